#pragma once
// The session actor: one per generation. It holds the token history and the
// sampling state, asks the supervisor for a route, prefills, then decodes one
// token per step, streaming each token to its client. Every request has a
// deadline; failures are retried a bounded number of times with backoff, then
// the client gets a clear error. Its caches are released when it ends.
//
// Recovery is targeted: a step that fails is sent again under the same step id
// until it yields its token, and each resend names the hops that must rebuild
// their caches (step_request::rebuild): a hop that answered cache_miss for it
// (step_reply::miss_hop), and, after a route change, every hop whose shard or
// layer range is not one that held the session's state. Every other hop keeps
// its cache: one that already applied the step answers it as a duplicate, one
// that did not applies it. A rebuilt hop gets its input rows for every position
// from the hop before it, which keeps the rows it sent in its cache blocks; if
// that hop lost its cache too, it misses in turn and is rebuilt as well, up to
// the head, which rebuilds from the session's tokens (so everything lost is a
// full re-prefill). See docs/architecture.md for why the tokens cannot change.
//
// Identity and ownership: the session's id comes from msg::mint_session_id()
// (the request's, or minted here when empty); its session key is minted here and
// travels in every step, release and lease renewal, so no other actor can use
// or free its caches. While alive it renews its lease on every shard of its
// route every `lease_renew`.
//
// Interface: msg::session_actor (route_info from the supervisor; resume, cancel
// and register from the client). Client protocol: the client receives
// token_event (in order), then either a generation_result or a caf::error.
// After the token counts listed in the request's pause_after, the session waits
// for (resume_atom) before its next step, so a client can inject a failure at an
// exact step.
//
// Speculative decoding (req.speculate > 0): a decode step may carry proposed
// tokens after the newest one (prompt lookup, actors/speculation.hpp); the tail
// answers which it took and its own next token, and the session takes them all
// in order, as if they had come one step each. Proposals never reach past a
// pause point, max_tokens or the context, so a step ends at most where a plain
// one would. A resend carries the same proposals; a hop that rebuilds gets the
// accepted tokens only (the session never holds rejected ones). With a draft
// model (SessionOptions::drafter) the session asks it for the proposals before
// sending a step (still in the stepping phase; a route push asks again).
//
// Phases (one behavior each, switched with become):
//   routing     a route request is in flight        -> stepping (route), backing_off (error), end (no_route)
//   stepping    a step is in flight                 -> stepping (token, miss, route push), routing (push
//                                                      without a complete route), backing_off (error),
//                                                      paused (pause point), end (stop, length, context)
//   backing_off waiting out a delay after a failure -> routing (timer), stepping (route push; or the
//                                                      timer after ec::overloaded: the same route)
//   paused      waiting for the client's resume     -> stepping (resume), routing (resume without a route)
// (cancel_atom) ends every phase, and so does losing the supervisor for longer
// than `cluster_wait` (it is monitored; `register` brings a new one). An answer to a request that a later event
// superseded (a route push during a step, a timer after a push) is ignored: each
// phase knows the one request it waits for.

#include "actors/drafter.hpp"
#include "actors/speculation.hpp"
#include "messages/messages.hpp"
#include "model/text/token_mask.hpp"

#include <caf/all.hpp>

#include <chrono>
#include <map>
#include <optional>

namespace strata::actors {

struct SessionOptions {
  /// The least deadline of a step. The deadline in use adapts: it is at least
  /// `deadline_factor` times the step time observed so far (decode steps; per
  /// token for prefills), so a step slowed by a busy machine is not a failure.
  std::chrono::milliseconds step_timeout{10000};
  double deadline_factor = 8;
  /// Steps refused with ec::overloaded in a row before giving up (each waits
  /// `backoff`, doubled up to 32x).
  int max_overloaded = 200;
  /// Bounds a route request. The supervisor answers no_route after its own
  /// --route-wait-ms, so this only guards against a supervisor that stopped
  /// answering; it must be longer than any route wait.
  std::chrono::milliseconds route_timeout{120000};
  /// How long the session waits for another coordinator after its own went
  /// away (its client reconnects and sends `register`) while no token comes;
  /// then it ends with ec::cluster_lost. The coordinator's default route wait.
  std::chrono::milliseconds cluster_wait{10000};
  int max_retries = 8;                          ///< failed steps in a row before giving up
  std::chrono::milliseconds backoff{20};        ///< doubled per retry
  int64_t max_context = 0;                      ///< the model's max_seq_len
  std::chrono::milliseconds lease_renew{500};   ///< how often the shards' leases are renewed
  /// Speculative decoding with a draft model (actors/drafter.hpp): proposals
  /// come from it instead of prompt lookup. An invalid handle: lookup.
  drafter_actor drafter;
  std::chrono::milliseconds draft_timeout{5000}; ///< a slower answer: the step goes without proposals
  /// The tokenizer's vocabulary, for constrained decoding (generation_request::
  /// grammar); null: such requests are refused. Shared by every session of a
  /// process, with the grammars compiled over it.
  std::shared_ptr<model::TokenVocabulary> vocabulary;
};

enum class session_phase : uint8_t { routing, stepping, backing_off, paused, ended };
const char* to_string(session_phase p);

/// The session's own type: its interface plus its two timers.
using session_impl_actor =
  msg::session_actor::extend<caf::reacts_to<atom::retry_atom, uint64_t>, caf::reacts_to<atom::lease_atom>>;

struct session_state {
  msg::generation_request req;
  SessionOptions opts;
  msg::session_client_actor client;
  msg::supervisor_actor supervisor;
  msg::session_key key;
  session_phase phase = session_phase::routing;
  std::vector<int32_t> seq;       // prompt + generated
  std::map<int32_t, int32_t> penalty_counts; // with a penalty: prompt ids (0) and how often each id was generated
  float last_logprob = 0;          // the last reply's logprobs, for its token_event
  std::vector<int32_t> last_top_ids;
  std::vector<float> last_top_logprobs;
  msg::route_info route;
  bool prefilled = false;         // the prompt's prefill yielded its token (later steps decode)
  bool step_pending = false;      // a step was sent and has not yielded its token (resends keep its id)
  std::vector<msg::hop> kept_hops; // the hops that held all of seq[0, size-1) at the last token
  std::vector<msg::shard_actor> lost; // shards that missed the pending step (they rebuild)
  bool recovery_counted = false;  // the pending step is counted as a recovery
  uint64_t rng_state = 0;
  int64_t step_id = 0;
  uint64_t awaited = 0;           // tag of the one request (or timer) whose answer counts
  int failures = 0;               // consecutive
  int overloads = 0;              // consecutive ec::overloaded answers
  bool retry_step = false;        // backing off from overloaded: step again (no re-route)
  msg::step_request inflight;     // the step in flight (resent as is after a first timeout)
  bool resent = false;            // the step in flight is already a resend
  double decode_ms = 0;           // observed decode step time (moving average)
  double prefill_ms_per_token = 0;
  msg::generation_result result;
  std::chrono::steady_clock::time_point started;
  bool first_token_seen = false;
  std::vector<msg::shard_actor> avoid; // shards this session could not reach (asks routes without them)
  std::vector<int32_t> draft;     // the pending step's proposals (speculative decoding; kept for its resends)
  DraftControl drafting;          // how many to propose (req.speculate: the most)
  bool drafted = false;           // the pending step's proposals are chosen (a draft model answers asynchronously)
  double draft_ms = 0;            // how long the draft model took to propose them (part of the step's cost)
  std::shared_ptr<model::ConstraintMatcher> constraint; // req.grammar's state after the generated tokens
  std::optional<std::chrono::steady_clock::time_point> supervisor_lost; // when the supervisor went down
  std::chrono::steady_clock::time_point last_token_at;                  // when the last token came
  static inline const char* name = "strata.session";
};

using session_self = session_impl_actor::stateful_pointer<session_state>;

session_impl_actor::behavior_type session(session_self self, msg::supervisor_actor supervisor, msg::session_client_actor client,
                                          msg::generation_request req, SessionOptions opts);

/// Spawns a session for `client` (which receives token_event, then a
/// generation_result or an error).
msg::session_actor spawn_session(caf::actor_system& sys, msg::supervisor_actor supervisor, msg::session_client_actor client,
                                 msg::generation_request req, SessionOptions opts);

} // namespace strata::actors
