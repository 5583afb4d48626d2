#pragma once
// Tests only: what a generation must produce, computed the plainest way.

#include "runtime/generator.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace strata::test {

/// Greedy ids of `model` for `prompt`, n tokens, by single-process stateless
/// recomputation (no cache, no actors): the reference every cached,
/// distributed or batched run must equal.
inline std::vector<int32_t> stateless_ids(const std::string& model, const std::vector<int32_t>& prompt, int64_t n,
                                          const model::LoadOptions& load = {}) {
  runtime::LocalPipeline pipe(model, load);
  runtime::GenerateRequest req;
  req.prompt_ids = prompt;
  req.max_tokens = n;
  return runtime::generate_stateless(pipe, req).ids;
}

/// Every generation ended well and gave its expected ids (index i: outs[i] vs expected[i]).
template <class Outcomes, class System>
void expect_outcomes(System& sys, const Outcomes& outs, const std::vector<std::vector<int32_t>>& expected) {
  for (std::size_t i = 0; i < outs.size(); ++i) {
    ASSERT_TRUE(outs[i].ok()) << i << ": " << sys.render(outs[i].error);
    EXPECT_EQ(outs[i].result.ids, expected[i]) << "session " << i;
  }
}

} // namespace strata::test
