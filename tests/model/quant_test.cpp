// Weight blocks: dequantization of hand-made blocks whose floats are exact, the
// reference quantizers, and the typed matrix kernels against a scalar path
// (dequantize, then double-precision dot products) for every type and shape
// class, tails included; a row's result must not depend on the other rows.

#include "model/base/error.hpp"
#include "model/kernels/kernels.hpp"
#include "model/kernels/kernels_q.hpp"
#include "model/formats/quant.hpp"
#include "model/formats/safetensors.hpp"
#include "model/formats/wmatrix.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
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
    if (t == WType::q8_0 || t == WType::q4_0)
      put16(b, at, f32_to_f16(sc(rng)));
    else if (t == WType::q4_K) {
      put16(b, at, f32_to_f16(sc(rng)));
      put16(b, at + 2, f32_to_f16(sc(rng)));
    } else
      put16(b, at + 208, f32_to_f16(sc(rng) / 8));
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

TEST_P(TypedKernels, MatchTheScalarPath) {
  struct Case {
    WType t;
    std::vector<int64_t> cols;
    double tol; // relative to the sum of |w x|: activations are rounded as llama.cpp pairs them
  };
  const std::vector<Case> cases = {
    {WType::f32, {37, 100, 896}, 1e-5},      {WType::f16, {37, 100, 896}, 2e-3},
    {WType::bf16, {37, 100, 896}, 1e-2},     {WType::q8_0, {32, 96, 160}, 1e-2},
    {WType::q4_0, {32, 96, 160}, 1e-2},      {WType::q4_K, {256, 768}, 1e-2},
    {WType::q6_K, {256, 768}, 1e-2},
  };
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const auto& c : cases)
    for (int64_t cols : c.cols)
      for (int64_t rows : {1, 3, 4, 7, 13}) {
        SCOPED_TRACE(std::string(to_string(c.t)) + " " + std::to_string(rows) + "x" + std::to_string(cols));
        auto bytes = random_blocks(c.t, rows, cols, static_cast<uint32_t>(rows * 1000 + cols));
        detail::WMatrix W;
        W.type = c.t;
        W.rows = rows;
        W.cols = cols;
        W.data = bytes.data();
        std::vector<float> w(static_cast<std::size_t>(rows * cols));
        dequantize(c.t, W.data, w.data(), rows * cols);
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

} // namespace
} // namespace strata::model
