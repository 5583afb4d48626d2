// The stories260K checkpoint, written by this test as a Hugging Face directory
// (safetensors; q/k rows permuted for rotate-half RoPE, as HF's converter does),
// loads through the HF path and gives the reference ids.

#include "model/base/error.hpp"
#include "model/formats/gguf.hpp"
#include "model/formats/safetensors.hpp"
#include "model/transformer/shard.hpp"
#include "model/text/tokenizer.hpp"
#include "runtime/generator.hpp"
#include "tests/support.hpp"

#include <algorithm>
#include <map>
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


// The new architectures as Hugging Face directories: each seeded GGUF of
// ../shared/models/gguf written out the way transformers stores that family
// (its tensor names and config.json fields; Gemma's norms as w where GGUF holds
// 1 + w; Mixtral's q/k in rotate-half order; experts as one matrix each), then
// loaded from the directory: greedy ids equal llama.cpp's for the GGUF file.
std::string hf_from_gguf(const std::string& family) {
  const model::GgufFile g(test::shared_path("models/gguf/" + family + "-rand-f32.gguf"));
  const std::string arch = g.get_string("general.architecture"), a = arch + ".";
  const int64_t D = g.get_int(a + "embedding_length"), L = g.get_int(a + "block_count");
  const int64_t NH = g.get_int(a + "attention.head_count"), NKV = g.get_int(a + "attention.head_count_kv");
  const int64_t hd = g.get_int(a + "attention.key_length");
  const int64_t V = g.tensor("token_embd.weight")->dims[1];
  const bool gemma = arch == "gemma2" || arch == "gemma3", mixtral = arch == "llama";
  auto values = [&](const std::string& name, float add = 0.f) {
    const auto* t = g.tensor(name);
    EXPECT_NE(t, nullptr) << name;
    std::vector<float> v(static_cast<std::size_t>(t->numel()));
    std::memcpy(v.data(), t->data, v.size() * 4);
    for (auto& x : v)
      x += add;
    return v;
  };
  auto norm = [&](const std::string& name) { return values(name, gemma ? -1.f : 0.f); };
  std::vector<TensorToWrite> ts;
  auto put = [&](const std::string& name, std::vector<int64_t> shape, std::vector<float> v) {
    ts.push_back({name, std::move(shape), std::move(v), DType::f32});
  };
  put("model.embed_tokens.weight", {V, D}, values("token_embd.weight"));
  put("model.norm.weight", {D}, norm("output_norm.weight"));
  const bool tied = g.tensor("output.weight") == nullptr;
  if (!tied)
    put("lm_head.weight", {V, D}, values("output.weight"));
  int64_t ffn = 0, experts = 0, expert_ffn = 0;
  for (int64_t l = 0; l < L; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".", p = "model.layers." + std::to_string(l) + ".";
    put(p + "input_layernorm.weight", {D}, norm(b + "attn_norm.weight"));
    if (arch == "phi3") {
      const auto* t = g.tensor(b + "attn_qkv.weight");
      put(p + "self_attn.qkv_proj.weight", {t->dims[1], D}, values(b + "attn_qkv.weight"));
    } else {
      auto q = values(b + "attn_q.weight"), k = values(b + "attn_k.weight");
      if (mixtral) { // GGUF llama: adjacent pairs; transformers: rotate-half
        q = permute_rows(q, NH, hd, D);
        k = permute_rows(k, NKV, hd, D);
      }
      put(p + "self_attn.q_proj.weight", {NH * hd, D}, q);
      put(p + "self_attn.k_proj.weight", {NKV * hd, D}, k);
      put(p + "self_attn.v_proj.weight", {NKV * hd, D}, values(b + "attn_v.weight"));
    }
    put(p + "self_attn.o_proj.weight", {D, NH * hd}, values(b + "attn_output.weight"));
    if (g.tensor(b + "attn_q_norm.weight")) {
      put(p + "self_attn.q_norm.weight", {hd}, norm(b + "attn_q_norm.weight"));
      put(p + "self_attn.k_norm.weight", {hd}, norm(b + "attn_k_norm.weight"));
    }
    if (gemma) {
      put(p + "pre_feedforward_layernorm.weight", {D}, norm(b + "ffn_norm.weight"));
      put(p + "post_attention_layernorm.weight", {D}, norm(b + "post_attention_norm.weight"));
      put(p + "post_feedforward_layernorm.weight", {D}, norm(b + "post_ffw_norm.weight"));
    } else {
      put(p + "post_attention_layernorm.weight", {D}, norm(b + "ffn_norm.weight"));
    }
    if (const auto* router = g.tensor(b + "ffn_gate_inp.weight")) {
      experts = router->dims[1];
      expert_ffn = g.tensor(b + "ffn_gate_exps.weight")->dims[1];
      put(p + (mixtral ? "block_sparse_moe.gate.weight" : "mlp.gate.weight"), {experts, D}, values(b + "ffn_gate_inp.weight"));
      const auto gate = values(b + "ffn_gate_exps.weight"), up = values(b + "ffn_up_exps.weight"),
                 down = values(b + "ffn_down_exps.weight");
      const auto n = static_cast<std::size_t>(expert_ffn * D);
      for (int64_t e = 0; e < experts; ++e) {
        const std::string x = p + (mixtral ? "block_sparse_moe.experts." : "mlp.experts.") + std::to_string(e) + ".";
        auto part = [&](const std::vector<float>& v) {
          return std::vector<float>(v.begin() + static_cast<std::ptrdiff_t>(e * n),
                                    v.begin() + static_cast<std::ptrdiff_t>((e + 1) * n));
        };
        put(x + (mixtral ? "w1" : "gate_proj") + ".weight", {expert_ffn, D}, part(gate));
        put(x + (mixtral ? "w3" : "up_proj") + ".weight", {expert_ffn, D}, part(up));
        put(x + (mixtral ? "w2" : "down_proj") + ".weight", {D, expert_ffn}, part(down));
      }
    } else if (arch == "phi3") {
      ffn = g.tensor(b + "ffn_down.weight")->dims[0];
      put(p + "mlp.gate_up_proj.weight", {2 * ffn, D}, values(b + "ffn_up.weight"));
      put(p + "mlp.down_proj.weight", {D, ffn}, values(b + "ffn_down.weight"));
    } else {
      ffn = g.tensor(b + "ffn_gate.weight")->dims[1];
      put(p + "mlp.gate_proj.weight", {ffn, D}, values(b + "ffn_gate.weight"));
      put(p + "mlp.up_proj.weight", {ffn, D}, values(b + "ffn_up.weight"));
      put(p + "mlp.down_proj.weight", {D, ffn}, values(b + "ffn_down.weight"));
    }
  }
  static const std::map<std::string, std::string> model_type = {
    {"qwen3", "qwen3"}, {"qwen3moe", "qwen3_moe"}, {"llama", "mixtral"},
    {"gemma2", "gemma2"}, {"gemma3", "gemma3_text"}, {"phi3", "phi3"}};
  nlohmann::json cfg = {{"model_type", model_type.at(arch)},
                        {"hidden_size", D},
                        {"intermediate_size", experts > 0 && mixtral ? expert_ffn : ffn > 0 ? ffn : 4 * D},
                        {"num_hidden_layers", L},
                        {"num_attention_heads", NH},
                        {"num_key_value_heads", NKV},
                        {"head_dim", hd},
                        {"vocab_size", V},
                        {"max_position_embeddings", g.get_int(a + "context_length")},
                        {"rms_norm_eps", *g.opt_float(a + "attention.layer_norm_rms_epsilon")},
                        {"rope_theta", g.opt_float(a + "rope.freq_base").value_or(10000.0)},
                        {"tie_word_embeddings", tied},
                        {"bos_token_id", g.opt_int("tokenizer.ggml.bos_token_id").value_or(1)},
                        {"eos_token_id", g.opt_int("tokenizer.ggml.eos_token_id").value_or(2)}};
  if (experts > 0) {
    if (mixtral) {
      cfg["num_local_experts"] = experts;
    } else {
      cfg["num_experts"] = experts;
      cfg["moe_intermediate_size"] = expert_ffn;
      cfg["norm_topk_prob"] = true;
    }
    cfg["num_experts_per_tok"] = g.get_int(a + "expert_used_count");
  }
  if (gemma) {
    cfg["hidden_activation"] = "gelu_pytorch_tanh";
    cfg["query_pre_attn_scalar"] = hd;
    cfg["sliding_window"] = g.get_int(a + "attention.sliding_window");
    if (auto c = g.opt_float(a + "attn_logit_softcapping"))
      cfg["attn_logit_softcapping"] = *c;
    if (auto c = g.opt_float(a + "final_logit_softcapping"))
      cfg["final_logit_softcapping"] = *c;
    if (arch == "gemma3") {
      cfg["sliding_window_pattern"] = g.get_int(a + "attention.sliding_window_pattern");
      cfg["rope_local_base_freq"] = *g.opt_float(a + "rope.freq_base_swa");
    }
  }
  auto dir = test::scratch_dir("hf_" + family);
  test::write_file(dir / "config.json", cfg.dump(2));
  model::write_safetensors((dir / "model.safetensors").string(), ts);
  return dir.string();
}

class HfArchitecture : public ::testing::TestWithParam<const char*> {};

TEST_P(HfArchitecture, DirectoryWrittenFromTheGgufGivesLlamaCppIds) {
  const std::string family = GetParam();
  STRATA_REQUIRE_SHARED("models/gguf/" + family + "-rand-f32.gguf");
  const auto dir = hf_from_gguf(family);
  auto shard = model::Shard::load(dir);
  const auto gguf = model::Shard::load(test::shared_path("models/gguf/" + family + "-rand-f32.gguf"));
  EXPECT_EQ(shard->config().describe(), gguf->config().describe());
  const auto ref = test::read_json(test::shared_path("models/gguf/" + family + "-rand.gguf-ref.json"));
  for (const auto& c : ref["files"][family + "-rand-f32.gguf"]) {
    const auto prompt = c["prompt_ids"].get<std::vector<int32_t>>();
    const auto want = c["generated_ids"].get<std::vector<int32_t>>();
    auto cache = shard->new_cache();
    auto out = shard->forward(prompt, model::consecutive_positions(0, static_cast<int64_t>(prompt.size())), cache);
    std::vector<int32_t> got;
    while (got.size() < want.size()) {
      const auto next = static_cast<int32_t>(std::max_element(out.logits.begin(), out.logits.end()) - out.logits.begin());
      got.push_back(next);
      out = shard->forward(std::vector<int32_t>{next}, model::consecutive_positions(cache.seq_len(), 1), cache);
    }
    EXPECT_EQ(got, want) << family << " prompt of " << prompt.size();
  }
}

INSTANTIATE_TEST_SUITE_P(Families, HfArchitecture,
                         ::testing::Values("qwen3", "qwen3moe", "mixtral", "gemma2", "gemma3", "phi3"),
                         [](const auto& info) { return std::string(info.param); });

TEST(HfExport, ConfigsOfOtherFamiliesAreRefusedNamingWhat) {
  auto dir = test::scratch_dir("hf_refused");
  auto refused = [&](nlohmann::json cfg, const std::string& what) {
    test::write_file(dir / "config.json", cfg.dump());
    EXPECT_MODEL_ERROR(model::read_config(dir.string()), model::errc::unsupported, what);
  };
  nlohmann::json base = {{"hidden_size", 64}, {"intermediate_size", 128}, {"num_hidden_layers", 2},
                         {"num_attention_heads", 4}, {"vocab_size", 300}};
  auto with = [&](nlohmann::json extra) {
    auto c = base;
    c.update(extra);
    return c;
  };
  refused(with({{"model_type", "gpt_neox"}}), "gpt_neox");
  refused(with({{"model_type", "gemma3"}}), "gemma3_text");
  refused(with({{"model_type", "qwen3_moe"}, {"num_experts", 4}, {"num_experts_per_tok", 2},
                {"moe_intermediate_size", 32}, {"norm_topk_prob", false}}),
          "norm_topk_prob");
  refused(with({{"model_type", "qwen3_moe"}, {"num_experts", 4}, {"num_experts_per_tok", 2},
                {"moe_intermediate_size", 32}, {"norm_topk_prob", true}, {"mlp_only_layers", {1}}}),
          "mlp_only_layers");
  refused(with({{"model_type", "gemma2"}, {"hidden_activation", "gelu"}}), "hidden_activation");
  refused(with({{"model_type", "gemma3_text"}, {"sliding_window", 16}, {"sliding_window_pattern", 2},
                {"layer_types", {"full_attention", "sliding_attention"}}}),
          "layer_types");
}

} // namespace
} // namespace strata
