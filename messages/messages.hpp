#pragma once
// Every message type of strata's actor layer, with `inspect`, and the one
// type-ID block that registers them (plus the atoms). Torch-free.

#include "messages/error.hpp"
#include "model/transformer/shard.hpp"

#include <caf/all.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace strata::atom {
// (CAF_ADD_ATOM in 0.17.6 is only this alias; the atoms come first so that the
// typed interfaces below can name them.)
using release_atom = caf::atom_constant<caf::atom("release")>;
constexpr release_atom release_atom_v = release_atom{};
using register_atom = caf::atom_constant<caf::atom("register")>;
constexpr register_atom register_atom_v = register_atom{};
using route_atom = caf::atom_constant<caf::atom("route")>;
constexpr route_atom route_atom_v = route_atom{};
using bump_atom = caf::atom_constant<caf::atom("bump")>;
constexpr bump_atom bump_atom_v = bump_atom{};
using subscribe_atom = caf::atom_constant<caf::atom("subscribe")>;
constexpr subscribe_atom subscribe_atom_v = subscribe_atom{};
using evict_atom = caf::atom_constant<caf::atom("evict")>;
constexpr evict_atom evict_atom_v = evict_atom{};
using desync_atom = caf::atom_constant<caf::atom("desync")>;
constexpr desync_atom desync_atom_v = desync_atom{};
using dup_atom = caf::atom_constant<caf::atom("dup")>;
constexpr dup_atom dup_atom_v = dup_atom{};
using stats_atom = caf::atom_constant<caf::atom("stats")>;
constexpr stats_atom stats_atom_v = stats_atom{};
using generate_atom = caf::atom_constant<caf::atom("generate")>;
constexpr generate_atom generate_atom_v = generate_atom{};
using step_atom = caf::atom_constant<caf::atom("step")>;
constexpr step_atom step_atom_v = step_atom{};
using cancel_atom = caf::atom_constant<caf::atom("cancel")>;
constexpr cancel_atom cancel_atom_v = cancel_atom{};
using retry_atom = caf::atom_constant<caf::atom("retry")>;
constexpr retry_atom retry_atom_v = retry_atom{};
using tick_atom = caf::atom_constant<caf::atom("tick")>;
constexpr tick_atom tick_atom_v = tick_atom{};
using round_atom = caf::atom_constant<caf::atom("round")>;
constexpr round_atom round_atom_v = round_atom{};
using resume_atom = caf::atom_constant<caf::atom("resume")>;
constexpr resume_atom resume_atom_v = resume_atom{};
using crash_atom = caf::atom_constant<caf::atom("crash")>;
constexpr crash_atom crash_atom_v = crash_atom{};
using freeze_atom = caf::atom_constant<caf::atom("freeze")>;
constexpr freeze_atom freeze_atom_v = freeze_atom{};
using model_atom = caf::atom_constant<caf::atom("model")>;
constexpr model_atom model_atom_v = model_atom{};
using lease_atom = caf::atom_constant<caf::atom("lease")>;
constexpr lease_atom lease_atom_v = lease_atom{};
using heartbeat_atom = caf::atom_constant<caf::atom("heartbeat")>;
constexpr heartbeat_atom heartbeat_atom_v = heartbeat_atom{};
using status_atom = caf::atom_constant<caf::atom("status")>;
constexpr status_atom status_atom_v = status_atom{};
using propose_atom = caf::atom_constant<caf::atom("propose")>;
constexpr propose_atom propose_atom_v = propose_atom{};
} // namespace strata::atom

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

template <class F>
struct bits;
template <class F>
bits<F> raw(F& x);

/// One element: floating point travels as its bit pattern (see `bits`).
template <class Inspector, class T>
typename Inspector::result_type element(Inspector& f, T& v) {
  if constexpr (std::is_floating_point_v<T>) {
    auto b = raw(v);
    return f(b);
  } else {
    return f(v);
  }
}

template <class Inspector, class T>
typename Inspector::result_type inspect(Inspector& f, guarded<T>& g) {
  if constexpr (Inspector::reads_state) {
    if constexpr (std::is_floating_point_v<T> && std::is_base_of_v<caf::serializer, Inspector>) {
      size_t n = g.xs.size();
      if (auto err = f.begin_sequence(n))
        return err;
      for (auto& v : g.xs)
        if (auto err = element(f, v))
          return err;
      return f.end_sequence();
    } else {
      return f(g.xs);
    }
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
        if (auto err = element(f, v))
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

/// The secret that binds a session's caches to the session that made them. The
/// session actor mints it (128 random bits) and carries it in every step and
/// release; a shard refuses a step or release for an existing session id that
/// carries another key (ec::session_conflict). It is never logged or shown.
struct session_key {
  uint64_t hi = 0;
  uint64_t lo = 0;
  bool empty() const { return hi == 0 && lo == 0; }
  friend bool operator==(const session_key&, const session_key&) = default;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, session_key& x) {
  return f(caf::meta::type_name("session_key"), x.hi, x.lo);
}

struct step_request;
struct step_reply;
struct shard_stats;
struct route_info;
struct model_facts;
struct cache_recipe;
struct cluster_status;

/// A shard actor as sessions and the supervisor see it (production interface).
///   step_request                      -> step_reply (token or cache_miss) | error;
///                                        non-tail shards delegate along the route
///   (release_atom, session, key)      -> drops the session's caches (owner only)
///   (lease_atom, session, key)        -> renews the session's lease (owner only)
///   (stats_atom)                      -> shard_stats
using shard_actor = caf::typed_actor<caf::replies_to<step_request>::with<step_reply>,
                                     caf::reacts_to<atom::release_atom, std::string, session_key>,
                                     caf::reacts_to<atom::lease_atom, std::string, session_key>,
                                     caf::replies_to<atom::stats_atom>::with<shard_stats>>;

/// Failure injection on a shard: a separate interface, held only by tools and
/// tests that inject (never by sessions or the supervisor).
///   (evict_atom, session, uint8 reason) -> drops one session's caches ("" = all)
///   (desync_atom, session)              -> the session's next request is treated as carrying a wrong past_len
///   (dup_atom, session)                 -> the session's next decode request is applied twice
///   (crash_atom)                        -> the node process exits abruptly (nodes only)
///   (freeze_atom, ms)                   -> the node process stops answering for ms (nodes only)
using shard_injection_actor = caf::typed_actor<caf::replies_to<atom::evict_atom, std::string, uint8_t>::with<void>,
                                               caf::replies_to<atom::desync_atom, std::string>::with<void>,
                                               caf::replies_to<atom::dup_atom, std::string>::with<void>,
                                               caf::replies_to<atom::crash_atom>::with<void>,
                                               caf::replies_to<atom::freeze_atom, int64_t>::with<void>>;

/// What a shard actor implements: both.
using shard_full_actor = shard_actor::extend_with<shard_injection_actor>;

/// The route supervisor as shard nodes, sessions and clients see it.
///   (register_atom, shard, first, last, recipe, facts, address) -> int64 epoch | incompatible_recipe
///   (route_atom, vector<shard_actor> avoid) -> route_info (waits up to route_wait) | no_route
///   (subscribe_atom)          -> the sender (a session) gets route_info on every change
///   (stats_atom)              -> route_info: the current plan
///   (get_atom)                -> route_info listing every registered shard
///   (model_atom)              -> model_facts of the cluster's model (vocab_size 0: none yet)
///   (heartbeat_atom, shard)   -> a registered shard's node is alive (every 500 ms)
///   (status_atom)             -> cluster_status: every shard with address, liveness, incarnation; the plan
using supervisor_actor =
  caf::typed_actor<caf::replies_to<atom::register_atom, shard_actor, int64_t, int64_t, cache_recipe, model_facts,
                                   std::string>::with<int64_t>,
                   caf::replies_to<atom::route_atom, std::vector<shard_actor>>::with<route_info>,
                   caf::reacts_to<atom::subscribe_atom>, caf::replies_to<atom::stats_atom>::with<route_info>,
                   caf::replies_to<caf::get_atom>::with<route_info>, caf::replies_to<atom::model_atom>::with<model_facts>,
                   caf::reacts_to<atom::heartbeat_atom, shard_actor>,
                   caf::replies_to<atom::status_atom>::with<cluster_status>>;

/// Failure injection on the supervisor: (bump_atom) -> the new epoch.
using supervisor_injection_actor = caf::typed_actor<caf::replies_to<atom::bump_atom>::with<int64_t>>;

struct token_event;
struct generation_result;

/// What a session sends its client: every token_event in order, then one
/// generation_result or one caf::error. (Blocking clients hold an untyped
/// scoped_actor and actor_cast it to this.)
using session_client_actor = caf::typed_actor<caf::reacts_to<token_event>, caf::reacts_to<generation_result>,
                                              caf::reacts_to<caf::error>>;

/// The session actor as its client and the supervisor see it.
///   route_info                    -> (from the supervisor) the route changed
///   (resume_atom)                 -> go on after a pause_after point
///   (cancel_atom)                 -> end now with ec::cancelled
///   (register_atom, supervisor)   -> follow a restarted coordinator
using session_actor = caf::typed_actor<caf::reacts_to<route_info>, caf::reacts_to<atom::resume_atom>,
                                       caf::reacts_to<atom::cancel_atom>,
                                       caf::reacts_to<atom::register_atom, supervisor_actor>>;

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
  std::string kv_dtype = "f32"; // how the KV cache keeps keys and values
  int64_t n_layers = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;

  static cache_recipe of(const model::ModelConfig& cfg);
  friend bool operator==(const cache_recipe&, const cache_recipe&) = default;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, cache_recipe& x) {
  return f(caf::meta::type_name("cache_recipe"), x.architecture, x.model, x.dtype, x.kv_dtype, x.n_layers,
           x.n_kv_heads, x.head_dim);
}

/// What a client needs to know of the cluster's model, without its files: the
/// shard nodes report it when they register; clients ask the supervisor.
struct model_facts {
  std::string architecture;
  std::string model;     ///< identity: checkpoint path or builtin:NAME
  int64_t n_layers = 0;
  int64_t vocab_size = 0; ///< 0: no shard has registered yet
  int64_t max_seq_len = 0;
  int32_t bos_id = -1;
  std::vector<int32_t> eos_ids;
  std::string tokenizer; ///< the model's own tokenizer ("builtin:bytes"), or "" (bring one)
  // What kind of model it is, for status and /v1/models.
  int64_t n_experts = 0;      ///< mixture of experts: experts per layer (0: dense)
  int64_t n_experts_used = 0; ///< ... of them active per token
  int64_t sliding_window = 0; ///< local layers attend to this many positions (0: none)
  int64_t swa_pattern = 0;    ///< which layers are local (model::ModelConfig::is_local)

  static model_facts of(const model::ModelConfig& cfg);
  /// A config with these facts (enough for stop rules, tokenizers and chat formats).
  model::ModelConfig to_config() const;
  friend bool operator==(const model_facts&, const model_facts&) = default;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, model_facts& x) {
  return f(caf::meta::type_name("model_facts"), x.architecture, x.model, x.n_layers, x.vocab_size, x.max_seq_len,
           x.bos_id, guard(x.eos_ids), x.tokenizer, x.n_experts, x.n_experts_used, x.sliding_window, x.swa_pattern);
}

/// One shard of a route.
struct hop {
  shard_actor shard;
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
  /// Parallel to hops: each shard node's advertised HOST:PORT ("" when it has
  /// none), so that processes connect to each other directly.
  std::vector<std::string> addresses;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, route_info& x) {
  return f(caf::meta::type_name("route_info"), x.epoch, guard(x.hops), x.recipe, guard(x.addresses));
}

/// One registered shard as the supervisor sees it (for `strata status`).
struct shard_status {
  hop shard;
  std::string address;     ///< advertised HOST:PORT ("" = none)
  int64_t silent_ms = -1;  ///< since its node's last heartbeat (-1: none yet)
  int64_t incarnation = 1; ///< registrations from this address so far (restarts count up)
  int64_t since_ms = 0;    ///< registered at (ms since 1970)
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, shard_status& x) {
  return f(caf::meta::type_name("shard_status"), x.shard, x.address, x.silent_ms, x.incarnation, x.since_ms);
}

/// The supervisor's whole view: every registered shard and the current plan.
struct cluster_status {
  int64_t epoch = 0;
  cache_recipe recipe;
  std::vector<shard_status> shards; ///< in registration order
  route_info plan;                  ///< the current complete chain (no hops: none)
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, cluster_status& x) {
  return f(caf::meta::type_name("cluster_status"), x.epoch, x.recipe, guard(x.shards), x.plan);
}

/// Sampling settings plus the generator state the tail continues from.
struct sampling_state {
  float temperature = 0;
  int32_t top_k = 0;
  float top_p = 1;
  uint64_t rng_state = 0;
  float min_p = 0;
  float presence_penalty = 0;   ///< OpenAI: minus this from each generated token's logit
  float frequency_penalty = 0;  ///< OpenAI: minus this times each generated token's count
  float repetition_penalty = 1; ///< transformers / vLLM: prompt and generated tokens' logits / (or *) this
  int32_t logprobs = -1;        ///< -1: none; 0: the chosen token's; k > 0: and the k most likely
  /// The tokens the penalties apply to (the session fills these each step when
  /// a penalty is set): distinct ids, and how often each was generated (0 for
  /// a prompt token that only the repetition penalty sees).
  std::vector<int32_t> penalty_ids;
  std::vector<int32_t> penalty_counts;
  /// Constrained decoding (structured outputs): the tokens the step may emit,
  /// as ids or as bits over the vocabulary (bit i of word i / 64); both empty:
  /// any. The session computes them from its grammar state each step; the tail
  /// masks every other token's logit to -inf before sampling.
  std::vector<int32_t> allowed_ids;
  std::vector<uint64_t> allowed_bits;
  bool constrained() const { return !allowed_ids.empty() || !allowed_bits.empty(); }
  bool penalized() const { return presence_penalty != 0 || frequency_penalty != 0 || repetition_penalty != 1; }
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sampling_state& x) {
  return f(caf::meta::type_name("sampling_state"), raw(x.temperature), x.top_k, raw(x.top_p), x.rng_state,
           raw(x.min_p), raw(x.presence_penalty), raw(x.frequency_penalty), raw(x.repetition_penalty), x.logprobs,
           guard(x.penalty_ids), guard(x.penalty_counts), guard(x.allowed_ids), guard(x.allowed_bits));
}

enum class step_mode : uint8_t { prefill = 0, decode = 1 };

/// One step of one session through a route. The head gets `tokens`; every
/// later hop gets the previous hop's `hidden`.
///
/// `past_len` is how many positions each kept hop already holds. A hop is
/// *rebuilt* when the step is a prefill (every hop) or its bit is set in
/// `rebuild`: it opens a fresh cache and gets its input rows for every position
/// from 0; a kept hop gets rows from past_len only. So `positions` (and the rows
/// of `tokens` / `hidden`) start at 0 on a rebuilt hop and at past_len on a kept
/// one; each hop builds the next hop's request from what it keeps (kv_cache.hpp:
/// every shard but the tail keeps the rows it sent).
///
/// `blocks` names the prefix-cache identities of the full blocks from block
/// `blocks_from` on (two words each: hi, lo); the head makes them from the
/// tokens, later hops learn them here. `recomputed` adds up, hop by hop, the
/// layer-tokens rebuilt hops computed again for positions before past_len.
///
/// Speculative decoding: the last `draft` rows are proposed tokens, not yet
/// the model's. Every hop runs and keeps them like any row; the tail verifies
/// them (step_reply::accepted). The next step's past_len then tells every hop
/// how many positions really count: a hop holding more, all of them past the
/// rows it knew were certain, cuts its cache back to past_len (blocks go back
/// to the pool), as if the rejected rows never came.
struct step_request {
  std::string session;
  session_key key; ///< the owner's secret (see session_key)
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
  uint64_t rebuild = 0; ///< bit i: hop i rebuilds its cache from position 0
  int64_t blocks_from = 0;
  std::vector<uint64_t> blocks;
  uint64_t recomputed = 0;
  uint32_t draft = 0; ///< proposed tokens at the end of the rows (speculative decoding)
  /// Prompt log-probabilities (a prefill): -1 none; k in [0, 20]: the tail
  /// returns, for every prompt token after the first, its log-probability
  /// given the tokens before it and the k most likely there
  /// (step_reply::prompt_*). Later hops then get the step's tokens too.
  int32_t prompt_logprobs = -1;
};

/// Proposed tokens one step may carry (the tail's logits per row, and the
/// session's proposers, are bounded by it).
constexpr uint32_t max_draft = 15;

/// Routes longer than this cannot name their rebuilt hops (a 64-bit mask).
constexpr std::size_t max_route_hops = 64;

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, step_request& x) {
  return f(caf::meta::type_name("step_request"), x.session, x.key, x.epoch, x.step_id, x.mode, x.past_len,
           guard(x.positions), guard(x.tokens), x.hidden, x.recipe, guard(x.route), x.hop_index, x.sampling,
           x.rebuild, x.blocks_from, guard(x.blocks), x.recomputed, x.draft, x.prompt_logprobs);
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
  uint64_t recomputed = 0; // layer-tokens recomputed on the way (step_request::recomputed)
  float logprob = 0;                 ///< the token's log-probability (sampling_state::logprobs >= 0)
  std::vector<int32_t> top_ids;      ///< the most likely tokens, most likely first
  std::vector<float> top_logprobs;   ///< and their log-probabilities
  /// Speculative steps: the proposed tokens the tail took (a prefix of the
  /// step's draft rows); `token` is the model's own next token after them.
  std::vector<int32_t> accepted;
  /// step_request::prompt_logprobs: one entry per prompt token after the first,
  /// and k ids / log-probabilities per such token.
  std::vector<float> prompt_logprobs;
  std::vector<int32_t> prompt_top_ids;
  std::vector<float> prompt_top_logprobs;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, step_reply& x) {
  return f(caf::meta::type_name("step_reply"), x.session, x.epoch, x.step_id, x.kind, x.token, x.rng_state, x.miss,
           x.miss_hop, x.detail, x.recomputed, raw(x.logprob), guard(x.top_ids), guard(x.top_logprobs),
           guard(x.accepted), guard(x.prompt_logprobs), guard(x.prompt_top_ids), guard(x.prompt_top_logprobs));
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
  uint64_t conflicts = 0; ///< steps/releases refused with session_conflict
  uint64_t orphans = 0;   ///< sessions dropped because their owner ended or its lease ran out
  // The block pool (model/kv_cache.hpp) and the scheduler (actors/scheduler.hpp).
  uint64_t pool_blocks = 0; ///< capacity in blocks
  uint64_t pool_used = 0;   ///< blocks in use
  uint64_t block_bytes = 0;
  uint64_t queued = 0;      ///< steps waiting now
  uint64_t rounds = 0;      ///< batched forward passes run
  uint64_t batched_rows = 0; ///< input rows over all rounds (rows / rounds = mean batch)
  uint64_t max_batch = 0;   ///< most sequences in one round
  uint64_t overloaded = 0;  ///< steps refused because the queue was full
  uint64_t computed = 0;    ///< layer-tokens computed (rows run x the shard's layers)
  uint64_t recomputed = 0;  ///< ... of them for positions a rebuilt cache had held (recovery)
  uint64_t prefix_hit_tokens = 0;  ///< positions taken from the prefix cache instead of computed
  uint64_t prefix_blocks = 0;      ///< blocks published in the prefix cache now
  uint64_t prefix_cached = 0;      ///< ... of them that nobody uses now (reclaimable)
  uint64_t window_used = 0;        ///< blocks of the sliding-window layers' pool in use (the windows' keys and values)
  uint64_t window_block_bytes = 0; ///< bytes of one of them (0: the shard has no sliding-window layer)
  std::string kv_dtype = "f32";     ///< how the pool keeps keys and values
  uint64_t kv_bytes_per_token = 0;  ///< keys and values of one position over the shard's layers
  uint64_t kept_bytes_per_token = 0; ///< the output row kept per position for recovery (0: the tail)
  uint64_t rolled_back = 0;          ///< positions of rejected proposals cut from caches (speculative decoding)
  std::string kernels;               ///< the kernel builds the node's CPU runs (model::kernel_builds)
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, shard_stats& x) {
  return f(caf::meta::type_name("shard_stats"), x.first, x.last, x.cache_bytes, x.sessions, x.hits,
           guard(x.misses), x.evictions, x.steps, x.duplicates, x.conflicts, x.orphans, x.pool_blocks, x.pool_used,
           x.block_bytes, x.queued, x.rounds, x.batched_rows, x.max_batch, x.overloaded, x.computed, x.recomputed,
           x.prefix_hit_tokens, x.prefix_blocks, x.prefix_cached, x.window_used, x.window_block_bytes, x.kv_dtype,
           x.kv_bytes_per_token, x.kept_bytes_per_token, x.rolled_back, x.kernels);
}

/// Streamed to a generation's client for every token, in order.
struct token_event {
  std::string session;
  int64_t index = 0;
  int32_t token = 0;
  float logprob = 0;               ///< when the request asked for logprobs
  std::vector<int32_t> top_ids;    ///< top_logprobs: most likely first
  std::vector<float> top_logprobs;
  /// The first event of a generation that asked for prompt_logprobs: the
  /// prompt's (as generation_result's), so a stream can echo it first.
  std::vector<float> prompt_logprobs;
  std::vector<int32_t> prompt_top_ids;
  std::vector<float> prompt_top_logprobs;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, token_event& x) {
  return f(caf::meta::type_name("token_event"), x.session, x.index, x.token, raw(x.logprob), guard(x.top_ids),
           guard(x.top_logprobs), guard(x.prompt_logprobs), guard(x.prompt_top_ids), guard(x.prompt_top_logprobs));
}

/// The end of a generation.
struct generation_result {
  std::string session;
  std::vector<int32_t> ids;
  std::string finish; // stop | length | context
  double prefill_ms = 0;
  double total_ms = 0;
  uint64_t steps = 0;
  uint64_t reprefills = 0;          ///< steps that rebuilt the caches of one or more hops (recoveries)
  uint64_t retries = 0;
  std::vector<uint64_t> misses; // by miss_reason
  uint64_t route_changes = 0;
  uint64_t recomputed_tokens = 0;   ///< positions that recoveries had to rebuild (each recovered step's past_len)
  uint64_t recomputed_layer_tokens = 0; ///< what the rebuilt hops computed again, in layers x positions
  uint64_t full_layer_tokens = 0;   ///< what a full re-prefill of every layer would have recomputed instead
  uint64_t proposed = 0;            ///< speculative decoding: tokens proposed
  uint64_t accepted = 0;            ///< ... of them the model took
  uint64_t declined = 0;            ///< steps the draft model proposed nothing for (a crowd: DrafterLimits::max_crowd)
  /// generation_request::prompt_logprobs: as step_reply's (the prompt's tokens
  /// after the first, each with k alternatives).
  std::vector<float> prompt_logprobs;
  std::vector<int32_t> prompt_top_ids;
  std::vector<float> prompt_top_logprobs;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, generation_result& x) {
  return f(caf::meta::type_name("generation_result"), x.session, guard(x.ids), x.finish, raw(x.prefill_ms), raw(x.total_ms),
           x.steps, x.reprefills, x.retries, guard(x.misses), x.route_changes, x.recomputed_tokens,
           x.recomputed_layer_tokens, x.full_layer_tokens, x.proposed, x.accepted, x.declined, guard(x.prompt_logprobs),
           guard(x.prompt_top_ids), guard(x.prompt_top_logprobs));
}

/// A generation's request: prompt ids, limits, sampling.
struct generation_request {
  std::string session; // from mint_session_id(); empty: the session mints one
  std::vector<int32_t> prompt;
  int64_t max_tokens = 128;
  sampling_state sampling; // rng_state = the seed
  std::vector<int32_t> stop_ids;
  /// Token counts after which the session pauses until the client sends
  /// (resume_atom): deterministic points to inject failures at.
  std::vector<int64_t> pause_after;
  /// Speculative decoding by prompt lookup: at most this many proposed tokens
  /// per step (0: off; at most max_draft). Proposals come from the session's
  /// own tokens (the longest recent n-gram match); how many adapts to how many
  /// the model takes. Not with penalties or logprobs (the session then steps
  /// one token at a time).
  uint32_t speculate = 0;
  /// Constrained decoding: a grammar (model/text/grammar.hpp's text form; empty:
  /// none) every generated text follows. Needs a session whose options carry
  /// the tokenizer's vocabulary. Steps one token at a time.
  std::string grammar;
  /// Prompt log-probabilities (echo, log-likelihood scoring): -1 none; k in
  /// [0, 20] (generation_result::prompt_*). With max_tokens 0 the session runs
  /// the prompt and ends without a token.
  int32_t prompt_logprobs = -1;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, generation_request& x) {
  return f(caf::meta::type_name("generation_request"), x.session, guard(x.prompt), x.max_tokens, x.sampling,
           guard(x.stop_ids), guard(x.pause_after), x.speculate, x.grammar, x.prompt_logprobs);
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
  CAF_ADD_TYPE_ID(strata, (strata::msg::session_key))
  CAF_ADD_TYPE_ID(strata, (strata::msg::model_facts))
  CAF_ADD_TYPE_ID(strata, (strata::msg::shard_actor))
  CAF_ADD_TYPE_ID(strata, (std::vector<strata::msg::shard_actor>))
  CAF_ADD_TYPE_ID(strata, (strata::msg::supervisor_actor))
  CAF_ADD_TYPE_ID(strata, (strata::msg::shard_status))
  CAF_ADD_TYPE_ID(strata, (strata::msg::cluster_status))
  CAF_ADD_TYPE_ID(strata, (std::vector<int32_t>))
CAF_END_TYPE_ID_BLOCK(strata)

namespace strata::msg {
/// Registers the block and the error renderer with a config.
void register_types(caf::actor_system_config& cfg);
} // namespace strata::msg
