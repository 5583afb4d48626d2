// strata_bench attention: the decode attention alone, one step of one sequence
// over a long context, per KV cache type, in the block pool's own layout (the
// shard's blocks, filled with seeded random keys and values): every layer, each
// kv head's query heads together (attend_heads), the kv heads side by side on
// the threads as the engine runs them. Two shapes: Qwen2.5-0.5B (24 layers, 2 kv
// heads of 64, 7 query heads each) and Gemma 3's global layers scaled down as in
// `bench arch` (2 layers, 4 kv heads of 128, 2 query heads each), and multi-head
// attention as in Llama 2 (8 of Llama-2-7B's 32 heads of 128 in 4 layers, one
// query head a kv head). Where the CPU
// runs the AVX-512 kernels, every type is also measured with the AVX2 build
// (what CPUs without AVX-512 run), and the f16 and q8_0 caches with the plain
// build, in turn. STRATA_BENCH_LAYOUTS=both adds, for the best build, the
// former position-major rows (a position's kv heads side by side, a kv head's
// part every kv_dim values: the kernels read the same blocks with that stride),
// in turn with the pool's own layout. A benchmark, not a test.
//
// Usage: strata_bench attention (STRATA_BENCH_THREADS, default 2;
// STRATA_BENCH_DEPTH, default 8192; STRATA_BENCH_ROUNDS, default 3: rounds of
// every row in turn, the best step of each kept, the median of the rounds shown).

#include "model/formats/quant.hpp"
#include "model/kernels/attention.hpp"
#include "model/transformer/kv_cache.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

using namespace strata;
using namespace strata::model;

namespace {

struct AttnShape {
  const char* name;
  int64_t layers, kv_heads, head_dim, group; // group: query heads per kv head
};

struct Case {
  AttnShape shape;
  WType type;
  detail::AttentionIsa isa;
  std::string label;
  std::shared_ptr<BlockPool> pool;
  std::unique_ptr<KVCache> cache;
  std::vector<float> q;
  std::vector<double> best; // per round, ms
  bool position_major = false; // read the blocks as the former layout's rows
};

void fill(Case& c, int64_t n) {
  const auto& s = c.shape;
  const int64_t kv = s.kv_heads * s.head_dim;
  c.pool = std::make_shared<BlockPool>(CacheShape{s.layers, kv, 0, {}, 0, c.type, s.head_dim}, KVCache::blocks_needed(n));
  c.cache = std::make_unique<KVCache>(c.pool);
  if (!c.cache->reserve(n))
    throw std::runtime_error("bench attention: the pool could not hold the context");
  c.cache->commit(n);
  const KVView v = c.cache->view();
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> row(static_cast<std::size_t>(kv));
  for (int64_t l = 0; l < s.layers; ++l)
    for (int64_t p = 0; p < n; ++p) {
      for (auto& x : row)
        x = d(rng);
      for (int64_t g = 0; g < s.kv_heads; ++g)
        v.put_key(l, p, g, row.data() + g * s.head_dim, s.head_dim);
      for (auto& x : row)
        x = d(rng);
      for (int64_t g = 0; g < s.kv_heads; ++g)
        quantize(c.type, row.data() + g * s.head_dim, v.v(l, p, g), s.head_dim);
    }
  c.q.resize(static_cast<std::size_t>(s.kv_heads * s.group * s.head_dim));
  for (auto& x : c.q)
    x = d(rng);
}

// One decode step's attention over every layer; ms.
double step(const Case& c, int64_t n, int threads) {
  const auto& s = c.shape;
  const KVView v = c.cache->view();
  const BlockPool& pool = *c.pool;
  const std::size_t stride = c.position_major ? pool.shape().kv_row_bytes() : pool.head_row_bytes();
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t l = 0; l < s.layers; ++l) {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      thread_local std::vector<float> scores, out;
      scores.resize(static_cast<std::size_t>(detail::attend_scores_floats(n + 1)));
      out.resize(static_cast<std::size_t>(s.group * s.head_dim));
      {
        const std::size_t head_at = row_bytes(c.type, g * s.head_dim); // (position-major)
        const detail::CacheRows rows{v.blocks_of(l).data(),
                                     BlockPool::block_tokens,
                                     stride,
                                     c.position_major ? pool.k_offset(l, 0, 0) + head_at : pool.k_offset(l, 0, g),
                                     c.position_major ? pool.v_offset(l, 0, 0) + head_at : pool.v_offset(l, 0, g),
                                     0,
                                     0.f,
                                     c.type,
                                     !c.position_major && pool.keys_by_dim()};
        detail::attend_heads(c.q.data() + g * s.group * s.head_dim, s.group, rows, n, s.head_dim, scale,
                             scores.data(), out.data());
      }
    }
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

} // namespace

int attention_bench_main(int, char**) {
  const char* threads_env = std::getenv("STRATA_BENCH_THREADS");
  const int threads = std::max(1, threads_env ? std::atoi(threads_env) : 2);
  const char* depth_env = std::getenv("STRATA_BENCH_DEPTH");
  const int64_t n = std::max<int64_t>(64, depth_env ? std::atoll(depth_env) : 8192);
  const char* rounds_env = std::getenv("STRATA_BENCH_ROUNDS");
  const int rounds = std::max(1, rounds_env ? std::atoi(rounds_env) : 3);
  const bool both = detail::attention_avx512_available();
  const char* layouts_env = std::getenv("STRATA_BENCH_LAYOUTS");
  const AttnShape shapes[] = {{"Qwen2.5-0.5B", 24, 2, 64, 7},
                              {"Gemma-3 global layers", 2, 4, 128, 2},
                              {"multi-head, Llama-2-7B's heads (4 layers)", 4, 8, 128, 1}};
  std::vector<Case> cases;
  const bool avx2 = detail::attention_avx2_available();
  for (const auto& s : shapes)
    for (WType t : {WType::f32, WType::bf16, WType::f16, WType::q8_0}) {
      // The builds this CPU runs: the best; where that is AVX-512, the AVX2
      // one and the plain one too (the AVX-512 build is another file).
      std::vector<std::pair<detail::AttentionIsa, const char*>> isas{
        {detail::AttentionIsa::best, both ? " (AVX-512)" : avx2 ? " (AVX2)" : ""}};
      if (both && avx2)
        isas.emplace_back(detail::AttentionIsa::avx2, " (AVX2)");
      if (both)
        isas.emplace_back(detail::AttentionIsa::portable, " (plain, AVX-512 clone)");
      for (const auto& [isa, name] : isas) {
        Case c{s, t, isa, std::string(to_string(t)) + name, {}, {}, {}, {}};
        fill(c, n);
        cases.push_back(std::move(c));
      }
      if (layouts_env && std::string(layouts_env) == "both") {
        Case c{s, t, detail::AttentionIsa::best, std::string(to_string(t)) + isas.front().second + ", position-major rows",
               {}, {}, {}, {}, true};
        fill(c, n);
        cases.push_back(std::move(c));
      }
    }
  std::printf("# strata_bench attention\n\none decode step's attention at %lld tokens of context, %d threads; ms per "
              "step: the median over %d rounds (every row in turn each round) of each round's best of 5 steps\n\n",
              static_cast<long long>(n), threads, rounds);
  for (int r = 0; r < rounds; ++r)
    for (auto& c : cases) {
      detail::set_attention_isa(c.isa);
      double best = 1e300;
      for (int i = 0; i < 5; ++i)
        best = std::min(best, step(c, n, threads));
      c.best.push_back(best);
    }
  detail::set_attention_isa(detail::AttentionIsa::best);
  std::printf("| shape | KV type | ms per step | GB/s of keys and values | ns per key and kv head |\n|---|---|---|---|---|\n");
  for (const auto& c : cases) {
    const auto& s = c.shape;
    const double ms = median(c.best);
    const double bytes = static_cast<double>(s.layers) * 2.0 * static_cast<double>(n) *
                         static_cast<double>(row_bytes(c.type, s.kv_heads * s.head_dim));
    const double per_key = ms * 1e6 * threads / (static_cast<double>(s.layers * s.kv_heads) * static_cast<double>(n));
    std::printf("| %s (%lld kv heads of %lld, %lld query heads each) | %s | %.2f | %.1f | %.1f |\n", s.name,
                static_cast<long long>(s.kv_heads), static_cast<long long>(s.head_dim),
                static_cast<long long>(s.group), c.label.c_str(), ms, bytes / ms / 1e6, per_key);
  }
  return 0;
}
