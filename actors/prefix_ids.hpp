#pragma once
// The identities of full KV blocks for the prefix cache (model/kv_cache.hpp).
//
// Block b of a sequence is named by a hash chain: id(b) = H(id(b-1), tokens of
// block b), with id(-1) = H(cache recipe). Two sequences whose first b+1 blocks
// hold the same tokens get the same id(b), and no other block does (128 bits).
// H is SipHash-2-4 with 128-bit output, keyed by a secret that only the head
// shard holds: a client never sees a block id and cannot make one, so it cannot
// file its own blocks under the id of another session's prefix on any shard.
// The head makes the ids from the tokens it is sent; later shards, which never
// see tokens, learn them from the step (step_request::blocks).

#include "messages/messages.hpp"
#include "model/transformer/kv_cache.hpp"

#include <cstdint>
#include <span>
#include <vector>

namespace strata::actors {

/// SipHash-2-4 of `bytes` under key (k0, k1): 64-bit output, or, with `wide`,
/// the 128-bit variant (hi = first word).
model::BlockId siphash24(uint64_t k0, uint64_t k1, std::span<const uint8_t> bytes, bool wide = true);

class PrefixIds {
public:
  /// A fresh random key.
  explicit PrefixIds(const msg::cache_recipe& recipe);
  PrefixIds(const msg::cache_recipe& recipe, uint64_t k0, uint64_t k1);

  /// The id of the block after `prev` (nullptr: the first block) holding `tokens`
  /// (block_tokens of them).
  model::BlockId next(const model::BlockId* prev, std::span<const int32_t> tokens) const;
  /// Extends `ids` (ids of the first ids.size() blocks of `tokens`) over every
  /// full block of `tokens`.
  void extend(std::vector<model::BlockId>& ids, std::span<const int32_t> tokens) const;

private:
  uint64_t k0_, k1_;
  model::BlockId seed_;
};

/// ids[from, to) as step_request::blocks words.
std::vector<uint64_t> to_words(const std::vector<model::BlockId>& ids, std::size_t from, std::size_t to);

} // namespace strata::actors
