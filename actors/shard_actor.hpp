#pragma once
// The shard actor: owns one model::Shard (a layer range), its block pool, its
// SessionCacheStore and its StepScheduler as private state. Spawn it detached:
// its rounds run the model and must not starve CAF's scheduler.
//
// Steps are not run as they arrive. A step is checked (recipe, hop, shape,
// limits) and queued; the actor then sends itself (round_atom). Everything
// that arrived before that message is in the queue when it is handled, and one
// round runs what StepScheduler::pick() chooses as one batched forward pass:
// cache lookups, misses, duplicates, epochs and ownership are decided per
// sequence at that point, exactly as for a lone step. Each finished sequence is
// answered (tail: the sampled token) or handed to its next hop; a long input
// runs in pieces over several rounds. Steps that arrive during a round form
// the next one. A full queue answers ec::overloaded.
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
#include "actors/prefix_ids.hpp"
#include "actors/scheduler.hpp"
#include "model/transformer/shard.hpp"

#include <caf/all.hpp>

#include <functional>
#include <map>
#include <set>
#include <unordered_map>
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

/// The shard's own type: both interfaces plus its lease timer and its rounds.
using shard_impl_actor =
  msg::shard_full_actor::extend<caf::reacts_to<atom::tick_atom>, caf::reacts_to<atom::round_atom, uint64_t>>;

struct shard_state {
  using self_ptr = shard_impl_actor::stateful_pointer<shard_state>;
  ShardHooks hooks;
  RequestLimits request_limits;
  std::shared_ptr<model::Shard> shard;
  std::shared_ptr<model::BlockPool> pool;
  std::unique_ptr<SessionCacheStore> store;
  std::unique_ptr<StepScheduler> scheduler;
  bool round_pending = false; ///< a (round_atom, round_id) is on its way
  bool round_delayed = false; ///< ... by a timer (waiting for expected sessions)
  uint64_t round_id = 0;
  /// Sessions this shard answered (or passed on) in the last round, with when:
  /// their next steps are expected back.
  std::unordered_map<std::string, std::chrono::steady_clock::time_point> expected;
  double return_ms = -1; ///< how long an answered session takes to come back (moving average; -1: unknown)
  double round_ms = 0;   ///< how long a round's forward pass takes (moving average)
  bool colocated = false; ///< the newest route runs entirely on this machine
  int64_t colocated_epoch = -1; ///< the epoch `colocated` was computed for
  uint64_t rounds = 0, batched_rows = 0, max_batch = 0, overloaded = 0;
  uint64_t computed = 0, recomputed = 0; ///< layer-tokens (shard_stats)
  std::unique_ptr<PrefixIds> prefix_ids; ///< the head's keyed block ids (prefix_ids.hpp)
  msg::cache_recipe recipe;
  /// Sessions whose next request is desynchronised / duplicated (injection;
  /// at most max_injected each, further ones are refused).
  std::set<std::string> desync_next, dup_next;
  static constexpr std::size_t max_injected = 1024;
  uint64_t steps = 0;
  uint64_t duplicates = 0;
  std::chrono::milliseconds lease_period{1000};
  /// Sessions by the actor that opened them (their owner, monitored).
  std::map<caf::actor_addr, std::set<std::string>> owned;
  static inline const char* name = "strata.shard";

  /// Checks a step and queues it (or answers at once: errors, overloaded).
  caf::result<msg::step_reply> handle(self_ptr self, msg::step_request& req);
  /// Runs one round: the pieces the scheduler picks, as one batched forward.
  void round(self_ptr self);
  /// Hands a finished (or duplicate) step to the next hop, with the rows it needs.
  void pass_on(QueuedStep& q, const SessionCacheStore::Context& ctx);
  /// Arranges the next round: at once, or (when the sessions answered last round
  /// come back quickly compared with a round) after a short wait for them, so
  /// sessions of one shard stay in one batch instead of alternating rounds.
  void schedule_round(self_ptr self);
  /// A delayed round starts now when no expected session is still out.
  void start_early(self_ptr self);
  /// A session ended (released its caches): a round need not wait for it.
  void not_coming_back(self_ptr self, const std::string& session);
  /// Monitors `owner` (the sender of an opening step) and files `session` under it.
  void adopt(self_ptr self, const caf::strong_actor_ptr& owner, const std::string& session);
  /// `session` is no longer filed under any owner (released, expired, re-opened).
  void disown(const std::string& session);
  /// Files `session` in `set` (desync_next or dup_next); an error naming `what`
  /// when the session id is too long or the set is full.
  caf::result<void> inject_next(std::set<std::string>& set, const std::string& session, const char* what);
  msg::shard_stats stats() const;
};

shard_impl_actor::behavior_type shard_actor(shard_state::self_ptr self, std::shared_ptr<model::Shard> shard,
                                            StoreLimits limits, ShardHooks hooks, RequestLimits request_limits,
                                            std::chrono::milliseconds lease_period, SchedulerLimits sched);

/// Spawns a detached shard actor for `shard`. `lease_period` is how often
/// leases are swept (a session renews every lease_period / 2). The block pool
/// holds limits.max_bytes of cache.
msg::shard_full_actor spawn_shard(caf::actor_system& sys, std::shared_ptr<model::Shard> shard, StoreLimits limits = {},
                                  ShardHooks hooks = {}, RequestLimits request_limits = {},
                                  std::chrono::milliseconds lease_period = std::chrono::milliseconds(1000),
                                  SchedulerLimits sched = {});

} // namespace strata::actors
