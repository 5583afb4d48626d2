#include "model/base/config.hpp"

#include "model/base/error.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
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

std::vector<double> ModelConfig::rope_inv_freq() const {
  const int64_t half = head_dim / 2;
  const RopeScaling& rs = rope_scaling;
  std::vector<double> inv(static_cast<std::size_t>(half));
  // The unscaled frequencies in float, as the references compute them.
  for (int64_t p = 0; p < half; ++p)
    inv[static_cast<std::size_t>(p)] =
      1.0f / std::pow(static_cast<float>(rope_theta), static_cast<float>(2 * p) / static_cast<float>(head_dim));
  const double pi = std::acos(-1.0);
  if (rs.type == "linear") {
    for (auto& f : inv)
      f /= rs.factor;
  } else if (rs.type == "llama3") {
    const double old_ctx = static_cast<double>(rs.original_max_position);
    const double low_wavelen = old_ctx / rs.low_freq_factor, high_wavelen = old_ctx / rs.high_freq_factor;
    for (auto& f : inv) {
      const double wavelen = 2 * pi / f;
      if (wavelen < high_wavelen)
        continue; // high frequencies kept
      if (wavelen > low_wavelen) {
        f /= rs.factor; // low frequencies interpolated
      } else {
        const double smooth = (old_ctx / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
        f = (1 - smooth) * f / rs.factor + smooth * f;
      }
    }
  } else if (rs.type == "yarn") {
    const double dim = static_cast<double>(head_dim), base = rope_theta;
    const double max_pos = static_cast<double>(rs.original_max_position);
    auto correction_dim = [&](double rotations) {
      return dim * std::log(max_pos / (rotations * 2 * pi)) / (2 * std::log(base));
    };
    double low = correction_dim(rs.beta_fast), high = correction_dim(rs.beta_slow);
    if (rs.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, dim - 1);
    if (low == high)
      high += 0.001;
    for (int64_t p = 0; p < half; ++p) {
      const double ramp = std::clamp((static_cast<double>(p) - low) / (high - low), 0.0, 1.0);
      const double extrapolation = 1 - ramp;
      double& f = inv[static_cast<std::size_t>(p)];
      f = f / rs.factor * (1 - extrapolation) + f * extrapolation;
    }
  }
  if (!rs.freq_factors.empty())
    for (std::size_t i = 0; i < inv.size() && i < rs.freq_factors.size(); ++i)
      inv[i] /= rs.freq_factors[i];
  return inv;
}

double ModelConfig::rope_attention_factor() const {
  const RopeScaling& rs = rope_scaling;
  if (rs.type != "yarn")
    return 1.0;
  if (rs.attention_factor > 0)
    return rs.attention_factor;
  auto mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
  if (rs.mscale > 0 && rs.mscale_all_dim > 0)
    return mscale(rs.factor, rs.mscale) / mscale(rs.factor, rs.mscale_all_dim);
  return mscale(rs.factor, 1.0);
}

void ModelConfig::validate() const {
  require(architecture == "llama" || architecture == "qwen2" || architecture == "qwen3" ||
            architecture == "qwen3moe" || architecture == "gemma2" || architecture == "gemma3" ||
            architecture == "phi3",
          "architecture '" + architecture + "' is not supported (llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3)");
  require(n_experts >= 0 && n_experts <= 1024, "n_experts must be in 0..1024 (got " + std::to_string(n_experts) + ")");
  if (n_experts > 0)
    require(n_experts_used > 0 && n_experts_used <= n_experts && expert_hidden_dim > 0,
            "a mixture of experts needs 0 < n_experts_used <= n_experts (" + std::to_string(n_experts_used) + " of " +
              std::to_string(n_experts) + ") and an expert width > 0");
  require(sliding_window >= 0 && swa_pattern >= 0, "sliding_window and its pattern must be >= 0");
  require(std::isfinite(embed_scale) && embed_scale > 0, "embed_scale must be > 0");
  require(std::isfinite(query_scale) && query_scale >= 0, "query_scale must be >= 0");
  require(std::isfinite(attn_softcap) && attn_softcap >= 0 && std::isfinite(final_softcap) && final_softcap >= 0,
          "soft-caps must be >= 0");
  require(rope_theta_local >= 0, "rope_theta_local must be >= 0");
  require(dim > 0, "dim must be > 0 (got " + std::to_string(dim) + ")");
  require(hidden_dim > 0, "hidden_dim must be > 0 (got " + std::to_string(hidden_dim) + ")");
  require(n_layers > 0 && n_layers <= 4096, "n_layers must be in 1..4096 (got " + std::to_string(n_layers) + ")");
  require(n_heads > 0, "n_heads must be > 0 (got " + std::to_string(n_heads) + ")");
  require(n_kv_heads > 0 && n_heads % n_kv_heads == 0,
          "n_kv_heads must divide n_heads (n_heads " + std::to_string(n_heads) + ", n_kv_heads " +
            std::to_string(n_kv_heads) + ")");
  require(head_dim > 0 && head_dim % 2 == 0, "head_dim must be even and > 0 (got " + std::to_string(head_dim) + ")");
  require(head_dim <= 512, "head_dim must be at most 512 (got " + std::to_string(head_dim) + ")");
  require(vocab_size > 0 && vocab_size < (int64_t{1} << 31), "vocab_size out of range (got " + std::to_string(vocab_size) + ")");
  require(max_seq_len > 0 && max_seq_len <= (int64_t{1} << 24), "max_seq_len out of range (got " + std::to_string(max_seq_len) + ")");
  require(rope_theta > 0, "rope_theta must be > 0");
  require(norm_eps > 0 && norm_eps < 1, "norm_eps must be in (0, 1)");
  const RopeScaling& rs = rope_scaling;
  require(rs.type == "none" || rs.type == "linear" || rs.type == "dynamic" || rs.type == "llama3" || rs.type == "yarn",
          "rope_scaling type '" + rs.type + "' is not supported (linear, dynamic, llama3, yarn)");
  if (rs.type == "dynamic") // exact only up to the original context (see loaders.cpp)
    require(rs.original_max_position > 0 && max_seq_len <= rs.original_max_position,
            "rope_scaling dynamic holds the context to original_max_position_embeddings (" +
              std::to_string(rs.original_max_position) + "), not " + std::to_string(max_seq_len));
  require(std::isfinite(rs.factor) && rs.factor > 0, "rope_scaling factor must be > 0");
  if (rs.type == "llama3")
    require(rs.original_max_position > 0 && rs.low_freq_factor > 0 && rs.high_freq_factor > rs.low_freq_factor,
            "rope_scaling llama3 needs original_max_position_embeddings > 0 and high_freq_factor > low_freq_factor > 0");
  if (rs.type == "yarn")
    require(rs.original_max_position > 0 && rs.beta_fast > 0 && rs.beta_slow > 0 && rope_theta > 1,
            "rope_scaling yarn needs original_max_position_embeddings > 0 and positive beta_fast / beta_slow");
  require(rs.freq_factors.empty() || static_cast<int64_t>(rs.freq_factors.size()) == head_dim / 2,
          "rope frequency factors: " + std::to_string(rs.freq_factors.size()) + " for " +
            std::to_string(head_dim / 2) + " frequencies");
  require(bos_id < vocab_size, "bos_id " + std::to_string(bos_id) + " is outside the vocabulary");
  for (auto id : eos_ids)
    require(id >= 0 && id < vocab_size, "eos id " + std::to_string(id) + " is outside the vocabulary");
}

std::string ModelConfig::describe() const {
  std::ostringstream os;
  os << architecture;
  if (n_experts > 0)
    os << ", " << n_experts << " experts (" << n_experts_used << " active)";
  if (sliding_window > 0)
    os << ", window " << sliding_window << " on " << local_layers() << " of " << n_layers << " layers";
  return os.str();
}

std::string ModelConfig::summary() const {
  std::ostringstream os;
  os << architecture << " dim=" << dim << " hidden=" << hidden_dim << " layers=" << n_layers
     << " heads=" << n_heads << "/" << n_kv_heads << " head_dim=" << head_dim
     << " vocab=" << vocab_size << " ctx=" << max_seq_len
     << " rope=" << (rotary == RotaryLayout::interleaved ? "interleaved" : "half") << "@" << rope_theta
     << (tied_embeddings ? " tied" : "") << (attention_bias ? " qkv-bias" : "") << (qk_norm ? " qk-norm" : "");
  if (n_experts > 0)
    os << " experts=" << n_experts << "/" << n_experts_used << "x" << expert_hidden_dim;
  if (sliding_window > 0)
    os << " window=" << sliding_window << (swa_pattern > 1 ? "/" + std::to_string(swa_pattern) : std::string());
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
