// Recovery v2 in one process: each fault kind on each hop of a 3-shard route
// ends with the failure-free ids, and the work recomputed is exactly the lost
// shard's layers x the lost positions (counted by every shard: the others 0);
// the fallback chain when upstream caches are gone too; and the prefix cache
// under 16 concurrent sessions, a small pool and a kill.

#include "actors/cluster.hpp"
#include "actors/prefix_ids.hpp"
#include "messages/session_id.hpp"
#include "tests/actors/reference.hpp"
#include "tests/support.hpp"

#include <atomic>
#include <mutex>
#include <thread>

namespace strata {
namespace {

using actors::Injection;
using actors::LocalCluster;

msg::generation_request request(std::vector<int32_t> prompt, int64_t n, const model::ModelConfig& cfg) {
  msg::generation_request r;
  r.session = msg::mint_session_id("recovery");
  r.prompt = std::move(prompt);
  r.max_tokens = n;
  r.stop_ids = cfg.eos_ids;
  return r;
}

std::vector<int32_t> prompt_of(int64_t len, int salt, int32_t vocab) {
  std::vector<int32_t> p{1};
  for (int64_t j = 1; j < len; ++j)
    p.push_back(static_cast<int32_t>((7 + 13 * salt + 31 * j) % (vocab - 3) + 3));
  return p;
}

struct FaultCase {
  std::vector<Injection> inject;
  std::vector<int> lost; // hops whose caches are rebuilt
  std::string name;
};

class TargetedRecovery : public ::testing::TestWithParam<FaultCase> {};

// The split 0-1,2-3,4: hops of 2, 2 and 1 layers.
constexpr int64_t hop_layers[3] = {2, 2, 1};

TEST_P(TargetedRecovery, OnlyTheLostLayersAreRecomputedAndTheTextIsUnchanged) {
  actors::actor_config cfg;
  caf::actor_system sys{cfg};
  const auto model = test::stories_or_tiny();
  actors::ClusterOptions opts;
  opts.limits.prefix_cache = false; // exact counts: nothing may come from the prefix cache
  LocalCluster c(sys, model, model::parse_layer_ranges("0-1,2-3,4"), opts);
  const auto prompt = prompt_of(40, 1, static_cast<int32_t>(c.config().vocab_size));
  const int64_t n = 24, at = GetParam().inject.front().at_token;
  const auto expected = test::stateless_ids(model, prompt, n);
  auto out = c.generate(request(prompt, n, c.config()), GetParam().inject);
  ASSERT_TRUE(out.ok()) << sys.render(out.error);
  ASSERT_EQ(out.result.ids, expected) << "the recovery changed the text";
  // The step after the fault had to rebuild the positions before it.
  const auto lost_positions = static_cast<uint64_t>(static_cast<int64_t>(prompt.size()) + at - 1);
  const auto stats = c.stats();
  ASSERT_EQ(stats.size(), 3u);
  uint64_t total = 0;
  for (int h = 0; h < 3; ++h) {
    const bool lost = std::find(GetParam().lost.begin(), GetParam().lost.end(), h) != GetParam().lost.end();
    const uint64_t want = lost ? static_cast<uint64_t>(hop_layers[h]) * lost_positions : 0;
    EXPECT_EQ(stats[static_cast<std::size_t>(h)].recomputed, want) << "hop " << h;
    total += want;
  }
  EXPECT_EQ(out.result.recomputed_layer_tokens, total) << "the session's count is the shards' count";
  EXPECT_EQ(out.result.full_layer_tokens, GetParam().lost.empty() ? 0 : 5 * lost_positions);
  EXPECT_EQ(out.result.reprefills, GetParam().lost.empty() ? 0u : 1u);
  for (auto& st : stats)
    EXPECT_EQ(st.sessions, 0u) << "released at the end";
}

std::vector<FaultCase> fault_cases() {
  std::vector<FaultCase> v;
  for (int h = 0; h < 3; ++h) {
    v.push_back({{Injection{Injection::evict, h, 10, msg::miss_reason::evicted_lru}}, {h}, "Evict_hop" + std::to_string(h)});
    v.push_back({{Injection{Injection::desync, h, 10, {}}}, {h}, "Desync_hop" + std::to_string(h)});
    v.push_back({{Injection{Injection::kill, h, 10, {}}}, {h}, "KillAndReplace_hop" + std::to_string(h)});
  }
  v.push_back({{Injection{Injection::epoch, 0, 10, {}}}, {}, "EpochBumpKeepsEveryHop"});
  // The fallback chain: the upstream copy is gone too, so the rebuild starts
  // further up; with everything gone it is a full re-prefill.
  auto ev = [](int h) { return Injection{Injection::evict, h, 10, msg::miss_reason::evicted_lru}; };
  v.push_back({{ev(1), ev(2)}, {1, 2}, "Fallback_hops1and2"});
  v.push_back({{ev(0), ev(1)}, {0, 1}, "Fallback_hops0and1"});
  v.push_back({{ev(0), ev(1), ev(2)}, {0, 1, 2}, "Fallback_everything"});
  return v;
}

INSTANTIATE_TEST_SUITE_P(ThreeShards, TargetedRecovery, ::testing::ValuesIn(fault_cases()),
                         [](const auto& info) { return info.param.name; });

// SipHash-2-4 against the reference vectors (key 00..0f, messages 00..n-1).
TEST(PrefixIds, SipHashMatchesTheReferenceVectors) {
  const uint64_t k0 = 0x0706050403020100ull, k1 = 0x0f0e0d0c0b0a0908ull;
  std::vector<uint8_t> msg15;
  for (uint8_t i = 0; i < 15; ++i)
    msg15.push_back(i);
  EXPECT_EQ(actors::siphash24(k0, k1, {}, false).hi, 0x726fdb47dd0e0e31ull);
  EXPECT_EQ(actors::siphash24(k0, k1, msg15, false).hi, 0xa129ca6149be45e5ull);
  const auto wide = actors::siphash24(k0, k1, {});
  EXPECT_EQ(wide.hi, 0xe6a825ba047f81a3ull);
  EXPECT_EQ(wide.lo, 0x930255c71472f66dull);
}

// Block ids: the same tokens under the same key give the same chain; another
// key (another head), another recipe or one token changed give other ids.
TEST(PrefixIds, ChainsDependOnEveryTokenBeforeAndTheKey) {
  msg::cache_recipe r{"llama", "builtin:tiny", "f32", "f32", 5, 2, 8};
  actors::PrefixIds a(r, 1, 2), b(r, 3, 4);
  std::vector<int32_t> t(100);
  for (int i = 0; i < 100; ++i)
    t[static_cast<std::size_t>(i)] = i;
  std::vector<model::BlockId> x, y, z;
  a.extend(x, t);
  ASSERT_EQ(x.size(), 3u) << "only full blocks";
  a.extend(y, std::span<const int32_t>(t).first(64));
  a.extend(y, t);
  EXPECT_EQ(x, y) << "extending later gives the same chain";
  b.extend(z, t);
  EXPECT_NE(x[0], z[0]);
  auto u = t;
  u[3] = 99;
  std::vector<model::BlockId> w;
  a.extend(w, u);
  EXPECT_NE(w[0], x[0]);
  EXPECT_NE(w[2], x[2]) << "a change in block 0 changes every later id";
  r.dtype = "bf16";
  actors::PrefixIds c(r, 1, 2);
  std::vector<model::BlockId> v;
  c.extend(v, t);
  EXPECT_NE(v[0], x[0]);
}

struct PrefixCache : ::testing::Test {
  actors::actor_config cfg;
  caf::actor_system sys{cfg};
};

// 16 sessions whose prompts share a 200-token prefix, against pools too small
// for all of them (evictions), with the middle shard killed and replaced while
// they generate: every text equals its lone stateless run, and the prefix was
// taken from the cache instead of computed.
TEST_F(PrefixCache, SixteenSessionsShareAPrefixThroughEvictionsAndAKill) {
  const auto model = test::stories_or_tiny();
  actors::ClusterOptions opts;
  opts.session.max_retries = 1000;
  LocalCluster probe(sys, model, model::parse_layer_ranges("0-1,2-3,4"));
  const auto& mc = probe.config();
  const auto vocab = static_cast<int32_t>(mc.vocab_size);
  // 14 blocks of the largest shards (2 layers with their output rows): a
  // session of 200 + 4 + 20 tokens needs 7 blocks; 16 of them need 22 with the
  // 6 prefix blocks shared (and 112 without).
  const auto kv = mc.n_kv_heads * (mc.dim / mc.n_heads);
  opts.limits.max_bytes = static_cast<std::size_t>(14 * (2 * 2 * 32 * kv + 32 * mc.dim)) * sizeof(float);
  LocalCluster c(sys, model, model::parse_layer_ranges("0-1,2-3,4"), opts);
  const int n = 16;
  const int64_t len = 20;
  const auto shared = prompt_of(200, 7, vocab);
  std::vector<std::vector<int32_t>> prompts(n), expected(n);
  for (int i = 0; i < n; ++i) {
    auto p = shared;
    for (int j = 0; j < 4; ++j)
      p.push_back(static_cast<int32_t>((11 * i + 5 * j) % (vocab - 3) + 3));
    prompts[static_cast<std::size_t>(i)] = p;
    expected[static_cast<std::size_t>(i)] = test::stateless_ids(model, p, len);
  }
  // One session puts the prefix in the cache (a system prompt served before).
  auto first = c.generate(request(prompts[0], len, c.config()));
  ASSERT_TRUE(first.ok()) << sys.render(first.error);
  EXPECT_EQ(first.result.ids, expected[0]);
  std::atomic<bool> running{true};
  std::atomic<int> over{0};
  std::thread watcher([&] {
    while (running)
      for (auto& s : c.stats())
        if (s.pool_used > s.pool_blocks)
          ++over;
  });
  std::mutex m;
  std::condition_variable cv;
  int streamed = 0;
  std::vector<actors::Outcome> outs(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      outs[static_cast<std::size_t>(i)] = c.generate(request(prompts[static_cast<std::size_t>(i)], len, c.config()),
                                                      [&](auto&) {
                                                        std::lock_guard lock(m);
                                                        ++streamed;
                                                        cv.notify_all();
                                                      });
    });
  {
    std::unique_lock lock(m); // a kill while every session is mid-generation
    cv.wait(lock, [&] { return streamed >= n * 3; });
  }
  c.kill_and_replace(1);
  for (auto& t : threads)
    t.join();
  running = false;
  watcher.join();
  test::expect_outcomes(sys, outs, expected);
  EXPECT_EQ(over, 0) << "a pool held more blocks than it has";
  uint64_t evictions = 0;
  for (auto& o : outs)
    evictions += o.result.reprefills;
  const auto stats = c.stats();
  for (std::size_t h = 0; h < stats.size(); ++h) {
    evictions += stats[h].evictions;
    if (h != 1) { // the replacement started empty; the others served the prefix from their caches
      EXPECT_GE(stats[h].prefix_hit_tokens, 6u * 32u) << "hop " << h;
    }
    EXPECT_EQ(stats[h].sessions, 0u);
    EXPECT_EQ(stats[h].pool_used, 0u) << "hop " << h << ": every block is back (cached or free)";
  }
  EXPECT_GT(evictions, 0u) << "the small pools should have forced evictions and recoveries";
  std::cout << "[ info ] evictions and recoveries: " << evictions << ", prefix tokens reused per hop: " << stats[0].prefix_hit_tokens
            << " / " << stats[1].prefix_hit_tokens << " / " << stats[2].prefix_hit_tokens << "\n";
}

} // namespace
} // namespace strata
