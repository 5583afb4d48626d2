#include "actors/speculation.hpp"

#include <algorithm>
#include <unordered_map>

namespace strata::actors {

std::vector<int32_t> lookup_proposal(std::span<const int32_t> seq, std::size_t k, std::size_t max_ngram,
                                     std::size_t min_ngram) {
  const std::size_t L = seq.size();
  if (k == 0 || min_ngram == 0 || L < 2)
    return {};
  for (std::size_t n = std::min(max_ngram, L - 1); n >= min_ngram; --n) {
    const auto tail = seq.subspan(L - n);
    // Where the earlier occurrences of the last n tokens continue (latest first).
    std::vector<std::size_t> next;
    for (std::size_t i = L - n; i-- > 0;)
      if (std::equal(tail.begin(), tail.end(), seq.begin() + static_cast<std::ptrdiff_t>(i)))
        next.push_back(i + n);
    if (next.empty()) {
      if (n == min_ngram)
        break;
      continue;
    }
    // Token by token, the continuation most of them share (a tie: the latest's);
    // the places that went another way drop out.
    std::vector<int32_t> out;
    std::unordered_map<int32_t, std::size_t> votes;
    while (out.size() < k && !next.empty()) {
      votes.clear();
      int32_t best = -1;
      std::size_t best_n = 0;
      for (auto p : next) {
        if (p >= L)
          continue;
        const auto c = ++votes[seq[p]];
        if (c > best_n) { // strictly more: on a tie the earlier-seen (later in the text) stays
          best_n = c;
          best = seq[p];
        }
      }
      if (best_n == 0)
        break;
      out.push_back(best);
      std::erase_if(next, [&](std::size_t p) { return p >= L || seq[p] != best; });
      for (auto& p : next)
        ++p;
    }
    return out;
  }
  return {};
}

DraftControl::DraftControl(uint32_t max, int patience, uint32_t start)
    : max_(max), k_(std::min(max, std::max<uint32_t>(1, start))), patience_(std::max(1, patience)) {
}

void DraftControl::declined(int steps) {
  cooldown_ = std::max(cooldown_, steps);
}

double DraftControl::acceptance() const {
  return taken_ + refusals_ > 0 ? taken_ / (taken_ + refusals_) : -1;
}

uint32_t DraftControl::paying() const {
  if (trip_ms_ >= 0 && spec_ms_per_token_ >= 0 && spec_ms_per_token_ > 0.98 * trip_ms_)
    return 0; // measured: a token cost more with proposals than a plain trip does
  if (trip_ms_ < 0 || row_ms_ < 0)
    return max_;
  const double a = std::clamp(acceptance() < 0 ? 0.5 : acceptance(), 0.0, 0.999);
  uint32_t best = 0;
  double best_rate = 1.0 / std::max(trip_ms_, 1e-3), expected = 1, power = 1;
  for (uint32_t k = 1; k <= max_; ++k) {
    power *= a;
    expected += power; // 1 + a + ... + a^k
    const double rate = expected / std::max(trip_ms_ + k * row_ms_, 1e-3);
    if (rate > best_rate * 1.02) { // (2 %: noise in the times is no reason to propose)
      best_rate = rate;
      best = k;
    }
  }
  return best;
}

uint32_t DraftControl::next() const {
  if (cooldown_ > 0)
    return 0;
  if ((trip_ms_ < 0 && spec_steps_ >= 2) || spec_steps_ >= 16)
    return 0; // one step without proposals tells what a trip costs alone (now)
  const uint32_t pay = paying();
  if (pay == 0)
    return unpaid_ % 32 == 31 ? 1 : 0; // every 32nd step: see whether it pays now
  return std::min(k_, pay);
}

void DraftControl::observe(uint32_t proposed, uint32_t accepted, double ms) {
  if (proposed == 0)
    return plain_step(ms);
  unpaid_ = 0;
  ++spec_steps_;
  taken_ = 0.9 * taken_ + accepted;
  refusals_ = 0.9 * refusals_ + (accepted < proposed ? 1 : 0);
  if (ms >= 0 && trip_ms_ >= 0) { // what the proposed rows added to the trip
    const double per_row = std::max(0.0, (ms - trip_ms_) / proposed);
    row_ms_ = row_ms_ < 0 ? per_row : 0.8 * row_ms_ + 0.2 * per_row;
  }
  if (ms >= 0) {
    const double per_token = ms / (accepted + 1.0);
    spec_ms_per_token_ = spec_ms_per_token_ < 0 ? per_token : 0.8 * spec_ms_per_token_ + 0.2 * per_token;
  }
  if (accepted >= proposed) {
    k_ = std::min(max_, std::max(k_, proposed) + 1);
  } else if (accepted > 0) {
    k_ = std::clamp<uint32_t>(accepted + 1, 1, max_);
  } else {
    k_ = std::max<uint32_t>(1, k_ / 2);
  }
  if (accepted > 0) {
    refused_in_row_ = 0;
    pause_ = 1;
    return;
  }
  if (++refused_in_row_ >= patience_) {
    refused_in_row_ = 0;
    pause_ = std::min(pause_ * 2, 64);
    cooldown_ = pause_;
  }
}

void DraftControl::plain_step(double ms) {
  spec_steps_ = 0;
  if (ms >= 0)
    trip_ms_ = trip_ms_ < 0 ? ms : 0.8 * trip_ms_ + 0.2 * ms;
  if (cooldown_ > 0)
    --cooldown_;
  if (paying() == 0)
    ++unpaid_;
}

} // namespace strata::actors
