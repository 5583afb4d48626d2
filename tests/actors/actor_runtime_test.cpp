// The actor runtime in one process: generation through 2 and 3 shard actors
// equals the single-process stateless ids, and every injected failure ends
// with the same ids and the recovery counted.

#include "actors/cluster.hpp"
#include "actors/shard_actor.hpp"
#include "messages/session_id.hpp"
#include "model/transformer/math_thread.hpp"
#include "tests/actors/reference.hpp"
#include "tests/support.hpp"

#include <thread>

namespace strata {
namespace {

using actors::Injection;
using actors::LocalCluster;
using msg::miss_reason;

std::string stories() {
  return test::shared_path("models/stories260K.bin");
}

using test::stateless_ids;

// `what` names the test's session for humans; the id itself is minted.
msg::generation_request request(const std::string& what, std::vector<int32_t> prompt, int64_t n,
                                const model::ModelConfig& cfg) {
  msg::generation_request r;
  r.session = msg::mint_session_id(what);
  r.prompt = std::move(prompt);
  r.max_tokens = n;
  r.stop_ids = cfg.eos_ids;
  return r;
}

// n clients at once, client i generating `tokens` after prompt(i) with the
// faults faults(i); their outcomes in client order.
template <class Prompt, class Faults>
std::vector<actors::Outcome> concurrent_clients(LocalCluster& c, int n, const std::string& what, Prompt prompt,
                                                int64_t tokens, Faults faults) {
  std::vector<actors::Outcome> outs(static_cast<std::size_t>(n));
  std::vector<std::thread> clients;
  for (int i = 0; i < n; ++i)
    clients.emplace_back([&, i] {
      outs[static_cast<std::size_t>(i)] =
        c.generate(request(what + "-" + std::to_string(i), prompt(i), tokens, c.config()), faults(i));
    });
  for (auto& t : clients)
    t.join();
  return outs;
}

struct ActorRuntime : ::testing::Test {
  actors::actor_config cfg;
  caf::actor_system sys{cfg};
};

TEST_F(ActorRuntime, GoldenThroughTwoAndThreeShards) {
  std::vector<std::pair<std::string, std::string>> cases = {{"builtin:tiny", "0-2,3-4"}, {"builtin:tiny", "0-1,2-3,4"}};
  if (test::have_shared("models/stories260K.bin")) {
    cases.push_back({stories(), "0-1,2-4"});
    cases.push_back({stories(), "0,1-3,4"});
  }
  for (auto& [model, split] : cases) {
    LocalCluster c(sys, model, model::parse_layer_ranges(split));
    const std::vector<int32_t> prompt = {1, 60, 70, 80};
    const auto expected = stateless_ids(model, prompt, 60);
    std::vector<int32_t> streamed;
    auto out = c.generate(request("golden", prompt, 60, c.config()),
                          [&](const msg::token_event& ev) {
                            EXPECT_EQ(ev.index, static_cast<int64_t>(streamed.size()));
                            streamed.push_back(ev.token);
                          });
    ASSERT_TRUE(out.ok()) << sys.render(out.error);
    EXPECT_EQ(out.result.ids, expected) << model << " split " << split;
    EXPECT_EQ(streamed, expected);
    EXPECT_EQ(out.result.reprefills, 0u);
  }
}

TEST_F(ActorRuntime, StoriesReferenceThroughShards) {
  STRATA_REQUIRE_SHARED("models/stories260K.bin");
  const auto ref = test::read_json(test::shared_path("models/stories260K.greedy.json"));
  LocalCluster c(sys, stories(), model::parse_layer_ranges("0-1,2-3,4"));
  for (const auto& k : ref["cases"]) {
    auto prompt = k["prompt_ids"].get<std::vector<int32_t>>();
    const int64_t n = k["steps"].get<int64_t>() - static_cast<int64_t>(prompt.size()) + 1;
    auto out = c.generate(request("ref", prompt, n, c.config()));
    ASSERT_TRUE(out.ok()) << sys.render(out.error);
    EXPECT_EQ(out.result.ids, k["expected_generated_ids"].get<std::vector<int32_t>>());
  }
}

struct InjectCase {
  std::string name;
  std::vector<Injection> inject;
  int expect_miss;        // miss_reason counted exactly once, 0 = none
  int64_t route_changes;  // exact, or -1 for "at least one"
  int64_t reprefills;     // exact, or -1 for "at least one"
};

class Injections : public ::testing::TestWithParam<InjectCase> {};

TEST_P(Injections, OutputIdenticalAndRecoveryCounted) {
  actors::actor_config cfg;
  caf::actor_system sys{cfg};
  const std::string model = test::have_shared("models/stories260K.bin") ? stories() : "builtin:tiny";
  const std::vector<int32_t> prompt = {1, 300 % 259, 301 % 259};
  const auto expected = stateless_ids(model, prompt, 80);
  LocalCluster c(sys, model, model::parse_layer_ranges("0-1,2-3,4"));
  auto out = c.generate(request("inj", prompt, 80, c.config()), GetParam().inject);
  ASSERT_TRUE(out.ok()) << sys.render(out.error);
  EXPECT_EQ(out.result.ids, expected);
  // The session pauses at each injection point, so the recovery is exact.
  uint64_t total_misses = 0;
  for (auto m : out.result.misses)
    total_misses += m;
  if (GetParam().expect_miss) {
    EXPECT_EQ(out.result.misses[static_cast<std::size_t>(GetParam().expect_miss)], 1u);
    EXPECT_EQ(total_misses, 1u);
  } else if (GetParam().route_changes >= 0) {
    EXPECT_EQ(total_misses, 0u);
  }
  if (GetParam().route_changes >= 0)
    EXPECT_EQ(out.result.route_changes, static_cast<uint64_t>(GetParam().route_changes));
  else
    EXPECT_GE(out.result.route_changes, 1u);
  if (GetParam().reprefills >= 0)
    EXPECT_EQ(out.result.reprefills, static_cast<uint64_t>(GetParam().reprefills));
  else
    EXPECT_GE(out.result.reprefills, 1u);
  EXPECT_EQ(out.result.retries, 0u);
  // Every cache was released when the session ended.
  for (auto& st : c.stats())
    EXPECT_EQ(st.sessions, 0u) << "shard " << st.first << "-" << st.last;
}

std::vector<InjectCase> inject_cases() {
  std::vector<InjectCase> v;
  for (auto r : {miss_reason::unknown_session, miss_reason::evicted_ttl, miss_reason::evicted_lru, miss_reason::released,
                 miss_reason::superseded}) {
    Injection i{Injection::evict, 1, 10, r};
    v.push_back({std::string("Evict_") + msg::to_string(r), {i}, static_cast<int>(r), 0, 1});
  }
  v.push_back({"Desync", {Injection{Injection::desync, 2, 12, {}}}, static_cast<int>(miss_reason::seq_mismatch), 0, 1});
  // A kill is seen twice by the supervisor (shard down, replacement registers).
  v.push_back({"KillMiddle", {Injection{Injection::kill, 1, 15, {}}}, 0, 2, 1});
  v.push_back({"KillHead", {Injection{Injection::kill, 0, 5, {}}}, 0, 2, 1});
  v.push_back({"KillTail", {Injection{Injection::kill, 2, 1, {}}}, 0, 2, 1});
  // A bump that changes no hop rebuilds nothing.
  v.push_back({"EpochBump", {Injection{Injection::epoch, 0, 20, {}}}, 0, 1, 0});
  v.push_back({"Duplicate", {Injection{Injection::dup, 1, 8, {}}, Injection{Injection::dup, 2, 9, {}}}, 0, 0, 0});
  v.push_back({"Everything",
               actors::parse_injections("evict:0@3,kill:2@10,epoch@20,desync:1@30,dup:0@40,kill:0@50,evict:2@60", 3),
               0, -1, -1});
  return v;
}

INSTANTIATE_TEST_SUITE_P(InProcess, Injections, ::testing::ValuesIn(inject_cases()),
                         [](const auto& info) { return info.param.name; });

TEST_F(ActorRuntime, DuplicateNeverAdvancesACacheTwice) {
  LocalCluster c(sys, "builtin:tiny", model::parse_layer_ranges("0-1,2-4"));
  auto out = c.generate(request("dup", {1, 40}, 30, c.config()),
                        {Injection{Injection::dup, 0, 5, {}}, Injection{Injection::dup, 1, 6, {}}});
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out.result.ids, stateless_ids("builtin:tiny", {1, 40}, 30));
  auto stats = c.stats();
  ASSERT_EQ(stats.size(), 2u);
  // Shard 0's duplicate reaches shard 1 twice as well; shard 1's own is a copy
  // of the step with its hidden state (before, shard 1 duplicated an emptied
  // request, refused, and counted nothing). So shard 1 meets two stale copies.
  // Shard 0's comes before the next step (one sender, in order) and is absorbed.
  // Shard 1's own injection may be taken by that stale copy, which then arrives
  // a second time, and this second copy can come after the next step has
  // advanced the cache: then it is refused as out of sequence (its answer goes
  // to the shard that sent it, not to the session). Either way nothing
  // advances a cache twice and the session meets no miss.
  EXPECT_EQ(stats[0].duplicates, 1u);
  EXPECT_GE(stats[1].duplicates, 1u);
  ASSERT_EQ(stats[1].misses.size(), msg::miss_reason_count);
  EXPECT_EQ(stats[1].duplicates + stats[1].misses[static_cast<std::size_t>(miss_reason::seq_mismatch)], 2u);
  EXPECT_EQ(out.result.reprefills, 0u) << "a duplicate is absorbed, not a miss";
}

// Every shard actor's forward passes run on the process's one math thread
// (model::run_math), so one OpenMP team serves them all: two in-process shard
// actors, four clients at once, one of them meeting an eviction; each equals
// its stateless run alone, and every round went through the math thread.
TEST_F(ActorRuntime, ShardActorsComputeOnTheOneMathThread) {
  LocalCluster c(sys, "builtin:tiny", model::parse_layer_ranges("0-1,2-4"));
  const uint64_t before = model::math_tasks_run();
  constexpr int n = 4;
  const auto outs = concurrent_clients(
    c, n, "math", [](int i) { return std::vector<int32_t>{1, static_cast<int32_t>(40 + 3 * i)}; }, 12,
    [](int i) { return i == 1 ? std::vector<Injection>{Injection{Injection::evict, 1, 5, {}}} : std::vector<Injection>{}; });
  const uint64_t ran = model::math_tasks_run() - before;
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(outs[static_cast<std::size_t>(i)].ok()) << "client " << i;
    EXPECT_EQ(outs[static_cast<std::size_t>(i)].result.ids,
              stateless_ids("builtin:tiny", {1, static_cast<int32_t>(40 + 3 * i)}, 12))
      << "client " << i;
  }
  EXPECT_GE(outs[1].result.reprefills, 1u) << "the eviction was met";
  uint64_t rounds = 0;
  for (const auto& st : c.stats())
    rounds += st.rounds;
  EXPECT_GT(rounds, 0u);
  EXPECT_GE(ran, rounds) << "a round computed off the math thread";
}

// A fault is aimed at the session that injects it: four clients at once, one
// desynchronising its own next step at the head shard, one duplicating its own
// next decode step at the tail; the other clients' steps in between meet
// nothing (before, the shard desynchronised whichever session came next).
TEST_F(ActorRuntime, FaultsHitOnlyTheSessionThatAsksForThem) {
  LocalCluster c(sys, "builtin:tiny", model::parse_layer_ranges("0-1,2-4"));
  constexpr int n = 4;
  auto prompt = [](int i) { return std::vector<int32_t>{1, static_cast<int32_t>(30 + 5 * i), 7}; };
  const auto outs = concurrent_clients(c, n, "aim", prompt, 20, [](int i) {
    if (i == 1)
      return std::vector<Injection>{Injection{Injection::desync, 0, 6, {}}};
    if (i == 2)
      return std::vector<Injection>{Injection{Injection::dup, 1, 7, {}}};
    return std::vector<Injection>{};
  });
  for (int i = 0; i < n; ++i) {
    const auto& o = outs[static_cast<std::size_t>(i)];
    ASSERT_TRUE(o.ok()) << "client " << i << ": " << sys.render(o.error);
    EXPECT_EQ(o.result.ids, stateless_ids("builtin:tiny", prompt(i), 20)) << "client " << i;
    uint64_t misses = 0;
    for (auto m : o.result.misses)
      misses += m;
    EXPECT_EQ(misses, i == 1 ? 1u : 0u) << "client " << i;
    EXPECT_EQ(o.result.reprefills, i == 1 ? 1u : 0u) << "client " << i;
  }
  EXPECT_EQ(outs[1].result.misses[static_cast<std::size_t>(miss_reason::seq_mismatch)], 1u);
  const auto stats = c.stats();
  ASSERT_EQ(stats.size(), 2u);
  EXPECT_EQ(stats[0].duplicates, 0u);
  EXPECT_GE(stats[1].duplicates, 1u) << "the duplicated step came back as a duplicate";
}

// The injection interface checks what it is told too: a desync or dup names a
// session id of 1-1,024 bytes, and at most 1,024 sessions wait for one at a
// shard; each refusal is a typed error naming the injection.
TEST_F(ActorRuntime, AimedInjectionsRefuseBadSessionIdsAndAFullShard) {
  std::shared_ptr<model::Shard> shard = model::Shard::load("builtin:tiny", {0, 4});
  auto a = caf::actor_cast<msg::shard_injection_actor>(actors::spawn_shard(sys, shard));
  caf::scoped_actor self{sys};
  auto inject = [&](bool desync, const std::string& session) {
    caf::error err;
    auto done = [] {};
    auto failed = [&](caf::error& e) { err = e; };
    if (desync)
      self->request(a, std::chrono::seconds(5), atom::desync_atom_v, session).receive(done, failed);
    else
      self->request(a, std::chrono::seconds(5), atom::dup_atom_v, session).receive(done, failed);
    return err;
  };
  const auto empty = inject(true, "");
  EXPECT_EQ(empty, ec::bad_request);
  EXPECT_NE(sys.render(empty).find("desync injection needs a session id of 1-1024 bytes, not 0"), std::string::npos)
    << sys.render(empty);
  const auto longer = inject(false, std::string(1025, 's'));
  EXPECT_EQ(longer, ec::bad_request);
  EXPECT_NE(sys.render(longer).find("dup injection needs a session id of 1-1024 bytes, not 1025"), std::string::npos)
    << sys.render(longer);
  for (int i = 0; i < 1024; ++i)
    ASSERT_FALSE(inject(true, "s" + std::to_string(i))) << i;
  EXPECT_FALSE(inject(true, "s7")) << "a session already waiting takes no more room";
  const auto full = inject(true, "s1024");
  EXPECT_EQ(full, ec::overloaded);
  EXPECT_NE(sys.render(full).find("1024 sessions are already waiting for one"), std::string::npos) << sys.render(full);
  EXPECT_FALSE(inject(false, "s1024")) << "the dup injections have room of their own";
  caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
}

TEST_F(ActorRuntime, SixteenConcurrentSessionsUnderATightBudget) {
  actors::ClusterOptions opts;
  // Room for only a few sessions' caches per shard: evictions are forced.
  opts.limits.max_bytes = 6 * 3 * 2 * model::BlockPool::block_tokens * 16 * sizeof(float);
  opts.session.max_retries = 64;
  LocalCluster c(sys, "builtin:tiny", model::parse_layer_ranges("0-2,3-4"), opts);
  const int n = 16;
  std::vector<std::vector<int32_t>> prompts, expected(n);
  for (int i = 0; i < n; ++i)
    prompts.push_back({1, static_cast<int32_t>(10 + 7 * i), static_cast<int32_t>(20 + 3 * i)});
  for (int i = 0; i < n; ++i)
    expected[static_cast<std::size_t>(i)] = stateless_ids("builtin:tiny", prompts[static_cast<std::size_t>(i)], 40);
  std::vector<actors::Outcome> outs(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      outs[static_cast<std::size_t>(i)] =
        c.generate(request("iso-" + std::to_string(i), prompts[static_cast<std::size_t>(i)], 40, c.config()));
    });
  for (auto& t : threads)
    t.join();
  uint64_t lru_misses = 0;
  for (int i = 0; i < n; ++i) {
    auto& o = outs[static_cast<std::size_t>(i)];
    ASSERT_TRUE(o.ok()) << i << ": " << sys.render(o.error);
    EXPECT_EQ(o.result.ids, expected[static_cast<std::size_t>(i)]) << "session " << i;
    lru_misses += o.result.misses[static_cast<std::size_t>(miss_reason::evicted_lru)];
  }
  uint64_t evictions = 0;
  for (auto& s : c.stats()) {
    evictions += s.evictions;
    EXPECT_LE(s.cache_bytes, opts.limits.max_bytes);
  }
  EXPECT_GT(evictions, 0u) << "the budget should have forced evictions";
  EXPECT_GT(lru_misses, 0u);
}

TEST_F(ActorRuntime, FrozenShardEndsInAClearErrorNotAHang) {
  // A "shard" that accepts steps and never answers (its promises are dropped).
  auto sup = actors::spawn_supervisor(sys, actors::SupervisorOptions{});
  auto frozen = sys.spawn(
    [](caf::event_based_actor* self, int) {
      return caf::behavior{[=](msg::step_request&) { return self->make_response_promise(); },
                           [](atom::lease_atom, std::string&, msg::session_key&) {}};
    },
    0);
  const auto cfg = model::read_config("builtin:tiny");
  caf::scoped_actor self{sys};
  self->request(sup, std::chrono::seconds(5), atom::register_atom_v, caf::actor_cast<msg::shard_actor>(frozen),
                int64_t{0}, int64_t{4}, msg::cache_recipe::of(cfg), msg::model_facts::of(cfg),
                std::string{})
    .receive([](int64_t) {}, [](caf::error&) {});
  actors::SessionOptions opts;
  opts.step_timeout = std::chrono::milliseconds(100);
  opts.max_retries = 2;
  opts.backoff = std::chrono::milliseconds(10);
  const auto t0 = std::chrono::steady_clock::now();
  actors::spawn_session(sys, sup, caf::actor_cast<msg::session_client_actor>(self), request("frozen", {1, 5}, 5, cfg),
                        opts);
  caf::error err;
  self->receive([&](caf::error& e) { err = e; }, [&](msg::generation_result&) {},
                caf::after(std::chrono::seconds(10)) >> [] { ADD_FAILURE() << "the session hung"; });
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(err, ec::retries_exhausted) << sys.render(err);
  EXPECT_NE(sys.render(err).find("request_timeout"), std::string::npos) << sys.render(err);
  EXPECT_GE(took, std::chrono::milliseconds(900)); // three attempts of 100 ms, each resent once with 200 ms
  EXPECT_LT(took, std::chrono::seconds(3));
  caf::anon_send_exit(frozen, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(sup, caf::exit_reason::user_shutdown);
}

TEST_F(ActorRuntime, CancelEndsTheSessionAndReleasesItsCaches) {
  LocalCluster c(sys, "builtin:tiny", model::parse_layer_ranges("0-2,3-4"));
  caf::scoped_actor self{sys};
  auto req = request("cancel-me", {1, 5}, 100, c.config());
  req.pause_after = {3};
  auto s = actors::spawn_session(sys, c.supervisor(), caf::actor_cast<msg::session_client_actor>(self), req,
                                 c.session_options());
  int tokens = 0;
  caf::error err;
  bool done = false;
  while (!done)
    self->receive([&](msg::token_event&) {
                    if (++tokens == 3)
                      self->send(s, atom::cancel_atom_v);
                  },
                  [&](caf::error& e) {
                    err = e;
                    done = true;
                  },
                  [&](msg::generation_result&) { done = true; });
  EXPECT_EQ(tokens, 3);
  EXPECT_EQ(err, ec::cancelled);
  for (auto& st : c.stats())
    EXPECT_EQ(st.sessions, 0u);
}

TEST_F(ActorRuntime, IncompatibleShardIsRefused) {
  LocalCluster c(sys, "builtin:tiny", model::parse_layer_ranges("0-4"));
  auto other = actors::spawn_shard(sys, model::Shard::load("builtin:qwen2-0.5b", {0, 0}));
  caf::scoped_actor self{sys};
  caf::error err;
  msg::cache_recipe r = msg::cache_recipe::of(model::read_config("builtin:qwen2-0.5b"));
  self->request(c.supervisor(), std::chrono::seconds(5), atom::register_atom_v, msg::shard_actor{other}, int64_t{0},
                int64_t{0}, r, msg::model_facts::of(model::read_config("builtin:qwen2-0.5b")), std::string{})
    .receive([](int64_t) {}, [&](caf::error& e) { err = e; });
  EXPECT_EQ(err, ec::incompatible_recipe);
  EXPECT_NE(sys.render(err).find("builtin:qwen2-0.5b"), std::string::npos) << sys.render(err);
  caf::anon_send_exit(other, caf::exit_reason::user_shutdown);
}

TEST_F(ActorRuntime, NoCompleteRouteFailsWithinTheBound) {
  actors::ClusterOptions opts;
  opts.supervisor.route_wait = std::chrono::milliseconds(300);
  LocalCluster c(sys, "builtin:tiny", model::parse_layer_ranges("0-2,3-4"), opts);
  caf::anon_send_exit(c.shard(1), caf::exit_reason::kill);
  const auto t0 = std::chrono::steady_clock::now();
  // Wait until the supervisor has seen the shard go (its plan has no hops).
  caf::scoped_actor self{sys};
  for (int i = 0; i < 200; ++i) {
    bool incomplete = false;
    self->request(c.supervisor(), std::chrono::seconds(1), atom::stats_atom_v)
      .receive([&](msg::route_info& r) { incomplete = r.hops.empty(); }, [](caf::error&) {});
    if (incomplete)
      break;
  }
  auto out = c.generate(request("noroute", {1, 5}, 5, c.config()));
  EXPECT_FALSE(out.ok());
  EXPECT_EQ(out.error, ec::no_route) << sys.render(out.error);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST_F(ActorRuntime, BadRequestsGetTypedErrors) {
  LocalCluster c(sys, "builtin:tiny", model::parse_layer_ranges("0-4"));
  auto out = c.generate(request("empty", {}, 5, c.config()));
  EXPECT_EQ(out.error, ec::invalid_request);
  auto big = c.generate(request("big", std::vector<int32_t>(600, 5), 5, c.config()));
  EXPECT_EQ(big.error, ec::invalid_request);
  auto bad = c.generate(request("oov", {1, 400}, 5, c.config()));
  EXPECT_EQ(bad.error, ec::model_error) << sys.render(bad.error);
  EXPECT_NE(sys.render(bad.error).find("400"), std::string::npos);
  // A forged step straight to a shard: wrong recipe, wrong shape.
  caf::scoped_actor self{sys};
  msg::step_request req;
  req.session = msg::mint_session_id("forged");
  req.key = msg::mint_session_key();
  req.recipe = msg::cache_recipe::of(c.config());
  req.recipe.n_layers = 99;
  req.route = {msg::hop{c.shard(0), 0, 4}};
  req.positions = {0};
  req.tokens = {1};
  caf::error err;
  self->request(c.shard(0), std::chrono::seconds(5), req).receive([](msg::step_reply&) {}, [&](caf::error& e) { err = e; });
  EXPECT_EQ(err, ec::incompatible_recipe);
  req.recipe = msg::cache_recipe::of(c.config());
  req.tokens = {1, 2};
  self->request(c.shard(0), std::chrono::seconds(5), req).receive([](msg::step_reply&) {}, [&](caf::error& e) { err = e; });
  EXPECT_EQ(err, ec::bad_shape);
}

TEST_F(ActorRuntime, MalformedStepsAreRefusedAndTheShardKeepsServing) {
  std::shared_ptr<model::Shard> shard = model::Shard::load("builtin:tiny", {0, 4});
  actors::RequestLimits lim;
  lim.max_step_tokens = 8;
  lim.max_message_bytes = 4096;
  msg::shard_actor a = actors::spawn_shard(sys, shard, {}, {}, lim);
  caf::scoped_actor self{sys};
  auto ask = [&](msg::step_request r) {
    caf::error err;
    msg::step_reply rep;
    self->request(a, std::chrono::seconds(5), r).receive([&](msg::step_reply& x) { rep = x; }, [&](caf::error& e) { err = e; });
    return std::pair{err, rep};
  };
  msg::step_request ok;
  ok.session = msg::mint_session_id("s");
  ok.key = msg::mint_session_key();
  ok.recipe = msg::cache_recipe::of(shard->config());
  ok.route = {msg::hop{a, 0, 4}};
  ok.positions = {0, 1};
  ok.tokens = {1, 70};
  auto r = ok;
  r.positions = std::vector<int64_t>(9, 0);
  r.tokens = std::vector<int32_t>(9, 1);
  auto [e1, _1] = ask(r);
  EXPECT_EQ(e1, ec::bad_request);
  EXPECT_NE(sys.render(e1).find("at most 8 per step"), std::string::npos) << sys.render(e1);
  r = ok;
  r.hidden.bytes.resize(8192);
  auto [e2, _2] = ask(r);
  EXPECT_NE(sys.render(e2).find("at most 4096 (--max-message-bytes)"), std::string::npos) << sys.render(e2);
  r = ok;
  r.past_len = -3;
  r.positions = {-3, -2};
  EXPECT_EQ(ask(r).first, ec::bad_request); // negative positions
  r = ok;
  r.mode = static_cast<uint8_t>(msg::step_mode::decode);
  r.session = msg::mint_session_id("never-seen");
  r.past_len = 5;
  r.positions = {5};
  r.tokens = {1};
  auto [e3, miss] = ask(r); // an unknown session is a typed cache miss
  EXPECT_FALSE(e3);
  EXPECT_EQ(miss.kind, static_cast<uint8_t>(msg::reply_kind::cache_miss));
  EXPECT_EQ(miss.miss, static_cast<uint8_t>(msg::miss_reason::unknown_session));
  // Recovery fields: a rebuild mask naming hops past the route, a rebuilt hop's
  // rows not starting at 0, a rebuild that does not reach past past_len, block ids
  // past the positions or in odd words.
  auto rebuild = r;
  rebuild.rebuild = 2; // hop 1 of a one-hop route
  auto [e5, _5] = ask(rebuild);
  EXPECT_EQ(e5, ec::bad_request);
  EXPECT_NE(sys.render(e5).find("rebuild mask"), std::string::npos) << sys.render(e5);
  rebuild.rebuild = 1; // hop 0 rebuilds, but its rows start at past_len 5
  EXPECT_EQ(ask(rebuild).first, ec::bad_request);
  rebuild.positions = {0, 1};
  rebuild.tokens = {1, 70};
  auto [e6, _6] = ask(rebuild); // rows 0-1 do not reach past past_len 5
  EXPECT_NE(sys.render(e6).find("must reach past past_len"), std::string::npos) << sys.render(e6);
  auto ids = ok;
  ids.blocks = {1, 2, 3};
  EXPECT_EQ(ask(ids).first, ec::bad_request);
  ids.blocks = {1, 2};
  auto [e7, _7] = ask(ids); // a block of 32 positions named by a step of 2
  EXPECT_NE(sys.render(e7).find("block ids past"), std::string::npos) << sys.render(e7);
  // Still serving.
  auto [e4, rep] = ask(ok);
  EXPECT_FALSE(e4) << sys.render(e4);
  EXPECT_EQ(rep.kind, static_cast<uint8_t>(msg::reply_kind::token));
  caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
}

// Polls the shards' stats until `done` holds for all of them, or 10 s pass.
bool until_stats(LocalCluster& c, const std::function<bool(const msg::shard_stats&)>& done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    auto all = c.stats();
    if (!all.empty() && std::all_of(all.begin(), all.end(), done))
      return true;
  }
  return false;
}

// A victim session paused mid-generation, driven by a scoped actor.
struct Paused {
  caf::scoped_actor self;
  msg::session_actor session;
  std::string id;
  std::vector<int32_t> ids;
  Paused(caf::actor_system& sys, LocalCluster& c, msg::generation_request req, int64_t pause_at) : self{sys} {
    req.pause_after = {pause_at};
    session = actors::spawn_session(sys, c.supervisor(), caf::actor_cast<msg::session_client_actor>(self), req,
                                    c.session_options());
    while (static_cast<int64_t>(ids.size()) < pause_at)
      self->receive([&](msg::token_event& ev) {
        id = ev.session;
        ids.push_back(ev.token);
      });
  }
  // Resumes and collects the rest; returns the error, if any.
  caf::error finish() {
    self->send(session, atom::resume_atom_v);
    caf::error err;
    bool done = false;
    while (!done)
      self->receive([&](msg::token_event& ev) { ids.push_back(ev.token); },
                    [&](msg::generation_result&) { done = true; },
                    [&](caf::error& e) {
                      err = e;
                      done = true;
                    });
    return err;
  }
};

TEST_F(ActorRuntime, ForgedStepsAndReleasesForALiveSessionGetSessionConflict) {
  LocalCluster c(sys, "builtin:tiny", model::parse_layer_ranges("0-1,2-3,4"));
  const std::vector<int32_t> prompt = {1, 72, 101, 108};
  const auto expected = stateless_ids("builtin:tiny", prompt, 40);
  Paused victim(sys, c, request("victim", prompt, 40, c.config()), 10);
  ASSERT_TRUE(msg::valid_session_id(victim.id));
  // A forger that knows the victim's id (it is in events and logs) but not its key.
  caf::scoped_actor forger{sys};
  msg::step_request f;
  f.session = victim.id;
  f.key = msg::mint_session_key();
  f.recipe = msg::cache_recipe::of(c.config());
  for (std::size_t i = 0; i < c.size(); ++i)
    f.route.push_back(msg::hop{c.shard(i), i == 0 ? 0 : static_cast<int64_t>(i * 2), i == 2 ? 4 : static_cast<int64_t>(i * 2 + 1)});
  f.epoch = INT64_MAX / 2; // a newer epoch must not supersede the owner's cache either
  auto ask = [&](msg::step_request r) {
    caf::error err;
    forger->request(c.shard(0), std::chrono::seconds(5), r)
      .receive([](msg::step_reply&) { ADD_FAILURE() << "a forged step was answered"; }, [&](caf::error& e) { err = e; });
    return err;
  };
  // A decode step at the victim's position, and a prefill that would replace its cache.
  f.mode = static_cast<uint8_t>(msg::step_mode::decode);
  f.past_len = static_cast<int64_t>(prompt.size() + victim.ids.size()) - 1;
  f.positions = {f.past_len};
  f.tokens = {victim.ids.back()};
  auto e1 = ask(f);
  EXPECT_EQ(e1, ec::session_conflict) << sys.render(e1);
  f.mode = static_cast<uint8_t>(msg::step_mode::prefill);
  f.past_len = 0;
  f.tokens = {1, 2, 3};
  f.positions = {0, 1, 2};
  auto e2 = ask(f);
  EXPECT_EQ(e2, ec::session_conflict) << sys.render(e2);
  // A forged release to every shard.
  for (std::size_t i = 0; i < c.size(); ++i)
    forger->send(c.shard(i), atom::release_atom_v, victim.id, f.key);
  ASSERT_TRUE(until_stats(c, [](auto& s) { return s.conflicts >= 1; }));
  for (auto& st : c.stats())
    EXPECT_EQ(st.sessions, 1u) << "the victim's cache on shard " << st.first << "-" << st.last << " must survive";
  EXPECT_FALSE(victim.finish());
  EXPECT_EQ(victim.ids, expected);
  for (auto& st : c.stats())
    EXPECT_EQ(st.misses[static_cast<std::size_t>(miss_reason::superseded)], 0u);
}

TEST_F(ActorRuntime, ASessionThatEndsWithoutReleasingLeavesNoCaches) {
  LocalCluster c(sys, "builtin:tiny", model::parse_layer_ranges("0-2,3-4"));
  Paused victim(sys, c, request("orphan", {1, 5, 9}, 40, c.config()), 5);
  ASSERT_TRUE(until_stats(c, [](auto& s) { return s.sessions == 1; }));
  caf::anon_send_exit(victim.session, caf::exit_reason::kill); // ends without its release
  EXPECT_TRUE(until_stats(c, [](auto& s) { return s.sessions == 0 && s.orphans == 1; }))
    << "every shard drops the caches of an owner that went down";
}

TEST_F(ActorRuntime, LeasesKeepLiveSessionsAndDropSilentOnes) {
  actors::ClusterOptions opts;
  opts.lease_period = std::chrono::milliseconds(50);
  opts.session.lease_renew = std::chrono::milliseconds(20);
  LocalCluster c(sys, "builtin:tiny", model::parse_layer_ranges("0-2,3-4"), opts);
  const std::vector<int32_t> prompt = {1, 40, 41};
  const auto expected = stateless_ids("builtin:tiny", prompt, 30);
  // A live session paused for 10 lease periods keeps its caches (it renews).
  Paused live(sys, c, request("live", prompt, 30, c.config()), 5);
  caf::scoped_actor wait{sys};
  wait->receive(caf::after(std::chrono::milliseconds(500)) >> [] {}); // 10 lease periods pass
  EXPECT_FALSE(live.finish());
  EXPECT_EQ(live.ids, expected);
  // An owner that never renews (a raw step from an actor that stays alive).
  caf::scoped_actor silent{sys};
  msg::step_request r;
  r.session = msg::mint_session_id("silent");
  r.key = msg::mint_session_key();
  r.recipe = msg::cache_recipe::of(c.config());
  r.route = {msg::hop{c.shard(0), 0, 2}, msg::hop{c.shard(1), 3, 4}};
  r.tokens = {1, 2};
  r.positions = {0, 1};
  silent->request(c.shard(0), std::chrono::seconds(5), r).receive([](msg::step_reply&) {}, [](caf::error&) {});
  EXPECT_TRUE(until_stats(c, [](auto& s) { return s.sessions == 0 && s.orphans == 1; }))
    << "a context nobody renews is dropped after its lease";
}

} // namespace
} // namespace strata
