// TensorSource over a GGUF file (llama and Mixtral-style llama, qwen2, qwen3,
// qwen3moe, gemma2, gemma3, phi3): the model
// configuration from the file's metadata, matrices served in place from the
// mapped file in their own types.

#include "model/base/error.hpp"
#include "model/formats/gguf.hpp"
#include "model/base/mapped_file.hpp"
#include "model/formats/source.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>

namespace strata::model::detail {

namespace {

// llama.cpp's llama_ftype values for the files people have.
std::string file_type_name(int64_t ft) {
  static const std::map<int64_t, std::string> names = {
    {0, "f32"},   {1, "f16"},     {2, "q4_0"},    {3, "q4_1"},    {7, "q8_0"},   {8, "q5_0"},   {9, "q5_1"},
    {10, "q2_K"}, {11, "q3_K_S"}, {12, "q3_K_M"}, {13, "q3_K_L"}, {14, "q4_K_S"}, {15, "q4_K_M"}, {16, "q5_K_S"},
    {17, "q5_K_M"}, {18, "q6_K"}, {21, "q2_K_S"}, {25, "iq4_nl"}, {30, "iq4_xs"}, {32, "bf16"},
  };
  auto it = names.find(ft);
  return it == names.end() ? "type" + std::to_string(ft) : it->second;
}

class GgufSource final : public TensorSource {
public:
  explicit GgufSource(const std::string& path) : f_(path) {
    const std::string where = "GGUF file '" + path + "'";
    const std::string arch = f_.get_string("general.architecture");
    static const std::set<std::string> known = {"llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3"};
    if (!known.count(arch))
      throw Error(errc::unsupported, where + ": architecture '" + arch +
                                       "' is not supported (llama and Mixtral-style llama, qwen2, qwen3, qwen3moe, "
                                       "gemma2, gemma3, phi3)");
    const std::string a = arch + ".";
    cfg_.architecture = arch;
    cfg_.identity = std::filesystem::absolute(path).lexically_normal().string();
    cfg_.dim = f_.get_int(a + "embedding_length");
    // Experts: Mixtral (llama with expert_count; an expert is feed_forward_length
    // wide) and qwen3moe (expert_feed_forward_length).
    cfg_.n_experts = f_.opt_int(a + "expert_count").value_or(0);
    if (cfg_.n_experts > 0) {
      if (arch != "llama" && arch != "qwen3moe")
        throw Error(errc::unsupported, where + ": experts in architecture '" + arch + "' are not supported");
      if (auto shared = f_.opt_int(a + "expert_shared_count"); shared && *shared > 0)
        throw Error(errc::unsupported, where + ": shared experts are not supported");
      if (auto gating = f_.opt_int(a + "expert_gating_func"); gating && *gating != 1) // llama.cpp: 1 softmax, 2 sigmoid
        throw Error(errc::unsupported, where + ": " + a + "expert_gating_func " + std::to_string(*gating) +
                                         " is not supported (softmax, 1)");
      cfg_.n_experts_used = f_.get_int(a + "expert_used_count");
      cfg_.expert_hidden_dim = f_.opt_int(a + "expert_feed_forward_length").value_or(0);
      if (cfg_.expert_hidden_dim == 0)
        cfg_.expert_hidden_dim = f_.get_int(a + "feed_forward_length");
    } else if (arch == "qwen3moe") {
      throw Error(errc::bad_config, where + ": qwen3moe without " + a + "expert_count");
    }
    cfg_.hidden_dim = f_.opt_int(a + "feed_forward_length").value_or(cfg_.expert_hidden_dim);
    cfg_.n_layers = f_.get_int(a + "block_count");
    cfg_.n_heads = f_.get_int(a + "attention.head_count");
    cfg_.n_kv_heads = f_.opt_int(a + "attention.head_count_kv").value_or(cfg_.n_heads);
    cfg_.head_dim = f_.opt_int(a + "attention.key_length").value_or(cfg_.n_heads > 0 ? cfg_.dim / cfg_.n_heads : 0);
    if (auto vl = f_.opt_int(a + "attention.value_length"); vl && *vl != cfg_.head_dim)
      throw Error(errc::unsupported, where + ": " + a + "attention.value_length " + std::to_string(*vl) +
                                       " differs from the key length " + std::to_string(cfg_.head_dim));
    if (auto rd = f_.opt_int(a + "rope.dimension_count"); rd && *rd != cfg_.head_dim)
      throw Error(errc::unsupported, where + ": " + a + "rope.dimension_count " + std::to_string(*rd) +
                                       " rotates part of a head of " + std::to_string(cfg_.head_dim) +
                                       " (partial rotary is not supported)");
    if (auto st = f_.opt_string(a + "rope.scaling.type"); st && *st != "none") {
      if (*st != "linear")
        throw Error(errc::unsupported, where + ": " + a + "rope.scaling.type '" + *st + "' is not supported (linear)");
      cfg_.rope_scaling.type = "linear";
      cfg_.rope_scaling.factor = f_.opt_float(a + "rope.scaling.factor").value_or(1.0);
    }
    cfg_.max_seq_len = f_.get_int(a + "context_length");
    // Sliding windows: real windowed attention on the local layers (Gemma: every
    // layer but each P-th; llama, e.g. Mistral v0.1: every layer).
    if (auto sw = f_.opt_int(a + "attention.sliding_window"); sw && *sw > 0) {
      cfg_.sliding_window = *sw;
      cfg_.swa_pattern =
        f_.opt_int(a + "attention.sliding_window_pattern").value_or(arch == "gemma2" ? 2 : arch == "gemma3" ? 6 : 0);
    }
    // llama3-style scaling as llama.cpp stores it: a frequency factor per pair.
    if (const GgufTensor* rf = f_.tensor("rope_freqs.weight")) {
      if (rf->type != WType::f32 || rf->numel() != cfg_.head_dim / 2)
        throw Error(errc::corrupt, where + ": rope_freqs.weight must hold " + std::to_string(cfg_.head_dim / 2) +
                                     " f32 values");
      MappedFile m(path, rf->file_offset, rf->nbytes);
      cfg_.rope_scaling.freq_factors.resize(static_cast<std::size_t>(rf->numel()));
      std::memcpy(cfg_.rope_scaling.freq_factors.data(), m.data(), rf->nbytes);
    }
    cfg_.rope_theta = f_.opt_float(a + "rope.freq_base").value_or(10000.0);
    cfg_.norm_eps = f_.opt_float(a + "attention.layer_norm_rms_epsilon").value_or(1e-5);
    // llama: Meta's interleaved pairs (llama.cpp's converter permutes Hugging
    // Face q/k back to them); the others: rotate-half (llama.cpp's NEOX rope).
    cfg_.rotary = arch == "llama" ? RotaryLayout::interleaved : RotaryLayout::half;
    cfg_.attention_bias = f_.tensor("blk.0.attn_q.bias") != nullptr;
    cfg_.qk_norm = f_.tensor("blk.0.attn_q_norm.weight") != nullptr;
    if (arch == "gemma2" || arch == "gemma3") {
      // Gemma: the embedding times sqrt(dim) (in float, as llama.cpp), norms
      // after attention and the FFN too (the GGUF's norm weights already hold
      // Gemma's 1 + w), GELU-gated FFN, q scaled by 1 / sqrt(key length).
      cfg_.embed_scale = static_cast<double>(std::sqrt(static_cast<float>(cfg_.dim)));
      cfg_.sandwich_norms = true;
      cfg_.ffn_act = FfnActivation::gelu_tanh;
      cfg_.query_scale = 1.0 / std::sqrt(static_cast<double>(cfg_.head_dim));
      cfg_.attn_softcap = f_.opt_float(a + "attn_logit_softcapping").value_or(0.0);
      cfg_.final_softcap = f_.opt_float(a + "final_logit_softcapping").value_or(0.0);
      if (arch == "gemma3")
        cfg_.rope_theta_local = f_.opt_float(a + "rope.freq_base_swa").value_or(10000.0);
    }
    const GgufTensor* emb = f_.tensor("token_embd.weight");
    if (!emb)
      throw Error(errc::missing_tensor, where + " has no tensor 'token_embd.weight'");
    cfg_.vocab_size = f_.opt_int(a + "vocab_size").value_or(emb->dims.size() == 2 ? emb->dims[1] : 0);
    cfg_.tied_embeddings = f_.tensor("output.weight") == nullptr;
    cfg_.bos_id = static_cast<int32_t>(f_.opt_int("tokenizer.ggml.bos_token_id").value_or(-1));
    for (const char* k : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"})
      if (auto id = f_.opt_int(k); id && std::find(cfg_.eos_ids.begin(), cfg_.eos_ids.end(), *id) == cfg_.eos_ids.end())
        cfg_.eos_ids.push_back(static_cast<int32_t>(*id));
    cfg_.dtype = "gguf:" + file_type_name(f_.opt_int("general.file_type").value_or(-1));
    try {
      cfg_.validate();
    } catch (const Error& e) {
      throw Error(errc::bad_config, where + ": " + e.message());
    }
    // From here on, only the tensors a shard asks for are mapped.
    f_.release_mapping();
  }

  const ModelConfig& config() const override { return cfg_; }
  bool native_types() const override { return true; }
  bool has(const std::string& name) const override {
    // ffn_up is gate | up fused only in phi3 files (elsewhere it is the up projection alone).
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".w13") == 0 && cfg_.architecture != "phi3")
      return false;
    return f_.tensor(gguf_name(name)) != nullptr;
  }

  std::vector<WMatrix> load_experts(const std::string& name, int64_t n, int64_t rows, int64_t cols) override {
    const std::string g = gguf_name(name);
    const GgufTensor* t = f_.tensor(g);
    if (!t)
      throw Error(errc::missing_tensor, "GGUF file '" + f_.path() + "' has no tensor '" + g + "'");
    if (t->dims != std::vector<int64_t>{cols, rows, n})
      throw Error(errc::corrupt, "GGUF file '" + f_.path() + "': tensor '" + g + "' is not " + std::to_string(n) +
                                   " experts of (" + std::to_string(rows) + ", " + std::to_string(cols) + ")");
    if (!t->type)
      throw Error(errc::unsupported, "GGUF file '" + f_.path() + "': tensor '" + g + "' has type " +
                                       ggml_type_name(t->ggml_type) + ", which strata does not implement");
    auto map = map_tensor(*t);
    std::vector<WMatrix> out(static_cast<std::size_t>(n));
    for (int64_t e = 0; e < n; ++e) {
      WMatrix& m = out[static_cast<std::size_t>(e)];
      m.type = *t->type;
      m.rows = rows;
      m.cols = cols;
      m.data = map->data() + static_cast<std::size_t>(e) * static_cast<std::size_t>(rows) * m.row_bytes();
      m.keep = map;
    }
    return out;
  }

  std::vector<float> load(const std::string& name, const std::vector<int64_t>& shape) override {
    const GgufTensor& t = find(name, shape);
    std::vector<float> out(static_cast<std::size_t>(t.numel()));
    auto map = map_tensor(t);
    dequantize(*t.type, map->data(), out.data(), t.numel());
    return out;
  }

  WMatrix load_matrix(const std::string& name, int64_t rows, int64_t cols) override {
    const GgufTensor& t = find(name, {rows, cols});
    auto map = map_tensor(t);
    WMatrix m;
    m.type = *t.type;
    m.rows = rows;
    m.cols = cols;
    m.data = map->data();
    m.keep = std::move(map);
    return m;
  }

private:
  std::string gguf_name(const std::string& name) const {
    if (name == "embed")
      return "token_embd.weight";
    if (name == "cls")
      return cfg_.tied_embeddings ? "token_embd.weight" : "output.weight";
    if (name == "norm")
      return "output_norm.weight";
    static const std::map<std::string, std::string> parts = {
      {"attn_norm", "attn_norm.weight"}, {"ffn_norm", "ffn_norm.weight"}, {"wq", "attn_q.weight"},
      {"wk", "attn_k.weight"},           {"wv", "attn_v.weight"},         {"wo", "attn_output.weight"},
      {"bq", "attn_q.bias"},             {"bk", "attn_k.bias"},           {"bv", "attn_v.bias"},
      {"w1", "ffn_gate.weight"},         {"w3", "ffn_up.weight"},         {"w2", "ffn_down.weight"},
      {"wqkv", "attn_qkv.weight"},       {"w13", "ffn_up.weight"}, // phi3: fused (ffn_up = gate | up)
      {"q_norm", "attn_q_norm.weight"},  {"k_norm", "attn_k_norm.weight"},
      {"post_attn_norm", "post_attention_norm.weight"}, {"post_ffn_norm", "post_ffw_norm.weight"},
      {"router", "ffn_gate_inp.weight"}, {"experts_w1", "ffn_gate_exps.weight"},
      {"experts_w3", "ffn_up_exps.weight"}, {"experts_w2", "ffn_down_exps.weight"},
    };
    const auto dot = name.find('.');
    return "blk." + name.substr(1, dot - 1) + "." + parts.at(name.substr(dot + 1));
  }

  // The tensor behind canonical `name`, checked against `shape` (rows, cols)
  // and for a type strata keeps resident.
  const GgufTensor& find(const std::string& name, const std::vector<int64_t>& shape) const {
    const std::string g = gguf_name(name);
    const GgufTensor* t = f_.tensor(g);
    if (!t)
      throw Error(errc::missing_tensor, "GGUF file '" + f_.path() + "' has no tensor '" + g + "'");
    std::vector<int64_t> want(shape.rbegin(), shape.rend());
    if (t->dims != want) {
      std::string got, exp;
      for (auto d : t->dims)
        got += (got.empty() ? "" : ", ") + std::to_string(d);
      for (auto d : want)
        exp += (exp.empty() ? "" : ", ") + std::to_string(d);
      throw Error(errc::corrupt, "GGUF file '" + f_.path() + "': tensor '" + g + "' has dims [" + got + "], expected [" +
                                   exp + "] for this model");
    }
    if (!t->type)
      throw Error(errc::unsupported, "GGUF file '" + f_.path() + "': tensor '" + g + "' has type " +
                                       ggml_type_name(t->ggml_type) +
                                       ", which strata does not implement (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_K, q3_K, q4_K, q5_K, "
                                       "q6_K, iq4_nl, iq4_xs)");
    return *t;
  }

  // The pages of one tensor, mapped on its own (shared when asked again, e.g. a
  // tied embedding and classifier).
  std::shared_ptr<const MappedFile> map_tensor(const GgufTensor& t) {
    std::lock_guard<std::mutex> lock(maps_mutex_); // layers load in parallel
    auto& weak = maps_[t.name];
    if (auto m = weak.lock())
      return m;
    auto m = std::make_shared<const MappedFile>(f_.path(), t.file_offset, t.nbytes);
    weak = m;
    return m;
  }

  GgufFile f_;
  ModelConfig cfg_;
  std::mutex maps_mutex_;
  std::map<std::string, std::weak_ptr<const MappedFile>> maps_;
};

} // namespace

std::unique_ptr<TensorSource> open_gguf(const std::string& path) {
  return std::make_unique<GgufSource>(path);
}

} // namespace strata::model::detail
