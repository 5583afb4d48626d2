// The fused kernels for CPUs with AVX-512 VNNI (int8) and AVX-512 BF16 (bf16).
// Library headers first: their inline functions must keep the default target
// (the linker may pick any translation unit's copy).
#include "model/base/error.hpp"
#include "model/kernels/kernels_q.hpp"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")
// GCC 12's AVX-512 intrinsics start from a self-initialised "undefined"
// vector, which -Wmaybe-uninitialized reports at every inlined use (a false
// positive, gone in GCC 13).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define KQ_NS vnni
#include "model/kernels/kernels_q_impl.hpp"

namespace strata::model::detail {

namespace {

// Stores to the kernels' scratch memory go through a vector type that aliases
// only floats: a store through __m512 may alias anything, and the compiler then
// reloads every pointer and size the kernel holds after each one.
typedef float f32x16u __attribute__((vector_size(64), aligned(4))); // accumulators (MemAcc)

// Packed q8_0 (packed.hpp) against activations interleaved alike
// (QuantActs::qi), two groups of 8 blocks at a time in 512-bit vectors (one
// load a step: the packed pairs lie step by step). Per
// pair of groups and (weight row, activation row): 8 vpdpbusd leave the
// integer sum of block j of the pair (+128 times the activations' sum, taken
// back through A.corr) in lane j, in two chains of 4 steps for one activation
// row (integer sums: the split changes no result); the 16 weight scales times
// the 16 activation scales then meet those sums in one multiply-add. The last
// group may be partial (nb % 8 lanes, read with masks). Every (weight row,
// activation row) pair goes through the same operations in the same order
// whatever R, MT and M are.
// Step s (4 values of each block) of an activation row's group g, `at` the
// group's interleaved bytes (QuantActs::qi + m x the row stride + 256g), with
// group g+1 in the upper half when PAIR (QuantActs::qi keeps pairs step by step).
template <bool PAIR>
__attribute__((always_inline)) inline __m512i act_step(const int8_t* at, int s) {
  const int8_t* ap = at + (PAIR ? 64 : 32) * s;
  return PAIR ? _mm512_loadu_si512(ap) : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ap)));
}

// Nibble chunks against the activations: for k = 0..3, chunk(i, k) is weight
// row i's 64 bytes whose low nibbles are step k and high nibbles step k + 4;
// fix(i, k, lo, hi) may add to the unpacked values (q5_0's 5th bits). Steps k
// go to P0, steps k + 4 to P1 for one activation row (two chains), else to P0.
// `unpacked` (several tiles of activation rows: run_packed_rows): the first
// tile (m0 == 0) keeps the unpacked values of the group there, 8 x R vectors,
// and the others read them instead of unpacking again; the same values either
// way. Passed for the types with 5th bits (q5_0, q5_1, q5_K: 5 vector
// operations a chunk, shifts sharing port 0 with vpdpbusd), where it measured
// 18-22 % faster at 8-16 rows (one thread, best of 12 alternating runs, 1024 x
// 896); for the others (2 operations a chunk) it measured 5-9 % slower.
template <bool PAIR, int R, int MT, class Chunk, class Fix>
__attribute__((always_inline)) inline void nibble_dots(const QuantActs& A, int64_t qis, int64_t m0, int64_t g,
                                                       __m512i* unpacked, Chunk&& chunk, Fix&& fix,
                                                       __m512i (&P0)[R][MT], __m512i (&P1)[R][MT]) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const int8_t* a0 = A.qi.data() + m0 * qis + 256 * g;
  auto run = [&](auto mode) __attribute__((always_inline)) {
    constexpr int MODE = decltype(mode)::value; // 0: unpack, 1: unpack and keep, 2: read the kept values
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      __m512i lo_a[MT], hi_a[MT];
      for (int t = 0; t < MT; ++t) {
        lo_a[t] = act_step<PAIR>(a0 + t * qis, k);
        hi_a[t] = act_step<PAIR>(a0 + t * qis, k + 4);
      }
      for (int i = 0; i < R; ++i) {
        __m512i lo, hi;
        if constexpr (MODE == 2) {
          lo = _mm512_load_si512(unpacked + 8 * i + 2 * k);
          hi = _mm512_load_si512(unpacked + 8 * i + 2 * k + 1);
        } else {
          const __m512i w = chunk(i, k);
          lo = _mm512_and_si512(w, m4);
          hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
          fix(i, k, lo, hi);
          if constexpr (MODE == 1) {
            _mm512_store_si512(unpacked + 8 * i + 2 * k, lo);
            _mm512_store_si512(unpacked + 8 * i + 2 * k + 1, hi);
          }
        }
        for (int t = 0; t < MT; ++t) {
          P0[i][t] = _mm512_dpbusd_epi32(P0[i][t], lo, lo_a[t]);
          auto& Ph = MT == 1 ? P1 : P0;
          Ph[i][t] = _mm512_dpbusd_epi32(Ph[i][t], hi, hi_a[t]);
        }
      }
    }
  };
  if (unpacked == nullptr)
    run(std::integral_constant<int, 0>{});
  else if (m0 == 0)
    run(std::integral_constant<int, 1>{});
  else
    run(std::integral_constant<int, 2>{});
}

// The integer chains of a group (pair) for weight rows i < R and activation
// rows m0 + t: P0 starts at each lane's activation-sum correction (A.corr of
// blocks 8g .. 8g+15 in `live` lanes, shifted right by `shift`), P1 at zero.
template <int R, int MT>
__attribute__((always_inline)) inline void chains_from_corr(const QuantActs& A, __mmask16 live, int64_t nb, int64_t g,
                                                            int64_t m0, int shift, __m512i (&P0)[R][MT],
                                                            __m512i (&P1)[R][MT]) {
  for (int t = 0; t < MT; ++t) {
    const __m512i cv = _mm512_srai_epi32(_mm512_maskz_loadu_epi32(live, A.corr.data() + (m0 + t) * nb + 8 * g), shift);
    for (int i = 0; i < R; ++i) {
      P0[i][t] = cv;
      P1[i][t] = _mm512_setzero_si512();
    }
  }
}

template <int R, int MT>
__attribute__((always_inline)) inline void zero_chains(__m512i (&P0)[R][MT], __m512i (&P1)[R][MT]) {
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < MT; ++t)
      P0[i][t] = P1[i][t] = _mm512_setzero_si512();
}

// The 5th bits of steps k (lo) and k + 4 (hi) or-ed into bit 4 of each value:
// bit k (4 + k) of each byte of qh (packed q5_0, q5_1 and q5_K) brought there
// by one shift.
__attribute__((always_inline)) inline void fix_5th_bits(__m512i qh, int k, __m512i& lo, __m512i& hi) {
  const __m512i b4 = _mm512_set1_epi8(0x10);
  lo = _mm512_ternarylogic_epi32(lo, _mm512_slli_epi16(qh, 4 - k), b4, 0xF8); // lo | (x & b4)
  hi = _mm512_ternarylogic_epi32(hi, _mm512_srli_epi16(qh, k), b4, 0xF8);
}

// Row r of W, rb its bytes worked out once (W.row() works them out out of line
// at every call: inside the group loops that cost 10-25 %).
__attribute__((always_inline)) inline const uint8_t* row_at(const WMatrix& W, std::size_t rb, int64_t r) {
  return W.data + rb * static_cast<std::size_t>(r);
}

// What the packed 32-value kernels share: groups of 8 blocks of BB bytes (a
// partial last one of `tail` blocks), their f16 scales first.
template <std::size_t BB>
struct Blocks32 {
  const WMatrix& W;
  const QuantActs& A;
  int64_t nb, ng_full, tail, qis;
  std::size_t rb;
  vnni::Ahead ahead; // the rows prefetched on (ahead_of)
  static constexpr std::size_t GB = 8 * BB; // bytes of a full group

  Blocks32(const WMatrix& w, const QuantActs& a)
      : W(w), A(a), nb(w.cols / 32), ng_full(w.cols / 32 / 8), tail(w.cols / 32 % 8),
        qis((w.cols / 32 + 7) / 8 * 256), rb(w.row_bytes()), ahead(vnni::ahead_of(rb)) {}

  // Lanes of the upper (PAIR) or lower half that are real blocks, as a mask
  // of 16 lanes; PART: the last group of the call is the partial one.
  template <bool PAIR, bool PART>
  __mmask16 lanes() const {
    const unsigned last = PART ? (1u << tail) - 1 : 0xFFu;
    return static_cast<__mmask16>(PAIR ? (0xFFu | (last << 8)) : last);
  }

  // The weight side of groups g (and g+1) of rows r .. r+R-1 that every
  // activation row shares: the 16 scales as floats.
  template <int R>
  struct Prep {
    __m512 ws[R];
  };
  template <bool PAIR, bool PART, int R>
  __attribute__((always_inline)) void prepare(int64_t g, int64_t r, Prep<R>& p) const {
    for (int i = 0; i < R; ++i)
      p.ws[i] = f16_lanes<PAIR, PART>(row_at(W, rb, r + i) + g * GB, 0, 0);
  }

  // One f16 per block of group g (and g + 1) as floats, lane j for block j:
  // those at byte `full_at` of a full group, `part_at` of the partial one (gp:
  // group g's first byte).
  template <bool PAIR, bool PART>
  __attribute__((always_inline)) __m512 f16_lanes(const uint8_t* gp, int64_t full_at, int64_t part_at) const {
    const __mmask8 part = static_cast<__mmask8>((1u << tail) - 1);
    __m128i lo, hi = _mm_setzero_si128();
    if (PAIR) {
      lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gp + full_at));
      hi = PART ? _mm_maskz_loadu_epi16(part, gp + GB + part_at)
                : _mm_loadu_si128(reinterpret_cast<const __m128i*>(gp + GB + full_at));
    } else {
      lo = PART ? _mm_maskz_loadu_epi16(part, gp + part_at) : _mm_loadu_si128(reinterpret_cast<const __m128i*>(gp + full_at));
    }
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
  }

  // acc += the weight scales x the activation scales x the integer sums (P0,
  // plus P1 for one activation row), lane by lane.
  template <int R, int MT, class Acc>
  __attribute__((always_inline)) void scale_into(const Prep<R>& prep, __mmask16 live, int64_t g, int64_t m0,
                                                 const __m512i (&P0)[R][MT], const __m512i (&P1)[R][MT],
                                                 Acc& acc) const {
    const float* d = A.d.data() + m0 * nb + 8 * g;
    __m512 dv[MT];
    for (int t = 0; t < MT; ++t)
      dv[t] = _mm512_maskz_loadu_ps(live, d + t * nb);
    for (int i = 0; i < R; ++i)
      for (int t = 0; t < MT; ++t) {
        const __m512i p = MT == 1 ? _mm512_add_epi32(P0[i][t], P1[i][t]) : P0[i][t];
        acc.set(i, t, _mm512_fmadd_ps(_mm512_mul_ps(prep.ws[i], dv[t]), _mm512_cvtepi32_ps(p), acc.get(i, t)));
      }
  }
};

struct Q8p : Blocks32<34> {
  using Blocks32::Blocks32;
  // Pairs of groups lie step by step (packed.hpp): their 16 + 2L bytes of
  // scales, then steps of 32 + 4L bytes (L: the blocks of the second group).
  template <bool PART>
  int64_t second() const {
    return PART ? tail : 8;
  }

  template <bool PAIR, bool PART, int R>
  __attribute__((always_inline)) void prepare(int64_t g, int64_t r, Prep<R>& p) const {
    if constexpr (PAIR) {
      const __mmask16 m = lanes<PAIR, PART>();
      for (int i = 0; i < R; ++i) {
        const uint8_t* sp = row_at(W, rb, r + i) + g * GB;
        p.ws[i] = _mm512_cvtph_ps(PART ? _mm256_maskz_loadu_epi16(m, sp) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)));
      }
    } else {
      Blocks32::prepare<PAIR, PART, R>(g, r, p);
    }
  }

  template <bool PAIR, bool PART, int R, int MT, class Acc>
  __attribute__((always_inline)) void groups(int64_t g, int64_t r, int64_t m0, auto fetch, const Prep<R>& prep,
                                             Acc& acc) const {
    const uint8_t* row0 = row_at(W, rb, r);
    const __mmask16 live = lanes<PAIR, PART>();
    // The partial group's steps: 4 * tail bytes each after its 2 * tail bytes of scales.
    const int64_t pstep = 4 * tail, pfirst = 2 * tail;
    const __mmask32 pmask = static_cast<__mmask32>((uint64_t{1} << pstep) - 1);
    // Even and odd steps in two chains for one activation row (latency); one
    // chain for tiles (registers).
    constexpr bool two = MT == 1;
    __m512i P0[R][MT], P1[R][MT];
    chains_from_corr<R, MT>(A, live, nb, g, m0, 0, P0, P1);
    const int8_t* a0 = A.qi.data() + m0 * qis + 256 * g;
    const uint8_t* g0 = row0 + g * GB;
    auto step = [&](__m512i(&P)[R][MT], int s, bool fetch_here) __attribute__((always_inline)) {
      __m512i a[MT];
      for (int t = 0; t < MT; ++t)
        a[t] = act_step<PAIR>(a0 + t * qis, s);
      for (int i = 0; i < R; ++i) {
        const uint8_t* gp = g0 + i * rb;
        if constexpr (PAIR) {
          const int64_t L = second<PART>(), step = 32 + 4 * L;
          const uint8_t* wp = gp + 16 + 2 * L + step * s;
          if (fetch_here) {
            _mm_prefetch(reinterpret_cast<const char*>(wp + ahead.bytes), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(wp + ahead.bytes + 64), _MM_HINT_T0);
          }
          const __m512i w = PART ? _mm512_maskz_loadu_epi8(static_cast<__mmask64>((uint64_t{1} << step) - 1), wp)
                                 : _mm512_loadu_si512(wp);
          for (int t = 0; t < MT; ++t)
            P[i][t] = _mm512_dpbusd_epi32(P[i][t], w, a[t]);
          continue;
        }
        // A group alone (the last one): 32-byte steps, or 4L for a partial one.
        const uint8_t* wp = gp + 16 + 32 * s;
        if (fetch_here)
          _mm_prefetch(reinterpret_cast<const char*>(wp + ahead.bytes), _MM_HINT_T0);
        const __m512i w = _mm512_zextsi256_si512(PART ? _mm256_maskz_loadu_epi8(pmask, gp + pfirst + pstep * s)
                                                      : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp)));
        for (int t = 0; t < MT; ++t)
          P[i][t] = _mm512_dpbusd_epi32(P[i][t], w, a[t]);
      }
    };
#pragma GCC unroll 4
    for (int s = 0; s < 8; s += 2) {
      step(P0, s, fetch);
      step(two ? P1 : P0, s + 1, false);
    }
    scale_into<R, MT>(prep, live, g, m0, P0, P1, acc);
  }
};

// The 16 iq4_nl values + 128 (unsigned bytes) in each 128-bit lane, for byte shuffles.
__attribute__((always_inline)) inline __m512i iq4_table_u512() {
  return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(iq4nl_values))),
                          _mm512_set1_epi8(static_cast<char>(0x80)));
}

// Packed q4_0, q5_0, q4_1, q5_1 and iq4_nl (packed.hpp): groups of 8 blocks
// as packed q8_0's (pairs in 512-bit vectors, a partial last group read with
// masks), the values unsigned (q4_0, q4_1: 0..15, q5_0, q5_1: 0..31 with the
// 5th bit brought from its byte to bit 4 by a shift and an or, iq4_nl: its
// table's value + 128 by one byte shuffle), so w = q - 8 (q - 16, K - 128)
// comes back through -8 (-16, -128) x each activation block's sum (A.corr /
// 16, / 8, as is: exact); q4_1 and q5_1 (w = d q + m) need no correction and
// add m x A.s (llama.cpp's q8_1 "s": the activation block's scale x sum) per
// lane after the scaling. Steps k and k + 4 from one chunk's low and high
// nibbles.
constexpr std::size_t q4p_block_bytes(WType t) {
  return t == WType::q5_0 ? 22 : t == WType::q4_1 ? 20 : t == WType::q5_1 ? 24 : 18;
}
template <WType T>
struct Q4p : Blocks32<q4p_block_bytes(T)> {
  static constexpr bool Q5 = T == WType::q5_0 || T == WType::q5_1, NL = T == WType::iq4_nl;
  static constexpr bool MIN = T == WType::q4_1 || T == WType::q5_1;
  static constexpr int64_t H = MIN ? 4 : 2; // header bytes a block: d (and m)
  using B = Blocks32<q4p_block_bytes(T)>;
  using B::A, B::W, B::GB, B::nb, B::qis, B::rb, B::tail, B::ahead;
  using B::B;
  // -128 s as is (iq4_nl), / 8 = -16 s (q5_0), / 16 = -8 s (q4_0)
  static constexpr int corr_shift = NL ? 0 : Q5 ? 3 : 4;
  mutable __m512i* unpacked = nullptr; // nibble_dots's (q5_0, q5_1), set by run_packed_rows

  // The weight side every activation row shares: the scales (B's), and the
  // mins of q4_1 and q5_1.
  template <int R>
  struct Prep : B::template Prep<R> {
    __m512 wm[R];
  };
  template <bool PAIR, bool PART, int R>
  __attribute__((always_inline)) void prepare(int64_t g, int64_t r, Prep<R>& p) const {
    B::template prepare<PAIR, PART, R>(g, r, p);
    if constexpr (MIN)
      for (int i = 0; i < R; ++i)
        p.wm[i] = this->template f16_lanes<PAIR, PART>(row_at(W, rb, r + i) + g * GB, 16, 2 * tail);
  }

  // The weight side of group g (and g+1) of rows r .. r+R-1: chunk(i, k) and
  // the unpacking of its nibbles (fix).
  template <bool PAIR, bool PART, int R>
  struct Side {
    const uint8_t* row0;
    std::size_t rb, ahead;
    int64_t g, GB, L;
    bool fetch;
    __mmask32 cmask;
    __m512i qh[R]; // q5_0, q5_1: the 5th bits
    __m512i table;

    __attribute__((always_inline)) Side(const Q4p& k, int64_t g_, int64_t r, bool fetch_)
        : row0(row_at(k.W, k.rb, r)), rb(k.rb), ahead(k.ahead.bytes), g(g_), GB(static_cast<int64_t>(k.GB)), L(k.tail), fetch(fetch_) {
      cmask = static_cast<__mmask32>((uint64_t{1} << (4 * L)) - 1);
      const __mmask8 wmask = static_cast<__mmask8>((1u << L) - 1);
      // The bytes of 5th bits (packed.hpp), where the chunks' bytes are.
      if constexpr (Q5)
        for (int i = 0; i < R; ++i) {
          const uint8_t* gp = row0 + i * rb + g * GB;
          constexpr int64_t QH = H + 16; // x the group's blocks
          const __m256i lo = PAIR || !PART ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + QH * 8))
                                           : _mm256_maskz_loadu_epi32(wmask, gp + QH * L);
          const __m256i hi = !PAIR ? _mm256_setzero_si256()
                             : PART ? _mm256_maskz_loadu_epi32(wmask, gp + GB + QH * L)
                                    : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + GB + QH * 8));
          qh[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
      table = NL ? iq4_table_u512() : _mm512_setzero_si512();
    }
    __attribute__((always_inline)) __m512i chunk(int i, int k) const {
      const uint8_t* gp = row0 + i * rb + g * GB;
      if (fetch) {
        _mm_prefetch(reinterpret_cast<const char*>(gp + 64 * k + ahead), _MM_HINT_T0);
        if (PAIR)
          _mm_prefetch(reinterpret_cast<const char*>(gp + GB + 64 * k + ahead), _MM_HINT_T0);
      }
      __m256i c0, c1 = _mm256_setzero_si256();
      if (PAIR) {
        c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 8 * H + 32 * k));
        c1 = PART ? _mm256_maskz_loadu_epi8(cmask, gp + GB + H * L + 4 * L * k)
                  : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + GB + 8 * H + 32 * k));
      } else {
        c0 = PART ? _mm256_maskz_loadu_epi8(cmask, gp + H * L + 4 * L * k)
                  : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 8 * H + 32 * k));
      }
      return _mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1);
    }
    __attribute__((always_inline)) void fix(int i, int k, __m512i& lo, __m512i& hi) const {
      if constexpr (Q5)
        fix_5th_bits(qh[i], k, lo, hi);
      else if constexpr (NL) {
        lo = _mm512_shuffle_epi8(table, lo);
        hi = _mm512_shuffle_epi8(table, hi);
      }
    }
  };

  template <bool PAIR, bool PART, int R, int MT, class Acc>
  __attribute__((always_inline)) void groups(int64_t g, int64_t r, int64_t m0, bool fetch, const Prep<R>& prep,
                                             Acc& acc) const {
    const __mmask16 live = this->template lanes<PAIR, PART>();
    __m512i P0[R][MT], P1[R][MT];
    if constexpr (MIN)
      zero_chains<R, MT>(P0, P1);
    else
      chains_from_corr<R, MT>(A, live, nb, g, m0, corr_shift, P0, P1);
    const Side<PAIR, PART, R> side(*this, g, r, fetch);
    nibble_dots<PAIR, R, MT>(
      A, qis, m0, g, Q5 ? unpacked : nullptr, [&](int i, int k) __attribute__((always_inline)) { return side.chunk(i, k); },
      [&](int i, int k, __m512i& lo, __m512i& hi) __attribute__((always_inline)) { side.fix(i, k, lo, hi); }, P0, P1);
    this->template scale_into<R, MT>(prep, live, g, m0, P0, P1, acc);
    if constexpr (MIN) { // + m x the activation block's scale x sum, lane by lane
      __m512 sv[MT];
      for (int t = 0; t < MT; ++t)
        sv[t] = _mm512_maskz_loadu_ps(live, A.s.data() + (m0 + t) * nb + 8 * g);
      for (int i = 0; i < R; ++i)
        for (int t = 0; t < MT; ++t)
          acc.set(i, t, _mm512_fmadd_ps(prep.wm[i], sv[t], acc.get(i, t)));
    }
  }
};

// Chunk k (32 bytes) of the nibbles of 256-value block g of a packed row
// (blocks of BB bytes, H header bytes first: q4_K, iq4_xs), and with PAIR the
// next block's in the upper half; `fetch` prefetches the same bytes `ahead` bytes on.
template <std::size_t BB, std::size_t H, bool PAIR>
__attribute__((always_inline)) inline __m512i k256_chunk(const uint8_t* row, std::size_t ahead, int64_t g, int k,
                                                         bool fetch) {
  const uint8_t* wp = row + g * BB + H + 32 * k;
  if (fetch) {
    _mm_prefetch(reinterpret_cast<const char*>(wp + ahead), _MM_HINT_T0);
    if (PAIR)
      _mm_prefetch(reinterpret_cast<const char*>(wp + BB + ahead), _MM_HINT_T0);
  }
  const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
  return PAIR ? _mm512_inserti64x4(_mm512_castsi256_si512(w0), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + BB)), 1)
              : _mm512_zextsi256_si512(w0);
}

// What the packed 256-value kernels share (q4_K, iq4_xs): a block is a group
// of 8 sub-blocks of 32, rows are whole blocks (PART is never asked for).
struct Blocks256 {
  const WMatrix& W;
  const QuantActs& A;
  int64_t ng_full, nb32, qis;
  std::size_t rb;
  vnni::Ahead ahead; // as Blocks32's
  int64_t tail = 0;

  Blocks256(const WMatrix& w, const QuantActs& a)
      : W(w), A(a), ng_full(w.cols / 256), nb32(w.cols / 32), qis(w.cols / 256 * 256), rb(w.row_bytes()),
        ahead(vnni::ahead_of(rb)) {}
};

// Packed q4_K (packed.hpp) against q8_K activations interleaved as q8_0's
// (a q4_K block is a group of 8 sub-blocks of 32), two blocks at a time in
// 512-bit vectors: per chunk of 32 bytes one load and two masks give steps k
// and k + 4 of all 8 sub-blocks (unsigned values 0..15: no correction), 8
// vpdpbusd leave each sub-block's integer dot in its lane; then d x scale_j x
// da and dmin x min_j x (da x the activations' sum of sub-block j) are one
// multiply-add each for the 16 lanes. Q5 (packed q5_K): the same with each
// value's 5th bit or-ed in from the block's 32 bytes of them (packed.hpp) by
// a shift and a vpternlogd, as packed q5_0's.
template <bool Q5>
struct Q4Kp : Blocks256 {
  mutable __m512i* unpacked = nullptr; // nibble_dots's (q5_K), set by run_packed_rows
  using Blocks256::Blocks256;
  static constexpr std::size_t BB = Q5 ? 176 : 144, QS = Q5 ? 48 : 16;

  // The weight side every activation row shares: d x scales, dmin x mins,
  // of one block (lanes 0-7) or two (PAIR: the next one in lanes 8-15), from
  // the packed header (packed.hpp) in one vector decode.
  template <int R>
  struct Prep {
    __m512 sc[R], mn[R];
  };
  template <bool PAIR, bool PART, int R>
  __attribute__((always_inline)) void prepare(int64_t g, int64_t r, Prep<R>& p) const {
    const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
    const __m512i m4 = _mm512_set1_epi32(15), m2 = _mm512_set1_epi32(3);
    for (int i = 0; i < R; ++i) {
      const uint8_t* blk = row_at(W, rb, r + i) + g * BB;
      const uint8_t* nxt = blk + BB;
      uint32_t h0, h1 = 0;
      std::memcpy(&h0, blk + 12, 4);
      __m128i lo8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 4));
      __m512 d = _mm512_set1_ps(vnni::half_to_float(blk)), dmin = _mm512_set1_ps(vnni::half_to_float(blk + 2));
      if (PAIR) {
        std::memcpy(&h1, nxt + 12, 4);
        lo8 = _mm_unpacklo_epi64(lo8, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(nxt + 4)));
        d = _mm512_mask_blend_ps(0xFF00, d, _mm512_set1_ps(vnni::half_to_float(nxt)));
        dmin = _mm512_mask_blend_ps(0xFF00, dmin, _mm512_set1_ps(vnni::half_to_float(nxt + 2)));
      }
      const __m512i v = _mm512_cvtepu8_epi32(lo8);
      const __m512i h = _mm512_mask_set1_epi32(_mm512_set1_epi32(static_cast<int>(h0)), 0xFF00, static_cast<int>(h1));
      const __m512i hs = _mm512_srlv_epi32(h, shifts);
      const __m512i sc = _mm512_or_si512(_mm512_and_si512(v, m4), _mm512_slli_epi32(_mm512_and_si512(hs, m2), 4));
      const __m512i mn = _mm512_or_si512(_mm512_srli_epi32(v, 4),
                                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hs, 16), m2), 4));
      p.sc[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
      p.mn[i] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn));
    }
  }

  template <bool PAIR, bool PART, int R, int MT, class Acc>
  __attribute__((always_inline)) void groups(int64_t g, int64_t r, int64_t m0, bool fetch, const Prep<R>& prep,
                                             Acc& acc) const {
    const uint8_t* row0 = row_at(W, rb, r);
    constexpr bool two = MT == 1; // steps k and k + 4 in two chains for one activation row
    __m512i P0[R][MT], P1[R][MT];
    zero_chains<R, MT>(P0, P1);
    auto chunk = [&](int i, int k) __attribute__((always_inline)) {
      return k256_chunk<BB, QS, PAIR>(row0 + i * rb, ahead.bytes, g, k, fetch);
    };
    __m512i qh[R]; // q5_K: the 5th bits of block g (and g + 1)
    if constexpr (Q5)
      for (int i = 0; i < R; ++i) {
        const uint8_t* blk = row0 + i * rb + g * BB + 16;
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
        qh[i] = PAIR ? _mm512_inserti64x4(_mm512_castsi256_si512(lo), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + BB)), 1)
                     : _mm512_zextsi256_si512(lo);
      }
    nibble_dots<PAIR, R, MT>(A, qis, m0, g, Q5 ? unpacked : nullptr, chunk,
                             [&](int i, int k, __m512i& lo, __m512i& hi) __attribute__((always_inline)) {
                               if constexpr (Q5)
                                 fix_5th_bits(qh[i], k, lo, hi);
                             },
                             P0, P1);
    __m512 dv[MT], dsv[MT];
    for (int t = 0; t < MT; ++t) {
      const float* d = A.d32.data() + (m0 + t) * nb32 + 8 * g;
      const float* ds = A.dsum32.data() + (m0 + t) * nb32 + 8 * g;
      dv[t] = PAIR ? _mm512_loadu_ps(d) : _mm512_zextps256_ps512(_mm256_loadu_ps(d));
      dsv[t] = PAIR ? _mm512_loadu_ps(ds) : _mm512_zextps256_ps512(_mm256_loadu_ps(ds));
    }
    for (int i = 0; i < R; ++i) {
      const __m512 sc = prep.sc[i], mn = prep.mn[i];
      for (int t = 0; t < MT; ++t) {
        const __m512i p = two ? _mm512_add_epi32(P0[i][t], P1[i][t]) : P0[i][t];
        acc.set(i, t, _mm512_fnmadd_ps(mn, dsv[t], _mm512_fmadd_ps(_mm512_mul_ps(sc, dv[t]), _mm512_cvtepi32_ps(p), acc.get(i, t))));
      }
    }
  }

};

// Packed iq4_xs (packed.hpp): as packed q4_K, each 256-value block a group of
// 8 sub-blocks two blocks at a time, the nibbles through the iq4_nl table + 128
// (one byte shuffle), the +128 taken back through -128 x each sub-block's
// activation sum (A.corr) in its lane's integer sum; then d x (ls_j - 32) x
// da meets that sum in one multiply-add for the 16 lanes.
struct IQ4XSp : Blocks256 {
  using Blocks256::Blocks256;

  // d x (ls_j - 32) of the block's 8 sub-blocks: ls_j's low 4 bits are bits
  // 4j .. 4j+3 of the scales_l word, its high 2 bits 2j, 2j+1 of scales_h.
  static __attribute__((always_inline)) __m256 scales(const uint8_t* blk) {
    uint16_t sh;
    uint32_t sl;
    std::memcpy(&sh, blk + 2, 2);
    std::memcpy(&sl, blk + 4, 4);
    const __m256i lo = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(sl)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
      _mm256_set1_epi32(0xF));
    const __m256i hi = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(sh), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), _mm256_set1_epi32(3));
    const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
    return _mm256_mul_ps(_mm256_set1_ps(vnni::half_to_float(blk)), _mm256_cvtepi32_ps(ls));
  }

  template <int R>
  struct Prep {
    __m512 sc[R];
  };
  template <bool PAIR, bool PART, int R>
  __attribute__((always_inline)) void prepare(int64_t g, int64_t r, Prep<R>& p) const {
    for (int i = 0; i < R; ++i) {
      const uint8_t* blk = row_at(W, rb, r + i) + g * 136;
      const __m256 s0 = scales(blk), s1 = PAIR ? scales(blk + 136) : _mm256_setzero_ps();
      p.sc[i] = _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(s0)), _mm256_castps_pd(s1), 1));
    }
  }

  template <bool PAIR, bool PART, int R, int MT, class Acc>
  __attribute__((always_inline)) void groups(int64_t g, int64_t r, int64_t m0, bool fetch, const Prep<R>& prep,
                                             Acc& acc) const {
    const uint8_t* row0 = row_at(W, rb, r);
    constexpr bool two = MT == 1; // steps k and k + 4 in two chains for one activation row
    constexpr __mmask16 live = PAIR ? 0xFFFF : 0xFF;
    __m512i P0[R][MT], P1[R][MT];
    chains_from_corr<R, MT>(A, live, nb32, g, m0, 0, P0, P1);
    auto chunk = [&](int i, int k) __attribute__((always_inline)) {
      return k256_chunk<136, 8, PAIR>(row0 + i * rb, ahead.bytes, g, k, fetch);
    };
    const __m512i table = iq4_table_u512();
    nibble_dots<PAIR, R, MT>(A, qis, m0, g, nullptr, chunk,
                             [&](int, int, __m512i& lo, __m512i& hi) __attribute__((always_inline)) {
                               lo = _mm512_shuffle_epi8(table, lo);
                               hi = _mm512_shuffle_epi8(table, hi);
                             },
                             P0, P1);
    __m512 dv[MT];
    for (int t = 0; t < MT; ++t) {
      const float* d = A.d32.data() + (m0 + t) * nb32 + 8 * g;
      dv[t] = PAIR ? _mm512_loadu_ps(d) : _mm512_zextps256_ps512(_mm256_loadu_ps(d));
    }
    for (int i = 0; i < R; ++i)
      for (int t = 0; t < MT; ++t) {
        const __m512i p = two ? _mm512_add_epi32(P0[i][t], P1[i][t]) : P0[i][t];
        acc.set(i, t, _mm512_fmadd_ps(_mm512_mul_ps(prep.sc[i], dv[t]), _mm512_cvtepi32_ps(p), acc.get(i, t)));
      }
  }
};

// Packed q2_K, q3_K and q6_K (packed.hpp) against q8_K activations
// interleaved by 16 (QuantActs::qi16): a block is 16 groups of 16, one per
// 32-bit lane; step k (k < 4) is values 4k .. 4k+3 of every group, one
// vpdpbusd, leaving each group's integer dot in its lane after 4 steps. PAIR:
// two blocks, one after the other.
// - q2_K: one 64-byte load, then per step a shift and a mask give the values
//   (0..3, unsigned: no correction); then d x scale_g x da and dmin x min_g x
//   (da x the group's activation sum) meet the 16 lanes in one multiply-add
//   each.
// - q3_K: the same, with 4 added where a value's 3rd bit is set (step k's 3rd
//   bits are one 64-bit mask, one masked add); the values 0..7
//   stand for q - 4, so each lane's chain starts at -4 x its group's
//   activation sum; then d x (scale_g - 32) x da meets it.
// - q6_K: two 64-byte loads of nibbles (steps k and k + 2) and one of the 2
//   high bits, or-ed in at bits 4, 5 by a shift and a vpternlogd; the values
//   0..63 stand for q - 32 (the chain starts at -32 x the activation sum);
//   then d x scale_g x da meets it.
template <WType T>
struct K16p {
  static constexpr bool Q3 = T == WType::q3_K, Q6 = T == WType::q6_K;
  const WMatrix& W;
  const QuantActs& A;
  int64_t ng_full, nb;
  std::size_t rb;
  vnni::Ahead ahead; // as Blocks32's
  int64_t tail = 0; // rows are whole blocks: PART is never asked for
  static constexpr std::size_t BB = Q6 ? 210 : Q3 ? 110 : 84;

  K16p(const WMatrix& w, const QuantActs& a)
      : W(w), A(a), ng_full(w.cols / 256), nb(w.cols / 256), rb(w.row_bytes()), ahead(vnni::ahead_of(rb)) {}

  template <int R>
  struct Prep {
    __m512 sc[R][2], mn[R][2]; // d x scales, (q2_K) dmin x mins of blocks g and g + 1
  };
  template <bool PAIR, bool PART, int R>
  __attribute__((always_inline)) void prepare(int64_t g, int64_t r, Prep<R>& p) const {
    for (int i = 0; i < R; ++i)
      for (int b = 0; b < (PAIR ? 2 : 1); ++b) {
        const uint8_t* blk = row_at(W, rb, r + i) + (g + b) * BB;
        if constexpr (Q6) {
          const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
          p.sc[i][b] = _mm512_mul_ps(_mm512_set1_ps(vnni::half_to_float(blk + 208)), _mm512_cvtepi32_ps(sc));
        } else if constexpr (Q3) {
          uint32_t w[4];
          q3_K_scale_words(blk + 96, w);
          const __m512i sc = _mm512_sub_epi32(
            _mm512_cvtepi8_epi32(_mm_set_epi32(static_cast<int>(w[3]), static_cast<int>(w[2]), static_cast<int>(w[1]),
                                               static_cast<int>(w[0]))),
            _mm512_set1_epi32(32));
          p.sc[i][b] = _mm512_mul_ps(_mm512_set1_ps(vnni::half_to_float(blk + 108)), _mm512_cvtepi32_ps(sc));
        } else {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
          p.sc[i][b] = _mm512_mul_ps(_mm512_set1_ps(vnni::half_to_float(blk + 80)),
                                     _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))));
          p.mn[i][b] = _mm512_mul_ps(_mm512_set1_ps(vnni::half_to_float(blk + 82)), _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)));
        }
      }
  }

  template <bool PAIR, bool PART, int R, int MT, class Acc>
  __attribute__((always_inline)) void groups(int64_t g, int64_t r, int64_t m0, bool fetch, const Prep<R>& prep,
                                             Acc& acc) const {
    const uint8_t* row0 = row_at(W, rb, r);
    constexpr bool two = MT == 1; // steps 0, 2 and 1, 3 in two chains for one activation row
    constexpr int offset_shift = Q6 ? 5 : 2; // the chains start at -32 (-4) x the activation sums
    const __m512i m2 = _mm512_set1_epi8(3), m4 = _mm512_set1_epi8(0x0F), b2 = _mm512_set1_epi8(4),
                  b45 = _mm512_set1_epi8(0x30);
    for (int b = 0; b < (PAIR ? 2 : 1); ++b) {
      const int64_t blk_i = g + b;
      // Per activation row: where its chains start, its block scale.
      __m512i base[MT];
      __m512 da[MT];
      for (int t = 0; t < MT; ++t) {
        const int64_t at = (m0 + t) * nb + blk_i;
        base[t] = (Q3 || Q6) ? _mm512_sub_epi32(_mm512_setzero_si512(),
                                                _mm512_slli_epi32(_mm512_loadu_si512(A.sums.data() + 16 * at), offset_shift))
                             : _mm512_setzero_si512();
        da[t] = _mm512_set1_ps(A.d[static_cast<std::size_t>(at)]);
      }
      __m512i P0[R][MT], P1[R][MT], w[R];
      for (int i = 0; i < R; ++i) {
        const uint8_t* blk = row0 + i * rb + blk_i * BB;
        if (fetch)
          for (std::size_t l = 0; l < (Q6 ? 256 : 128); l += 64)
            _mm_prefetch(reinterpret_cast<const char*>(blk + ahead.bytes + l), _MM_HINT_T0);
        if constexpr (!Q6) // (q6_K's three vectors are loaded at each step: registers)
          w[i] = _mm512_loadu_si512(blk + (Q3 ? 0 : 16));
        for (int t = 0; t < MT; ++t) {
          P0[i][t] = base[t];
          P1[i][t] = _mm512_setzero_si512();
        }
      }
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        __m512i a[MT];
        for (int t = 0; t < MT; ++t)
          a[t] = _mm512_loadu_si512(A.qi16.data() + (m0 + t) * W.cols + 256 * blk_i + 64 * k);
        for (int i = 0; i < R; ++i) {
          const uint8_t* blk = row0 + i * rb + blk_i * BB;
          __m512i q;
          if constexpr (Q6) { // nibbles, then bits 2k, 2k + 1 of the high byte to bits 4, 5
            const __m512i c = _mm512_loadu_si512(blk + 64 * (k & 1)), h = _mm512_loadu_si512(blk + 128);
            q = _mm512_and_si512(k < 2 ? c : _mm512_srli_epi16(c, 4), m4);
            const __m512i hk = k < 2 ? _mm512_slli_epi16(h, 4 - 2 * k) : k == 2 ? h : _mm512_srli_epi16(h, 2);
            q = _mm512_ternarylogic_epi32(q, hk, b45, 0xF8); // q | (hk & 0x30)
          } else {
            q = _mm512_and_si512(_mm512_srli_epi16(w[i], 2 * k), m2);
          }
          if constexpr (Q3) { // + 4 in the lane bytes whose 3rd bit is set: step k's 64 bits are one mask
            uint64_t bits;
            std::memcpy(&bits, blk + 64 + 8 * k, 8);
            q = _mm512_mask_add_epi8(q, _cvtu64_mask64(bits), q, b2);
          }
          for (int t = 0; t < MT; ++t) {
            auto& P = two && (k & 1) ? P1 : P0;
            P[i][t] = _mm512_dpbusd_epi32(P[i][t], q, a[t]);
          }
        }
      }
      for (int i = 0; i < R; ++i)
        for (int t = 0; t < MT; ++t) {
          const int64_t at = (m0 + t) * nb + blk_i;
          const __m512i p = two ? _mm512_add_epi32(P0[i][t], P1[i][t]) : P0[i][t];
          const __m512 sum = _mm512_fmadd_ps(_mm512_mul_ps(prep.sc[i][b], da[t]), _mm512_cvtepi32_ps(p), acc.get(i, t));
          if constexpr (Q3 || Q6)
            acc.set(i, t, sum);
          else
            acc.set(i, t, _mm512_fnmadd_ps(prep.mn[i][b], _mm512_loadu_ps(A.dsum16.data() + 16 * at), sum));
        }
    }
  }
};

// A packed kernel K over weight rows [r0, r1) (run_packed): four rows side by
// side (the rows ahead_of(rb) on prefetched on the first tile), activation rows in tiles
// of up to 4 (run_packed_rows), then one horizontal sum per (row, activation
// row): a row's result does not depend on M.
// over_groups calls f(PAIR, PART, g) for every pair of groups of a row, then a last group
// alone or a full group with the partial one (K::tail lanes).
template <class K, class F>
__attribute__((always_inline)) inline void over_groups(const K& k, F&& f) {
  using T = std::true_type;
  using N = std::false_type;
  int64_t g = 0;
  for (; g + 2 <= k.ng_full; g += 2)
    f(T{}, N{}, g);
  const bool one_full = g < k.ng_full;
  if (one_full && k.tail > 0)
    f(T{}, T{}, g);
  else if (one_full)
    f(N{}, N{}, g);
  else if (k.tail > 0)
    f(N{}, T{}, g);
}

// The accumulators of weight rows i < R and activation rows m0 + t < m0 + MT:
// in registers (RegAcc: one activation row), or in memory (MemAcc: tiles of
// several rows, read and written at each group's scaling only, so the integer
// chains alone hold the registers through a group's steps).
template <int R, int MT>
struct RegAcc {
  __m512 v[R][MT];
  __attribute__((always_inline)) __m512 get(int i, int t) const { return v[i][t]; }
  __attribute__((always_inline)) void set(int i, int t, __m512 x) { v[i][t] = x; }
};
template <int R>
struct MemAcc {
  float* p;   // [t][i][16 lanes] of the tile
  bool first; // the row's first group: p holds nothing yet, each accumulator is zero until set
  uint32_t written = 0; // (first group) the accumulators set so far, bit t * R + i
  __attribute__((always_inline)) __m512 get(int i, int t) const {
    if (first && !(written >> (t * R + i) & 1u))
      return _mm512_setzero_ps();
    return reinterpret_cast<__m512>(*reinterpret_cast<const f32x16u*>(p + 16 * (t * R + i)));
  }
  __attribute__((always_inline)) void set(int i, int t, __m512 x) {
    *reinterpret_cast<f32x16u*>(p + 16 * (t * R + i)) = reinterpret_cast<f32x16u>(x);
    written |= 1u << (t * R + i);
  }
};

// Lane o of the result: op over the 16 lanes of a[o] (o < 16), in
// _mm512_reduce_add_ps's tree (lane j with lane j + 8, then j + 4, then j + 2,
// then j + 1: for float addition, which commutes, the same pairs give the same
// bits), in 15 vector operations instead of 16 scalar chains; exact for
// maxima and integer sums whatever the pairing.
template <class Op>
__attribute__((always_inline)) inline __m512 lanes16(const __m512 (&a)[16], Op op) {
  __m512 c[8], e[4], g[2];
  for (int k = 0; k < 8; ++k)
    c[k] = op(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 4; ++k)
    e[k] = op(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int k = 0; k < 2; ++k)
    g[k] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(e[2 * k]), _mm512_castps_pd(e[2 * k + 1]))),
              _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(e[2 * k]), _mm512_castps_pd(e[2 * k + 1]))));
  const __m512 r = op(_mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// The horizontal sums of up to 16 vectors at once: out[o] = the sum of v[o]'s
// lanes for o < n (16 floats written).
__attribute__((always_inline)) inline void reduce16(const float* v, int n, float* out) {
  __m512 a[16];
  for (int o = 0; o < 16; ++o)
    a[o] = o < n ? _mm512_loadu_ps(v + 16 * o) : _mm512_setzero_ps();
  _mm512_storeu_ps(out, lanes16(a, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); }));
}

// A packed kernel K over weight rows r .. r+R-1 against every activation row,
// then one horizontal sum per (row, activation row).
template <class K, int R>
void run_packed_rows(const K& k, float* Y, int64_t ldy, int64_t r, int64_t r_end, bool accumulate) {
  const bool fetch = r + R + k.ahead.rows <= r_end;
  const int64_t M = k.A.rows;
  auto put = [&](int64_t m, int i, __m512 acc) __attribute__((always_inline)) {
    const float s = _mm512_reduce_add_ps(acc);
    float& y = Y[m * ldy + r + i];
    y = accumulate ? y + s : s;
  };
  using Prep = typename K::template Prep<R>;
  Prep prep;
  if (M == 1) { // the accumulators stay in registers
    RegAcc<R, 1> acc;
    for (int i = 0; i < R; ++i)
      acc.v[i][0] = _mm512_setzero_ps();
    over_groups(k, [&](auto pair, auto part, int64_t g) __attribute__((always_inline)) {
      k.template prepare<pair(), part(), R>(g, r, prep);
      if (fetch)
        k.template groups<pair(), part(), R, 1>(g, r, 0, std::true_type{}, prep, acc);
      else
        k.template groups<pair(), part(), R, 1>(g, r, 0, std::false_type{}, prep, acc);
    });
    for (int i = 0; i < R; ++i)
      put(0, i, acc.v[i][0]);
    return;
  }
  // Several activation rows: groups outermost, the weight side prepared once
  // for all rows, which pass over it in tiles of 4 with their accumulators
  // in memory (the same operations as above, in the same order, for each row).
  // (not zeroed: the first group writes them; zeroing 2 KB a call for 8 rows
  // took 3 % of a round)
  thread_local std::vector<float> store;
  if (store.size() < static_cast<std::size_t>(16 * R * M))
    store.resize(static_cast<std::size_t>(16 * R * M));
  float* accs = store.data(); // [m][i][16 lanes]
  alignas(64) __m512i unpacked[8 * R];
  if constexpr (requires { k.unpacked; }) // the kernels that unpack nibbles
    k.unpacked = M > 4 ? unpacked : nullptr;
  over_groups(k, [&](auto pair, auto part, int64_t g) __attribute__((always_inline)) {
    k.template prepare<pair(), part(), R>(g, r, prep);
    auto tile = [&](auto mt, int64_t m0) __attribute__((always_inline)) {
      MemAcc<R> acc{accs + 16 * R * m0, g == 0};
      // (fetch as a constant: tested inside every step, it cost 4-19 % of the
      // packed q8_0 kernel's time on matrices in L2, one thread, best of 12
      // alternating runs: 896 x 4864 at 8 rows 1.09 -> 1.30 G vpdpbusd a second)
      if (fetch && m0 == 0)
        k.template groups<pair(), part(), R, decltype(mt)::value>(g, r, m0, std::true_type{}, prep, acc);
      else
        k.template groups<pair(), part(), R, decltype(mt)::value>(g, r, m0, std::false_type{}, prep, acc);
    };
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4)
      tile(std::integral_constant<int, 4>{}, m0);
    switch (M - m0) {
      case 3: return tile(std::integral_constant<int, 3>{}, m0);
      case 2: return tile(std::integral_constant<int, 2>{}, m0);
      case 1: return tile(std::integral_constant<int, 1>{}, m0);
      default: return;
    }
  });
  // The sums 16 at a time (accs is [m][i]: 16 / R activation rows a time).
  float sums[16];
  constexpr int64_t per = 16 / R;
  for (int64_t m0 = 0; m0 < M; m0 += per) {
    const int64_t rows = std::min<int64_t>(per, M - m0);
    reduce16(accs + 16 * R * m0, static_cast<int>(R * rows), sums);
    for (int64_t m = 0; m < rows; ++m)
      for (int i = 0; i < R; ++i) {
        float& y = Y[(m0 + m) * ldy + r + i];
        y = accumulate ? y + sums[m * R + i] : sums[m * R + i];
      }
  }
}

// Four weight rows side by side (four memory streams; with several activation
// rows the 4 x 4 tile's chains and accumulators overflow the registers, yet
// four rows measured 10-27 % faster than two at 8 activation rows), the rest
// one at a time.
template <class K>
void run_packed(const K& k, float* Y, int64_t ldy, int64_t r0, int64_t r1, bool accumulate) {
  vnni::by_fours(r0, r1, [&](auto R, int64_t r) { run_packed_rows<K, decltype(R)::value>(k, Y, ldy, r, r1, accumulate); });
}

} // namespace

// lanes16's op for int32 lanes carried in float vectors (the quantizers' sums).
__attribute__((always_inline)) inline __m512 add_int32_lanes(__m512 u, __m512 v) {
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(u), _mm512_castps_si512(v)));
}

// f16 rounding (to nearest even, as f32_to_f16) and back, 16 lanes at once.
__attribute__((always_inline)) inline __m512 through_f16(__m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The activation quantizers of kernels_q.cpp (quant_q8_0, quant_q8_K) in
// 512-bit vectors: per value the same operations (|x| maxima, one multiply,
// round to nearest even, integer sums), so the same bytes and scales.
// quant_q8_0: up to 16 blocks at a time, their maxima, scales and sums as the
// lanes of one vector each (f16 rounding by F16C: the same bits as f32_to_f16
// for every finite value; a run with an infinite or NaN maximum goes block by
// block through f32_to_f16, as one block did before).
void quant_q8_0_avx512(const float* x, int64_t n, int8_t* q, float* d, float* s, int16_t* sums32) {
  const int64_t nb = n / 32;
  int64_t b = 0;
  for (; b < nb; b += 16) {
    const int cnt = static_cast<int>(std::min<int64_t>(16, nb - b));
    const __mmask16 live = static_cast<__mmask16>((1u << cnt) - 1);
    const float* xb = x + 32 * b;
    __m512 m[16];
    for (int j = 0; j < 16; ++j)
      m[j] = j < cnt ? _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb + 32 * j)), _mm512_abs_ps(_mm512_loadu_ps(xb + 32 * j + 16)))
                     : _mm512_setzero_ps();
    const __m512 amax = lanes16(m, [](__m512 u, __m512 v) { return _mm512_max_ps(u, v); });
    if (_mm512_cmp_ps_mask(amax, _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_LE_OQ) != 0xFFFF)
      break; // an infinity or a NaN: the rest block by block
    const __m512 dun = _mm512_div_ps(amax, _mm512_set1_ps(127.f)); // unrounded d
    const __mmask16 nz = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    alignas(64) float id[16];
    _mm512_store_ps(id, _mm512_maskz_div_ps(nz, _mm512_set1_ps(127.f), amax));
    _mm512_mask_storeu_ps(d + b, live, through_f16(dun));
    __m512 sm[16];
    for (int j = 0; j < 16; ++j) {
      if (j >= cnt) {
        sm[j] = _mm512_setzero_ps();
        continue;
      }
      const __m512 idv = _mm512_set1_ps(id[j]);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 32 * j), idv));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 32 * j + 16), idv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * (b + j)), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * (b + j) + 16), _mm512_cvtsepi32_epi8(q1));
      sm[j] = _mm512_castsi512_ps(_mm512_add_epi32(q0, q1));
    }
    const __m512i sum = _mm512_castps_si512(lanes16(sm, add_int32_lanes));
    _mm512_mask_storeu_ps(s + b, live, through_f16(_mm512_mul_ps(dun, _mm512_cvtepi32_ps(sum))));
    _mm256_mask_storeu_epi16(sums32 + b, live, _mm512_cvtepi32_epi16(sum));
  }
  if (b >= nb)
    return;
  for (x += 32 * b, q += 32 * b; b < nb; ++b, x += 32, q += 32) {
    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    d[b] = f16_to_f32(f32_to_f16(amax / 127.f));
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    s[b] = f16_to_f32(f32_to_f16(amax / 127.f * static_cast<float>(sum)));
    sums32[b] = static_cast<int16_t>(sum);
  }
}

void quant_q8_K_avx512(const float* x, int64_t n, int8_t* q, float* d, int32_t* sums) {
  for (int64_t b = 0; b < n / 256; ++b, x += 256, q += 256) {
    __m512 m = _mm512_setzero_ps();
    for (int k = 0; k < 16; ++k)
      m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + 16 * k)));
    const float amax = _mm512_reduce_max_ps(m);
    float mx = 0.f; // the first value of the largest magnitude, as the scalar loop keeps it
    if (amax != 0.f)
      for (int k = 0; k < 16; ++k) {
        const __mmask16 hit =
          _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + 16 * k)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
        if (hit) {
          mx = x[16 * k + __builtin_ctz(hit)];
          break;
        }
      }
    const float iscale = amax != 0.f ? -127.f / mx : 0.f;
    d[b] = amax != 0.f ? 1.f / iscale : 0.f;
    __m512 sv[16]; // the 16 sums of 16 values as the lanes of one vector
    for (int k = 0; k < 16; ++k) {
      const __m512i v = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * k), _mm512_set1_ps(iscale))),
                                         _mm512_set1_epi32(127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * k), _mm512_cvtsepi32_epi8(v));
      sv[k] = _mm512_castsi512_ps(v);
    }
    _mm512_storeu_si512(sums + b * 16, _mm512_castps_si512(lanes16(sv, add_int32_lanes)));
  }
}

void fused_rows_vnni(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r0, int64_t r1, bool acc) {
  // Each packed kernel reads the interleaving its own type's activations have
  // (prepares_alike never shares them across the two kinds).
  if (W.packed && interleaves_by_16(W.type) != interleaves_by_16(A.for_type))
    throw Error(errc::bad_argument, "packed " + std::string(to_string(W.type)) + " rows given activations quantized for " +
                                      std::string(to_string(A.for_type)));
  if (W.packed)
    switch (W.type) {
      case WType::q4_K: return run_packed(Q4Kp<false>(W, A), Y, ldy, r0, r1, acc);
      case WType::q5_K: return run_packed(Q4Kp<true>(W, A), Y, ldy, r0, r1, acc);
      case WType::q2_K: return run_packed(K16p<WType::q2_K>(W, A), Y, ldy, r0, r1, acc);
      case WType::q3_K: return run_packed(K16p<WType::q3_K>(W, A), Y, ldy, r0, r1, acc);
      case WType::q6_K: return run_packed(K16p<WType::q6_K>(W, A), Y, ldy, r0, r1, acc);
      case WType::iq4_xs: return run_packed(IQ4XSp(W, A), Y, ldy, r0, r1, acc);
      case WType::q4_0: return run_packed(Q4p<WType::q4_0>(W, A), Y, ldy, r0, r1, acc);
      case WType::q5_0: return run_packed(Q4p<WType::q5_0>(W, A), Y, ldy, r0, r1, acc);
      case WType::q4_1: return run_packed(Q4p<WType::q4_1>(W, A), Y, ldy, r0, r1, acc);
      case WType::q5_1: return run_packed(Q4p<WType::q5_1>(W, A), Y, ldy, r0, r1, acc);
      case WType::iq4_nl: return run_packed(Q4p<WType::iq4_nl>(W, A), Y, ldy, r0, r1, acc);
      case WType::q8_0: return run_packed(Q8p(W, A), Y, ldy, r0, r1, acc);
      default: throw Error(errc::bad_argument, std::string("a packed ") + to_string(W.type) + " matrix has no packed kernel");
    }
  vnni::rows_impl<true>(W, A, Y, ldy, r0, r1, acc);
}

namespace {

// bf16 x bf16 pairs into f32 lanes (vdpbf16ps), R weight rows side by side with
// the rows `far` on prefetched (as the int8 kernels); a tail of cols % 32 in scalar.
template <int R>
void bf16_block(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r, int64_t r_end,
                bool accumulate, const vnni::Ahead& far) {
  const int64_t cols = W.cols, main = cols / 32 * 32;
  const std::size_t rb = W.row_bytes();
  const auto* w0 = reinterpret_cast<const uint16_t*>(W.row(r));
  const bool ahead = r + R + far.rows <= r_end;
  for (int64_t m = 0; m < A.rows; ++m) {
    const uint16_t* a = A.bf.data() + m * cols;
    __m512 acc[R];
    for (int i = 0; i < R; ++i)
      acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < main; c += 32) {
      const __m512bh av = (__m512bh)_mm512_loadu_si512(a + c);
      for (int i = 0; i < R; ++i) {
        const uint16_t* w = reinterpret_cast<const uint16_t*>(reinterpret_cast<const uint8_t*>(w0) + i * rb);
        if (m == 0 && ahead)
          _mm_prefetch(reinterpret_cast<const char*>(w + c) + far.bytes, _MM_HINT_T0);
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(w + c), av);
      }
    }
    for (int i = 0; i < R; ++i) {
      const uint16_t* w = reinterpret_cast<const uint16_t*>(reinterpret_cast<const uint8_t*>(w0) + i * rb);
      float s = _mm512_reduce_add_ps(acc[i]);
      for (int64_t c = main; c < cols; ++c) {
        const uint32_t wb = static_cast<uint32_t>(w[c]) << 16, ab = static_cast<uint32_t>(a[c]) << 16;
        float wf, af;
        std::memcpy(&wf, &wb, 4);
        std::memcpy(&af, &ab, 4);
        s += wf * af;
      }
      float& y = Y[m * ldy + r + i];
      y = accumulate ? y + s : s;
    }
  }
}

} // namespace

void fused_rows_bf16(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r0, int64_t r1,
                     bool accumulate) {
  const vnni::Ahead far = vnni::ahead_of(W.row_bytes());
  vnni::by_fours(r0, r1, [&](auto R, int64_t r) { bf16_block<R>(W, A, Y, ldy, r, r1, accumulate, far); });
}

} // namespace strata::model::detail
