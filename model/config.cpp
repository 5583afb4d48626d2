#include "model/config.hpp"

#include "model/error.hpp"

#include <charconv>
#include <sstream>

namespace strata::model {

namespace {

void require(bool ok, const std::string& what) {
  if (!ok)
    throw Error(errc::bad_config, what);
}

int64_t parse_int(const std::string& s, const std::string& whole) {
  int64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || p != s.data() + s.size() || s.empty())
    throw Error(errc::bad_argument, "layer range '" + whole + "': '" + s + "' is not a number");
  return v;
}

} // namespace

void ModelConfig::validate() const {
  require(architecture == "llama" || architecture == "qwen2",
          "architecture '" + architecture + "' is not supported (llama, qwen2)");
  require(dim > 0, "dim must be > 0 (got " + std::to_string(dim) + ")");
  require(hidden_dim > 0, "hidden_dim must be > 0 (got " + std::to_string(hidden_dim) + ")");
  require(n_layers > 0 && n_layers <= 4096, "n_layers must be in 1..4096 (got " + std::to_string(n_layers) + ")");
  require(n_heads > 0, "n_heads must be > 0 (got " + std::to_string(n_heads) + ")");
  require(n_kv_heads > 0 && n_heads % n_kv_heads == 0,
          "n_kv_heads must divide n_heads (n_heads " + std::to_string(n_heads) + ", n_kv_heads " +
            std::to_string(n_kv_heads) + ")");
  require(head_dim > 0 && head_dim % 2 == 0, "head_dim must be even and > 0 (got " + std::to_string(head_dim) + ")");
  require(vocab_size > 0 && vocab_size < (int64_t{1} << 31), "vocab_size out of range (got " + std::to_string(vocab_size) + ")");
  require(max_seq_len > 0 && max_seq_len <= (int64_t{1} << 24), "max_seq_len out of range (got " + std::to_string(max_seq_len) + ")");
  require(rope_theta > 0, "rope_theta must be > 0");
  require(norm_eps > 0 && norm_eps < 1, "norm_eps must be in (0, 1)");
  require(bos_id < vocab_size, "bos_id " + std::to_string(bos_id) + " is outside the vocabulary");
  for (auto id : eos_ids)
    require(id >= 0 && id < vocab_size, "eos id " + std::to_string(id) + " is outside the vocabulary");
}

std::string ModelConfig::summary() const {
  std::ostringstream os;
  os << architecture << " dim=" << dim << " hidden=" << hidden_dim << " layers=" << n_layers
     << " heads=" << n_heads << "/" << n_kv_heads << " head_dim=" << head_dim
     << " vocab=" << vocab_size << " ctx=" << max_seq_len
     << " rope=" << (rotary == RotaryLayout::interleaved ? "interleaved" : "half") << "@" << rope_theta
     << (tied_embeddings ? " tied" : "") << (attention_bias ? " qkv-bias" : "");
  return os.str();
}

LayerRange parse_layer_range(const std::string& text) {
  auto dash = text.find('-');
  LayerRange r;
  if (dash == std::string::npos) {
    r.first = r.last = parse_int(text, text);
  } else {
    r.first = parse_int(text.substr(0, dash), text);
    r.last = parse_int(text.substr(dash + 1), text);
  }
  if (r.first < 0 || r.last < r.first)
    throw Error(errc::bad_argument, "layer range '" + text + "' must be A-B with 0 <= A <= B");
  return r;
}

std::vector<LayerRange> parse_layer_ranges(const std::string& text) {
  std::vector<LayerRange> out;
  std::string item;
  std::istringstream is(text);
  while (std::getline(is, item, ','))
    out.push_back(parse_layer_range(item));
  if (out.empty())
    throw Error(errc::bad_argument, "empty layer range list");
  return out;
}

void check_route_covers(const std::vector<LayerRange>& ranges, int64_t n_layers) {
  int64_t next = 0;
  for (auto& r : ranges) {
    if (r.first != next)
      throw Error(errc::bad_argument, "shard ranges must be consecutive: expected a range starting at layer " +
                                        std::to_string(next) + ", got " + std::to_string(r.first) + "-" +
                                        std::to_string(r.last));
    next = r.last + 1;
  }
  if (next != n_layers)
    throw Error(errc::bad_argument, "shard ranges cover layers 0-" + std::to_string(next - 1) + " but the model has " +
                                      std::to_string(n_layers) + " layers");
}

} // namespace strata::model
