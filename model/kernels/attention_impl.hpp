#pragma once
// Internal to model/kernels: the attention kernels as templates over the cache's
// stored type (E) and, where it pays, the head size (HD, 0: known at run time).
// Each cache type is compiled in a file of its own (attention_<type>.cpp, through
// STRATA_ATTENTION_KERNELS): they build in parallel, and one type's kernels do
// not wait for the others'.
//
// A file that defines STRATA_ATTENTION_AVX512 (attention_<type>_avx512.cpp)
// includes this header after its library headers and <immintrin.h>, under
// `#pragma GCC target` for AVX-512 with F16C: there the f16 values (an f16
// cache's, a q8_0 block's scale) convert with vcvtph2ps, one instruction for 16
// values, instead of the integer arithmetic every target can run. Each build
// lives in a namespace of its own (STRATA_ATTENTION_NS), so no inline function
// here is ever shared between translation units built for different targets.
//
// A file that defines STRATA_ATTENTION_AVX2 (attention_<type>_avx2.cpp) builds
// them for AVX2 with FMA and F16C: there the 16-lane vectors (v16, vu16, vi16)
// are vec_ops.hpp's two halves of 8, which GCC keeps in registers, where it
// keeps a 64-byte vector in memory. The code is written once for both: vector
// selects, casts, conversions and loads go through vec_ops.hpp's helpers.

#include "model/formats/quant.hpp"
#include "model/kernels/attention.hpp"
#include "model/kernels/vec.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>

#ifndef STRATA_ATTENTION_NS
#define STRATA_ATTENTION_NS portable
#endif

namespace strata::model::detail::STRATA_ATTENTION_NS {

#ifdef STRATA_ATTENTION_AVX2
#define STRATA_VEC_PAIR
#endif
#include "model/kernels/vec_ops.hpp"
#undef STRATA_VEC_PAIR

#ifdef STRATA_ATTENTION_AVX2
using v16 = pair16<v8>;
using vu16 = pair16<vu8>;
using vi16 = pair16<vi8>;
// Accumulators a kernel may keep in registers, in 16-lane vectors.
constexpr int wide_registers = 8;
// 16 uint16 values at p, each into a 32-bit lane.
inline __attribute__((always_inline)) vu16 widen_u16(const uint8_t* p) {
  return {reinterpret_cast<vu8>(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))),
          reinterpret_cast<vu8>(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))))};
}
#else
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
#ifdef STRATA_ATTENTION_AVX512
constexpr int wide_registers = 16;
#else
constexpr int wide_registers = 0; // known at run time: wide_registers_here()
#endif
inline __attribute__((always_inline)) vu16 widen_u16(const uint8_t* p) {
  typedef uint16_t h16 __attribute__((vector_size(32), aligned(2)));
  h16 h;
  __builtin_memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vu16);
}
#endif

// e^x for 16 lanes at once (vec_ops.hpp's vexp: -inf, a masked score, gives
// exactly 0). Lane by lane a pure function of its input, so a score gets the
// same weight whichever kernel, lane or batch it is computed in.
inline __attribute__((always_inline)) v16 exp16(v16 x) { return vexp<v16, vi16>(x); }

// f16 bits to f32 with integer and float vector operations only (every target
// clone has them; a _Float16 conversion would be a library call per value on
// CPUs without AVX-512 FP16): exponent and mantissa shifted into place and
// rebiased by one exact multiplication (normals and subnormals alike), inf and
// NaN kept, the sign put back. Where the file is built for F16C, vcvtph2ps:
// the same values.
#if defined(STRATA_ATTENTION_AVX512)
// f16 bits (the low half of each 32-bit lane, the high half zero) to f32: the
// halves packed (vpmovdw), then vcvtph2ps. Exact, as the arithmetic below.
inline __attribute__((always_inline)) v16 f16_bits_to_f32(vu16 x) {
  return reinterpret_cast<v16>(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(x))));
}
inline __attribute__((always_inline)) v16 f16_to_f32_16(const uint8_t* p) {
  return reinterpret_cast<v16>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
#elif defined(STRATA_ATTENTION_AVX2)
// Each half's 8 lanes packed to 16 bits (vpackusdw: the high halves are zero),
// then vcvtph2ps.
inline __attribute__((always_inline)) v8 f16_bits_to_f32_8(vu8 x) {
  const __m256i v = reinterpret_cast<__m256i>(x);
  return reinterpret_cast<v8>(
    _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1))));
}
inline __attribute__((always_inline)) v16 f16_bits_to_f32(vu16 x) {
  return {f16_bits_to_f32_8(x.lo), f16_bits_to_f32_8(x.hi)};
}
inline __attribute__((always_inline)) v16 f16_to_f32_16(const uint8_t* p) {
  return {reinterpret_cast<v8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))),
          reinterpret_cast<v8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))))};
}
#else
// f16 bits (the low half of each 32-bit lane, the high half zero) to f32.
inline __attribute__((always_inline)) v16 f16_bits_to_f32(vu16 x) {
  const vu16 em = x & 0x7fffu;
  const v16 scaled = vcast<v16>(em << 13) * 0x1p112f;
  const vu16 special = vcast<vu16>(em >= 0x7c00u); // inf / NaN: all ones where so
  const vu16 bits = (vcast<vu16>(scaled) & ~special) | ((0x7f800000u | ((em & 0x3ffu) << 13)) & special);
  return vcast<v16>(bits | ((x & 0x8000u) << 16));
}
inline __attribute__((always_inline)) v16 f16_to_f32_16(const uint8_t* p) {
  return f16_bits_to_f32(widen_u16(p));
}
#endif

// Transposes 16 vectors of 16 lanes in place (R[r][c] becomes R[c][r]): the
// off-diagonal halves of each 2B x 2B square swap, for B = 8, 4, 2, 1.
template <int B>
inline __attribute__((always_inline)) void transpose_stage(vu16* R) {
#define STRATA_IA(c) (((c) & B) ? 16 + (c) - B : (c))
#define STRATA_IB(c) (((c) & B) ? 16 + (c) : (c) + B)
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r)
    if ((r & B) == 0) {
      const vu16 a = R[r], b = R[r + B];
      R[r] = __builtin_shufflevector(a, b, STRATA_IA(0), STRATA_IA(1), STRATA_IA(2), STRATA_IA(3), STRATA_IA(4),
                                     STRATA_IA(5), STRATA_IA(6), STRATA_IA(7), STRATA_IA(8), STRATA_IA(9),
                                     STRATA_IA(10), STRATA_IA(11), STRATA_IA(12), STRATA_IA(13), STRATA_IA(14),
                                     STRATA_IA(15));
      R[r + B] = __builtin_shufflevector(a, b, STRATA_IB(0), STRATA_IB(1), STRATA_IB(2), STRATA_IB(3), STRATA_IB(4),
                                         STRATA_IB(5), STRATA_IB(6), STRATA_IB(7), STRATA_IB(8), STRATA_IB(9),
                                         STRATA_IB(10), STRATA_IB(11), STRATA_IB(12), STRATA_IB(13), STRATA_IB(14),
                                         STRATA_IB(15));
    }
#undef STRATA_IA
#undef STRATA_IB
}
#ifdef STRATA_ATTENTION_AVX2
// The same on two halves: for B = 8 the squares are whole halves, which swap;
// for B < 8 each half's lanes move as above, within the half.
template <int B>
inline __attribute__((always_inline)) void transpose_stage_halves(vu16* R) {
#define STRATA_IA(c) (((c) & B) ? 8 + (c) - B : (c))
#define STRATA_IB(c) (((c) & B) ? 8 + (c) : (c) + B)
#define STRATA_SHUF(a, b, I) __builtin_shufflevector(a, b, I(0), I(1), I(2), I(3), I(4), I(5), I(6), I(7))
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r)
    if ((r & B) == 0) {
      const vu16 a = R[r], b = R[r + B];
      R[r] = {STRATA_SHUF(a.lo, b.lo, STRATA_IA), STRATA_SHUF(a.hi, b.hi, STRATA_IA)};
      R[r + B] = {STRATA_SHUF(a.lo, b.lo, STRATA_IB), STRATA_SHUF(a.hi, b.hi, STRATA_IB)};
    }
#undef STRATA_SHUF
#undef STRATA_IA
#undef STRATA_IB
}
inline __attribute__((always_inline)) void transpose16(vu16* R) {
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) {
    const vu16 a = R[r], b = R[r + 8];
    R[r] = {a.lo, b.lo};
    R[r + 8] = {a.hi, b.hi};
  }
  transpose_stage_halves<4>(R);
  transpose_stage_halves<2>(R);
  transpose_stage_halves<1>(R);
}
#else
inline __attribute__((always_inline)) void transpose16(vu16* R) {
  transpose_stage<8>(R);
  transpose_stage<4>(R);
  transpose_stage<2>(R);
  transpose_stage<1>(R);
}
#endif

// Bytes [at, at + len) of each of 16 rows into the lanes' first len bytes (the
// rest zero), then transposed: R[u] holds 32-bit unit u of every row.
inline __attribute__((always_inline)) void load_units(const uint8_t* const* p, int64_t at, int64_t len, vu16* R) {
  for (int r = 0; r < 16; ++r) {
    if (len == 64) {
      R[r] = vload<vu16>(p[r] + at);
    } else {
      R[r] = vu16{};
      __builtin_memcpy(&R[r], p[r] + at, static_cast<std::size_t>(len));
    }
  }
  transpose16(R);
}

// Cached rows in their stored type, read as f32: E::row(p, n, tmp) gives the n
// values at p as floats (p itself for f32, else converted into tmp); E::get16(p,
// c) the 16 values from c (c a multiple of 16).
// E::keys16(p, hd, kt) (not q8_0, whose scores are integers): the hd values of
// 16 rows (p[r], as E::row reads them) transposed: kt[i] holds value i of every
// row, one row a lane.
struct KvF32 {
  static constexpr int64_t bytes(int64_t n) { return 4 * n; } // of n values (a whole number of blocks)
  static inline __attribute__((always_inline)) void keys16(const uint8_t* const* p, int64_t hd, v16* kt) {
#pragma GCC unroll 1
    for (int64_t c0 = 0; c0 < hd; c0 += 16) {
      const int64_t w = std::min<int64_t>(16, hd - c0);
      vu16 R[16];
      load_units(p, 4 * c0, 4 * w, R);
      for (int64_t c = 0; c < w; ++c)
        kt[c0 + c] = vcast<v16>(R[c]);
    }
  }
  static const float* row(const uint8_t* p, int64_t, float*) { return reinterpret_cast<const float*>(p); }
  static inline __attribute__((always_inline)) v16 get16(const uint8_t* p, int64_t c) {
    return vload<v16>(p + 4 * c);
  }
};
// Two 16-bit values a 32-bit unit: value 2u in its low half, 2u + 1 in its high.
template <class Conv>
inline __attribute__((always_inline)) void keys16_pairs(const uint8_t* const* p, int64_t hd, v16* kt, Conv conv) {
#pragma GCC unroll 1
  for (int64_t c0 = 0; c0 < hd; c0 += 32) {
    const int64_t w = std::min<int64_t>(32, hd - c0);
    vu16 R[16];
    load_units(p, 2 * c0, 2 * w, R);
    for (int64_t u = 0; 2 * u < w; ++u) {
      kt[c0 + 2 * u] = conv(R[u] & 0xffffu);
      if (2 * u + 1 < w)
        kt[c0 + 2 * u + 1] = conv(R[u] >> 16);
    }
  }
}
struct KvBf16 {
  static constexpr int64_t bytes(int64_t n) { return 2 * n; }
  static inline __attribute__((always_inline)) void keys16(const uint8_t* const* p, int64_t hd, v16* kt) {
    keys16_pairs(p, hd, kt, [](vu16 b) __attribute__((always_inline)) { return vcast<v16>(b << 16); });
  }
  static const float* row(const uint8_t* p, int64_t n, float* tmp) {
    const auto* h = reinterpret_cast<const uint16_t*>(p);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i)
      tmp[i] = __builtin_bit_cast(float, static_cast<uint32_t>(h[i]) << 16);
    return tmp;
  }
  static inline __attribute__((always_inline)) v16 get16(const uint8_t* p, int64_t c) {
    return vcast<v16>(widen_u16(p + 2 * c) << 16);
  }
};
struct KvF16 {
  static constexpr int64_t bytes(int64_t n) { return 2 * n; }
  static inline __attribute__((always_inline)) void keys16(const uint8_t* const* p, int64_t hd, v16* kt) {
    keys16_pairs(p, hd, kt, [](vu16 b) __attribute__((always_inline)) { return f16_bits_to_f32(b); });
  }
  static const float* row(const uint8_t* p, int64_t n, float* tmp) {
    const int64_t whole = n & ~int64_t{15};
    for (int64_t i = 0; i < whole; i += 16) {
      const v16 v = f16_to_f32_16(p + 2 * i);
      vstore(tmp + i, v);
    }
    for (int64_t i = whole; i < n; ++i) {
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
  // The f16 scale as f32 by f16_bits_to_f32's arithmetic on one lane (a
  // _Float16 conversion is a library call where AVX-512 FP16 is missing), or
  // by vcvtph2ps where the file is built for AVX-512.
  static inline __attribute__((always_inline)) float scale(const uint8_t* blk) {
    uint16_t h;
    __builtin_memcpy(&h, blk, 2);
#if defined(STRATA_ATTENTION_AVX512) || defined(STRATA_ATTENTION_AVX2)
    return _cvtsh_ss(h);
#else
    const uint32_t x = h, em = x & 0x7fffu;
    float f = __builtin_bit_cast(float, em << 13) * 0x1p112f;
    if (em >= 0x7c00u)
      f = __builtin_bit_cast(float, 0x7f800000u | ((em & 0x3ffu) << 13));
    return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, f) | ((x & 0x8000u) << 16));
#endif
  }
  // (no keys16: its scores are integers, heads_scores_q8_impl)
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
    const uint8_t* blk = p + 34 * (c / 32);
#ifdef STRATA_ATTENTION_AVX512
    // (vpmovsxbd, vcvtdq2ps)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + c % 32));
    return reinterpret_cast<v16>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))) * scale(blk);
#elif defined(STRATA_ATTENTION_AVX2)
    // (vpmovsxbd, vcvtdq2ps; 8 values a half)
    const uint8_t* q = blk + 2 + c % 32;
    const v16 x{reinterpret_cast<v8>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))))),
                reinterpret_cast<v8>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)))))};
    return x * scale(blk);
#else
    typedef int8_t i16v __attribute__((vector_size(16), aligned(1)));
    typedef int16_t s16v __attribute__((vector_size(32)));
    i16v q;
    __builtin_memcpy(&q, blk + 2 + c % 32, sizeof q);
    // (int8 -> int16 -> int32 -> float: GCC 12 widens int8 to int32 in one step
    // one byte at a time, and int8 to float lane by lane)
    return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(q, s16v), vi16), v16) * scale(blk);
#endif
  }
};

// Scores over a q8_0 cache in integers, as llama.cpp computes them: each query
// is quantized to q8_0 blocks as the cache quantizes a row
// (quantize_q8_0_block), each block's 32 products of
// int8 keys and queries are summed exactly in int32, and the score adds the
// blocks in order: s = s + float(sum_b) * (d_key_b * d_query_b). The product of
// two f16 scales is exact in f32, and an exact integer sum does not depend on
// how it was added up, so every kernel and build gives the same bits however it
// lays out keys and queries (keys in lanes at decode, query rows in lanes in
// prefill). Where the file is built with AVX-512 VNNI (vpdpbusd: unsigned by
// signed bytes) the keys' bytes go in offset by 128 (x ^ 0x80) and 128 times the
// block's sum of query bytes comes off again; AVX2 multiplies |k| by q with
// k's sign (vpsignb, vpmaddubsw: no pair exceeds 16 bits) and adds pairs
// (vpmaddwd); the plain build multiplies in floats, exactly (below).
struct QueryQ8 {
  uint32_t q4[max_head_dim / 4]; // four int8 values a word, in order
  float d[max_head_dim / 32];    // each block's scale (an f16 value)
  int32_t bias[max_head_dim / 32]; // 128 x the block's sum of values (VNNI's offset)
};
inline __attribute__((always_inline)) void quantize_query_q8(const float* x, int64_t hd, QueryQ8& out) {
  for (int64_t b = 0; b < hd / 32; ++b) {
    uint8_t blk[34];
    quantize_q8_0_block(x + 32 * b, blk);
    uint16_t h;
    __builtin_memcpy(&h, blk, 2);
    out.d[b] = f16_to_f32(h);
    __builtin_memcpy(&out.q4[8 * b], blk + 2, 32);
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i)
      sum += static_cast<int8_t>(blk[2 + i]);
    out.bias[b] = 128 * sum;
  }
}
#if defined(STRATA_ATTENTION_VNNI) || defined(STRATA_ATTENTION_AVX2)
using dot_acc = vi16;
inline __attribute__((always_inline)) v16 dot_float(vi16 acc) { return vconvert<v16>(acc); }
#endif
#if defined(STRATA_ATTENTION_VNNI)
constexpr bool dot_biased = true;
// acc + sum over the 4 bytes of each lane of (a + 128) * b, b's 4 bytes in every lane
inline __attribute__((always_inline)) vi16 dot4(vi16 acc, vu16 a_flipped, uint32_t b4) {
  return reinterpret_cast<vi16>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc), reinterpret_cast<__m512i>(a_flipped),
                                                    _mm512_set1_epi32(static_cast<int>(b4))));
}
inline __attribute__((always_inline)) vu16 dot_flip(vu16 a) { return a ^ 0x80808080u; }
inline __attribute__((always_inline)) uint32_t dot_flip(uint32_t a) { return a ^ 0x80808080u; }
// acc + sum of a * (b + 128), b in each lane, a's 4 bytes in every lane (b's
// offset: 128 x the sum of a's bytes comes off)
inline __attribute__((always_inline)) vi16 dot4_lanes(vi16 acc, vu16 b, uint32_t a4_flipped) {
  return reinterpret_cast<vi16>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc),
                                                    _mm512_set1_epi32(static_cast<int>(a4_flipped)),
                                                    reinterpret_cast<__m512i>(b)));
}
#elif defined(STRATA_ATTENTION_AVX2)
constexpr bool dot_biased = false;
inline __attribute__((always_inline)) vi8 dot4_half(vi8 acc, vu8 a, __m256i b) {
  const __m256i k = reinterpret_cast<__m256i>(a);
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(k, k), _mm256_sign_epi8(b, k));
  return acc + reinterpret_cast<vi8>(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
inline __attribute__((always_inline)) vi16 dot4(vi16 acc, vu16 a, uint32_t b4) {
  const __m256i b = _mm256_set1_epi32(static_cast<int>(b4));
  return {dot4_half(acc.lo, a.lo, b), dot4_half(acc.hi, a.hi, b)};
}
inline __attribute__((always_inline)) vu16 dot_flip(vu16 a) { return a; }
inline __attribute__((always_inline)) uint32_t dot_flip(uint32_t a) { return a; }
inline __attribute__((always_inline)) vi16 dot4_lanes(vi16 acc, vu16 b, uint32_t a4) { return dot4(acc, b, a4); }
#else
constexpr bool dot_biased = false;
// (integer products and sums of 32 of them stay below 2^24: in floats they are
// exact, the same numbers as in int32, and a float multiply-add takes a
// fraction of a 32-bit integer multiply's time)
using dot_acc = v16;
inline __attribute__((always_inline)) v16 dot4(v16 acc, vu16 a, uint32_t b4) {
  const vi16 x = vcast<vi16>(a);
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k)
    acc += vconvert<v16>((x << (24 - 8 * k)) >> 24) *
           static_cast<float>(static_cast<int32_t>(b4 << (24 - 8 * k)) >> 24);
  return acc;
}
inline __attribute__((always_inline)) vu16 dot_flip(vu16 a) { return a; }
inline __attribute__((always_inline)) uint32_t dot_flip(uint32_t a) { return a; }
inline __attribute__((always_inline)) v16 dot4_lanes(v16 acc, vu16 b, uint32_t a4) { return dot4(acc, b, a4); }
inline __attribute__((always_inline)) v16 dot_float(v16 acc) { return acc; }
#endif

// A score plus one block's integer sum: s + float(sum) * (d_key * d_query),
// the one arithmetic every q8_0 score kernel and build uses (VNNI's offset
// taken off first).
template <class B>
inline __attribute__((always_inline)) v16 add_q8_block(v16 s, dot_acc sum, B bias, v16 scales) {
  if constexpr (dot_biased)
    sum -= bias;
  return s + dot_float(sum) * scales;
}

// HD > 0: head_dim known at compile time (loops fully unrolled); HD == 0: runtime `hd`.

// How many 16-lane accumulators this build keeps in registers: 16 on AVX-512
// (32 registers), 8 on AVX2 (16 registers, two a vector: the rest of a loop
// needs the others), 2 on the baseline's SSE (16 registers, four a vector).
inline __attribute__((always_inline)) int wide_registers_here() {
  if constexpr (wide_registers > 0)
    return wide_registers;
  return __builtin_cpu_supports("avx512f") ? 16 : 2;
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

// The value pass of m <= L lanes over keys [lo, n), output columns [c0, c1)
// (c1 - c0 a multiple of 16 x CW, c0 of 16), 16 x CW columns at a time, each
// value row read once for all lanes: lane t's weight of key j at
// at(j)[STRIDE * t], its output at out + t * out_stride. Each output column adds
// the keys in order whatever CW is, and whatever other columns the call has.
// In runs of blocks of about value_run_bytes() of [c0, c1): every pass of columns
// over one run, then the next run (the passes' sums kept in `out` between
// runs: a store and a load of a float change no bits), so that a run's value
// rows come from memory once and its later passes find them in the L2 cache.
// Pass by pass over the whole cache, a cache larger than L2 came from memory
// once a pass (Qwen2.5-0.5B's f32 cache at 8,192 tokens: 2 MB a kv head and
// layer, two passes of 32 columns).
template <class E, int L, int STRIDE, int CW, class At>
inline __attribute__((always_inline)) void value_columns_w(const CacheRows& rows, int64_t lo, int64_t n, int64_t c0,
                                                           int64_t c1, int64_t m, At at, float* out,
                                                           int64_t out_stride) {
  const int64_t bt = rows.block_tokens, b0 = lo / bt;
  const std::size_t rs = rows.row_stride;
  const int64_t v_at = E::bytes(c0), v_bytes = std::max<int64_t>(E::bytes(c1 - c0), 34);
  const int64_t run_blocks = std::max<int64_t>(1, value_run_bytes() / (bt * v_bytes));
  // The columns [c0, c1) of the values one block ahead (a block's keys take
  // less time than a fetch from memory); then, in each run's first pass, those
  // of the block two ahead.
  prefetch_block(rows, b0 + 1, std::min(bt, n - (b0 + 1) * bt), rows.v_offset, v_at, v_bytes);
  for (int64_t r0 = b0 * bt; r0 < n; r0 += run_blocks * bt) {
    const int64_t r1 = std::min(n, r0 + run_blocks * bt);
    for (int64_t c = c0; c < c1; c += 16 * CW) {
      v16 acc[L][CW];
#pragma GCC unroll 16
      for (int t = 0; t < L; ++t) // (constant indices: a run-time one would keep acc in memory)
        for (int u = 0; u < CW; ++u)
          acc[t][u] = r0 == b0 * bt || t >= m ? v16{} : vload<v16>(out + t * out_stride + c + 16 * u);
      for (int64_t j0 = r0, b = r0 / bt; j0 < r1; j0 += bt, ++b) {
        const int64_t first = std::max<int64_t>(lo - j0, 0);
        const uint8_t* vp = rows.blocks[b] + rows.v_offset + static_cast<std::size_t>(first) * rs;
        const int64_t cnt = std::min(bt, n - j0);
        // Row r of the block two ahead while row r of this one is read (the
        // run's first pass): the prefetches spread over the block's work (a
        // burst of a whole block's filled the line buffers and stalled the
        // loads behind it).
        const int64_t ahead = c == c0 ? std::min(bt, n - j0 - 2 * bt) : 0;
        const uint8_t* pf = ahead > 0 ? rows.blocks[b + 2] + rows.v_offset + v_at + static_cast<std::size_t>(first) * rs
                                      : nullptr;
        for (int64_t j = j0 + first; j < j0 + cnt; ++j, vp += rs) {
          if (j - j0 < ahead) {
            for (int64_t l = 0; l < v_bytes; l += 64)
              __builtin_prefetch(pf + l, 0, 3);
            pf += rs;
          }
          // Each lane's weight broadcast from memory (a load, folded into the
          // multiply-add), not extracted from a register (a shuffle each).
          const float* p = at(j);
#pragma GCC unroll 8
          for (int u = 0; u < CW; ++u) {
            const v16 vj = E::get16(vp, c + 16 * u);
#pragma GCC unroll 16
            for (int t = 0; t < L; ++t)
              acc[t][u] += p[STRIDE * t] * vj;
          }
        }
      }
#pragma GCC unroll 16
      for (int t = 0; t < L; ++t)
        if (t < m)
          for (int u = 0; u < CW; ++u)
            vstore(out + t * out_stride + c + 16 * u, acc[t][u]);
    }
  }
}

// As many columns per pass as L x CW accumulators fit the registers (16 v16
// with AVX-512's 32 registers, 8 with AVX2's 16, 2 with SSE's 16 xmm): few lanes (a decode step's heads
// of one kv head) then read each value row in one pass, whole cache lines,
// rather than a part of it per pass over the whole cache (a 16-column pass
// over a bf16 cache reads half of each line, so each line came twice).
// Columns [c0, c1) (multiples of 16).
template <class E, int L, int STRIDE, class At>
inline __attribute__((always_inline)) void value_columns(const CacheRows& rows, int64_t lo, int64_t n, int64_t c0,
                                                         int64_t c1, int64_t m, At at, float* out,
                                                         int64_t out_stride) {
  const int budget = wide_registers_here();
  const int64_t w = c1 - c0;
  if constexpr (L <= 2)
    if (8 * L <= budget && w % 128 == 0)
      return value_columns_w<E, L, STRIDE, 8>(rows, lo, n, c0, c1, m, at, out, out_stride);
  if constexpr (L <= 4)
    if (4 * L <= budget && w % 64 == 0)
      return value_columns_w<E, L, STRIDE, 4>(rows, lo, n, c0, c1, m, at, out, out_stride);
  if constexpr (L <= 8)
    if (2 * L <= budget && w % 32 == 0)
      return value_columns_w<E, L, STRIDE, 2>(rows, lo, n, c0, c1, m, at, out, out_stride);
  value_columns_w<E, L, STRIDE, 1>(rows, lo, n, c0, c1, m, at, out, out_stride);
}

// The sum of a softmax's weights, the same bits in every kernel: weight j
// into part j % 16 (in order of j), then the parts as hsum adds lanes.
inline __attribute__((always_inline)) v16 sum_parts(const v16* part) {
  v16 a[8], b[4];
  for (int l = 0; l < 8; ++l)
    a[l] = part[l] + part[l + 8];
  for (int l = 0; l < 4; ++l)
    b[l] = a[l] + a[l + 4];
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// The prefill kernels' pass over the key blocks of [lo, n) from block b0:
// f(j0, first, cnt, run) for each block (its keys first .. cnt-1 of the
// block from key j0, run the kv head's keys in it: key j's row at run + j x
// row_stride, or its parts at the by_dim_* offsets), the block two ahead
// prefetched while this one is read (blocks lie anywhere in the pool, so the
// hardware prefetcher starts over at each one; by dimension a whole block's
// keys of the head are the same bytes). f must be always_inline: left to the
// compiler, Kernels.EveryBuildOfTheCacheKernelsGivesTheSameBits found the
// builds' results differing.
template <class F>
inline __attribute__((always_inline)) void over_key_blocks(const CacheRows& rows, int64_t b0, int64_t lo, int64_t n,
                                                           int64_t key_bytes, F&& f) {
  const int64_t bt = rows.block_tokens;
  prefetch_block(rows, b0 + 1, std::min(bt, n - (b0 + 1) * bt), rows.k_offset, 0, key_bytes);
  for (int64_t j0 = b0 * bt, b = b0; j0 < n; j0 += bt, ++b) {
    prefetch_block(rows, b + 2, std::min(bt, n - j0 - 2 * bt), rows.k_offset, 0, key_bytes);
    f(j0, std::max<int64_t>(lo - j0, 0), std::min(bt, n - j0), rows.blocks[b] + rows.k_offset);
  }
}

template <class E, int HD>
inline __attribute__((always_inline)) void attend_rows_impl(const float* q, int64_t q_stride, int64_t m,
                                                            const CacheRows& rows, int64_t n0, int64_t hd_rt,
                                                            float scale, float* scores_raw, float* out,
                                                            int64_t out_stride) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  constexpr int64_t L = attend_group;
  float tmp[HD > 0 ? HD : max_head_dim];
  const int64_t n = n0 + m;
  const int64_t bt = rows.block_tokens;
  // Row t (at position n0 + t) sees keys [n0 + t + 1 - window, n0 + t]: the
  // earliest any row sees is row 0's first, and blocks before it are not read.
  const int64_t w = rows.window;
  const int64_t lo = w > 0 ? std::max<int64_t>(0, n0 + 1 - w) : 0;
  const int64_t b0 = lo / bt;
  const float cap = rows.softcap, inv_cap = cap > 0 ? 1.0f / cap : 0.f;
  // Key j's scores of every row at S + 16 j.
  float* const S = scores_raw;
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
    if (jj > n0) { // causal: lane t sees key jj only when jj <= n0 + t
      const v16 from = v16{} + static_cast<float>(jj - n0);
      acc = select(lanes >= from, acc, v16{} - INFINITY);
    }
    if (w > 0 && jj + w <= n0 + L - 1) { // window: lane t sees key jj only when n0 + t - jj < w
      const v16 until = v16{} + static_cast<float>(jj - n0 + w - 1);
      acc = select(lanes <= until, acc, v16{} - INFINITY);
    }
    vstore(S + 16 * jj, acc);
    mx = select(mx > acc, mx, acc);
  };
  // Four keys at a time in four independent chains (one chain of hd dependent
  // multiply-adds per key waited on the previous one's latency: about 80 ns a
  // key at head size 64); each lane still adds its products in order i = 0 ..
  // hd-1, so every score is the same bits as one key at a time.
  if constexpr (std::is_same_v<E, KvQ8>) {
    // Integer scores (QueryQ8): row t's query bytes in lane t, 4 a lane; each
    // key's 4 bytes at a time into every lane.
    constexpr int64_t HM = HD > 0 ? HD : max_head_dim;
    const int64_t nb = hd / 32;
    vu16 qu[HM / 4];
    v16 dql[HM / 32];
    vi16 biasl[HM / 32];
    {
      QueryQ8 qr;
      for (int64_t u = 0; u < hd / 4; ++u)
        qu[u] = vu16{};
      for (int64_t kb = 0; kb < nb; ++kb) {
        dql[kb] = v16{};
        biasl[kb] = vi16{};
      }
      for (int64_t t = 0; t < m; ++t) {
        quantize_query_q8(q + t * q_stride, hd, qr);
        for (int64_t u = 0; u < hd / 4; ++u)
          qu[u][t] = qr.q4[u];
        for (int64_t kb = 0; kb < nb; ++kb) {
          dql[kb][t] = qr.d[kb];
          biasl[kb][t] = qr.bias[kb];
        }
      }
    }
    // BD: keys by dimension (CacheRows::keys_by_dim): key j's block kb is
    // spread over the run (its scale, then each unit of 4 values; by_dim_q8_*);
    // else a row of 34-byte blocks.
    auto key_pass = [&](auto bd) __attribute__((always_inline)) {
      constexpr bool BD = decltype(bd)::value;
      over_key_blocks(rows, b0, lo, n, E::bytes(hd),
                      [&](int64_t j0, int64_t first, int64_t cnt, const uint8_t* run) __attribute__((always_inline)) {
                        for (int64_t j = first; j < cnt; ++j) {
                          const uint8_t* row = run + static_cast<std::size_t>(j) * rows.row_stride; // (by position)
                          v16 acc = v16{};
#pragma GCC unroll 8
                          for (int64_t kb = 0; kb < nb; ++kb) {
                            const float dk = KvQ8::scale(BD ? run + by_dim_q8_scale(bt, kb, j) : row + 34 * kb);
                            dot_acc ia = dot_acc{};
#pragma GCC unroll 8
                            for (int u = 0; u < 8; ++u) {
                              uint32_t k4;
                              __builtin_memcpy(&k4, BD ? run + by_dim_q8_unit(bt, kb, u, j) : row + 34 * kb + 2 + 4 * u,
                                               4);
                              ia = dot4_lanes(ia, qu[8 * kb + u], dot_flip(k4));
                            }
                            acc = add_q8_block(acc, ia, biasl[kb], dql[kb] * dk);
                          }
                          finish(j0 + j, acc);
                        }
                      });
    };
    if (rows.keys_by_dim)
      key_pass(std::true_type{});
    else
      key_pass(std::false_type{});
  } else {
    // Queries transposed: qt[i] holds element i of every row's query, one row a lane.
    v16 qt[HD > 0 ? HD : max_head_dim];
    for (int64_t i = 0; i < hd; ++i) {
      float lane[L] = {};
      for (int64_t t = 0; t < m; ++t)
        lane[t] = q[t * q_stride + i];
      qt[i] = vload<v16>(lane);
    }
    float tmp4[4][HD > 0 ? HD : max_head_dim];
    // BD: f32 keys by dimension (CacheRows::keys_by_dim): a key's value i is
    // bt floats on, the next key one float on (by_dim_f32).
    auto key_pass = [&](auto bd) __attribute__((always_inline)) {
      constexpr bool BD = decltype(bd)::value;
      const int64_t ks = BD ? bt : 1;
      const std::size_t rs = BD ? sizeof(float) : rows.row_stride;
      auto key = [&](const uint8_t* p, float* t) __attribute__((always_inline)) {
        return BD ? reinterpret_cast<const float*>(p) : E::row(p, hd, t);
      };
      over_key_blocks(
        rows, b0, lo, n, E::bytes(hd),
        [&](int64_t j0, int64_t first, int64_t cnt, const uint8_t* run) __attribute__((always_inline)) {
          const uint8_t* kp = run + static_cast<std::size_t>(first) * rs;
          int64_t j = first;
          for (; j + 4 <= cnt; j += 4, kp += 4 * rs) {
            const float* k0 = key(kp, tmp4[0]);
            const float* k1 = key(kp + rs, tmp4[1]);
            const float* k2 = key(kp + 2 * rs, tmp4[2]);
            const float* k3 = key(kp + 3 * rs, tmp4[3]);
            v16 a0 = v16{}, a1 = v16{}, a2 = v16{}, a3 = v16{};
#pragma GCC unroll 4
            for (int64_t i = 0; i < hd; ++i) {
              const v16 qi = qt[i];
              a0 += qi * k0[i * ks];
              a1 += qi * k1[i * ks];
              a2 += qi * k2[i * ks];
              a3 += qi * k3[i * ks];
            }
            const v16 a[4] = {a0, a1, a2, a3};
#pragma GCC unroll 1
            for (int u = 0; u < 4; ++u)
              finish(j0 + j + u, a[u]);
          }
          for (; j < cnt; ++j, kp += rs) {
            const float* k = key(kp, tmp);
            v16 acc = v16{};
            for (int64_t i = 0; i < hd; ++i)
              acc += qt[i] * k[i * ks];
            finish(j0 + j, acc);
          }
        });
    };
    if constexpr (std::is_same_v<E, KvF32>) {
      if (rows.keys_by_dim)
        key_pass(std::true_type{});
      else
        key_pass(std::false_type{});
    } else {
      key_pass(std::false_type{});
    }
  }
  v16 part[16] = {};
  for (int64_t j = lo; j < n; ++j) {
    const v16 e = exp16(vload<v16>(S + 16 * j) - mx);
    vstore(S + 16 * j, e);
    part[j & 15] += e;
  }
  const v16 inv = 1.0f / sum_parts(part);
  for (int64_t j = lo; j < n; ++j) {
    const v16 p = vload<v16>(S + 16 * j) * inv; // probabilities; 0 where a row may not look
    vstore(S + 16 * j, p);
  }
  if (hd % 16 == 0) // 16 output columns of all rows at a time: each value row is read once
    return value_columns<E, L, 1>(rows, lo, n, 0, hd, m, [&](int64_t j) { return scores_raw + j * L; }, out,
                                  out_stride);
  for (int64_t t = 0; t < m; ++t) {
    float* o = out + t * out_stride;
    for (int64_t i = 0; i < hd; ++i)
      o[i] = 0.f;
    const int64_t nt = n0 + t + 1;
    for (int64_t j0 = b0 * bt, b = b0; j0 < nt; j0 += bt, ++b) {
      const int64_t first = std::max<int64_t>(lo - j0, 0);
      const uint8_t* vp = rows.blocks[b] + rows.v_offset + static_cast<std::size_t>(first) * rows.row_stride;
      const int64_t cnt = std::min(bt, nt - j0);
      for (int64_t j = first; j < cnt; ++j, vp += rows.row_stride) {
        const float* v = E::row(vp, hd, tmp);
        const float a = S[16 * (j0 + j) + t];
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i)
          o[i] += a * v[i];
      }
    }
  }
}


// The row pointers of the 16 keys from cs (a multiple of 16), at byte `off` of
// each row; a key outside [lo, n) points at key lo's row (its lanes are masked:
// its block may be gone, or not yet exist).
inline __attribute__((always_inline)) void key_ptrs(const CacheRows& rows, std::size_t off, int64_t cs, int64_t lo,
                                                    int64_t n, const uint8_t** p) {
  const int64_t bt = rows.block_tokens;
  const std::size_t rs = rows.row_stride;
  int64_t b = cs / bt, slot = cs % bt;
  const uint8_t* safe = rows.blocks[lo / bt] + off + static_cast<std::size_t>(lo % bt) * rs;
  for (int r = 0; r < 16; ++r) {
    const int64_t j = cs + r;
    p[r] = j >= lo && j < n ? rows.blocks[b] + off + static_cast<std::size_t>(slot) * rs : safe;
    if (++slot == bt) {
      slot = 0;
      ++b;
    }
  }
}

// m <= MH query heads of one position that share a kv head (a decode step of
// grouped-query attention) against keys [lo, n), in three steps (the scores,
// the softmax weights, the value pass) that one item may spread over threads:
// each step's numbers are the same bits however the work is split. Keys are the
// lanes: 16 keys' rows are transposed (E::keys16; f32 keys stored by dimension,
// CacheRows::keys_by_dim, are loaded as they lie) so that each head's scores of
// 16 keys are one chain of hd multiply-adds (C groups of 16 keys at once: C * MH
// chains, enough to hide the latency), and each head's softmax runs 16 keys a
// vector. Every number is the same bits as attend_rows gives the same query
// row: a score adds its products in order i = 0 .. hd-1, the weights' sum goes
// by j % 16 (sum_parts), the value pass adds keys in order. Scores are kept as
// [16-key chunk][head][16], so the value pass reads every head's weight of a key
// at fixed offsets.

// Step 1's end of a chunk: the 16 keys' dot products from cs of every head
// (acc[h]) scaled, soft-capped, masked to the keys [lo, n) the step sees, stored
// at S + 16 h, and into each head's running maximum, lane by lane.
template <int MH>
inline __attribute__((always_inline)) void finish_heads_chunk(const v16* acc, const CacheRows& rows, int64_t cs,
                                                              int64_t lo, int64_t n, float scale, float* S, v16* mx) {
  const float cap = rows.softcap, inv_cap = cap > 0 ? 1.0f / cap : 0.f;
  v16 lanes;
  for (int t = 0; t < 16; ++t)
    lanes[t] = static_cast<float>(t);
  // lane r is key cs + r: seen when lo <= cs + r < n
  const v16 from = v16{} + static_cast<float>(lo - cs), until = v16{} + static_cast<float>(n - cs);
  const auto seen = (lanes >= from) & (lanes < until);
  for (int h = 0; h < MH; ++h) {
    v16 a = acc[h] * scale;
    if (cap > 0)
      for (int t = 0; t < 16; ++t)
        a[t] = cap * std::tanh(a[t] * inv_cap);
    a = select(seen, a, v16{} - INFINITY);
    vstore(S + 16 * h, a);
    mx[h] = select(mx[h] > a, mx[h], a);
  }
}

// Step 1: the scores of chunks [k0, k1) of keys [lo, n) (chunk k holds keys
// base + 16 k .. + 15, base = lo rounded down to 16), and each head's maximum of
// them, lane by lane, at mx + 16 h.
// BD: f32 keys stored by dimension (CacheRows::keys_by_dim): 16 keys' value i
// is one vector load, no transposition.
template <class E, int HD, int MH, bool BD = false>
inline __attribute__((always_inline)) void heads_scores_impl(const float* q, int64_t m, const CacheRows& rows,
                                                             int64_t n, int64_t hd_rt, float scale, float* scores,
                                                             int64_t k0, int64_t k1, float* mx_out) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  // (AVX2 has half the registers: half the groups; a head size of 256 or more
  // half again, so that the groups' transposed keys stay in the L1 cache)
  constexpr int C0 = HD == 0 || MH >= 16 ? 1
                     : wide_registers == 8 ? (MH >= 8 ? 1 : MH >= 4 ? 2 : 4)
                                           : (MH >= 8 ? 2 : 4);
  constexpr int C = HD >= 256 && C0 > 1 ? C0 / 2 : C0;
  constexpr int64_t HM = HD > 0 ? HD : max_head_dim;
  float qb[MH][HM];
  for (int h = 0; h < MH; ++h)
    for (int64_t i = 0; i < hd; ++i)
      qb[h][i] = h < m ? q[h * hd + i] : 0.f;
  const HeadsKeys keys = heads_keys(rows, n);
  const int64_t lo = keys.lo, base = keys.base, end = std::min(n, base + 16 * k1);
  v16 mx[MH];
  std::fill_n(mx, MH, v16{} - INFINITY);
  v16 kt[BD ? 1 : C][BD ? 1 : HM];
  const uint8_t* ptr[16];
  const int64_t kbytes = E::bytes(hd);
  const int64_t bt = rows.block_tokens;
  // BD: value 0 of the 16 keys of a group from key j (a multiple of 16: one
  // block holds them); value i is by_dim_f32(bt, i, 0) = i bt floats on.
  auto by_dim = [&](int64_t j) __attribute__((always_inline)) {
    return reinterpret_cast<const float*>(rows.blocks[j / bt] + rows.k_offset) + by_dim_f32(bt, 0, j % bt);
  };
  const float* kd[C];
  const float* kpf[C]; // BD: the keys two groups ahead (past the end: this group's), prefetched value by value below
  for (int64_t c0 = base + 16 * k0; c0 < end; c0 += 16 * C) {
    // The keys two groups ahead, while these are computed (blocks lie anywhere
    // in the pool: the hardware prefetcher starts over at each one), a chunk's
    // before each chunk is transposed: a burst of all the groups' prefetches at
    // once filled the line buffers and stalled the loads behind it.
    for (int c = 0; c < C; ++c) {
      const int64_t ahead = c0 + 16 * (2 * C + c);
      if constexpr (BD) {
        kpf[c] = by_dim(ahead < end ? ahead : c0);
        // (a group past the end reads the first group's keys: its scores are not stored)
        kd[c] = by_dim(c0 + 16 * c < end ? c0 + 16 * c : c0);
        continue;
      }
      if (ahead < end) {
        key_ptrs(rows, rows.k_offset, ahead, lo, n, ptr);
        for (int r = 0; r < 16; ++r)
          for (int64_t l = 0; l < kbytes; l += 64)
            __builtin_prefetch(ptr[r] + l, 0, 3);
      }
      key_ptrs(rows, rows.k_offset, c0 + 16 * c, lo, n, ptr);
      E::keys16(ptr, hd, kt[c]);
    }
    v16 acc[C][MH] = {};
#pragma GCC unroll 2
    for (int64_t i = 0; i < hd; ++i) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        if constexpr (BD)
          __builtin_prefetch(kpf[c] + by_dim_f32(bt, i, 0), 0, 3);
        const v16 k = BD ? vload<v16>(kd[c] + by_dim_f32(bt, i, 0)) : kt[BD ? 0 : c][BD ? 0 : i];
#pragma GCC unroll 16
        for (int h = 0; h < MH; ++h)
          acc[c][h] += qb[h][i] * k;
      }
    }
    for (int c = 0; c < C; ++c) {
      const int64_t cs = c0 + 16 * c;
      if (cs >= end) // (the next call's chunk: it stores it)
        break;
      finish_heads_chunk<MH>(acc[c], rows, cs, lo, n, scale, scores + (cs - base) * MH, mx);
    }
  }
  for (int h = 0; h < MH; ++h)
    vstore(mx_out + 16 * h, mx[h]);
}

// The values of blocks at byte `at` and at + 34 (if `two`; else zeros) of 16
// q8_0 rows into R (row r's 32-bit units in R[r]), their f16 scales returned
// (the first's in the low half of each lane, the second's in the high).
inline __attribute__((always_inline)) vu16 load_q8_pair(const uint8_t* const* ptr, int64_t at, bool two, vu16* R) {
  uint32_t dd[16];
  for (int r = 0; r < 16; ++r) {
    const uint8_t* blk = ptr[r] + at;
    uint16_t h0, h1 = 0;
    __builtin_memcpy(&h0, blk, 2);
    if (two)
      __builtin_memcpy(&h1, blk + 34, 2);
    dd[r] = h0 | static_cast<uint32_t>(h1) << 16;
  }
#ifdef STRATA_ATTENTION_AVX512
  // (whole-register loads and inserts: the halves went through the stack)
  if (two)
    for (int r = 0; r < 16; ++r) {
      const uint8_t* blk = ptr[r] + at;
      R[r] = reinterpret_cast<vu16>(_mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 36)), 1));
    }
  else
    for (int r = 0; r < 16; ++r)
      R[r] = reinterpret_cast<vu16>(
        _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ptr[r] + at + 2))));
#else
  for (int r = 0; r < 16; ++r) {
    const uint8_t* blk = ptr[r] + at;
    R[r] = vload_halves<vu16>(blk + 2, two ? blk + 36 : nullptr);
  }
#endif
  return vload<vu16>(dd);
}

// Step 1 over a q8_0 cache: integer scores (QueryQ8 above), 16 keys a lane
// vector: two blocks of the 16 keys transposed (a lane's 4 bytes are 4 values of
// its key), each multiplied with every head's 4 query bytes at once.
// BD: keys by dimension (CacheRows::keys_by_dim): 16 keys' unit u of a block
// (4 values each) is one 64-byte load and their scales one 32-byte load; no
// transposition.
template <int HD, int MH, bool BD = false>
inline __attribute__((always_inline)) void heads_scores_q8_impl(const float* q, int64_t m, const CacheRows& rows,
                                                                int64_t n, int64_t hd_rt, float scale, float* scores,
                                                                int64_t k0, int64_t k1, float* mx_out) {
  const int64_t hd = HD > 0 ? HD : hd_rt, nb = hd / 32;
  QueryQ8 qq[MH];
  for (int h = 0; h < MH; ++h) {
    if (h < m) {
      quantize_query_q8(q + h * hd, hd, qq[h]);
    } else {
      std::fill_n(qq[h].q4, hd / 4, 0u);
      std::fill_n(qq[h].d, nb, 0.f);
      std::fill_n(qq[h].bias, nb, 0);
    }
  }
  const HeadsKeys keys = heads_keys(rows, n);
  const int64_t lo = keys.lo, base = keys.base, end = std::min(n, base + 16 * k1);
  v16 mx[MH];
  std::fill_n(mx, MH, v16{} - INFINITY);
  const uint8_t* ptr[16];
  const int64_t kbytes = KvQ8::bytes(hd);
  const int64_t bt = rows.block_tokens;
  constexpr int ahead_groups = 4;
  // BD: the head's run of keys in the block of key j (by_dim_q8_*: the 16
  // keys from j, a multiple of 16, lie side by side in each block's scales and
  // units).
  auto run_of = [&](int64_t j) __attribute__((always_inline)) { return rows.blocks[j / bt] + rows.k_offset; };
  for (int64_t cs = base + 16 * k0; cs < end; cs += 16) {
    // The keys four groups ahead, while these are computed (blocks lie anywhere
    // in the pool: the hardware prefetcher starts over at each one).
    if (cs + 16 * ahead_groups < end) {
      if constexpr (BD) {
        const int64_t a = cs + 16 * ahead_groups;
        const uint8_t* pa = run_of(a);
        for (int64_t b = 0; b < nb; ++b) {
          __builtin_prefetch(pa + by_dim_q8_scale(bt, b, a % bt), 0, 3);
          for (int u = 0; u < 8; ++u)
            __builtin_prefetch(pa + by_dim_q8_unit(bt, b, u, a % bt), 0, 3);
        }
      } else {
        key_ptrs(rows, rows.k_offset, cs + 16 * ahead_groups, lo, n, ptr);
        for (int r = 0; r < 16; ++r)
          for (int64_t l = 0; l < kbytes; l += 64)
            __builtin_prefetch(ptr[r] + l, 0, 3);
      }
    }
    const uint8_t* run = nullptr; // BD: the 16 keys' run, from slot cs % bt
    if constexpr (BD)
      run = run_of(cs);
    else
      key_ptrs(rows, rows.k_offset, cs, lo, n, ptr);
    v16 acc[MH] = {};
#pragma GCC unroll 1
    for (int64_t b0 = 0; b0 < nb; b0 += 2) {
      const bool two = b0 + 1 < nb;
      vu16 R[16];
      v16 s0, s1;
      if constexpr (BD) {
        const int64_t slot = cs % bt;
        for (int k = 0; k < 2; ++k)
          for (int u = 0; u < 8; ++u)
            R[8 * k + u] = k == 0 || two ? vload<vu16>(run + by_dim_q8_unit(bt, b0 + k, u, slot)) : vu16{};
        s0 = f16_bits_to_f32(widen_u16(run + by_dim_q8_scale(bt, b0, slot)));
        s1 = two ? f16_bits_to_f32(widen_u16(run + by_dim_q8_scale(bt, b0 + 1, slot))) : v16{};
      } else {
        const vu16 d = load_q8_pair(ptr, 34 * b0, two, R);
        transpose16(R);
        s0 = f16_bits_to_f32(d & 0xffffu);
        s1 = f16_bits_to_f32(d >> 16);
      }
      // Blocks b0 + k0 .. b0 + k0 + K - 1 at once: K chains a head (two where
      // the heads alone are too few to hide the latency; one where more would
      // leave the registers), each head adding its blocks in order.
      auto blocks = [&]<int K>(int k0) __attribute__((always_inline)) {
        dot_acc ia[K][MH] = {};
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u)
#pragma GCC unroll 2
          for (int k = 0; k < K; ++k) {
            const vu16 x = dot_flip(R[8 * (k0 + k) + u]);
#pragma GCC unroll 16
            for (int h = 0; h < MH; ++h)
              ia[k][h] = dot4(ia[k][h], x, qq[h].q4[8 * (b0 + k0 + k) + u]);
          }
#pragma GCC unroll 16
        for (int h = 0; h < MH; ++h)
#pragma GCC unroll 2
          for (int k = 0; k < K; ++k) {
            const int64_t b = b0 + k0 + k;
            acc[h] = add_q8_block(acc[h], ia[k][h], qq[h].bias[b], (k0 + k == 0 ? s0 : s1) * qq[h].d[b]);
          }
      };
      if (MH <= 4 && two) {
        blocks.template operator()<2>(0);
      } else {
        blocks.template operator()<1>(0);
        if (two)
          blocks.template operator()<1>(1);
      }
    }
    finish_heads_chunk<MH>(acc, rows, cs, lo, n, scale, scores + (cs - base) * MH, mx);
  }
  for (int h = 0; h < MH; ++h)
    vstore(mx_out + 16 * h, mx[h]);
}

// Step 2, once every chunk has its scores: the maxima of `parts` calls of step 1
// (part p's at mx + attend_heads_max_floats * p) merged, and each head's scores
// made its weights, 16 keys a vector: e^(s - max), summed by j % 16.
template <int MH>
inline __attribute__((always_inline)) void heads_weights_impl(int64_t m, const CacheRows& rows, int64_t n,
                                                              float* scores, const float* mx, int64_t parts) {
  const int64_t chunks = heads_keys(rows, n).chunks;
  for (int h = 0; h < std::min<int64_t>(m, MH); ++h) {
    v16 mh = vload<v16>(mx + 16 * h);
    for (int64_t p = 1; p < parts; ++p) {
      const v16 o = vload<v16>(mx + attend_heads_max_floats * p + 16 * h);
      mh = select(mh > o, mh, o);
    }
    float top = -INFINITY;
    for (int t = 0; t < 16; ++t)
      top = std::max(top, mh[t]);
    v16 part = v16{};
    float* S = scores + 16 * h;
    for (int64_t k = 0; k < chunks; ++k) {
      const v16 e = exp16(vload<v16>(S + k * 16 * MH) - top);
      vstore(S + k * 16 * MH, e);
      part += e;
    }
    const float inv = 1.0f / hsum(part);
    for (int64_t k = 0; k < chunks; ++k) {
      const v16 p = vload<v16>(S + k * 16 * MH) * inv;
      vstore(S + k * 16 * MH, p);
    }
  }
}

// Step 3: output columns [c0, c1) of every head (multiples of 16 where hd is one).
template <class E, int MH>
inline __attribute__((always_inline)) void heads_values_impl(int64_t m, const CacheRows& rows, int64_t n,
                                                             int64_t hd, const float* scores, int64_t c0, int64_t c1,
                                                             float* out) {
  const HeadsKeys keys = heads_keys(rows, n);
  const int64_t lo = keys.lo, base = keys.base;
  if (hd % 16 == 0) // 16 output columns of every head at a time: each value row is read once
    // key j's weights: chunk (j - base) / 16, lane j % 16, a head every 16 floats
    return value_columns<E, MH, 16>(
      rows, lo, n, c0, c1, m, [&](int64_t j) { return scores + ((j - base) >> 4) * 16 * MH + (j & 15); }, out, hd);
  const int64_t bt = rows.block_tokens;
  const int64_t b0 = lo / bt;
  const std::size_t rs = rows.row_stride;
  float tmp[max_head_dim];
  for (int64_t t = 0; t < m; ++t) {
    float* o = out + t * hd;
    for (int64_t i = c0; i < c1; ++i)
      o[i] = 0.f;
    for (int64_t j0 = b0 * bt, b = b0; j0 < n; j0 += bt, ++b) {
      const int64_t first = std::max<int64_t>(lo - j0, 0);
      const uint8_t* vp = rows.blocks[b] + rows.v_offset + static_cast<std::size_t>(first) * rs;
      const int64_t cnt = std::min(bt, n - j0);
      for (int64_t j = j0 + first; j < j0 + cnt; ++j, vp += rs) {
        const float* v = E::row(vp, hd, tmp);
        const float a = scores[((j - base) >> 4) * 16 * MH + 16 * t + (j & 15)];
#pragma omp simd
        for (int64_t i = c0; i < c1; ++i)
          o[i] += a * v[i];
      }
    }
  }
}

// The head sizes with a kernel of their own (loops unrolled at compile time):
// every other size goes through the run-time loop, with the same arithmetic.
// The portable build (CPUs without AVX2, and the tests' reference for the
// others' bits) runs every size through that loop: specialised, its baseline
// clone took five minutes (304 s) to compile for a path no AVX2 CPU takes.
#if defined(STRATA_ATTENTION_AVX512) || defined(STRATA_ATTENTION_AVX2)
constexpr bool head_size_kernels = true;
#else
constexpr bool head_size_kernels = false;
#endif
template <class E>
inline __attribute__((always_inline)) void attend_rows_typed(const float* q, int64_t q_stride, int64_t m,
                                                             const CacheRows& rows, int64_t n0, int64_t hd, float scale,
                                                             float* scores, float* out, int64_t out_stride) {
  if constexpr (head_size_kernels) {
    switch (hd) {
      case 64: return attend_rows_impl<E, 64>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
      case 128: return attend_rows_impl<E, 128>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
      default: break;
    }
  }
  attend_rows_impl<E, 0>(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
}

// One specialisation of step 1: a q8_0 cache's integer scores, the others' float ones.
template <class E, int HD, int MH, bool BD>
inline __attribute__((always_inline)) void heads_scores_one(const float* q, int64_t m, const CacheRows& rows, int64_t n,
                                                            int64_t hd, float scale, float* scores, int64_t k0,
                                                            int64_t k1, float* mx) {
  if constexpr (std::is_same_v<E, KvQ8>)
    heads_scores_q8_impl<HD, MH, BD>(q, m, rows, n, hd, scale, scores, k0, k1, mx);
  else
    heads_scores_impl<E, HD, MH, BD>(q, m, rows, n, hd, scale, scores, k0, k1, mx);
}

template <class E, int MH>
inline __attribute__((always_inline)) void heads_scores_lanes(const float* q, int64_t m, const CacheRows& rows,
                                                              int64_t n, int64_t hd, float scale, float* scores,
                                                              int64_t k0, int64_t k1, float* mx) {
  // The head sizes specialised (head_size_kernels), for the keys' layout BD (keys by dimension:
  // f32 and q8_0 caches only).
  auto by_size = [&](auto bd) __attribute__((always_inline)) {
    constexpr bool BD = decltype(bd)::value;
    if constexpr (head_size_kernels) {
      switch (hd) {
        case 64: return heads_scores_one<E, 64, MH, BD>(q, m, rows, n, hd, scale, scores, k0, k1, mx);
        case 128: return heads_scores_one<E, 128, MH, BD>(q, m, rows, n, hd, scale, scores, k0, k1, mx);
        case 256: return heads_scores_one<E, 256, MH, BD>(q, m, rows, n, hd, scale, scores, k0, k1, mx);
        default: break;
      }
    }
    heads_scores_one<E, 0, MH, BD>(q, m, rows, n, hd, scale, scores, k0, k1, mx);
  };
  if constexpr (std::is_same_v<E, KvF32> || std::is_same_v<E, KvQ8>)
    if (rows.keys_by_dim)
      return by_size(std::true_type{});
  by_size(std::false_type{});
}

// As few head lanes as hold the heads (1-2, 3-4, 5-8, 9-16): every step picks the same.
#define STRATA_HEADS_LANES(m, call)                                                                                 \
  if ((m) <= 2)                                                                                                     \
    return call(2);                                                                                                 \
  if ((m) <= 4)                                                                                                     \
    return call(4);                                                                                                 \
  if ((m) <= 8)                                                                                                     \
    return call(8);                                                                                                 \
  return call(16)

template <class E>
inline __attribute__((always_inline)) void attend_heads_scores_typed(const float* q, int64_t m, const CacheRows& rows,
                                                                     int64_t n, int64_t hd, float scale, float* scores,
                                                                     int64_t k0, int64_t k1, float* mx) {
#define STRATA_CALL(MH) heads_scores_lanes<E, MH>(q, m, rows, n, hd, scale, scores, k0, k1, mx)
  STRATA_HEADS_LANES(m, STRATA_CALL);
#undef STRATA_CALL
}
template <class E>
inline __attribute__((always_inline)) void attend_heads_weights_typed(int64_t m, const CacheRows& rows, int64_t n,
                                                                      float* scores, const float* mx, int64_t parts) {
#define STRATA_CALL(MH) heads_weights_impl<MH>(m, rows, n, scores, mx, parts)
  STRATA_HEADS_LANES(m, STRATA_CALL);
#undef STRATA_CALL
}
template <class E>
inline __attribute__((always_inline)) void attend_heads_values_typed(int64_t m, const CacheRows& rows, int64_t n,
                                                                     int64_t hd, const float* scores, int64_t c0,
                                                                     int64_t c1, float* out) {
#define STRATA_CALL(MH) heads_values_impl<E, MH>(m, rows, n, hd, scores, c0, c1, out)
  STRATA_HEADS_LANES(m, STRATA_CALL);
#undef STRATA_CALL
}
#undef STRATA_HEADS_LANES

// The three steps in one call.
template <class E>
inline __attribute__((always_inline)) void attend_heads_typed(const float* q, int64_t m, const CacheRows& rows, int64_t n,
                                                              int64_t hd, float scale, float* scores, float* out) {
  float mx[attend_heads_max_floats];
  attend_heads_scores_typed<E>(q, m, rows, n, hd, scale, scores, 0, heads_keys(rows, n).chunks, mx);
  attend_heads_weights_typed<E>(m, rows, n, scores, mx, 1);
  attend_heads_values_typed<E>(m, rows, n, hd, scores, 0, hd, out);
}

} // namespace strata::model::detail::STRATA_ATTENTION_NS

// The two entry points for one cache type E, named attend_{rows,heads}_<name>, each built
// for x86-64-v4 (AVX-512 F, BW, CD, DQ, VL) and the baseline, chosen at load
// time (CPUs with AVX2 but not AVX-512 run attention_<type>_avx2.cpp's build). (A clone for AVX-512F alone ran the bf16 decode
// kernel at half the speed: without VL, 256- and 128-bit work cannot use the
// upper 16 vector registers, and the transpositions spilled.)
#define STRATA_ATTENTION_CLONES __attribute__((target_clones("arch=x86-64-v4", "default")))
#define STRATA_ATTENTION_KERNELS(E, name) STRATA_ATTENTION_KERNELS_WITH(E, name, STRATA_ATTENTION_CLONES)
// The same for one target (ATTRS: the functions' attributes, if any).
#define STRATA_ATTENTION_KERNELS_WITH(E, name, ATTRS)                                                             \
  namespace strata::model::detail {                                                                              \
  ATTRS void attend_rows_##name(const float* q, int64_t q_stride, int64_t m, const CacheRows& rows, int64_t n0,   \
                                int64_t hd, float scale, float* scores, float* out, int64_t out_stride) {         \
    STRATA_ATTENTION_NS::attend_rows_typed<STRATA_ATTENTION_NS::E>(q, q_stride, m, rows, n0, hd, scale, scores,   \
                                                                   out, out_stride);                              \
  }                                                                                                               \
  ATTRS void attend_heads_##name(const float* q, int64_t m, const CacheRows& rows, int64_t n, int64_t hd,         \
                                 float scale, float* scores, float* out) {                                        \
    STRATA_ATTENTION_NS::attend_heads_typed<STRATA_ATTENTION_NS::E>(q, m, rows, n, hd, scale, scores, out);       \
  }                                                                                                               \
  ATTRS void attend_heads_scores_##name(const float* q, int64_t m, const CacheRows& rows, int64_t n, int64_t hd,  \
                                        float scale, float* scores, int64_t k0, int64_t k1, float* mx) {          \
    STRATA_ATTENTION_NS::attend_heads_scores_typed<STRATA_ATTENTION_NS::E>(q, m, rows, n, hd, scale, scores, k0,  \
                                                                           k1, mx);                               \
  }                                                                                                               \
  ATTRS void attend_heads_weights_##name(int64_t m, const CacheRows& rows, int64_t n, float* scores,              \
                                         const float* mx, int64_t parts) {                                        \
    STRATA_ATTENTION_NS::attend_heads_weights_typed<STRATA_ATTENTION_NS::E>(m, rows, n, scores, mx, parts);       \
  }                                                                                                               \
  ATTRS void attend_heads_values_##name(int64_t m, const CacheRows& rows, int64_t n, int64_t hd,                  \
                                        const float* scores, int64_t c0, int64_t c1, float* out) {                \
    STRATA_ATTENTION_NS::attend_heads_values_typed<STRATA_ATTENTION_NS::E>(m, rows, n, hd, scores, c0, c1, out);  \
  }                                                                                                               \
  }
