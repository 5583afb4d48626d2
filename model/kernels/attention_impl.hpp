#pragma once
// Internal to model/kernels: the attention kernels as templates over the cache's
// stored type (E) and, where it pays, the head size (HD, 0: known at run time).
// Each cache type is compiled in a file of its own (attention_<type>.cpp, through
// STRATA_ATTENTION_KERNELS): they build in parallel, and one type's kernels do
// not wait for the others'.

#include "model/formats/quant.hpp"
#include "model/kernels/attention.hpp"
#include "model/kernels/vec.hpp"

#include <algorithm>
#include <cmath>

namespace strata::model::detail {

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
  static constexpr int64_t bytes(int64_t n) { return 4 * n; } // of n values (a whole number of blocks)
  static const float* row(const uint8_t* p, int64_t, float*) { return reinterpret_cast<const float*>(p); }
  static inline __attribute__((always_inline)) v16 get16(const uint8_t* p, int64_t c) {
    return load16(reinterpret_cast<const float*>(p) + c);
  }
};
struct KvBf16 {
  static constexpr int64_t bytes(int64_t n) { return 2 * n; }
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
  static constexpr int64_t bytes(int64_t n) { return 2 * n; }
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
  static constexpr int64_t bytes(int64_t n) { return 34 * (n / 32); }
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


// Prefetches `bytes` from byte `at` of the first `count` rows of block `b`
// (from byte `offset` of each row); nothing when count <= 0.
inline __attribute__((always_inline)) void prefetch_block(const CacheRows& rows, int64_t b, int64_t count,
                                                          std::size_t offset, int64_t at, int64_t bytes) {
  if (count <= 0)
    return;
  const uint8_t* p = rows.blocks[b] + offset + at;
  for (int64_t r = 0; r < count; ++r, p += rows.row_stride)
    for (int64_t l = 0; l < bytes; l += 64)
      __builtin_prefetch(p + l, 0, 3);
}

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
  // Key jj's scores (acc: the dot products of every lane) scaled, capped,
  // masked, stored, and into the running maximum.
  auto finish = [&](int64_t jj, v16 acc) __attribute__((always_inline)) {
    acc *= scale;
    if (cap > 0)
      for (int t = 0; t < L; ++t)
        acc[t] = cap * std::tanh(acc[t] * inv_cap);
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
  };
  // Four keys at a time in four independent chains (one chain of hd dependent
  // multiply-adds per key waited on the previous one's latency: about 80 ns a
  // key at head size 64); each lane still adds its products in order i = 0 ..
  // hd-1, so every score is the same bits as one key at a time.
  float tmp4[4][HD > 0 ? HD : 512];
  prefetch_block(rows, b0 + 1, std::min(bt, n - (b0 + 1) * bt), rows.k_offset, 0, E::bytes(hd));
  for (int64_t j0 = b0 * bt, b = b0; j0 < n; j0 += bt, ++b) {
    const int64_t first = std::max<int64_t>(lo - j0, 0);
    const uint8_t* kp = rows.blocks[b] + rows.k_offset + static_cast<std::size_t>(first) * rows.row_stride;
    const int64_t cnt = std::min(bt, n - j0);
    const std::size_t rs = rows.row_stride;
    // The next block's keys of this head, ahead of use: blocks lie anywhere in
    // the pool, so the hardware prefetcher starts over at each one.
    prefetch_block(rows, b + 2, std::min(bt, n - j0 - 2 * bt), rows.k_offset, 0, E::bytes(hd));
    int64_t j = first;
    for (; j + 4 <= cnt; j += 4, kp += 4 * rs) {
      const float* k0 = E::row(kp, hd, tmp4[0]);
      const float* k1 = E::row(kp + rs, hd, tmp4[1]);
      const float* k2 = E::row(kp + 2 * rs, hd, tmp4[2]);
      const float* k3 = E::row(kp + 3 * rs, hd, tmp4[3]);
      v16 a0 = v16{}, a1 = v16{}, a2 = v16{}, a3 = v16{};
#pragma GCC unroll 4
      for (int64_t i = 0; i < hd; ++i) {
        const v16 qi = qt[i];
        a0 += qi * k0[i];
        a1 += qi * k1[i];
        a2 += qi * k2[i];
        a3 += qi * k3[i];
      }
      const v16 a[4] = {a0, a1, a2, a3};
#pragma GCC unroll 1
      for (int u = 0; u < 4; ++u)
        finish(j0 + j + u, a[u]);
    }
    for (; j < cnt; ++j, kp += rs) {
      const float* k = E::row(kp, hd, tmp);
      v16 acc = v16{};
      for (int64_t i = 0; i < hd; ++i)
        acc += qt[i] * k[i];
      finish(j0 + j, acc);
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
      // These columns of the values two blocks ahead (a block's 16 keys take
      // less time than a fetch from memory).
      const int64_t v_at = E::bytes(c), v_bytes = std::max<int64_t>(E::bytes(16), 34);
      prefetch_block(rows, b0 + 1, std::min(bt, n - (b0 + 1) * bt), rows.v_offset, v_at, v_bytes);
      for (int64_t j0 = b0 * bt, b = b0; j0 < n; j0 += bt, ++b) {
        const int64_t first = std::max<int64_t>(lo - j0, 0);
        const uint8_t* vp = rows.blocks[b] + rows.v_offset + static_cast<std::size_t>(first) * rows.row_stride;
        const int64_t cnt = std::min(bt, n - j0);
        prefetch_block(rows, b + 2, std::min(bt, n - j0 - 2 * bt), rows.v_offset, v_at, v_bytes);
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


// The head sizes with a kernel of their own (loops unrolled at compile time):
// every other size goes through the run-time loop, with the same arithmetic.
template <class E>
inline __attribute__((always_inline)) void attend_typed(const float* q, const CacheRows& rows, int64_t n, int64_t hd,
                                                        float scale, float* scores, float* out) {
  switch (hd) {
    case 64: return attend_impl<E, 64>(q, rows, n, hd, scale, scores, out);
    case 128: return attend_impl<E, 128>(q, rows, n, hd, scale, scores, out);
    default: return attend_impl<E, 0>(q, rows, n, hd, scale, scores, out);
  }
}

template <class E>
inline __attribute__((always_inline)) void attend_rows_typed(const float* q, int64_t q_stride, int64_t m,
                                                             const CacheRows& rows, int64_t n0, int64_t hd, float scale,
                                                             float* scores, float* out, int64_t out_stride) {
  switch (hd) {
    case 64: return attend_rows_impl<E, 64>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
    case 128: return attend_rows_impl<E, 128>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
    default: return attend_rows_impl<E, 0>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
  }
}

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

} // namespace strata::model::detail

// The three entry points for one cache type E, named attend*_<name>, each built
// for AVX-512, x86-64-v3 (AVX2, FMA) and the baseline, chosen at load time.
#define STRATA_ATTENTION_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#define STRATA_ATTENTION_KERNELS(E, name)                                                                         \
  namespace strata::model::detail {                                                                              \
  STRATA_ATTENTION_CLONES void attend_##name(const float* q, const CacheRows& rows, int64_t n, int64_t hd,        \
                                             float scale, float* scores, float* out) {                           \
    attend_typed<E>(q, rows, n, hd, scale, scores, out);                                                          \
  }                                                                                                               \
  STRATA_ATTENTION_CLONES void attend_rows_##name(const float* q, int64_t q_stride, int64_t m,                    \
                                                  const CacheRows& rows, int64_t n0, int64_t hd, float scale,    \
                                                  float* scores, float* out, int64_t out_stride) {               \
    attend_rows_typed<E>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);                           \
  }                                                                                                               \
  STRATA_ATTENTION_CLONES void attend_heads_##name(const float* q, int64_t m, const CacheRows& rows, int64_t n,  \
                                                   int64_t hd, float scale, float* scores, float* out) {         \
    attend_heads_typed<E>(q, m, rows, n, hd, scale, scores, out);                                                 \
  }                                                                                                               \
  }
