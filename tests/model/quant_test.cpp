// Weight blocks: dequantization of hand-made blocks whose floats are exact, the
// reference quantizers, and the typed matrix kernels against a scalar path
// (dequantize, then double-precision dot products) for every type and shape
// class, tails included; a row's result must not depend on the other rows.

#include "model/base/error.hpp"
#include "model/kernels/kernels.hpp"
#include "model/kernels/kernels_q.hpp"
#include "model/formats/packed.hpp"
#include "model/formats/quant.hpp"
#include "model/formats/safetensors.hpp"
#include "model/formats/wmatrix.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

namespace strata::model {
namespace {

void put16(std::vector<uint8_t>& b, std::size_t at, uint16_t v) {
  std::memcpy(b.data() + at, &v, 2);
}

TEST(Quant, BlockSizesAreGgufs) {
  EXPECT_EQ(block_bytes(WType::q8_0), 34u);
  EXPECT_EQ(block_bytes(WType::q4_0), 18u);
  EXPECT_EQ(block_bytes(WType::q4_K), 144u);
  EXPECT_EQ(block_bytes(WType::q6_K), 210u);
  EXPECT_EQ(row_bytes(WType::q4_K, 512), 288u);
  EXPECT_EQ(parse_wtype("q4_k"), WType::q4_K);
  EXPECT_EQ(parse_wtype("Q4_K"), std::nullopt);
  // The types llama-quantize falls back to and the other mixes (ggml's block structs).
  const std::vector<std::tuple<WType, int64_t, std::size_t>> more = {
    {WType::q4_1, 32, 20},  {WType::q5_0, 32, 22},  {WType::q5_1, 32, 24},   {WType::q2_K, 256, 84},
    {WType::q3_K, 256, 110}, {WType::q5_K, 256, 176}, {WType::iq4_nl, 32, 18}, {WType::iq4_xs, 256, 136}};
  for (const auto& [t, values, bytes] : more) {
    EXPECT_EQ(block_values(t), values) << to_string(t);
    EXPECT_EQ(block_bytes(t), bytes) << to_string(t);
    EXPECT_EQ(parse_wtype(to_string(t)), t);
  }
  EXPECT_EQ(parse_wtype("q5_k"), WType::q5_K);
}

// Hand-made blocks of the fallback types, every field exercised: value j and
// j + 16 share a byte; the 5th bits are bit j of qh.
TEST(Quant, Q5AndQ4_1HandMadeBlocks) {
  std::vector<uint8_t> b(24);
  put16(b, 0, f32_to_f16(0.25f));
  const uint32_t qh = 0xA5F00F5Au;
  std::memcpy(b.data() + 2, &qh, 4);
  for (int i = 0; i < 16; ++i)
    b[6 + i] = static_cast<uint8_t>(i | ((15 - i) << 4));
  std::vector<float> y(32);
  dequantize(WType::q5_0, b.data(), y.data(), 32);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 0.25f * static_cast<float>(static_cast<int>(j | (((qh >> j) & 1) << 4)) - 16)) << j;
    EXPECT_EQ(y[j + 16], 0.25f * static_cast<float>(static_cast<int>((15 - j) | (((qh >> (j + 16)) & 1) << 4)) - 16)) << j;
  }
  // q5_1: d, m, qh, nibbles.
  put16(b, 0, f32_to_f16(0.5f));
  put16(b, 2, f32_to_f16(-3.0f));
  std::memcpy(b.data() + 4, &qh, 4);
  for (int i = 0; i < 16; ++i)
    b[8 + i] = static_cast<uint8_t>(i | ((15 - i) << 4));
  dequantize(WType::q5_1, b.data(), y.data(), 32);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 0.5f * static_cast<float>(static_cast<int>(j | (((qh >> j) & 1) << 4))) - 3.0f) << j;
    EXPECT_EQ(y[j + 16], 0.5f * static_cast<float>(static_cast<int>((15 - j) | (((qh >> (j + 16)) & 1) << 4))) - 3.0f) << j;
  }
  // q4_1: d, m, nibbles.
  put16(b, 0, f32_to_f16(2.0f));
  put16(b, 2, f32_to_f16(1.0f));
  for (int i = 0; i < 16; ++i)
    b[4 + i] = static_cast<uint8_t>(i | ((15 - i) << 4));
  dequantize(WType::q4_1, b.data(), y.data(), 32);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 2.0f * static_cast<float>(j) + 1.0f);
    EXPECT_EQ(y[j + 16], 2.0f * static_cast<float>(15 - j) + 1.0f);
  }
}

TEST(Quant, Iq4HandMadeBlocks) {
  std::vector<uint8_t> b(136, 0);
  put16(b, 0, f32_to_f16(0.5f));
  for (int i = 0; i < 16; ++i)
    b[2 + i] = static_cast<uint8_t>(i | ((15 - i) << 4));
  std::vector<float> y(256);
  dequantize(WType::iq4_nl, b.data(), y.data(), 32);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], 0.5f * iq4nl_values[j]);
    EXPECT_EQ(y[j + 16], 0.5f * iq4nl_values[15 - j]);
  }
  // iq4_xs: group g's scale is ls - 32, ls = 4 low bits from scales_l, 2 high from scales_h.
  const int ls[8] = {0, 63, 32, 33, 17, 48, 5, 40};
  uint16_t sh = 0;
  std::fill(b.begin() + 2, b.end(), uint8_t{0});
  for (int g = 0; g < 8; ++g) {
    sh = static_cast<uint16_t>(sh | ((ls[g] >> 4) << (2 * g)));
    b[4 + g / 2] = static_cast<uint8_t>(b[4 + g / 2] | ((ls[g] & 15) << (4 * (g % 2))));
  }
  put16(b, 2, sh);
  for (int i = 0; i < 128; ++i)
    b[8 + i] = static_cast<uint8_t>((i % 16) | ((i * 7 % 16) << 4));
  dequantize(WType::iq4_xs, b.data(), y.data(), 256);
  for (int g = 0; g < 8; ++g)
    for (int j = 0; j < 16; ++j) {
      const int byte = 16 * g + j;
      EXPECT_EQ(y[32 * g + j], 0.5f * static_cast<float>(ls[g] - 32) * iq4nl_values[byte % 16]) << g << "," << j;
      EXPECT_EQ(y[32 * g + 16 + j], 0.5f * static_cast<float>(ls[g] - 32) * iq4nl_values[byte * 7 % 16]);
    }
}

// q2_K / q3_K: group g = 8h + 2j + p holds values 128h + 32j + 16p + l, 2 bits at
// bit 2j of qs[32h + 16p + l]; q3_K's 3rd bit is bit 4h + j of hmask[16p + l].
TEST(Quant, Q2_KAndQ3_KHandMadeBlocks) {
  std::mt19937 rng(11);
  std::vector<uint8_t> b(110);
  for (auto& x : b)
    x = static_cast<uint8_t>(rng());
  put16(b, 80, f32_to_f16(0.5f));
  put16(b, 82, f32_to_f16(0.25f));
  std::vector<float> y(256);
  dequantize(WType::q2_K, b.data(), y.data(), 256);
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int p = 0; p < 2; ++p)
        for (int l = 0; l < 16; ++l) {
          const int g = 8 * h + 2 * j + p;
          const int q = (b[16 + 32 * h + 16 * p + l] >> (2 * j)) & 3;
          ASSERT_EQ(y[128 * h + 32 * j + 16 * p + l], 0.5f * (b[g] & 15) * q - 0.25f * (b[g] >> 4));
        }
  for (auto& x : b)
    x = static_cast<uint8_t>(rng());
  put16(b, 108, f32_to_f16(0.125f));
  // 6-bit scales: low 4 bits of byte g (g < 8) or high 4 of byte g - 8; high 2
  // bits from byte 8 + g % 4 at bits 2 (g / 4).
  int8_t sc[16];
  q3_K_scales(b.data() + 96, sc);
  for (int g = 0; g < 16; ++g) {
    const int lo = g < 8 ? b[96 + g] & 15 : b[96 + g - 8] >> 4;
    const int hi = (b[96 + 8 + g % 4] >> (2 * (g / 4))) & 3;
    EXPECT_EQ(sc[g], (lo | (hi << 4)) - 32) << g;
  }
  dequantize(WType::q3_K, b.data(), y.data(), 256);
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int p = 0; p < 2; ++p)
        for (int l = 0; l < 16; ++l) {
          const int g = 8 * h + 2 * j + p;
          int q = (b[32 + 32 * h + 16 * p + l] >> (2 * j)) & 3;
          if (!(b[16 * p + l] & (1 << (4 * h + j))))
            q -= 4;
          ASSERT_EQ(y[128 * h + 32 * j + 16 * p + l], 0.125f * sc[g] * q);
        }
}

TEST(Quant, Q8_0HandMadeBlock) {
  std::vector<uint8_t> b(34);
  put16(b, 0, f32_to_f16(0.5f));
  for (int i = 0; i < 32; ++i)
    b[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(i - 16));
  std::vector<float> y(32);
  dequantize(WType::q8_0, b.data(), y.data(), 32);
  for (int i = 0; i < 32; ++i)
    EXPECT_EQ(y[i], 0.5f * static_cast<float>(i - 16));
}

TEST(Quant, Q4_0HandMadeBlock) {
  std::vector<uint8_t> b(18);
  put16(b, 0, f32_to_f16(-2.0f));
  for (int i = 0; i < 16; ++i)
    b[2 + i] = static_cast<uint8_t>(i | ((15 - i) << 4)); // low nibble i, high 15 - i
  std::vector<float> y(32);
  dequantize(WType::q4_0, b.data(), y.data(), 32);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(y[i], -2.0f * static_cast<float>(i - 8));
    EXPECT_EQ(y[i + 16], -2.0f * static_cast<float>(15 - i - 8));
  }
}

TEST(Quant, Q4_KHandMadeBlock) {
  // d = 1, dmin = 0.5; sub-block j has scale j + 1 and min 2j (6-bit packing:
  // j < 4 in the low 6 bits of bytes j / j + 4; j >= 4 split across bytes).
  std::vector<uint8_t> b(144, 0);
  put16(b, 0, f32_to_f16(1.0f));
  put16(b, 2, f32_to_f16(0.5f));
  uint8_t* s = b.data() + 4;
  int sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = j + 1 + (j >= 4 ? 40 : 0); // exercise the high bits too
    mn[j] = 2 * j + (j >= 4 ? 33 : 0);
  }
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
  }
  uint8_t* q = b.data() + 16;
  for (int i = 0; i < 128; ++i)
    q[i] = static_cast<uint8_t>((i % 16) | (((i + 3) % 16) << 4));
  std::vector<float> y(256);
  dequantize(WType::q4_K, b.data(), y.data(), 256);
  // Chunk c (0..3) of 32 bytes gives sub-blocks 2c (low nibbles) and 2c + 1 (high).
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      const int lo = (32 * c + l) % 16, hi = (32 * c + l + 3) % 16;
      EXPECT_EQ(y[64 * c + l], static_cast<float>(sc[2 * c] * lo) - 0.5f * static_cast<float>(mn[2 * c]));
      EXPECT_EQ(y[64 * c + 32 + l], static_cast<float>(sc[2 * c + 1] * hi) - 0.5f * static_cast<float>(mn[2 * c + 1]));
    }
}

TEST(Quant, Q6_KHandMadeBlock) {
  // d = 0.25; scales[k] = k - 8; value i of the block = 6-bit q - 32.
  std::vector<uint8_t> b(210, 0);
  int q6[256];
  for (int i = 0; i < 256; ++i)
    q6[i] = (i * 7 + 5) % 64;
  // Layout: half n (128 values), l < 32: values l, l+32, l+64, l+96 take
  // ql[l] low, ql[l+32] low, ql[l] high, ql[l+32] high nibbles and the 2-bit
  // pairs of qh[l] at shifts 0, 2, 4, 6.
  for (int n = 0; n < 2; ++n)
    for (int l = 0; l < 32; ++l) {
      const int* v = q6 + 128 * n;
      uint8_t* ql = b.data() + 64 * n;
      uint8_t* qh = b.data() + 128 + 32 * n;
      ql[l] = static_cast<uint8_t>((v[l] & 0xF) | ((v[l + 64] & 0xF) << 4));
      ql[l + 32] = static_cast<uint8_t>((v[l + 32] & 0xF) | ((v[l + 96] & 0xF) << 4));
      qh[l] = static_cast<uint8_t>((v[l] >> 4) | ((v[l + 32] >> 4) << 2) | ((v[l + 64] >> 4) << 4) | ((v[l + 96] >> 4) << 6));
    }
  for (int k = 0; k < 16; ++k)
    b[192 + k] = static_cast<uint8_t>(static_cast<int8_t>(k - 8));
  put16(b, 208, f32_to_f16(0.25f));
  std::vector<float> y(256);
  dequantize(WType::q6_K, b.data(), y.data(), 256);
  for (int i = 0; i < 256; ++i) // value i uses scale i / 16
    EXPECT_EQ(y[i], 0.25f * static_cast<float>(i / 16 - 8) * static_cast<float>(q6[i] - 32)) << i;
}

TEST(Quant, HalfTypesAndQuantizersRoundTrip) {
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> x(256);
  for (auto& v : x)
    v = d(rng);
  for (auto [t, tol] : {std::pair{WType::f16, 1e-3}, {WType::bf16, 8e-3}, {WType::q8_0, 0.5 / 127 + 1e-3}, {WType::q4_0, 1.0 / 8 + 1e-3}}) {
    std::vector<uint8_t> q(row_bytes(t, 256));
    quantize(t, x.data(), q.data(), 256);
    std::vector<float> y(256);
    dequantize(t, q.data(), y.data(), 256);
    for (int b = 0; b < 256; b += 32) {
      float amax = 0;
      for (int i = 0; i < 32; ++i)
        amax = std::max(amax, std::fabs(x[b + i]));
      // Relative to the block's largest value (q4_0: -8 d is the signed extreme,
      // so the opposite side clamps at 7 d, an error up to d).
      for (int i = 0; i < 32; ++i)
        EXPECT_LE(std::fabs(y[b + i] - x[b + i]), tol * amax * 1.01 + 1e-6) << to_string(t) << " value " << b + i;
    }
  }
  // q4_K (simple min/max): within half a step of each sub-block's range, plus
  // the 6-bit rounding of its scale and min.
  {
    std::vector<uint8_t> q(row_bytes(WType::q4_K, 256));
    quantize(WType::q4_K, x.data(), q.data(), 256);
    std::vector<float> y(256);
    dequantize(WType::q4_K, q.data(), y.data(), 256);
    float amax = 0;
    for (float v : x)
      amax = std::max(amax, std::fabs(v));
    for (int i = 0; i < 256; ++i)
      EXPECT_LE(std::fabs(y[i] - x[i]), 0.12f * amax) << "q4_K value " << i;
  }
  std::vector<uint8_t> q6(row_bytes(WType::q6_K, 256));
  EXPECT_THROW(quantize(WType::q6_K, x.data(), q6.data(), 256), Error);
}

// Random bytes make valid blocks of every type as long as the f16 scales are
// tame: write them explicitly.
std::vector<uint8_t> random_blocks(WType t, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> b(row_bytes(t, cols) * static_cast<std::size_t>(rows));
  if (t == WType::f32 || t == WType::f16 || t == WType::bf16) {
    std::normal_distribution<float> d(0.f, 0.5f);
    std::vector<float> v(static_cast<std::size_t>(rows * cols));
    for (auto& x : v)
      x = d(rng);
    quantize(t, v.data(), b.data(), rows * cols);
    return b;
  }
  for (auto& x : b)
    x = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> sc(0.001f, 0.02f);
  const std::size_t bb = block_bytes(t);
  for (std::size_t at = 0; at < b.size(); at += bb) {
    switch (t) {
      case WType::q4_K: case WType::q5_K: case WType::q4_1: case WType::q5_1: // d and a min (dmin)
        put16(b, at, f32_to_f16(sc(rng)));
        put16(b, at + 2, f32_to_f16(sc(rng)));
        break;
      case WType::q6_K: put16(b, at + 208, f32_to_f16(sc(rng) / 8)); break;
      case WType::q2_K:
        put16(b, at + 80, f32_to_f16(sc(rng)));
        put16(b, at + 82, f32_to_f16(sc(rng)));
        break;
      case WType::q3_K: put16(b, at + 108, f32_to_f16(sc(rng) / 8)); break;
      case WType::iq4_nl: case WType::iq4_xs: put16(b, at, f32_to_f16(sc(rng) / 16)); break;
      default: put16(b, at, f32_to_f16(sc(rng))); break; // q8_0, q4_0, q5_0
    }
  }
  return b;
}

class TypedKernels : public ::testing::TestWithParam<detail::FusedIsa> {
protected:
  void SetUp() override { detail::set_fused_isa(GetParam()); }
  void TearDown() override { detail::set_fused_isa(detail::FusedIsa::best); }
};

INSTANTIATE_TEST_SUITE_P(Isa, TypedKernels,
                         ::testing::Values(detail::FusedIsa::best, detail::FusedIsa::avx2, detail::FusedIsa::expand),
                         [](const auto& info) {
                           return std::string(info.param == detail::FusedIsa::best   ? "Best"
                                              : info.param == detail::FusedIsa::avx2 ? "Avx2"
                                                                                     : "Expand");
                         });

// The activation quantizers: the vector ones (best) give the scalar ones'
// bytes, scales and sums, on rows with zero blocks, ties of magnitude with
// opposite signs (q8_K keeps the first), values that round to +-127.5 and
// tiny and huge magnitudes; rows of 1024 values (q8_0's vector quantizer: two
// runs of 16 blocks) and, for the 32-value types, of 992 (a run of 16 blocks
// and one of 15).
TEST(ActivationQuantizers, VectorAndScalarGiveTheSameBytes) {
  for (const int64_t cols : {int64_t{1024}, int64_t{992}}) {
    SCOPED_TRACE(cols);
    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.f, 1.f);
    const int64_t M = 6;
    std::vector<float> X(static_cast<std::size_t>(M * cols));
    for (auto& x : X)
      x = nd(rng);
    for (int64_t i = 0; i < 256; ++i) // row 1: a zero block of 256 (and 8 of 32)
      X[static_cast<std::size_t>(cols + i)] = 0.f;
    X[2 * cols + 5] = -4.f; // row 2: ties of |4|, the negative one first
    X[2 * cols + 9] = 4.f;
    X[2 * cols + 300] = 6.f; // then the positive first
    X[2 * cols + 301] = -6.f;
    for (int64_t i = 0; i < cols; ++i) {
      X[static_cast<std::size_t>(3 * cols + i)] = static_cast<float>(i % 32) - 15.5f; // halves after scaling
      X[static_cast<std::size_t>(4 * cols + i)] = nd(rng) * 1e-30f;
      X[static_cast<std::size_t>(5 * cols + i)] = nd(rng) * 1e30f;
    }
    for (WType t : {WType::q8_0, WType::q4_0, WType::q4_K, WType::q6_K, WType::q2_K, WType::q3_K}) {
      if (cols % detail::acts_block(t) != 0)
        continue;
      SCOPED_TRACE(to_string(t));
      detail::QuantActs vec, scalar;
      detail::set_fused_isa(detail::FusedIsa::best);
      detail::quantize_acts(t, X.data(), M, cols, vec);
      detail::set_fused_isa(detail::FusedIsa::avx2);
      detail::quantize_acts(t, X.data(), M, cols, scalar);
      detail::set_fused_isa(detail::FusedIsa::best);
      EXPECT_EQ(vec.q, scalar.q);
      EXPECT_EQ(vec.d, scalar.d);
      EXPECT_EQ(vec.s, scalar.s);
      EXPECT_EQ(vec.sums, scalar.sums);
      EXPECT_EQ(vec.sums32, scalar.sums32);
      EXPECT_EQ(vec.qi, scalar.qi);
      EXPECT_EQ(vec.corr, scalar.corr);
      EXPECT_EQ(vec.d32, scalar.d32);
      EXPECT_EQ(vec.dsum32, scalar.dsum32);
      EXPECT_EQ(vec.qi16, scalar.qi16);
      EXPECT_EQ(vec.dsum16, scalar.dsum16);
    }
  }
}

TEST_P(TypedKernels, MatchTheScalarPath) {
  struct Case {
    WType t;
    std::vector<int64_t> cols;
    double tol; // relative to the sum of |w x|: activations are rounded as llama.cpp pairs them
    bool packed = false; // the rows in packed.hpp's layout (groups of 8 blocks, then plain ones)
  };
  const std::vector<Case> cases = {
    {WType::f32, {37, 100, 896}, 1e-5},      {WType::f16, {37, 100, 896}, 2e-3},
    {WType::bf16, {37, 100, 896}, 1e-2},     {WType::q8_0, {32, 96, 160}, 1e-2},
    {WType::q4_0, {32, 96, 160}, 1e-2},      {WType::q4_K, {256, 768}, 1e-2},
    {WType::q6_K, {256, 768}, 1e-2},        {WType::q4_1, {32, 96, 160}, 1e-2},
    {WType::q5_0, {32, 96, 160}, 1e-2},      {WType::q5_1, {32, 96, 160}, 1e-2},
    {WType::iq4_nl, {32, 96, 160}, 1e-2},    {WType::q2_K, {256, 768}, 1e-2},
    {WType::q3_K, {256, 768}, 1e-2},         {WType::q5_K, {256, 768}, 1e-2},
    {WType::iq4_xs, {256, 768}, 1e-2},
    // (q8_0: pairs of full groups, of a full and a partial one, a last group alone of each kind)
    {WType::q8_0, {32, 96, 256, 288, 480, 512, 544, 768, 896, 1280}, 1e-2, true}, {WType::q4_K, {256, 768, 1280}, 1e-2, true},
    {WType::q4_0, {32, 96, 256, 288, 480, 544, 896}, 1e-2, true}, {WType::q5_0, {32, 96, 256, 288, 480, 544, 896}, 1e-2, true},
    {WType::iq4_nl, {32, 96, 256, 288, 480, 544, 896}, 1e-2, true}, {WType::iq4_xs, {256, 768, 1280}, 1e-2, true},
    {WType::q2_K, {256, 768, 1280}, 1e-2, true},
    {WType::q4_1, {32, 96, 256, 288, 480, 544, 896}, 1e-2, true}, {WType::q5_1, {32, 96, 256, 288, 480, 544, 896}, 1e-2, true},
    {WType::q5_K, {256, 768, 1280}, 1e-2, true}, {WType::q3_K, {256, 768, 1280}, 1e-2, true},
    {WType::q6_K, {256, 768, 1280}, 1e-2, true},
  };
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const auto& c : cases)
    for (int64_t cols : c.cols)
      for (int64_t rows : {1, 3, 4, 7, 13}) {
        SCOPED_TRACE(std::string(to_string(c.t)) + (c.packed ? " packed " : " ") + std::to_string(rows) + "x" +
                     std::to_string(cols));
        auto bytes = random_blocks(c.t, rows, cols, static_cast<uint32_t>(rows * 1000 + cols));
        detail::WMatrix W;
        W.type = c.t;
        W.rows = rows;
        W.cols = cols;
        W.data = bytes.data();
        std::vector<float> w(static_cast<std::size_t>(rows * cols));
        dequantize(c.t, W.data, w.data(), rows * cols);
        if (c.packed) {
          W = detail::pack_rows(W);
          ASSERT_TRUE(W.packed);
          ASSERT_EQ(W.bytes(), bytes.size());
          if (cols > 32) { // (one q4_0 block packs to itself)
            ASSERT_NE(std::memcmp(W.data, bytes.data(), bytes.size()), 0) << "packing moved nothing";
          }
          std::vector<uint8_t> back(bytes.size());
          detail::unpack_rows(W, 0, rows, back.data());
          ASSERT_EQ(back, bytes) << "unpacking gives the plain rows back";
          std::vector<float> wp(w.size());
          detail::dequantize_rows(W, 0, rows, wp.data());
          ASSERT_EQ(wp, w);
        }
        for (int64_t M : {1, 5, 20}) {
          std::vector<float> X(static_cast<std::size_t>(M * cols));
          for (auto& x : X)
            x = nd(rng);
          const int64_t ldy = rows + 2; // a part of a wider output
          std::vector<float> Y(static_cast<std::size_t>(M * ldy), -7.f), G(Y.size(), -7.f);
          detail::matmul_rows(W, X.data(), Y.data(), ldy, M, false);
          detail::matmul_gemm(W, X.data(), G.data(), ldy, M, false);
          for (int64_t m = 0; m < M; ++m) {
            for (int64_t r = 0; r < rows; ++r) {
              double ref = 0, mag = 0;
              for (int64_t k = 0; k < cols; ++k) {
                ref += static_cast<double>(w[r * cols + k]) * X[m * cols + k];
                mag += std::fabs(static_cast<double>(w[r * cols + k]) * X[m * cols + k]);
              }
              const auto i = static_cast<std::size_t>(m * ldy + r);
              ASSERT_NEAR(Y[i], ref, c.tol * mag + 1e-5) << "rows kernel, row " << m << "," << r;
              ASSERT_NEAR(G[i], ref, c.tol * mag + 1e-5) << "gemm, row " << m << "," << r;
              // Quantized weights take their fused kernel for long sequences
              // too: the same bits as the few-row path.
              if (c.t != WType::f32 && c.t != WType::f16 && c.t != WType::bf16 && detail::fused_available(c.t)) {
                ASSERT_EQ(G[i], Y[i]) << "gemm path, row " << m << "," << r;
              }
            }
            EXPECT_EQ(Y[static_cast<std::size_t>(m * ldy + rows)], -7.f) << "wrote past its columns";
            // Alone, row m gets bit-for-bit the same numbers.
            std::vector<float> one(static_cast<std::size_t>(ldy), -7.f);
            detail::matmul_rows(W, X.data() + m * cols, one.data(), ldy, 1, false);
            for (int64_t r = 0; r < rows; ++r)
              ASSERT_EQ(one[static_cast<std::size_t>(r)], Y[static_cast<std::size_t>(m * ldy + r)]);
          }
        }
      }
}

// Packing converts rows independently: through a runner that hands out uneven
// pieces of rows in reverse order from several threads at once (as the loader's
// packing on the math pool's threads does), every packable type gives the bytes
// packing them one after another gives.
TEST(PackedRows, PiecesOnSeveralThreadsGiveTheSameBytesAsOneAfterAnother) {
  const std::vector<std::pair<WType, int64_t>> types = {
    {WType::q8_0, 544}, {WType::q4_0, 544}, {WType::q5_0, 544}, {WType::q4_1, 544},  {WType::q5_1, 544},
    {WType::iq4_nl, 544}, {WType::q4_K, 768}, {WType::q5_K, 768}, {WType::q6_K, 768}, {WType::iq4_xs, 768},
    {WType::q2_K, 768}, {WType::q3_K, 768}};
  for (const auto& [t, cols] : types) {
    SCOPED_TRACE(to_string(t));
    const int64_t rows = 37;
    auto bytes = random_blocks(t, rows, cols, 7);
    detail::WMatrix W;
    W.type = t;
    W.rows = rows;
    W.cols = cols;
    W.data = bytes.data();
    ASSERT_TRUE(detail::packable(W));
    const auto one = detail::pack_rows(W);
    const auto pieces = detail::pack_rows(W, [](int64_t n, const std::function<void(int64_t, int64_t)>& f) {
      std::vector<std::pair<int64_t, int64_t>> ranges;
      for (int64_t r = 0, len = 1; r < n; r += len, len = len % 5 + 2)
        ranges.emplace_back(r, std::min(n, r + len));
      std::vector<std::thread> threads;
      for (int k = 0; k < 3; ++k)
        threads.emplace_back([&, k] {
          for (auto i = static_cast<int64_t>(ranges.size()) - 1 - k; i >= 0; i -= 3)
            f(ranges[static_cast<std::size_t>(i)].first, ranges[static_cast<std::size_t>(i)].second);
        });
      for (auto& th : threads)
        th.join();
    });
    ASSERT_TRUE(pieces.packed);
    ASSERT_EQ(std::memcmp(one.data, pieces.data, W.bytes()), 0);
    std::vector<uint8_t> back(bytes.size());
    detail::unpack_rows(pieces, 0, rows, back.data());
    EXPECT_EQ(back, bytes);
  }
}

// A stacked weight whose parts are of different types (q | k | v of a Q2_K
// file: q2_K with q4_K and q3_K parts) multiplies each part as it would alone:
// the activations each part needs (q2_K's also interleaved by 16) whatever
// part came before, bit for bit, in either order.
TEST_P(TypedKernels, StackedPartsOfMixedTypesEqualEachPartAlone) {
  const int64_t cols = 512, M = 3;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> X(static_cast<std::size_t>(M * cols));
  for (auto& x : X)
    x = nd(rng);
  for (auto order : {std::vector<WType>{WType::q4_K, WType::q2_K, WType::q3_K, WType::q2_K},
                     std::vector<WType>{WType::q2_K, WType::q4_K, WType::q8_0, WType::q2_K}}) {
    std::vector<std::vector<uint8_t>> bytes;
    detail::Linear w;
    for (std::size_t i = 0; i < order.size(); ++i) {
      bytes.push_back(random_blocks(order[i], 5 + static_cast<int64_t>(i), cols, static_cast<uint32_t>(70 + i)));
      detail::WMatrix m;
      m.type = order[i];
      m.rows = 5 + static_cast<int64_t>(i);
      m.cols = cols;
      m.data = bytes.back().data();
      w.add(detail::pack_for_kernels(m));
    }
    std::vector<float> Y(static_cast<std::size_t>(M * w.rows), -7.f);
    detail::matmul_rows(w, X.data(), Y.data(), M, false);
    int64_t col0 = 0;
    for (const auto& part : w.parts) {
      SCOPED_TRACE(to_string(part.type));
      std::vector<float> alone(static_cast<std::size_t>(M * part.rows), -7.f);
      detail::matmul_rows(part, X.data(), alone.data(), part.rows, M, false);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < part.rows; ++r)
          ASSERT_EQ(Y[static_cast<std::size_t>(m * w.rows + col0 + r)], alone[static_cast<std::size_t>(m * part.rows + r)])
            << "row " << m << "," << r;
      col0 += part.rows;
    }
  }
}

} // namespace
} // namespace strata::model
