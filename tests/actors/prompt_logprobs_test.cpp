// Prompt log-probabilities (echo / log-likelihood scoring): the tail scores
// every prompt token, across hops, in prefill pieces and in a crowd, equal to
// scoring each prefix alone in one process.
#include "actors/cluster.hpp"
#include "messages/session_id.hpp"
#include "model/transformer/sampler.hpp"
#include "model/transformer/shard.hpp"
#include "tests/actors/reference.hpp"

#include <cmath>

namespace strata {
namespace {

using actors::Injection;
using actors::LocalCluster;

std::vector<int32_t> prompt_of(int salt, int64_t vocab, int n) {
  std::vector<int32_t> p{1};
  for (int j = 1; j < n; ++j)
    p.push_back(static_cast<int32_t>((7 + 31 * salt + 13 * j * j) % (vocab - 3) + 3));
  return p;
}

TEST(PromptLogprobs, ThroughThreeShardsInPiecesAndACrowdEqualEachPrefixScoredAlone) {
  actors::actor_config cfg;
  caf::actor_system sys{cfg};
  const auto model = test::stories_or_tiny();
  actors::ClusterOptions opts;
  opts.scheduler.prefill_chunk = 8; // a 40-token prompt runs in 5 pieces
  opts.scheduler.max_batch_tokens = 24;
  opts.session.max_retries = 100;
  LocalCluster c(sys, model, model::parse_layer_ranges("0-1,2-3,4"), opts);
  const auto vocab = c.config().vocab_size;
  const int n = 40, k = 3;
  // The reference: each prefix through the whole model alone, its last row's log-softmax.
  auto whole = model::Shard::load(model);
  auto score = [&](const std::vector<int32_t>& p) {
    std::vector<model::TokenLogprobs> out;
    for (std::size_t j = 1; j < p.size(); ++j) {
      auto cache = whole->new_cache();
      std::vector<int32_t> prefix(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(j));
      const auto pos = model::consecutive_positions(0, static_cast<int64_t>(j));
      const auto o = whole->forward(prefix, pos, cache);
      out.push_back(model::token_logprobs(o.logits, p[j], k));
    }
    return out;
  };
  const int sessions = 4;
  std::vector<std::vector<model::TokenLogprobs>> expected(sessions);
  for (int i = 0; i < sessions; i += 2)
    expected[static_cast<std::size_t>(i)] = score(prompt_of(i, vocab, n));
  auto outs = test::run_staggered<actors::Outcome>(sessions, [&](int i, const auto& on_token) {
    msg::generation_request r;
    r.session = msg::mint_session_id("score");
    r.prompt = prompt_of(i, vocab, n);
    r.max_tokens = i == 2 ? 0 : 30; // session 2 only scores its prompt
    if (i % 2 == 0)
      r.prompt_logprobs = k;
    if (i == 0)
      return c.generate(r, {Injection{Injection::evict, 1, 5, msg::miss_reason::evicted_lru}, Injection{Injection::epoch, 0, 12, {}}},
                        on_token);
    return c.generate(r, on_token);
  });
  for (int i = 0; i < sessions; ++i) {
    auto& o = outs[static_cast<std::size_t>(i)];
    ASSERT_TRUE(o.ok()) << "session " << i << ": " << sys.render(o.error);
    if (i % 2 == 1) {
      EXPECT_TRUE(o.result.prompt_logprobs.empty());
      continue;
    }
    const auto& want = expected[static_cast<std::size_t>(i)];
    ASSERT_EQ(o.result.prompt_logprobs.size(), want.size()) << "session " << i;
    ASSERT_EQ(o.result.prompt_top_ids.size(), want.size() * k);
    for (std::size_t j = 0; j < want.size(); ++j) {
      EXPECT_NEAR(o.result.prompt_logprobs[j], want[j].logprob, 1e-4) << "session " << i << " token " << j + 1;
      for (std::size_t q = 0; q < static_cast<std::size_t>(k); ++q) {
        EXPECT_EQ(o.result.prompt_top_ids[j * k + q], want[j].top_ids[q]) << "session " << i << " token " << j + 1;
        EXPECT_NEAR(o.result.prompt_top_logprobs[j * k + q], want[j].top_logprobs[q], 1e-4);
      }
    }
    if (i == 2) {
      EXPECT_TRUE(o.result.ids.empty()) << "max_tokens 0: scored, nothing generated";
      EXPECT_EQ(o.result.finish, "length");
    } else {
      EXPECT_EQ(o.result.ids, test::stateless_ids(model, prompt_of(i, vocab, n), 30)) << "scoring changes no token";
    }
  }
  for (auto& s : c.stats())
    EXPECT_EQ(s.sessions, 0u) << "every cache released";
}

} // namespace
} // namespace strata
