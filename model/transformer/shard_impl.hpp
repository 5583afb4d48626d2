#pragma once
// Internal to model/: what a Shard holds (weights, RoPE tables, scratch) and the
// batched forward pass over it (forward.cpp). Includes ATen.

#include "model/transformer/kv_cache.hpp"
#include "model/transformer/shard.hpp"
#include "model/transformer/weights.hpp"

#include <atomic>
#include <vector>

namespace strata::model {

/// Scratch buffers reused across calls; they grow to the largest batch seen.
struct Workspace {
  std::vector<float> x;    // (R, dim) residual stream
  std::vector<float> xb;   // (R, dim) normalized input of a sub-block
  std::vector<float> qkv;  // (R, q_dim + 2*kv_dim)
  std::vector<float> att;  // (R, q_dim) attention output, heads concatenated
  std::vector<float> h13;  // (R, 2*hidden) gate | up
  std::vector<float> hb;   // (R, hidden) SwiGLU output
  std::vector<float> xn;     // (S, dim) final-normed last rows
  std::vector<float> logits; // (S, vocab)
  std::vector<float> tmp;    // (R, dim) a sub-block's output before its post-norm (sandwich norms)
  // Mixture of experts: router logits, each row's chosen experts and weights,
  // and one expert's gathered rows.
  std::vector<float> router;      // (R, n_experts)
  std::vector<int32_t> chosen;    // (R, n_experts_used)
  std::vector<float> weight;      // (R, n_experts_used)
  // Attention items spread over threads: each item's scores, and the heads'
  // maxima of each of its spans of keys.
  std::vector<float> att_scores;
  std::vector<float> att_max;
};

struct Shard::Impl {
  ModelConfig cfg;
  LayerRange range;
  detail::ShardWeights w;
  uint64_t uid = 0;
  WType kv_type = WType::f32; // LoadOptions::kv_dtype
  std::vector<float> rope_cos, rope_sin; // (max_seq_len, head_dim / 2)
  std::vector<float> rope_cos_local, rope_sin_local; // local layers' own base (gemma3), else empty
  Workspace ws;
  std::shared_ptr<BlockPool> default_pool; // for new_cache(): unbounded, made on first use

  // Every shard but the tail keeps its output rows beside its keys and values.
  CacheShape cache_shape() const {
    CacheShape s{range.count(), cfg.kv_dim(), range.last == cfg.n_layers - 1 ? 0 : cfg.dim, {}, 0, kv_type, cfg.head_dim};
    if (cfg.sliding_window > 0 && cfg.sliding_window < cfg.max_seq_len) {
      s.window = cfg.sliding_window;
      for (int64_t l = range.first; l <= range.last; ++l)
        s.local.push_back(cfg.is_local(l) ? 1 : 0);
    }
    return s;
  }
  void build_rope();
  /// The batched forward pass (forward.cpp).
  std::vector<SeqOutcome> run(std::span<const SeqStep> batch);
};

} // namespace strata::model
