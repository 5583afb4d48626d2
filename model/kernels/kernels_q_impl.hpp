#pragma once
// Internal to kernels_q_*.cpp: the fused few-row kernels as templates, compiled
// once per instruction set (each including file sets its own GCC target first).
// VNNI = true uses AVX-512 VNNI's vpdpbusd on 256-bit vectors; false, AVX2's
// maddubs + madd.

#include "model/kernels/kernels_q.hpp"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace strata::model::detail::KQ_NS {

// How far ahead of the rows being read the kernels prefetch: the rows from at
// least 10 KB on, and at least 4 rows on (one step of four rows). A fixed count
// of R rows was too near for short rows: 4 rows of 1,024 q4_K values are 2.3 KB,
// which one thread reads in less time than memory takes to answer
// (docs/benchmarks.md, session 17).
struct Ahead {
  int64_t rows;      // prefetched that many rows on
  std::size_t bytes; // rows x the row's bytes
};
inline Ahead ahead_of(std::size_t rb) {
  constexpr std::size_t at_least = 10240;
  const int64_t rows = std::max<int64_t>(4, static_cast<int64_t>((at_least + rb - 1) / rb));
  return {rows, static_cast<std::size_t>(rows) * rb};
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// ------------------------------------------------------------ int8 dot of 32 bytes

// Sum over 4-byte groups of u8 x s8 products into 8 int32 lanes, added to acc.
template <bool VNNI>
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
  if constexpr (VNNI) {
    return _mm256_dpbusd_epi32(acc, u, s);
  } else {
    const __m256i p16 = _mm256_maddubs_epi16(u, s); // pairs fit int16 for our value ranges
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
  }
}

inline float hsum8(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

inline int32_t hsum8i(__m256i v) {
  const __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i b = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(b, _mm_shuffle_epi32(b, 0xb1)));
}

// The 32 weights of a q8_0 block (signed) or a q4_0 block (unsigned nibbles).
template <WType T>
inline __m256i block_weights(const uint8_t* blk) {
  if constexpr (T == WType::q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(x, m), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
    return _mm256_set_m128i(hi, lo); // unsigned 0..15: the -8 is applied through the activation sums
  }
}

// One block's signed product of weights w and activations a (32 each), as
// 8 int32 lanes: |w| . (a * sign(w)), so that the unsigned x signed dot applies.
template <bool VNNI>
inline __m256i block_dot(__m256i w, __m256i a) {
  return dot_u8s8<VNNI>(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

// The end of a tile: Y[(m0 + t) * ldy + r + i] (=|+=) the sum of lanes[i][t]
// plus extra[i][t], for every weight row i and activation row t.
template <int R, int MT>
inline void store_tile(float* Y, int64_t ldy, int64_t r, int64_t m0, const __m256 (&lanes)[R][MT],
                       const float (&extra)[R][MT], bool accumulate) {
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < MT; ++t) {
      const float s = hsum8(lanes[i][t]) + extra[i][t];
      float& y = Y[(m0 + t) * ldy + r + i];
      y = accumulate ? y + s : s;
    }
}

// R weight rows (r .. r+R-1) against a tile of MT activation rows (m0 ..
// m0+MT-1): the R rows stream from memory side by side (R independent streams
// keep enough loads in flight; the rows `far` on are prefetched while the first
// tile computes), and each weight block is loaded, its signs taken and its
// scales converted once for all MT activation rows; each activation block is
// loaded once for all R. Each (row, activation row) pair is reduced in the same
// order whatever R, MT and M are: a row's result does not depend on its batch.
template <WType T, bool VNNI, int R, int MT>
inline void rows_q8_tile(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r, int64_t r_end,
                         int64_t m0, bool accumulate, const Ahead& far) {
  constexpr std::size_t BB = T == WType::q8_0 ? 34 : 18;
  const int64_t nb = W.cols / 32;
  const std::size_t rb = W.row_bytes();
  const uint8_t* row0 = W.row(r);
  const bool ahead = m0 == 0 && r + R + far.rows <= r_end;
  const int8_t* a[MT];
  const float* da[MT];
  const int16_t* sa[MT];
  for (int t = 0; t < MT; ++t) {
    a[t] = A.q.data() + (m0 + t) * A.cols;
    da[t] = A.d.data() + (m0 + t) * nb;
    sa[t] = A.sums32.data() + (m0 + t) * nb;
  }
  __m256 acc[R][MT];
  __m256 corr[R][MT]; // q4_0: the -8 sum(a) terms, 8 blocks per vector operation
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < MT; ++t)
      acc[i][t] = corr[i][t] = _mm256_setzero_ps();
  // Blocks in groups of 8: the 8 block scales of a row are converted once,
  // multiplied by each activation row's scales in one vector operation, then
  // read back one by one as broadcasts from memory (load ports, not ALU ports).
  // The products and their order are those of the one-block loop below.
  int64_t b = 0;
  alignas(32) float sc[R][MT][8];
  for (; b + 8 <= nb; b += 8) {
    for (int i = 0; i < R; ++i) {
      const uint8_t* blk = row0 + i * rb + b * BB;
      __m128i h = _mm_setzero_si128();
      h = _mm_insert_epi16(h, *reinterpret_cast<const uint16_t*>(blk), 0);
      h = _mm_insert_epi16(h, *reinterpret_cast<const uint16_t*>(blk + BB), 1);
      h = _mm_insert_epi16(h, *reinterpret_cast<const uint16_t*>(blk + 2 * BB), 2);
      h = _mm_insert_epi16(h, *reinterpret_cast<const uint16_t*>(blk + 3 * BB), 3);
      h = _mm_insert_epi16(h, *reinterpret_cast<const uint16_t*>(blk + 4 * BB), 4);
      h = _mm_insert_epi16(h, *reinterpret_cast<const uint16_t*>(blk + 5 * BB), 5);
      h = _mm_insert_epi16(h, *reinterpret_cast<const uint16_t*>(blk + 6 * BB), 6);
      h = _mm_insert_epi16(h, *reinterpret_cast<const uint16_t*>(blk + 7 * BB), 7);
      const __m256 ws = _mm256_cvtph_ps(h);
      for (int t = 0; t < MT; ++t) {
        const __m256 s = _mm256_mul_ps(ws, _mm256_loadu_ps(da[t] + b));
        _mm256_store_ps(sc[i][t], s);
        if constexpr (T == WType::q4_0) {
          const __m256 minus8sa = _mm256_mul_ps(
            _mm256_set1_ps(-8.f),
            _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sa[t] + b)))));
          corr[i][t] = _mm256_fmadd_ps(s, minus8sa, corr[i][t]);
        }
      }
    }
    for (int k = 0; k < 8; ++k) {
      __m256i av[MT];
      for (int t = 0; t < MT; ++t)
        av[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t] + 32 * (b + k)));
      for (int i = 0; i < R; ++i) {
        const uint8_t* blk = row0 + i * rb + (b + k) * BB;
        if (ahead && (k & 1) == 0)
          _mm_prefetch(reinterpret_cast<const char*>(blk + far.bytes), _MM_HINT_T0);
        const __m256i w = block_weights<T>(blk);
        if constexpr (T == WType::q8_0) {
          const __m256i wabs = _mm256_sign_epi8(w, w);
          for (int t = 0; t < MT; ++t) {
            const __m256i p = dot_u8s8<VNNI>(_mm256_setzero_si256(), wabs, _mm256_sign_epi8(av[t], w));
            acc[i][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&sc[i][t][k]), _mm256_cvtepi32_ps(p), acc[i][t]);
          }
        } else { // unsigned nibbles; the -8 sum(a) went into corr above
          for (int t = 0; t < MT; ++t) {
            const __m256i p = dot_u8s8<VNNI>(_mm256_setzero_si256(), w, av[t]);
            acc[i][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&sc[i][t][k]), _mm256_cvtepi32_ps(p), acc[i][t]);
          }
        }
      }
    }
  }
  for (; b < nb; ++b) {
    for (int i = 0; i < R; ++i) {
      const uint8_t* blk = row0 + i * rb + b * BB;
      if (ahead && (b & 1) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(blk + far.bytes), _MM_HINT_T0);
      const __m256i w = block_weights<T>(blk);
      const float wd = half_to_float(blk);
      for (int t = 0; t < MT; ++t) {
        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t] + 32 * b));
        __m256i p;
        if constexpr (T == WType::q8_0) {
          p = block_dot<VNNI>(w, av);
        } else { // sum (q - 8) a = sum q a - 8 sum a: unsigned q needs no sign trick
          p = dot_u8s8<VNNI>(_mm256_setr_epi32(-8 * sa[t][b], 0, 0, 0, 0, 0, 0, 0), w, av);
        }
        acc[i][t] = _mm256_fmadd_ps(_mm256_set1_ps(wd * da[t][b]), _mm256_cvtepi32_ps(p), acc[i][t]);
      }
    }
  }
  const float none[R][MT] = {};
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < MT; ++t)
      acc[i][t] = _mm256_add_ps(acc[i][t], corr[i][t]);
  store_tile<R, MT>(Y, ldy, r, m0, acc, none, accumulate);
}


// q4_K: 8 sub-blocks of 32 with 6-bit scales and mins.
// The twelve packed bytes as eight 6-bit scales (bytes 0-7 of the result) and
// eight 6-bit mins (bytes 8-15), with 32-bit word operations; the words go to
// the vector from registers (through memory they would stall store forwarding).
inline __m128i scales_mins_k4(const uint8_t* q) {
  uint32_t u[3];
  std::memcpy(u, q, 12);
  constexpr uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
  const uint32_t mins47 = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);
  const uint32_t scales47 = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);
  return _mm_set_epi32(static_cast<int>(mins47), static_cast<int>(u[1] & m6), static_cast<int>(scales47),
                       static_cast<int>(u[0] & m6));
}

// u8 x s8 pairs summed to int16 (maddubs), then int16 pairs times an int16
// scale summed into int32 lanes of acc (VNNI: vpdpwssd; AVX2: madd + add).
template <bool VNNI>
inline __m256i dot_scaled(__m256i acc, __m256i u, __m256i s, __m256i scale16) {
  const __m256i p16 = _mm256_maddubs_epi16(u, s); // q4 <= 15: pairs fit int16
  if constexpr (VNNI)
    return _mm256_dpwssd_epi32(acc, p16, scale16);
  else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, scale16));
}

// R q4_K rows against a tile of MT activation rows: each weight block's scales
// are decoded, and each 32 of its nibbles unpacked, once for all MT rows; the
// scale of each sub-block multiplies inside the int16 pair sums. Per (row,
// activation row) the integer totals and the float steps are those of a tile
// of one, so a row's result does not depend on its batch.
// Q5 (q5_K): the same with a 5th bit per value (bit g of qh[l] for value l of
// group g), spread to bit 4 of each unpacked byte.
template <bool Q5, bool VNNI, int R, int MT>
inline void rows_q45_K_tile(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r, int64_t r_end,
                            int64_t m0, bool accumulate, const Ahead& far) {
  constexpr int BB = Q5 ? 176 : 144, QS = Q5 ? 48 : 16;
  const int64_t nb = W.cols / 256;
  const std::size_t rb = W.row_bytes();
  const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  const uint8_t* row0 = W.row(r);
  const bool ahead = m0 == 0 && r + R + far.rows <= r_end;
  float acc[R][MT] = {};
  __m256 accv[R][MT]; // the scaled products, kept in lanes until the row ends
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < MT; ++t)
      accv[i][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int i = 0; i < R; ++i) {
      const uint8_t* blk = row0 + i * rb + b * BB;
      if (ahead)
        for (int l = 0; l < BB; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk + far.bytes + l), _MM_HINT_T0);
      const __m128i sm = scales_mins_k4(blk + 4);
      // 8 scales as int16, the same in both 128-bit halves; sub-block j's scale
      // is broadcast from it with one byte shuffle.
      const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
      const uint8_t* qs = blk + QS;
      __m256i qh = _mm256_setzero_si256();
      if constexpr (Q5)
        qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
      __m256i tot[MT];
      for (int t = 0; t < MT; ++t)
        tot[t] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if constexpr (Q5) {
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
        }
        const __m256i s_lo = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(static_cast<short>((4 * c) | ((4 * c + 1) << 8))));
        const __m256i s_hi =
          _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(static_cast<short>((4 * c + 2) | ((4 * c + 3) << 8))));
        for (int t = 0; t < MT; ++t) {
          const int8_t* ab = A.q.data() + (m0 + t) * A.cols + 256 * b + 64 * c;
          tot[t] = dot_scaled<VNNI>(tot[t], lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab)), s_lo);
          tot[t] = dot_scaled<VNNI>(tot[t], hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab + 32)), s_hi);
        }
      }
      // Mins times the activation sums of each sub-block of 32.
      const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
      const float wd = half_to_float(blk), wdmin = half_to_float(blk + 2);
      for (int t = 0; t < MT; ++t) {
        const int16_t* sums32 = A.sums32.data() + (m0 + t) * nb * 8;
        const __m128i mm = _mm_madd_epi16(mins, _mm_loadu_si128(reinterpret_cast<const __m128i*>(sums32 + 8 * b)));
        const __m128i m2 = _mm_add_epi32(mm, _mm_shuffle_epi32(mm, 0x4e));
        const int32_t msum = _mm_cvtsi128_si32(_mm_add_epi32(m2, _mm_shuffle_epi32(m2, 0xb1)));
        const float da = A.d[static_cast<std::size_t>((m0 + t) * nb + b)];
        const float d = wd * da, dmin = wdmin * da;
        accv[i][t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(tot[t]), accv[i][t]);
        acc[i][t] -= dmin * static_cast<float>(msum);
      }
    }
  }
  store_tile<R, MT>(Y, ldy, r, m0, accv, acc, accumulate);
}


// q6_K: values (6-bit) - 32 with an int8 scale per 16. R rows against a tile as
// q4_K; u8 x s8 pair sums (maddubs: 63 x 127 x 2 fits int16), then each half of
// 16 times its scale in the int16 pair sums (vpdpwssd); the -32 offset through
// the activation sums of every 16.
template <bool VNNI, int R, int MT>
inline void rows_q6_K_tile(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r, int64_t r_end,
                           int64_t m0, bool accumulate, const Ahead& far) {
  const int64_t nb = W.cols / 256;
  const std::size_t rb = W.row_bytes();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
  // pick[k]: int16 word 2k in the low half, 2k + 1 in the high half.
  __m256i pick[4];
  for (int k = 0; k < 4; ++k)
    pick[k] = _mm256_set_m128i(_mm_set1_epi16(static_cast<short>((4 * k + 2) | ((4 * k + 3) << 8))),
                               _mm_set1_epi16(static_cast<short>((4 * k) | ((4 * k + 1) << 8))));
  const uint8_t* row0 = W.row(r);
  const bool ahead = m0 == 0 && r + R + far.rows <= r_end;
  __m256 accv[R][MT]; // the scaled products, kept in lanes until the row ends
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < MT; ++t)
      accv[i][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int i = 0; i < R; ++i) {
      const uint8_t* blk = row0 + i * rb + b * 210;
      if (ahead)
        for (int l = 0; l < 210; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk + far.bytes + l), _MM_HINT_T0);
      const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
      const __m256i halves[2] = {_mm256_permute2x128_si256(sc16, sc16, 0x00),
                                 _mm256_permute2x128_si256(sc16, sc16, 0x11)};
      __m256i tot[MT];
      for (int t = 0; t < MT; ++t)
        tot[t] = _mm256_setzero_si256();
      for (int n = 0; n < 2; ++n) {
        const uint8_t* ql = blk + 64 * n;
        const uint8_t* qh = blk + 128 + 32 * n;
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
        const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4)),
          _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4)),
        };
        for (int k = 0; k < 4; ++k) {
          // values 0-15 of group 8n + 2k: its scale; 16-31: the next one's
          const __m256i s = _mm256_shuffle_epi8(halves[n], pick[k]);
          for (int t = 0; t < MT; ++t) {
            const int8_t* a = A.q.data() + (m0 + t) * A.cols + 256 * b + 32 * (4 * n + k);
            tot[t] = dot_scaled<VNNI>(tot[t], q[k], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)), s);
          }
        }
      }
      // The -32 offset: 32 * sum over groups of 16 of scale x activation sum.
      const __m256i sc_a = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
      const __m256i sc_b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8)));
      const float wd = half_to_float(blk + 208);
      for (int t = 0; t < MT; ++t) {
        const int32_t* sums = A.sums.data() + (m0 + t) * nb * 16 + 16 * b;
        const __m256i corr =
          _mm256_add_epi32(_mm256_mullo_epi32(sc_a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums))),
                           _mm256_mullo_epi32(sc_b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + 8))));
        const __m256i v = _mm256_sub_epi32(tot[t], _mm256_slli_epi32(corr, 5));
        const float da = A.d[static_cast<std::size_t>((m0 + t) * nb + b)];
        accv[i][t] = _mm256_fmadd_ps(_mm256_set1_ps(wd * da), _mm256_cvtepi32_ps(v), accv[i][t]);
      }
    }
  }
  const float none[R][MT] = {};
  store_tile<R, MT>(Y, ldy, r, m0, accv, none, accumulate);
}

// ------------------------------------------------------------ the fallback and mix types

// Byte j = 0xFF where bit j of x is set (j = 0..31), else 0.
inline __m256i bits_to_bytes(uint32_t x) {
  const __m256i spread = _mm256_shuffle_epi8(
    _mm256_set1_epi32(static_cast<int>(x)),
    _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i r = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(r, _mm256_set1_epi64x(-1));
}

// The 16 iq4_nl values in both 128-bit lanes, for byte shuffles.
inline __m256i iq4_table() {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(iq4nl_values)));
}

// 16 bytes of nibbles as 32 values: value j (low nibble of byte j) in byte j,
// value j + 16 (high nibble) in byte j + 16.
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), m), _mm_and_si128(x, m));
}

// The 32-value types beyond q8_0 / q4_0, against q8_0 activations (llama.cpp
// pairs q4_1 / q5_1 with q8_1: the same values, and their sum times the scale
// as f16, A.s). Per block: q4_1 / q5_1 d da sum(q a) + m s; q5_0
// d da (sum(q a) - 16 sum(a)); iq4_nl d da sum(K[q] a). R rows side by side
// against a tile of MT activation rows as above; each (row, activation row) pair
// reduces in one order whatever R, MT and M are.
template <WType T, bool VNNI, int R, int MT>
inline void rows_q32_tile(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r, int64_t r_end,
                          int64_t m0, bool accumulate, const Ahead& far) {
  constexpr std::size_t BB = T == WType::q4_1 ? 20 : T == WType::q5_0 ? 22 : T == WType::q5_1 ? 24 : 18;
  constexpr bool MIN = T == WType::q4_1 || T == WType::q5_1;
  constexpr std::size_t QS = T == WType::q4_1 ? 4 : T == WType::q5_0 ? 6 : T == WType::q5_1 ? 8 : 2;
  const int64_t nb = W.cols / 32;
  const std::size_t rb = W.row_bytes();
  const uint8_t* row0 = W.row(r);
  const bool ahead = m0 == 0 && r + R + far.rows <= r_end;
  const __m256i table = iq4_table(), bit5 = _mm256_set1_epi8(0x10);
  const __m256i table_u = _mm256_xor_si256(table, _mm256_set1_epi8(static_cast<char>(0x80))); // K + 128
  __m256 acc[R][MT];
  float mins[R][MT] = {};
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < MT; ++t)
      acc[i][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i av[MT];
    for (int t = 0; t < MT; ++t)
      av[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(A.q.data() + (m0 + t) * A.cols + 32 * b));
    for (int i = 0; i < R; ++i) {
      const uint8_t* blk = row0 + i * rb + b * BB;
      if (ahead && (b & 1) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(blk + far.bytes), _MM_HINT_T0);
      // The weights once for the tile: unsigned bytes (the 5th bit in place),
      // or the table's values (iq4_nl: K + 128 with VNNI, K and |K| without).
      __m256i q = nibbles32(blk + QS);
      if constexpr (T == WType::q5_0 || T == WType::q5_1) {
        uint32_t qh;
        std::memcpy(&qh, blk + QS - 4, 4);
        q = _mm256_or_si256(q, _mm256_and_si256(bits_to_bytes(qh), bit5));
      }
      __m256i w = q, wabs = q;
      if constexpr (T == WType::iq4_nl && VNNI) {
        w = _mm256_shuffle_epi8(table_u, q);
      } else if constexpr (T == WType::iq4_nl) {
        w = _mm256_shuffle_epi8(table, q);
        wabs = _mm256_sign_epi8(w, w);
      }
      const float wd = half_to_float(blk);
      const float wm = MIN ? half_to_float(blk + 2) : 0.f;
      for (int t = 0; t < MT; ++t) {
        const int64_t at = (m0 + t) * nb + b;
        const int16_t sa = A.sums32[static_cast<std::size_t>(at)];
        __m256i p;
        if constexpr (T == WType::iq4_nl && VNNI) // sum K a = sum (K + 128) a - 128 sum a
          p = _mm256_dpbusd_epi32(_mm256_setr_epi32(-128 * sa, 0, 0, 0, 0, 0, 0, 0), w, av[t]);
        else if constexpr (T == WType::iq4_nl)
          p = dot_u8s8<VNNI>(_mm256_setzero_si256(), wabs, _mm256_sign_epi8(av[t], w));
        else
          p = dot_u8s8<VNNI>(T == WType::q5_0 ? _mm256_setr_epi32(-16 * sa, 0, 0, 0, 0, 0, 0, 0) : _mm256_setzero_si256(),
                             q, av[t]);
        acc[i][t] = _mm256_fmadd_ps(_mm256_set1_ps(wd * A.d[static_cast<std::size_t>(at)]), _mm256_cvtepi32_ps(p),
                                    acc[i][t]);
        if constexpr (MIN)
          mins[i][t] += wm * A.s[static_cast<std::size_t>(at)];
      }
    }
  }
  store_tile<R, MT>(Y, ldy, r, m0, acc, mins, accumulate);
}

// q2_K (2-bit values, 4-bit scale and min per 16) and q3_K (2 bits plus a 3rd
// bit that is +4, 6-bit signed scale per 16, the -4 through the activation sums
// of every 16). The 32 values of (h, j) are 128h + 32j + l: the low 16 take
// group 8h + 2j, the high 16 group 8h + 2j + 1, as q6_K's halves. The 16 scales
// are one vector of int16; each (h, j) pair of them is spread over its halves by
// one byte shuffle, and the scales (mins) meet the activation sums in one madd.
template <WType T, bool VNNI, int R>
inline void rows_q23_K_block(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r, int64_t r_end,
                             bool accumulate, const Ahead& far) {
  constexpr std::size_t BB = T == WType::q2_K ? 84 : 110;
  const int64_t nb = W.cols / 256;
  const std::size_t rb = W.row_bytes();
  const __m256i m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  // pick[j]: int16 word 2j in the low half, 2j + 1 in the high half.
  __m256i pick[4];
  for (int j = 0; j < 4; ++j)
    pick[j] = _mm256_set_m128i(_mm_set1_epi16(static_cast<short>((4 * j + 2) | ((4 * j + 3) << 8))),
                               _mm_set1_epi16(static_cast<short>((4 * j) | ((4 * j + 1) << 8))));
  const uint8_t* row0 = W.row(r);
  const bool ahead = r + R + far.rows <= r_end;
  for (int64_t m = 0; m < A.rows; ++m) {
    const int8_t* a = A.q.data() + m * A.cols;
    const float* da = A.d.data() + m * nb;
    const int32_t* sums = A.sums.data() + m * nb * 16;
    float acc[R] = {};
    __m256 accv[R];
    for (int i = 0; i < R; ++i)
      accv[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256i av[8];
      for (int j = 0; j < 8; ++j)
        av[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 256 * b + 32 * j));
      // The 16 activation sums of this block as int16, in order (|sum| <= 2032).
      const __m256i s16 = _mm256_permute4x64_epi64(
        _mm256_packs_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + 16 * b)),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + 16 * b + 8))),
        0xD8);
      for (int i = 0; i < R; ++i) {
        const uint8_t* blk = row0 + i * rb + b * BB;
        if (m == 0 && ahead)
          for (std::size_t l = 0; l < BB; l += 64)
            _mm_prefetch(reinterpret_cast<const char*>(blk + far.bytes + l), _MM_HINT_T0);
        const uint8_t* qs;
        __m256i sc16, hm = _mm256_setzero_si256();
        __m128i raw = _mm_setzero_si128();
        if constexpr (T == WType::q2_K) {
          raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
          sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0F)));
          qs = blk + 16;
        } else {
          uint32_t w[4];
          q3_K_scale_words(blk + 96, w);
          const __m128i sc8 =
            _mm_sub_epi8(_mm_set_epi32(static_cast<int>(w[3]), static_cast<int>(w[2]), static_cast<int>(w[1]),
                                       static_cast<int>(w[0])),
                         _mm_set1_epi8(32));
          sc16 = _mm256_cvtepi8_epi16(sc8);
          hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
          qs = blk + 32;
        }
        __m256i tot = _mm256_setzero_si256();
        const __m256i halves[2] = {_mm256_permute2x128_si256(sc16, sc16, 0x00),
                                   _mm256_permute2x128_si256(sc16, sc16, 0x11)};
        for (int h = 0; h < 2; ++h) {
          const __m256i q2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * h));
          const __m256i half = halves[h];
          for (int j = 0; j < 4; ++j) {
            __m256i q = _mm256_and_si256(_mm256_srli_epi16(q2, 2 * j), m2);
            if constexpr (T == WType::q3_K) // the 3rd bit set: the value is q, clear: q - 4 (the -4 below)
              q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + j), one), 2));
            tot = dot_scaled<VNNI>(tot, q, av[4 * h + j], _mm256_shuffle_epi8(half, pick[j]));
          }
        }
        if constexpr (T == WType::q2_K) {
          // The mins (high nibbles) times the activation sums of every 16.
          const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)));
          const int32_t msum = hsum8i(_mm256_madd_epi16(mn16, s16));
          accv[i] = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(blk + 80) * da[b]), _mm256_cvtepi32_ps(tot), accv[i]);
          acc[i] -= half_to_float(blk + 82) * da[b] * static_cast<float>(msum);
        } else {
          const __m256i corr = _mm256_madd_epi16(sc16, s16);
          const __m256i v = _mm256_sub_epi32(tot, _mm256_slli_epi32(corr, 2));
          accv[i] = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(blk + 108) * da[b]), _mm256_cvtepi32_ps(v), accv[i]);
        }
      }
    }
    for (int i = 0; i < R; ++i) {
      const float s = hsum8(accv[i]) + acc[i];
      float& y = Y[m * ldy + r + i];
      y = accumulate ? y + s : s;
    }
  }
}

// iq4_xs: 8 groups of 32, each an iq4_nl block with a signed 6-bit scale; the
// table values (|v| <= 127) pair with the activations as |v| . (a sign(v)),
// then each group's int16 pair sums times its scale.
template <bool VNNI, int R>
inline void rows_iq4_xs_block(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r, int64_t r_end,
                              bool accumulate, const Ahead& far) {
  const int64_t nb = W.cols / 256;
  const std::size_t rb = W.row_bytes();
  const __m256i table = iq4_table();
  const uint8_t* row0 = W.row(r);
  const bool ahead = r + R + far.rows <= r_end;
  for (int64_t m = 0; m < A.rows; ++m) {
    const int8_t* a = A.q.data() + m * A.cols;
    const float* da = A.d.data() + m * nb;
    __m256 accv[R];
    for (int i = 0; i < R; ++i)
      accv[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256i av[8];
      for (int j = 0; j < 8; ++j)
        av[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 256 * b + 32 * j));
      for (int i = 0; i < R; ++i) {
        const uint8_t* blk = row0 + i * rb + b * 136;
        if (m == 0 && ahead)
          for (int l = 0; l < 136; l += 64)
            _mm_prefetch(reinterpret_cast<const char*>(blk + far.bytes + l), _MM_HINT_T0);
        uint16_t sh;
        std::memcpy(&sh, blk + 2, 2);
        const uint8_t* sl = blk + 4;
        __m256i tot = _mm256_setzero_si256();
        for (int g = 0; g < 8; ++g) {
          const int ls = ((sl[g / 2] >> (4 * (g % 2))) & 0xF) | (((sh >> (2 * g)) & 3) << 4);
          const __m256i w = _mm256_shuffle_epi8(table, nibbles32(blk + 8 + 16 * g));
          tot = dot_scaled<VNNI>(tot, _mm256_sign_epi8(w, w), _mm256_sign_epi8(av[g], w),
                                 _mm256_set1_epi16(static_cast<short>(ls - 32)));
        }
        accv[i] = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(blk) * da[b]), _mm256_cvtepi32_ps(tot), accv[i]);
      }
    }
    for (int i = 0; i < R; ++i) {
      const float s = hsum8(accv[i]);
      float& y = Y[m * ldy + r + i];
      y = accumulate ? y + s : s;
    }
  }
}

// Every activation row in tiles of up to 4 (VNNI: AVX-512's 32 vector
// registers hold the 4 x 4 accumulators) or 2 (AVX2): f(MT, m0) handles rows
// m0 .. m0+MT-1 (MT an integral_constant).
template <bool VNNI, class F>
inline void by_tiles(int64_t M, F&& f) {
  constexpr int MTMAX = VNNI ? 4 : 2;
  int64_t m0 = 0;
  for (; m0 + MTMAX <= M; m0 += MTMAX)
    f(std::integral_constant<int, MTMAX>{}, m0);
  switch (M - m0) {
    case 3: return f(std::integral_constant<int, 3>{}, m0);
    case 2: return f(std::integral_constant<int, 2>{}, m0);
    case 1: return f(std::integral_constant<int, 1>{}, m0);
    default: return;
  }
}

// Rows [r0, r1) four at a time, the rest one at a time: f(R, r) handles rows
// r .. r+R-1 (R an integral_constant).
template <class F>
inline void by_fours(int64_t r0, int64_t r1, F&& f) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4)
    f(std::integral_constant<int, 4>{}, r);
  for (; r < r1; ++r)
    f(std::integral_constant<int, 1>{}, r);
}

template <bool VNNI>
void rows_impl(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r0, int64_t r1, bool acc) {
  const Ahead far = ahead_of(W.row_bytes()); // (once a product: a division)
  // Weight rows four at a time, each group against the activation rows in tiles.
  auto tiled = [&](auto kernel) {
    by_fours(r0, r1, [&](auto R, int64_t r) {
      by_tiles<VNNI>(A.rows, [&](auto MT, int64_t m0) { kernel(R, MT, r, m0); });
    });
  };
  // The 32-value families, one template each, the type as a constant.
  auto q8 = [&](auto T) {
    tiled([&](auto R, auto MT, int64_t r, int64_t m0) { rows_q8_tile<T(), VNNI, R, MT>(W, A, Y, ldy, r, r1, m0, acc, far); });
  };
  auto q32 = [&](auto T) {
    tiled([&](auto R, auto MT, int64_t r, int64_t m0) { rows_q32_tile<T(), VNNI, R, MT>(W, A, Y, ldy, r, r1, m0, acc, far); });
  };
  auto k45 = [&](auto Q5) {
    tiled([&](auto R, auto MT, int64_t r, int64_t m0) { rows_q45_K_tile<Q5(), VNNI, R, MT>(W, A, Y, ldy, r, r1, m0, acc, far); });
  };
  using T = WType;
  switch (W.type) {
    case T::q8_0: return q8(std::integral_constant<T, T::q8_0>{});
    case T::q4_0: return q8(std::integral_constant<T, T::q4_0>{});
    case T::q4_1: return q32(std::integral_constant<T, T::q4_1>{});
    case T::q5_0: return q32(std::integral_constant<T, T::q5_0>{});
    case T::q5_1: return q32(std::integral_constant<T, T::q5_1>{});
    case T::iq4_nl: return q32(std::integral_constant<T, T::iq4_nl>{});
    case T::q4_K: return k45(std::false_type{});
    case T::q5_K: return k45(std::true_type{});
    case WType::q6_K:
      return tiled([&](auto R, auto MT, int64_t r, int64_t m0) { rows_q6_K_tile<VNNI, R, MT>(W, A, Y, ldy, r, r1, m0, acc, far); });
    case WType::q2_K:
      return by_fours(r0, r1, [&](auto R, int64_t r) { rows_q23_K_block<WType::q2_K, VNNI, R>(W, A, Y, ldy, r, r1, acc, far); });
    case WType::q3_K:
      return by_fours(r0, r1, [&](auto R, int64_t r) { rows_q23_K_block<WType::q3_K, VNNI, R>(W, A, Y, ldy, r, r1, acc, far); });
    case WType::iq4_xs:
      return by_fours(r0, r1, [&](auto R, int64_t r) { rows_iq4_xs_block<VNNI, R>(W, A, Y, ldy, r, r1, acc, far); });
    case WType::f32: case WType::f16: case WType::bf16:
      return; // fused_available() is false for these: never called
  }
}

} // namespace strata::model::detail::KQ_NS
