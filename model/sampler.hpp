#pragma once
// Next-token sampling: greedy, temperature, top-k, min-p, top-p, seeded.
// Order: top-k cut, softmax at the temperature, min-p cut (tokens less likely
// than min_p times the most likely one), nucleus (top-p) cut, draw. Torch-free.

#include <cstdint>
#include <span>
#include <vector>

namespace strata::model {

struct SamplingParams {
  float temperature = 0.0f; ///< 0 = greedy
  int32_t top_k = 0;        ///< 0 = no top-k cut
  float top_p = 1.0f;       ///< 1 = no nucleus cut
  uint64_t seed = 0;
  float min_p = 0.0f;       ///< 0 = no min-p cut

  /// Throws Error(bad_argument) naming the field when out of range.
  void validate() const;
};

/// Samples ids from logits. The same seed and logits give the same ids on every
/// machine (the random numbers and the tie-breaking are ours, not the library's).
class Sampler {
public:
  explicit Sampler(SamplingParams params);
  int32_t sample(std::span<const float> logits);
  /// Index of the first maximum.
  static int32_t argmax(std::span<const float> logits);
  /// State of the random generator, so a sampler can continue elsewhere.
  uint64_t state() const { return rng_; }
  void set_state(uint64_t s) { rng_ = s; }

private:
  float next_uniform(); // [0, 1)
  SamplingParams p_;
  uint64_t rng_;
  std::vector<std::pair<float, int32_t>> scratch_;
};

} // namespace strata::model
