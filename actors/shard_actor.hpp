#pragma once
// The shard actor: owns one model::Shard (a layer range) and its
// SessionCacheStore as private state. Spawn it detached: its handlers run the
// model and must not starve the scheduler.
//
// Interfaces (messages/messages.hpp): msg::shard_actor for sessions and the
// supervisor (step, release, lease, stats) and msg::shard_injection_actor for
// failure injection; the actor implements both (msg::shard_full_actor).
//
// Ownership: the first step that opens a session id binds it to the step's
// session key; the shard also monitors that step's sender (the session actor)
// and drops all of its sessions when it goes down (the client process died or
// the session ended without releasing). Where no down message can arrive (a
// session reached through a relay), the lease does it: a context that no step or
// (lease_atom) renewed for `lease_missed` lease periods is dropped.

#include "actors/cache_store.hpp"

#include <caf/all.hpp>

#include <functional>
#include <map>
#include <set>
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

/// The shard's own type: both interfaces plus its lease timer.
using shard_impl_actor = msg::shard_full_actor::extend<caf::reacts_to<atom::tick_atom>>;

struct shard_state {
  using self_ptr = shard_impl_actor::stateful_pointer<shard_state>;
  ShardHooks hooks;
  RequestLimits request_limits;
  std::shared_ptr<model::Shard> shard;
  std::unique_ptr<SessionCacheStore> store;
  msg::cache_recipe recipe;
  bool desync_next = false;
  bool dup_next = false;
  uint64_t steps = 0;
  uint64_t duplicates = 0;
  std::chrono::milliseconds lease_period{1000};
  /// Sessions by the actor that opened them (their owner, monitored).
  std::map<caf::actor_addr, std::set<std::string>> owned;
  static inline const char* name = "strata.shard";

  caf::result<msg::step_reply> handle(self_ptr self, msg::step_request& req);
  /// Monitors the sender of an opening step and files `session` under it.
  void adopt(self_ptr self, const std::string& session);
  /// `session` is no longer filed under any owner (released, expired, re-opened).
  void disown(const std::string& session);
  msg::shard_stats stats() const;
};

shard_impl_actor::behavior_type shard_actor(shard_state::self_ptr self, std::shared_ptr<model::Shard> shard,
                                                StoreLimits limits, ShardHooks hooks, RequestLimits request_limits,
                                                std::chrono::milliseconds lease_period);

/// Spawns a detached shard actor for `shard`. `lease_period` is how often
/// leases are swept (a session renews every lease_period / 2).
msg::shard_full_actor spawn_shard(caf::actor_system& sys, std::shared_ptr<model::Shard> shard, StoreLimits limits = {},
                       ShardHooks hooks = {}, RequestLimits request_limits = {},
                                  std::chrono::milliseconds lease_period = std::chrono::milliseconds(1000));

} // namespace strata::actors
