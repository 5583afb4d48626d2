#pragma once
// Internal to model/: where weights come from. A TensorSource reads one checkpoint
// format (one loader file each: loader_gguf, loader_llama2c, loader_hf, loader_builtin)
// and serves its tensors under canonical names. Never include it outside model/.

#include "model/base/config.hpp"
#include "model/formats/wmatrix.hpp"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace strata::model::detail {

/// A checkpoint seen through canonical tensor names:
///   "embed" (vocab, dim), "cls" (vocab, dim), "norm" (dim) and per layer i
///   "L<i>.attn_norm" (dim), "L<i>.wq" (q_dim, dim), "L<i>.wk"/"L<i>.wv" (kv_dim, dim),
///   "L<i>.bq" (q_dim), "L<i>.bk"/"L<i>.bv" (kv_dim), "L<i>.wo" (dim, q_dim),
///   "L<i>.ffn_norm" (dim), "L<i>.w1" gate (hidden, dim), "L<i>.w3" up (hidden, dim),
///   "L<i>.w2" down (dim, hidden);
///   fused where a family stores them so (phi3): "L<i>.wqkv" (q_dim + 2 kv_dim, dim),
///   "L<i>.w13" gate | up (2 hidden, dim);
///   "L<i>.q_norm" / "L<i>.k_norm" (head_dim), "L<i>.post_attn_norm" / "L<i>.post_ffn_norm" (dim);
///   experts (MoE): "L<i>.router" (n_experts, dim), and the 3-D "L<i>.experts_w1" / "L<i>.experts_w3"
///   (n_experts x (expert_hidden, dim)) and "L<i>.experts_w2" (n_experts x (dim, expert_hidden)).
/// Weights are (out_features, in_features), row-major, as in torch.nn.Linear.
class TensorSource {
public:
  virtual ~TensorSource() = default;
  virtual const ModelConfig& config() const = 0;
  /// A float32 copy of tensor `name` (row-major), checked against `shape`.
  /// Throws Error(missing_tensor / corrupt) naming the file and tensor.
  virtual std::vector<float> load(const std::string& name, const std::vector<int64_t>& shape) = 0;
  /// Matrix `name` (rows, cols) in the type the file stores it in where that is
  /// a resident type (GGUF: in place in the mapped file); the default widens
  /// through load() to f32. Must be safe to call from several threads at once.
  virtual WMatrix load_matrix(const std::string& name, int64_t rows, int64_t cols);
  /// Whether the file's own types are kept (GGUF): then --dtype may not convert.
  virtual bool native_types() const { return false; }
  /// Whether the checkpoint holds tensor `name` (e.g. a fused "L0.wqkv").
  virtual bool has(const std::string& name) const { (void)name; return false; }
  /// The `n` matrices (rows, cols) of a 3-D tensor of experts, each in the
  /// file's own type (views into one mapping). Throws Error(unsupported) from
  /// sources without experts.
  virtual std::vector<WMatrix> load_experts(const std::string& name, int64_t n, int64_t rows, int64_t cols);
};

std::unique_ptr<TensorSource> open_llama2c(const std::string& path);
std::unique_ptr<TensorSource> open_hf_dir(const std::string& dir);
std::unique_ptr<TensorSource> open_builtin(const std::string& name);
std::unique_ptr<TensorSource> open_gguf(const std::string& path);
/// Whether `path` starts with the GGUF magic.
bool is_gguf_file(const std::string& path);
/// Dispatches on the spec: "builtin:NAME", a directory (HF), a file starting
/// with the GGUF magic, or another file (llama2.c).
std::unique_ptr<TensorSource> open_source(const std::string& spec);

/// The dtype name a model is served in (what recipes compare): "f32", "bf16",
/// "q8_0", "q4_0", "q4_K", or for GGUF files "gguf:" + the file's type (e.g. gguf:q4_K_M).
/// Throws Error(bad_argument) for an unknown `dtype` or one a GGUF file cannot take.
std::string resolve_dtype(const TensorSource& src, const std::string& dtype);

/// "[a, b, c]", for errors naming a shape.
std::string shape_str(const std::vector<int64_t>& s);
/// Splits "L12.wq" into (12, "wq"); nullopt for global names ("embed", "norm", ...).
std::optional<std::pair<int64_t, std::string>> split_layer_name(const std::string& name);

} // namespace strata::model::detail
