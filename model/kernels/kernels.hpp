#pragma once
// Internal to model/: the matrix and attention kernels. Torch-free.

#include "model/formats/wmatrix.hpp"

#include <cstddef>
#include <cstdint>
#include <string>

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

/// A theoretical-peak probe: multiply-adds per second one thread sustains in
/// registers (the widest vector unit this CPU has), for benchmarks.
double fma_rate_per_thread(double seconds);

/// Tests: run the few-row f32 product's AVX2 build (what CPUs with AVX2 but
/// without AVX-512 run; the same bits as the others) instead of the CPU's
/// best, process-wide. False (and nothing changes) where the CPU lacks AVX2.
bool set_rows_isa_avx2(bool on);

} // namespace strata::model::detail
