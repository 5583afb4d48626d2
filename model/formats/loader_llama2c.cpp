// llama2.c checkpoints (legacy version 0): a 7-int header, then fp32 weights,
// memory-mapped; the header is checked against the file size before anything is read.

#include "model/base/error.hpp"
#include "model/base/mapped_file.hpp"
#include "model/formats/source.hpp"

#include <cstring>
#include <map>
#include <string>

namespace strata::model::detail {

namespace {

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

  std::vector<float> load(const std::string& name, const std::vector<int64_t>& shape) override {
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
    return std::vector<float>(p, p + numel);
  }

private:
  MappedFile file_;
  ModelConfig cfg_;
  bool shared_ = true;
  std::map<std::string, std::pair<uint64_t, uint64_t>> base_; // key -> (offset, floats per layer)
};

} // namespace

std::unique_ptr<TensorSource> open_llama2c(const std::string& path) {
  return std::make_unique<Llama2cSource>(path);
}

} // namespace strata::model::detail
