// strata_bench draft [MODEL ...]: the drafter's rounds. Not a test.
//
// N sessions (1, 8, 32) each ask the draft model for k = 4 proposals a step
// after their own prompt (16 tokens) and what they have accepted so far, as
// sessions do before every speculative step; after each step a session's
// sequence grows by two tokens (one proposal taken and the model's own token).
// Two ways in turn, the same requests: one request at a time (what the drafter
// did before it answered in rounds) and every session's request in one round
// (drafter_state::propose_all: one batched forward pass a token for all of
// them). Reports proposals per second and passes per step.
//
// Models: the given ones (default: builtin:qwen2-0.5b as q8_0, the size of a
// real draft model, Qwen2.5-0.5B for Qwen2.5-7B; and stories260K's q4_0 file
// where ../shared has it). STRATA_BENCH_ROUNDS (default 3): rounds of the pair.

#include "actors/drafter.hpp"
#include "model/transformer/shard.hpp"
#include "tests/bench/measure.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>

using namespace strata;
using clk = std::chrono::steady_clock;

int draft_bench_main(int argc, char** argv) {
  const auto models = bench::models_or(argc, argv, "builtin:qwen2-0.5b", "../shared/models/gguf/stories260K-q4_0.gguf");
  const int rounds = std::getenv("STRATA_BENCH_ROUNDS") ? std::max(1, std::atoi(std::getenv("STRATA_BENCH_ROUNDS"))) : 3;
  const int steps = 8;
  const uint32_t k = 4;
  model::set_num_threads(2);
  std::printf("# strata_bench draft: sessions asking a draft model for %u proposals a step, %d steps, 2 threads; "
              "one request at a time against all of a step's requests in one round, in turn (%d rounds)\n\n",
              k, steps, rounds);
  for (const auto& m : models) {
    model::LoadOptions lo;
    if (m.rfind("builtin:", 0) == 0)
      lo.dtype = "q8_0";
    const std::shared_ptr<model::Shard> draft = model::Shard::load(m, lo);
    const auto vocab = draft->config().vocab_size;
    std::printf("## %s (%s)\n\n| sessions | one at a time: proposals/s | in rounds: proposals/s | in rounds / one at a "
                "time | passes a step (one at a time / in rounds) |\n|---|---|---|---|---|\n",
                m.c_str(), draft->config().summary().c_str());
    for (int n : {1, 8, 32}) {
      std::vector<double> alone_rate, batched_rate;
      uint64_t alone_passes = 0, batched_passes = 0;
      for (int r = 0; r < rounds; ++r)
        for (int mode = 0; mode < 2; ++mode) {
          const bool batched = (mode == 0) == (r % 2 == 0); // the order alternates by round
          actors::drafter_state st;
          st.model = draft;
          st.pool = draft->new_pool(st.limits.cache_bytes);
          st.pool->set_prefix_cache(false);
          std::vector<actors::drafter_state::Request> reqs(static_cast<std::size_t>(n));
          for (int i = 0; i < n; ++i) {
            auto& q = reqs[static_cast<std::size_t>(i)];
            q.session = std::to_string(i); // (GCC 12 warns of "s" + to_string: a false -Wrestrict)
            q.k = k;
            for (int j = 0; j < 16; ++j)
              q.seq.push_back(static_cast<int32_t>((1000 + 7919 * i + 104729 * j) % (vocab - 10) + 5));
          }
          uint64_t made = 0;
          double ms = 0;
          for (int s = 0; s < steps; ++s) {
            const auto t0 = clk::now();
            std::vector<actors::drafter_state::Answer> answers;
            if (batched) {
              answers = st.propose_all(reqs);
            } else {
              for (const auto& q : reqs)
                answers.push_back(std::move(st.propose_all({q})[0]));
            }
            ms += bench::ms_between(t0, clk::now());
            for (std::size_t i = 0; i < reqs.size(); ++i) {
              made += answers[i].tokens.size();
              reqs[i].seq.push_back(answers[i].tokens.empty() ? 5 : answers[i].tokens[0]);
              reqs[i].seq.push_back(static_cast<int32_t>((reqs[i].seq.size() * 31) % static_cast<std::size_t>(vocab - 10) + 5));
            }
          }
          (batched ? batched_rate : alone_rate).push_back(static_cast<double>(made) * 1000.0 / ms);
          (batched ? batched_passes : alone_passes) += st.passes;
        }
      const double a = bench::pct(alone_rate, 0.5), b = bench::pct(batched_rate, 0.5);
      std::printf("| %d | %.0f | %.0f | %.2fx | %.1f / %.1f |\n", n, a, b, b / a,
                  static_cast<double>(alone_passes) / (rounds * steps), static_cast<double>(batched_passes) / (rounds * steps));
    }
    std::printf("\n");
  }
  return 0;
}
