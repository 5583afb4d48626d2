// builtin:NAME models: deterministic weights from a per-tensor seeded splitmix64
// stream, so a shard generates just its own tensors (no files).

#include "model/base/error.hpp"
#include "model/formats/source.hpp"

#include <cmath>
#include <map>
#include <string>

namespace strata::model::detail {

namespace {

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

    // Multi-head attention, one kv head per query head (as in Llama 2 and
    // Phi-3-mini), every matrix's columns a multiple of 32 (so each can be
    // q8_0) and a head size a q8_0 cache takes: for tests of that path.
    ModelConfig mha = tiny;
    mha.identity = "builtin:tiny-mha";
    mha.dim = 128;
    mha.hidden_dim = 320;
    mha.n_layers = 3;
    mha.n_heads = 4;
    mha.n_kv_heads = 4;
    mha.head_dim = 32;
    m.emplace("tiny-mha", BuiltinSpec{mha, 0x5eed0002});

    // Multi-query attention, one kv head for every query head (as Gemma 3 1B
    // and Falcon have), and a context long enough for a decode step's attention
    // to be spread over threads: for tests of that path.
    ModelConfig mqa = mha;
    mqa.identity = "builtin:tiny-mqa";
    mqa.n_layers = 2;
    mqa.n_kv_heads = 1;
    mqa.max_seq_len = 2048;
    m.emplace("tiny-mqa", BuiltinSpec{mqa, 0x5eed0003});

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

  std::vector<float> load(const std::string& name, const std::vector<int64_t>& shape) override {
    std::string key = name == "cls" && spec_.cfg.tied_embeddings ? "embed" : name;
    auto l = split_layer_name(key);
    const std::string part = l ? l->second : key;
    int64_t n = 1;
    for (auto s : shape)
      n *= s;
    std::vector<float> t(static_cast<std::size_t>(n));
    float* p = t.data();
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
      favour_readable_bytes(t, shape[1]);
    return t;
  }

private:
  // builtin:tiny's classifier is damped except for the rows of lowercase
  // letters, space and a little punctuation, so that its (random) text is mostly
  // readable pseudo-words instead of control bytes.
  // (rows of `dim` values; f32 products, as the weights were always made)
  static void favour_readable_bytes(std::vector<float>& cls, int64_t dim) {
    for (float& x : cls)
      x *= 0.25f;
    const std::string readable = "abcdefghijklmnopqrstuvwxyz ,.";
    for (unsigned char c : readable) {
      float* row = cls.data() + (static_cast<int64_t>(c) + 3) * dim;
      for (int64_t i = 0; i < dim; ++i)
        row[i] *= c == ' ' ? 4.5f : 3.5f;
    }
  }

  BuiltinSpec spec_;
};

} // namespace

std::unique_ptr<TensorSource> open_builtin(const std::string& name) {
  return std::make_unique<BuiltinSource>(name);
}

} // namespace strata::model::detail
