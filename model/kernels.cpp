// Why our own gemv: at one token per step, libtorch's per-call dispatch costs
// more than the arithmetic on small models, and the BLAS shipped with Debian may
// fall back to a generic kernel on CPUs it does not recognise.

#include "model/kernels.hpp"

#include <ATen/Parallel.h>

#include <cmath>

namespace strata::model::detail {

namespace {

__attribute__((target_clones("avx512f", "avx2", "default"))) void gemv_rows(const float* W, const float* x, float* y,
                                                                             int64_t r0, int64_t r1, int64_t cols,
                                                                             bool accumulate) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const float* w0 = W + r * cols;
    const float* w1 = w0 + cols;
    const float* w2 = w1 + cols;
    const float* w3 = w2 + cols;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t c = 0; c < cols; ++c) {
      s0 += w0[c] * x[c];
      s1 += w1[c] * x[c];
      s2 += w2[c] * x[c];
      s3 += w3[c] * x[c];
    }
    if (accumulate) {
      y[r] += s0, y[r + 1] += s1, y[r + 2] += s2, y[r + 3] += s3;
    } else {
      y[r] = s0, y[r + 1] = s1, y[r + 2] = s2, y[r + 3] = s3;
    }
  }
  for (; r < r1; ++r) {
    const float* w = W + r * cols;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < cols; ++c)
      s += w[c] * x[c];
    y[r] = accumulate ? y[r] + s : s;
  }
}

} // namespace

namespace {

// HD > 0: head_dim known at compile time (loops fully unrolled); HD == 0: runtime `hd`.
template <int HD>
__attribute__((always_inline)) inline void attend_impl(const float* q, const CacheRows& rows, int64_t n, int64_t hd_rt,
                                                       float scale, float* scores, float* out) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  // Walk the cache block by block: no division per row.
  float mx = -INFINITY;
  for (int64_t j0 = 0, b = 0; j0 < n; j0 += rows.block_tokens, ++b) {
    const float* k = rows.blocks[b] + rows.k_offset;
    const int64_t m = std::min(rows.block_tokens, n - j0);
    for (int64_t j = 0; j < m; ++j, k += rows.row_stride) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < hd; ++i)
        s += q[i] * k[i];
      s *= scale;
      scores[j0 + j] = s;
      mx = std::max(mx, s);
    }
  }
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - mx);
    sum += scores[j];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < hd; ++i)
    out[i] = 0.f;
  for (int64_t j0 = 0, b = 0; j0 < n; j0 += rows.block_tokens, ++b) {
    const float* v = rows.blocks[b] + rows.v_offset;
    const int64_t m = std::min(rows.block_tokens, n - j0);
    for (int64_t j = 0; j < m; ++j, v += rows.row_stride) {
      const float a = scores[j0 + j] * inv;
#pragma omp simd
      for (int64_t i = 0; i < hd; ++i)
        out[i] += a * v[i];
    }
  }
}

} // namespace

__attribute__((target_clones("avx512f", "avx2", "default"))) void attend(const float* q, const CacheRows& rows, int64_t n,
                                                                          int64_t hd, float scale, float* scores,
                                                                          float* out) {
  switch (hd) {
    case 8: return attend_impl<8>(q, rows, n, hd, scale, scores, out);
    case 16: return attend_impl<16>(q, rows, n, hd, scale, scores, out);
    case 32: return attend_impl<32>(q, rows, n, hd, scale, scores, out);
    case 64: return attend_impl<64>(q, rows, n, hd, scale, scores, out);
    case 128: return attend_impl<128>(q, rows, n, hd, scale, scores, out);
    default: return attend_impl<0>(q, rows, n, hd, scale, scores, out);
  }
}

void gemv(const float* W, const float* x, float* y, int64_t rows, int64_t cols, bool accumulate) {
  // About 1M multiply-adds per task before splitting is worth a thread wake-up.
  const int64_t grain = std::max<int64_t>(4, ((int64_t{1} << 20) / std::max<int64_t>(cols, 1)) & ~int64_t{3});
  if (rows <= grain || at::get_num_threads() == 1) {
    gemv_rows(W, x, y, 0, rows, cols, accumulate);
    return;
  }
  at::parallel_for(0, (rows + 3) / 4, grain / 4, [&](int64_t b, int64_t e) {
    gemv_rows(W, x, y, b * 4, std::min(rows, e * 4), cols, accumulate);
  });
}

} // namespace strata::model::detail
