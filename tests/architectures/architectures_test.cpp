// The architectures beyond Llama (qwen3, qwen3moe, Mixtral-style llama,
// gemma2, gemma3, phi3) through real shard and session actors: split over one,
// two and three shards, with several sessions at once and faults (an eviction,
// a killed shard, an epoch bump) hitting some of them, every text equals
// llama.cpp's greedy ids for the same file (../shared/models/gguf, f32: exact).
// A Gemma-3-shaped model generating far past its window keeps its sliding-window
// layers' blocks bounded by the window (shard_stats), and its text equals the
// stateless recomputation.

#include "actors/cluster.hpp"
#include "messages/session_id.hpp"
#include "tests/actors/reference.hpp"
#include "tests/support.hpp"

#include <algorithm>
#include <atomic>
#include <future>
#include <mutex>
#include <iostream>
#include <thread>

namespace strata {
namespace {

using actors::Injection;
using actors::LocalCluster;

struct Case {
  std::vector<int32_t> prompt;
  std::vector<int32_t> ids; // llama.cpp's greedy ids
};

std::vector<Case> cases_of(const std::string& family) {
  const auto ref = test::read_json(test::shared_path("models/gguf/" + family + "-rand.gguf-ref.json"));
  std::vector<Case> out;
  for (const auto& c : ref["files"][family + "-rand-f32.gguf"])
    out.push_back({c["prompt_ids"].get<std::vector<int32_t>>(), c["generated_ids"].get<std::vector<int32_t>>()});
  return out;
}

msg::generation_request request(const Case& c) {
  msg::generation_request r;
  r.session = msg::mint_session_id("arch");
  r.prompt = c.prompt;
  r.max_tokens = static_cast<int64_t>(c.ids.size()); // the references stop only at BOS
  return r;
}

struct Architectures : ::testing::TestWithParam<const char*> {
  actors::actor_config cfg;
  caf::actor_system sys{cfg};
};

TEST_P(Architectures, ShardedWithFaultsDuringConcurrentSessionsEqualLlamaCpp) {
  const std::string family = GetParam();
  const std::string file = "models/gguf/" + family + "-rand-f32.gguf";
  STRATA_REQUIRE_SHARED(file);
  const auto model = test::shared_path(file);
  const auto cases = cases_of(family);
  ASSERT_GE(cases.size(), 4u);
  const bool three = family == "gemma3"; // 3 layers; the others have 2
  std::vector<std::string> splits = {three ? "0-2" : "0-1", three ? "0-1,2" : "0,1"};
  if (three)
    splits.push_back("0,1,2");
  for (const auto& split : splits) {
    SCOPED_TRACE(split);
    LocalCluster c(sys, model, model::parse_layer_ranges(split));
    const auto last = static_cast<int64_t>(c.size()) - 1;
    // Session i runs case i; three of them meet a fault on the way.
    const std::vector<std::vector<Injection>> faults = {
      {Injection{Injection::evict, last, 10, msg::miss_reason::evicted_lru}},
      {Injection{Injection::kill, 0, 20, {}}},
      {Injection{Injection::epoch, 0, 30, {}}},
      {}};
    // A route change (the kill's, the epoch's) that reaches session 0 between
    // its eviction and its next step makes it rebuild every hop, rightly
    // without asking the evicted cache: the eviction would go unseen (under
    // two busy loops, 2 of 20 repeats). So the other faults wait until session 0 has taken
    // the step after its eviction; the sessions run side by side throughout.
    std::promise<void> evicted;
    const auto evicted_seen = evicted.get_future().share();
    std::once_flag once;
    auto release = [&] { std::call_once(once, [&] { evicted.set_value(); }); };
    std::vector<actors::Outcome> outs(cases.size());
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < cases.size(); ++i)
      threads.emplace_back([&, i] {
        const auto inject = i < faults.size() ? faults[i] : std::vector<Injection>{};
        if (i == 0) {
          outs[i] = c.generate(request(cases[i]), inject, [&](const msg::token_event& ev) {
            if (ev.index >= faults[0][0].at_token)
              release();
          });
          release(); // it ended early: nothing to wait for
        } else {
          outs[i] = actors::run_generation(
            sys, c.supervisor(), request(cases[i]), c.session_options(), inject,
            [&](const Injection& inj, const std::string& session) {
              evicted_seen.wait();
              c.apply(inj, session);
            },
            {});
        }
      });
    for (auto& t : threads)
      t.join();
    for (std::size_t i = 0; i < cases.size(); ++i) {
      ASSERT_TRUE(outs[i].ok()) << "case " << i << ": " << sys.render(outs[i].error);
      EXPECT_EQ(outs[i].result.ids, cases[i].ids) << "case " << i << " differs from llama.cpp";
    }
    EXPECT_GE(outs[0].result.misses[static_cast<std::size_t>(msg::miss_reason::evicted_lru)], 1u)
      << "the eviction reached its session; it saw " << caf::deep_to_string(outs[0].result);
    EXPECT_GE(outs[1].result.reprefills + outs[1].result.retries + outs[1].result.route_changes, 1u)
      << "the kill reached its session";
  }
}

INSTANTIATE_TEST_SUITE_P(Families, Architectures,
                         ::testing::Values("qwen3", "qwen3moe", "mixtral", "gemma2", "gemma3", "phi3"),
                         [](const auto& info) { return std::string(info.param); });

// gemma3-rand: window 16 on layers 0 and 1, layer 2 global. Three sessions
// (prompts of 4, 7 and 24 tokens, prefilled in pieces of 8) generate 256
// tokens (16 times the window) through two shards: the first
// holds only local layers (its main blocks keep the output rows for recovery),
// the second only the global one. While they run, the local pool never holds
// more than the windows' blocks (2 per session: 16 positions span at most two
// 32-position blocks), while the global layer's blocks grow with the text.
TEST(SlidingWindow, GenerationsFarPastTheWindowHoldOnlyTheWindowsBlocks) {
  STRATA_REQUIRE_SHARED("models/gguf/gemma3-rand-f32.gguf");
  const auto model = test::shared_path("models/gguf/gemma3-rand-f32.gguf");
  const auto cases = cases_of("gemma3");
  actors::actor_config cfg;
  caf::actor_system sys{cfg};
  actors::ClusterOptions opts;
  opts.scheduler.prefill_chunk = 8; // the 24-token prompt runs in 3 pieces between decodes
  LocalCluster c(sys, model, model::parse_layer_ranges("0-1,2"), opts);
  const int n = 3;
  const int64_t len = 256;
  std::vector<std::vector<int32_t>> expected(n);
  for (int i = 0; i < n; ++i)
    expected[static_cast<std::size_t>(i)] = test::stateless_ids(model, cases[static_cast<std::size_t>(i + 1)].prompt, len);
  std::atomic<bool> running{true};
  std::atomic<uint64_t> most_window{0}, most_main{0}, samples{0};
  std::thread watcher([&] {
    while (running) {
      for (auto& s : c.stats()) {
        if (s.first == 0) {
          most_window = std::max<uint64_t>(most_window, s.window_used);
          EXPECT_GT(s.window_block_bytes, 0u);
        } else {
          most_main = std::max<uint64_t>(most_main, s.pool_used);
          EXPECT_EQ(s.window_used, 0u) << "the global layer's shard has no window pool";
        }
        ++samples;
      }
    }
  });
  std::vector<actors::Outcome> outs(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      msg::generation_request r;
      r.session = msg::mint_session_id("window");
      r.prompt = cases[static_cast<std::size_t>(i + 1)].prompt;
      r.max_tokens = len;
      outs[static_cast<std::size_t>(i)] = c.generate(r);
    });
  for (auto& t : threads)
    t.join();
  running = false;
  watcher.join();
  test::expect_outcomes(sys, outs, expected);
  for (int i = 0; i < n; ++i) // the references cover the first 64 tokens
    EXPECT_TRUE(std::equal(cases[static_cast<std::size_t>(i + 1)].ids.begin(), cases[static_cast<std::size_t>(i + 1)].ids.end(),
                           outs[static_cast<std::size_t>(i)].result.ids.begin()))
      << "case " << i << " differs from llama.cpp";
  std::cout << "[ info ] most blocks in use: local pool " << most_window << ", global layer's pool " << most_main
            << " (" << samples << " samples)\n";
  EXPECT_GT(samples, 0u);
  EXPECT_GT(most_window, 0u);
  EXPECT_LE(most_window, 2u * n) << "local blocks beyond the windows";
  EXPECT_GE(most_main, 8u) << "the global layer holds every position (the sampler saw at least one long session)";
}

} // namespace
} // namespace strata
