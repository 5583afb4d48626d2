// Why our own kernel for few rows: at one token per step libtorch's per-call
// dispatch costs more than the arithmetic on small models, BLAS libraries are
// slow for 2-16 rows (measured: oneDNN took 2.6x as long for 8 rows as for 1,
// where 8 rows read the weights no more than 1 row does), and a batch must not
// change a row's rounding. Why oneDNN for many rows: Debian's OpenBLAS does not
// recognise this CPU and falls back to its generic kernel (see docs/benchmarks.md).

#include "model/kernels/kernels.hpp"
#include "model/base/parallel.hpp"
#include "model/kernels/attention.hpp"
#include "model/formats/packed.hpp"
#include "model/kernels/kernels_q.hpp"
#include "model/kernels/kernels_rows_impl.hpp"
#include "model/kernels/vec.hpp"

#include <oneapi/dnnl/dnnl.h>

#include <atomic>
#include <optional>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace strata::model::detail {

void rows_kernel_avx2(const float* W, const float* X, float* Y, int64_t ldy, int64_t M, int64_t r0, int64_t r1,
                      int64_t cols, bool accumulate);
void rows_kernel_q_avx2(const WMatrix& W, const float* X, float* Y, int64_t ldy, int64_t M, int64_t r0, int64_t r1,
                        float* buf, bool accumulate);
double fma_loop_avx2(int64_t iters);

namespace {

// The few-row f32 product (kernels_rows_impl.hpp), built for AVX-512 and the
// baseline here, for AVX2 in kernels_rows_avx2.cpp; chosen by the CPU (or by
// set_rows_isa_avx2, for tests).
__attribute__((target_clones("avx512f", "default"))) void rows_kernel_plain(const float* W, const float* X, float* Y,
                                                                           int64_t ldy, int64_t M, int64_t r0,
                                                                           int64_t r1, int64_t cols, bool accumulate) {
  plain::rows_kernel(W, X, Y, ldy, M, r0, r1, cols, accumulate);
}
__attribute__((target_clones("avx512f", "default"))) void rows_kernel_q_plain(const WMatrix& W, const float* X,
                                                                             float* Y, int64_t ldy, int64_t M,
                                                                             int64_t r0, int64_t r1, float* buf,
                                                                             bool accumulate) {
  plain::rows_kernel_q(W, X, Y, ldy, M, r0, r1, buf, accumulate);
}
__attribute__((target_clones("avx512f", "default"))) double fma_loop_plain(int64_t iters) {
  return plain::fma_loop(iters);
}

std::atomic<bool> force_avx2{false};
// AVX2 without AVX-512, or asked for: the AVX2 build.
bool rows_avx2() {
  static const bool v = !__builtin_cpu_supports("avx512f") && attention_avx2_available();
  return v || force_avx2.load(std::memory_order_relaxed);
}
void rows_kernel(const float* W, const float* X, float* Y, int64_t ldy, int64_t M, int64_t r0, int64_t r1,
                 int64_t cols, bool accumulate) {
  if (rows_avx2())
    return rows_kernel_avx2(W, X, Y, ldy, M, r0, r1, cols, accumulate);
  rows_kernel_plain(W, X, Y, ldy, M, r0, r1, cols, accumulate);
}
void rows_kernel_q(const WMatrix& W, const float* X, float* Y, int64_t ldy, int64_t M, int64_t r0, int64_t r1,
                   float* buf, bool accumulate) {
  if (rows_avx2())
    return rows_kernel_q_avx2(W, X, Y, ldy, M, r0, r1, buf, accumulate);
  rows_kernel_q_plain(W, X, Y, ldy, M, r0, r1, buf, accumulate);
}
double fma_loop(int64_t iters) { return rows_avx2() ? fma_loop_avx2(iters) : fma_loop_plain(iters); }

float* scratch(std::size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats)
    buf.resize(floats);
  return buf.data();
}

} // namespace

void matmul_rows(const float* W, const float* X, float* Y, int64_t M, int64_t rows, int64_t cols, bool accumulate) {
  WMatrix w;
  w.data = reinterpret_cast<const uint8_t*>(W);
  w.rows = rows;
  w.cols = cols;
  matmul_rows(w, X, Y, rows, M, accumulate);
}

namespace {

// Activations prepared for one weight type: quantized for the fused kernels
// (kernels_q.cpp), or rounded to f32 the way llama.cpp pairs them with the type
// for the other paths (f16 with f16, bf16 with bf16, int8 blocks for the
// quantized types: the same values the fused kernels multiply). Parts of a
// stacked weight whose types prepare alike share one preparation.
struct Prepared {
  WType type;
  bool fused;
  const float* x;       // the rounded rows (or X itself for f32), when not fused
  const QuantActs* q;   // when fused
};

bool prepares_alike(WType a, WType b, bool gemm) {
  auto kind = [](WType t) { // the same activation blocks (q2_K's, q3_K's and q6_K's also interleaved by 16)
    const int64_t b = acts_block(t);
    return interleaves_by_16(t) ? WType::q2_K : b == 32 ? WType::q8_0 : b == 256 ? WType::q4_K : t;
  };
  return kind(a) == kind(b) && (gemm || fused_available(a) == fused_available(b));
}

// The buffers are the calling thread's: valid until its next prepare().
Prepared prepare(WType t, const float* X, int64_t M, int64_t cols, bool gemm) {
  thread_local QuantActs acts;
  thread_local std::vector<float> rounded;
  if (t == WType::f32)
    return {t, false, X, nullptr};
  const int64_t n = M * cols;
  if (static_cast<int64_t>(rounded.size()) < n)
    rounded.resize(static_cast<std::size_t>(n));
  if (t == WType::f16) {
    for (int64_t i = 0; i < n; ++i)
      rounded[static_cast<std::size_t>(i)] = static_cast<float>(static_cast<_Float16>(X[i]));
    return {t, false, rounded.data(), nullptr};
  }
  quantize_acts(t, X, M, cols, acts);
  if (!gemm && fused_available(t))
    return {t, true, nullptr, &acts};
  expand_acts(acts, rounded.data());
  return {t, false, rounded.data(), nullptr};
}

void rows_prepared(const WMatrix& W, const Prepared& p, float* Y, int64_t ldy, int64_t M, bool accumulate) {
  const int64_t rows = W.rows, cols = W.cols;
  if (p.fused) {
    const QuantActs& a = *p.q;
    const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 18) / std::max<int64_t>(cols * M, 1));
    if (rows <= grain || detail::team_size() == 1)
      return fused_rows(W, a, Y, ldy, 0, rows, accumulate);
    detail::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) { fused_rows(W, a, Y, ldy, r0, r1, accumulate); });
    return;
  }
  const float* X = p.x;
  auto run = [&](int64_t r0, int64_t r1) {
    if (W.type == WType::f32)
      rows_kernel(W.f32(), X, Y, ldy, M, r0, r1, cols, accumulate);
    else
      rows_kernel_q(W, X, Y, ldy, M, r0, r1, scratch(static_cast<std::size_t>(4 * cols)), accumulate);
  };
  // About 256K multiply-adds (4 weight rows each) per task before splitting is
  // worth a thread wake-up.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(cols * M, 1));
  const int64_t blocks = (rows + 3) / 4;
  if (blocks <= grain || detail::team_size() == 1) {
    run(0, rows);
    return;
  }
  detail::parallel_for(0, blocks, grain, [&](int64_t b, int64_t e) { run(b * 4, std::min(rows, e * 4)); });
}

// Quantized weights go through their fused kernel at every row count, not
// expanded for sgemm above small_rows: a row's numbers then never depend on how
// many rows came with it, so a position decoded alone, rebuilt in a long piece
// or recomputed statelessly gets the same bits. (Their activations are rounded
// to int8 blocks, which turns sgemm's other order of additions, 1e-6 apart,
// into whole rounding steps: logits 0.1-0.2 apart, enough to flip near-ties.)
// Measured, 896 x 4864, 2 threads, fused / expand+sgemm time: packed q8_0
// 0.84 at 128 rows, 0.47 at 32; packed q4_K 0.63 / 0.27; plain layout (VNNI)
// 0.85-0.97 at 128-256 rows; the AVX2 kernels 0.7-0.8 at 32 rows, 1.03-1.24
// at 128-256 (against an AVX-512 sgemm).
bool fused_at_any_rows(const WMatrix& W) {
  return W.type != WType::f32 && W.type != WType::f16 && W.type != WType::bf16 && fused_available(W.type);
}

void gemm_prepared(const WMatrix& W, const Prepared& p, float* Y, int64_t ldy, int64_t M, bool accumulate);

// Every part of a stacked weight into its columns of Y, the activations
// prepared once for all parts that take them alike. `gemm`: long sequences'
// rows (sgemm, but fused_at_any_rows parts through their fused kernel).
void over_parts(const Linear& w, const float* X, float* Y, int64_t M, bool accumulate, bool gemm) {
  if (M <= 0)
    return;
  std::optional<Prepared> p;
  bool p_gemm = false;
  int64_t col0 = 0;
  for (const auto& part : w.parts) {
    const bool g = gemm && !fused_at_any_rows(part);
    if (!p || p_gemm != g || !prepares_alike(p->type, part.type, g)) {
      p = prepare(part.type, X, M, w.cols, g);
      p_gemm = g;
    }
    if (g)
      gemm_prepared(part, *p, Y + col0, w.rows, M, accumulate);
    else
      rows_prepared(part, *p, Y + col0, w.rows, M, accumulate);
    col0 += part.rows;
  }
}

} // namespace

void matmul_rows(const WMatrix& W, const float* X, float* Y, int64_t ldy, int64_t M, bool accumulate) {
  if (M <= 0 || W.rows <= 0)
    return;
  rows_prepared(W, prepare(W.type, X, M, W.cols, false), Y, ldy, M, accumulate);
}

void matmul_rows(const Linear& w, const float* X, float* Y, int64_t M, bool accumulate) {
  over_parts(w, X, Y, M, accumulate, false);
}

namespace {

void sgemm(const float* W, const float* X, float* Y, int64_t ldy, int64_t M, int64_t rows, int64_t cols,
           bool accumulate) {
  const auto st = dnnl_sgemm('N', 'T', M, rows, cols, 1.0f, X, cols, W, cols, accumulate ? 1.0f : 0.0f, Y, ldy);
  if (st != dnnl_success) // only on invalid arguments, which the callers rule out
    throw std::runtime_error("oneDNN sgemm failed with status " + std::to_string(static_cast<int>(st)));
}

} // namespace

void matmul_gemm(const float* W, const float* X, float* Y, int64_t M, int64_t rows, int64_t cols, bool accumulate) {
  if (M <= 0 || rows <= 0)
    return;
  sgemm(W, X, Y, rows, M, rows, cols, accumulate);
}

namespace {

void gemm_prepared(const WMatrix& W, const Prepared& p, float* Y, int64_t ldy, int64_t M, bool accumulate) {
  if (W.type == WType::f32)
    return sgemm(W.f32(), p.x, Y, ldy, M, W.rows, W.cols, accumulate);
  // Slabs of about 4 MB of f32 weights: expanded by all threads, then one sgemm.
  const int64_t cols = W.cols;
  const int64_t slab = std::max<int64_t>(16, (int64_t{1} << 20) / cols);
  float* buf = scratch(static_cast<std::size_t>(std::min(slab, W.rows) * cols));
  for (int64_t r0 = 0; r0 < W.rows; r0 += slab) {
    const int64_t n = std::min(slab, W.rows - r0);
    detail::parallel_for(0, n, 16, [&](int64_t a, int64_t b) {
      dequantize_rows(W, r0 + a, b - a, buf + a * cols);
    });
    sgemm(buf, p.x, Y + r0, ldy, M, n, cols, accumulate);
  }
}

} // namespace

void matmul_gemm(const WMatrix& W, const float* X, float* Y, int64_t ldy, int64_t M, bool accumulate) {
  if (M <= 0 || W.rows <= 0)
    return;
  if (fused_at_any_rows(W))
    return matmul_rows(W, X, Y, ldy, M, accumulate);
  gemm_prepared(W, prepare(W.type, X, M, W.cols, true), Y, ldy, M, accumulate);
}

void matmul_gemm(const Linear& w, const float* X, float* Y, int64_t M, bool accumulate) {
  over_parts(w, X, Y, M, accumulate, true);
}

namespace {

} // namespace

bool set_rows_isa_avx2(bool on) {
  const bool ok = !on || attention_avx2_available();
  force_avx2.store(on && ok);
  return ok;
}

double fma_rate_per_thread(double seconds) {
  volatile double sink = fma_loop(1000); // warm the clock up
  int64_t iters = 1 << 20;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    sink = sink + fma_loop(iters);
    const double d = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (d >= seconds)
      return static_cast<double>(iters) * 8.0 * 16.0 / d;
    iters *= 2;
  }
}

} // namespace strata::model::detail
