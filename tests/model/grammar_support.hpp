#pragma once
// Tests only: random sentences of a grammar (model/text/grammar.hpp).
#include "model/text/grammar.hpp"

#include <random>
#include <string>
#include <vector>

namespace strata::test {

/// A random sentence: bytes drawn among those the grammar allows, ending at the
/// first accepting state reached after `min_len` bytes (or when nothing may
/// follow). Empty when the walk ran past `max_len` bytes.
inline std::string random_sentence(model::GrammarAutomaton& a, std::mt19937& rng, std::size_t min_len,
                                   std::size_t max_len) {
  std::string out;
  int32_t s = a.start();
  while (out.size() < max_len) {
    if (a.accepting(s) && (out.size() >= min_len || !a.can_continue(s)))
      return out;
    std::vector<int> ok;
    for (int b = 0; b < 256; ++b)
      if (a.next(s, static_cast<uint8_t>(b)) != model::GrammarAutomaton::dead)
        ok.push_back(b);
    if (ok.empty())
      return {};
    const int b = ok[std::uniform_int_distribution<std::size_t>(0, ok.size() - 1)(rng)];
    out.push_back(static_cast<char>(b));
    s = a.next(s, static_cast<uint8_t>(b));
  }
  return {};
}

} // namespace strata::test
