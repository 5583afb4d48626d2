// The block pool's prefix cache: published blocks are shared by reference
// count and counted once; a block in use is never reclaimed; unused published
// blocks are reclaimed least recently released first; turning the cache off
// frees them.

#include "model/transformer/kv_cache.hpp"
#include "model/base/error.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <set>
#include <vector>

namespace strata::model {
namespace {

// A row of an f32 KV cache.
float* f32(uint8_t* p) {
  return reinterpret_cast<float*>(p);
}

constexpr auto bt = BlockPool::block_tokens;

std::shared_ptr<BlockPool> pool_of(int64_t blocks) {
  return std::make_shared<BlockPool>(CacheShape{2, 4, 8}, blocks);
}

// A cache of `blocks` full blocks, each filled with `tag` and published as (tag, b).
KVCache filled(const std::shared_ptr<BlockPool>& pool, int64_t blocks, uint64_t tag) {
  KVCache c(pool);
  EXPECT_TRUE(c.reserve(blocks * bt));
  for (int64_t p = 0; p < blocks * bt; ++p)
    *c.view().out(p) = static_cast<float>(tag);
  c.commit(blocks * bt);
  for (int64_t b = 0; b < blocks; ++b)
    EXPECT_TRUE(pool->publish(c.table()[static_cast<std::size_t>(b)], BlockId{tag, static_cast<uint64_t>(b)}));
  return c;
}

TEST(BlockPool, EachKvHeadsRowsOfABlockLieTogether) {
  // 2 layers, 3 kv heads of 32 values, f16: a head's 32 positions of a block are
  // one run of 32 x 64 bytes; per layer the slab's blocks' runs of head 0's
  // keys side by side, then head 1's, head 2's, then the values alike.
  CacheShape shape{2, 96, 0, {}, 0, WType::f16, 32};
  auto pool = std::make_shared<BlockPool>(shape, 4);
  const std::size_t hb = 32 * 2;
  EXPECT_EQ(pool->head_row_bytes(), hb);
  EXPECT_EQ(pool->block_bytes(), 2u * 2 * bt * 96 * 2);
  for (int64_t l = 0; l < 2; ++l)
    for (int64_t g = 0; g < 3; ++g)
      for (int64_t slot = 0; slot < bt; ++slot) {
        const std::size_t k = pool->k_offset(l, slot, g), v = pool->v_offset(l, slot, g);
        // (the pool's 4 blocks fit one slab: a layer's part of a block is 4
        // blocks' keys and values from the next layer's, a head's run 4 runs
        // from the next head's)
        EXPECT_EQ(k, static_cast<std::size_t>(l) * 4 * (2 * 3 * bt * hb) + static_cast<std::size_t>(g) * 4 * bt * hb +
                       static_cast<std::size_t>(slot) * hb);
        EXPECT_EQ(v, k + 3 * 4 * bt * hb);
      }
  // Every (layer, k|v, head, position) of a sequence has bytes of its own.
  KVCache c(pool);
  ASSERT_TRUE(c.reserve(2 * bt));
  const KVView view = c.view();
  std::set<const uint8_t*> starts;
  for (int64_t l = 0; l < 2; ++l)
    for (int64_t p = 0; p < 2 * bt; ++p)
      for (int64_t g = 0; g < 3; ++g) {
        EXPECT_TRUE(starts.insert(view.k(l, p, g)).second);
        EXPECT_TRUE(starts.insert(view.v(l, p, g)).second);
      }
  // A width that is not whole heads, and a q8_0 head that is not whole blocks of 32, are refused.
  EXPECT_THROW(BlockPool(CacheShape{1, 96, 0, {}, 0, WType::f32, 64}, 1), Error);
  EXPECT_THROW(BlockPool(CacheShape{1, 96, 0, {}, 0, WType::q8_0, 48}, 1), Error);
  EXPECT_NO_THROW(BlockPool(CacheShape{1, 96, 0, {}, 0, WType::q8_0, 32}, 1));
}

TEST(BlockPool, BlocksOfSeveralSlabsLieLayerByLayerHeadByHeadAndNeverOverlap) {
  // 2 layers, 8 kv heads of 512 f16 values and 1,024-wide output rows: a block
  // is 2 x 512 KB of keys and values and 128 KB of output rows, so a slab of
  // about 32 MB holds 28 blocks, and 60 blocks take three slabs.
  CacheShape shape{2, 4096, 1024, {}, 0, WType::f16, 512};
  auto pool = std::make_shared<BlockPool>(shape, 60);
  const std::size_t layer = 2 * bt * 4096 * 2, out = bt * 1024 * sizeof(float);
  const std::size_t run = bt * 512 * 2; // one kv head's keys (values) of one block
  ASSERT_EQ(pool->block_bytes(), 2 * layer + out);
  ASSERT_EQ(pool->slab_blocks(), (std::size_t{32} << 20) / (2 * layer + out));
  ASSERT_LT(pool->slab_blocks(), 30u);
  KVCache c(pool);
  ASSERT_TRUE(c.reserve(60 * bt));
  const KVView view = c.view();
  // Blocks taken one after another lie side by side in each layer and kv head,
  // within a slab: a head's keys (values) of a sequence's blocks are one run
  // of memory, which a decode step reads from start to end.
  for (std::size_t b = 1; b < 60; ++b)
    if (b % pool->slab_blocks() != 0) {
      EXPECT_EQ(view.blocks[b] - view.blocks[b - 1], static_cast<std::ptrdiff_t>(run));
      EXPECT_EQ(view.out_blocks[b] - view.out_blocks[b - 1], static_cast<std::ptrdiff_t>(out));
      const auto pos = static_cast<int64_t>(b) * bt;
      for (int64_t l = 0; l < 2; ++l)
        for (int64_t g = 0; g < 8; g += 7) {
          EXPECT_EQ(view.k(l, pos, g) - view.k(l, pos - bt, g), static_cast<std::ptrdiff_t>(run));
          EXPECT_EQ(view.v(l, pos, g) - view.v(l, pos - bt, g), static_cast<std::ptrdiff_t>(run));
        }
    }
  // A slab's keys of head g + 1 follow its blocks' keys of head g, its values
  // follow the keys of the last head.
  const auto S = static_cast<std::ptrdiff_t>(pool->slab_blocks() * run);
  EXPECT_EQ(view.k(0, 0, 1) - view.k(0, 0, 0), S);
  EXPECT_EQ(view.v(0, 0, 0) - view.k(0, 0, 7), S);
  EXPECT_EQ(view.k(1, 0, 0) - view.k(0, 0, 0), 16 * S);
  // Each block's keys and values of every head and layer, and its output rows:
  // a tag of their own in every byte, written all first and read back after,
  // so that any two regions that shared a byte would show it.
  struct Region {
    uint8_t* at;
    std::size_t bytes;
  };
  std::vector<Region> regions;
  for (int64_t b = 0; b < 60; ++b) {
    for (int64_t l = 0; l < 2; ++l)
      for (int64_t g = 0; g < 8; ++g) {
        regions.push_back({view.k(l, b * bt, g), run});
        regions.push_back({view.v(l, b * bt, g), run});
      }
    regions.push_back({reinterpret_cast<uint8_t*>(view.out(b * bt)), out});
  }
  for (std::size_t r = 0; r < regions.size(); ++r) {
    auto* p = reinterpret_cast<uint16_t*>(regions[r].at);
    std::fill(p, p + regions[r].bytes / 2, static_cast<uint16_t>(r));
  }
  for (std::size_t r = 0; r < regions.size(); ++r) {
    const auto* p = reinterpret_cast<const uint16_t*>(regions[r].at);
    EXPECT_TRUE(std::all_of(p, p + regions[r].bytes / 2, [&](uint16_t x) { return x == r; })) << "region " << r;
  }
  // A head's last position ends where its run of the block does.
  EXPECT_EQ(view.k(1, 59 * bt + bt - 1, 7) + 512 * 2, view.k(1, 59 * bt, 7) + run);
}

TEST(BlockPool, FreedBlocksAreTakenLowestFirstSoASequencesRunsAscend) {
  // Sequences that grow side by side interleave their blocks; once they are
  // gone, a new sequence takes the freed blocks lowest first: its blocks lie
  // one after another, so each kv head's keys and values of it are one run.
  CacheShape shape{1, 128, 0, {}, 0, WType::f32, 64};
  auto pool = std::make_shared<BlockPool>(shape, 8);
  const std::size_t run = bt * 64 * sizeof(float);
  {
    KVCache a(pool);
    std::optional<KVCache> b(std::in_place, pool);
    for (int64_t n = 1; n <= 4; ++n) {
      ASSERT_TRUE(a.reserve(n * bt));
      ASSERT_TRUE(b->reserve(n * bt));
    }
    const KVView va = a.view();
    EXPECT_EQ(va.blocks[1] - va.blocks[0], static_cast<std::ptrdiff_t>(2 * run)) << "interleaved";
    b.reset(); // b's blocks (1, 3, 5, 7) freed first, then a's
  }
  KVCache c(pool);
  ASSERT_TRUE(c.reserve(8 * bt));
  const KVView v = c.view();
  for (std::size_t i = 1; i < 8; ++i)
    EXPECT_EQ(v.blocks[i] - v.blocks[i - 1], static_cast<std::ptrdiff_t>(run)) << "block " << i;
  EXPECT_EQ(v.k(0, 7 * bt, 1) - v.k(0, 0, 1), static_cast<std::ptrdiff_t>(7 * run));
}

TEST(BlockPool, SharedBlocksAreCountedOnceAndNeverWritten) {
  auto pool = pool_of(8);
  KVCache a = filled(pool, 2, 7);
  EXPECT_EQ(pool->in_use(), 2);
  KVCache b(pool);
  for (uint64_t i = 0; i < 2; ++i)
    ASSERT_TRUE(b.adopt(BlockId{7, i}));
  EXPECT_EQ(b.seq_len(), 2 * bt);
  EXPECT_EQ(pool->in_use(), 2) << "two sequences, two shared blocks: counted once";
  EXPECT_EQ(pool->refcount(a.table()[0]), 2);
  // b grows past the shared blocks into a block of its own.
  ASSERT_TRUE(b.reserve(2 * bt + 1));
  EXPECT_EQ(pool->in_use(), 3);
  EXPECT_NE(b.table()[2], a.table()[0]);
  EXPECT_NE(b.table()[2], a.table()[1]);
  EXPECT_FALSE(b.adopt(BlockId{7, 0})) << "only right after full blocks";
  EXPECT_FALSE(pool->publish(b.table()[2], BlockId{7, 0})) << "an id names one block";
}

TEST(BlockPool, BlocksInUseAreNeverReclaimedAndUnusedOnesGoLeastRecentFirst) {
  auto pool = pool_of(4);
  KVCache keep = filled(pool, 1, 1); // in use throughout
  {
    KVCache old = filled(pool, 1, 2);
    KVCache newer = filled(pool, 1, 3);
    old = KVCache{};   // released first: least recent
    newer = KVCache{}; // then this one
  }
  EXPECT_EQ(pool->in_use(), 1);
  EXPECT_EQ(pool->cached(), 2);
  EXPECT_EQ(pool->available(), 3) << "cached blocks can be taken";
  KVCache fresh(pool);
  ASSERT_TRUE(fresh.reserve(2 * bt)); // one never-used block, then the least recent cached one
  EXPECT_EQ(pool->lookup(BlockId{2, 0}), -1) << "the least recently released block was reclaimed";
  EXPECT_NE(pool->lookup(BlockId{3, 0}), -1) << "the newer one is still cached";
  ASSERT_TRUE(fresh.reserve(3 * bt));
  EXPECT_EQ(pool->lookup(BlockId{3, 0}), -1);
  EXPECT_EQ(pool->reclaimed(), 2u);
  EXPECT_FALSE(fresh.reserve(4 * bt)) << "the last block is in use: never taken";
  EXPECT_EQ(pool->lookup(BlockId{1, 0}), keep.table()[0]);
  EXPECT_EQ(*keep.view().out(0), 1.0f) << "its contents are untouched";
  std::set<int32_t> seen(fresh.table().begin(), fresh.table().end());
  EXPECT_EQ(seen.count(keep.table()[0]), 0u);
}

TEST(BlockPool, ACachedBlockAdoptedAgainIsInUseAgain) {
  auto pool = pool_of(2);
  { KVCache a = filled(pool, 1, 9); }
  EXPECT_EQ(pool->cached(), 1);
  KVCache b(pool);
  ASSERT_TRUE(b.adopt(BlockId{9, 0}));
  EXPECT_EQ(pool->cached(), 0);
  EXPECT_EQ(pool->in_use(), 1);
  EXPECT_EQ(*b.view().out(3), 9.0f);
}

TEST(BlockPool, TurningThePrefixCacheOffFreesCachedBlocks) {
  auto pool = pool_of(2);
  { KVCache a = filled(pool, 1, 4); }
  pool->set_prefix_cache(false);
  EXPECT_EQ(pool->cached(), 0);
  EXPECT_EQ(pool->published(), 0);
  EXPECT_EQ(pool->lookup(BlockId{4, 0}), -1);
  KVCache b(pool);
  ASSERT_TRUE(b.reserve(bt));
  EXPECT_FALSE(pool->publish(b.table()[0], BlockId{5, 0}));
}


// Sliding windows: a shard of 3 layers, the first two local with a window of
// 40. Local layers live in the local pool; a long sequence holds the global
// layer's blocks in full and the local ones only for the window.
TEST(WindowedCache, LocalBlocksBeforeTheWindowGoBackAndTheRestStaysPut) {
  CacheShape shape{3, 4, 8, {1, 1, 0}, 40};
  auto pool = std::make_shared<BlockPool>(shape, 64);
  ASSERT_NE(pool->local(), nullptr);
  EXPECT_EQ(pool->local()->shape().n_layers, 2);
  // Main blocks: 1 layer of k|v plus the output rows; local blocks: 2 layers.
  EXPECT_EQ(pool->block_bytes(), (1 * 2 * bt * 4 + bt * 8) * sizeof(float));
  EXPECT_EQ(pool->local()->block_bytes(), (2 * 2 * bt * 4) * sizeof(float));
  KVCache c(pool);
  // Write every layer's key at every position as the position, one at a time.
  for (int64_t p = 0; p < 10 * bt; ++p) {
    ASSERT_TRUE(c.reserve(p + 1));
    auto v = c.view();
    for (int64_t l = 0; l < 3; ++l)
      *f32(v.k(l, p, 0)) = static_cast<float>(p * 10 + l);
    *v.out(p) = static_cast<float>(p);
    c.commit(p + 1);
    // Held: the blocks of positions p + 1 - 40 .. p (at most 3 of 32).
    EXPECT_LE(c.local_blocks(), 3) << p;
    EXPECT_EQ(c.blocks(), p / bt + 1);
  }
  EXPECT_EQ(pool->local()->in_use(), c.local_blocks());
  EXPECT_EQ(pool->in_use(), 10);
  // The window and every global position still read back what was written.
  const auto v = c.view();
  for (int64_t p = 0; p < 10 * bt; ++p) {
    EXPECT_EQ(*f32(v.k(2, p, 0)), static_cast<float>(p * 10 + 2));
    EXPECT_EQ(*v.out(p), static_cast<float>(p));
  }
  for (int64_t p = 10 * bt - 40; p < 10 * bt; ++p)
    for (int64_t l = 0; l < 2; ++l)
      EXPECT_EQ(*f32(v.k(l, p, 0)), static_cast<float>(p * 10 + l));
  EXPECT_EQ(c.bytes(), 10 * pool->block_bytes() + static_cast<std::size_t>(c.local_blocks()) * pool->local()->block_bytes());
  // Back into the window: fine; back past what was given back: refused, unchanged.
  c.truncate(10 * bt - 8);
  EXPECT_EQ(c.seq_len(), 10 * bt - 8);
  EXPECT_THROW(c.truncate(bt), Error);
  EXPECT_EQ(c.seq_len(), 10 * bt - 8);
  // Dropping the cache gives everything back.
  c = KVCache();
  EXPECT_EQ(pool->in_use(), 0);
  EXPECT_EQ(pool->local()->in_use(), 0);
}

TEST(WindowedCache, APublishedPrefixIsSharedWithItsLocalBlocks) {
  CacheShape shape{2, 4, 0, {1, 0}, 16};
  auto pool = std::make_shared<BlockPool>(shape, 16);
  KVCache a(pool);
  ASSERT_TRUE(a.reserve(3 * bt));
  for (int64_t p = 0; p < 3 * bt; ++p) {
    *f32(a.view().k(0, p, 0)) = static_cast<float>(p);
    *f32(a.view().k(1, p, 0)) = static_cast<float>(-p);
  }
  a.commit(3 * bt);
  for (std::size_t b = 0; b < 3; ++b) // published before the window is trimmed
    EXPECT_TRUE(a.publish(b, BlockId{3, b}));
  a.trim_window();
  EXPECT_EQ(a.local_blocks(), 1);
  EXPECT_EQ(pool->local()->cached(), 2) << "given back but kept for sharing";
  KVCache b(pool);
  for (uint64_t i = 0; i < 3; ++i)
    ASSERT_TRUE(b.adopt(BlockId{3, i}));
  EXPECT_EQ(b.seq_len(), 3 * bt);
  const auto v = b.view();
  for (int64_t p = 0; p < 3 * bt; ++p) {
    EXPECT_EQ(*f32(v.k(0, p, 0)), static_cast<float>(p));
    EXPECT_EQ(*f32(v.k(1, p, 0)), static_cast<float>(-p));
  }
  // An id whose local block is gone (reclaimed or never published) is not adopted.
  KVCache d(pool);
  ASSERT_TRUE(d.reserve(bt));
  d.commit(bt);
  EXPECT_TRUE(pool->publish(d.table()[0], BlockId{4, 0})) << "the main block alone";
  KVCache e(pool);
  EXPECT_FALSE(e.adopt(BlockId{4, 0}));
  EXPECT_EQ(e.seq_len(), 0);
}

} // namespace
} // namespace strata::model
