#include "model/base/error.hpp"
#include "model/formats/safetensors.hpp"
#include "tests/support.hpp"

#include <cmath>
#include <cstring>

namespace strata {
namespace {

using model::DType;

TEST(Safetensors, WritesAndReadsEveryDtype) {
  auto dir = test::scratch_dir("st_roundtrip");
  const std::vector<float> v = {0.0f, 1.0f, -2.5f, 3.14159f, 65504.0f, 1e-7f};
  model::write_safetensors((dir / "a.safetensors").string(),
                           {{"a", {2, 3}, v, DType::f32}, {"b", {6}, v, DType::f16}, {"c", {3, 2}, v, DType::bf16}});
  model::SafetensorsFile f((dir / "a.safetensors").string());
  ASSERT_EQ(f.tensors().size(), 3u);
  const auto& a = f.at("a");
  EXPECT_EQ(a.dtype, DType::f32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(a.data, v.data(), 24), 0);
  const auto& b = f.at("b");
  EXPECT_EQ(b.nbytes, 12u);
  for (int i = 0; i < 6; ++i) {
    uint16_t h;
    std::memcpy(&h, b.data + 2 * i, 2);
    EXPECT_NEAR(model::f16_to_f32(h), v[static_cast<std::size_t>(i)], std::abs(v[static_cast<std::size_t>(i)]) * 1e-3 + 1e-7);
  }
  EXPECT_MODEL_ERROR(f.at("zzz"), model::errc::missing_tensor, "zzz");
}

TEST(Safetensors, HalfConversionsRoundToNearestEven) {
  EXPECT_EQ(model::f32_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(model::f32_to_f16(-2.0f), 0xC000);
  EXPECT_EQ(model::f32_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(model::f32_to_f16(1e6f), 0x7C00);           // overflow -> inf
  EXPECT_EQ(model::f32_to_f16(5.960464477539063e-8f), 1); // smallest subnormal
  EXPECT_EQ(model::f16_to_f32(0x0001), 5.960464477539063e-8f);
  EXPECT_EQ(model::f16_to_f32(0x3555), 0.333251953125f);
  EXPECT_EQ(model::f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(model::bf16_to_f32(0x4049), 3.140625f);
  for (uint32_t h = 0; h < 0x7C00; h += 7) // every finite positive half survives f16 -> f32 -> f16
    EXPECT_EQ(model::f32_to_f16(model::f16_to_f32(static_cast<uint16_t>(h))), h);
}

TEST(Safetensors, RejectsLyingFiles) {
  auto dir = test::scratch_dir("st_bad");
  test::write_file(dir / "short", "1234");
  EXPECT_MODEL_ERROR(model::SafetensorsFile((dir / "short").string()), model::errc::bad_format, "8-byte");
  std::string h = R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}})";
  uint64_t n = h.size();
  test::write_file(dir / "size", std::string(reinterpret_cast<char*>(&n), 8) + h + std::string(8, '\0'));
  EXPECT_MODEL_ERROR(model::SafetensorsFile((dir / "size").string()), model::errc::corrupt, "needs 16");
  h = R"({"x":{"dtype":"F32","shape":[-4],"data_offsets":[0,8]}})";
  n = h.size();
  test::write_file(dir / "neg", std::string(reinterpret_cast<char*>(&n), 8) + h + std::string(8, '\0'));
  EXPECT_MODEL_ERROR(model::SafetensorsFile((dir / "neg").string()), model::errc::corrupt, "negative");
  h = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})";
  n = h.size();
  test::write_file(dir / "rev", std::string(reinterpret_cast<char*>(&n), 8) + h + std::string(8, '\0'));
  EXPECT_MODEL_ERROR(model::SafetensorsFile((dir / "rev").string()), model::errc::corrupt, "outside the data section");
  h = R"([1,2,3])";
  n = h.size();
  test::write_file(dir / "arr", std::string(reinterpret_cast<char*>(&n), 8) + h);
  EXPECT_MODEL_ERROR(model::SafetensorsFile((dir / "arr").string()), model::errc::bad_format, "not a JSON object");
}

} // namespace
} // namespace strata
