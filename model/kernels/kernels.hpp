#pragma once
// Internal to model/: the matrix and attention kernels. Torch-free.

#include "model/formats/wmatrix.hpp"

#include <cstddef>
#include <cstdint>

namespace strata::model::detail {

/// Y (M, rows) = X (M, cols) W^T, or Y += X W^T when `accumulate`; W is row-major
/// (rows, cols) as in torch.nn.Linear, X and Y are row-major and contiguous.
///
/// Our own kernel for few rows (decode: one row per sequence): each weight row is
/// read from memory once for all M rows. Row m of Y is computed in the same order
/// whatever M is and whatever the other rows hold, so a sequence decoded in a
/// batch gets bit-for-bit the numbers it gets alone. Vectorized for AVX-512 /
/// AVX2 / baseline (chosen at load time); weight rows are split across the
/// intra-op threads.
void matmul_rows(const float* W, const float* X, float* Y, int64_t M, int64_t rows, int64_t cols, bool accumulate);

/// The same for a weight of any resident type: Y (M, W.rows) with row stride
/// `ldy` (>= W.rows) = X (M, W.cols) W^T. Quantized weights are expanded to f32
/// four rows at a time in L1 and go through the same tile as f32, so a row's
/// numbers still do not depend on M.
void matmul_rows(const WMatrix& W, const float* X, float* Y, int64_t ldy, int64_t M, bool accumulate);
/// A stacked weight: Y (M, w.rows) = X w^T, each part writing its own columns.
/// The activations are prepared once for parts whose types pair with the same
/// activation rounding, not once per part.
void matmul_rows(const Linear& w, const float* X, float* Y, int64_t M, bool accumulate);

/// The same product through oneDNN's sgemm (JIT kernels for this CPU, OpenMP
/// threads shared with ATen): for many rows (prefill chunks).
void matmul_gemm(const float* W, const float* X, float* Y, int64_t M, int64_t rows, int64_t cols, bool accumulate);
/// The same for a weight of any resident type (ldy as above): other types are
/// expanded to f32 a slab of rows at a time (threads share the work), then sgemm.
void matmul_gemm(const WMatrix& W, const float* X, float* Y, int64_t ldy, int64_t M, bool accumulate);
void matmul_gemm(const Linear& w, const float* X, float* Y, int64_t M, bool accumulate);

/// Applies the thread count of set_num_threads() to the calling thread (OpenMP
/// keeps it per thread); cheap when nothing changed.
void apply_threads();

/// Rows up to which matmul_rows is used for a group of rows.
constexpr int64_t small_rows = 16;

/// Where one attention head finds cached rows: row j of K starts at byte
/// blocks[j / block_tokens] + k_offset + (j % block_tokens) * row_stride, V
/// likewise; its head_dim values are of `type` (f32, bf16, f16, or q8_0 blocks
/// of 32: head_dim a multiple of 32).
struct CacheRows {
  const uint8_t* const* blocks;
  int64_t block_tokens;
  std::size_t row_stride;
  std::size_t k_offset;
  std::size_t v_offset;
  /// Sliding window: the query at position p sees keys p' with p - p' < window
  /// (0: every earlier key). Blocks wholly before the window are never read.
  int64_t window = 0;
  /// Scores become softcap * tanh(score / softcap) before the softmax (0: off).
  float softcap = 0.f;
  WType type = WType::f32;
};

/// One query head against cached rows 0..n-1 (the query is at position n-1;
/// with a window only the last `window` of them): out = softmax(q.K^T * scale) V.
/// `scores` has room for n floats.
void attend(const float* q, const CacheRows& rows, int64_t n, int64_t head_dim, float scale, float* scores, float* out);

/// Up to 16 consecutive query rows of one head (rows of one piece of one
/// sequence) against cached rows: row t (0 <= t < m) sees the first n0 + t + 1
/// cached rows (causal). Query row t starts at q + t * q_stride, its output at
/// out + t * out_stride. Each key is read once for all rows and no horizontal
/// sums are needed (the rows' queries are transposed into vector lanes); a row's
/// result does not depend on m. `scores` has room for 16 * (n0 + m) floats.
void attend_rows(const float* q, int64_t q_stride, int64_t m, const CacheRows& rows, int64_t n0, int64_t head_dim,
                 float scale, float* scores, float* out, int64_t out_stride);
constexpr int64_t attend_group = 16;

/// Up to 16 query heads of one position that share a kv head (grouped-query
/// attention at decode), query head t at q + t * head_dim, its output at
/// out + t * head_dim, against cached rows 0..n-1: each key and value row is
/// read once for all of them, not once per head. A head's result does not
/// depend on m. `scores` has room for 16 * n floats.
void attend_heads(const float* q, int64_t m, const CacheRows& rows, int64_t n, int64_t head_dim, float scale,
                  float* scores, float* out);

/// A theoretical-peak probe: multiply-adds per second one thread sustains in
/// registers (the widest vector unit this CPU has), for benchmarks.
double fma_rate_per_thread(double seconds);

} // namespace strata::model::detail
