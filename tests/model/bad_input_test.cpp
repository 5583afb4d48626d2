// Bad checkpoints and bad calls give typed errors that name the file or field.

#include "model/base/error.hpp"
#include "model/formats/safetensors.hpp"
#include "model/transformer/shard.hpp"
#include "tests/support.hpp"

#include <cstring>
#include <functional>

namespace strata {
namespace {

using model::errc;

std::string stories() {
  return test::read_file(test::shared_path("models/stories260K.bin"));
}

TEST(BadCheckpoint, MissingFile) {
  EXPECT_MODEL_ERROR(model::Shard::load("/nonexistent/model.bin"), errc::io, "/nonexistent/model.bin");
}

TEST(BadCheckpoint, TruncatedLlama2c) {
  STRATA_REQUIRE_SHARED("models/stories260K.bin");
  auto dir = test::scratch_dir("bad_trunc");
  test::write_file(dir / "m.bin", stories().substr(0, 100000));
  EXPECT_MODEL_ERROR(model::Shard::load((dir / "m.bin").string()), errc::corrupt, "but the file has 100000");
  test::write_file(dir / "tiny.bin", "abc");
  EXPECT_MODEL_ERROR(model::Shard::load((dir / "tiny.bin").string()), errc::bad_format, "28-byte header");
}

TEST(BadCheckpoint, HeaderContradictsFileSize) {
  STRATA_REQUIRE_SHARED("models/stories260K.bin");
  auto dir = test::scratch_dir("bad_header");
  auto bytes = stories();
  int32_t layers = 6; // the file holds 5
  std::memcpy(bytes.data() + 8, &layers, 4);
  test::write_file(dir / "m.bin", bytes);
  EXPECT_MODEL_ERROR(model::Shard::load((dir / "m.bin").string()), errc::corrupt, "layers 6");
  bytes = stories();
  int32_t heads = 0;
  std::memcpy(bytes.data() + 12, &heads, 4);
  test::write_file(dir / "m2.bin", bytes);
  EXPECT_MODEL_ERROR(model::Shard::load((dir / "m2.bin").string()), errc::corrupt, "n_heads");
  bytes = stories();
  int32_t kv = 3; // does not divide 8 heads
  std::memcpy(bytes.data() + 16, &kv, 4);
  test::write_file(dir / "m3.bin", bytes);
  EXPECT_MODEL_ERROR(model::Shard::load((dir / "m3.bin").string()), errc::corrupt, "n_kv_heads");
}

// A small valid HF directory (random weights) whose parts the tests then break.
std::filesystem::path tiny_hf(const std::string& name, nlohmann::json cfg_patch = {}) {
  auto dir = test::scratch_dir(name);
  nlohmann::json cfg = {{"model_type", "qwen2"}, {"hidden_size", 8},      {"intermediate_size", 16},
                        {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"num_key_value_heads", 1},
                        {"vocab_size", 10},       {"max_position_embeddings", 16}, {"tie_word_embeddings", true},
                        {"eos_token_id", 2}};
  if (!cfg_patch.is_null())
    cfg.merge_patch(cfg_patch);
  test::write_file(dir / "config.json", cfg.dump());
  auto t = [](std::string n, std::vector<int64_t> shape) {
    int64_t k = 1;
    for (auto s : shape)
      k *= s;
    return model::TensorToWrite{std::move(n), shape, std::vector<float>(static_cast<std::size_t>(k), 0.01f)};
  };
  const std::string p = "model.layers.0.";
  model::write_safetensors((dir / "model.safetensors").string(),
                           {t("model.embed_tokens.weight", {10, 8}), t(p + "input_layernorm.weight", {8}),
                            t(p + "self_attn.q_proj.weight", {8, 8}), t(p + "self_attn.k_proj.weight", {4, 8}),
                            t(p + "self_attn.v_proj.weight", {4, 8}), t(p + "self_attn.q_proj.bias", {8}),
                            t(p + "self_attn.k_proj.bias", {4}), t(p + "self_attn.v_proj.bias", {4}),
                            t(p + "self_attn.o_proj.weight", {8, 8}), t(p + "post_attention_layernorm.weight", {8}),
                            t(p + "mlp.gate_proj.weight", {16, 8}), t(p + "mlp.up_proj.weight", {16, 8}),
                            t(p + "mlp.down_proj.weight", {8, 16}), t("model.norm.weight", {8})});
  return dir;
}

// Rewrites the JSON header of a safetensors file (keeping the data section).
void patch_header(const std::filesystem::path& file, const std::function<void(nlohmann::json&)>& fn) {
  auto bytes = test::read_file(file);
  uint64_t hl = 0;
  std::memcpy(&hl, bytes.data(), 8);
  auto h = nlohmann::json::parse(bytes.substr(8, hl));
  fn(h);
  std::string hs = h.dump();
  uint64_t nl = hs.size();
  std::string out(reinterpret_cast<const char*>(&nl), 8);
  test::write_file(file, out + hs + bytes.substr(8 + hl));
}

TEST(BadCheckpoint, ValidTinyHfLoads) {
  auto dir = tiny_hf("hf_ok");
  auto shard = model::Shard::load(dir.string());
  EXPECT_EQ(shard->config().architecture, "qwen2");
  EXPECT_TRUE(shard->config().attention_bias);
}

TEST(BadCheckpoint, SafetensorsOffsetsOutsideTheFile) {
  auto dir = tiny_hf("hf_offsets");
  patch_header(dir / "model.safetensors", [](auto& h) { h["model.norm.weight"]["data_offsets"] = {0, 1u << 30}; });
  EXPECT_MODEL_ERROR(model::Shard::load(dir.string()), errc::corrupt, "model.norm.weight");
}

TEST(BadCheckpoint, SafetensorsDtypeLies) {
  auto dir = tiny_hf("hf_dtype");
  patch_header(dir / "model.safetensors", [](auto& h) { h["model.norm.weight"]["dtype"] = "F16"; });
  EXPECT_MODEL_ERROR(model::Shard::load(dir.string()), errc::corrupt, "model.norm.weight");
  auto dir2 = tiny_hf("hf_dtype2");
  patch_header(dir2 / "model.safetensors", [](auto& h) { h["model.norm.weight"]["dtype"] = "I64"; });
  EXPECT_MODEL_ERROR(model::Shard::load(dir2.string()), errc::unsupported, "I64");
}

TEST(BadCheckpoint, SafetensorsShapeDisagreesWithConfig) {
  auto dir = tiny_hf("hf_shape");
  patch_header(dir / "model.safetensors", [](auto& h) {
    h["model.norm.weight"]["shape"] = {2, 4};
  });
  EXPECT_MODEL_ERROR(model::Shard::load(dir.string()), errc::corrupt, "expected [8]");
}

TEST(BadCheckpoint, SafetensorsHeaderLengthLies) {
  auto dir = tiny_hf("hf_hlen");
  auto bytes = test::read_file(dir / "model.safetensors");
  uint64_t huge = uint64_t{1} << 40;
  std::memcpy(bytes.data(), &huge, 8);
  test::write_file(dir / "model.safetensors", bytes);
  EXPECT_MODEL_ERROR(model::Shard::load(dir.string()), errc::corrupt, "exceeds the file size");
  test::write_file(dir / "model.safetensors", std::string("\x04\0\0\0\0\0\0\0nope", 12));
  EXPECT_MODEL_ERROR(model::Shard::load(dir.string()), errc::bad_format, "not JSON");
}

TEST(BadCheckpoint, MissingTensorAndBadConfig) {
  auto dir = tiny_hf("hf_missing", {{"tie_word_embeddings", false}});
  EXPECT_MODEL_ERROR(model::Shard::load(dir.string()), errc::missing_tensor, "lm_head.weight");
  auto dir2 = tiny_hf("hf_cfg", {{"num_key_value_heads", 3}});
  EXPECT_MODEL_ERROR(model::Shard::load(dir2.string()), errc::bad_config, "n_kv_heads");
  auto dir3 = tiny_hf("hf_type", {{"model_type", "gpt2"}});
  EXPECT_MODEL_ERROR(model::Shard::load(dir3.string()), errc::unsupported, "gpt2");
  auto dir4 = tiny_hf("hf_field", {{"hidden_size", "eight"}});
  EXPECT_MODEL_ERROR(model::Shard::load(dir4.string()), errc::bad_config, "hidden_size");
}

TEST(BadCall, TokenOutOfRangeAndContextOverflow) {
  STRATA_REQUIRE_SHARED("models/stories260K.bin");
  auto shard = model::Shard::load(test::shared_path("models/stories260K.bin"));
  auto cache = shard->new_cache();
  std::vector<int32_t> bad = {1, 512};
  EXPECT_MODEL_ERROR(shard->forward(bad, model::consecutive_positions(0, 2), cache), errc::token_out_of_range, "512");
  EXPECT_EQ(cache.seq_len(), 0);
  std::vector<int32_t> full(512, 5);
  shard->forward(full, model::consecutive_positions(0, 512), cache);
  EXPECT_EQ(cache.seq_len(), 512);
  std::vector<int32_t> one = {5};
  EXPECT_MODEL_ERROR(shard->forward(one, model::consecutive_positions(512, 1), cache), errc::context_overflow,
                     "max_seq_len 512");
  EXPECT_EQ(cache.seq_len(), 512) << "a failed append leaves the cache as it was";
}

TEST(BadCall, PositionsShapesAndForeignCaches) {
  auto head = model::Shard::load("builtin:tiny", {0, 1});
  auto tail = model::Shard::load("builtin:tiny", {2, 4});
  auto hc = head->new_cache(), tc = tail->new_cache();
  std::vector<int32_t> toks = {1, 2, 3};
  EXPECT_MODEL_ERROR(head->forward(toks, model::consecutive_positions(1, 3), hc), errc::bad_position, "holds 0 tokens");
  EXPECT_MODEL_ERROR(head->forward(toks, model::consecutive_positions(0, 2), hc), errc::bad_shape, "positions");
  EXPECT_MODEL_ERROR(head->forward(toks, model::consecutive_positions(0, 3), tc), errc::bad_argument, "not created by this shard");
  auto out = head->forward(toks, model::consecutive_positions(0, 3), hc);
  ASSERT_EQ(out.hidden.rows, 3);
  model::Activation wrong = out.hidden;
  wrong.cols = 7;
  EXPECT_MODEL_ERROR(tail->forward(wrong, model::consecutive_positions(0, 3), tc), errc::bad_shape, "dim 64");
  EXPECT_MODEL_ERROR(tail->forward(toks, model::consecutive_positions(0, 3), tc), errc::bad_argument, "not the head");
  EXPECT_MODEL_ERROR(head->forward(out.hidden, model::consecutive_positions(0, 3), hc), errc::bad_argument, "is the head");
  auto logits = tail->forward(out.hidden, model::consecutive_positions(0, 3), tc);
  EXPECT_EQ(logits.logits.size(), 259u);
}

TEST(BadCall, UnknownBuiltinAndBadRange) {
  EXPECT_MODEL_ERROR(model::Shard::load("builtin:nope"), errc::bad_argument, "builtin:tiny");
  EXPECT_MODEL_ERROR(model::Shard::load("builtin:tiny", {3, 9}), errc::bad_argument, "5 layers");
  EXPECT_MODEL_ERROR(model::parse_layer_ranges("0-1,x"), errc::bad_argument, "'x'");
  EXPECT_MODEL_ERROR(model::check_route_covers(model::parse_layer_ranges("0-1,3-4"), 5), errc::bad_argument,
                     "starting at layer 2");
}

// Stop ids as models ship them: generation_config.json's eos_token_id (an integer
// or a list) joins config.json's, once each; a broken file is refused by name.
TEST(HfConfig, GenerationConfigStopIdsJoinConfigJson) {
  auto dir = tiny_hf("hf_genconfig");
  EXPECT_EQ(model::read_config(dir.string()).eos_ids, (std::vector<int32_t>{2}));
  test::write_file(dir / "generation_config.json", R"({"bos_token_id": 1, "eos_token_id": [7, 2, 9]})");
  EXPECT_EQ(model::read_config(dir.string()).eos_ids, (std::vector<int32_t>{2, 7, 9}));
  test::write_file(dir / "generation_config.json", R"({"eos_token_id": 5, "do_sample": true})");
  EXPECT_EQ(model::read_config(dir.string()).eos_ids, (std::vector<int32_t>{2, 5}));
  test::write_file(dir / "generation_config.json", R"({"eos_token_id": "</s>"})");
  EXPECT_MODEL_ERROR(model::read_config(dir.string()), errc::bad_config, "generation_config.json");
  test::write_file(dir / "generation_config.json", "{not json");
  EXPECT_MODEL_ERROR(model::read_config(dir.string()), errc::bad_format, "generation_config.json");
}

} // namespace
} // namespace strata
