// The model's kernels against plain loops: the few-row matrix kernel (and that
// a row's result does not depend on the other rows), oneDNN's GEMM, and the
// grouped attention kernel against the one-row kernel, for the head sizes of
// the models we run.

#include "model/formats/quant.hpp"
#include "model/kernels/activations.hpp"
#include "model/kernels/attention.hpp"
#include "model/kernels/kernels.hpp"
#include "model/kernels/kernels_q.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <limits>
#include <cmath>
#include <cstring>
#include <string>
#include <random>
#include <thread>
#include <vector>

namespace strata::model::detail {
namespace {

std::vector<float> random(std::size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v)
    x = d(rng);
  return v;
}

TEST(Kernels, FewRowProductEqualsPlainLoopsAndIgnoresOtherRows) {
  for (int64_t cols : {64, 896, 100}) {
    const int64_t rows = 37, M = 9;
    auto W = random(static_cast<std::size_t>(rows * cols), 1), X = random(static_cast<std::size_t>(M * cols), 2);
    std::vector<float> Y(static_cast<std::size_t>(M * rows)), G(Y.size()), one(static_cast<std::size_t>(rows));
    matmul_rows(W.data(), X.data(), Y.data(), M, rows, cols, false);
    matmul_gemm(W.data(), X.data(), G.data(), M, rows, cols, false);
    for (int64_t m = 0; m < M; ++m) {
      matmul_rows(W.data(), X.data() + m * cols, one.data(), 1, rows, cols, false);
      for (int64_t r = 0; r < rows; ++r) {
        double ref = 0;
        for (int64_t c = 0; c < cols; ++c)
          ref += static_cast<double>(W[static_cast<std::size_t>(r * cols + c)]) * X[static_cast<std::size_t>(m * cols + c)];
        const auto y = Y[static_cast<std::size_t>(m * rows + r)];
        EXPECT_NEAR(y, ref, 1e-3) << "cols " << cols;
        EXPECT_NEAR(G[static_cast<std::size_t>(m * rows + r)], ref, 1e-3) << "gemm, cols " << cols;
        EXPECT_EQ(y, one[static_cast<std::size_t>(r)]) << "row " << m << " alone differs from the same row among " << M;
      }
    }
    // Accumulate.
    std::vector<float> acc = Y;
    matmul_rows(W.data(), X.data(), acc.data(), M, rows, cols, true);
    for (std::size_t i = 0; i < acc.size(); ++i)
      EXPECT_NEAR(acc[i], 2 * Y[i], 1e-4);
  }
}

// Attention over rows stored in every KV cache type: a piece of rows and a
// group of heads equal each query alone (one row of a piece), and all equal
// plain loops over the values the cache stores (each row dequantized: the
// rounding is the cache's, the math exact).
TEST(Kernels, GroupedAttentionEqualsOneRowAttentionForEveryKvType) {
  const int64_t bt = 32, blocks = 4;
  for (WType type : {WType::f32, WType::bf16, WType::f16, WType::q8_0})
    for (int64_t hd : {8, 64, 128}) {
      if (type == WType::q8_0 && hd % 32 != 0)
        continue;
      SCOPED_TRACE(std::string(to_string(type)) + " hd " + std::to_string(hd));
      const int64_t kv = 2 * hd; // two kv heads side by side
      const std::size_t stride = row_bytes(type, kv);
      std::vector<std::vector<uint8_t>> store;
      std::vector<const uint8_t*> ptrs;
      std::vector<float> stored; // what the cache holds, row by row (block, k|v, slot)
      for (int64_t b = 0; b < blocks; ++b) {
        const auto x = random(static_cast<std::size_t>(2 * bt * kv), static_cast<uint32_t>(10 + b));
        store.emplace_back(2 * bt * stride);
        quantize(type, x.data(), store.back().data(), 2 * bt * kv);
        std::vector<float> back(x.size());
        dequantize(type, store.back().data(), back.data(), 2 * bt * kv);
        stored.insert(stored.end(), back.begin(), back.end());
        ptrs.push_back(store.back().data());
      }
      // The second kv head: keys at slot 0 + hd values in, values after the keys.
      const std::size_t head_at = row_bytes(type, hd);
      const CacheRows rows{ptrs.data(), bt, stride, head_at, bt * stride + head_at, 0, 0.f, type};
      auto key = [&](int64_t j, int64_t i) { return stored[static_cast<std::size_t>(((j / bt) * 2 * bt + j % bt) * kv + hd + i)]; };
      auto val = [&](int64_t j, int64_t i) {
        return stored[static_cast<std::size_t>(((j / bt) * 2 * bt + bt + j % bt) * kv + hd + i)];
      };
      const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
      for (int64_t m : {2, 7, 16})
        for (int64_t n0 : {0, 5, 40, 100}) {
          const int64_t qs = 3 * hd;
          auto q = random(static_cast<std::size_t>(m * qs), 99);
          std::vector<float> out(static_cast<std::size_t>(m * qs)), ref(static_cast<std::size_t>(hd));
          std::vector<float> scores(static_cast<std::size_t>(attend_scores_floats(n0 + m + 1)));
          attend_rows(q.data(), qs, m, rows, n0, hd, scale, scores.data(), out.data(), qs);
          // Over a q8_0 cache the scores take the query as q8_0 blocks too (as
          // llama.cpp does): the reference reads it as the cache would store it.
          std::vector<float> qref = q;
          if (type == WType::q8_0)
            for (int64_t t = 0; t < m; ++t) {
              std::vector<uint8_t> qb(row_bytes(type, hd));
              quantize(type, q.data() + t * qs, qb.data(), hd);
              dequantize(type, qb.data(), qref.data() + t * qs, hd);
            }
          for (int64_t t = 0; t < m; ++t) {
            attend_rows(q.data() + t * qs, qs, 1, rows, n0 + t, hd, scale, scores.data(), ref.data(), hd);
            // Plain loops in double over the stored values.
            const int64_t n = n0 + t + 1;
            std::vector<double> p(static_cast<std::size_t>(n));
            double mx = -1e300, sum = 0;
            for (int64_t j = 0; j < n; ++j) {
              double d = 0;
              for (int64_t i = 0; i < hd; ++i)
                d += static_cast<double>(qref[static_cast<std::size_t>(t * qs + i)]) * key(j, i);
              p[static_cast<std::size_t>(j)] = d * scale;
              mx = std::max(mx, d * scale);
            }
            for (auto& x : p)
              sum += (x = std::exp(x - mx));
            for (int64_t i = 0; i < hd; ++i) {
              double o = 0;
              for (int64_t j = 0; j < n; ++j)
                o += p[static_cast<std::size_t>(j)] / sum * val(j, i);
              ASSERT_NEAR(ref[static_cast<std::size_t>(i)], o, 1e-4) << "one row, m " << m << " n0 " << n0 << " row " << t;
              ASSERT_NEAR(out[static_cast<std::size_t>(t * qs + i)], ref[static_cast<std::size_t>(i)], 1e-5)
                << "grouped, m " << m << " n0 " << n0 << " row " << t;
            }
          }
          // m query heads of one position sharing the kv head (a decode step of
          // grouped-query attention): each equals the one-row kernel, alone or not.
          const int64_t n = n0 + 1;
          std::vector<float> heads(static_cast<std::size_t>(m * hd)), one(static_cast<std::size_t>(hd));
          std::vector<float> qh(static_cast<std::size_t>(m * hd));
          for (int64_t t = 0; t < m; ++t)
            std::copy(q.begin() + t * qs, q.begin() + t * qs + hd, qh.begin() + t * hd);
          attend_heads(qh.data(), m, rows, n, hd, scale, scores.data(), heads.data());
          for (int64_t t = 0; t < m; ++t) {
            attend_rows(qh.data() + t * hd, hd, 1, rows, n - 1, hd, scale, scores.data(), ref.data(), hd);
            attend_heads(qh.data() + t * hd, 1, rows, n, hd, scale, scores.data(), one.data());
            for (int64_t i = 0; i < hd; ++i) {
              ASSERT_NEAR(heads[static_cast<std::size_t>(t * hd + i)], ref[static_cast<std::size_t>(i)], 1e-5)
                << "heads, m " << m << " n " << n << " head " << t;
              ASSERT_EQ(heads[static_cast<std::size_t>(t * hd + i)], one[static_cast<std::size_t>(i)])
                << "a head's result depends on the others";
            }
          }
        }
    }
}

// `blocks` cache blocks of `bt` positions of key rows then value rows, `kv`
// values a row, stored as `type` from seeded normal values (block b from seed
// seed0 + b); block `tiny` (if any) scaled by 2e-6: f16 subnormals, and q8_0
// blocks whose scale is an f16 subnormal.
struct StoredBlocks {
  std::vector<std::vector<uint8_t>> store;
  std::vector<const uint8_t*> ptrs;
};
StoredBlocks stored_blocks(WType type, int64_t kv, int64_t bt, int64_t blocks, uint32_t seed0, int64_t tiny = -1) {
  StoredBlocks s;
  const std::size_t stride = row_bytes(type, kv);
  for (int64_t b = 0; b < blocks; ++b) {
    auto x = random(static_cast<std::size_t>(2 * bt * kv), seed0 + static_cast<uint32_t>(b));
    if (b == tiny)
      for (auto& v : x)
        v *= 2e-6f;
    s.store.emplace_back(2 * bt * stride);
    quantize(type, x.data(), s.store.back().data(), 2 * bt * kv);
    s.ptrs.push_back(s.store.back().data());
  }
  return s;
}

// A decode step's heads (attend_heads: keys in lanes) are the same bits as the
// prefill kernel (attend_rows: query rows in lanes) gives the same query at the
// same position, alone or as the last row of a piece, with sliding windows and
// soft-capping: what makes a cached decode equal a stateless recomputation.
TEST(Kernels, DecodeHeadsEqualPrefillRowsBitForBit) {
  const int64_t bt = 32, blocks = 6;
  for (WType type : {WType::f32, WType::bf16, WType::f16, WType::q8_0})
    for (int64_t hd : {8, 32, 48, 64, 96, 128, 256, 320, 512}) {
      if (type == WType::q8_0 && hd % 32 != 0)
        continue;
      const int64_t kv = hd;
      const std::size_t stride = row_bytes(type, kv);
      const StoredBlocks cache = stored_blocks(type, kv, bt, blocks, 20);
      const auto& ptrs = cache.ptrs;
      for (int64_t window : {0, 17, 40})
        for (float cap : {0.f, 3.f}) {
          SCOPED_TRACE(std::string(to_string(type)) + " hd " + std::to_string(hd) + " window " + std::to_string(window) +
                       " cap " + std::to_string(cap));
          const CacheRows rows{ptrs.data(), bt, stride, 0, bt * stride, window, cap, type};
          const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
          for (int64_t m : {1, 2, 3, 7, 8, 12, 16})
            for (int64_t n : {1, 15, 16, 17, 33, 70, 150, 192}) {
              const auto q = random(static_cast<std::size_t>(16 * hd), static_cast<uint32_t>(7 * m + n));
              std::vector<float> heads(static_cast<std::size_t>(m * hd)), row(static_cast<std::size_t>(hd));
              std::vector<float> piece(static_cast<std::size_t>(16 * hd));
              std::vector<float> scores(static_cast<std::size_t>(attend_scores_floats(n + 1)));
              attend_heads(q.data(), m, rows, n, hd, scale, scores.data(), heads.data());
              for (int64_t t = 0; t < m; ++t) {
                attend_rows(q.data() + t * hd, hd, 1, rows, n - 1, hd, scale, scores.data(), row.data(), hd);
                // The same query as the last of a piece of up to 16 rows.
                const int64_t rows_in = std::min<int64_t>(16, n);
                std::vector<float> qp(static_cast<std::size_t>(rows_in * hd));
                std::copy(q.begin() + t * hd, q.begin() + (t + 1) * hd, qp.begin() + (rows_in - 1) * hd);
                attend_rows(qp.data(), hd, rows_in, rows, n - rows_in, hd, scale, scores.data(), piece.data(), hd);
                for (int64_t i = 0; i < hd; ++i) {
                  ASSERT_EQ(heads[static_cast<std::size_t>(t * hd + i)], row[static_cast<std::size_t>(i)])
                    << "m " << m << " n " << n << " head " << t << " column " << i;
                  ASSERT_EQ(row[static_cast<std::size_t>(i)], piece[static_cast<std::size_t>((rows_in - 1) * hd + i)])
                    << "m " << m << " n " << n << " head " << t << " column " << i;
                }
              }
            }
        }
    }
}

// The same over long contexts: the value pass goes in runs of blocks
// (value_run_bytes() of each row's columns, every pass of columns over one run,
// the sums kept in the output between runs), so a decode step (up to 8 heads:
// 2 passes of 32 columns at head size 64) and the prefill kernel (16 rows: 4
// passes of 16) cross run bounds at different places in their passes; both
// still give every output the same bits, with and without a window that
// starts mid-run.
TEST(Kernels, DecodeHeadsEqualPrefillRowsAcrossValueRuns) {
  const int64_t bt = 32, blocks = 40; // 1,280 keys
  for (WType type : {WType::f32, WType::bf16, WType::f16, WType::q8_0})
    for (int64_t hd : {64, 128}) {
      const std::size_t stride = row_bytes(type, hd);
      const StoredBlocks cache = stored_blocks(type, hd, bt, blocks, 90);
      for (int64_t window : {0, 700}) {
        SCOPED_TRACE(std::string(to_string(type)) + " hd " + std::to_string(hd) + " window " + std::to_string(window));
        const CacheRows rows{cache.ptrs.data(), bt, stride, 0, bt * stride, window, 0.f, type};
        const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
        for (int64_t m : {2, 7, 8})
          for (int64_t n : {600, 1100, 1280}) {
            const auto q = random(static_cast<std::size_t>(m * hd), static_cast<uint32_t>(3 * m + n));
            std::vector<float> heads(static_cast<std::size_t>(m * hd)), piece(static_cast<std::size_t>(16 * hd));
            std::vector<float> scores(static_cast<std::size_t>(attend_scores_floats(n + 1)));
            attend_heads(q.data(), m, rows, n, hd, scale, scores.data(), heads.data());
            for (int64_t t = 0; t < m; ++t) {
              // The query as the last of a piece of 16 rows.
              std::vector<float> qp(static_cast<std::size_t>(16 * hd));
              std::copy(q.begin() + t * hd, q.begin() + (t + 1) * hd, qp.begin() + 15 * hd);
              attend_rows(qp.data(), hd, 16, rows, n - 16, hd, scale, scores.data(), piece.data(), hd);
              for (int64_t i = 0; i < hd; ++i)
                ASSERT_EQ(__builtin_bit_cast(uint32_t, heads[static_cast<std::size_t>(t * hd + i)]),
                          __builtin_bit_cast(uint32_t, piece[static_cast<std::size_t>(15 * hd + i)]))
                  << "m " << m << " n " << n << " head " << t << " column " << i;
            }
          }
      }
    }
}

// One decode item spread over threads (attend_heads_scores on spans of keys,
// attend_heads_weights, attend_heads_values on spans of output columns) is the
// same bits as one attend_heads call, for every cache type, head size (64, 128
// and 256 have kernels of their own; 48 and 40 take the run-time one, 40 the
// column loop of a head size not a multiple of 16), window and soft-cap: spans
// on any chunk, those of one step run at once on threads of their own, in any
// order, and every score and output is written (the buffers start as NaN).
TEST(Kernels, ADecodeItemSpreadOverThreadsGivesTheBitsOfOneCall) {
  const int64_t bt = 64, blocks = 20; // 1,280 keys
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (WType type : {WType::f32, WType::bf16, WType::f16, WType::q8_0})
    for (int64_t hd : {40, 48, 64, 128, 256}) {
      if (type == WType::q8_0 && hd % 32 != 0)
        continue;
      const std::size_t stride = row_bytes(type, hd);
      const StoredBlocks cache = stored_blocks(type, hd, bt, blocks, 60);
      for (int64_t window : {0, 300})
        for (float cap : {0.f, 3.f}) {
          SCOPED_TRACE(std::string(to_string(type)) + " hd " + std::to_string(hd) + " window " + std::to_string(window) +
                       " cap " + std::to_string(cap));
          const CacheRows rows{cache.ptrs.data(), bt, stride, 0, bt * stride, window, cap, type};
          const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
          for (int64_t m : {1, 4, 7, 16})
            for (int64_t n : {1, 333, 1000, 1280}) {
              const auto q = random(static_cast<std::size_t>(m * hd), static_cast<uint32_t>(13 * m + n));
              std::vector<float> scores(static_cast<std::size_t>(attend_scores_floats(n + 1)));
              std::vector<float> whole(static_cast<std::size_t>(m * hd));
              attend_heads(q.data(), m, rows, n, hd, scale, scores.data(), whole.data());
              const int64_t chunks = heads_keys(rows, n).chunks;
              for (int64_t parts : {2, 3, 5}) {
                if (parts > chunks)
                  continue;
                // Chunk bounds anywhere (not only on multiples of 4), column
                // bounds on multiples of 16 (all of them in one piece where hd is not one).
                std::vector<int64_t> kb, cb;
                for (int64_t p = 0; p <= parts; ++p) {
                  kb.push_back(chunks * p / parts);
                  cb.push_back(hd % 16 == 0 ? hd / 16 * p / parts * 16 : (p == 0 ? 0 : hd));
                }
                std::vector<float> split_scores(scores.size(), nan), mx(static_cast<std::size_t>(parts * attend_heads_max_floats), nan);
                std::vector<float> split(whole.size(), nan);
                {
                  std::vector<std::thread> ts;
                  for (int64_t p = parts - 1; p >= 0; --p)
                    ts.emplace_back([&, p] {
                      attend_heads_scores(q.data(), m, rows, n, hd, scale, split_scores.data(), kb[p], kb[p + 1],
                                          mx.data() + p * attend_heads_max_floats);
                    });
                  for (auto& t : ts)
                    t.join();
                }
                attend_heads_weights(m, rows, n, split_scores.data(), mx.data(), parts);
                {
                  std::vector<std::thread> ts;
                  for (int64_t p = parts - 1; p >= 0; --p)
                    if (cb[p + 1] > cb[p])
                      ts.emplace_back([&, p] {
                        attend_heads_values(m, rows, n, hd, split_scores.data(), cb[p], cb[p + 1], split.data());
                      });
                  for (auto& t : ts)
                    t.join();
                }
                for (std::size_t i = 0; i < whole.size(); ++i)
                  ASSERT_EQ(__builtin_bit_cast(uint32_t, whole[i]), __builtin_bit_cast(uint32_t, split[i]))
                    << "m " << m << " n " << n << " in " << parts << " parts, head " << i / hd << " column "
                    << i % hd;
              }
            }
        }
    }
}

// The kernel builds named for `strata status` are the ones that run here.
TEST(Kernels, KernelBuildsNameWhatThisCpuRuns) {
  const std::string s = kernel_builds();
  const std::string base = attention_avx512_available() ? "avx512" : attention_avx2_available() ? "avx2" : "baseline";
  ASSERT_EQ(s.substr(0, base.size()), base) << s;
  std::string rest = s.substr(base.size());
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw")) {
    ASSERT_EQ(rest.substr(0, 5), "+vnni") << s;
    rest = rest.substr(5);
  }
  if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")) {
    ASSERT_EQ(rest, "+bf16") << s;
    rest.clear();
  }
  EXPECT_EQ(rest, "") << s;
}

// The few-row product's AVX2 build (16 lanes as two halves of 8, 2 x 2 tiles)
// gives the same bits as the build this CPU runs by default, for f32 weights
// and for the types expanded to f32 on the way (bf16, f16), at every row count
// and with column tails: a machine without AVX-512 computes the same tokens.
TEST(Kernels, FewRowProductAvx2BuildGivesTheSameBits) {
  if (!attention_avx2_available())
    GTEST_SKIP() << "this CPU lacks AVX2 with FMA and F16C: only the baseline build runs here";
  struct Restore {
    ~Restore() { set_rows_isa_avx2(false); }
  } restore;
  for (WType type : {WType::f32, WType::bf16, WType::f16})
    for (int64_t cols : {64, 896, 100, 7}) {
      if (type != WType::f32 && cols % 32 != 0)
        continue;
      const int64_t rows = 37;
      const WMatrix W = convert(owned_f32(random(static_cast<std::size_t>(rows * cols), 3), rows, cols), type);
      for (int64_t M : {1, 2, 3, 4, 5, 9, 16}) {
        const auto X = random(static_cast<std::size_t>(M * cols), static_cast<uint32_t>(4 + M));
        auto run = [&](bool avx2, bool accumulate) {
          EXPECT_TRUE(set_rows_isa_avx2(avx2));
          std::vector<float> Y(static_cast<std::size_t>(M * rows), 0.5f);
          matmul_rows(W, X.data(), Y.data(), rows, M, accumulate);
          return Y;
        };
        for (bool accumulate : {false, true}) {
          const auto best = run(false, accumulate), avx2 = run(true, accumulate);
          for (std::size_t i = 0; i < best.size(); ++i)
            ASSERT_EQ(__builtin_bit_cast(uint32_t, best[i]), __builtin_bit_cast(uint32_t, avx2[i]))
              << to_string(type) << " cols " << cols << " M " << M << " value " << i;
        }
      }
    }
}

// Every build of the kernels gives the same bits: the AVX-512 one with F16C
// (f16 values converted by vcvtph2ps), the AVX2 one (16-lane vectors as two
// halves of 8, F16C) and the plain one (its AVX-512 clone here; f16 values
// converted by integer arithmetic), for every cache type and kernel, with
// windows and soft-capping, and with subnormal f16 values and scales among the
// stored ones: machines of every kind compute the same tokens.
TEST(Kernels, EveryBuildOfTheCacheKernelsGivesTheSameBits) {
  if (!attention_avx2_available())
    GTEST_SKIP() << "this CPU lacks AVX2 with FMA and F16C: only the plain kernels run here";
  struct Restore {
    ~Restore() { set_attention_isa(AttentionIsa::best); }
  } restore;
  const int64_t bt = 32, blocks = 6;
  for (WType type : {WType::f32, WType::bf16, WType::f16, WType::q8_0})
    for (int64_t hd : {32, 40, 48, 64, 96, 128, 320}) {
      if (type == WType::q8_0 && hd % 32 != 0)
        continue;
      const int64_t kv = hd;
      const std::size_t stride = row_bytes(type, kv);
      // Block 1 holds tiny values: f16 subnormals, q8_0 blocks with subnormal scales.
      const StoredBlocks cache = stored_blocks(type, kv, bt, blocks, 40, 1);
      const auto& ptrs = cache.ptrs;
      for (int64_t window : {0, 40})
        for (float cap : {0.f, 3.f}) {
          SCOPED_TRACE(std::string(to_string(type)) + " hd " + std::to_string(hd) + " window " + std::to_string(window) +
                       " cap " + std::to_string(cap));
          const CacheRows rows{ptrs.data(), bt, stride, 0, bt * stride, window, cap, type};
          const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
          for (int64_t m : {1, 2, 4, 7, 16})
            for (int64_t n : {1, 17, 70, 150, 192}) {
              const auto q = random(static_cast<std::size_t>(16 * hd), static_cast<uint32_t>(11 * m + n));
              std::vector<float> scores(static_cast<std::size_t>(attend_scores_floats(n + 1)));
              auto run = [&](AttentionIsa isa) {
                set_attention_isa(isa);
                std::vector<float> all(static_cast<std::size_t>(2 * 16 * hd));
                attend_heads(q.data(), m, rows, n, hd, scale, scores.data(), all.data());
                const int64_t rows_in = std::min<int64_t>(m, n);
                attend_rows(q.data(), hd, rows_in, rows, n - rows_in, hd, scale, scores.data(),
                            all.data() + 16 * hd, hd);
                return all;
              };
              const auto best = run(AttentionIsa::best), avx2 = run(AttentionIsa::avx2),
                         plain = run(AttentionIsa::portable);
              for (std::size_t i = 0; i < best.size(); ++i) {
                ASSERT_EQ(__builtin_bit_cast(uint32_t, best[i]), __builtin_bit_cast(uint32_t, avx2[i]))
                  << "AVX2 build, m " << m << " n " << n << " output " << i / (16 * hd) << " value " << i % (16 * hd);
                ASSERT_EQ(__builtin_bit_cast(uint32_t, best[i]), __builtin_bit_cast(uint32_t, plain[i]))
                  << "plain build, m " << m << " n " << n << " output " << i / (16 * hd) << " value "
                  << i % (16 * hd);
              }
            }
        }
    }
}

// f32 and q8_0 keys stored by dimension inside a block (the block pool's
// layout for those types, kv_cache.hpp: f32 value i of slot s at i x bt + s;
// q8_0 per block of 32 values the bt scales, then unit u of 4 values of slot s
// at 2 bt + 4 (u bt + s)) give every kernel the same bits as the same keys
// stored by position: a decode step's heads whole and spread over threads,
// prefill rows alone and as pieces, with windows and soft-capping, in every
// build.
TEST(Kernels, KeysByDimensionGiveTheBitsOfKeysByPosition) {
  struct Restore {
    ~Restore() { set_attention_isa(AttentionIsa::best); }
  } restore;
  const int64_t bt = 32, blocks = 40; // 1,280 keys
  std::vector<AttentionIsa> isas{AttentionIsa::best, AttentionIsa::portable};
  if (attention_avx2_available())
    isas.push_back(AttentionIsa::avx2);
  for (WType type : {WType::f32, WType::q8_0})
    for (int64_t hd : {32, 48, 64, 128, 256}) {
      if (type == WType::q8_0 && hd % 32 != 0)
        continue;
      const std::size_t stride = row_bytes(type, hd);
      const StoredBlocks cache = stored_blocks(type, hd, bt, blocks, 80, 3);
      // The same blocks with each block's keys by dimension, the layout spelled out
      // here rather than through attention.hpp's by_dim_* (which the kernels and
      // the cache use): this checks those offsets too.
      std::vector<std::vector<uint8_t>> by_dim_store;
      std::vector<const uint8_t*> by_dim;
      for (const auto& blk : cache.store) {
        by_dim_store.push_back(blk);
        uint8_t* dst = by_dim_store.back().data();
        for (int64_t slot = 0; slot < bt; ++slot) {
          const uint8_t* row = blk.data() + slot * stride;
          if (type == WType::f32) {
            for (int64_t i = 0; i < hd; ++i)
              std::memcpy(dst + 4 * (i * bt + slot), row + 4 * i, 4);
            continue;
          }
          for (int64_t b = 0; b < hd / 32; ++b) {
            uint8_t* at = dst + 34 * bt * b;
            std::memcpy(at + 2 * slot, row + 34 * b, 2);
            for (int64_t u = 0; u < 8; ++u)
              std::memcpy(at + 2 * bt + 4 * (u * bt + slot), row + 34 * b + 2 + 4 * u, 4);
          }
        }
        by_dim.push_back(by_dim_store.back().data());
      }
      for (int64_t window : {0, 300})
        for (float cap : {0.f, 3.f}) {
          SCOPED_TRACE(std::string(to_string(type)) + " hd " + std::to_string(hd) + " window " +
                       std::to_string(window) + " cap " + std::to_string(cap));
          const CacheRows rows{cache.ptrs.data(), bt, stride, 0, bt * stride, window, cap, type};
          CacheRows dims = rows;
          dims.blocks = by_dim.data();
          dims.keys_by_dim = true;
          const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
          for (AttentionIsa isa : isas) {
            set_attention_isa(isa);
            for (int64_t m : {1, 2, 7, 8, 16})
              for (int64_t n : {1, 15, 17, 70, 333, 1280}) {
                const auto q = random(static_cast<std::size_t>(16 * hd), static_cast<uint32_t>(5 * m + n));
                std::vector<float> scores(static_cast<std::size_t>(attend_scores_floats(n + 1)));
                auto run = [&](const CacheRows& r) {
                  std::vector<float> all(static_cast<std::size_t>(3 * 16 * hd));
                  attend_heads(q.data(), m, r, n, hd, scale, scores.data(), all.data());
                  const int64_t rows_in = std::min<int64_t>(m, n);
                  attend_rows(q.data(), hd, rows_in, r, n - rows_in, hd, scale, scores.data(), all.data() + 16 * hd,
                              hd);
                  // Spread: scores in three spans of chunks, then the weights and values.
                  const int64_t chunks = heads_keys(r, n).chunks;
                  std::vector<float> mx(static_cast<std::size_t>(3 * attend_heads_max_floats));
                  for (int64_t p = 0; p < 3; ++p)
                    attend_heads_scores(q.data(), m, r, n, hd, scale, scores.data(), chunks * p / 3,
                                        chunks * (p + 1) / 3, mx.data() + p * attend_heads_max_floats);
                  attend_heads_weights(m, r, n, scores.data(), mx.data(), 3);
                  attend_heads_values(m, r, n, hd, scores.data(), 0, hd, all.data() + 2 * 16 * hd);
                  return all;
                };
                const auto a = run(rows), b = run(dims);
                for (std::size_t i = 0; i < a.size(); ++i)
                  ASSERT_EQ(__builtin_bit_cast(uint32_t, a[i]), __builtin_bit_cast(uint32_t, b[i]))
                    << "build " << static_cast<int>(isa) << " m " << m << " n " << n << " output " << i / (16 * hd)
                    << " value " << i % (16 * hd);
              }
          }
        }
    }
}

// The vectorized SiLU x up: within a few ulp of the scalar formula over the
// range activations take (and at its ends), NaN and infinities as the formula
// gives them, and every value the same bits whatever the length of the call
// and its place in it (the tail goes through the same vector code).
TEST(Kernels, SiluMulIsCloseToTheFormulaAndIndependentOfItsNeighbours) {
  auto silu_mul_reference = [](float g, float u) { return g / (1.0f + std::exp(-g)) * u; };
  std::vector<float> g, u;
  for (float x = -120.f; x <= 120.f; x += 0.0137f) {
    g.push_back(x);
    u.push_back(1.0f + 0.001f * static_cast<float>(g.size() % 97));
  }
  for (float x : {0.f, -0.f, 1e-30f, -1e-30f, 87.f, -87.f, 88.7f, -88.7f, 89.f, -89.f, 1e30f, -1e30f}) {
    g.push_back(x);
    u.push_back(0.5f);
  }
  const auto n = static_cast<int64_t>(g.size());
  std::vector<float> o(g.size());
  silu_mul(g.data(), u.data(), o.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const float want = silu_mul_reference(g[i], u[i]);
    // (relative, and absolute far below anything a row adds: where e^-g leaves
    // float's range, g < -88.7, the kernel gives 0 for values under 1e-36)
    const float tol = 4e-7f * std::fabs(want) + 1e-30f;
    ASSERT_NEAR(o[i], want, tol) << "g " << g[i] << " u " << u[i];
  }
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const float sg[3] = {nan, inf, -inf}, su[3] = {1.f, 2.f, 1.f};
  float so[3];
  silu_mul(sg, su, so, 3);
  EXPECT_TRUE(std::isnan(so[0]));
  EXPECT_EQ(so[1], inf);
  EXPECT_EQ(std::isnan(so[2]), std::isnan(silu_mul_reference(-inf, 1.f)));
  // Any length, any start: the same bits for every value.
  for (int64_t start : {0, 1, 5, 13})
    for (int64_t len : {1, 3, 7, 8, 9, 17, 100}) {
      std::vector<float> part(static_cast<std::size_t>(len));
      silu_mul(g.data() + start * 101, u.data() + start * 101, part.data(), len);
      for (int64_t i = 0; i < len; ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(part[static_cast<std::size_t>(i)]),
                  std::bit_cast<uint32_t>(o[static_cast<std::size_t>(start * 101 + i)]))
          << "start " << start << " length " << len << " value " << i;
    }
}

} // namespace
} // namespace strata::model::detail
