#pragma once
// Internal to model/: how a shard holds its weights (ShardWeights) and how they are
// loaded from any TensorSource. Never include it outside model/.

#include "model/base/config.hpp"
#include "model/formats/source.hpp"
#include "model/formats/wmatrix.hpp"

#include <vector>

namespace strata::model::detail {

struct LayerWeights {
  std::vector<float> attn_norm;      // (dim)
  Linear wqkv;               // (q_dim + 2*kv_dim, dim): q rows, then k, then v
  std::vector<float> bqkv;           // (q_dim + 2*kv_dim), or empty when the model has no bias
  std::vector<float> q_norm, k_norm; // (head_dim) each, with cfg.qk_norm
  Linear wo;                 // (dim, q_dim)
  std::vector<float> post_attn_norm; // (dim), with cfg.sandwich_norms
  std::vector<float> ffn_norm;       // (dim)
  Linear w13;                // (2*hidden, dim): gate rows, then up rows (dense FFN)
  Linear w2;                 // (dim, hidden)
  std::vector<float> post_ffn_norm;  // (dim), with cfg.sandwich_norms
  // Mixture of experts: the router and, per expert, its gate | up and down.
  WMatrix router;            // (n_experts, dim)
  std::vector<Linear> expert_w13; // each (2*expert_hidden, dim)
  std::vector<Linear> expert_w2;  // each (dim, expert_hidden)
};

struct ShardWeights {
  WMatrix embedding;                // (vocab, dim), head only
  std::vector<LayerWeights> layers; // range.count() entries
  std::vector<float> final_norm;    // (dim), tail only
  WMatrix classifier;               // (vocab, dim), tail only; may share memory with embedding
};

/// Loads what layers `range` need from `src`, layers in parallel.
ShardWeights load_weights(TensorSource& src, LayerRange range, const LoadOptions& options);

} // namespace strata::model::detail
