// The shard scheduler with real shard actors: concurrent sessions started at
// staggered steps are batched and still emit exactly their lone tokens; the
// block pool never exceeds its budget under 32 sessions; a full queue answers
// `overloaded` at once, and sessions ride it out.

#include "actors/cluster.hpp"
#include "actors/shard_actor.hpp"
#include "messages/session_id.hpp"
#include "tests/actors/reference.hpp"
#include "tests/support.hpp"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace strata {
namespace {

using actors::LocalCluster;

using test::stateless_ids;

msg::generation_request request(std::vector<int32_t> prompt, int64_t n, const model::ModelConfig& cfg) {
  msg::generation_request r;
  r.session = msg::mint_session_id("batch");
  r.prompt = std::move(prompt);
  r.max_tokens = n;
  r.stop_ids = cfg.eos_ids;
  return r;
}

std::vector<int32_t> prompt_of(int i, int32_t vocab) {
  std::vector<int32_t> p{1};
  for (int j = 0; j < 3 + 4 * i; ++j) // 3 .. 31 tokens: some beyond the small-row kernel
    p.push_back(static_cast<int32_t>((5 + 17 * i + 29 * j) % (vocab - 3) + 3));
  return p;
}

struct Batching : ::testing::Test {
  actors::actor_config cfg;
  caf::actor_system sys{cfg};
};

// Eight sessions; session i starts once session 0 has streamed i tokens.
void staggered(caf::actor_system& sys, const std::string& model, const std::string& split) {
  actors::ClusterOptions opts;
  opts.scheduler.prefill_chunk = 8; // long prompts run in pieces between decodes
  LocalCluster c(sys, model, model::parse_layer_ranges(split), opts);
  const int n = 8, len = 24;
  const auto vocab = static_cast<int32_t>(c.config().vocab_size);
  std::vector<std::vector<int32_t>> expected(n);
  for (int i = 0; i < n; ++i)
    expected[static_cast<std::size_t>(i)] = stateless_ids(model, prompt_of(i, vocab), len);
  const auto outs = test::run_staggered<actors::Outcome>(n, [&](int i, const auto& on_token) {
    return c.generate(request(prompt_of(i, vocab), len, c.config()), on_token);
  });
  for (int i = 0; i < n; ++i) {
    auto& o = outs[static_cast<std::size_t>(i)];
    ASSERT_TRUE(o.ok()) << i << ": " << sys.render(o.error);
    EXPECT_EQ(o.result.ids, expected[static_cast<std::size_t>(i)]) << "session " << i << " differs from its lone run";
  }
  uint64_t most = 0;
  for (auto& s : c.stats()) {
    EXPECT_GT(s.rounds, 0u);
    EXPECT_LE(s.rounds, s.batched_rows);
    most = std::max(most, s.max_batch);
    EXPECT_EQ(s.queued, 0u);
  }
  std::cout << "[ info ] most sequences in one round: " << most << "\n";
}

TEST_F(Batching, StaggeredSessionsThroughThreeShardsEqualTheirLoneRuns) {
  staggered(sys, "builtin:tiny", "0-1,2-3,4");
}

TEST_F(Batching, StaggeredSessionsThroughOneShardEqualTheirLoneRuns) {
  staggered(sys, "builtin:tiny", "0-4");
}

TEST_F(Batching, StaggeredStoriesSessionsEqualTheirLoneRuns) {
  STRATA_REQUIRE_SHARED("models/stories260K.bin");
  staggered(sys, test::shared_path("models/stories260K.bin"), "0-2,3-4");
}

// 32 concurrent sessions against pools of a few blocks: evictions and
// re-prefills, never more blocks than the pool has, every text exact.
TEST_F(Batching, PoolNeverExceedsItsBudgetUnderThirtyTwoSessions) {
  actors::ClusterOptions opts;
  // 5 layers x 2 x 32 tokens x kv 16 floats per block (first shard: 3 layers).
  opts.limits.max_bytes = 10 * 3 * 2 * model::BlockPool::block_tokens * 16 * sizeof(float);
  opts.session.max_retries = 1000;
  LocalCluster c(sys, "builtin:tiny", model::parse_layer_ranges("0-2,3-4"), opts);
  const int n = 32, len = 40; // prompt + 40 tokens: 2 blocks per session at the end
  std::vector<std::vector<int32_t>> expected(n);
  for (int i = 0; i < n; ++i)
    expected[static_cast<std::size_t>(i)] = stateless_ids("builtin:tiny", prompt_of(i % 4, 259), len);
  std::atomic<bool> running{true};
  std::atomic<int> samples{0}, over{0};
  std::thread watcher([&] {
    while (running) {
      for (auto& s : c.stats()) {
        if (s.pool_used > s.pool_blocks || s.cache_bytes > opts.limits.max_bytes)
          ++over;
        ++samples;
      }
    }
  });
  std::vector<actors::Outcome> outs(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      outs[static_cast<std::size_t>(i)] = c.generate(request(prompt_of(i % 4, 259), len, c.config()));
    });
  for (auto& t : threads)
    t.join();
  running = false;
  watcher.join();
  test::expect_outcomes(sys, outs, expected);
  EXPECT_GT(samples, 0);
  EXPECT_EQ(over, 0) << "a pool held more blocks than it has";
  uint64_t evictions = 0;
  for (auto& s : c.stats()) {
    evictions += s.evictions;
    EXPECT_LE(s.pool_used, s.pool_blocks);
    // The first shard's blocks also keep its output rows (32 x dim floats).
    const auto head_block = (3 * 2 * model::BlockPool::block_tokens * 16 + model::BlockPool::block_tokens * c.config().dim) *
                            static_cast<int64_t>(sizeof(float));
    EXPECT_EQ(s.pool_blocks, s.first == 0 ? opts.limits.max_bytes / static_cast<std::size_t>(head_block) : 15u);
  }
  EXPECT_GT(evictions, 0u) << "the pool should have forced evictions";
}

// A shard whose queue holds 2 steps, sent 24 at once: the excess is refused
// with `overloaded` at once (no hang), the rest answered.
TEST_F(Batching, FullQueueAnswersOverloadedAtOnce) {
  auto shard = std::shared_ptr<model::Shard>(model::Shard::load("builtin:tiny"));
  actors::SchedulerLimits sl;
  sl.max_queue = 2;
  auto a = actors::spawn_shard(sys, shard, {}, {}, {}, std::chrono::milliseconds(1000), sl);
  msg::route_info dummy;
  caf::scoped_actor self{sys};
  const int n = 24;
  for (int i = 0; i < n; ++i) {
    msg::step_request r;
    r.session = msg::mint_session_id("q");
    r.key = msg::mint_session_key();
    r.epoch = 1;
    r.step_id = 1;
    r.mode = static_cast<uint8_t>(msg::step_mode::prefill);
    r.tokens = prompt_of(i % 8, 259);
    r.positions = model::consecutive_positions(0, static_cast<int64_t>(r.tokens.size()));
    r.recipe = msg::cache_recipe::of(shard->config());
    r.route = {msg::hop{caf::actor_cast<msg::shard_actor>(a), 0, 4}};
    self->send(caf::actor_cast<msg::shard_actor>(a), std::move(r));
  }
  int tokens = 0, overloaded = 0, other = 0;
  for (int i = 0; i < n; ++i)
    self->receive([&](msg::step_reply&) { ++tokens; },
                  [&](caf::error& e) { (e == ec::overloaded ? overloaded : other)++; },
                  caf::after(std::chrono::seconds(30)) >> [&] { ADD_FAILURE() << "no answer: a hang"; });
  EXPECT_EQ(tokens + overloaded, n);
  EXPECT_EQ(other, 0);
  EXPECT_GE(tokens, 2);
  EXPECT_GT(overloaded, 0);
  self->request(caf::actor_cast<msg::shard_actor>(a), std::chrono::seconds(5), atom::stats_atom_v)
    .receive([&](msg::shard_stats& s) { EXPECT_EQ(s.overloaded, static_cast<uint64_t>(overloaded)); },
             [&](caf::error& e) { ADD_FAILURE() << sys.render(e); });
  self->send_exit(a, caf::exit_reason::user_shutdown);
}

// Sessions against shards that queue one step at a time: they are refused
// often, back off, and still all end with their exact texts.
TEST_F(Batching, SessionsRideOutOverloadedShards) {
  actors::ClusterOptions opts;
  opts.scheduler.max_queue = 1;
  LocalCluster c(sys, "builtin:tiny", model::parse_layer_ranges("0-2,3-4"), opts);
  const int n = 8, len = 16;
  std::vector<actors::Outcome> outs(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] { outs[static_cast<std::size_t>(i)] = c.generate(request(prompt_of(i, 259), len, c.config())); });
  for (auto& t : threads)
    t.join();
  uint64_t refused = 0;
  for (auto& s : c.stats())
    refused += s.overloaded;
  for (int i = 0; i < n; ++i) {
    auto& o = outs[static_cast<std::size_t>(i)];
    ASSERT_TRUE(o.ok()) << i << ": " << sys.render(o.error);
    EXPECT_EQ(o.result.ids, stateless_ids("builtin:tiny", prompt_of(i, 259), len)) << "session " << i;
    EXPECT_EQ(o.result.reprefills, 0u) << "an overloaded step is sent again, not recomputed";
  }
  std::cout << "[ info ] steps refused as overloaded: " << refused << "\n";
}

// Six sessions decoding together; at token 6 of one of them a fault hits it:
// its cache on hop 1 is evicted (only it misses and re-prefills; the others see
// no miss), or hop 1 is killed and replaced (every session recovers). Every text
// equals its lone run.
void fault_in_a_batch(caf::actor_system& sys, actors::Injection::Kind kind) {
  LocalCluster c(sys, "builtin:tiny", model::parse_layer_ranges("0-1,2-3,4"));
  const int n = 6, len = 24;
  std::vector<std::vector<int32_t>> expected(n);
  for (int i = 0; i < n; ++i)
    expected[static_cast<std::size_t>(i)] = stateless_ids("builtin:tiny", prompt_of(i, 259), len);
  std::vector<actors::Outcome> outs(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      auto req = request(prompt_of(i, 259), len, c.config());
      if (i == 0)
        outs[0] = c.generate(req, {actors::Injection{kind, 1, 6, msg::miss_reason::evicted_lru}});
      else
        outs[static_cast<std::size_t>(i)] = c.generate(req);
    });
  for (auto& t : threads)
    t.join();
  for (int i = 0; i < n; ++i) {
    auto& o = outs[static_cast<std::size_t>(i)];
    ASSERT_TRUE(o.ok()) << i << ": " << sys.render(o.error);
    EXPECT_EQ(o.result.ids, expected[static_cast<std::size_t>(i)]) << "session " << i;
    uint64_t misses = 0;
    for (auto m : o.result.misses)
      misses += m;
    if (kind == actors::Injection::evict) {
      if (i == 0) {
        EXPECT_GE(o.result.misses[static_cast<std::size_t>(msg::miss_reason::evicted_lru)], 1u);
      } else {
        EXPECT_EQ(misses + o.result.reprefills, 0u) << "session " << i << " was not the one hit";
      }
    }
  }
  if (kind == actors::Injection::kill) {
    EXPECT_GE(outs[0].result.reprefills + outs[0].result.retries + outs[0].result.route_changes, 1u);
  }
}

TEST_F(Batching, AnEvictionHitsOneSequenceOfABatchAndTheOthersCarryOn) {
  fault_in_a_batch(sys, actors::Injection::evict);
}

TEST_F(Batching, AKillDuringBatchedDecodingChangesNoToken) {
  fault_in_a_batch(sys, actors::Injection::kill);
}

} // namespace
} // namespace strata
