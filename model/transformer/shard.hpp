#pragma once
// Shard: a contiguous layer range [first, last] of a decoder-only transformer,
// and its batched forward pass.
//
// This header is torch-free on purpose: everything outside model/ talks to the
// model through plain vectors, so only model/*.cpp pays for ATen at compile time.
//
// The model never owns a cache: `forward(batch)` is a function of the weights
// and, per sequence, its input rows, positions and cache (a block table into a
// BlockPool, see kv_cache.hpp). A Shard keeps scratch buffers between calls, so
// one Shard serves one caller at a time (the shard actor that owns it).

#include "model/base/config.hpp"
#include "model/base/error.hpp"
#include "model/transformer/kv_cache.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
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
/// tail) or the logits of the last position (the tail; of the last
/// SeqStep::logit_rows positions, one vocab-wide row each, in order).
struct ShardOutput {
  Activation hidden;         // (T, dim), non-tail shards
  std::vector<float> logits; // (logit_rows x vocab), tail shard
  bool has_logits() const { return !logits.empty(); }
  /// SeqStep::row_targets: per row, the target's log-probability (0 where the
  /// target is -1) and the row_top most likely ids and log-probabilities.
  std::vector<float> row_logprobs;
  std::vector<int32_t> row_top_ids;      ///< rows x row_top
  std::vector<float> row_top_logprobs;   ///< rows x row_top
};

/// One sequence of a batched forward call: its input rows at `positions`
/// (which must continue its cache: cache->seq_len(), +1, ...).
struct SeqStep {
  std::span<const int32_t> tokens; ///< head: token ids (one per row)
  const float* hidden = nullptr;   ///< other shards: (rows, dim) hidden rows
  int64_t rows = 0;                ///< rows of `hidden` (the head uses tokens.size())
  std::span<const int64_t> positions;
  KVCache* cache = nullptr;
  /// false: only fill the cache (a prefill chunk before the last); the tail skips
  /// its classifier and other shards return no hidden rows.
  bool emit = true;
  /// The tail: logits for this many last rows (speculative decoding verifies a
  /// proposal at each of them); at most the rows of the step.
  int64_t logit_rows = 1;
  /// The tail, prompt log-probabilities: when not empty (one id per row, -1 for
  /// none), every row goes through the classifier (a few rows at a time) and
  /// only its log-softmax at the target and its `row_top` best are kept.
  std::span<const int32_t> row_targets;
  int32_t row_top = 0;
};

/// What one sequence of a batch got: an error (nothing of its cache changed) or
/// its output.
struct SeqOutcome {
  std::optional<Error> error;
  ShardOutput out;
};

/// Sets the math threads of the process (one OpenMP team: our kernels and
/// oneDNN's sgemm). 0 keeps the setting; the default is OMP_NUM_THREADS where set,
/// else the physical cores the process may run on.
void set_num_threads(int threads);
int num_threads();
/// Lets the calling thread's math threads go (its OpenMP team, started by the
/// math it ran). Shard::load calls it when it returns: loading packs weights on
/// the calling thread, and the shard's math then runs on another one (the
/// process's math thread: math_thread.hpp). libgomp cuts the time its threads spin between
/// parallel regions to almost nothing while it manages more threads than there
/// are CPUs, so an idle team left on the loading thread made every parallel
/// region of the shard put its threads to sleep and wake them through the
/// kernel (on 2 vCPUs, a node decoded 1.5-2x slower). Harmless anywhere: a
/// thread that runs math again gets a new team.
void release_math_threads();
/// How many times this process spread a layer's decode attention over threads
/// (fewer attention items than threads, each with a long enough cache: one
/// session of a model with one kv head). For tests and benches.
uint64_t attention_spreads();

class Shard {
public:
  ~Shard();
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  /// Loads layers `range` of `model`, which is a llama2.c `.bin` checkpoint, a
  /// GGUF file, a Hugging Face model directory, or `builtin:NAME`. Only what the range needs is
  /// loaded: the embedding on the head, final norm + classifier on the tail.
  /// The calling thread's math threads are let go on return (release_math_threads).
  static std::unique_ptr<Shard> load(const std::string& model, LayerRange range, const LoadOptions& options = {});
  /// Loads the whole model as one shard.
  static std::unique_ptr<Shard> load(const std::string& model, const LoadOptions& options = {});

  const ModelConfig& config() const;
  LayerRange range() const;
  bool is_head() const { return range().first == 0; }
  bool is_tail() const { return range().last == config().n_layers - 1; }
  /// Bytes held by this shard's weights.
  std::size_t weight_bytes() const;

  /// The geometry of this shard's cache blocks.
  CacheShape cache_shape() const;
  /// How this shard's KV cache keeps keys and values (LoadOptions::kv_dtype).
  WType kv_type() const;
  /// A block pool for this shard holding at most `budget_bytes` of cache.
  std::shared_ptr<BlockPool> new_pool(std::size_t budget_bytes) const;
  /// An empty cache in this shard's own unbounded pool (tools and tests; the
  /// shard actor budgets its own pool).
  KVCache new_cache() const;

  /// The batched forward pass. Every weight matrix is applied once to the rows
  /// of all sequences; attention runs per sequence over its own blocks. Each
  /// sequence is checked first (input, positions, context, free blocks): one
  /// that fails gets its error and is left out; the others run. A sequence's
  /// cache is committed only once all its rows ran (all-or-nothing per
  /// sequence). A sequence gets bit-for-bit the same numbers in a batch as alone,
  /// as long as it is fed in the same pieces.
  std::vector<SeqOutcome> forward(std::span<const SeqStep> batch);

  /// Head only: runs token ids at `positions` (which must be cache.seq_len(),
  /// +1, ... ) and appends them to `cache`. All-or-nothing: on error (thrown)
  /// the cache is unchanged.
  ShardOutput forward(std::span<const int32_t> tokens, std::span<const int64_t> positions, KVCache& cache);
  /// Middle/tail: runs a hidden state (T, dim) from the previous shard.
  ShardOutput forward(const Activation& hidden, std::span<const int64_t> positions, KVCache& cache);

  struct Impl;

private:
  explicit Shard(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Multiply-adds per second one thread sustains on this CPU's widest FMA units
/// (a register-only loop run for `seconds`): the basis of a peak-FLOP/s figure.
double fma_rate_per_thread(double seconds);

/// The kernel builds this CPU runs (e.g. "avx512+vnni+bf16", "avx2"), for status.
std::string kernel_builds();

/// The configuration of `model` (same specs as Shard::load) without loading weights.
ModelConfig read_config(const std::string& model);

/// Positions start, start+1, ..., start+n-1.
std::vector<int64_t> consecutive_positions(int64_t start, int64_t n);

/// The KV cache type named `name` ("f32", "bf16", "f16", "q8_0") for a model of
/// `cfg`; Error(bad_argument) naming what is wrong otherwise.
WType parse_kv_dtype(const std::string& name, const ModelConfig& cfg);

/// Names accepted after `builtin:`.
std::vector<std::string> builtin_model_names();

} // namespace strata::model
