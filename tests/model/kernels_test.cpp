// The model's kernels against plain loops: the few-row matrix kernel (and that
// a row's result does not depend on the other rows), oneDNN's GEMM, and the
// grouped attention kernel against the one-row kernel, for the head sizes of
// the models we run.

#include "model/kernels/kernels.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
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

TEST(Kernels, GroupedAttentionEqualsOneRowAttention) {
  const int64_t bt = 32, blocks = 4;
  for (int64_t hd : {8, 64, 128}) {
    const int64_t stride = 2 * hd; // two kv heads side by side
    std::vector<std::vector<float>> store;
    std::vector<const float*> ptrs;
    for (int64_t b = 0; b < blocks; ++b) {
      store.push_back(random(static_cast<std::size_t>(2 * bt * stride), static_cast<uint32_t>(10 + b)));
      ptrs.push_back(store.back().data());
    }
    const CacheRows rows{ptrs.data(), bt, stride, hd, bt * stride + hd}; // the second kv head
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    for (int64_t m : {2, 7, 16})
      for (int64_t n0 : {0, 5, 40, 100}) {
        const int64_t qs = 3 * hd;
        auto q = random(static_cast<std::size_t>(m * qs), 99);
        std::vector<float> out(static_cast<std::size_t>(m * qs)), ref(static_cast<std::size_t>(hd));
        std::vector<float> scores(static_cast<std::size_t>(16 * (n0 + m + 1)));
        attend_rows(q.data(), qs, m, rows, n0, hd, scale, scores.data(), out.data(), qs);
        for (int64_t t = 0; t < m; ++t) {
          attend(q.data() + t * qs, rows, n0 + t + 1, hd, scale, scores.data(), ref.data());
          for (int64_t i = 0; i < hd; ++i)
            ASSERT_NEAR(out[static_cast<std::size_t>(t * qs + i)], ref[static_cast<std::size_t>(i)], 1e-5)
              << "hd " << hd << " m " << m << " n0 " << n0 << " row " << t;
        }
      }
  }
}

} // namespace
} // namespace strata::model::detail
