#pragma once
// The session actor: one per generation, with a stable id. It holds the token
// history and sampling state, asks the supervisor for a route, prefills, then
// decodes one token per step, streaming each token to its client. On a
// cache_miss it re-prefills the prompt-so-far under the same id; on a route
// change (epoch bump) it takes the new route and re-prefills. Every step has a
// deadline; failures are retried a bounded number of times with backoff, then
// the client gets a clear error. Its caches are released when it ends.
//
// Client protocol: the client receives token_event (in order), then either a
// generation_result or a caf::error. (cancel_atom) from anyone ends it early.
// After the token counts listed in the request's pause_after, the session waits
// for (resume_atom) before its next step, so a client can inject a failure at
// an exact step.
//
// (register_atom, supervisor) hands the session a new supervisor (the client
// reconnected after a coordinator restart); it subscribes there and goes on.
//
// Phases are behaviors: `routing` (waiting for a route), `stepping` (a step in
// flight); the route_info and cancel handlers are shared.

#include "messages/messages.hpp"

#include <caf/all.hpp>

#include <chrono>

namespace strata::actors {

struct SessionOptions {
  std::chrono::milliseconds step_timeout{10000};
  std::chrono::milliseconds route_timeout{10000};
  int max_retries = 8;                       ///< failed steps in a row before giving up
  std::chrono::milliseconds backoff{20};     ///< doubled per retry
  int64_t max_context = 0;                   ///< the model's max_seq_len
};

struct session_state {
  msg::generation_request req;
  SessionOptions opts;
  caf::actor client;
  caf::actor supervisor;
  std::vector<int32_t> seq;       // prompt + generated
  msg::route_info route;
  bool needs_prefill = true;
  uint64_t rng_state = 0;
  int64_t step_id = 0;
  uint64_t attempt = 0;           // replies to older attempts are ignored
  int failures = 0;               // consecutive
  msg::generation_result result;
  std::chrono::steady_clock::time_point started;
  bool first_token_seen = false;
  bool paused = false;
  std::vector<caf::actor> avoid; // shards this session could not reach (asks routes without them)
  static inline const char* name = "strata.session";
};

caf::behavior session_actor(caf::stateful_actor<session_state>* self, caf::actor supervisor, caf::actor client,
                            msg::generation_request req, SessionOptions opts);

} // namespace strata::actors
