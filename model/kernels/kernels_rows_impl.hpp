#pragma once
// Internal to model/kernels: the few-row f32 product (kernels.cpp's
// rows_kernel, rows_kernel_q) and the FMA peak loop, written once over the
// 16-lane vectors of vec_ops.hpp and built per target, each build in a
// namespace of its own (STRATA_ROWS_NS): kernels.cpp builds them for AVX-512
// and the baseline (target clones), kernels_rows_avx2.cpp for AVX2 with 16
// lanes as two halves of 8 (STRATA_ROWS_AVX2; GCC 12 keeps 64-byte vectors in
// memory on AVX2). Every build adds each dot product's terms in the same order
// (lane c % 16, then the lanes as hsum adds them, then the tail): the same bits.

#include "model/formats/packed.hpp"
#include "model/formats/wmatrix.hpp"
#include "model/kernels/vec.hpp"

#include <cstdint>
#include <type_traits>

#ifndef STRATA_ROWS_NS
#define STRATA_ROWS_NS plain
#endif

namespace strata::model::detail::STRATA_ROWS_NS {

#ifdef STRATA_ROWS_AVX2
#define STRATA_VEC_PAIR
#endif
#include "model/kernels/vec_ops.hpp"
#undef STRATA_VEC_PAIR

#ifdef STRATA_ROWS_AVX2
using v16 = pair16<v8>;
// Weight rows per block: AVX2's 16 registers hold 2 x 2 accumulators of two
// halves each, with the operands beside them.
constexpr int block_rows = 2;
#else
constexpr int block_rows = 4;
#endif

// Y rows [m, m+MR) x the RR weight rows at w (stride cols): RR*MR dot products
// over `cols`. y points at column 0 of this weight block in Y row 0.
template <int RR, int MR, bool PREFETCH = false>
inline __attribute__((always_inline)) void tile(const float* w, const float* X, float* y, int64_t ldy, int64_t m,
                                                int64_t cols, bool accumulate) {
  v16 acc[RR][MR];
#pragma GCC unroll 4
  for (int i = 0; i < RR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < MR; ++j)
      acc[i][j] = v16{};
  const float* x = X + m * cols;
  int64_t c = 0;
  for (; c + 16 <= cols; c += 16) {
    v16 wv[RR];
#pragma GCC unroll 4
    for (int i = 0; i < RR; ++i) {
      wv[i] = vload<v16>(w + i * cols + c);
      if constexpr (PREFETCH) // the next block's rows, while this one computes
        __builtin_prefetch(w + (RR + i) * cols + c, 0, 3);
    }
#pragma GCC unroll 4
    for (int j = 0; j < MR; ++j) {
      const v16 xv = vload<v16>(x + j * cols + c);
#pragma GCC unroll 4
      for (int i = 0; i < RR; ++i)
        acc[i][j] += wv[i] * xv;
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < RR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < MR; ++j) {
      float s = hsum(acc[i][j]);
      // (fused by hand: GCC may vectorize this loop as an in-order reduction,
      // products then sums, in one build and fuse them in another)
      for (int64_t cc = c; cc < cols; ++cc)
        s = __builtin_fmaf(w[i * cols + cc], x[j * cols + cc], s);
      float& out = y[(m + j) * ldy + i];
      out = accumulate ? out + s : s;
    }
}

// block_rows weight rows (at w, stride cols) against all M rows of X, in
// tiles of block_rows x block_rows; PREFETCH: the first pass prefetches the
// next block's rows.
template <bool PREFETCH>
inline __attribute__((always_inline)) void block(const float* w, const float* X, float* y, int64_t ldy, int64_t M,
                                                 int64_t cols, bool accumulate) {
  constexpr int B = block_rows;
  int64_t m = 0;
  for (; m + B <= M; m += B) {
    if (m == 0)
      tile<B, B, PREFETCH>(w, X, y, ldy, m, cols, accumulate);
    else
      tile<B, B>(w, X, y, ldy, m, cols, accumulate);
  }
  const bool first = m == 0;
  switch (M - m) {
    case 3:
      if constexpr (B > 3)
        first ? tile<B, 3, PREFETCH>(w, X, y, ldy, m, cols, accumulate) : tile<B, 3>(w, X, y, ldy, m, cols, accumulate);
      break;
    case 2:
      if constexpr (B > 2)
        first ? tile<B, 2, PREFETCH>(w, X, y, ldy, m, cols, accumulate) : tile<B, 2>(w, X, y, ldy, m, cols, accumulate);
      break;
    case 1: first ? tile<B, 1, PREFETCH>(w, X, y, ldy, m, cols, accumulate) : tile<B, 1>(w, X, y, ldy, m, cols, accumulate); break;
    default: break;
  }
}

// f32 weight rows [r0, r1) against all M rows of X: a block of block_rows
// weight rows stays in L1 while every group of input rows passes over it.
inline __attribute__((always_inline)) void rows_kernel(const float* W, const float* X, float* Y, int64_t ldy,
                                                       int64_t M, int64_t r0, int64_t r1, int64_t cols,
                                                       bool accumulate) {
  constexpr int B = block_rows;
  int64_t r = r0;
  for (; r + B <= r1; r += B) {
    // The first pass over this block of weight rows brings them from memory;
    // it also asks for the next block's, so memory and arithmetic overlap.
    if (r + 2 * B <= r1)
      block<true>(W + r * cols, X, Y + r, ldy, M, cols, accumulate);
    else
      block<false>(W + r * cols, X, Y + r, ldy, M, cols, accumulate);
  }
  for (; r < r1; ++r)
    for (int64_t m = 0; m < M; ++m)
      tile<1, 1>(W + r * cols, X, Y + r, ldy, m, cols, accumulate);
}

// The same for another type: block_rows rows at a time expanded to f32 in
// `buf` (4 * cols floats), then the f32 tile.
inline __attribute__((always_inline)) void rows_kernel_q(const WMatrix& W, const float* X, float* Y, int64_t ldy,
                                                         int64_t M, int64_t r0, int64_t r1, float* buf,
                                                         bool accumulate) {
  constexpr int B = block_rows;
  const int64_t cols = W.cols;
  int64_t r = r0;
  for (; r + B <= r1; r += B) {
    dequantize_rows(W, r, B, buf);
    block<false>(buf, X, Y + r, ldy, M, cols, accumulate);
  }
  for (; r < r1; ++r) {
    dequantize_rows(W, r, 1, buf);
    for (int64_t m = 0; m < M; ++m)
      tile<1, 1>(buf, X, Y + r, ldy, m, cols, accumulate);
  }
}

// 8 independent multiply-add chains on the widest vectors: the FMA units' peak.
inline __attribute__((always_inline)) double fma_loop(int64_t iters) {
  const v16 b = v16{} + 1.000001f;
  v16 a[8];
  for (int i = 0; i < 8; ++i)
    a[i] = v16{} + static_cast<float>(i);
  for (int64_t n = 0; n < iters; ++n)
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)
      a[i] = a[i] * b + b;
  float s = 0.f;
  for (int i = 0; i < 8; ++i)
    s += hsum(a[i]);
  return s;
}

} // namespace strata::model::detail::STRATA_ROWS_NS
