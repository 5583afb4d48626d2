#pragma once
// Every message type of strata's actor layer, with `inspect`, and the one
// type-ID block that registers them (plus the atoms). Torch-free.

#include "messages/error.hpp"
#include "model/shard.hpp"

#include <caf/all.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace strata::msg {

namespace wire {

/// Refers to a vector field while it is (de)serialized. Loading does not trust
/// the length on the wire: a length larger than the bytes left in the input is
/// refused before anything is allocated. (CAF 0.17 resizes byte sequences to
/// the claimed length first: 9 forged bytes made it allocate gigabytes.)
template <class T>
struct guarded {
  std::vector<T>& xs;
};

template <class T>
guarded<T> guard(std::vector<T>& xs) {
  return {xs};
}

template <class Inspector, class T>
typename Inspector::result_type inspect(Inspector& f, guarded<T>& g) {
  if constexpr (Inspector::reads_state) {
    return f(g.xs);
  } else {
    size_t n = 0;
    if (auto err = f.begin_sequence(n))
      return err;
    std::size_t left = SIZE_MAX;
    if (auto* bin = dynamic_cast<caf::binary_deserializer*>(&f))
      left = bin->remaining();
    if (n > left) // every element takes at least one byte
      return caf::make_error(caf::sec::invalid_argument,
                             "a sequence claims " + std::to_string(n) + " elements but only " + std::to_string(left) +
                               " bytes are left");
    g.xs.clear();
    if constexpr (std::is_same_v<T, uint8_t>) {
      g.xs.resize(n);
      if (n > 0)
        if (auto err = f.apply_raw(n, g.xs.data()))
          return err;
    } else {
      for (size_t i = 0; i < n; ++i) {
        T v{};
        if (auto err = f(v))
          return err;
        g.xs.push_back(std::move(v));
      }
    }
    return f.end_sequence();
  }
}

/// Refers to a float or double field while it is (de)serialized: it travels as
/// its IEEE-754 bit pattern. (CAF 0.17's float packing loops forever on an
/// infinity; the fuzz target found it: a peer could hang a node's I/O thread.)
template <class F>
struct bits {
  F& x;
};

template <class F>
bits<F> raw(F& x) {
  return {x};
}

template <class Inspector, class F>
typename Inspector::result_type inspect(Inspector& f, bits<F>& b) {
  using U = std::conditional_t<sizeof(F) == 4, uint32_t, uint64_t>;
  U u = 0;
  if constexpr (Inspector::reads_state) {
    std::memcpy(&u, &b.x, sizeof u);
    return f(u);
  } else {
    auto err = f(u);
    if (!err)
      std::memcpy(&b.x, &u, sizeof u);
    return err;
  }
}

} // namespace wire

using wire::guard;
using wire::raw;

/// A tensor on the wire: dtype + shape + raw bytes (host byte order; strata
/// nodes are little-endian x86-64/aarch64). Bytes (de)serialize with one memcpy.
struct tensor_blob {
  uint8_t dtype = 0; // 0 = float32
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  bool empty() const { return bytes.empty(); }
  /// Copies an activation in (one copy).
  static tensor_blob from(const model::Activation& a);
  /// Copies out into an activation (one copy). Throws model::Error(bad_shape)
  /// when dtype, shape and byte count disagree.
  model::Activation to_activation() const;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, tensor_blob& x) {
  return f(caf::meta::type_name("tensor_blob"), x.dtype, guard(x.shape), guard(x.bytes));
}

/// What a cache was made for. A shard refuses a request whose recipe differs.
struct cache_recipe {
  std::string architecture;
  std::string model; // identity: checkpoint path or builtin:NAME
  std::string dtype = "f32";
  int64_t n_layers = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;

  static cache_recipe of(const model::ModelConfig& cfg);
  friend bool operator==(const cache_recipe&, const cache_recipe&) = default;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, cache_recipe& x) {
  return f(caf::meta::type_name("cache_recipe"), x.architecture, x.model, x.dtype, x.n_layers, x.n_kv_heads,
           x.head_dim);
}

/// One shard of a route.
struct hop {
  caf::actor shard;
  int64_t first = 0;
  int64_t last = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, hop& x) {
  return f(caf::meta::type_name("hop"), x.shard, x.first, x.last);
}

/// A planned chain of shards covering every layer, valid for one epoch.
struct route_info {
  int64_t epoch = 0;
  std::vector<hop> hops;
  cache_recipe recipe;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, route_info& x) {
  return f(caf::meta::type_name("route_info"), x.epoch, guard(x.hops), x.recipe);
}

/// Sampling settings plus the generator state the tail continues from.
struct sampling_state {
  float temperature = 0;
  int32_t top_k = 0;
  float top_p = 1;
  uint64_t rng_state = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sampling_state& x) {
  return f(caf::meta::type_name("sampling_state"), raw(x.temperature), x.top_k, raw(x.top_p), x.rng_state);
}

enum class step_mode : uint8_t { prefill = 0, decode = 1 };

/// One step of one session through a route. The head gets `tokens`; every
/// later hop gets the previous hop's `hidden`. `past_len` is how many tokens
/// each shard must already hold (0 for prefill).
struct step_request {
  std::string session;
  int64_t epoch = 0;
  int64_t step_id = 0;
  uint8_t mode = 0; // step_mode
  int64_t past_len = 0;
  std::vector<int64_t> positions;
  std::vector<int32_t> tokens;
  tensor_blob hidden;
  cache_recipe recipe;
  std::vector<hop> route;
  uint32_t hop_index = 0;
  sampling_state sampling;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, step_request& x) {
  return f(caf::meta::type_name("step_request"), x.session, x.epoch, x.step_id, x.mode, x.past_len,
           guard(x.positions), guard(x.tokens), x.hidden, x.recipe, guard(x.route), x.hop_index, x.sampling);
}

/// Why a shard holds no usable cache for a request.
enum class miss_reason : uint8_t {
  unknown_session = 1,
  evicted_ttl = 2,
  evicted_lru = 3,
  released = 4,
  superseded = 5,
  seq_mismatch = 6,
};
constexpr std::size_t miss_reason_count = 7; // index 0 unused
const char* to_string(miss_reason r);

enum class reply_kind : uint8_t { token = 0, cache_miss = 1 };

/// The answer to a step: the tail's sampled token, or a cache miss from any hop.
struct step_reply {
  std::string session;
  int64_t epoch = 0;
  int64_t step_id = 0;
  uint8_t kind = 0; // reply_kind
  int32_t token = -1;
  uint64_t rng_state = 0;
  uint8_t miss = 0;     // miss_reason when kind == cache_miss
  int64_t miss_hop = -1; // which hop missed
  std::string detail;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, step_reply& x) {
  return f(caf::meta::type_name("step_reply"), x.session, x.epoch, x.step_id, x.kind, x.token, x.rng_state, x.miss,
           x.miss_hop, x.detail);
}

/// A shard's counters, for `status` and metrics.
struct shard_stats {
  int64_t first = 0;
  int64_t last = 0;
  uint64_t cache_bytes = 0;
  uint64_t sessions = 0;
  uint64_t hits = 0;
  std::vector<uint64_t> misses; // by miss_reason
  uint64_t evictions = 0;
  uint64_t steps = 0;
  uint64_t duplicates = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, shard_stats& x) {
  return f(caf::meta::type_name("shard_stats"), x.first, x.last, x.cache_bytes, x.sessions, x.hits,
           guard(x.misses), x.evictions, x.steps, x.duplicates);
}

/// Streamed to a generation's client for every token, in order.
struct token_event {
  std::string session;
  int64_t index = 0;
  int32_t token = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, token_event& x) {
  return f(caf::meta::type_name("token_event"), x.session, x.index, x.token);
}

/// The end of a generation.
struct generation_result {
  std::string session;
  std::vector<int32_t> ids;
  std::string finish; // stop | length | context
  double prefill_ms = 0;
  double total_ms = 0;
  uint64_t steps = 0;
  uint64_t reprefills = 0;
  uint64_t retries = 0;
  std::vector<uint64_t> misses; // by miss_reason
  uint64_t route_changes = 0;
  uint64_t recomputed_tokens = 0; ///< tokens processed again by re-prefills
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, generation_result& x) {
  return f(caf::meta::type_name("generation_result"), x.session, guard(x.ids), x.finish, raw(x.prefill_ms), raw(x.total_ms),
           x.steps, x.reprefills, x.retries, guard(x.misses), x.route_changes, x.recomputed_tokens);
}

/// A generation's request: prompt ids, limits, sampling.
struct generation_request {
  std::string session; // empty: the session picks one
  std::vector<int32_t> prompt;
  int64_t max_tokens = 128;
  sampling_state sampling; // rng_state = the seed
  std::vector<int32_t> stop_ids;
  /// Token counts after which the session pauses until the client sends
  /// (resume_atom): deterministic points to inject failures at.
  std::vector<int64_t> pause_after;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, generation_request& x) {
  return f(caf::meta::type_name("generation_request"), x.session, guard(x.prompt), x.max_tokens, x.sampling,
           guard(x.stop_ids), guard(x.pause_after));
}

} // namespace strata::msg

CAF_BEGIN_TYPE_ID_BLOCK(strata, caf::first_custom_type_id)
  CAF_ADD_TYPE_ID(strata, (strata::msg::tensor_blob))
  CAF_ADD_TYPE_ID(strata, (strata::msg::cache_recipe))
  CAF_ADD_TYPE_ID(strata, (strata::msg::hop))
  CAF_ADD_TYPE_ID(strata, (strata::msg::route_info))
  CAF_ADD_TYPE_ID(strata, (strata::msg::sampling_state))
  CAF_ADD_TYPE_ID(strata, (strata::msg::step_request))
  CAF_ADD_TYPE_ID(strata, (strata::msg::step_reply))
  CAF_ADD_TYPE_ID(strata, (strata::msg::shard_stats))
  CAF_ADD_TYPE_ID(strata, (strata::msg::token_event))
  CAF_ADD_TYPE_ID(strata, (strata::msg::generation_result))
  CAF_ADD_TYPE_ID(strata, (strata::msg::generation_request))
  CAF_ADD_TYPE_ID(strata, (std::vector<strata::msg::hop>))
  CAF_ADD_ATOM(strata, strata::atom, release_atom, "release")
  CAF_ADD_ATOM(strata, strata::atom, register_atom, "register")
  CAF_ADD_ATOM(strata, strata::atom, route_atom, "route")
  CAF_ADD_ATOM(strata, strata::atom, bump_atom, "bump")
  CAF_ADD_ATOM(strata, strata::atom, subscribe_atom, "subscribe")
  CAF_ADD_ATOM(strata, strata::atom, evict_atom, "evict")
  CAF_ADD_ATOM(strata, strata::atom, desync_atom, "desync")
  CAF_ADD_ATOM(strata, strata::atom, dup_atom, "dup")
  CAF_ADD_ATOM(strata, strata::atom, stats_atom, "stats")
  CAF_ADD_ATOM(strata, strata::atom, generate_atom, "generate")
  CAF_ADD_ATOM(strata, strata::atom, step_atom, "step")
  CAF_ADD_ATOM(strata, strata::atom, cancel_atom, "cancel")
  CAF_ADD_ATOM(strata, strata::atom, retry_atom, "retry")
  CAF_ADD_ATOM(strata, strata::atom, tick_atom, "tick")
  CAF_ADD_ATOM(strata, strata::atom, resume_atom, "resume")
  CAF_ADD_ATOM(strata, strata::atom, crash_atom, "crash")
  CAF_ADD_ATOM(strata, strata::atom, freeze_atom, "freeze")
CAF_END_TYPE_ID_BLOCK(strata)

namespace strata::msg {
/// Registers the block and the error renderer with a config.
void register_types(caf::actor_system_config& cfg);
} // namespace strata::msg
