#pragma once
// Internal to model/: the decode-path matrix-vector kernel. Torch-free.

#include <cstdint>

namespace strata::model::detail {

/// y = W x (or y += W x when `accumulate`), W row-major (rows, cols).
/// Vectorized for AVX-512 / AVX2 / baseline, chosen at load time; rows are split
/// across the intra-op threads when the matrix is large enough to pay for it.
void gemv(const float* W, const float* x, float* y, int64_t rows, int64_t cols, bool accumulate);

/// Where one attention head finds cached rows: row j of K lives at
/// blocks[j / block_tokens] + k_offset + (j % block_tokens) * row_stride, V likewise.
struct CacheRows {
  const float* const* blocks;
  int64_t block_tokens;
  int64_t row_stride;
  int64_t k_offset;
  int64_t v_offset;
};

/// One query head against cached rows 0..n-1: out = softmax(q.K^T * scale) V.
/// `scores` has room for n floats.
void attend(const float* q, const CacheRows& rows, int64_t n, int64_t head_dim, float scale, float* scores, float* out);

} // namespace strata::model::detail
