#pragma once
// The drafter: a small model in the session's own process that proposes the
// next tokens for speculative decoding (`--draft-model FILE` on generate and
// serve). One detached actor owns the draft model (a whole-model Shard) and a
// KV cache per session; sessions ask it for proposals before each step.
//
//   (propose_atom, session, seq, k) -> up to k tokens the draft model would
//       generate greedily after `seq` (prompt + accepted tokens). Its cache
//       keeps what it computed: the next request reuses the longest common
//       prefix (accepted proposals included) and computes only the rest.
//   (release_atom, session)       -> drops that session's cache.
//   (stats_atom)                  -> proposals made, positions computed,
//       batched passes run, requests declined (the crowd), sessions drafting now.
//
// Requests are answered in rounds, as a shard's steps are: a request is queued
// and the actor sends itself (round_atom); every request that arrived by then
// runs together, one batched forward pass of the draft model a token
// (Shard::forward over all their sequences), instead of one pass a session a
// token. With many sessions the draft's cost per pass is shared, as the
// shards' is. A batch gives each sequence the bits it gets alone, so a
// proposal does not depend on who else asked.
//
// A crowd turns the draft off (vLLM's disable-by-batch-size): while more
// sessions draft at once than DrafterLimits::max_crowd (--draft-max-sessions),
// every request is answered at once with no proposals, and those sessions
// step plainly until fewer draft. On one machine a crowd already fills the
// shards' rounds, and proposals that are mostly refused only cost them (a
// weak draft with 32 sessions at 0 ms: 0.80-0.91x plain); across a network a
// crowd still gains from it (raise the limit there). A session drafts from
// its first request until it releases (or goes quiet for `crowd_idle`).
//
// The draft must share the model's tokenizer (the same vocabulary size is
// checked when it loads). Its proposals are greedy, so a proposal is certain
// and the tail's verification (model::Sampler::verify) keeps the model's
// output exactly (greedy) or its distribution (sampling). A drafter that fails
// or is slow only costs the step its proposals: the session steps without.

#include "messages/messages.hpp"
#include "model/transformer/shard.hpp"

#include <caf/all.hpp>
#include <caf/typed_response_promise.hpp>

#include <chrono>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace strata::actors {

using drafter_actor =
  caf::typed_actor<caf::replies_to<atom::propose_atom, std::string, std::vector<int32_t>, uint32_t>::with<std::vector<int32_t>>,
                   caf::reacts_to<atom::release_atom, std::string>, caf::reacts_to<atom::round_atom>,
                   caf::replies_to<atom::stats_atom>::with<uint64_t, uint64_t, uint64_t, uint64_t, uint64_t>>;

struct DrafterLimits {
  std::size_t cache_bytes = std::size_t{256} << 20; ///< the draft's KV pool
  std::size_t max_sessions = 64;                    ///< least recently used ones go first
  /// More sessions drafting at once than this: requests get no proposals
  /// (0: no limit).
  std::size_t max_crowd = 1;
  /// A session that has not asked for this long no longer counts as drafting.
  std::chrono::milliseconds crowd_idle{30000};
};

struct drafter_state {
  std::shared_ptr<model::Shard> model;
  std::shared_ptr<model::BlockPool> pool;
  DrafterLimits limits;
  struct Entry {
    std::string session;
    model::KVCache cache;
    std::vector<int32_t> tokens; // what the cache holds, position by position
  };
  std::list<Entry> lru; // front: most recently used
  std::unordered_map<std::string, std::list<Entry>::iterator> index;
  /// Proposals made, positions computed, batched forward passes run,
  /// requests declined because of the crowd.
  uint64_t proposals = 0, computed = 0, passes = 0, declined = 0;
  /// The sessions drafting now (asked, not released), with when each last asked.
  std::unordered_map<std::string, std::chrono::steady_clock::time_point> drafting;
  /// Notes that `session` asks at `now`; true when the crowd is over limits.max_crowd.
  bool crowded(const std::string& session, std::chrono::steady_clock::time_point now);
  /// The sessions drafting at `now`: those idle past limits.crowd_idle are forgotten.
  std::size_t crowd(std::chrono::steady_clock::time_point now);

  struct Request {
    std::string session;
    std::vector<int32_t> seq; ///< prompt + accepted tokens
    uint32_t k = 0;
  };
  struct Answer {
    std::vector<int32_t> tokens;
    std::optional<model::Error> error; ///< set: no proposal (that session's cache was dropped)
  };
  /// Greedy proposals for every request, all of them in one batched forward
  /// pass a token (a session asking twice is served in a second batch after
  /// its first). A request that fails gets its error; the others go on.
  std::vector<Answer> propose_all(const std::vector<Request>& requests);
  /// One request alone (throws model::Error on bad input).
  std::vector<int32_t> propose(const std::string& session, const std::vector<int32_t>& seq, uint32_t k);
  /// Drops the least recently used session not in `keep`; false when none is left.
  bool evict_outside(const std::unordered_set<std::string>& keep);
  /// Drops one session's draft cache (released, or its request failed).
  void drop(const std::string& session);

  /// Requests waiting for the next round, and whether a round_atom is on its way.
  std::vector<std::pair<Request, caf::typed_response_promise<std::vector<int32_t>>>> queued;
  bool round_pending = false;
  static inline const char* name = "strata.drafter";
};

using drafter_self = drafter_actor::stateful_pointer<drafter_state>;

drafter_actor::behavior_type drafter(drafter_self self, std::shared_ptr<model::Shard> model, DrafterLimits limits);

/// Loads `path` as a whole model and spawns its drafter (detached). Throws
/// model::Error naming the file when it cannot load, or when its vocabulary
/// is not `vocab_size` (0: not checked).
drafter_actor spawn_drafter(caf::actor_system& sys, const std::string& path, int64_t vocab_size,
                            const model::LoadOptions& load = {}, DrafterLimits limits = {});
/// The same for a draft model already loaded (a whole model).
drafter_actor spawn_drafter(caf::actor_system& sys, std::shared_ptr<model::Shard> draft, int64_t vocab_size,
                            DrafterLimits limits = {});

} // namespace strata::actors
