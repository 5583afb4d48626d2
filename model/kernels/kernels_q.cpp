// Fused few-row kernels (see kernels_q.hpp). Each (weight row, activation row)
// pair is reduced in one fixed order, so a row's result does not depend on how
// many rows share the call.

#include "model/kernels/kernels_q.hpp"
#include "model/base/parallel.hpp"
#include "model/kernels/attention.hpp"

#include "model/formats/packed.hpp"
#include "model/formats/quant.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

namespace strata::model::detail {

// kernels_q_vnni.cpp / kernels_q_avx2.cpp: the kernels per instruction set.
void fused_rows_vnni(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r0, int64_t r1, bool acc);
void fused_rows_bf16(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r0, int64_t r1, bool acc);
void fused_rows_avx2(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r0, int64_t r1, bool acc);
void quant_q8_0_avx512(const float* x, int64_t n, int8_t* q, float* d, float* s, int16_t* sums32);
void quant_q8_K_avx512(const float* x, int64_t n, int8_t* q, float* d, int32_t* sums);

namespace {

bool has_vnni() {
  static const bool v = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512bw");
  return v;
}
bool has_avx2() { // (AVX2, FMA, F16C: what the attention's AVX2 build needs too)
  return attention_avx2_available();
}
bool has_bf16() {
  static const bool v = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  return v;
}

// ------------------------------------------------------------ activations

// llama.cpp's q8_0: d = amax / 127 kept as f16; q = round(x / d).
// Also q8_1's s = f16(d x sum(q)) with d unrounded (what llama.cpp pairs with
// q4_1 / q5_1 weights' mins).
void quant_q8_0(const float* x, int64_t n, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < n / 32; ++b, x += 32, q += 32) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j)
      amax = std::max(amax, std::fabs(x[j]));
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    d[b] = f16_to_f32(f32_to_f16(amax / 127.f)); // stored as f16 by llama.cpp
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      q[j] = static_cast<int8_t>(std::nearbyint(x[j] * id));
      sum += q[j];
    }
    s[b] = f16_to_f32(f32_to_f16(amax / 127.f * static_cast<float>(sum)));
  }
}

// llama.cpp's q8_K: the signed extreme maps to -127; sums of every 16 values.
void quant_q8_K(const float* x, int64_t n, int8_t* q, float* d, int32_t* sums) {
  for (int64_t b = 0; b < n / 256; ++b, x += 256, q += 256) {
    float amax = 0.f, mx = 0.f;
    for (int j = 0; j < 256; ++j)
      if (std::fabs(x[j]) > amax) {
        amax = std::fabs(x[j]);
        mx = x[j];
      }
    const float iscale = amax != 0.f ? -127.f / mx : 0.f;
    d[b] = amax != 0.f ? 1.f / iscale : 0.f;
    for (int j = 0; j < 256; ++j)
      q[j] = static_cast<int8_t>(std::min(127.f, std::nearbyint(iscale * x[j])));
    for (int g = 0; g < 16; ++g) {
      int32_t s = 0;
      for (int j = 0; j < 16; ++j)
        s += q[16 * g + j];
      sums[b * 16 + g] = s;
    }
  }
}

// QuantActs::qi and ::corr from q and sums32 (the activations of packed q8_0).
// Groups of 8 blocks (the last one of nb % 8 = L, its lanes from L on zero) go
// in pairs, step by step (step s of group 2p, then of 2p + 1: one 64-byte
// vector), a last odd group alone.
void interleave_q8_0(QuantActs& a) {
  const int64_t nb = a.cols / 32, groups = (nb + pack_group - 1) / pack_group, stride = groups * 256;
  a.qi.assign(static_cast<std::size_t>(a.rows * stride), 0);
  a.corr.resize(static_cast<std::size_t>(a.rows * nb));
  for (int64_t m = 0; m < a.rows; ++m) {
    const int8_t* q = a.q.data() + m * a.cols;
    int8_t* out = a.qi.data() + m * stride;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t within = g % 2, step = (within == 0 && g + 1 == groups) ? 32 : 64;
      const int64_t L = std::min<int64_t>(pack_group, nb - pack_group * g);
      int8_t* base = out + 256 * (g - within) + 32 * within;
      for (int s = 0; s < 8; ++s)
        for (int64_t j = 0; j < L; ++j)
          std::memcpy(base + step * s + 4 * j, q + 32 * (pack_group * g + j) + 4 * s, 4);
    }
  }
  for (std::size_t i = 0; i < a.corr.size(); ++i)
    a.corr[i] = -128 * static_cast<int32_t>(a.sums32[i]);
}

// QuantActs::qi16 and ::dsum16 from q, d and sums (the activations of packed q2_K, q3_K and q6_K).
void interleave_q8_K16(QuantActs& a) {
  const int64_t nb = a.cols / 256;
  a.qi16.resize(a.q.size());
  a.dsum16.resize(a.sums.size());
  for (int64_t m = 0; m < a.rows; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* q = a.q.data() + m * a.cols + 256 * b;
      int8_t* out = a.qi16.data() + m * a.cols + 256 * b;
      for (int k = 0; k < 4; ++k)
        for (int g = 0; g < 16; ++g)
          std::memcpy(out + 64 * k + 4 * g, q + 16 * g + 4 * k, 4);
      const auto at = static_cast<std::size_t>(m * nb + b);
      for (std::size_t g = 0; g < 16; ++g)
        a.dsum16[16 * at + g] = a.d[at] * static_cast<float>(a.sums[16 * at + g]);
    }
}

uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7f800000u) != 0x7f800000u)
    b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

} // namespace

namespace {
std::atomic<FusedIsa> isa_setting{FusedIsa::best};
} // namespace

void set_fused_isa(FusedIsa isa) {
  isa_setting = isa;
}

bool interleaves_by_16(WType t) {
  return t == WType::q2_K || t == WType::q3_K || t == WType::q6_K;
}

int64_t acts_block(WType t) {
  switch (t) {
    case WType::f32: case WType::f16: case WType::bf16: return 0;
    default: return block_values(t);
  }
}

std::string kernel_builds() {
  std::string s = attention_avx512_available() ? "avx512" : has_avx2() ? "avx2" : "baseline";
  if (has_vnni())
    s += "+vnni";
  if (has_bf16())
    s += "+bf16";
  return s;
}

bool fused_available(WType t) {
  const FusedIsa isa = isa_setting.load(std::memory_order_relaxed);
  if (isa == FusedIsa::expand)
    return false;
  switch (t) {
    case WType::f32: case WType::f16: return false;
    case WType::bf16: return isa == FusedIsa::best && has_bf16();
    default: return has_vnni() || has_avx2();
  }
}

void quantize_acts(WType t, const float* X, int64_t M, int64_t cols, QuantActs& out) {
  out.for_type = t;
  out.rows = M;
  out.cols = cols;
  if (t == WType::bf16) {
    out.bf.resize(static_cast<std::size_t>(M * cols));
    for (int64_t i = 0; i < M * cols; ++i)
      out.bf[static_cast<std::size_t>(i)] = to_bf16(X[i]);
    return;
  }
  out.q.resize(static_cast<std::size_t>(M * cols));
  // The vector quantizers give the same bytes; the scalar ones run under the
  // other kernel settings (a test compares them).
  const bool vec = has_vnni() && isa_setting.load(std::memory_order_relaxed) == FusedIsa::best;
  if (acts_block(t) == 32) {
    out.d.resize(static_cast<std::size_t>(M * (cols / 32)));
    out.sums32.resize(static_cast<std::size_t>(M * (cols / 32)));
    out.s.resize(static_cast<std::size_t>(M * (cols / 32)));
    for (int64_t m = 0; m < M; ++m) {
      const auto nb = m * (cols / 32);
      if (vec) {
        quant_q8_0_avx512(X + m * cols, cols, out.q.data() + m * cols, out.d.data() + nb, out.s.data() + nb,
                          out.sums32.data() + nb);
        continue;
      }
      quant_q8_0(X + m * cols, cols, out.q.data() + m * cols, out.d.data() + nb, out.s.data() + nb);
      for (int64_t i = nb; i < nb + cols / 32; ++i) {
        int32_t s = 0;
        for (int j = 0; j < 32; ++j)
          s += out.q[static_cast<std::size_t>(32 * i + j)];
        out.sums32[static_cast<std::size_t>(i)] = static_cast<int16_t>(s);
      }
    }
    interleave_q8_0(out); // for packed q8_0 parts, which share these activations with the other 32-value types
  } else {
    out.d.resize(static_cast<std::size_t>(M * (cols / 256)));
    out.sums.resize(static_cast<std::size_t>(M * (cols / 16)));
    out.sums32.resize(static_cast<std::size_t>(M * (cols / 32)));
    for (int64_t m = 0; m < M; ++m)
      (vec ? quant_q8_K_avx512 : quant_q8_K)(X + m * cols, cols, out.q.data() + m * cols,
                                             out.d.data() + m * (cols / 256), out.sums.data() + m * (cols / 16));
    for (std::size_t i = 0; i < out.sums32.size(); ++i)
      out.sums32[i] = static_cast<int16_t>(out.sums[2 * i] + out.sums[2 * i + 1]);
    // The packed kernels of the groups-of-16 types read the activations
    // interleaved by 16 only; the others' (q4_K, q5_K, iq4_xs: a block of 256 is
    // a group of 8 blocks of 32) those interleaved as q8_0's, with per-32 scales.
    // Each product prepares only what its kernels read; the rest is left empty.
    if (interleaves_by_16(t)) {
      interleave_q8_K16(out);
      out.qi.clear();
      out.corr.clear();
      out.d32.clear();
      out.dsum32.clear();
      return;
    }
    out.qi16.clear();
    out.dsum16.clear();
    interleave_q8_0(out);
    out.d32.resize(out.sums32.size());
    out.dsum32.resize(out.sums32.size());
    for (std::size_t i = 0; i < out.sums32.size(); ++i) {
      out.d32[i] = out.d[i / 8];
      out.dsum32[i] = out.d32[i] * static_cast<float>(out.sums32[i]);
    }
  }
}

void expand_acts(const QuantActs& a, float* out) {
  const int64_t n = a.rows * a.cols;
  if (a.for_type == WType::bf16) {
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(a.bf[static_cast<std::size_t>(i)]) << 16;
      std::memcpy(out + i, &bits, 4);
    }
    return;
  }
  const int64_t block = acts_block(a.for_type);
  for (int64_t i = 0; i < n; ++i)
    out[i] = a.d[static_cast<std::size_t>(i / block)] * static_cast<float>(a.q[static_cast<std::size_t>(i)]);
}

WMatrix pack_for_kernels(const WMatrix& m) {
  const char* env = std::getenv("STRATA_PACKED_WEIGHTS"); // "0": keep the plain layout (for comparisons)
  if (packable(m) && has_vnni() && !(env && std::string(env) == "0")) // rows converted on the math pool's threads
    return pack_rows(m, [](int64_t rows, const std::function<void(int64_t, int64_t)>& f) { detail::parallel_for(0, rows, 64, f); });
  return m;
}

void fused_rows(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r0, int64_t r1, bool accumulate) {
  if (W.type == WType::bf16)
    return fused_rows_bf16(W, A, Y, ldy, r0, r1, accumulate);
  const bool vnni = has_vnni() && isa_setting.load(std::memory_order_relaxed) == FusedIsa::best;
  if (W.packed && !vnni) { // only the VNNI kernel reads the packed layout: these rows plain
    thread_local std::vector<uint8_t> plain;
    plain.resize(W.row_bytes() * static_cast<std::size_t>(r1 - r0));
    unpack_rows(W, r0, r1 - r0, plain.data());
    WMatrix part = W;
    part.packed = false;
    part.data = plain.data();
    part.rows = r1 - r0;
    return fused_rows_avx2(part, A, Y + r0, ldy, 0, r1 - r0, accumulate);
  }
  if (vnni)
    return fused_rows_vnni(W, A, Y, ldy, r0, r1, accumulate);
  return fused_rows_avx2(W, A, Y, ldy, r0, r1, accumulate);
}

} // namespace strata::model::detail
