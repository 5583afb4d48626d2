#pragma once
// Internal to model/: where weights come from (TensorSource) and how a shard
// holds them (ShardWeights). Includes ATen; never include it outside model/.

#include "model/config.hpp"

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

namespace strata::model::detail {

/// A checkpoint seen through canonical tensor names:
///   "embed" (vocab, dim), "cls" (vocab, dim), "norm" (dim) and per layer i
///   "L<i>.attn_norm" (dim), "L<i>.wq" (q_dim, dim), "L<i>.wk"/"L<i>.wv" (kv_dim, dim),
///   "L<i>.bq" (q_dim), "L<i>.bk"/"L<i>.bv" (kv_dim), "L<i>.wo" (dim, q_dim),
///   "L<i>.ffn_norm" (dim), "L<i>.w1" gate (hidden, dim), "L<i>.w3" up (hidden, dim),
///   "L<i>.w2" down (dim, hidden).
/// Weights are (out_features, in_features), row-major, as in torch.nn.Linear.
class TensorSource {
public:
  virtual ~TensorSource() = default;
  virtual const ModelConfig& config() const = 0;
  /// A float32 contiguous copy of tensor `name`, checked against `shape`.
  /// Throws Error(missing_tensor / corrupt) naming the file and tensor.
  virtual at::Tensor load(const std::string& name, const std::vector<int64_t>& shape) = 0;
};

std::unique_ptr<TensorSource> open_llama2c(const std::string& path);
std::unique_ptr<TensorSource> open_hf_dir(const std::string& dir);
std::unique_ptr<TensorSource> open_builtin(const std::string& name);
/// Dispatches on the spec: "builtin:NAME", a directory (HF) or a file (llama2.c).
std::unique_ptr<TensorSource> open_source(const std::string& spec);

struct LayerWeights {
  at::Tensor attn_norm; // (dim)
  at::Tensor wqkv;      // (q_dim + 2*kv_dim, dim): q rows, then k, then v
  at::Tensor bqkv;      // (q_dim + 2*kv_dim) or undefined when the model has no bias
  at::Tensor wo;        // (dim, q_dim)
  at::Tensor ffn_norm;  // (dim)
  at::Tensor w13;       // (2*hidden, dim): gate rows, then up rows
  at::Tensor w2;        // (dim, hidden)
  // Transposed views for multi-token matmuls (no copy).
  at::Tensor wqkv_t, wo_t, w13_t, w2_t;
};

struct ShardWeights {
  at::Tensor embedding;           // (vocab, dim), head only
  std::vector<LayerWeights> layers; // range.count() entries
  at::Tensor final_norm;          // (dim), tail only
  at::Tensor classifier;          // (vocab, dim), tail only; may share storage with embedding
};

/// Loads what layers `range` need from `src`.
ShardWeights load_weights(TensorSource& src, LayerRange range);

} // namespace strata::model::detail
