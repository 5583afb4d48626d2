// The route supervisor under CAF's deterministic test coordinator: every
// message is delivered when the test says so, and time only moves when the
// test advances it, so orderings (down -> epoch bump -> new route) are exact.

#include "actors/cluster.hpp"
#include "actors/supervisor.hpp"
#include "tests/actors/deterministic.hpp"
#include "tests/support.hpp"


namespace strata {
namespace {

struct Log {
  std::vector<msg::route_info> routes; // pushed to the subscribed "session"
  std::vector<caf::message> replies;   // answers to ask()
};

struct SupervisorTest : ::testing::Test, test::Deterministic {
  std::shared_ptr<Log> log = std::make_shared<Log>();
  actors::SupervisorOptions opts{std::chrono::milliseconds(500)};
  msg::supervisor_actor sup = actors::spawn_supervisor(sys, opts);
  msg::cache_recipe recipe{"llama", "builtin:tiny", "f32", "f32", 5, 2, 8};
  msg::model_facts facts{"llama", "builtin:tiny", 5, 259, 512, 1, {2}, "builtin:bytes"};
  std::vector<msg::shard_actor> none; // route requests avoid no shard

  msg::shard_actor fake_shard() {
    // (A spawn argument: CAF 0.17 dereferences a null argument tuple for
    // argument-less function actors, which UBSan reports.)
    return caf::actor_cast<msg::shard_actor>(sys.spawn([](int) { return caf::behavior{[](msg::step_request&) {}}; }, 0));
  }
  // A subscribed stand-in for a session that records every route it is told.
  caf::actor session() {
    auto l = log;
    auto target = sup;
    auto s = sys.spawn(
      [l, target](caf::event_based_actor* self, int) {
        self->send(target, atom::subscribe_atom_v); // a session subscribes itself
        return caf::behavior{[l](msg::route_info& r) { l->routes.push_back(r); }};
      },
      0);
    sched.run();
    return s;
  }
  // Sends a request from a one-shot actor; the answer (a Reply, or an error)
  // lands in log->replies.
  template <class Reply, class... Ts>
  void ask(Ts... xs) {
    auto l = log;
    auto target = caf::actor_cast<caf::actor>(sup); // also the injection interface (bump)
    sys.spawn(
      [=](caf::event_based_actor* self, int) {
        self->request(target, caf::infinite, xs...)
          .then([=](Reply& r) { l->replies.push_back(caf::make_message(r)); },
                [=](caf::error& e) { l->replies.push_back(caf::make_message(e)); });
      },
      0);
    sched.run();
  }
  int64_t epoch_reply(std::size_t i) { return log->replies.at(i).get_as<int64_t>(0); }
  ~SupervisorTest() override {
    caf::anon_send_exit(sup, caf::exit_reason::user_shutdown);
    sched.run();
  }
};

TEST_F(SupervisorTest, ShardDownBumpsTheEpochThenAReplacementRestoresTheRoute) {
  auto a = fake_shard(), b = fake_shard();
  ask<int64_t>(atom::register_atom_v, a, int64_t{0}, int64_t{2}, recipe, facts, std::string{});
  ask<int64_t>(atom::register_atom_v, b, int64_t{3}, int64_t{4}, recipe, facts, std::string{});
  ASSERT_EQ(log->replies.size(), 2u);
  EXPECT_EQ(epoch_reply(1), epoch_reply(0) + 1);
  session();
  const int64_t before = epoch_reply(1);
  caf::anon_send_exit(b, caf::exit_reason::kill);
  sched.run();
  ASSERT_EQ(log->routes.size(), 1u);
  EXPECT_EQ(log->routes[0].epoch, before + 1);
  EXPECT_TRUE(log->routes[0].hops.empty()) << "layers 3-4 have no shard now";
  auto c = fake_shard();
  ask<int64_t>(atom::register_atom_v, c, int64_t{3}, int64_t{4}, recipe, facts, std::string{});
  ASSERT_EQ(log->routes.size(), 2u);
  EXPECT_EQ(log->routes[1].epoch, before + 2);
  ASSERT_EQ(log->routes[1].hops.size(), 2u);
  EXPECT_EQ(log->routes[1].hops[0].shard, a);
  EXPECT_EQ(log->routes[1].hops[1].shard, c);
}

TEST_F(SupervisorTest, RouteRequestWaitsThenFailsWhenNoRouteAppears) {
  auto a = fake_shard();
  ask<int64_t>(atom::register_atom_v, a, int64_t{0}, int64_t{2}, recipe, facts, std::string{});
  ask<msg::route_info>(atom::route_atom_v, none);
  ASSERT_EQ(log->replies.size(), 1u) << "the route request is held, not answered";
  sched.advance_time(std::chrono::milliseconds(499));
  sched.run();
  EXPECT_EQ(log->replies.size(), 1u);
  sched.advance_time(std::chrono::milliseconds(2));
  sched.run();
  ASSERT_EQ(log->replies.size(), 2u);
  auto err = log->replies[1].get_as<caf::error>(0);
  EXPECT_EQ(err, ec::no_route);
}

TEST_F(SupervisorTest, HeldRouteRequestIsAnsweredByARegistration) {
  auto a = fake_shard(), b = fake_shard();
  ask<int64_t>(atom::register_atom_v, a, int64_t{0}, int64_t{2}, recipe, facts, std::string{});
  ask<msg::route_info>(atom::route_atom_v, none);
  ASSERT_EQ(log->replies.size(), 1u);
  ask<int64_t>(atom::register_atom_v, b, int64_t{3}, int64_t{4}, recipe, facts, std::string{});
  ASSERT_EQ(log->replies.size(), 3u);
  // The held request was answered with the complete route (before the registrant's epoch reply or after).
  bool got_route = false;
  for (auto& m : log->replies)
    if (m.match_elements<msg::route_info>()) {
      got_route = true;
      EXPECT_EQ(m.get_as<msg::route_info>(0).hops.size(), 2u);
    }
  EXPECT_TRUE(got_route);
}

TEST_F(SupervisorTest, ReplicasShareTheLoadAndAManualBumpNotifies) {
  auto a = fake_shard(), b = fake_shard();
  ask<int64_t>(atom::register_atom_v, a, int64_t{0}, int64_t{4}, recipe, facts, std::string{});
  ask<int64_t>(atom::register_atom_v, b, int64_t{0}, int64_t{4}, recipe, facts, std::string{});
  ask<msg::route_info>(atom::route_atom_v, none);
  ask<msg::route_info>(atom::route_atom_v, none);
  const auto r1 = log->replies[2].get_as<msg::route_info>(0);
  const auto r2 = log->replies[3].get_as<msg::route_info>(0);
  EXPECT_NE(r1.hops[0].shard, r2.hops[0].shard) << "the second route takes the less-loaded replica";
  session();
  ask<int64_t>(atom::bump_atom_v);
  ASSERT_EQ(log->routes.size(), 1u);
  EXPECT_EQ(log->routes[0].epoch, log->replies[4].get_as<int64_t>(0));
  // One replica dies: the route goes around it.
  caf::anon_send_exit(a, caf::exit_reason::kill);
  sched.run();
  ASSERT_EQ(log->routes.size(), 2u);
  ASSERT_EQ(log->routes[1].hops.size(), 1u);
  EXPECT_EQ(log->routes[1].hops[0].shard, b);
}

// A change elsewhere keeps a session on the shards it has: every hop that moved
// to another replica would have to rebuild the session's cache there.
TEST_F(SupervisorTest, AChangeElsewhereKeepsASessionOnItsShards) {
  auto a0 = fake_shard(), a1 = fake_shard(), b = fake_shard();
  ask<int64_t>(atom::register_atom_v, a0, int64_t{0}, int64_t{2}, recipe, facts, std::string{});
  ask<int64_t>(atom::register_atom_v, a1, int64_t{0}, int64_t{2}, recipe, facts, std::string{});
  ask<int64_t>(atom::register_atom_v, b, int64_t{3}, int64_t{4}, recipe, facts, std::string{});
  session();
  ask<int64_t>(atom::bump_atom_v); // the first push: the session is planned on a0 or a1
  ASSERT_EQ(log->routes.size(), 1u);
  const auto mine = log->routes[0].hops.at(0).shard;
  for (int i = 0; i < 4; ++i) { // other sessions' routes load the replicas
    ask<msg::route_info>(atom::route_atom_v, none);
    ask<int64_t>(atom::bump_atom_v);
  }
  ASSERT_EQ(log->routes.size(), 5u);
  for (auto& r : log->routes)
    EXPECT_EQ(r.hops.at(0).shard, mine) << "epoch " << r.epoch << " moved the session to the other replica";
  // Its replica dies: only then does it move.
  caf::anon_send_exit(caf::actor_cast<caf::actor>(mine), caf::exit_reason::kill);
  sched.run();
  ASSERT_EQ(log->routes.size(), 6u);
  EXPECT_NE(log->routes.back().hops.at(0).shard, mine);
  EXPECT_EQ(log->routes.back().hops.at(1).shard, b);
}

TEST_F(SupervisorTest, IncompatibleRecipeAndBadRangeAreRefused) {
  auto a = fake_shard(), b = fake_shard();
  ask<int64_t>(atom::register_atom_v, a, int64_t{0}, int64_t{4}, recipe, facts, std::string{});
  auto other = recipe;
  other.n_kv_heads = 4;
  ask<int64_t>(atom::register_atom_v, b, int64_t{0}, int64_t{4}, other, facts, std::string{});
  ASSERT_EQ(log->replies.size(), 2u);
  EXPECT_EQ(log->replies[1].get_as<caf::error>(0), ec::incompatible_recipe);
  ask<int64_t>(atom::register_atom_v, b, int64_t{3}, int64_t{9}, recipe, facts, std::string{});
  EXPECT_EQ(log->replies[2].get_as<caf::error>(0), ec::bad_request);
}

// Nodes that keep the same model in other weight types (--dtype) would give
// other tokens: one cluster serves one dtype.
TEST_F(SupervisorTest, ShardsWithAnotherWeightTypeAreRefused) {
  auto a = fake_shard(), b = fake_shard();
  ask<int64_t>(atom::register_atom_v, a, int64_t{0}, int64_t{2}, recipe, facts, std::string{});
  auto q8 = recipe;
  q8.dtype = "q8_0";
  ask<int64_t>(atom::register_atom_v, b, int64_t{3}, int64_t{4}, q8, facts, std::string{});
  ASSERT_EQ(log->replies.size(), 2u);
  const auto err = log->replies[1].get_as<caf::error>(0);
  EXPECT_EQ(err, ec::incompatible_recipe);
  const auto text = sys.render(err);
  EXPECT_NE(text.find("weights q8_0"), std::string::npos) << text;
  EXPECT_NE(text.find("weights f32"), std::string::npos) << text;
}

} // namespace
} // namespace strata
