// The stories260K checkpoint, written by this test as a Hugging Face directory
// (safetensors; q/k rows permuted for rotate-half RoPE, as HF's converter does),
// loads through the HF path and gives the reference ids.

#include "model/base/error.hpp"
#include "model/formats/safetensors.hpp"
#include "model/transformer/shard.hpp"
#include "model/text/tokenizer.hpp"
#include "runtime/generator.hpp"
#include "tests/support.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>

namespace strata {
namespace {

using model::DType;
using model::TensorToWrite;

// Reads the llama2.c file independently of the loader under test.
struct RawLlama2c {
  int32_t dim, hidden, layers, heads, kv_heads, vocab, seq;
  std::vector<float> w;
  std::size_t off = 0;
  explicit RawLlama2c(const std::string& path) {
    auto bytes = test::read_file(path);
    std::memcpy(&dim, bytes.data(), 28);
    w.resize((bytes.size() - 28) / 4);
    std::memcpy(w.data(), bytes.data() + 28, w.size() * 4);
  }
  std::vector<float> take(std::size_t n) {
    std::vector<float> v(w.begin() + static_cast<std::ptrdiff_t>(off), w.begin() + static_cast<std::ptrdiff_t>(off + n));
    off += n;
    return v;
  }
};

// HF's permute for rotate-half: row (h, 2i + e) moves to (h, e * hd/2 + i).
std::vector<float> permute_rows(const std::vector<float>& w, int64_t heads, int64_t hd, int64_t cols) {
  std::vector<float> out(w.size());
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < hd / 2; ++i)
      for (int64_t e = 0; e < 2; ++e) {
        const int64_t src = h * hd + 2 * i + e, dst = h * hd + e * (hd / 2) + i;
        std::memcpy(&out[static_cast<std::size_t>(dst * cols)], &w[static_cast<std::size_t>(src * cols)],
                    static_cast<std::size_t>(cols) * 4);
      }
  return out;
}

// Writes the HF directory; `split` puts the layers into two files with an index.
std::string export_hf(const std::string& name, DType dtype, bool split) {
  RawLlama2c r(test::shared_path("models/stories260K.bin"));
  const int64_t D = r.dim, H = r.hidden, L = r.layers, hd = r.dim / r.heads, KV = r.kv_heads * hd;
  auto emb = r.take(static_cast<std::size_t>(r.vocab * D));
  auto rms_att = r.take(static_cast<std::size_t>(L * D));
  auto wq = r.take(static_cast<std::size_t>(L * D * D));
  auto wk = r.take(static_cast<std::size_t>(L * KV * D));
  auto wv = r.take(static_cast<std::size_t>(L * KV * D));
  auto wo = r.take(static_cast<std::size_t>(L * D * D));
  auto rms_ffn = r.take(static_cast<std::size_t>(L * D));
  auto w1 = r.take(static_cast<std::size_t>(L * H * D));
  auto w2 = r.take(static_cast<std::size_t>(L * D * H));
  auto w3 = r.take(static_cast<std::size_t>(L * H * D));
  auto norm = r.take(static_cast<std::size_t>(D));
  auto slice = [](const std::vector<float>& v, int64_t l, int64_t n) {
    return std::vector<float>(v.begin() + l * n, v.begin() + (l + 1) * n);
  };
  std::vector<TensorToWrite> a, b;
  a.push_back({"model.embed_tokens.weight", {r.vocab, D}, emb, dtype});
  for (int64_t l = 0; l < L; ++l) {
    auto& dst = split && l >= 2 ? b : a;
    const std::string p = "model.layers." + std::to_string(l) + ".";
    dst.push_back({p + "input_layernorm.weight", {D}, slice(rms_att, l, D), dtype});
    dst.push_back({p + "self_attn.q_proj.weight", {D, D}, permute_rows(slice(wq, l, D * D), r.heads, hd, D), dtype});
    dst.push_back({p + "self_attn.k_proj.weight", {KV, D}, permute_rows(slice(wk, l, KV * D), r.kv_heads, hd, D), dtype});
    dst.push_back({p + "self_attn.v_proj.weight", {KV, D}, slice(wv, l, KV * D), dtype});
    dst.push_back({p + "self_attn.o_proj.weight", {D, D}, slice(wo, l, D * D), dtype});
    dst.push_back({p + "post_attention_layernorm.weight", {D}, slice(rms_ffn, l, D), dtype});
    dst.push_back({p + "mlp.gate_proj.weight", {H, D}, slice(w1, l, H * D), dtype});
    dst.push_back({p + "mlp.down_proj.weight", {D, H}, slice(w2, l, D * H), dtype});
    dst.push_back({p + "mlp.up_proj.weight", {H, D}, slice(w3, l, H * D), dtype});
  }
  (split ? b : a).push_back({"model.norm.weight", {D}, norm, dtype});
  auto dir = test::scratch_dir(name);
  nlohmann::json cfg = {{"model_type", "llama"},     {"hidden_size", D},       {"intermediate_size", H},
                        {"num_hidden_layers", L},     {"num_attention_heads", r.heads},
                        {"num_key_value_heads", r.kv_heads}, {"vocab_size", r.vocab},
                        {"max_position_embeddings", r.seq}, {"rms_norm_eps", 1e-5},
                        {"rope_theta", 10000.0},      {"tie_word_embeddings", true},
                        {"bos_token_id", 1},          {"eos_token_id", 1}};
  test::write_file(dir / "config.json", cfg.dump(2));
  if (split) {
    model::write_safetensors((dir / "model-00001-of-00002.safetensors").string(), a);
    model::write_safetensors((dir / "model-00002-of-00002.safetensors").string(), b);
    nlohmann::json idx;
    for (auto& t : a)
      idx["weight_map"][t.name] = "model-00001-of-00002.safetensors";
    for (auto& t : b)
      idx["weight_map"][t.name] = "model-00002-of-00002.safetensors";
    test::write_file(dir / "model.safetensors.index.json", idx.dump());
  } else {
    model::write_safetensors((dir / "model.safetensors").string(), a);
  }
  return dir.string();
}

void expect_reference_ids(const std::string& model_dir) {
  const auto ref = test::read_json(test::shared_path("models/stories260K.greedy.json"));
  runtime::LocalPipeline pipe(model_dir);
  EXPECT_EQ(pipe.config().rotary, model::RotaryLayout::half);
  for (const auto& c : ref["cases"]) {
    runtime::GenerateRequest req;
    req.prompt_ids = c["prompt_ids"].get<std::vector<int32_t>>();
    req.max_tokens = c["steps"].get<int64_t>() - static_cast<int64_t>(req.prompt_ids.size()) + 1;
    EXPECT_EQ(runtime::generate(pipe, req).ids, c["expected_generated_ids"].get<std::vector<int32_t>>());
  }
}

// The tokenizer.json of a model directory is found without --tokenizer; a
// directory without one has none; a broken one is an error naming the file.
TEST(HfExport, TokenizerJsonInTheModelDirectoryIsFound) {
  STRATA_REQUIRE_SHARED("models/stories260K.bin");
  STRATA_REQUIRE_SHARED("models/qwen-tokenizer.json");
  const auto dir = export_hf("hf_with_tokenizer", DType::f32, false);
  EXPECT_EQ(model::default_tokenizer_for(model::read_config(dir)), nullptr) << "no tokenizer.json yet";
  std::filesystem::copy_file(test::shared_path("models/qwen-tokenizer.json"),
                             std::filesystem::path(dir) / "tokenizer.json");
  auto found = model::default_tokenizer_for(model::read_config(dir));
  ASSERT_NE(found, nullptr);
  auto direct = model::Tokenizer::load(test::shared_path("models/qwen-tokenizer.json"));
  const std::string text = "Hello, world! Once upon a time, 42 dragons.";
  EXPECT_EQ(found->encode(text, false), direct->encode(text, false));
  test::write_file(std::filesystem::path(dir) / "tokenizer.json", "{ not json");
  try {
    model::default_tokenizer_for(model::read_config(dir));
    ADD_FAILURE() << "a broken tokenizer.json must be an error";
  } catch (const model::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer.json"), std::string::npos) << e.what();
  }
}

TEST(HfExport, SingleFileF32GivesReferenceIds) {
  STRATA_REQUIRE_SHARED("models/stories260K.bin");
  expect_reference_ids(export_hf("hf_f32", DType::f32, false));
}

TEST(HfExport, ShardedIndexGivesReferenceIds) {
  STRATA_REQUIRE_SHARED("models/stories260K.bin");
  expect_reference_ids(export_hf("hf_split", DType::f32, true));
}

TEST(HfExport, HalfPrecisionFilesLoadAsRoundedWeights) {
  STRATA_REQUIRE_SHARED("models/stories260K.bin");
  // f16 / bf16 change the weights, so compare logits with the f32 export loosely
  // and check the first greedy tokens, which have wide margins.
  const auto f32 = export_hf("hf_ref32", DType::f32, false);
  for (auto dt : {DType::f16, DType::bf16}) {
    const auto dir = export_hf(std::string("hf_") + model::to_string(dt), dt, false);
    runtime::LocalPipeline a(f32), b(dir);
    auto ca = a.new_caches(), cb = b.new_caches();
    const std::vector<int32_t> prompt = {1, 400, 410};
    auto la = a.step(prompt, ca), lb = b.step(prompt, cb);
    ASSERT_EQ(la.size(), lb.size());
    double max_diff = 0;
    for (std::size_t i = 0; i < la.size(); ++i)
      max_diff = std::max(max_diff, static_cast<double>(std::abs(la[i] - lb[i])));
    EXPECT_LT(max_diff, dt == DType::f16 ? 0.05 : 0.5) << model::to_string(dt);
    EXPECT_GT(max_diff, 0.0) << "half precision should perturb the logits a little";
  }
}

} // namespace
} // namespace strata

namespace strata {
namespace {

// One checkpoint, three formats: llama2.c .bin, Hugging Face safetensors (our
// export) and GGUF f32 (llama.cpp's converter): the same ids, and logits equal
// to float rounding (the HF copy rotates halves, so sums run in another order).
TEST(HfExport, SameCheckpointAsLlama2cHfAndGgufGivesIdenticalIds) {
  STRATA_REQUIRE_SHARED("models/gguf/stories260K-f32.gguf");
  const auto hf = export_hf("hf_vs_gguf", DType::f32, false);
  std::vector<std::unique_ptr<model::Shard>> shards;
  shards.push_back(model::Shard::load(test::shared_path("models/stories260K.bin")));
  shards.push_back(model::Shard::load(hf));
  shards.push_back(model::Shard::load(test::shared_path("models/gguf/stories260K-f32.gguf")));
  std::vector<std::vector<int32_t>> ids(shards.size());
  std::vector<std::vector<float>> first(shards.size());
  for (std::size_t s = 0; s < shards.size(); ++s) {
    auto cache = shards[s]->new_cache();
    std::vector<int32_t> tok{1, 300, 301, 302};
    auto out = shards[s]->forward(tok, model::consecutive_positions(0, 4), cache);
    first[s] = out.logits;
    for (int step = 0; step < 100; ++step) {
      const auto next = static_cast<int32_t>(std::max_element(out.logits.begin(), out.logits.end()) - out.logits.begin());
      ids[s].push_back(next);
      const std::vector<int32_t> one{next};
      out = shards[s]->forward(one, model::consecutive_positions(cache.seq_len(), 1), cache);
    }
  }
  EXPECT_EQ(ids[0], ids[1]);
  EXPECT_EQ(ids[0], ids[2]);
  EXPECT_EQ(first[0], first[2]) << "the GGUF f32 file holds the llama2.c weights bit for bit";
  for (std::size_t i = 0; i < first[0].size(); ++i)
    ASSERT_NEAR(first[0][i], first[1][i], 1e-4);
}

} // namespace
} // namespace strata
