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
  /// Speculative decoding: whether the model, whose next-token logits are
  /// `logits`, takes the proposed token `draft`, and the token it emits. Greedy:
  /// taken when it is the argmax; the argmax otherwise. Sampling (a proposal
  /// that was certain, as prompt lookup's are): taken with the probability the
  /// sampler's distribution gives it; otherwise a token drawn from that
  /// distribution without `draft` (renormalised). Either way the emitted token
  /// is distributed exactly as sample(logits) would be.
  struct Verdict {
    bool accepted = false;
    int32_t token = -1; ///< draft when accepted
  };
  Verdict verify(std::span<const float> logits, int32_t draft);
  /// State of the random generator, so a sampler can continue elsewhere.
  uint64_t state() const { return rng_; }
  void set_state(uint64_t s) { rng_ = s; }

private:
  float next_uniform(); // [0, 1)
  /// The candidates sample() draws from (scratch_[0, n), weights not normalised)
  /// and their total weight.
  std::size_t distribution(std::span<const float> logits, double& sum);
  SamplingParams p_;
  uint64_t rng_;
  std::vector<std::pair<float, int32_t>> scratch_;
};

/// OpenAI's presence and frequency penalties (for tokens generated: minus
/// presence, minus frequency x count) and transformers' repetition penalty (for
/// prompt and generated tokens: a positive logit divided by it, a negative one
/// multiplied), applied in place to the listed ids (repetition first, as vLLM
/// does). `counts[i]` is how often ids[i] was generated (0: only in the prompt).
/// Throws Error(bad_argument) for an id outside the logits or mismatched lists.
void apply_penalties(std::span<float> logits, float presence, float frequency, float repetition,
                     std::span<const int32_t> ids, std::span<const int32_t> counts);

/// Constrained decoding: every token not allowed gets logit -inf. Allowed are
/// the ids listed, or (when `bits` is not empty) the set bits over the
/// vocabulary. Throws Error(bad_argument) for an id outside the logits, bits
/// of another size, or bits that allow nothing.
void apply_allowed(std::span<float> logits, std::span<const int32_t> ids, std::span<const uint64_t> bits);

/// A token's log-probability under softmax(logits), and the `k` most likely
/// tokens' (most likely first; ties: the lower id), as OpenAI's logprobs report.
struct TokenLogprobs {
  float logprob = 0;
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
};
TokenLogprobs token_logprobs(std::span<const float> logits, int32_t token, int32_t k);

} // namespace strata::model
