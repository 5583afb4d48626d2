// Block layouts of the resident weight types (as GGUF / ggml define them),
// dequantization and the reference quantizers used by --dtype. Written as plain
// loops over one block at a time; the compiler vectorizes them per target.

#include "model/formats/quant.hpp"

#include "model/base/error.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

namespace strata::model {

namespace {

// An f16 block scale as float, inline: the exponent is rebiased by one exact
// multiplication (normals and subnormals alike); inf / NaN keep their class.
inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t em = h & 0x7fffu;
  uint32_t bits = em << 13;
  float f;
  if (em >= 0x7c00u) {
    bits = 0x7f800000u | ((em & 0x3ffu) << 13);
    std::memcpy(&f, &bits, 4);
  } else {
    std::memcpy(&f, &bits, 4);
    f *= 0x1p112f;
  }
  return (h & 0x8000u) ? -f : f;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline void store_u16(uint8_t* p, uint16_t v) {
  std::memcpy(p, &v, 2);
}

// The 6-bit scale and min of sub-block j (0..7) of a q4_K block.
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// 16 lanes at a time through GCC vector types: the compiler maps them onto
// AVX-512, AVX2 or SSE (plain loops over blocks did not vectorize).
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef int8_t vb16 __attribute__((vector_size(16)));
typedef uint8_t vub16 __attribute__((vector_size(16)));
typedef uint16_t vh16 __attribute__((vector_size(32)));

template <class V>
inline V load_vec(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* y, vf16 v) {
  std::memcpy(y, &v, sizeof v);
}

__attribute__((target_clones("avx512f", "arch=x86-64-v3", "default"))) void dequant_q8_0(const uint8_t* __restrict src, float* __restrict y,
                                                                                int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, src += 34, y += 32) {
    const float d = half(src);
    const int8_t* __restrict q = reinterpret_cast<const int8_t*>(src + 2);
    for (int i = 0; i < 32; ++i)
      y[i] = d * static_cast<float>(q[i]);
  }
}

__attribute__((target_clones("avx512f", "arch=x86-64-v3", "default"))) void dequant_q4_0(const uint8_t* __restrict src, float* __restrict y,
                                                                                int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, src += 18, y += 32) {
    const float d = half(src);
    const vi16 q = __builtin_convertvector(load_vec<vub16>(src + 2), vi16);
    store16(y, __builtin_convertvector((q & 0xF) - 8, vf16) * d);
    store16(y + 16, __builtin_convertvector((q >> 4) - 8, vf16) * d);
  }
}

// q4_K (Q5 false) and q5_K: 8 groups of 32 with 6-bit scale / min pairs; q5_K
// adds a 5th bit (value l of group g adds 16 when bit g of qh[l] is set).
template <bool Q5>
inline __attribute__((always_inline)) void dequant_k45(const uint8_t* __restrict src, float* __restrict y,
                                                       int64_t blocks) {
  constexpr std::size_t BB = Q5 ? 176 : 144, QS = Q5 ? 48 : 16;
  for (int64_t b = 0; b < blocks; ++b, src += BB) {
    const float d = half(src);
    const float dmin = half(src + 2);
    const uint8_t* scales = src + 4;
    const uint8_t* qh = src + 16;
    const uint8_t* q = src + QS;
    for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
      int sc, mn;
      scale_min_k4(j, scales, sc, mn);
      const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(mn);
      scale_min_k4(j + 1, scales, sc, mn);
      const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(mn);
      for (int l = 0; l < 32; ++l)
        y[l] = d1 * static_cast<float>((q[l] & 0xF) | (Q5 ? ((qh[l] >> j) & 1) << 4 : 0)) - m1;
      for (int l = 0; l < 32; ++l)
        y[l + 32] = d2 * static_cast<float>((q[l] >> 4) | (Q5 ? ((qh[l] >> (j + 1)) & 1) << 4 : 0)) - m2;
    }
  }
}

__attribute__((target_clones("avx512f", "arch=x86-64-v3", "default"))) void dequant_q4_K(const uint8_t* __restrict src, float* __restrict y,
                                                                                int64_t blocks) {
  dequant_k45<false>(src, y, blocks);
}

__attribute__((target_clones("avx512f", "arch=x86-64-v3", "default"))) void dequant_q5_K(const uint8_t* __restrict src, float* __restrict y,
                                                                                int64_t blocks) {
  dequant_k45<true>(src, y, blocks);
}

__attribute__((target_clones("avx512f", "arch=x86-64-v3", "default"))) void dequant_q6_K(const uint8_t* __restrict src, float* __restrict y,
                                                                                int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, src += 210) {
    const uint8_t* ql = src;
    const uint8_t* qh = src + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(src + 192);
    const float d = half(src + 208);
    for (int n = 0; n < 2; ++n, ql += 64, qh += 32, sc += 8, y += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
        y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
        y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
        y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
      }
    }
  }
}

__attribute__((target_clones("avx512f", "arch=x86-64-v3", "default"))) void dequant_bf16(const uint8_t* __restrict src, float* __restrict y,
                                                                                int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const vu16 bits = __builtin_convertvector(load_vec<vh16>(src + 2 * i), vu16) << 16;
    std::memcpy(y + i, &bits, sizeof bits);
  }
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(load_u16(src + 2 * i)) << 16;
    std::memcpy(y + i, &bits, 4);
  }
}

__attribute__((target_clones("arch=x86-64-v3", "default"))) void dequant_f16(const uint8_t* __restrict src, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    _Float16 h;
    std::memcpy(&h, src + 2 * i, 2);
    y[i] = static_cast<float>(h);
  }
}

// ------------------------------------------------------------ the fallback and mix types

__attribute__((target_clones("avx512f", "arch=x86-64-v3", "default"))) void dequant_q4_1(const uint8_t* __restrict src, float* __restrict y,
                                                                                int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, src += 20, y += 32) {
    const float d = half(src), m = half(src + 2);
    const vi16 q = __builtin_convertvector(load_vec<vub16>(src + 4), vi16);
    store16(y, __builtin_convertvector(q & 0xF, vf16) * d + m);
    store16(y + 16, __builtin_convertvector(q >> 4, vf16) * d + m);
  }
}

// q5_0 (x = d (q - 16)) and q5_1 (x = d q + m): bit j of qh is value j's 5th bit.
template <bool WITH_MIN>
void dequant_q5(const uint8_t* __restrict src, float* __restrict y, int64_t blocks) {
  constexpr std::size_t BB = WITH_MIN ? 24 : 22;
  constexpr std::size_t QH = WITH_MIN ? 4 : 2;
  for (int64_t b = 0; b < blocks; ++b, src += BB, y += 32) {
    const float d = half(src), m = WITH_MIN ? half(src + 2) : 0.f;
    const int off = WITH_MIN ? 0 : 16; // q5_0: d (q - 16), as ggml computes it
    uint32_t qh;
    std::memcpy(&qh, src + QH, 4);
    const uint8_t* qs = src + QH + 4;
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 0xF) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      y[j] = d * static_cast<float>(lo - off) + m;
      y[j + 16] = d * static_cast<float>(hi - off) + m;
    }
  }
}

// q2_K: 16 groups of 16; group g = 8h + 2j + p holds values 128h + 32j + 16p + l,
// whose 2 bits are bits 2j of qs[32h + 16p + l]; scales[g] is scale | min << 4.
void dequant_q2_K(const uint8_t* __restrict src, float* __restrict y, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, src += 84) {
    const uint8_t* scales = src;
    const uint8_t* qs = src + 16;
    const float d = half(src + 80), dmin = half(src + 82);
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j)
        for (int p = 0; p < 2; ++p, y += 16) {
          const uint8_t sc = scales[8 * h + 2 * j + p];
          const float dl = d * static_cast<float>(sc & 0xF), ml = dmin * static_cast<float>(sc >> 4);
          const uint8_t* q = qs + 32 * h + 16 * p;
          for (int l = 0; l < 16; ++l)
            y[l] = dl * static_cast<float>((q[l] >> (2 * j)) & 3) - ml;
        }
  }
}

} // namespace

void q3_K_scales(const uint8_t* packed, int8_t out[16]) {
  uint32_t aux[4];
  q3_K_scale_words(packed, aux);
  std::memcpy(out, aux, 16);
  for (int g = 0; g < 16; ++g)
    out[g] = static_cast<int8_t>(out[g] - 32);
}

namespace {

// q3_K: the groups and 2 bits as q2_K; minus 4 where bit 4h + j of
// hmask[16p + l] is clear; 6-bit scales - 32.
void dequant_q3_K(const uint8_t* __restrict src, float* __restrict y, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, src += 110) {
    const uint8_t* hm = src;
    const uint8_t* qs = src + 32;
    int8_t sc[16];
    q3_K_scales(src + 96, sc);
    const float d = half(src + 108);
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j)
        for (int p = 0; p < 2; ++p, y += 16) {
          const float dl = d * static_cast<float>(sc[8 * h + 2 * j + p]);
          const uint8_t* q = qs + 32 * h + 16 * p;
          const uint8_t bit = static_cast<uint8_t>(1u << (4 * h + j));
          for (int l = 0; l < 16; ++l)
            y[l] = dl * static_cast<float>(((q[l] >> (2 * j)) & 3) - ((hm[16 * p + l] & bit) ? 0 : 4));
        }
  }
}

inline void iq4_32(float d, const uint8_t* qs, float* y) {
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(iq4nl_values[qs[j] & 0xF]);
    y[j + 16] = d * static_cast<float>(iq4nl_values[qs[j] >> 4]);
  }
}

void dequant_iq4_nl(const uint8_t* __restrict src, float* __restrict y, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, src += 18, y += 32)
    iq4_32(half(src), src + 2, y);
}

// iq4_xs: 8 groups of 32, each an iq4_nl block with scale d (ls - 32).
void dequant_iq4_xs(const uint8_t* __restrict src, float* __restrict y, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, src += 136) {
    const float d = half(src);
    const uint16_t sh = load_u16(src + 2);
    const uint8_t* sl = src + 4;
    const uint8_t* qs = src + 8;
    for (int g = 0; g < 8; ++g, y += 32, qs += 16) {
      const int ls = ((sl[g / 2] >> (4 * (g % 2))) & 0xF) | (((sh >> (2 * g)) & 3) << 4);
      iq4_32(d * static_cast<float>(ls - 32), qs, y);
    }
  }
}

// A simple q4_K quantizer: each sub-block of 32 spans [min(0, lo), hi] in 15
// steps; the 8 scales and mins are then 6-bit multiples of the block's d and
// dmin (f16). Not llama.cpp's error-minimizing search: somewhat less accurate,
// the same format.
void quantize_q4_K_block(const float* x, uint8_t* dst) {
  float scale[8], minv[8];
  for (int j = 0; j < 8; ++j) {
    float lo = 0.f, hi = 0.f;
    for (int l = 0; l < 32; ++l) {
      lo = std::min(lo, x[32 * j + l]);
      hi = std::max(hi, x[32 * j + l]);
    }
    scale[j] = (hi - lo) / 15.f;
    minv[j] = -lo;
  }
  const float max_scale = *std::max_element(scale, scale + 8), max_min = *std::max_element(minv, minv + 8);
  const uint16_t dh = f32_to_f16(max_scale / 63.f), mh = f32_to_f16(max_min / 63.f);
  const float d = f16_to_f32(dh), dmin = f16_to_f32(mh);
  uint8_t sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = static_cast<uint8_t>(d > 0.f ? std::clamp(std::lround(scale[j] / d), 0L, 63L) : 0);
    mn[j] = static_cast<uint8_t>(dmin > 0.f ? std::clamp(std::lround(minv[j] / dmin), 0L, 63L) : 0);
  }
  store_u16(dst, dh);
  store_u16(dst + 2, mh);
  uint8_t* s = dst + 4;
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
  }
  uint8_t q[256];
  for (int j = 0; j < 8; ++j) {
    const float es = d * static_cast<float>(sc[j]), em = dmin * static_cast<float>(mn[j]);
    for (int l = 0; l < 32; ++l)
      q[32 * j + l] = static_cast<uint8_t>(es > 0.f ? std::clamp(std::lround((x[32 * j + l] + em) / es), 0L, 15L) : 0);
  }
  uint8_t* qs = dst + 16;
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l)
      qs[32 * c + l] = static_cast<uint8_t>(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
}

} // namespace

const char* to_string(WType t) {
  switch (t) {
    case WType::f32: return "f32";
    case WType::f16: return "f16";
    case WType::bf16: return "bf16";
    case WType::q8_0: return "q8_0";
    case WType::q4_0: return "q4_0";
    case WType::q4_K: return "q4_K";
    case WType::q6_K: return "q6_K";
    case WType::q4_1: return "q4_1";
    case WType::q5_0: return "q5_0";
    case WType::q5_1: return "q5_1";
    case WType::q2_K: return "q2_K";
    case WType::q3_K: return "q3_K";
    case WType::q5_K: return "q5_K";
    case WType::iq4_nl: return "iq4_nl";
    case WType::iq4_xs: return "iq4_xs";
  }
  return "?";
}

std::optional<WType> parse_wtype(const std::string& s) {
  for (auto t : all_wtypes) {
    std::string name = to_string(t), lower = name;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    if (s == name || s == lower)
      return t;
  }
  return std::nullopt;
}

int64_t block_values(WType t) {
  switch (t) {
    case WType::f32: case WType::f16: case WType::bf16: return 1;
    case WType::q8_0: case WType::q4_0: case WType::q4_1: case WType::q5_0: case WType::q5_1: case WType::iq4_nl:
      return 32;
    case WType::q4_K: case WType::q6_K: case WType::q2_K: case WType::q3_K: case WType::q5_K: case WType::iq4_xs:
      return 256;
  }
  return 1;
}

std::size_t block_bytes(WType t) {
  switch (t) {
    case WType::f32: return 4;
    case WType::f16: case WType::bf16: return 2;
    case WType::q8_0: return 34;
    case WType::q4_0: return 18;
    case WType::q4_K: return 144;
    case WType::q6_K: return 210;
    case WType::q4_1: return 20;
    case WType::q5_0: return 22;
    case WType::q5_1: return 24;
    case WType::q2_K: return 84;
    case WType::q3_K: return 110;
    case WType::q5_K: return 176;
    case WType::iq4_nl: return 18;
    case WType::iq4_xs: return 136;
  }
  return 4;
}

std::size_t row_bytes(WType t, int64_t cols) {
  return static_cast<std::size_t>(cols / block_values(t)) * block_bytes(t);
}

void dequantize(WType t, const uint8_t* src, float* dst, int64_t n) {
  const int64_t blocks = n / block_values(t);
  switch (t) {
    case WType::f32: std::memcpy(dst, src, static_cast<std::size_t>(n) * 4); return;
    case WType::f16: return dequant_f16(src, dst, n);
    case WType::bf16: return dequant_bf16(src, dst, n);
    case WType::q8_0: return dequant_q8_0(src, dst, blocks);
    case WType::q4_0: return dequant_q4_0(src, dst, blocks);
    case WType::q4_K: return dequant_q4_K(src, dst, blocks);
    case WType::q6_K: return dequant_q6_K(src, dst, blocks);
    case WType::q4_1: return dequant_q4_1(src, dst, blocks);
    case WType::q5_0: return dequant_q5<false>(src, dst, blocks);
    case WType::q5_1: return dequant_q5<true>(src, dst, blocks);
    case WType::q2_K: return dequant_q2_K(src, dst, blocks);
    case WType::q3_K: return dequant_q3_K(src, dst, blocks);
    case WType::q5_K: return dequant_q5_K(src, dst, blocks);
    case WType::iq4_nl: return dequant_iq4_nl(src, dst, blocks);
    case WType::iq4_xs: return dequant_iq4_xs(src, dst, blocks);
  }
}

void quantize_q8_0_block(const float* x, uint8_t* dst) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i)
    amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  store_u16(dst, f32_to_f16(d));
  for (int i = 0; i < 32; ++i) {
    // lround's rounding, halves away from zero, without a library call (the
    // attention quantizes every query this way): the conversion truncates, and
    // the fraction v - t is exact
    const float v = x[i] * id;
    const auto t = static_cast<int32_t>(v);
    const float f = v - static_cast<float>(t);
    dst[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(t + (f >= 0.5f) - (f <= -0.5f)));
  }
}

void quantize(WType t, const float* x, uint8_t* dst, int64_t n) {
  switch (t) {
    case WType::f32: std::memcpy(dst, x, static_cast<std::size_t>(n) * 4); return;
    case WType::f16:
      for (int64_t i = 0; i < n; ++i)
        store_u16(dst + 2 * i, f32_to_f16(x[i]));
      return;
    case WType::bf16:
      for (int64_t i = 0; i < n; ++i)
        store_u16(dst + 2 * i, f32_to_bf16(x[i]));
      return;
    case WType::q8_0:
      for (int64_t b = 0; b < n / 32; ++b, x += 32, dst += 34)
        quantize_q8_0_block(x, dst);
      return;
    case WType::q4_0:
      for (int64_t b = 0; b < n / 32; ++b, x += 32, dst += 18) {
        float amax = 0.f, mx = 0.f;
        for (int i = 0; i < 32; ++i)
          if (amax < std::fabs(x[i])) {
            amax = std::fabs(x[i]);
            mx = x[i];
          }
        const float d = mx / -8.f, id = d != 0.f ? 1.f / d : 0.f;
        store_u16(dst, f32_to_f16(d));
        for (int i = 0; i < 16; ++i) {
          const auto lo = static_cast<uint8_t>(std::min(15, static_cast<int>(static_cast<int8_t>(x[i] * id + 8.5f))));
          const auto hi =
            static_cast<uint8_t>(std::min(15, static_cast<int>(static_cast<int8_t>(x[i + 16] * id + 8.5f))));
          dst[2 + i] = static_cast<uint8_t>(lo | (hi << 4));
        }
      }
      return;
    case WType::q4_K:
      for (int64_t b = 0; b < n / 256; ++b, x += 256, dst += 144)
        quantize_q4_K_block(x, dst);
      return;
    case WType::q6_K: case WType::q4_1: case WType::q5_0: case WType::q5_1: case WType::q2_K: case WType::q3_K:
    case WType::q5_K: case WType::iq4_nl: case WType::iq4_xs:
      throw Error(errc::unsupported, std::string("quantizing to ") + to_string(t) +
                                       " is not supported (load a GGUF file quantized by llama.cpp instead)");
  }
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else { // subnormal: renormalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

float bf16_to_f32(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

uint16_t f32_to_bf16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((x >> 16) | 0x40); // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);                  // round to nearest even
  return static_cast<uint16_t>(x >> 16);
}

uint16_t f32_to_f16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u)
    return sign | 0x7e00u;
  if (x >= 0x477ff000u) // rounds to >= 65520: infinity
    return sign | 0x7c00u;
  if (x < 0x38800000u) { // subnormal or zero in f16
    if (x < 0x33000000u)
      return sign;
    const uint32_t exp = x >> 23;
    uint32_t mant = (x & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp; // 14 + (113 - exp)
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u)))
      ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t r = x + 0xfffu + ((x >> 13) & 1u) - 0x38000000u;
  return sign | static_cast<uint16_t>(r >> 13);
}

} // namespace strata::model
