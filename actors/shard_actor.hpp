#pragma once
// The shard actor: owns one model::Shard (a layer range) and its
// SessionCacheStore as private state. Spawn it detached: its handlers run the
// model and must not starve the scheduler.
//
// Interface (untyped actor):
//   step_request            -> step_reply (tail token or cache_miss) | error;
//                              non-tail shards forward along the request's route
//                              (delegation: the tail answers the session directly)
//   (release_atom, session) -> drops the session's cache
//   (stats_atom)            -> shard_stats
//   (evict_atom, session, uint8 reason)  -> drops the session's cache, or every
//                              session's when `session` is empty (injection)
//   (desync_atom)           -> the next request is treated as carrying a wrong past_len
//   (dup_atom)              -> the next decode request is delivered twice
//   (crash_atom), (freeze_atom, int64 ms) -> process-level failures; only a node
//                              process provides them (ShardHooks), else an error

#include "actors/cache_store.hpp"

#include <caf/all.hpp>

#include <functional>
#include <memory>

namespace strata::actors {

/// Process-level failure injection, provided by a node process.
struct ShardHooks {
  std::function<void()> crash;            ///< exit abruptly, like kill -9
  std::function<void(int64_t ms)> freeze; ///< stop answering for a while (SIGSTOP)
};

/// What one step request may carry; larger requests are refused with
/// ec::bad_request naming the limit (before any compute or cache is touched).
struct RequestLimits {
  int64_t max_step_tokens = 0;                    ///< tokens in one step (0 = the model's context)
  std::size_t max_message_bytes = 64u << 20;      ///< tokens + positions + hidden state
};

struct shard_state {
  ShardHooks hooks;
  RequestLimits request_limits;
  std::shared_ptr<model::Shard> shard;
  std::unique_ptr<SessionCacheStore> store;
  msg::cache_recipe recipe;
  bool desync_next = false;
  bool dup_next = false;
  uint64_t steps = 0;
  uint64_t duplicates = 0;
  static inline const char* name = "strata.shard";

  caf::result<msg::step_reply> handle(caf::stateful_actor<shard_state>* self, msg::step_request& req);
  msg::shard_stats stats() const;
};

caf::behavior shard_actor(caf::stateful_actor<shard_state>* self, std::shared_ptr<model::Shard> shard,
                          StoreLimits limits, ShardHooks hooks, RequestLimits request_limits);

/// Spawns a detached shard actor for `shard`.
caf::actor spawn_shard(caf::actor_system& sys, std::shared_ptr<model::Shard> shard, StoreLimits limits = {},
                       ShardHooks hooks = {}, RequestLimits request_limits = {});

} // namespace strata::actors
