#pragma once
// Shared by the benchmarks that run next to llama.cpp on generated GGUF files
// (bench_arch.cpp, bench_types.cpp): a seeded f32 GGUF writer for a model
// shape, strata's and llama-bench's speeds on one file, interleaved rounds.

#include "model/transformer/shard.hpp"

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace strata::benchgguf {

double since(std::chrono::steady_clock::time_point t0);
double median_of(std::vector<double> v);

/// A model shape written as seeded random f32 weights.
struct Shape {
  std::string arch, file;
  uint32_t dim, layers, heads, kv_heads, head_dim, ffn, vocab, ctx;
  uint32_t experts = 0, used = 0, expert_ffn = 0;
  uint32_t window = 0, pattern = 0;
  bool qk_norm = true;    ///< attn_q_norm / attn_k_norm (qwen3, gemma3)
  bool qkv_bias = false;  ///< attn_q/k/v.bias (qwen2)
  bool post_norms = false; ///< post_attention_norm / post_ffw_norm (gemma)
  bool vocab_tokens = false; ///< a made-up SentencePiece vocabulary (servers detokenize); else "none"
};

/// Writes `s` as an f32 GGUF file at `path` (atomically: via PATH.part).
void make_model(const Shape& s, const std::filesystem::path& path);
/// `llama_bin`/llama-quantize SRC DST TYPE [extra]; false (and a line) on failure.
bool quantize_file(const std::string& llama_bin, const std::filesystem::path& src, const std::filesystem::path& dst,
                   const std::string& type, const std::string& extra = "");

struct Speeds {
  double prefill = 0, decode = 0;
};

/// A cache holding `n` tokens of seeded ids, prefilled in pieces of 2,048.
model::KVCache filled_cache(model::Shard& shard, int64_t n);
/// Prefill `prompt` tokens in one call (best of 2); decode 24 tokens after a
/// context of `depth` (median step).
Speeds strata_speed(model::Shard& shard, int threads, int64_t prompt, int64_t depth);
/// llama-bench on the same file: prefill `prompt` and 24 decoded tokens at `depth`.
Speeds llama_speed(const std::string& bin, const std::string& file, int threads, int64_t prompt, int64_t depth);
/// Rounds of (strata, llama.cpp) in turn; the median of each figure.
std::pair<Speeds, Speeds> interleaved(model::Shard& shard, const std::string& llama, const std::string& file, int t,
                                      int64_t prompt, int64_t depth, bool peer, int rounds);

std::string fmt(double v);
std::string ratio(double a, double b);

} // namespace strata::benchgguf
