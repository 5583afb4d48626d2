#pragma once
// Single-process generation: a chain of in-process shards, prefill then cached
// decode, sampling and stop rules. The actor runtime reuses the same stop rules
// (GenerationRules) so every path stops at the same token.

#include "model/transformer/sampler.hpp"
#include "model/transformer/shard.hpp"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace strata::runtime {

/// Why a generation ended.
enum class FinishReason { stop, length, context };
const char* to_string(FinishReason r);

struct GenerateRequest {
  std::vector<int32_t> prompt_ids;
  int64_t max_tokens = 128;
  model::SamplingParams sampling;
};

struct GenerateResult {
  std::vector<int32_t> ids; // generated ids, without the prompt and the stop id
  FinishReason finish = FinishReason::length;
  double prefill_ms = 0;
  double decode_ms = 0; // total time of the decode steps
};

/// Stop rules shared by every generation path.
struct GenerationRules {
  std::vector<int32_t> stop_ids;
  int64_t max_tokens = 0;
  int64_t max_seq_len = 0;
  /// Throws Error(bad_argument / context_overflow / token_out_of_range) for
  /// requests that cannot run at all.
  static GenerationRules make(const model::ModelConfig& cfg, const GenerateRequest& req);
  bool is_stop(int32_t id) const;
};

/// Layers of one model split over shards that run one after another in this
/// process. Each call goes through every shard with that shard's cache.
class LocalPipeline {
public:
  LocalPipeline(const std::string& model, const std::vector<model::LayerRange>& ranges,
                const model::LoadOptions& load = {});
  /// One shard covering the whole model.
  explicit LocalPipeline(const std::string& model, const model::LoadOptions& load = {});

  const model::ModelConfig& config() const { return shards_.front()->config(); }
  std::size_t size() const { return shards_.size(); }
  model::Shard& shard(std::size_t i) { return *shards_[i]; }

  /// Per-shard caches for one sequence.
  std::vector<model::KVCache> new_caches() const;
  /// Runs `tokens` at the next positions through all shards; returns logits.
  std::vector<float> step(std::span<const int32_t> tokens, std::vector<model::KVCache>& caches);

private:
  std::vector<std::unique_ptr<model::Shard>> shards_;
};

/// Greedy or sampled generation with a cache. `on_token` sees each id as it is
/// produced.
GenerateResult generate(LocalPipeline& pipe, const GenerateRequest& req,
                        const std::function<void(int32_t)>& on_token = {});

/// The same without any cache: every step recomputes the whole prefix. Slow;
/// the reference that cached and distributed runs are compared against.
GenerateResult generate_stateless(LocalPipeline& pipe, const GenerateRequest& req);

} // namespace strata::runtime
