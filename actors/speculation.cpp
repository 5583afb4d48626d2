#include "actors/speculation.hpp"

#include <algorithm>

namespace strata::actors {

std::vector<int32_t> lookup_proposal(std::span<const int32_t> seq, std::size_t k, std::size_t max_ngram,
                                     std::size_t min_ngram) {
  const std::size_t L = seq.size();
  if (k == 0 || min_ngram == 0)
    return {};
  for (std::size_t n = std::min(max_ngram, L > 0 ? L - 1 : 0); n >= min_ngram; --n) {
    const auto tail = seq.subspan(L - n);
    // Latest start i < L - n whose n tokens equal the tail (so at least one follows).
    for (std::size_t i = L - n; i-- > 0;) {
      if (!std::equal(tail.begin(), tail.end(), seq.begin() + static_cast<std::ptrdiff_t>(i)))
        continue;
      const std::size_t from = i + n, to = std::min(L, from + k);
      return {seq.begin() + static_cast<std::ptrdiff_t>(from), seq.begin() + static_cast<std::ptrdiff_t>(to)};
    }
    if (n == min_ngram)
      break;
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
