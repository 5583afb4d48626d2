// Hugging Face model directories: config.json (+ generation_config.json) and
// model.safetensors or a sharded index, f32/f16/bf16 converted to f32 on load.

#include "model/base/error.hpp"
#include "model/formats/safetensors.hpp"
#include "model/formats/source.hpp"

#include <nlohmann/json.hpp>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <unordered_map>

namespace strata::model::detail {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json read_json_file(const fs::path& p) {
  std::ifstream in(p);
  if (!in)
    throw Error(errc::io, "cannot open '" + p.string() + "'");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw Error(errc::bad_format, "'" + p.string() + "' is not valid JSON: " + e.what());
  }
}

// Adds the ids of `c`'s "eos_token_id" (an integer or a list; null or absent:
// none) to `out`, skipping ids already there.
void add_eos_ids(const json& c, const std::string& where, std::vector<int32_t>& out) {
  if (!c.contains("eos_token_id") || c["eos_token_id"].is_null())
    return;
  const auto& e = c["eos_token_id"];
  std::vector<int32_t> ids;
  if (e.is_number_integer())
    ids.push_back(e.get<int32_t>());
  else if (e.is_array())
    for (auto& x : e) {
      if (!x.is_number_integer())
        throw Error(errc::bad_config, where + ": eos_token_id list holds a non-integer");
      ids.push_back(x.get<int32_t>());
    }
  else
    throw Error(errc::bad_config, where + ": eos_token_id must be an integer or a list");
  for (auto id : ids)
    if (std::find(out.begin(), out.end(), id) == out.end())
      out.push_back(id);
}

// Hugging Face's rope_scaling object ("rope_type" or the older "type").
RopeScaling parse_rope_scaling(const json& r, const std::string& where, int64_t max_position) {
  if (!r.is_object())
    throw Error(errc::bad_config, where + ": rope_scaling is not an object");
  const std::string type = r.contains("rope_type") ? r.value("rope_type", std::string{}) : r.value("type", std::string{});
  auto num = [&](const char* key, std::optional<double> dflt) -> double {
    if (r.contains(key) && !r[key].is_null()) {
      if (!r[key].is_number())
        throw Error(errc::bad_config, where + ": rope_scaling." + key + " is not a number");
      return r[key].get<double>();
    }
    if (!dflt)
      throw Error(errc::bad_config, where + ": rope_scaling type '" + type + "' needs " + key);
    return *dflt;
  };
  RopeScaling rs;
  if (type == "default" || type.empty())
    return rs;
  if (type == "linear") {
    rs.type = type;
    rs.factor = num("factor", std::nullopt);
  } else if (type == "llama3") {
    rs.type = type;
    rs.factor = num("factor", std::nullopt);
    rs.low_freq_factor = num("low_freq_factor", std::nullopt);
    rs.high_freq_factor = num("high_freq_factor", std::nullopt);
    rs.original_max_position = static_cast<int64_t>(num("original_max_position_embeddings", std::nullopt));
  } else if (type == "yarn") {
    rs.type = type;
    rs.factor = num("factor", std::nullopt);
    rs.original_max_position = static_cast<int64_t>(num("original_max_position_embeddings", double(max_position)));
    rs.beta_fast = num("beta_fast", 32.0);
    rs.beta_slow = num("beta_slow", 1.0);
    rs.attention_factor = num("attention_factor", 0.0);
    rs.mscale = num("mscale", 0.0);
    rs.mscale_all_dim = num("mscale_all_dim", 0.0);
    if (r.contains("truncate") && r["truncate"].is_boolean())
      rs.truncate = r["truncate"].get<bool>();
  } else if (type == "dynamic") {
    // Dynamic NTK: transformers rescales the base only once a sequence grows
    // past the original context, and then only for the positions computed from
    // that step on (cached keys keep their old rotation), so a token's rotation
    // would depend on how the sequence was batched, which a recovery or a
    // shared prefix cannot repeat. Up to the original context the math is
    // exactly the unscaled one: the context is held there.
    rs.type = type;
    rs.factor = num("factor", std::nullopt);
    rs.original_max_position = static_cast<int64_t>(num("original_max_position_embeddings", double(max_position)));
  } else {
    throw Error(errc::unsupported, where + ": rope_scaling type '" + type +
                                     "' is not supported (linear, dynamic, llama3, yarn)");
  }
  return rs;
}

class HfSource final : public TensorSource {
public:
  explicit HfSource(const std::string& dir) : dir_(dir) {
    const auto cfg_path = dir_ / "config.json";
    const json c = read_json_file(cfg_path);
    const std::string where = "'" + cfg_path.string() + "'";
    auto get_int = [&](const char* key, std::optional<int64_t> dflt = std::nullopt) -> int64_t {
      if (c.contains(key) && !c[key].is_null()) {
        if (!c[key].is_number_integer())
          throw Error(errc::bad_config, where + ": field " + key + " is not an integer");
        return c[key].get<int64_t>();
      }
      if (dflt)
        return *dflt;
      throw Error(errc::bad_config, where + ": field " + key + " is missing");
    };
    auto get_num = [&](const char* key, double dflt) -> double {
      if (c.contains(key) && !c[key].is_null()) {
        if (!c[key].is_number())
          throw Error(errc::bad_config, where + ": field " + key + " is not a number");
        return c[key].get<double>();
      }
      return dflt;
    };
    auto get_bool = [&](const char* key, bool dflt) -> bool {
      if (c.contains(key) && !c[key].is_null()) {
        if (!c[key].is_boolean())
          throw Error(errc::bad_config, where + ": field " + key + " is not a boolean");
        return c[key].get<bool>();
      }
      return dflt;
    };
    const std::string mt = c.value("model_type", std::string{});
    mt_ = mt;
    static const std::map<std::string, std::string> families = {
      {"llama", "llama"}, {"mistral", "llama"},    {"mixtral", "llama"},   {"qwen2", "qwen2"},      {"qwen3", "qwen3"},
      {"qwen3_moe", "qwen3moe"}, {"gemma2", "gemma2"}, {"gemma3_text", "gemma3"}, {"phi3", "phi3"}};
    if (mt == "gemma3")
      throw Error(errc::unsupported, where + ": model_type 'gemma3' is the multimodal checkpoint; its text model "
                                               "(model_type gemma3_text, or a GGUF file) is supported");
    const auto fam = families.find(mt);
    if (fam == families.end())
      throw Error(errc::unsupported, where + ": model_type '" + mt +
                                       "' is not supported (llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, gemma2, "
                                       "gemma3_text, phi3)");
    cfg_.architecture = fam->second;
    gemma_ = mt == "gemma2" || mt == "gemma3_text";
    if (c.contains("rope_scaling") && !c["rope_scaling"].is_null())
      cfg_.rope_scaling = parse_rope_scaling(c["rope_scaling"], where, get_int("max_position_embeddings", 2048));
    // Fields that change the math: refused unless they say what strata computes.
    const std::string act_key = c.contains("hidden_activation") ? "hidden_activation" : "hidden_act";
    const std::string want_act = gemma_ ? "gelu_pytorch_tanh" : "silu";
    if (c.contains(act_key) && !c[act_key].is_null() && c[act_key] != want_act)
      throw Error(errc::unsupported, where + ": " + act_key + " " + c[act_key].dump() + " is not supported (" +
                                       want_act + ")");
    if (get_bool("mlp_bias", false))
      throw Error(errc::unsupported, where + ": mlp_bias is not supported");
    if (get_num("partial_rotary_factor", 1.0) != 1.0)
      throw Error(errc::unsupported, where + ": partial_rotary_factor is not supported (the whole head rotates)");
    cfg_.identity = fs::absolute(dir_).lexically_normal().string();
    cfg_.dim = get_int("hidden_size");
    cfg_.hidden_dim = get_int("intermediate_size");
    cfg_.n_layers = get_int("num_hidden_layers");
    cfg_.n_heads = get_int("num_attention_heads");
    cfg_.n_kv_heads = get_int("num_key_value_heads", cfg_.n_heads);
    cfg_.head_dim = get_int("head_dim", cfg_.n_heads > 0 ? cfg_.dim / cfg_.n_heads : 0);
    cfg_.vocab_size = get_int("vocab_size");
    cfg_.max_seq_len = get_int("max_position_embeddings", 2048);
    if (cfg_.rope_scaling.type == "dynamic") // see parse_rope_scaling
      cfg_.max_seq_len = std::min(cfg_.max_seq_len, cfg_.rope_scaling.original_max_position);
    // A sliding window: Mistral v0.1's (4096) is real windowed attention on
    // every layer. Qwen2 windows only when use_sliding_window is set, and then
    // only layers from max_window_layers on (as transformers' Qwen2 reads its
    // config): such a model is held to its window, where windowed and full
    // attention are the same computation (Qwen2.5's shipped configs have none).
    const bool qwen = mt == "qwen2" || mt == "qwen3" || mt == "qwen3_moe";
    const bool windowed = !qwen || (get_bool("use_sliding_window", false) &&
                                    get_int("max_window_layers", cfg_.n_layers) < cfg_.n_layers);
    if (windowed && c.contains("sliding_window") && !c["sliding_window"].is_null()) {
      const int64_t w = get_int("sliding_window");
      if (w <= 0)
        throw Error(errc::bad_config, where + ": sliding_window must be positive");
      if (qwen)
        cfg_.max_seq_len = std::min(cfg_.max_seq_len, w);
      else
        cfg_.sliding_window = w; // every layer local (swa_pattern 0) unless the family says otherwise below
    } else if (qwen && get_bool("use_sliding_window", false) && windowed) {
      throw Error(errc::bad_config, where + ": use_sliding_window without a sliding_window size");
    }
    cfg_.rope_theta = get_num("rope_theta", 10000.0);
    cfg_.rotary = RotaryLayout::half;
    cfg_.norm_eps = get_num("rms_norm_eps", 1e-6);
    cfg_.tied_embeddings = get_bool("tie_word_embeddings", false);
    cfg_.attention_bias = cfg_.architecture == "qwen2" ? true : get_bool("attention_bias", false);
    family_fields(c, where, get_int, get_num, get_bool);
    cfg_.bos_id = static_cast<int32_t>(get_int("bos_token_id", -1));
    add_eos_ids(c, where, cfg_.eos_ids);
    // The stop ids a model ships for generation (e.g. Llama 3 Instruct's <|eot_id|>)
    // live in generation_config.json: added to config.json's.
    const auto gen_path = dir_ / "generation_config.json";
    if (fs::exists(gen_path)) {
      const json g = read_json_file(gen_path);
      const std::string gen_where = "'" + gen_path.string() + "'";
      if (!g.is_object())
        throw Error(errc::bad_config, gen_where + ": not a JSON object");
      add_eos_ids(g, gen_where, cfg_.eos_ids);
    }
    try {
      cfg_.validate();
    } catch (const Error& e) {
      throw Error(errc::bad_config, where + ": " + e.message());
    }
    // Tensor files: a single model.safetensors or an index of shards.
    const auto single = dir_ / "model.safetensors";
    const auto index = dir_ / "model.safetensors.index.json";
    if (fs::exists(index)) {
      const json idx = read_json_file(index);
      if (!idx.contains("weight_map") || !idx["weight_map"].is_object())
        throw Error(errc::bad_format, "'" + index.string() + "' has no weight_map object");
      for (auto& [name, file] : idx["weight_map"].items()) {
        if (!file.is_string())
          throw Error(errc::bad_format, "'" + index.string() + "': weight_map entry '" + name + "' is not a string");
        const auto f = file.get<std::string>();
        if (f.find('/') != std::string::npos || f == "..")
          throw Error(errc::bad_format, "'" + index.string() + "': weight_map file '" + f + "' leaves the directory");
        weight_map_[name] = f;
      }
    } else if (!fs::exists(single)) {
      throw Error(errc::io, "HF model directory '" + dir + "' has neither model.safetensors nor model.safetensors.index.json");
    }
  }

  const ModelConfig& config() const override { return cfg_; }

  bool has(const std::string& name) const override {
    auto l = split_layer_name(name);
    return l && mt_ == "phi3" && (l->second == "wqkv" || l->second == "w13");
  }

  std::vector<WMatrix> load_experts(const std::string& name, int64_t n, int64_t rows, int64_t cols) override {
    std::vector<WMatrix> out;
    for (int64_t e = 0; e < n; ++e) {
      out.push_back(owned_f32(load(name + "#" + std::to_string(e), {rows, cols}), rows, cols));
    }
    return out;
  }

  std::vector<float> load(const std::string& name, const std::vector<int64_t>& shape) override {
    const std::string hf = hf_name(name);
    const SafetensorsFile& f = file_for(hf);
    const TensorView& v = f.at(hf);
    if (v.shape != shape)
      throw Error(errc::corrupt, "safetensors file '" + f.path() + "': tensor '" + hf + "' has shape " +
                                   shape_str(v.shape) + ", expected " + shape_str(shape));
    const int64_t n = v.numel();
    std::vector<float> out(static_cast<std::size_t>(n));
    float* dst = out.data();
    if (v.dtype == DType::f32) {
      std::memcpy(dst, v.data, static_cast<std::size_t>(n) * 4);
    } else {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(v.data);
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + i, 2);
        dst[i] = v.dtype == DType::f16 ? f16_to_f32(h) : bf16_to_f32(h);
      }
    }
    if (gemma_ && is_norm(name)) // Gemma's RMS norms scale by (1 + w)
      for (int64_t i = 0; i < n; ++i)
        dst[i] += 1.0f;
    return out;
  }

private:
  static bool is_norm(const std::string& name) {
    if (name == "norm")
      return true;
    auto l = split_layer_name(name);
    return l && (l->second.size() >= 5 && l->second.compare(l->second.size() - 5, 5, "_norm") == 0);
  }

  // Family fields beyond the Llama ones: experts, Gemma's norms, scales, caps
  // and windows, Qwen3's q/k norms. Each refuses what would change the math.
  template <class GetInt, class GetNum, class GetBool>
  void family_fields(const json& c, const std::string& where, GetInt get_int, GetNum get_num, GetBool get_bool) {
    if (mt_ == "qwen3" || mt_ == "qwen3_moe" || mt_ == "gemma3_text")
      cfg_.qk_norm = true;
    if (mt_ == "qwen3_moe") {
      cfg_.n_experts = get_int("num_experts");
      cfg_.n_experts_used = get_int("num_experts_per_tok");
      cfg_.expert_hidden_dim = get_int("moe_intermediate_size");
      if (!get_bool("norm_topk_prob", false))
        throw Error(errc::unsupported, where + ": norm_topk_prob false is not supported (the top-k are renormalised)");
      if (get_int("decoder_sparse_step", 1) != 1 ||
          (c.contains("mlp_only_layers") && c["mlp_only_layers"].is_array() && !c["mlp_only_layers"].empty()))
        throw Error(errc::unsupported, where + ": dense layers between the expert layers (decoder_sparse_step, "
                                               "mlp_only_layers) are not supported");
    }
    if (mt_ == "mixtral") {
      cfg_.n_experts = get_int("num_local_experts");
      cfg_.n_experts_used = get_int("num_experts_per_tok");
      cfg_.expert_hidden_dim = cfg_.hidden_dim;
    }
    if (gemma_) {
      cfg_.tied_embeddings = get_bool("tie_word_embeddings", true);
      cfg_.sandwich_norms = true;
      cfg_.ffn_act = FfnActivation::gelu_tanh;
      cfg_.embed_scale = static_cast<double>(std::sqrt(static_cast<float>(cfg_.dim)));
      cfg_.query_scale = 1.0 / std::sqrt(get_num("query_pre_attn_scalar", static_cast<double>(cfg_.head_dim)));
      cfg_.attn_softcap = get_num("attn_logit_softcapping", 0.0);
      cfg_.final_softcap = get_num("final_logit_softcapping", 0.0);
      if (cfg_.sliding_window > 0) {
        cfg_.swa_pattern = mt_ == "gemma2" ? 2 : get_int("sliding_window_pattern", 6);
        // Newer configs list every layer's kind: it must be the pattern.
        if (c.contains("layer_types") && c["layer_types"].is_array()) {
          const auto& lt = c["layer_types"];
          if (static_cast<int64_t>(lt.size()) != cfg_.n_layers)
            throw Error(errc::bad_config, where + ": layer_types has " + std::to_string(lt.size()) + " entries for " +
                                            std::to_string(cfg_.n_layers) + " layers");
          for (int64_t l = 0; l < cfg_.n_layers; ++l)
            if ((lt[static_cast<std::size_t>(l)] == "sliding_attention") != cfg_.is_local(l))
              throw Error(errc::unsupported, where + ": layer_types is not a repeating pattern of " +
                                               std::to_string(cfg_.swa_pattern - 1) + " local layers and 1 global one");
        }
      }
      if (mt_ == "gemma3_text")
        cfg_.rope_theta_local = get_num("rope_local_base_freq", 10000.0);
      else if (cfg_.rope_scaling.type != "none")
        throw Error(errc::unsupported, where + ": rope_scaling in a gemma2 model is not supported");
    }
  }

  std::string hf_name(const std::string& name) const {
    if (name == "embed")
      return "model.embed_tokens.weight";
    if (name == "cls")
      return cfg_.tied_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    if (name == "norm")
      return "model.norm.weight";
    auto l = split_layer_name(name);
    const std::string layer = "model.layers." + std::to_string(l->first) + ".";
    std::string part = l->second;
    // Experts: "experts_w1#E" -> the expert's own matrix.
    if (auto hash = part.find('#'); hash != std::string::npos) {
      const std::string e = part.substr(hash + 1), w = part.substr(0, hash);
      if (mt_ == "mixtral")
        return layer + "block_sparse_moe.experts." + e + "." + w.substr(8) + ".weight"; // w1 / w2 / w3
      const std::string proj = w == "experts_w1" ? "gate_proj" : w == "experts_w3" ? "up_proj" : "down_proj";
      return layer + "mlp.experts." + e + "." + proj + ".weight";
    }
    if (part == "router")
      return layer + (mt_ == "mixtral" ? "block_sparse_moe.gate.weight" : "mlp.gate.weight");
    if (gemma_) {
      if (part == "ffn_norm")
        return layer + "pre_feedforward_layernorm.weight";
      if (part == "post_attn_norm")
        return layer + "post_attention_layernorm.weight";
      if (part == "post_ffn_norm")
        return layer + "post_feedforward_layernorm.weight";
    }
    static const std::map<std::string, std::string> parts = {
      {"attn_norm", "input_layernorm.weight"},     {"ffn_norm", "post_attention_layernorm.weight"},
      {"wq", "self_attn.q_proj.weight"},           {"wk", "self_attn.k_proj.weight"},
      {"wv", "self_attn.v_proj.weight"},           {"wo", "self_attn.o_proj.weight"},
      {"bq", "self_attn.q_proj.bias"},             {"bk", "self_attn.k_proj.bias"},
      {"bv", "self_attn.v_proj.bias"},             {"w1", "mlp.gate_proj.weight"},
      {"w3", "mlp.up_proj.weight"},                {"w2", "mlp.down_proj.weight"},
      {"q_norm", "self_attn.q_norm.weight"},       {"k_norm", "self_attn.k_norm.weight"},
      {"wqkv", "self_attn.qkv_proj.weight"},       {"w13", "mlp.gate_up_proj.weight"},
    };
    auto it = parts.find(part);
    if (it == parts.end())
      throw Error(errc::missing_tensor, "HF model directory '" + dir_.string() + "' has no tensor for '" + name + "'");
    return layer + it->second;
  }

  const SafetensorsFile& file_for(const std::string& hf) {
    std::lock_guard<std::mutex> lock(files_mutex_); // layers load in parallel
    std::string fname = "model.safetensors";
    if (!weight_map_.empty()) {
      auto it = weight_map_.find(hf);
      if (it == weight_map_.end())
        throw Error(errc::missing_tensor, "HF model directory '" + dir_.string() + "': index has no tensor '" + hf + "'");
      fname = it->second;
    }
    auto it = files_.find(fname);
    if (it == files_.end())
      it = files_.emplace(fname, std::make_unique<SafetensorsFile>((dir_ / fname).string())).first;
    return *it->second;
  }

  fs::path dir_;
  std::string mt_;
  bool gemma_ = false;
  ModelConfig cfg_;
  std::map<std::string, std::string> weight_map_;
  std::mutex files_mutex_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
};

} // namespace

std::unique_ptr<TensorSource> open_hf_dir(const std::string& dir) {
  return std::make_unique<HfSource>(dir);
}

} // namespace strata::model::detail
