#pragma once
// ModelConfig: the architecture facts a shard needs. Torch-free.

#include <cstdint>
#include <string>
#include <vector>

namespace strata::model {

/// How rotary embeddings pair up the dimensions of a head.
enum class RotaryLayout : uint8_t {
  interleaved = 0, ///< llama2.c / Meta: pairs (2i, 2i+1)
  half = 1,        ///< Hugging Face "rotate_half": pairs (i, i + head_dim/2)
};

/// How rotary frequencies are scaled for long contexts, as Hugging Face's
/// `rope_scaling` defines each type (modeling_rope_utils): "none", "linear"
/// (frequencies / factor), "dynamic" (NTK: unscaled up to the original context,
/// which is where strata holds such models), "llama3" (low frequencies / factor, high kept, a
/// smooth blend between) and "yarn" (NTK-by-parts blend of interpolated and
/// extrapolated frequencies, cos/sin scaled by the attention factor).
/// `freq_factors` (GGUF `rope_freqs.weight`, how llama.cpp stores llama3
/// scaling): frequency i is divided by freq_factors[i].
struct RopeScaling {
  std::string type = "none";
  double factor = 1.0;
  double low_freq_factor = 1.0;       ///< llama3
  double high_freq_factor = 4.0;      ///< llama3
  int64_t original_max_position = 0;  ///< llama3, yarn
  double beta_fast = 32.0;            ///< yarn
  double beta_slow = 1.0;             ///< yarn
  double attention_factor = 0.0;      ///< yarn; 0: 0.1 ln(factor) + 1 (or from mscale)
  double mscale = 0.0, mscale_all_dim = 0.0; ///< yarn (DeepSeek style), 0 = unset
  bool truncate = true;               ///< yarn: round the correction range to whole dims
  std::vector<float> freq_factors;
  bool operator==(const RopeScaling&) const = default;
};

/// The gated FFN's activation: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma).
enum class FfnActivation : uint8_t { silu = 0, gelu_tanh = 1 };

struct ModelConfig {
  /// "llama" (Mixtral-style experts when n_experts > 0), "qwen2", "qwen3",
  /// "qwen3moe", "gemma2", "gemma3" or "phi3".
  std::string architecture = "llama";
  std::string identity;               ///< where it came from (path or builtin:NAME)
  int64_t dim = 0;
  int64_t hidden_dim = 0;
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t vocab_size = 0;
  int64_t max_seq_len = 0;
  double rope_theta = 10000.0;
  RotaryLayout rotary = RotaryLayout::interleaved;
  RopeScaling rope_scaling;
  double norm_eps = 1e-5;
  bool tied_embeddings = true;
  bool attention_bias = false;   ///< q/k/v projections carry a bias (Qwen2)
  int32_t bos_id = 1;            ///< -1 when the model has none
  std::vector<int32_t> eos_ids;  ///< generation stops on any of these
  /// How the weights are kept in memory: "f32", "bf16", "q8_0", "q4_0", or
  /// "gguf:" + the GGUF file's type (e.g. "gguf:q4_K_M"). Part of the cache recipe.
  std::string dtype = "f32";
  /// How a shard's KV cache keeps keys and values ("f32", "bf16", "f16",
  /// "q8_0": LoadOptions::kv_dtype). Part of the cache recipe.
  std::string kv_dtype = "f32";

  // What the families beyond Llama add (all off for llama and qwen2).
  bool qk_norm = false;           ///< per-head RMS norm of q and k before RoPE (qwen3, gemma3)
  bool sandwich_norms = false;    ///< RMS norms after attention and after the FFN as well (gemma2/3)
  FfnActivation ffn_act = FfnActivation::silu;
  double embed_scale = 1.0;       ///< the embedding rows times this (gemma: sqrt(dim))
  double query_scale = 0.0;       ///< what q.k is multiplied by; 0: 1 / sqrt(head_dim)
  double attn_softcap = 0.0;      ///< scores become c tanh(s / c) before softmax (gemma2); 0: off
  double final_softcap = 0.0;     ///< logits become c tanh(l / c) (gemma2); 0: off
  /// Sliding-window attention: a local layer's query at position p sees the
  /// keys at p' with p - p' < sliding_window. 0: no layer is local.
  int64_t sliding_window = 0;
  /// Which layers are local: layer l when l % P < P - 1 (Gemma's pattern; P = 2:
  /// every other layer); 0 or 1: every layer (Mistral v0.1).
  int64_t swa_pattern = 0;
  double rope_theta_local = 0.0;  ///< local layers' RoPE base (gemma3); 0: rope_theta
  // Mixture of experts (qwen3moe, Mixtral): per token the router's softmax over
  // every expert, the n_experts_used most probable, their probabilities
  // renormalised to sum 1; the FFN is their weighted sum.
  int64_t n_experts = 0;
  int64_t n_experts_used = 0;
  int64_t expert_hidden_dim = 0;  ///< one expert's FFN width

  int64_t q_dim() const { return n_heads * head_dim; }
  int64_t kv_dim() const { return n_kv_heads * head_dim; }
  bool moe() const { return n_experts > 0; }
  /// Whether `layer` attends through the sliding window.
  bool is_local(int64_t layer) const {
    return sliding_window > 0 && (swa_pattern <= 1 || layer % swa_pattern < swa_pattern - 1);
  }
  /// The architecture as `strata status` and /v1/models show it: "gemma3, window
  /// 1024 on 5 of 6 layers", "qwen3moe, 128 experts (8 active)".
  std::string describe() const;
  /// Layers with a sliding window (is_local).
  int64_t local_layers() const {
    int64_t n = 0;
    for (int64_t l = 0; l < n_layers; ++l)
      n += is_local(l) ? 1 : 0;
    return n;
  }

  /// Throws Error(bad_config) naming the offending field when inconsistent.
  void validate() const;
  /// The rotary inverse frequencies (head_dim / 2 of them) after rope_scaling.
  std::vector<double> rope_inv_freq() const;
  /// What cos and sin are multiplied by (yarn's attention factor; 1 otherwise).
  double rope_attention_factor() const;
  /// One line, for logs and `--help` listings.
  std::string summary() const;
};

/// How a shard loads its weights.
struct LoadOptions {
  LoadOptions() = default; // not an aggregate: `{0, 4}` stays a LayerRange
  /// "auto": what the file holds (llama2.c, Hugging Face and builtin weights are
  /// widened to f32; GGUF tensors stay in their own types). "f32", "bf16",
  /// "q8_0", "q4_0" or "q4_K": llama2.c / Hugging Face / builtin weights are
  /// converted at load (a GGUF file takes only "auto"). Matrices whose columns
  /// are not a multiple of 32 stay f16; under q4_K those not a multiple of 256
  /// are q8_0; under q4_0 / q4_K the classifier is q8_0 (llama.cpp's quantizer
  /// makes similar choices). q4_K uses a simple min/max quantizer.
  std::string dtype = "auto";
  /// How the KV cache keeps keys and values: "f32", "bf16", "f16" or "q8_0"
  /// (blocks of 32 values with an f16 scale; needs head_dim a multiple of 32).
  std::string kv_dtype = "f32";
  /// A progress line (bytes, MB/s, ETA) on stderr while loading.
  bool progress = false;
};

/// Inclusive range [first, last] of transformer layers.
struct LayerRange {
  int64_t first = 0;
  int64_t last = 0;
  int64_t count() const { return last - first + 1; }
  bool operator==(const LayerRange&) const = default;
};

/// Parses "A-B" or "A" (a single layer). Throws Error(bad_argument).
LayerRange parse_layer_range(const std::string& text);
/// Parses "0-1,2-3,4" into consecutive ranges. Throws Error(bad_argument).
std::vector<LayerRange> parse_layer_ranges(const std::string& text);
/// Checks that `ranges` cover [0, n_layers) in order without gaps or overlaps.
void check_route_covers(const std::vector<LayerRange>& ranges, int64_t n_layers);

} // namespace strata::model
