#include "model/transformer/sampler.hpp"

#include "model/base/error.hpp"

#include <algorithm>
#include <limits>
#include <cmath>

namespace strata::model {

void SamplingParams::validate() const {
  if (!std::isfinite(temperature) || temperature < 0.0f || temperature > 100.0f)
    throw Error(errc::bad_argument, "temperature must be in [0, 100] (got " + std::to_string(temperature) + ")");
  if (top_k < 0)
    throw Error(errc::bad_argument, "top_k must be >= 0 (got " + std::to_string(top_k) + ")");
  if (!std::isfinite(top_p) || top_p <= 0.0f || top_p > 1.0f)
    throw Error(errc::bad_argument, "top_p must be in (0, 1] (got " + std::to_string(top_p) + ")");
  if (!std::isfinite(min_p) || min_p < 0.0f || min_p > 1.0f)
    throw Error(errc::bad_argument, "min_p must be in [0, 1] (got " + std::to_string(min_p) + ")");
}

Sampler::Sampler(SamplingParams params) : p_(params), rng_(params.seed * 0x9e3779b97f4a7c15ull + 0x2545F4914F6CDD1Dull) {
  p_.validate();
  if (rng_ == 0)
    rng_ = 1;
}

float Sampler::next_uniform() {
  // xorshift* as in llama2.c's run.c
  rng_ ^= rng_ >> 12;
  rng_ ^= rng_ << 25;
  rng_ ^= rng_ >> 27;
  const auto r = static_cast<uint32_t>((rng_ * 0x2545F4914F6CDD1Dull) >> 32);
  return static_cast<float>(r >> 8) / 16777216.0f;
}

int32_t Sampler::argmax(std::span<const float> logits) {
  // The first index whose value exceeds every one before it (a NaN is never
  // chosen, nor anything after a NaN at index 0), with the largest value so
  // far kept in a register: comparing against logits[best] reloaded it after
  // every possible change of best, 4.5 ns a value (150 us for 32k logits, 690
  // for Qwen's 152k, on the machine of docs/benchmarks.md). Blocks of 16 whose
  // largest value (NaNs left out) does not exceed it are passed over at once:
  // 0.3 ns a value, the same index.
  const std::size_t n = logits.size();
  if (n == 0)
    return 0;
  std::size_t best = 0, i = 1;
  float m = logits[0];
  for (; i + 16 <= n; i += 16) {
    float bm = -std::numeric_limits<float>::infinity();
    for (std::size_t k = 0; k < 16; ++k)
      bm = logits[i + k] > bm ? logits[i + k] : bm;
    if (!(bm > m))
      continue;
    for (std::size_t k = 0; k < 16; ++k)
      if (logits[i + k] > m) {
        m = logits[i + k];
        best = i + k;
      }
  }
  for (; i < n; ++i)
    if (logits[i] > m) {
      m = logits[i];
      best = i;
    }
  return static_cast<int32_t>(best);
}

std::size_t Sampler::distribution(std::span<const float> logits, double& sum) {
  // Candidates sorted by logit (ties: lower id first), cut by top-k.
  scratch_.clear();
  for (std::size_t i = 0; i < logits.size(); ++i)
    scratch_.emplace_back(logits[i], static_cast<int32_t>(i));
  auto cmp = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  std::size_t k = scratch_.size();
  if (p_.top_k > 0 && static_cast<std::size_t>(p_.top_k) < k) {
    k = static_cast<std::size_t>(p_.top_k);
    std::partial_sort(scratch_.begin(), scratch_.begin() + static_cast<std::ptrdiff_t>(k), scratch_.end(), cmp);
    scratch_.resize(k);
  } else if (p_.top_p < 1.0f) {
    std::sort(scratch_.begin(), scratch_.end(), cmp);
  }
  // Softmax at the temperature.
  const float mx = std::max_element(scratch_.begin(), scratch_.end(), [](auto& a, auto& b) { return a.first < b.first; })->first;
  sum = 0;
  for (auto& c : scratch_) {
    c.first = std::exp((c.first - mx) / p_.temperature);
    sum += c.first;
  }
  // Min-p cut: the weights are relative to the most likely token (which has
  // weight 1), so the cut is a threshold on them; the order is kept.
  if (p_.min_p > 0.0f) {
    std::size_t kept = 0;
    sum = 0;
    for (auto& c : scratch_)
      if (c.first >= p_.min_p) {
        scratch_[kept++] = c;
        sum += c.first;
      }
    scratch_.resize(kept); // never empty: the most likely token has weight 1
  }
  // Nucleus cut: smallest prefix whose mass reaches top_p (needs sorted order).
  std::size_t n = scratch_.size();
  if (p_.top_p < 1.0f) {
    double cum = 0;
    for (std::size_t i = 0; i < scratch_.size(); ++i) {
      cum += scratch_[i].first / sum;
      if (cum >= p_.top_p) {
        n = i + 1;
        break;
      }
    }
    sum = 0;
    for (std::size_t i = 0; i < n; ++i)
      sum += scratch_[i].first;
  }
  return n;
}

int32_t Sampler::sample(std::span<const float> logits) {
  if (logits.empty())
    throw Error(errc::bad_shape, "cannot sample from empty logits");
  if (p_.temperature == 0.0f)
    return argmax(logits);
  double sum = 0;
  const std::size_t n = distribution(logits, sum);
  const double coin = static_cast<double>(next_uniform()) * sum;
  double cum = 0;
  for (std::size_t i = 0; i < n; ++i) {
    cum += scratch_[i].first;
    if (coin < cum)
      return scratch_[i].second;
  }
  return scratch_[n - 1].second;
}

Sampler::Verdict Sampler::verify(std::span<const float> logits, int32_t draft) {
  if (logits.empty())
    throw Error(errc::bad_shape, "cannot sample from empty logits");
  if (p_.temperature == 0.0f) {
    const int32_t best = argmax(logits);
    return {best == draft, best};
  }
  double sum = 0;
  const std::size_t n = distribution(logits, sum);
  double w_draft = 0;
  for (std::size_t i = 0; i < n; ++i)
    if (scratch_[i].second == draft)
      w_draft = scratch_[i].first;
  // The proposal put all its mass on `draft`: keep it with probability p(draft)
  // (min(1, p / q) with q = 1), else draw from the residual max(0, p - q),
  // which is p without `draft`.
  if (w_draft > 0 && static_cast<double>(next_uniform()) * sum < w_draft)
    return {true, draft};
  const double rest = sum - w_draft;
  if (!(rest > 0)) // p was all on draft (the coin cannot miss it); kept for safety
    return {true, draft};
  const double coin = static_cast<double>(next_uniform()) * rest;
  double cum = 0;
  int32_t last = -1;
  for (std::size_t i = 0; i < n; ++i) {
    if (scratch_[i].second == draft)
      continue;
    cum += scratch_[i].first;
    last = scratch_[i].second;
    if (coin < cum)
      return {false, last};
  }
  return {false, last};
}

void apply_penalties(std::span<float> logits, float presence, float frequency, float repetition,
                     std::span<const int32_t> ids, std::span<const int32_t> counts) {
  if (ids.size() != counts.size())
    throw Error(errc::bad_argument, "penalty lists differ in length (" + std::to_string(ids.size()) + " ids, " +
                                      std::to_string(counts.size()) + " counts)");
  if (!(repetition > 0) || !std::isfinite(repetition) || !std::isfinite(presence) || !std::isfinite(frequency))
    throw Error(errc::bad_argument, "penalties must be finite and the repetition penalty > 0");
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || static_cast<std::size_t>(id) >= logits.size() || counts[i] < 0)
      throw Error(errc::bad_argument, "penalty token id " + std::to_string(id) + " is outside the vocabulary of " +
                                        std::to_string(logits.size()));
    float& l = logits[static_cast<std::size_t>(id)];
    if (repetition != 1.0f)
      l = l > 0 ? l / repetition : l * repetition;
    if (counts[i] > 0)
      l -= presence + frequency * static_cast<float>(counts[i]);
  }
}

void apply_allowed(std::span<float> logits, std::span<const int32_t> ids, std::span<const uint64_t> bits) {
  const std::size_t V = logits.size();
  if (!bits.empty()) {
    if (bits.size() != (V + 63) / 64)
      throw Error(errc::bad_argument, "the allowed-token bits cover " + std::to_string(bits.size() * 64) +
                                        " tokens, not the vocabulary of " + std::to_string(V));
    bool any = false;
    for (std::size_t i = 0; i < V; ++i) {
      if ((bits[i >> 6] >> (i & 63)) & 1)
        any = true;
      else
        logits[i] = -std::numeric_limits<float>::infinity();
    }
    if (!any)
      throw Error(errc::bad_argument, "the allowed-token bits allow no token");
    return;
  }
  std::vector<char> keep(V, 0);
  for (int32_t id : ids) {
    if (id < 0 || static_cast<std::size_t>(id) >= V)
      throw Error(errc::bad_argument, "allowed token id " + std::to_string(id) + " is outside the vocabulary of " +
                                        std::to_string(V));
    keep[static_cast<std::size_t>(id)] = 1;
  }
  for (std::size_t i = 0; i < V; ++i)
    if (!keep[i])
      logits[i] = -std::numeric_limits<float>::infinity();
}

TokenLogprobs token_logprobs(std::span<const float> logits, int32_t token, int32_t k) {
  if (logits.empty() || token < 0 || static_cast<std::size_t>(token) >= logits.size())
    throw Error(errc::bad_argument, "token " + std::to_string(token) + " is outside the logits");
  const float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float l : logits)
    sum += std::exp(static_cast<double>(l) - mx);
  const double log_z = mx + std::log(sum);
  TokenLogprobs out;
  out.logprob = static_cast<float>(logits[static_cast<std::size_t>(token)] - log_z);
  const auto n = static_cast<std::size_t>(std::clamp<int32_t>(k, 0, static_cast<int32_t>(logits.size())));
  if (n > 0) {
    std::vector<int32_t> idx(logits.size());
    for (std::size_t i = 0; i < idx.size(); ++i)
      idx[i] = static_cast<int32_t>(i);
    std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(n), idx.end(), [&](int32_t a, int32_t b) {
      const float x = logits[static_cast<std::size_t>(a)], y = logits[static_cast<std::size_t>(b)];
      return x > y || (x == y && a < b);
    });
    for (std::size_t i = 0; i < n; ++i) {
      out.top_ids.push_back(idx[i]);
      out.top_logprobs.push_back(static_cast<float>(logits[static_cast<std::size_t>(idx[i])] - log_z));
    }
  }
  return out;
}

} // namespace strata::model
