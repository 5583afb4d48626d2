#pragma once
// Tests only: what a generation must produce, computed the plainest way.

#include "runtime/generator.hpp"

#include "messages/messages.hpp"
#include "tests/support.hpp"

#include <gtest/gtest.h>

#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace strata::test {

/// The model most actor tests run: stories260K from ../shared when it is there,
/// builtin:tiny otherwise (a user's fresh clone).
inline std::string stories_or_tiny() {
  return have_shared("models/stories260K.bin") ? shared_path("models/stories260K.bin") : "builtin:tiny";
}

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

/// Runs n generations on their own threads, generation i starting once
/// generation 0 has streamed i tokens (a crowd that grows while it decodes);
/// whatever becomes of generation 0, nobody waits past its end. `run(i,
/// on_token)` runs generation i, passing on_token every token it streams.
template <class Outcome>
std::vector<Outcome> run_staggered(
  int n, const std::function<Outcome(int, const std::function<void(const msg::token_event&)>&)>& run) {
  std::mutex m;
  std::condition_variable cv;
  int first_tokens = 0;
  std::vector<Outcome> outs(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      {
        std::unique_lock lock(m);
        cv.wait(lock, [&] { return first_tokens >= i; });
      }
      outs[static_cast<std::size_t>(i)] = run(i, [&, i](const msg::token_event&) {
        if (i != 0)
          return;
        std::lock_guard lock(m);
        ++first_tokens;
        cv.notify_all();
      });
      if (i == 0) {
        std::lock_guard lock(m);
        first_tokens = n;
        cv.notify_all();
      }
    });
  for (auto& t : threads)
    t.join();
  return outs;
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
