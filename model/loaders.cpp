// TensorSource implementations: llama2.c checkpoints, Hugging Face model
// directories (safetensors), and deterministic builtin models.

#include "model/error.hpp"
#include "model/mapped_file.hpp"
#include "model/safetensors.hpp"
#include "model/weights.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace strata::model::detail {

namespace fs = std::filesystem;
using nlohmann::json;

bool is_gguf_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i)
    out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// Splits "L12.wq" into (12, "wq"); returns nullopt for global names.
std::optional<std::pair<int64_t, std::string>> split_layer_name(const std::string& name) {
  if (name.size() < 3 || name[0] != 'L')
    return std::nullopt;
  auto dot = name.find('.');
  return std::make_pair(std::stoll(name.substr(1, dot - 1)), name.substr(dot + 1));
}

// ---------------------------------------------------------------- llama2.c

class Llama2cSource final : public TensorSource {
public:
  explicit Llama2cSource(const std::string& path) : file_(path) {
    const auto fsize = file_.size();
    if (fsize < 28)
      throw Error(errc::bad_format, "llama2.c checkpoint '" + path + "' is " + std::to_string(fsize) +
                                      " bytes, shorter than its 28-byte header");
    int32_t h[7];
    std::memcpy(h, file_.data(), sizeof h);
    const char* names[7] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
    for (int i = 0; i < 7; ++i) {
      if (i == 5 ? h[i] == 0 : h[i] <= 0)
        throw Error(errc::corrupt, "llama2.c checkpoint '" + path + "': header field " + names[i] + " = " +
                                     std::to_string(h[i]) + " is not positive");
    }
    shared_ = h[5] > 0;
    cfg_.architecture = "llama";
    cfg_.identity = path;
    cfg_.dim = h[0];
    cfg_.hidden_dim = h[1];
    cfg_.n_layers = h[2];
    cfg_.n_heads = h[3];
    cfg_.n_kv_heads = h[4];
    cfg_.vocab_size = shared_ ? h[5] : -static_cast<int64_t>(h[5]);
    cfg_.max_seq_len = h[6];
    if (cfg_.dim % cfg_.n_heads != 0)
      throw Error(errc::corrupt, "llama2.c checkpoint '" + path + "': dim " + std::to_string(cfg_.dim) +
                                   " is not a multiple of n_heads " + std::to_string(cfg_.n_heads));
    cfg_.head_dim = cfg_.dim / cfg_.n_heads;
    cfg_.rope_theta = 10000.0;
    cfg_.rotary = RotaryLayout::interleaved;
    cfg_.norm_eps = 1e-5;
    cfg_.tied_embeddings = shared_;
    cfg_.bos_id = 1;
    cfg_.eos_ids = {1}; // llama2.c's run.c stops when the next token is BOS
    try {
      cfg_.validate();
    } catch (const Error& e) {
      throw Error(errc::corrupt, "llama2.c checkpoint '" + path + "': " + e.message());
    }
    // Offsets (in floats) of each weight family, in llama2.c order.
    const uint64_t D = cfg_.dim, H = cfg_.hidden_dim, L = cfg_.n_layers, V = cfg_.vocab_size;
    const uint64_t Q = cfg_.q_dim(), KV = cfg_.kv_dim(), S = cfg_.max_seq_len, HS = cfg_.head_dim;
    uint64_t off = 0;
    auto put = [&](const std::string& key, uint64_t per_layer_floats, uint64_t layers) {
      base_[key] = {off, per_layer_floats};
      off += per_layer_floats * layers;
    };
    put("embed", V * D, 1);
    put("attn_norm", D, L);
    put("wq", Q * D, L);
    put("wk", KV * D, L);
    put("wv", KV * D, L);
    put("wo", D * Q, L);
    put("ffn_norm", D, L);
    put("w1", H * D, L);
    put("w2", D * H, L);
    put("w3", H * D, L);
    put("norm", D, 1);
    off += 2 * (S * HS / 2); // freq_cis_real and freq_cis_imag (unused: we compute RoPE)
    if (!shared_)
      put("cls", V * D, 1);
    const uint64_t expected = 28 + off * 4;
    if (expected != fsize)
      throw Error(errc::corrupt, "llama2.c checkpoint '" + path + "': header (dim " + std::to_string(D) + ", layers " +
                                   std::to_string(L) + ", vocab " + std::to_string(V) + ", seq_len " + std::to_string(S) +
                                   (shared_ ? ", shared classifier" : ", separate classifier") + ") implies " +
                                   std::to_string(expected) + " bytes but the file has " + std::to_string(fsize));
  }

  const ModelConfig& config() const override { return cfg_; }

  at::Tensor load(const std::string& name, const std::vector<int64_t>& shape) override {
    std::string key = name;
    uint64_t layer = 0;
    if (auto l = split_layer_name(name)) {
      layer = static_cast<uint64_t>(l->first);
      key = l->second;
    }
    if (key == "cls" && shared_)
      key = "embed";
    auto it = base_.find(key);
    if (it == base_.end())
      throw Error(errc::missing_tensor, "llama2.c checkpoint '" + file_.path() + "' has no tensor '" + name + "'");
    int64_t numel = 1;
    for (auto s : shape)
      numel *= s;
    if (static_cast<uint64_t>(numel) != it->second.second)
      throw Error(errc::corrupt, "llama2.c checkpoint '" + file_.path() + "': tensor '" + name + "' expected " +
                                   shape_str(shape));
    const float* p = reinterpret_cast<const float*>(file_.data() + 28) + it->second.first + layer * it->second.second;
    return at::from_blob(const_cast<float*>(p), shape, at::kFloat).clone();
  }

private:
  MappedFile file_;
  ModelConfig cfg_;
  bool shared_ = true;
  std::map<std::string, std::pair<uint64_t, uint64_t>> base_; // key -> (offset, floats per layer)
};

// ---------------------------------------------------------------- Hugging Face

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
    if (mt == "llama" || mt == "mistral")
      cfg_.architecture = "llama";
    else if (mt == "qwen2")
      cfg_.architecture = "qwen2";
    else
      throw Error(errc::unsupported, where + ": model_type '" + mt + "' is not supported (llama, mistral, qwen2)");
    if (c.contains("rope_scaling") && !c["rope_scaling"].is_null())
      cfg_.rope_scaling = parse_rope_scaling(c["rope_scaling"], where, get_int("max_position_embeddings", 2048));
    // Fields that change the math: refused unless they say what strata computes.
    if (c.contains("hidden_act") && c["hidden_act"] != "silu")
      throw Error(errc::unsupported, where + ": hidden_act " + c["hidden_act"].dump() + " is not supported (silu)");
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
    // A sliding window (Mistral v0.1: 4096) changes attention only past the
    // window: sequences are held to it, so every position sees what it would.
    // Qwen2 windows only when use_sliding_window is set, and then only layers
    // from max_window_layers on (as transformers' Qwen2 reads its config).
    const bool windowed = mt != "qwen2" || (get_bool("use_sliding_window", false) &&
                                             get_int("max_window_layers", cfg_.n_layers) < cfg_.n_layers);
    if (windowed && c.contains("sliding_window") && !c["sliding_window"].is_null()) {
      const int64_t w = get_int("sliding_window");
      if (w <= 0)
        throw Error(errc::bad_config, where + ": sliding_window must be positive");
      cfg_.max_seq_len = std::min(cfg_.max_seq_len, w);
    } else if (mt == "qwen2" && get_bool("use_sliding_window", false) && windowed) {
      throw Error(errc::bad_config, where + ": use_sliding_window without a sliding_window size");
    }
    cfg_.rope_theta = get_num("rope_theta", 10000.0);
    cfg_.rotary = RotaryLayout::half;
    cfg_.norm_eps = get_num("rms_norm_eps", 1e-6);
    cfg_.tied_embeddings = get_bool("tie_word_embeddings", false);
    cfg_.attention_bias = cfg_.architecture == "qwen2" ? true : get_bool("attention_bias", false);
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

  at::Tensor load(const std::string& name, const std::vector<int64_t>& shape) override {
    const std::string hf = hf_name(name);
    const SafetensorsFile& f = file_for(hf);
    const TensorView& v = f.at(hf);
    if (v.shape != shape)
      throw Error(errc::corrupt, "safetensors file '" + f.path() + "': tensor '" + hf + "' has shape " +
                                   shape_str(v.shape) + ", expected " + shape_str(shape));
    at::Tensor out = at::empty(shape, at::kFloat);
    float* dst = out.data_ptr<float>();
    const int64_t n = v.numel();
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
    return out;
  }

private:
  std::string hf_name(const std::string& name) const {
    if (name == "embed")
      return "model.embed_tokens.weight";
    if (name == "cls")
      return cfg_.tied_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    if (name == "norm")
      return "model.norm.weight";
    auto l = split_layer_name(name);
    static const std::map<std::string, std::string> parts = {
      {"attn_norm", "input_layernorm.weight"},     {"ffn_norm", "post_attention_layernorm.weight"},
      {"wq", "self_attn.q_proj.weight"},           {"wk", "self_attn.k_proj.weight"},
      {"wv", "self_attn.v_proj.weight"},           {"wo", "self_attn.o_proj.weight"},
      {"bq", "self_attn.q_proj.bias"},             {"bk", "self_attn.k_proj.bias"},
      {"bv", "self_attn.v_proj.bias"},             {"w1", "mlp.gate_proj.weight"},
      {"w3", "mlp.up_proj.weight"},                {"w2", "mlp.down_proj.weight"},
    };
    return "model.layers." + std::to_string(l->first) + "." + parts.at(l->second);
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
  ModelConfig cfg_;
  std::map<std::string, std::string> weight_map_;
  std::mutex files_mutex_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
};

// ---------------------------------------------------------------- builtin

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  return h;
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct BuiltinSpec {
  ModelConfig cfg;
  uint64_t seed;
};

const std::map<std::string, BuiltinSpec>& builtin_specs() {
  static const std::map<std::string, BuiltinSpec> specs = [] {
    std::map<std::string, BuiltinSpec> m;
    ModelConfig tiny;
    tiny.architecture = "llama";
    tiny.identity = "builtin:tiny";
    tiny.dim = 64;
    tiny.hidden_dim = 176;
    tiny.n_layers = 5;
    tiny.n_heads = 8;
    tiny.n_kv_heads = 2;
    tiny.head_dim = 8;
    tiny.vocab_size = 259; // byte tokenizer: 0 <unk>, 1 <s>, 2 </s>, 3 + byte
    tiny.max_seq_len = 512;
    tiny.rope_theta = 10000.0;
    tiny.rotary = RotaryLayout::half;
    tiny.norm_eps = 1e-5;
    tiny.tied_embeddings = false;
    tiny.bos_id = 1;
    tiny.eos_ids = {2};
    m.emplace("tiny", BuiltinSpec{tiny, 0x5eed0001});

    ModelConfig q;
    q.architecture = "qwen2";
    q.identity = "builtin:qwen2-0.5b";
    q.dim = 896;
    q.hidden_dim = 4864;
    q.n_layers = 24;
    q.n_heads = 14;
    q.n_kv_heads = 2;
    q.head_dim = 64;
    q.vocab_size = 151936;
    q.max_seq_len = 32768;
    q.rope_theta = 1000000.0;
    q.rotary = RotaryLayout::half;
    q.norm_eps = 1e-6;
    q.tied_embeddings = true;
    q.attention_bias = true;
    q.bos_id = -1;
    q.eos_ids = {151643, 151645};
    m.emplace("qwen2-0.5b", BuiltinSpec{q, 0x5eed0005});
    return m;
  }();
  return specs;
}

class BuiltinSource final : public TensorSource {
public:
  explicit BuiltinSource(const std::string& name) {
    auto it = builtin_specs().find(name);
    if (it == builtin_specs().end()) {
      std::string known;
      for (auto& [k, v] : builtin_specs())
        known += (known.empty() ? "" : ", ") + ("builtin:" + k);
      throw Error(errc::bad_argument, "unknown builtin model 'builtin:" + name + "' (known: " + known + ")");
    }
    spec_ = it->second;
  }

  const ModelConfig& config() const override { return spec_.cfg; }

  at::Tensor load(const std::string& name, const std::vector<int64_t>& shape) override {
    std::string key = name == "cls" && spec_.cfg.tied_embeddings ? "embed" : name;
    auto l = split_layer_name(key);
    const std::string part = l ? l->second : key;
    at::Tensor t = at::empty(shape, at::kFloat);
    float* p = t.data_ptr<float>();
    const int64_t n = t.numel();
    const int64_t fan_in = shape.size() == 2 ? shape[1] : 1;
    // Norm weights near 1, biases small, matrices with unit-variance outputs.
    double center = 0, scale;
    if (part == "attn_norm" || part == "ffn_norm" || part == "norm") {
      center = 1.0;
      scale = 0.1;
    } else if (part == "bq" || part == "bk" || part == "bv") {
      scale = 0.1;
    } else if (part == "embed") {
      scale = 1.0;
    } else {
      scale = 1.0 / std::sqrt(static_cast<double>(fan_in));
    }
    uint64_t state = fnv1a(key) ^ spec_.seed;
    const double k = scale * std::sqrt(3.0) / 9007199254740992.0; // uniform with std `scale`
    for (int64_t i = 0; i < n; ++i) {
      const double u = static_cast<double>(splitmix64(state) >> 11) * 2.0 - 9007199254740992.0;
      p[i] = static_cast<float>(center + u * k);
    }
    if (spec_.cfg.identity == "builtin:tiny" && key == "cls")
      favour_readable_bytes(t);
    return t;
  }

private:
  // builtin:tiny's classifier is damped except for the rows of lowercase
  // letters, space and a little punctuation, so that its (random) text is mostly
  // readable pseudo-words instead of control bytes.
  static void favour_readable_bytes(at::Tensor& cls) {
    cls.mul_(0.25);
    const std::string readable = "abcdefghijklmnopqrstuvwxyz ,.";
    for (unsigned char c : readable)
      cls[static_cast<int64_t>(c) + 3].mul_(c == ' ' ? 4.5 : 3.5);
  }

  BuiltinSpec spec_;
};

} // namespace

std::unique_ptr<TensorSource> open_llama2c(const std::string& path) {
  return std::make_unique<Llama2cSource>(path);
}

std::unique_ptr<TensorSource> open_hf_dir(const std::string& dir) {
  return std::make_unique<HfSource>(dir);
}

std::unique_ptr<TensorSource> open_builtin(const std::string& name) {
  return std::make_unique<BuiltinSource>(name);
}

std::unique_ptr<TensorSource> open_source(const std::string& spec) {
  if (spec.rfind("builtin:", 0) == 0)
    return open_builtin(spec.substr(8));
  std::error_code ec;
  if (fs::is_directory(spec, ec))
    return open_hf_dir(spec);
  if (!fs::exists(spec, ec))
    throw Error(errc::io, "model '" + spec + "' does not exist (expected a llama2.c .bin file, a Hugging Face "
                          "directory or builtin:NAME)");
  if (is_gguf_file(spec))
    return open_gguf(spec);
  if (fs::path(spec).extension() == ".gguf") // never read as another format
    throw Error(errc::bad_format, "'" + spec + "' is named .gguf but is not a GGUF file (no GGUF magic)");
  return open_llama2c(spec);
}

} // namespace strata::model::detail
