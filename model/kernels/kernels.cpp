// Why our own kernel for few rows: at one token per step libtorch's per-call
// dispatch costs more than the arithmetic on small models, BLAS libraries are
// slow for 2-16 rows (measured: oneDNN took 2.6x as long for 8 rows as for 1,
// where 8 rows read the weights no more than 1 row does), and a batch must not
// change a row's rounding. Why oneDNN for many rows: Debian's OpenBLAS does not
// recognise this CPU and falls back to its generic kernel (see docs/benchmarks.md).

#include "model/kernels/kernels.hpp"
#include "model/kernels/kernels_q.hpp"

#include <ATen/Parallel.h>
#include <oneapi/dnnl/dnnl.h>

#include <array>
#include <optional>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace strata::model::detail {

namespace {

// A 64-byte vector of floats; the compiler maps it onto AVX-512, AVX2 or SSE.
typedef float v16 __attribute__((vector_size(64)));
// The same, for memory that may not be 64-byte aligned.
typedef float v16u __attribute__((vector_size(64), aligned(4)));

inline __attribute__((always_inline)) v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// A fixed pairwise order, so every row reduces the same way: lanes i and i+8,
// then i and i+4, i and i+2, i and i+1.
inline __attribute__((always_inline)) float hsum(v16 v) {
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const float c0 = b[0] + b[2], c1 = b[1] + b[3];
  return c0 + c1;
}

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
      wv[i] = load16(w + i * cols + c);
      if constexpr (PREFETCH) // the next block's rows, while this one computes
        __builtin_prefetch(w + (RR + i) * cols + c, 0, 3);
    }
#pragma GCC unroll 4
    for (int j = 0; j < MR; ++j) {
      const v16 xv = load16(x + j * cols + c);
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
      for (int64_t cc = c; cc < cols; ++cc)
        s += w[i * cols + cc] * x[j * cols + cc];
      float& out = y[(m + j) * ldy + i];
      out = accumulate ? out + s : s;
    }
}

// Four weight rows (at w, stride cols) against all M rows of X; `first` asks
// the first pass to prefetch the next four rows.
template <bool PREFETCH>
inline __attribute__((always_inline)) void block4(const float* w, const float* X, float* y, int64_t ldy, int64_t M,
                                                  int64_t cols, bool accumulate) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    if (m == 0)
      tile<4, 4, PREFETCH>(w, X, y, ldy, m, cols, accumulate);
    else
      tile<4, 4>(w, X, y, ldy, m, cols, accumulate);
  }
  const bool first = m == 0;
  switch (M - m) {
    case 3: first ? tile<4, 3, PREFETCH>(w, X, y, ldy, m, cols, accumulate) : tile<4, 3>(w, X, y, ldy, m, cols, accumulate); break;
    case 2: first ? tile<4, 2, PREFETCH>(w, X, y, ldy, m, cols, accumulate) : tile<4, 2>(w, X, y, ldy, m, cols, accumulate); break;
    case 1: first ? tile<4, 1, PREFETCH>(w, X, y, ldy, m, cols, accumulate) : tile<4, 1>(w, X, y, ldy, m, cols, accumulate); break;
    default: break;
  }
}

// f32 weight rows [r0, r1) against all M rows of X: a block of 4 weight rows
// stays in L1 while every group of up to 4 input rows passes over it.
__attribute__((target_clones("avx512f", "avx2", "default"))) void rows_kernel(const float* W, const float* X,
                                                                               float* Y, int64_t ldy, int64_t M,
                                                                               int64_t r0, int64_t r1, int64_t cols,
                                                                               bool accumulate) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    // The first pass over this block of weight rows brings them from memory;
    // it also asks for the next block's, so memory and arithmetic overlap.
    if (r + 8 <= r1)
      block4<true>(W + r * cols, X, Y + r, ldy, M, cols, accumulate);
    else
      block4<false>(W + r * cols, X, Y + r, ldy, M, cols, accumulate);
  }
  for (; r < r1; ++r)
    for (int64_t m = 0; m < M; ++m)
      tile<1, 1>(W + r * cols, X, Y + r, ldy, m, cols, accumulate);
}

// The same for another type: four rows at a time expanded to f32 in `buf`
// (4 * cols floats), then the f32 tile.
__attribute__((target_clones("avx512f", "avx2", "default"))) void rows_kernel_q(const WMatrix& W, const float* X,
                                                                                 float* Y, int64_t ldy, int64_t M,
                                                                                 int64_t r0, int64_t r1, float* buf,
                                                                                 bool accumulate) {
  const int64_t cols = W.cols;
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    dequantize(W.type, W.row(r), buf, 4 * cols);
    block4<false>(buf, X, Y + r, ldy, M, cols, accumulate);
  }
  for (; r < r1; ++r) {
    dequantize(W.type, W.row(r), buf, cols);
    for (int64_t m = 0; m < M; ++m)
      tile<1, 1>(buf, X, Y + r, ldy, m, cols, accumulate);
  }
}

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
  auto kind = [](WType t) { // the same activation blocks
    const int64_t b = acts_block(t);
    return b == 32 ? WType::q8_0 : b == 256 ? WType::q4_K : t;
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
    if (rows <= grain || at::get_num_threads() == 1)
      return fused_rows(W, a, Y, ldy, 0, rows, accumulate);
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) { fused_rows(W, a, Y, ldy, r0, r1, accumulate); });
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
  if (blocks <= grain || at::get_num_threads() == 1) {
    run(0, rows);
    return;
  }
  at::parallel_for(0, blocks, grain, [&](int64_t b, int64_t e) { run(b * 4, std::min(rows, e * 4)); });
}

// Every part of a stacked weight into its columns of Y, the activations
// prepared once for all parts that take them alike.
template <class Run>
void over_parts(const Linear& w, const float* X, float* Y, int64_t M, bool accumulate, bool gemm, Run run) {
  if (M <= 0)
    return;
  std::optional<Prepared> p;
  int64_t col0 = 0;
  for (const auto& part : w.parts) {
    if (!p || !prepares_alike(p->type, part.type, gemm))
      p = prepare(part.type, X, M, w.cols, gemm);
    run(part, *p, Y + col0, w.rows, M, accumulate);
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
  over_parts(w, X, Y, M, accumulate, false, [](auto&&... a) { rows_prepared(a...); });
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
    at::parallel_for(0, n, 16, [&](int64_t a, int64_t b) {
      dequantize(W.type, W.row(r0 + a), buf + a * cols, (b - a) * cols);
    });
    sgemm(buf, p.x, Y + r0, ldy, M, n, cols, accumulate);
  }
}

} // namespace

void matmul_gemm(const WMatrix& W, const float* X, float* Y, int64_t ldy, int64_t M, bool accumulate) {
  if (M <= 0 || W.rows <= 0)
    return;
  gemm_prepared(W, prepare(W.type, X, M, W.cols, true), Y, ldy, M, accumulate);
}

void matmul_gemm(const Linear& w, const float* X, float* Y, int64_t M, bool accumulate) {
  over_parts(w, X, Y, M, accumulate, true, [](auto&&... a) { gemm_prepared(a...); });
}

namespace {

// e^x for 16 lanes at once (Cephes' expf: x = k ln2 + r, |r| <= ln2 / 2, a
// degree-7 polynomial in r, times 2^k), within 2 ulp of expf; 0 below -87.3
// (so -inf, a masked score, gives exactly 0; so does NaN). Lane by lane a pure function of
// its input, so a score gets the same weight whichever kernel, lane or batch it
// is computed in.
inline __attribute__((always_inline)) v16 exp16(v16 x) {
  typedef int32_t vi16 __attribute__((vector_size(64)));
  const v16 lo = v16{} - 87.33654f, hi = v16{} + 88.72283f;
  const vi16 under = ~(x >= lo); // NaN too (an unused lane's -inf - -inf)
  x = x >= lo ? x : lo;
  x = x > hi ? hi : x;
  // k = round(x / ln2) by the 1.5 * 2^23 trick (|x / ln2| < 2^22).
  const v16 shifter = v16{} + 12582912.0f;
  const v16 kf = (x * 1.44269504088896341f + shifter) - shifter;
  const v16 r = x - kf * 0.693359375f - kf * -2.12194440e-4f;
  const v16 r2 = r * r;
  v16 p = v16{} + 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r2 + r + 1.0f;
  const vi16 k = __builtin_convertvector(kf, vi16);
  const v16 two_k = reinterpret_cast<v16>((k + 127) << 23);
  const v16 e = p * two_k;
  return under ? v16{} : e;
}

// Cached rows in their stored type, read as f32: E::row(p, n, tmp) gives the n
// values at p as floats (p itself for f32, else converted into tmp); E::get16(p,
// c) the 16 values from c (c a multiple of 16).
struct KvF32 {
  static const float* row(const uint8_t* p, int64_t, float*) { return reinterpret_cast<const float*>(p); }
  static inline __attribute__((always_inline)) v16 get16(const uint8_t* p, int64_t c) {
    return load16(reinterpret_cast<const float*>(p) + c);
  }
};
struct KvBf16 {
  static const float* row(const uint8_t* p, int64_t n, float* tmp) {
    const auto* h = reinterpret_cast<const uint16_t*>(p);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i)
      tmp[i] = __builtin_bit_cast(float, static_cast<uint32_t>(h[i]) << 16);
    return tmp;
  }
  static inline __attribute__((always_inline)) v16 get16(const uint8_t* p, int64_t c) {
    typedef uint16_t h16 __attribute__((vector_size(32), aligned(2)));
    typedef uint32_t u16v __attribute__((vector_size(64)));
    h16 h;
    __builtin_memcpy(&h, p + 2 * c, sizeof h);
    return reinterpret_cast<v16>(__builtin_convertvector(h, u16v) << 16);
  }
};
// f16 bits to f32 with integer and float vector operations only (every target
// clone has them; a _Float16 conversion would be a library call per value on
// CPUs without AVX-512 FP16): exponent and mantissa shifted into place and
// rebiased by one exact multiplication (normals and subnormals alike), inf and
// NaN kept, the sign put back.
inline __attribute__((always_inline)) v16 f16_to_f32_16(const uint8_t* p) {
  typedef uint16_t h16 __attribute__((vector_size(32), aligned(2)));
  typedef uint32_t u16v __attribute__((vector_size(64)));
  h16 h;
  __builtin_memcpy(&h, p, sizeof h);
  const u16v x = __builtin_convertvector(h, u16v);
  const u16v em = x & 0x7fffu;
  const v16 scaled = reinterpret_cast<v16>(em << 13) * 0x1p112f;
  const u16v special = reinterpret_cast<u16v>(em >= 0x7c00u); // inf / NaN: all ones where so
  const u16v bits = (reinterpret_cast<u16v>(scaled) & ~special) | ((0x7f800000u | ((em & 0x3ffu) << 13)) & special);
  return reinterpret_cast<v16>(bits | ((x & 0x8000u) << 16));
}

struct KvF16 {
  static const float* row(const uint8_t* p, int64_t n, float* tmp) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const v16 v = f16_to_f32_16(p + 2 * i);
      __builtin_memcpy(tmp + i, &v, sizeof v);
    }
    for (; i < n; ++i) {
      uint16_t h;
      __builtin_memcpy(&h, p + 2 * i, 2);
      tmp[i] = f16_to_f32(h);
    }
    return tmp;
  }
  static inline __attribute__((always_inline)) v16 get16(const uint8_t* p, int64_t c) {
    return f16_to_f32_16(p + 2 * c);
  }
};
struct KvQ8 { // blocks of 32: f16 d, 32 int8; x = d q
  static inline __attribute__((always_inline)) float scale(const uint8_t* blk) {
    _Float16 d;
    __builtin_memcpy(&d, blk, 2);
    return static_cast<float>(d);
  }
  static const float* row(const uint8_t* p, int64_t n, float* tmp) {
    for (int64_t b = 0; b < n / 32; ++b) {
      const uint8_t* blk = p + 34 * b;
      const float d = scale(blk);
      const auto* q = reinterpret_cast<const int8_t*>(blk + 2);
#pragma omp simd
      for (int i = 0; i < 32; ++i)
        tmp[32 * b + i] = d * static_cast<float>(q[i]);
    }
    return tmp;
  }
  static inline __attribute__((always_inline)) v16 get16(const uint8_t* p, int64_t c) {
    typedef int8_t i16v __attribute__((vector_size(16), aligned(1)));
    const uint8_t* blk = p + 34 * (c / 32);
    i16v q;
    __builtin_memcpy(&q, blk + 2 + c % 32, sizeof q);
    return __builtin_convertvector(q, v16) * scale(blk);
  }
};

// HD > 0: head_dim known at compile time (loops fully unrolled); HD == 0: runtime `hd`.
template <class E, int HD>
__attribute__((always_inline)) inline void attend_impl(const float* q, const CacheRows& rows, int64_t n, int64_t hd_rt,
                                                       float scale, float* scores, float* out) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  const int64_t bt = rows.block_tokens;
  float tmp[HD > 0 ? HD : 512];
  // The first key the query sees (a sliding window starts later), and the
  // block it lies in: blocks before it are not read.
  const int64_t lo = rows.window > 0 ? std::max<int64_t>(0, n - rows.window) : 0;
  const int64_t b0 = lo / bt;
  const float cap = rows.softcap, inv_cap = cap > 0 ? 1.0f / cap : 0.f;
  // Walk the cache block by block: no division per row.
  float mx = -INFINITY;
  for (int64_t j0 = b0 * bt, b = b0; j0 < n; j0 += bt, ++b) {
    const int64_t first = std::max<int64_t>(lo - j0, 0);
    const uint8_t* kp = rows.blocks[b] + rows.k_offset + static_cast<std::size_t>(first) * rows.row_stride;
    const int64_t m = std::min(bt, n - j0);
    for (int64_t j = first; j < m; ++j, kp += rows.row_stride) {
      const float* k = E::row(kp, hd, tmp);
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < hd; ++i)
        s += q[i] * k[i];
      s *= scale;
      if (cap > 0)
        s = cap * std::tanh(s * inv_cap);
      scores[j0 + j] = s;
      mx = std::max(mx, s);
    }
  }
  // Softmax weights 16 at a time (a tail padded with -inf: weight 0), summed
  // in lanes, then across them in a fixed order.
  v16 sum16 = v16{};
  int64_t j = lo;
  for (; j + 16 <= n; j += 16) {
    const v16 e = exp16(load16(scores + j) - mx);
    __builtin_memcpy(scores + j, &e, sizeof e);
    sum16 += e;
  }
  if (j < n) {
    float tail[16];
    for (int t = 0; t < 16; ++t)
      tail[t] = j + t < n ? scores[j + t] - mx : -INFINITY;
    const v16 e = exp16(load16(tail));
    for (int t = 0; j + t < n; ++t)
      scores[j + t] = e[t];
    sum16 += e;
  }
  const float sum = hsum(sum16);
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < hd; ++i)
    out[i] = 0.f;
  for (int64_t j0 = b0 * bt, b = b0; j0 < n; j0 += bt, ++b) {
    const int64_t first = std::max<int64_t>(lo - j0, 0);
    const uint8_t* vp = rows.blocks[b] + rows.v_offset + static_cast<std::size_t>(first) * rows.row_stride;
    const int64_t m = std::min(bt, n - j0);
    for (int64_t j = first; j < m; ++j, vp += rows.row_stride) {
      const float* v = E::row(vp, hd, tmp);
      const float a = scores[j0 + j] * inv;
#pragma omp simd
      for (int64_t i = 0; i < hd; ++i)
        out[i] += a * v[i];
    }
  }
}

template <class E>
inline __attribute__((always_inline)) void attend_typed(const float* q, const CacheRows& rows, int64_t n, int64_t hd,
                                                        float scale, float* scores, float* out) {
  switch (hd) {
    case 8: return attend_impl<E, 8>(q, rows, n, hd, scale, scores, out);
    case 16: return attend_impl<E, 16>(q, rows, n, hd, scale, scores, out);
    case 32: return attend_impl<E, 32>(q, rows, n, hd, scale, scores, out);
    case 64: return attend_impl<E, 64>(q, rows, n, hd, scale, scores, out);
    case 128: return attend_impl<E, 128>(q, rows, n, hd, scale, scores, out);
    default: return attend_impl<E, 0>(q, rows, n, hd, scale, scores, out);
  }
}

} // namespace

__attribute__((target_clones("avx512f", "arch=x86-64-v3", "default"))) void attend(const float* q, const CacheRows& rows,
                                                                                     int64_t n, int64_t hd, float scale,
                                                                                     float* scores, float* out) {
  switch (rows.type) {
    case WType::bf16: return attend_typed<KvBf16>(q, rows, n, hd, scale, scores, out);
    case WType::f16: return attend_typed<KvF16>(q, rows, n, hd, scale, scores, out);
    case WType::q8_0: return attend_typed<KvQ8>(q, rows, n, hd, scale, scores, out);
    default: return attend_typed<KvF32>(q, rows, n, hd, scale, scores, out);
  }
}

namespace {

// SAME: the m rows are query heads of one position n0 (attend_heads): every lane
// sees keys 0..n0 (within the window), no causal staircase. LM: the lanes the
// value pass computes (m <= LM; the others hold no row).
template <class E, int HD, bool SAME = false, int LM = attend_group>
inline __attribute__((always_inline)) void attend_rows_impl(const float* q, int64_t q_stride, int64_t m,
                                                            const CacheRows& rows, int64_t n0, int64_t hd_rt,
                                                            float scale, float* scores_raw, float* out,
                                                            int64_t out_stride) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  constexpr int64_t L = attend_group;
  float tmp[HD > 0 ? HD : 512];
  // Queries transposed: qt[i] holds element i of every row's query, one row a lane.
  v16 qt[HD > 0 ? HD : 256];
  for (int64_t i = 0; i < hd; ++i) {
    float lane[L] = {};
    for (int64_t t = 0; t < m; ++t)
      lane[t] = q[t * q_stride + i];
    qt[i] = load16(lane);
  }
  const int64_t n = SAME ? n0 + 1 : n0 + m;
  const int64_t bt = rows.block_tokens;
  // Row t (at position n0 + t) sees keys [n0 + t + 1 - window, n0 + t]: the
  // earliest any row sees is row 0's first, and blocks before it are not read.
  const int64_t w = rows.window;
  const int64_t lo = w > 0 ? std::max<int64_t>(0, n0 + 1 - w) : 0;
  const int64_t b0 = lo / bt;
  const float cap = rows.softcap, inv_cap = cap > 0 ? 1.0f / cap : 0.f;
  v16u* S = reinterpret_cast<v16u*>(scores_raw);
  v16 lanes;
  for (int t = 0; t < L; ++t)
    lanes[t] = static_cast<float>(t);
  v16 mx = v16{} - INFINITY;
  for (int64_t j0 = b0 * bt, b = b0; j0 < n; j0 += bt, ++b) {
    const int64_t first = std::max<int64_t>(lo - j0, 0);
    const uint8_t* kp = rows.blocks[b] + rows.k_offset + static_cast<std::size_t>(first) * rows.row_stride;
    const int64_t cnt = std::min(bt, n - j0);
    for (int64_t j = first; j < cnt; ++j, kp += rows.row_stride) {
      const float* k = E::row(kp, hd, tmp);
      v16 acc = v16{};
      for (int64_t i = 0; i < hd; ++i)
        acc += qt[i] * k[i];
      acc *= scale;
      if (cap > 0)
        for (int t = 0; t < L; ++t)
          acc[t] = cap * std::tanh(acc[t] * inv_cap);
      const int64_t jj = j0 + j;
      if (!SAME && jj > n0) { // causal: lane t sees key jj only when jj <= n0 + t
        const v16 from = v16{} + static_cast<float>(jj - n0);
        acc = lanes >= from ? acc : v16{} - INFINITY;
      }
      if (!SAME && w > 0 && jj + w <= n0 + L - 1) { // window: lane t sees key jj only when n0 + t - jj < w
        const v16 until = v16{} + static_cast<float>(jj - n0 + w - 1);
        acc = lanes <= until ? acc : v16{} - INFINITY;
      }
      S[jj] = acc;
      mx = mx > acc ? mx : acc;
    }
  }
  v16 sum = v16{};
  for (int64_t j = lo; j < n; ++j) {
    const v16 e = exp16(S[j] - mx);
    S[j] = e;
    sum += e;
  }
  const v16 inv = 1.0f / sum;
  for (int64_t j = lo; j < n; ++j)
    S[j] = S[j] * inv; // probabilities; 0 where a row may not look
  if (hd % 16 == 0) {
    // 16 output columns of all rows at a time: each value row is read once.
    for (int64_t c = 0; c < hd; c += 16) {
      v16 acc[L];
#pragma GCC unroll 16
      for (int t = 0; t < L; ++t)
        acc[t] = v16{};
      for (int64_t j0 = b0 * bt, b = b0; j0 < n; j0 += bt, ++b) {
        const int64_t first = std::max<int64_t>(lo - j0, 0);
        const uint8_t* vp = rows.blocks[b] + rows.v_offset + static_cast<std::size_t>(first) * rows.row_stride;
        const int64_t cnt = std::min(bt, n - j0);
        for (int64_t j = first; j < cnt; ++j, vp += rows.row_stride) {
          const v16 vj = E::get16(vp, c);
          // Each lane's weight broadcast from memory (a load, folded into the
          // multiply-add), not extracted from a register (a shuffle each).
          const float* p = scores_raw + (j0 + j) * L;
#pragma GCC unroll 16
          for (int t = 0; t < LM; ++t)
            acc[t] += p[t] * vj;
        }
      }
      for (int64_t t = 0; t < m; ++t)
        __builtin_memcpy(out + t * out_stride + c, &acc[t], sizeof(v16));
    }
    return;
  }
  for (int64_t t = 0; t < m; ++t) {
    float* o = out + t * out_stride;
    for (int64_t i = 0; i < hd; ++i)
      o[i] = 0.f;
    const int64_t nt = SAME ? n : n0 + t + 1;
    for (int64_t j0 = b0 * bt, b = b0; j0 < nt; j0 += bt, ++b) {
      const int64_t first = std::max<int64_t>(lo - j0, 0);
      const uint8_t* vp = rows.blocks[b] + rows.v_offset + static_cast<std::size_t>(first) * rows.row_stride;
      const int64_t cnt = std::min(bt, nt - j0);
      for (int64_t j = first; j < cnt; ++j, vp += rows.row_stride) {
        const float* v = E::row(vp, hd, tmp);
        const float a = S[j0 + j][t];
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i)
          o[i] += a * v[i];
      }
    }
  }
}

template <class E>
inline __attribute__((always_inline)) void attend_rows_typed(const float* q, int64_t q_stride, int64_t m,
                                                             const CacheRows& rows, int64_t n0, int64_t hd, float scale,
                                                             float* scores, float* out, int64_t out_stride) {
  switch (hd) {
    case 64: return attend_rows_impl<E, 64>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
    case 128: return attend_rows_impl<E, 128>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
    case 8: return attend_rows_impl<E, 8>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
    case 16: return attend_rows_impl<E, 16>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
    case 32: return attend_rows_impl<E, 32>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
    default: return attend_rows_impl<E, 0>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
  }
}

} // namespace

__attribute__((target_clones("avx512f", "arch=x86-64-v3", "default"))) void attend_rows(const float* q, int64_t q_stride,
                                                                                          int64_t m, const CacheRows& rows,
                                                                                          int64_t n0, int64_t hd,
                                                                                          float scale, float* scores,
                                                                                          float* out, int64_t out_stride) {
  switch (rows.type) {
    case WType::bf16: return attend_rows_typed<KvBf16>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
    case WType::f16: return attend_rows_typed<KvF16>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
    case WType::q8_0: return attend_rows_typed<KvQ8>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
    default: return attend_rows_typed<KvF32>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
  }
}

namespace {

// The value pass over as few lanes as hold heads (groups of 2-4, 5-8, 9-16).
template <class E, int LM>
inline __attribute__((always_inline)) void attend_heads_lanes(const float* q, int64_t m, const CacheRows& rows, int64_t n,
                                                              int64_t hd, float scale, float* scores, float* out) {
  switch (hd) {
    case 64: return attend_rows_impl<E, 64, true, LM>(q, hd, m, rows, n - 1, hd, scale, scores, out, hd);
    case 128: return attend_rows_impl<E, 128, true, LM>(q, hd, m, rows, n - 1, hd, scale, scores, out, hd);
    default: return attend_rows_impl<E, 0, true, LM>(q, hd, m, rows, n - 1, hd, scale, scores, out, hd);
  }
}

template <class E>
inline __attribute__((always_inline)) void attend_heads_typed(const float* q, int64_t m, const CacheRows& rows, int64_t n,
                                                              int64_t hd, float scale, float* scores, float* out) {
  if (m <= 4)
    return attend_heads_lanes<E, 4>(q, m, rows, n, hd, scale, scores, out);
  if (m <= 8)
    return attend_heads_lanes<E, 8>(q, m, rows, n, hd, scale, scores, out);
  return attend_heads_lanes<E, 16>(q, m, rows, n, hd, scale, scores, out);
}

} // namespace

__attribute__((target_clones("avx512f", "arch=x86-64-v3", "default"))) void attend_heads(const float* q, int64_t m,
                                                                                           const CacheRows& rows, int64_t n,
                                                                                           int64_t hd, float scale,
                                                                                           float* scores, float* out) {
  switch (rows.type) {
    case WType::bf16: return attend_heads_typed<KvBf16>(q, m, rows, n, hd, scale, scores, out);
    case WType::f16: return attend_heads_typed<KvF16>(q, m, rows, n, hd, scale, scores, out);
    case WType::q8_0: return attend_heads_typed<KvQ8>(q, m, rows, n, hd, scale, scores, out);
    default: return attend_heads_typed<KvF32>(q, m, rows, n, hd, scale, scores, out);
  }
}

namespace {

// 8 independent multiply-add chains on the widest vectors: the FMA units' peak.
__attribute__((target_clones("avx512f", "avx2", "default"))) double fma_loop(int64_t iters) {
  v16 a[8], b = load16(std::array<float, 16>{1.000001f, 1.000001f, 1.000001f, 1.000001f, 1.000001f, 1.000001f,
                                             1.000001f, 1.000001f, 1.000001f, 1.000001f, 1.000001f, 1.000001f,
                                             1.000001f, 1.000001f, 1.000001f, 1.000001f}
                                 .data());
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

} // namespace

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
