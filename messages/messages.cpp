#include "messages/messages.hpp"

#include "model/base/error.hpp"

#include <cstring>

namespace strata {

const char* to_string(ec code) {
  switch (code) {
    case ec::none: return "none";
    case ec::stale_epoch: return "stale_epoch";
    case ec::incompatible_recipe: return "incompatible_recipe";
    case ec::budget_exceeded: return "budget_exceeded";
    case ec::bad_shape: return "bad_shape";
    case ec::bad_request: return "bad_request";
    case ec::session_conflict: return "session_conflict";
    case ec::overloaded: return "overloaded";
    case ec::model_error: return "model_error";
    case ec::no_route: return "no_route";
    case ec::step_timeout: return "step_timeout";
    case ec::retries_exhausted: return "retries_exhausted";
    case ec::invalid_request: return "invalid_request";
    case ec::cluster_lost: return "cluster_lost";
    case ec::cancelled: return "cancelled";
  }
  return "unknown";
}

std::string render_error(uint8_t code, const caf::message& context) {
  std::string out = to_string(static_cast<ec>(code));
  if (!context.empty()) {
    out += ": ";
    for (std::size_t i = 0; i < context.size(); ++i) {
      if (i)
        out += ", ";
      out += context.match_element<std::string>(i) ? context.get_as<std::string>(i) : caf::deep_to_string(context);
      if (!context.match_element<std::string>(i))
        break;
    }
  }
  return out;
}

namespace msg {

const char* to_string(miss_reason r) {
  switch (r) {
    case miss_reason::unknown_session: return "unknown_session";
    case miss_reason::evicted_ttl: return "evicted_ttl";
    case miss_reason::evicted_lru: return "evicted_lru";
    case miss_reason::released: return "released";
    case miss_reason::superseded: return "superseded";
    case miss_reason::seq_mismatch: return "seq_mismatch";
  }
  return "unknown";
}

tensor_blob tensor_blob::from(const model::Activation& a) {
  tensor_blob b;
  b.dtype = 0;
  b.shape = {a.rows, a.cols};
  b.bytes.resize(a.data.size() * sizeof(float));
  std::memcpy(b.bytes.data(), a.data.data(), b.bytes.size());
  return b;
}

model::Activation tensor_blob::to_activation() const {
  if (dtype != 0)
    throw model::Error(model::errc::bad_shape, "tensor dtype " + std::to_string(dtype) + " is not float32 (0)");
  if (shape.size() != 2 || shape[0] <= 0 || shape[1] <= 0 || shape[0] > (int64_t{1} << 24) || shape[1] > (int64_t{1} << 24))
    throw model::Error(model::errc::bad_shape, "hidden state must have shape [T, dim] with positive sizes");
  const auto n = static_cast<std::size_t>(shape[0] * shape[1]);
  if (bytes.size() != n * sizeof(float))
    throw model::Error(model::errc::bad_shape, "hidden state of shape [" + std::to_string(shape[0]) + ", " +
                                                 std::to_string(shape[1]) + "] carries " + std::to_string(bytes.size()) +
                                                 " bytes, expected " + std::to_string(n * sizeof(float)));
  model::Activation a;
  a.rows = shape[0];
  a.cols = shape[1];
  a.data.resize(n);
  std::memcpy(a.data.data(), bytes.data(), bytes.size());
  return a;
}

cache_recipe cache_recipe::of(const model::ModelConfig& cfg) {
  cache_recipe r;
  r.architecture = cfg.architecture;
  r.model = cfg.identity;
  r.dtype = cfg.dtype;
  r.kv_dtype = cfg.kv_dtype;
  r.n_layers = cfg.n_layers;
  r.n_kv_heads = cfg.n_kv_heads;
  r.head_dim = cfg.head_dim;
  return r;
}

model::ModelConfig model_facts::to_config() const {
  model::ModelConfig c;
  c.architecture = architecture;
  c.identity = model;
  c.n_layers = n_layers;
  c.vocab_size = vocab_size;
  c.max_seq_len = max_seq_len;
  c.bos_id = bos_id;
  c.eos_ids = eos_ids;
  c.n_experts = n_experts;
  c.n_experts_used = n_experts_used;
  c.sliding_window = sliding_window;
  c.swa_pattern = swa_pattern;
  return c;
}

void register_types(caf::actor_system_config& cfg) {
  cfg.add_message_types<caf::id_block::strata>();
  cfg.add_error_category(caf::atom("strata"), [](uint8_t code, caf::atom_value, const caf::message& ctx) {
    return render_error(code, ctx);
  });
}

} // namespace msg
} // namespace strata
