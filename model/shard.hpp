#pragma once
// Shard: a contiguous layer range [first, last] of a decoder-only transformer,
// and KVCache: the per-session attention cache for one shard.
//
// This header is torch-free on purpose: everything outside model/ talks to the
// model through plain vectors, so only model/*.cpp pays for ATen at compile time.
//
// The model never owns a cache: `forward(input, positions, cache)` is a function
// of the weights, the input, the positions and the caller's cache. A Shard keeps
// scratch buffers between calls, so one Shard serves one caller at a time (the
// shard actor that owns it).

#include "model/config.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace strata::model {

/// A row-major float matrix: the residual stream [rows = tokens, cols = dim].
struct Activation {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<float> data; // (rows, cols)
};

/// What one shard emits: the unnormalized residual stream (every shard but the
/// tail) or the logits of the last position (the tail).
struct ShardOutput {
  Activation hidden;         // (T, dim), non-tail shards
  std::vector<float> logits; // (vocab), tail shard
  bool has_logits() const { return !logits.empty(); }
};

class Shard;

/// Per-session cache of keys and values for the layers of one shard. Its memory
/// grows in fixed blocks of tokens, so appending never copies what is cached.
/// The layout is private to model/.
class KVCache {
public:
  KVCache();
  ~KVCache();
  KVCache(KVCache&&) noexcept;
  KVCache& operator=(KVCache&&) noexcept;
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  /// Number of tokens whose keys and values are cached.
  int64_t seq_len() const;
  /// Bytes of memory held (allocated blocks, not only the used part).
  std::size_t bytes() const;
  /// Bytes this cache would hold with `tokens` tokens (for budgeting an append
  /// before doing it).
  std::size_t bytes_for(int64_t tokens) const;
  /// Forget everything from token `n` on (n <= seq_len). Frees whole blocks.
  void truncate(int64_t n);
  /// Tokens per allocation block.
  static constexpr int64_t block_tokens = 32;

  struct Impl;

private:
  friend class Shard;
  explicit KVCache(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Sets the threads used by tensor math (intra-op and BLAS). 0 keeps the default.
void set_num_threads(int threads);
int num_threads();

class Shard {
public:
  ~Shard();
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  /// Loads layers `range` of `model`, which is a llama2.c `.bin` checkpoint, a
  /// Hugging Face model directory, or `builtin:NAME`. Only what the range needs is
  /// loaded: the embedding on the head, final norm + classifier on the tail.
  static std::unique_ptr<Shard> load(const std::string& model, LayerRange range);
  /// Loads the whole model as one shard.
  static std::unique_ptr<Shard> load(const std::string& model);

  const ModelConfig& config() const;
  LayerRange range() const;
  bool is_head() const { return range().first == 0; }
  bool is_tail() const { return range().last == config().n_layers - 1; }
  /// Bytes held by this shard's weights.
  std::size_t weight_bytes() const;

  /// An empty cache shaped for this shard.
  KVCache new_cache() const;

  /// Head only: runs token ids at `positions` (which must be cache.seq_len(),
  /// +1, ... ) and appends them to `cache`. All-or-nothing: on error the cache
  /// is unchanged.
  ShardOutput forward(std::span<const int32_t> tokens, std::span<const int64_t> positions, KVCache& cache);
  /// Middle/tail: runs a hidden state (T, dim) from the previous shard.
  ShardOutput forward(const Activation& hidden, std::span<const int64_t> positions, KVCache& cache);

  struct Impl;

private:
  explicit Shard(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// The configuration of `model` (same specs as Shard::load) without loading weights.
ModelConfig read_config(const std::string& model);

/// Positions start, start+1, ..., start+n-1.
std::vector<int64_t> consecutive_positions(int64_t start, int64_t n);

/// Names accepted after `builtin:`.
std::vector<std::string> builtin_model_names();

} // namespace strata::model
