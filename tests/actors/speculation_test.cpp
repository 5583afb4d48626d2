// Speculative decoding (issue 27): prompt-lookup proposals, the draft
// controller, the sampler's verification rule, and end to end through shard
// and session actors: greedy output equal to plain decoding through 1 and 3
// shards under faults, 8 concurrent sessions mixing speculative and plain
// ones, sampled tokens distributed as without speculation, and rejected rows
// leaving every cache as if they never came.

#include "actors/cluster.hpp"
#include "actors/drafter.hpp"
#include "actors/speculation.hpp"
#include "messages/session_id.hpp"
#include "model/transformer/sampler.hpp"
#include "model/transformer/shard.hpp"
#include "tests/actors/reference.hpp"
#include "tests/support.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <thread>

namespace strata {
namespace {

using actors::Injection;
using actors::LocalCluster;

// A prompt that repeats itself, as stories do: lookup finds proposals at once.
std::vector<int32_t> repeating_prompt(int salt, int32_t vocab) {
  std::vector<int32_t> p{1};
  for (int rep = 0; rep < 3; ++rep)
    for (int j = 0; j < 9; ++j)
      p.push_back(static_cast<int32_t>((5 + 17 * salt + 29 * j) % (vocab - 3) + 3));
  return p;
}

msg::generation_request request(std::vector<int32_t> prompt, int64_t n, const model::ModelConfig& cfg,
                                uint32_t speculate) {
  msg::generation_request r;
  r.session = msg::mint_session_id("spec");
  r.prompt = std::move(prompt);
  r.max_tokens = n;
  r.stop_ids = cfg.eos_ids;
  r.speculate = speculate;
  return r;
}

// Two-sample chi-square over the categories, pooling those with fewer than 10
// draws in both samples into one; returns (statistic, degrees of freedom).
std::pair<double, int> chi_square(const std::map<int32_t, int>& a, const std::map<int32_t, int>& b) {
  std::map<int32_t, std::pair<int, int>> bins;
  for (auto [k, n] : a)
    bins[k].first += n;
  for (auto [k, n] : b)
    bins[k].second += n;
  std::vector<std::pair<double, double>> cells;
  std::pair<double, double> rest{0, 0};
  for (auto& [k, ab] : bins) {
    if (ab.first + ab.second < 10)
      rest = {rest.first + ab.first, rest.second + ab.second};
    else
      cells.emplace_back(ab.first, ab.second);
  }
  if (rest.first + rest.second > 0)
    cells.push_back(rest);
  double na = 0, nb = 0;
  for (auto& c : cells) {
    na += c.first;
    nb += c.second;
  }
  double x2 = 0;
  for (auto& c : cells) {
    const double tot = c.first + c.second;
    const double ea = tot * na / (na + nb), eb = tot * nb / (na + nb);
    x2 += (c.first - ea) * (c.first - ea) / ea + (c.second - eb) * (c.second - eb) / eb;
  }
  return {x2, static_cast<int>(cells.size()) - 1};
}

// The chi-square value that a true null exceeds with probability 0.001
// (Wilson-Hilferty: z = 3.09).
double chi_square_bound(int df) {
  const double d = std::max(1, df), z = 3.09;
  return d * std::pow(1 - 2 / (9 * d) + z * std::sqrt(2 / (9 * d)), 3);
}

TEST(LookupProposal, TakesWhatMostMatchesOfTheLongestNgramContinuedWith) {
  //                         0  1  2  3  4  5  6  7  8  9 10 11
  const std::vector<int32_t> s{5, 6, 7, 8, 9, 5, 6, 7, 4, 2, 6, 7};
  // Last 2 tokens "6 7": latest earlier match at 6 (followed by 4 2 6 7).
  EXPECT_EQ(actors::lookup_proposal(s, 3), (std::vector<int32_t>{4, 2, 6}));
  EXPECT_EQ(actors::lookup_proposal(s, 10), (std::vector<int32_t>{4, 2, 6, 7})) << "up to the end of the sequence";
  // "5 6 7" occurs at 0 and 5; the 3-gram at the end is "2 6 7": none; "6 7" decides.
  const std::vector<int32_t> t{1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3};
  EXPECT_EQ(actors::lookup_proposal(t, 2), (std::vector<int32_t>{9, 1})) << "the longest n-gram, its latest match";
  // "2 3" (no 3-gram "3 2 3" before) continued twice with 9, once (the latest) with 5.
  const std::vector<int32_t> u{2, 3, 9, 8, 2, 3, 9, 7, 2, 3, 5, 8, 2, 3};
  EXPECT_EQ(actors::lookup_proposal(u, 3), (std::vector<int32_t>{9, 7, 2})) << "the majority (9), then a tie between the two that agreed: the latest";
  EXPECT_TRUE(actors::lookup_proposal(std::vector<int32_t>{1, 2, 3, 4}, 4).empty()) << "nothing repeats";
  EXPECT_TRUE(actors::lookup_proposal(s, 0).empty());
  EXPECT_TRUE(actors::lookup_proposal(std::vector<int32_t>{}, 4).empty());
  EXPECT_TRUE(actors::lookup_proposal(std::vector<int32_t>{3}, 4).empty());
}

TEST(DraftControl, FollowsTheAcceptanceAndStopsWhereNothingIsTaken) {
  actors::DraftControl c(6, 3);
  c.plain_step(100); // a trip timed (else every third step would go plain to time one)
  EXPECT_EQ(c.next(), 6u);
  c.observe(6, 2);
  EXPECT_EQ(c.next(), 3u) << "what was taken plus one";
  c.observe(3, 3);
  EXPECT_EQ(c.next(), 4u) << "all taken: one more";
  c.observe(4, 0);
  EXPECT_EQ(c.next(), 2u) << "none taken: half";
  c.observe(2, 0);
  c.observe(1, 0);
  EXPECT_EQ(c.next(), 0u) << "three steps in a row took nothing: a pause";
  c.plain_step();
  c.plain_step();
  EXPECT_EQ(c.next(), 1u) << "after 2 plain steps it proposes again";
  for (int i = 0; i < 3; ++i)
    c.observe(1, 0);
  int paused = 0;
  while (c.next() == 0) {
    c.plain_step();
    ++paused;
  }
  EXPECT_EQ(paused, 4) << "pauses double";
  c.observe(1, 1);
  EXPECT_EQ(c.next(), 2u);
}

// Trip time against the cost of proposed rows: long trips make proposals pay,
// a short trip with costly rows and little taken does not (then one probe every
// 32 steps); until a plain trip was timed it proposes what acceptance says.
TEST(DraftControl, WeighsTheTripAgainstWhatProposedRowsCost) {
  {
    actors::DraftControl c(8);
    c.plain_step(100); // a 100 ms trip
    for (int i = 0; i < 10; ++i)
      c.observe(4, 2, 100 + 4 * 0.5); // rows cost 0.5 ms each; half taken
    EXPECT_NEAR(c.trip_ms(), 100, 1e-9);
    EXPECT_NEAR(c.row_ms(), 0.5, 1e-6);
    EXPECT_GT(c.paying(), 4u) << "a long trip: proposing more pays even at this acceptance";
    EXPECT_EQ(c.next(), 3u) << "... but acceptance says what was taken plus one";
  }
  {
    actors::DraftControl c(8);
    c.plain_step(2); // a 2 ms trip, rows that cost 1 ms each, a third taken
    for (int i = 0; i < 6; ++i)
      c.observe(3, i % 3 == 0 ? 1 : 0, 5);
    EXPECT_EQ(c.paying(), 0u);
    int proposing = 0;
    for (int i = 0; i < 64; ++i) {
      proposing += c.next() > 0 ? 1 : 0;
      c.plain_step(2);
    }
    EXPECT_EQ(proposing, 2) << "only the probes every 32 steps";
  }
  {
    actors::DraftControl c(6);
    for (int i = 0; i < 2; ++i)
      c.observe(6, 6); // no times known yet
    EXPECT_EQ(c.next(), 0u) << "after two speculative steps, one plain step to time a trip";
    c.plain_step(10);
    EXPECT_EQ(c.next(), 6u);
  }
}

// With a draft model it starts small and grows as proposals are taken; a
// proposer that declines (a crowd) is not asked again for 32 steps.
TEST(DraftControl, StartsWhereToldAndRestsAfterADecline) {
  actors::DraftControl c(8, 3, 2);
  EXPECT_EQ(c.next(), 2u);
  c.observe(2, 2);
  EXPECT_EQ(c.next(), 3u) << "all taken: one more";
  EXPECT_EQ(actors::DraftControl(3, 3, 9).next(), 3u) << "never past the maximum";
  EXPECT_EQ(actors::DraftControl(3, 3, 0).next(), 1u) << "at least one";
  c.plain_step(10);
  c.declined();
  int resting = 0;
  while (c.next() == 0 && resting < 100) {
    c.plain_step(10);
    ++resting;
  }
  EXPECT_EQ(resting, 32);
  EXPECT_EQ(c.next(), 3u) << "then as before";
}

// The rule keeps the model's distribution: over many draws, verify(logits, d)
// emits each token as often as sample(logits) does, for a proposal the model
// likes, one it does not, one outside the nucleus, under top-p and top-k.
TEST(SpeculativeSampling, VerifyEmitsTokensDistributedAsSample) {
  const std::vector<float> logits{2.0f, 1.6f, 1.1f, 0.7f, 0.2f, -0.4f, -1.0f, -2.5f, 0.9f, 1.3f};
  const int N = 60000;
  for (auto [temperature, top_p, top_k] : {std::tuple{1.0f, 1.0f, 0}, std::tuple{1.0f, 0.9f, 0},
                                           std::tuple{0.7f, 1.0f, 5}}) {
    for (int32_t draft : {0, 3, 7}) {
      model::SamplingParams p{temperature, top_k, top_p, 11, 0};
      model::Sampler plain(p), spec(model::SamplingParams{temperature, top_k, top_p, 12, 0});
      std::map<int32_t, int> a, b;
      int taken = 0;
      for (int i = 0; i < N; ++i) {
        ++a[plain.sample(logits)];
        const auto v = spec.verify(logits, draft);
        ++b[v.token];
        taken += v.accepted ? 1 : 0;
        if (v.accepted)
          ASSERT_EQ(v.token, draft);
        else
          ASSERT_NE(v.token, draft) << "a refused proposal is never the emitted token";
      }
      const auto [x2, df] = chi_square(a, b);
      EXPECT_LT(x2, chi_square_bound(df)) << "T " << temperature << " top_p " << top_p << " top_k " << top_k
                                          << " draft " << draft << ": chi-square " << x2 << " over " << df
                                          << " degrees of freedom";
      EXPECT_NEAR(static_cast<double>(taken) / N, static_cast<double>(a[draft]) / N, 0.015)
        << "a proposal is taken as often as the model would pick it";
    }
  }
  model::Sampler greedy(model::SamplingParams{});
  EXPECT_TRUE(greedy.verify(logits, 0).accepted);
  EXPECT_EQ(greedy.verify(logits, 1).token, 0);
}

// Rollback at the model's level: one forward of a token and 3 proposals, cut
// back to the token, then the next token: logits bit for bit those of plain
// decoding, and the pool holds the same blocks (the proposals crossed a block
// boundary; that block went back).
TEST(SpeculativeRollback, RejectedRowsLeaveTheCacheAsIfTheyNeverCame) {
  const auto model = test::stories_or_tiny();
  auto shard = model::Shard::load(model);
  const auto V = static_cast<std::size_t>(shard->config().vocab_size);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 30; ++i)
    prompt.push_back(static_cast<int32_t>((3 + 7 * i) % (static_cast<int32_t>(V) - 3) + 3));
  model::KVCache a(shard->new_pool(std::size_t{1} << 24)), b(shard->new_pool(std::size_t{1} << 24));
  for (auto* c : {&a, &b})
    shard->forward(prompt, model::consecutive_positions(0, 30), *c);
  const int32_t t1 = 5, t2 = 9;
  const std::vector<int32_t> plain1{t1}, spec1{t1, 11, 12, 13};
  const auto pa = shard->forward(plain1, model::consecutive_positions(30, 1), a);
  ASSERT_TRUE(b.reserve(34));
  const auto pos = model::consecutive_positions(30, 4);
  model::SeqStep st;
  st.tokens = spec1;
  st.positions = pos;
  st.cache = &b;
  st.logit_rows = 4;
  auto outs = shard->forward(std::span<const model::SeqStep>(&st, 1));
  ASSERT_FALSE(outs[0].error);
  ASSERT_EQ(outs[0].out.logits.size(), 4 * V);
  EXPECT_TRUE(std::equal(pa.logits.begin(), pa.logits.end(), outs[0].out.logits.begin()))
    << "the token's row among proposals is the plain row";
  EXPECT_EQ(b.blocks(), 2) << "the proposals reached a second block";
  b.truncate(31);
  EXPECT_EQ(b.blocks(), 1);
  EXPECT_EQ(a.pool()->in_use(), b.pool()->in_use()) << "the block of the proposals went back";
  const std::vector<int32_t> next{t2};
  const auto la = shard->forward(next, model::consecutive_positions(31, 1), a);
  const auto lb = shard->forward(next, model::consecutive_positions(31, 1), b);
  EXPECT_EQ(la.logits, lb.logits) << "the next step's logits equal the plain run's";
}

struct FaultCase {
  std::string shards;
  std::vector<Injection> inject;
  std::string name;
};

// Who proposes: prompt lookup, the model itself as its draft (every proposal
// taken), or a draft that is mostly refused (stories260K's q4_0 file: a
// quantized stories260K drifts far from its f32 self).
enum class Proposer { lookup, self_draft, poor_draft };

std::string poor_draft_path() {
  return test::have_shared("models/gguf/stories260K-q4_0.gguf") && test::have_shared("models/stories260K.bin")
           ? test::shared_path("models/gguf/stories260K-q4_0.gguf")
           : test::stories_or_tiny();
}

class SpeculativeGreedy : public ::testing::TestWithParam<std::tuple<FaultCase, Proposer>> {};

// Greedy speculation through 1 and 3 shards, with a fault at a step in the
// middle of the generation (so the step after it carries proposals and
// rebuilds): the ids equal the plain stateless run, and proposals were taken.
TEST_P(SpeculativeGreedy, EqualsPlainDecodingUnderFaults) {
  const auto& [fault, proposer] = GetParam();
  actors::actor_config cfg;
  caf::actor_system sys{cfg};
  const auto model = test::stories_or_tiny();
  actors::ClusterOptions opts;
  if (proposer != Proposer::lookup)
    opts.session.drafter = actors::spawn_drafter(sys, proposer == Proposer::self_draft ? model : poor_draft_path(),
                                                 model::read_config(model).vocab_size);
  LocalCluster c(sys, model, model::parse_layer_ranges(fault.shards), opts);
  const auto prompt = repeating_prompt(1, static_cast<int32_t>(c.config().vocab_size));
  const int64_t n = 120;
  const auto expected = test::stateless_ids(model, prompt, n);
  auto out = c.generate(request(prompt, n, c.config(), 6), fault.inject);
  if (opts.session.drafter)
    caf::anon_send_exit(opts.session.drafter, caf::exit_reason::user_shutdown);
  ASSERT_TRUE(out.ok()) << sys.render(out.error);
  EXPECT_EQ(out.result.ids, expected);
  EXPECT_GT(out.result.accepted, 0u) << "proposals the model took";
  // Fewer trips than tokens, not counting the trips the faults cost: each cache
  // miss and each retry (a timed-out step under load, a route that changed)
  // sends at most one step more, and how many retries a kill costs depends on
  // timing.
  uint64_t fault_trips = out.result.retries;
  for (auto m : out.result.misses)
    fault_trips += m;
  EXPECT_LT(out.result.steps - std::min(fault_trips, out.result.steps), static_cast<uint64_t>(n))
    << "fewer trips than tokens: " << out.result.steps << " steps, " << fault_trips << " of them for faults, "
    << out.result.accepted << " proposals taken";
  if (proposer == Proposer::self_draft) {
    EXPECT_EQ(out.result.accepted, out.result.proposed) << "the model agrees with itself";
  }
  for (auto& s : c.stats())
    EXPECT_EQ(s.pool_used, 0u) << "every block back at the end";
}

std::vector<FaultCase> fault_cases() {
  auto at = [](Injection::Kind k, int64_t hop, int64_t t) { return Injection{k, hop, t, msg::miss_reason::evicted_lru}; };
  return {
    {"0-4", {}, "OneShard"},
    {"0-4", {at(Injection::evict, 0, 37)}, "OneShardEvict"},
    {"0-1,2-3,4", {}, "ThreeShards"},
    {"0-1,2-3,4", {at(Injection::evict, 1, 21), at(Injection::kill, 2, 47)}, "ThreeShardsEvictAndKill"},
    {"0-1,2-3,4", {at(Injection::kill, 0, 33), at(Injection::epoch, 0, 61)}, "ThreeShardsKillHeadAndEpoch"},
    {"0-1,2-3,4", {at(Injection::desync, 1, 29), at(Injection::dup, 2, 52)}, "ThreeShardsDesyncAndDuplicate"},
  };
}

INSTANTIATE_TEST_SUITE_P(Routes, SpeculativeGreedy,
                         ::testing::Combine(::testing::ValuesIn(fault_cases()),
                                            ::testing::Values(Proposer::lookup, Proposer::self_draft, Proposer::poor_draft)),
                         [](const auto& info) {
                           const auto p = std::get<1>(info.param);
                           return std::get<0>(info.param).name + (p == Proposer::lookup       ? "_Lookup"
                                                                  : p == Proposer::self_draft ? "_SelfDraft"
                                                                                              : "_PoorDraft");
                         });

// 8 staggered sessions through 3 shards while session 0 injects an eviction
// and an epoch bump: session i proposes up to speculate(i) tokens (0: plain), by
// the draft model where drafted(i) (declining while more than max_crowd draft
// at once; 0: never), else by lookup. Each equals its lone
// stateless run; plain sessions propose nothing; some proposals were taken and
// some refused and cut back.
void crowd_equals_alone(const std::function<uint32_t(int)>& speculate, const std::function<bool(int)>& drafted_session,
                        std::size_t max_crowd) {
  actors::actor_config cfg;
  caf::actor_system sys{cfg};
  const auto model = test::stories_or_tiny();
  actors::ClusterOptions opts;
  opts.session.max_retries = 100;
  LocalCluster c(sys, model, model::parse_layer_ranges("0-1,2-3,4"), opts);
  auto drafted = c.session_options();
  actors::DrafterLimits limits;
  limits.max_crowd = max_crowd;
  drafted.drafter = actors::spawn_drafter(sys, poor_draft_path(), c.config().vocab_size, {}, limits);
  const auto vocab = static_cast<int32_t>(c.config().vocab_size);
  const int n = 8;
  const int64_t len = 80;
  std::vector<std::vector<int32_t>> expected(n);
  for (int i = 0; i < n; ++i)
    expected[static_cast<std::size_t>(i)] = test::stateless_ids(model, repeating_prompt(i, vocab), len);
  auto outs = test::run_staggered<actors::Outcome>(n, [&](int i, const auto& on_token) {
    auto req = request(repeating_prompt(i, vocab), len, c.config(), speculate(i));
    if (i == 0) // the first session puts the faults in place while the others run
      return c.generate(req, {Injection{Injection::evict, 1, 20, msg::miss_reason::evicted_lru},
                              Injection{Injection::epoch, 0, 40, {}}},
                        on_token);
    if (drafted_session(i))
      return actors::run_generation(sys, c.supervisor(), req, drafted, {}, {}, on_token);
    return c.generate(req, on_token);
  });
  caf::anon_send_exit(drafted.drafter, caf::exit_reason::user_shutdown);
  uint64_t accepted = 0;
  for (int i = 0; i < n; ++i) {
    auto& o = outs[static_cast<std::size_t>(i)];
    ASSERT_TRUE(o.ok()) << "session " << i << ": " << sys.render(o.error);
    EXPECT_EQ(o.result.ids, expected[static_cast<std::size_t>(i)]) << "session " << i;
    if (speculate(i) == 0) {
      EXPECT_EQ(o.result.proposed, 0u);
    }
    accepted += o.result.accepted;
  }
  EXPECT_GT(accepted, 0u);
  uint64_t rolled = 0;
  for (auto& s : c.stats())
    rolled += s.rolled_back;
  EXPECT_GT(rolled, 0u) << "some proposals were refused and cut back";
}

// 8 sessions at once, half speculative (by lookup and with a draft model), half
// plain, started as a crowd that grows, while the middle hop is evicted and the
// route epoch bumped: each equals the same request alone.
TEST(SpeculativeCrowd, EightSessionsMixingSpeculativeAndPlainEachEqualAlone) {
  // Even sessions speculate: 2 and 6 with a draft model, 0 and 4 by lookup.
  crowd_equals_alone([](int i) { return i % 2 == 0 ? 8u : 0u; }, [](int i) { return i % 4 == 2; }, 0);
}

// Seven sessions ask the one drafter at once (its rounds may hold several
// sessions' requests) while session 0 injects the faults; then again with a
// drafter that declines while more than 3 draft at once (sessions stepping
// with and without it as the crowd grows and shrinks).
TEST(SpeculativeCrowd, SevenSessionsDraftingAtOnceUnderFaultsEachEqualAlone) {
  crowd_equals_alone([](int) { return 8u; }, [](int i) { return i != 0; }, 0);
  crowd_equals_alone([](int) { return 8u; }, [](int i) { return i != 0; }, 3);
}

// What a fresh drafter proposes for `seq` alone.
std::vector<int32_t> draft_alone(const std::shared_ptr<model::Shard>& draft, const std::vector<int32_t>& seq, uint32_t k) {
  actors::drafter_state st;
  st.model = draft;
  st.pool = draft->new_pool(st.limits.cache_bytes);
  st.pool->set_prefix_cache(false);
  return st.propose("alone", seq, k);
}

// The crowd gate: a session counts as drafting from its first request until it
// releases (or is idle for crowd_idle); while more draft than max_crowd, every
// request is answered at once with no proposals, then as before; the drafter
// counts it all (stats_atom).
TEST(Drafter, DeclinesWhileMoreSessionsDraftThanItsLimit) {
  using clk = std::chrono::steady_clock;
  {
    actors::drafter_state st;
    st.limits.max_crowd = 2;
    const auto t0 = clk::now();
    EXPECT_FALSE(st.crowded("a", t0));
    EXPECT_FALSE(st.crowded("b", t0));
    EXPECT_TRUE(st.crowded("c", t0));
    EXPECT_TRUE(st.crowded("a", t0 + std::chrono::seconds(10))) << "c still counts";
    EXPECT_FALSE(st.crowded("a", t0 + std::chrono::seconds(31))) << "b and c have been idle past crowd_idle";
    EXPECT_EQ(st.drafting.size(), 1u);
    st.limits.max_crowd = 0;
    for (int i = 0; i < 100; ++i)
      EXPECT_FALSE(st.crowded("s" + std::to_string(i), t0 + std::chrono::seconds(31))) << "0: no limit";
  }
  actors::actor_config cfg;
  caf::actor_system sys{cfg};
  const std::shared_ptr<model::Shard> draft = model::Shard::load(poor_draft_path());
  actors::DrafterLimits limits;
  limits.max_crowd = 2;
  auto d = actors::spawn_drafter(sys, draft, draft->config().vocab_size, limits);
  caf::scoped_actor self{sys};
  const std::vector<int32_t> seq{1, 5, 9, 13};
  const auto ask = [&](const std::string& session) {
    std::vector<int32_t> got;
    self->request(d, std::chrono::seconds(30), atom::propose_atom_v, session, seq, uint32_t{3})
      .receive([&](std::vector<int32_t>& p) { got = std::move(p); },
               [&](caf::error& e) { ADD_FAILURE() << sys.render(e); });
    return got;
  };
  const auto alone = draft_alone(draft, seq, 3);
  ASSERT_EQ(alone.size(), 3u);
  EXPECT_EQ(ask("a"), alone);
  EXPECT_EQ(ask("b"), alone);
  EXPECT_TRUE(ask("c").empty()) << "a third session drafting: declined";
  EXPECT_TRUE(ask("a").empty()) << "every session, while the crowd is there";
  self->send(d, atom::release_atom_v, std::string("c")); // (before the next request: one sender's messages keep their order)
  const auto again = ask("a");
  EXPECT_EQ(again, alone) << "fewer drafting: proposals again, the same as alone";
  // Its counts (serve's /metrics): 3 answered, 2 declined, a and b drafting.
  self->request(d, std::chrono::seconds(30), atom::stats_atom_v)
    .receive(
      [&](uint64_t proposals, uint64_t positions, uint64_t passes, uint64_t declined, uint64_t drafting) {
        EXPECT_EQ(proposals, 3u);
        EXPECT_EQ(declined, 2u);
        EXPECT_EQ(drafting, 2u);
        EXPECT_GE(positions, passes);
      },
      [&](caf::error& e) { ADD_FAILURE() << sys.render(e); });
  caf::anon_send_exit(d, caf::exit_reason::user_shutdown);
}

// The drafter answers the requests of a round together: one batched forward
// pass of the draft model a token for all of them. Each request gets exactly
// the proposal it gets alone; a session asking twice is served after its first
// request; a bad request fails alone. The passes are those of the longest
// request (plus the second wave), not the sum.
TEST(Drafter, ABatchOfRequestsProposesWhatEachGetsAloneInOnePassAToken) {
  const std::shared_ptr<model::Shard> draft = model::Shard::load(poor_draft_path());
  const auto& cfg = draft->config();
  const auto vocab = static_cast<int32_t>(cfg.vocab_size);
  const auto fresh = [&] {
    auto st = std::make_unique<actors::drafter_state>();
    st->model = draft;
    st->pool = draft->new_pool(st->limits.cache_bytes);
    st->pool->set_prefix_cache(false);
    return st;
  };
  const auto seq_of = [&](int salt, int64_t len) {
    std::vector<int32_t> s;
    for (int64_t j = 0; j < len; ++j)
      s.push_back(static_cast<int32_t>((7 + 13 * salt + 31 * j + j * j) % (vocab - 3) + 3));
    return s;
  };
  const int64_t longest = std::min<int64_t>(300, cfg.max_seq_len - 20); // two pieces of 256 where it fits
  using Request = actors::drafter_state::Request;
  std::vector<Request> requests{
    {"a", seq_of(1, 5), 3},
    {"b", seq_of(2, 40), 8},
    {"c", seq_of(3, longest), 15},
    {"d", seq_of(4, 1), 1},
    {"e", {}, 4},                 // nothing to propose after
    {"f", seq_of(6, 9), 0},       // none asked for
    {"g", {1, vocab + 5}, 4},     // outside the vocabulary: fails alone
    {"a", seq_of(1, 4), 5},       // "a" again: after its first request, from its cache
  };
  auto batched = fresh();
  const auto answers = batched->propose_all(requests);
  ASSERT_EQ(answers.size(), requests.size());
  auto alone = fresh();
  for (std::size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE("request " + std::to_string(i) + " of session " + requests[i].session);
    if (requests[i].session == "g") {
      ASSERT_TRUE(answers[i].error);
      EXPECT_EQ(answers[i].error->code(), model::errc::token_out_of_range) << answers[i].error->what();
      EXPECT_TRUE(answers[i].tokens.empty());
      EXPECT_THROW(alone->propose(requests[i].session, requests[i].seq, requests[i].k), model::Error);
      continue;
    }
    ASSERT_FALSE(answers[i].error) << answers[i].error->what();
    const auto expected = alone->propose(requests[i].session, requests[i].seq, requests[i].k);
    EXPECT_EQ(answers[i].tokens, expected);
    const std::size_t k = requests[i].seq.empty() ? 0 : requests[i].k;
    EXPECT_EQ(answers[i].tokens.size(), k);
  }
  // First wave: the longest job's pieces (longest/256 rounded up) and then k - 1
  // tokens; second wave: "a" again, whose cache holds 3 of its 4 tokens: one
  // piece of 1 token, then 4 tokens.
  const uint64_t first = static_cast<uint64_t>((longest + 255) / 256 + 15 - 1), second = 1 + 5 - 1;
  EXPECT_EQ(batched->passes, first + second);
  EXPECT_GT(alone->passes, batched->passes) << "alone, every request runs its own passes";
  EXPECT_EQ(batched->computed, alone->computed) << "the same positions computed either way";
  EXPECT_EQ(batched->index.count("g"), 0u) << "a failed request's cache is dropped";
}

// Sampling (temperature 1, and top-p 0.9): over many seeds, the tokens a
// speculative step emits are distributed as plain decoding's: tokens 2 to 8 of
// each run, counted by position (a repeating prompt, so proposals come early).
TEST(SpeculativeSampling, SampledTokensFollowThePlainDistribution) {
  actors::actor_config cfg;
  caf::actor_system sys{cfg};
  const auto model = test::stories_or_tiny();
  LocalCluster c(sys, model, model::parse_layer_ranges("0-2,3-4"));
  const auto prompt = repeating_prompt(2, static_cast<int32_t>(c.config().vocab_size));
  for (float top_p : {1.0f, 0.9f}) {
    std::map<int32_t, int> plain, spec;
    uint64_t proposed = 0;
    const int runs = 300;
    for (int s = 0; s < runs; ++s)
      for (uint32_t k : {0u, 4u}) {
        auto req = request(prompt, 8, c.config(), k);
        req.sampling.temperature = 1.0f;
        req.sampling.top_p = top_p;
        req.sampling.rng_state = model::Sampler(model::SamplingParams{1.0f, 0, top_p, static_cast<uint64_t>(s + 1000 * k), 0}).state();
        auto out = c.generate(req);
        ASSERT_TRUE(out.ok()) << sys.render(out.error);
        proposed += out.result.proposed;
        auto& m = k == 0 ? plain : spec;
        for (std::size_t i = 1; i < out.result.ids.size(); ++i)
          ++m[out.result.ids[i] * 1000 + static_cast<int32_t>(i)];
      }
    EXPECT_GT(proposed, 100u);
    std::printf("top_p %.1f: %llu proposed over %d speculative runs\n", top_p, static_cast<unsigned long long>(proposed), runs);
    const auto [x2, df] = chi_square(plain, spec);
    EXPECT_LT(x2, chi_square_bound(df)) << "top_p " << top_p << ": chi-square " << x2 << " over " << df
                                        << " degrees of freedom";
  }
}

} // namespace
} // namespace strata

namespace strata {
namespace {

// Sliding windows: gemma3-rand (window 16 on 2 of its 3 layers) through 3
// shards, far past its window, with an eviction: the local layers' blocks that
// rejected rows would have needed stay held until the rows are certain, and
// the ids equal the plain stateless run.
TEST(SpeculativeWindows, AWindowedModelSpeculatesFarPastItsWindow) {
  STRATA_REQUIRE_SHARED("models/gguf/gemma3-rand-f32.gguf");
  const auto model = test::shared_path("models/gguf/gemma3-rand-f32.gguf");
  actors::actor_config cfg;
  caf::actor_system sys{cfg};
  LocalCluster c(sys, model, model::parse_layer_ranges("0,1,2"));
  const auto prompt = repeating_prompt(3, static_cast<int32_t>(c.config().vocab_size));
  const int64_t n = 100;
  const auto expected = test::stateless_ids(model, prompt, n);
  auto out = c.generate(request(prompt, n, c.config(), 6), {Injection{Injection::evict, 1, 50, msg::miss_reason::evicted_lru}});
  ASSERT_TRUE(out.ok()) << sys.render(out.error);
  EXPECT_EQ(out.result.ids, expected);
  EXPECT_GT(out.result.proposed, 0u);
  std::printf("gemma3-rand: %llu proposed, %llu accepted, %llu steps for %zu tokens\n",
              static_cast<unsigned long long>(out.result.proposed), static_cast<unsigned long long>(out.result.accepted),
              static_cast<unsigned long long>(out.result.steps), out.result.ids.size());
}

} // namespace
} // namespace strata
