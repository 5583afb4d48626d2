#pragma once
// Tests only: what a generation must produce, computed the plainest way.

#include "runtime/generator.hpp"

#include <string>
#include <vector>

namespace strata::test {

/// Greedy ids of `model` for `prompt`, n tokens, by single-process stateless
/// recomputation (no cache, no actors): the reference every cached,
/// distributed or batched run must equal.
inline std::vector<int32_t> stateless_ids(const std::string& model, const std::vector<int32_t>& prompt, int64_t n) {
  runtime::LocalPipeline pipe(model);
  runtime::GenerateRequest req;
  req.prompt_ids = prompt;
  req.max_tokens = n;
  return runtime::generate_stateless(pipe, req).ids;
}

} // namespace strata::test
