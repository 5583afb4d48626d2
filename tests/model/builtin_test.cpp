// builtin:tiny is deterministic, loads per range, and its cache grows in blocks.

#include "model/base/error.hpp"
#include "model/transformer/shard.hpp"
#include "tests/support.hpp"

namespace strata {
namespace {

TEST(Builtin, TinyIsDeterministicAcrossLoads) {
  auto a = model::Shard::load("builtin:tiny");
  auto b = model::Shard::load("builtin:tiny");
  auto ca = a->new_cache(), cb = b->new_cache();
  std::vector<int32_t> t = {1, 72, 105};
  auto la = a->forward(t, model::consecutive_positions(0, 3), ca).logits;
  auto lb = b->forward(t, model::consecutive_positions(0, 3), cb).logits;
  EXPECT_EQ(la, lb);
  EXPECT_EQ(a->config().vocab_size, 259);
  EXPECT_EQ(a->config().n_kv_heads, 2);
  EXPECT_FALSE(a->config().tied_embeddings);
}

TEST(Builtin, CacheGrowsInBlocksWithoutCopying) {
  auto s = model::Shard::load("builtin:tiny", {0, 4});
  auto c = s->new_cache();
  EXPECT_EQ(c.bytes(), 0u);
  const std::size_t block = 5 * 2 * model::BlockPool::block_tokens * s->config().kv_dim() * sizeof(float);
  std::vector<int32_t> one = {7};
  for (int64_t n = 1; n <= 70; ++n) {
    s->forward(one, model::consecutive_positions(n - 1, 1), c);
    const auto blocks = static_cast<std::size_t>((n + model::BlockPool::block_tokens - 1) / model::BlockPool::block_tokens);
    ASSERT_EQ(c.bytes(), blocks * block) << n;
    ASSERT_EQ(c.seq_len(), n);
  }
  c.truncate(10);
  EXPECT_EQ(c.seq_len(), 10);
  EXPECT_EQ(c.bytes(), block);
}

TEST(Builtin, TruncatedCacheRecomputesTheSame) {
  auto s = model::Shard::load("builtin:tiny");
  auto c = s->new_cache();
  std::vector<int32_t> t = {1, 50, 60, 70, 80};
  s->forward(t, model::consecutive_positions(0, 5), c);
  c.truncate(3);
  std::vector<int32_t> tail = {70, 80};
  auto again = s->forward(tail, model::consecutive_positions(3, 2), c).logits;
  auto fresh = s->new_cache();
  auto ref = s->forward(t, model::consecutive_positions(0, 5), fresh).logits;
  ASSERT_EQ(again.size(), ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i)
    EXPECT_NEAR(again[i], ref[i], 1e-5);
}

} // namespace
} // namespace strata
