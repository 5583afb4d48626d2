#pragma once
// SessionCacheStore: the per-shard map from (session id, route epoch) to an
// isolated KV cache for the shard's own layers. A plain class; the shard actor
// owns one as private state.
//
// Rules:
// * bounded by the shard's block pool (sized by the byte budget), a session cap
//   and an idle TTL, with LRU eviction; the session being served, and any the
//   caller pins (the other members of a batch being formed), are never victims;
//   a session that alone needs more blocks than the whole pool is a budget error;
// * a lookup returns the context or a miss with a reason; a bounded history of
//   recent misses tells a later lookup why the state is gone;
// * an epoch older than the newest seen for the session is stale (an error);
// * ownership: a session id is bound to the session key of the step that first
//   opened it; a step, release or lease renewal with another key is refused
//   (ec::session_conflict) before anything of the owner's is read or changed;
//   the binding is remembered as long as the session's epoch is;
// * leases: every step or renewal marks a context as alive; lease_sweep() (run
//   by the shard every lease period) drops contexts that were not marked in
//   `lease_missed` sweeps in a row (their owner died without releasing);
// * the clock is injectable; counters are exposed for metrics.

#include "messages/messages.hpp"
#include "model/transformer/kv_cache.hpp"

#include <chrono>
#include <deque>
#include <functional>
#include <list>
#include <string>
#include <unordered_map>

namespace strata::actors {

struct StoreLimits {
  std::size_t max_bytes = std::size_t{1} << 30;
  std::size_t max_sessions = 64;
  std::chrono::milliseconds ttl{10 * 60 * 1000};
  std::size_t history = 4096; ///< remembered misses and epochs
  int lease_missed = 3;       ///< sweeps without a renewal before a context is dropped (0 = no leases)
  bool prefix_cache = true;   ///< share full blocks between sessions (model/kv_cache.hpp)
};

struct StoreCounters {
  uint64_t hits = 0;
  uint64_t misses[msg::miss_reason_count] = {};
  uint64_t evictions_lru = 0;
  uint64_t evictions_ttl = 0;
  uint64_t stale = 0;
  uint64_t budget_errors = 0;
  uint64_t conflicts = 0; ///< refused: another owner's session id
  uint64_t orphans = 0;   ///< dropped: the owner ended or its lease ran out
  uint64_t prefix_hit_tokens = 0; ///< positions adopted from the prefix cache
  uint64_t rolled_back = 0;       ///< positions of rejected proposals cut from caches
};

class SessionCacheStore {
public:
  using clock = std::chrono::steady_clock;
  using now_fn = std::function<clock::time_point()>;

  struct Context {
    std::string session;
    int64_t epoch = 0;
    model::KVCache cache;
    clock::time_point last_used;
    // The last applied step, so that a duplicate can be recognised and replayed.
    int64_t last_step = -1;
    int64_t last_past_len = -1;
    /// Positions the last step made certain: the cache may hold more (proposed
    /// tokens of a speculative step, see msg::step_request::draft), which a
    /// next step cuts back to its past_len, never below this.
    int64_t certain = 0;
    uint64_t rolled_back = 0;       // positions cut back so far (rejected proposals)
    msg::step_reply replay_reply;   // tail: what the step answered (other shards replay from their kept rows)
    bool renewed = true;            // a step or lease renewal since the last sweep
    int missed = 0;                 // sweeps in a row without one
    // The prefix cache: block ids of the full blocks (as far as known), how many
    // of the blocks were published or adopted, and (head only) the tokens.
    std::vector<model::BlockId> ids;
    std::size_t published = 0;
    std::vector<int32_t> tokens;
  };

  /// What a lookup found.
  struct Lookup {
    Context* ctx = nullptr;  ///< set on success
    bool duplicate = false;  ///< ctx already applied this very step
    msg::miss_reason miss{}; ///< set when ctx is null and err is empty
    std::string detail;
    caf::error err; ///< stale epoch or session_conflict
  };

  /// Caches live in `pool` (whose capacity is the budget; limits.max_bytes is
  /// not consulted again).
  SessionCacheStore(StoreLimits limits, std::shared_ptr<model::BlockPool> pool,
                    now_fn now = [] { return clock::now(); });

  using pin_fn = std::function<bool(const Context&)>;
  /// Prefill or rebuild: opens a fresh context for (session, epoch) owned by
  /// `key`, replacing any older one of the same owner; a context that already
  /// applied `step_id` (at this epoch or an older one) is a duplicate
  /// (answered, not re-opened).
  /// The session cap evicts the least recently used others, never pinned ones.
  Lookup open(const std::string& session, const msg::session_key& key, int64_t epoch, int64_t step_id = -1,
              const pin_fn& pinned = {});
  /// Decode: the context that must hold exactly `past_len` tokens (one that
  /// holds more, all past its `certain` positions, is cut back to past_len for a
  /// new step: rejected proposals). A context
  /// built at an older epoch is carried into this one (the session keeps a hop
  /// whose shard and layers did not change; the length check still applies).
  Lookup find(const std::string& session, const msg::session_key& key, int64_t epoch, int64_t past_len,
              int64_t step_id);
  /// Takes the pool blocks `ctx` needs to grow to `tokens` tokens, evicting other
  /// sessions (LRU) while the pool has too few free. Contexts for which `pinned`
  /// says true are not evicted; when only they could make room the result is
  /// ec::overloaded and nothing changed (the caller retries later). A context
  /// that alone needs more than the whole pool is dropped and the result is
  /// ec::budget_exceeded.
  caf::error reserve(Context& ctx, int64_t tokens, const pin_fn& pinned = {});
  /// Records that `ctx` applied step `step_id` at `past_len`, the last `draft`
  /// of its positions proposals, and publishes its newly full blocks whose ids
  /// are known in the prefix cache (none holding a proposal).
  void committed(Context& ctx, int64_t step_id, int64_t past_len, int64_t draft = 0);
  /// A freshly opened `ctx` takes the longest run of published blocks named by
  /// ctx.ids that ends at most at `limit` positions. Returns the positions taken.
  int64_t share_prefix(Context& ctx, int64_t limit);
  /// Drops a context because its session is done (later lookups: released).
  /// ec::session_conflict (and nothing dropped) when `key` is not the owner's.
  caf::error release(const std::string& session, const msg::session_key& key);
  /// Marks the session's context alive; session_conflict for another key.
  caf::error renew(const std::string& session, const msg::session_key& key);
  /// Drops a context whose owner is gone (counted as an orphan; later lookups: released).
  void orphan(const std::string& session);
  /// One lease period passed: drops contexts not renewed in `lease_missed`
  /// sweeps in a row; returns their session ids.
  std::vector<std::string> lease_sweep();
  /// Drops a context and remembers `reason` (failure injection, operator evict).
  void evict(const std::string& session, msg::miss_reason reason);
  /// Drops every context with `reason`.
  void evict_all(msg::miss_reason reason);
  /// Drops a context and forgets it ever existed (later lookups: unknown_session).
  void forget(const std::string& session);
  /// Evicts contexts idle for longer than the TTL (except `keep`).
  void expire(const Context* keep = nullptr);

  /// Bytes of the pool's blocks in use.
  std::size_t bytes() const;
  const model::BlockPool& pool() const { return *pool_; }
  std::size_t sessions() const { return index_.size(); }
  const StoreCounters& counters() const { return counters_; }
  const StoreLimits& limits() const { return limits_; }
  bool contains(const std::string& session) const { return index_.count(session) != 0; }

private:
  using list_type = std::list<Context>;
  Lookup miss(const std::string& session, msg::miss_reason why, std::string detail);
  void drop(list_type::iterator it, msg::miss_reason why);
  void remember(const std::string& session, msg::miss_reason why);
  bool check_epoch(const std::string& session, int64_t epoch, Lookup& out);
  caf::error check_owner(const std::string& session, const msg::session_key& key);
  void touch(list_type::iterator it);

  StoreLimits limits_;
  std::shared_ptr<model::BlockPool> pool_;
  now_fn now_;
  list_type lru_; // front = most recently used
  std::unordered_map<std::string, list_type::iterator> index_;
  // Bounded memories: why a session's state went away, and its newest epoch.
  std::unordered_map<std::string, msg::miss_reason> why_gone_;
  std::unordered_map<std::string, int64_t> newest_epoch_;
  std::unordered_map<std::string, msg::session_key> owner_;
  std::deque<std::string> memory_order_;
  StoreCounters counters_;
};

} // namespace strata::actors
