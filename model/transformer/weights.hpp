#pragma once
// Internal to model/: how a shard holds its weights (ShardWeights) and how they are
// loaded from any TensorSource. Includes ATen; never include it outside model/.

#include "model/base/config.hpp"
#include "model/formats/source.hpp"
#include "model/formats/wmatrix.hpp"

#include <ATen/ATen.h>

#include <vector>

namespace strata::model::detail {

struct LayerWeights {
  at::Tensor attn_norm; // (dim)
  Linear wqkv;          // (q_dim + 2*kv_dim, dim): q rows, then k, then v
  at::Tensor bqkv;      // (q_dim + 2*kv_dim) or undefined when the model has no bias
  Linear wo;            // (dim, q_dim)
  at::Tensor ffn_norm;  // (dim)
  Linear w13;           // (2*hidden, dim): gate rows, then up rows
  Linear w2;            // (dim, hidden)
};

struct ShardWeights {
  WMatrix embedding;                // (vocab, dim), head only
  std::vector<LayerWeights> layers; // range.count() entries
  at::Tensor final_norm;            // (dim), tail only
  WMatrix classifier;               // (vocab, dim), tail only; may share memory with embedding
};

/// Loads what layers `range` need from `src`, layers in parallel.
ShardWeights load_weights(TensorSource& src, LayerRange range, const LoadOptions& options);

} // namespace strata::model::detail
