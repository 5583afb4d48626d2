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
//
// The draft must share the model's tokenizer (the same vocabulary size is
// checked when it loads). Its proposals are greedy, so a proposal is certain
// and the tail's verification (model::Sampler::verify) keeps the model's
// output exactly (greedy) or its distribution (sampling). A drafter that fails
// or is slow only costs the step its proposals: the session steps without.

#include "messages/messages.hpp"
#include "model/transformer/shard.hpp"

#include <caf/all.hpp>

#include <list>
#include <memory>
#include <string>
#include <unordered_map>

namespace strata::actors {

using drafter_actor =
  caf::typed_actor<caf::replies_to<atom::propose_atom, std::string, std::vector<int32_t>, uint32_t>::with<std::vector<int32_t>>,
                   caf::reacts_to<atom::release_atom, std::string>>;

struct DrafterLimits {
  std::size_t cache_bytes = std::size_t{256} << 20; ///< the draft's KV pool
  std::size_t max_sessions = 64;                    ///< least recently used ones go first
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
  uint64_t proposals = 0, computed = 0;
  /// Greedy proposals after `seq` (throws model::Error on bad input).
  std::vector<int32_t> propose(const std::string& session, const std::vector<int32_t>& seq, uint32_t k);
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
