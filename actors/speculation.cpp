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

DraftControl::DraftControl(uint32_t max, int patience) : max_(max), k_(max), patience_(std::max(1, patience)) {
}

void DraftControl::observe(uint32_t proposed, uint32_t accepted) {
  if (proposed == 0)
    return plain_step();
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

void DraftControl::plain_step() {
  if (cooldown_ > 0)
    --cooldown_;
}

} // namespace strata::actors
