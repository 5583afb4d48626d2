// The session's phases under CAF's deterministic test coordinator, with a
// stand-in supervisor and stand-in shards that hold every request until the
// test answers it. Each test drives one phase change and checks the phase, what
// the session sent, and what its client saw.

#include "actors/cluster.hpp"
#include "actors/session.hpp"
#include "messages/session_id.hpp"
#include "tests/actors/deterministic.hpp"
#include "tests/support.hpp"


namespace strata {
namespace {

using actors::session_phase;

struct Log {
  std::vector<caf::response_promise> route_requests; // held (route_atom, avoid)
  int subscriptions = 0;
  struct Step {
    int shard;
    msg::step_request req;
    caf::response_promise rp;
  };
  std::vector<Step> steps;              // held step requests, by stand-in shard
  std::vector<std::pair<int, msg::session_key>> releases;
  std::vector<int32_t> tokens;          // what the client saw
  std::optional<msg::generation_result> result;
  std::optional<caf::error> error;
};

struct SessionPhases : ::testing::Test, test::Deterministic {
  std::shared_ptr<Log> log = std::make_shared<Log>();
  msg::cache_recipe recipe{"llama", "builtin:tiny", "f32", "f32", 5, 2, 8};
  caf::actor sup_raw, client_raw;
  std::vector<caf::actor> shards_raw;
  msg::session_actor session;
  actors::SessionOptions opts;

  SessionPhases() {
    auto l = log;
    sup_raw = sys.spawn(
      [l](caf::event_based_actor* self, int) {
        return caf::behavior{
          [=](atom::route_atom, std::vector<msg::shard_actor>&) {
            auto rp = self->make_response_promise();
            l->route_requests.push_back(rp);
            return rp;
          },
          [=](atom::subscribe_atom) { ++l->subscriptions; },
          // The test's answer to the newest held route request (promises are
          // delivered from inside the actor that holds them).
          [=](caf::ok_atom, msg::route_info& r) { l->route_requests.back().deliver(std::move(r)); },
        };
      },
      0);
    for (int i = 0; i < 2; ++i)
      shards_raw.push_back(sys.spawn(
        [l, i](caf::event_based_actor* self, int) {
          return caf::behavior{
            [=](msg::step_request& r) {
              auto rp = self->make_response_promise();
              l->steps.push_back({i, r, rp});
              return rp;
            },
            [=](atom::release_atom, std::string&, msg::session_key& k) { l->releases.emplace_back(i, k); },
            [=](atom::lease_atom, std::string&, msg::session_key&) {},
            [=](caf::ok_atom, uint64_t k, msg::step_reply& rep) { l->steps.at(k).rp.deliver(std::move(rep)); },
            [=](atom::cancel_atom, uint64_t k, caf::error& e) { l->steps.at(k).rp.deliver(std::move(e)); },
          };
        },
        0));
    client_raw = sys.spawn(
      [l](caf::event_based_actor* self, int) {
        // (An event-based actor in CAF 0.17 gets an error message through its
        // error handler, not its behavior.)
        self->set_error_handler([=](caf::error& e) { l->error = e; });
        return caf::behavior{
          [=](msg::token_event& ev) { l->tokens.push_back(ev.token); },
          [=](msg::generation_result& r) { l->result = r; },
        };
      },
      0);
    opts.step_timeout = std::chrono::milliseconds(1000);
    opts.route_timeout = std::chrono::milliseconds(1000);
    opts.backoff = std::chrono::milliseconds(100);
    opts.lease_renew = std::chrono::hours(1); // out of the way
  }
  ~SessionPhases() override {
    for (auto& a : {sup_raw, client_raw})
      caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    for (auto& a : shards_raw)
      caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    if (session)
      caf::anon_send_exit(session, caf::exit_reason::user_shutdown);
    sched.run();
  }

  void start(std::vector<int64_t> pause_after = {}) {
    msg::generation_request req;
    req.session = msg::mint_session_id("test");
    req.prompt = {1, 2, 3};
    req.max_tokens = 10;
    req.pause_after = std::move(pause_after);
    session = actors::spawn_session(sys, caf::actor_cast<msg::supervisor_actor>(sup_raw),
                                    caf::actor_cast<msg::session_client_actor>(client_raw), req, opts);
    sched.run();
  }
  session_phase phase() {
    auto* p = caf::actor_cast<caf::abstract_actor*>(session);
    auto* s = dynamic_cast<caf::stateful_actor<actors::session_state, actors::session_impl_actor::base>*>(p);
    if (s == nullptr)
      ADD_FAILURE() << "not a session actor";
    return s ? s->state.phase : session_phase::ended;
  }
  msg::route_info route(int64_t epoch, int shard) {
    msg::route_info r;
    r.epoch = epoch;
    r.recipe = recipe;
    r.hops = {msg::hop{caf::actor_cast<msg::shard_actor>(shards_raw.at(shard)), 0, 4}};
    return r;
  }
  void answer_route(msg::route_info r) {
    ASSERT_FALSE(log->route_requests.empty());
    caf::anon_send(sup_raw, caf::ok_atom_v, std::move(r));
    sched.run();
  }
  msg::step_reply token(const msg::step_request& req, int32_t t) {
    msg::step_reply rep;
    rep.session = req.session;
    rep.epoch = req.epoch;
    rep.step_id = req.step_id;
    rep.kind = static_cast<uint8_t>(msg::reply_kind::token);
    rep.token = t;
    return rep;
  }
  msg::step_reply miss(const msg::step_request& req) {
    auto rep = token(req, -1);
    rep.kind = static_cast<uint8_t>(msg::reply_kind::cache_miss);
    rep.miss = static_cast<uint8_t>(msg::miss_reason::evicted_lru);
    return rep;
  }
  void answer_step(std::size_t i, msg::step_reply rep) {
    caf::anon_send(shards_raw.at(static_cast<std::size_t>(log->steps.at(i).shard)), caf::ok_atom_v,
                   static_cast<uint64_t>(i), std::move(rep));
    sched.run();
  }
  // Starts, gets route epoch 10 via shard 0, and leaves the prefill in flight.
  void to_stepping(std::vector<int64_t> pause_after = {}) {
    start(std::move(pause_after));
    ASSERT_EQ(phase(), session_phase::routing);
    answer_route(route(10, 0));
    ASSERT_EQ(phase(), session_phase::stepping);
    ASSERT_EQ(log->steps.size(), 1u);
  }
  void expect_cancelled_and_released(std::size_t releases) {
    caf::anon_send(session, atom::cancel_atom_v);
    sched.run();
    ASSERT_TRUE(log->error.has_value());
    EXPECT_EQ(*log->error, ec::cancelled);
    EXPECT_EQ(log->releases.size(), releases);
    session = nullptr;
  }
};

TEST_F(SessionPhases, RoutingThenSteppingThenTokensInOrder) {
  start();
  EXPECT_EQ(log->subscriptions, 1);
  ASSERT_EQ(log->route_requests.size(), 1u);
  answer_route(route(10, 0));
  EXPECT_EQ(phase(), session_phase::stepping);
  ASSERT_EQ(log->steps.size(), 1u);
  EXPECT_EQ(log->steps[0].req.mode, static_cast<uint8_t>(msg::step_mode::prefill));
  EXPECT_FALSE(log->steps[0].req.key.empty());
  answer_step(0, token(log->steps[0].req, 42));
  EXPECT_EQ(log->tokens, (std::vector<int32_t>{42}));
  ASSERT_EQ(log->steps.size(), 2u);
  EXPECT_EQ(log->steps[1].req.mode, static_cast<uint8_t>(msg::step_mode::decode));
  EXPECT_EQ(log->steps[1].req.key, log->steps[0].req.key) << "one key for the whole session";
  EXPECT_EQ(phase(), session_phase::stepping);
}

TEST_F(SessionPhases, RoutePushWhileSteppingSupersedesTheStepInFlight) {
  to_stepping();
  caf::anon_send(session, route(11, 1));
  sched.run();
  EXPECT_EQ(phase(), session_phase::stepping);
  ASSERT_EQ(log->steps.size(), 2u);
  EXPECT_EQ(log->steps[1].shard, 1) << "the new route's shard gets the re-prefill";
  EXPECT_EQ(log->steps[1].req.mode, static_cast<uint8_t>(msg::step_mode::prefill));
  EXPECT_EQ(log->steps[1].req.epoch, 11);
  answer_step(0, token(log->steps[0].req, 7)); // the superseded step answers late
  EXPECT_TRUE(log->tokens.empty()) << "a superseded answer is ignored";
  EXPECT_EQ(log->steps.size(), 2u);
  answer_step(1, token(log->steps[1].req, 8));
  EXPECT_EQ(log->tokens, (std::vector<int32_t>{8}));
  // A stale push (older epoch) changes nothing.
  caf::anon_send(session, route(9, 0));
  sched.run();
  EXPECT_EQ(log->steps.size(), 3u);
  EXPECT_EQ(log->steps[2].shard, 1);
}

TEST_F(SessionPhases, PushWithoutACompleteRouteWhileSteppingGoesRouting) {
  to_stepping();
  auto empty = route(11, 0);
  empty.hops.clear();
  caf::anon_send(session, empty);
  sched.run();
  EXPECT_EQ(phase(), session_phase::routing);
  EXPECT_EQ(log->route_requests.size(), 2u);
  answer_route(route(12, 1));
  EXPECT_EQ(phase(), session_phase::stepping);
  EXPECT_EQ(log->steps.back().shard, 1);
}

// A step past its deadline is sent once more as it was (same id: a shard that
// applied it answers it as a duplicate); a second deadline is a failure.
void time_out_twice(SessionPhases& t) {
  t.sched.advance_time(t.opts.step_timeout); // the step's deadline passes
  t.sched.run();
  ASSERT_EQ(t.phase(), session_phase::stepping) << "a slow step is resent, not given up";
  ASSERT_EQ(t.log->steps.size(), 2u);
  EXPECT_EQ(t.log->steps[1].req.step_id, t.log->steps[0].req.step_id);
  EXPECT_EQ(t.log->steps[1].req.tokens, t.log->steps[0].req.tokens);
  EXPECT_EQ(t.log->steps[1].req.mode, t.log->steps[0].req.mode);
  t.sched.advance_time(2 * t.opts.step_timeout); // the resend's (doubled) deadline passes too
  t.sched.run();
  EXPECT_EQ(t.phase(), session_phase::backing_off);
}

TEST_F(SessionPhases, TimeoutBacksOffAndALateMissWhileBackingOffIsIgnored) {
  to_stepping();
  time_out_twice(*this);
  answer_step(0, miss(log->steps[0].req)); // the late answer: a miss
  EXPECT_EQ(phase(), session_phase::backing_off) << "a miss for a step that timed out does not count";
  EXPECT_EQ(log->steps.size(), 2u);
  EXPECT_EQ(log->route_requests.size(), 1u);
  sched.advance_time(opts.backoff); // the backoff ends: ask for a route again
  sched.run();
  EXPECT_EQ(phase(), session_phase::routing);
  EXPECT_EQ(log->route_requests.size(), 2u);
  answer_route(route(10, 0));
  ASSERT_EQ(log->steps.size(), 3u);
  EXPECT_EQ(log->steps[2].req.mode, static_cast<uint8_t>(msg::step_mode::prefill));
}

TEST_F(SessionPhases, ASlowStepAnsweredAfterItsResendCountsOnce) {
  to_stepping();
  answer_step(0, token(log->steps[0].req, 5));
  ASSERT_EQ(log->steps.size(), 2u); // a decode
  sched.advance_time(opts.step_timeout);
  sched.run();
  ASSERT_EQ(log->steps.size(), 3u);
  EXPECT_EQ(log->steps[2].req.step_id, log->steps[1].req.step_id);
  EXPECT_EQ(log->steps[2].req.mode, static_cast<uint8_t>(msg::step_mode::decode)) << "no re-prefill";
  answer_step(1, token(log->steps[1].req, 6)); // the first copy, late: superseded
  EXPECT_EQ(log->tokens, (std::vector<int32_t>{5}));
  answer_step(2, token(log->steps[2].req, 6)); // the shard's duplicate answer
  EXPECT_EQ(log->tokens, (std::vector<int32_t>{5, 6}));
  ASSERT_EQ(log->steps.size(), 4u);
  EXPECT_EQ(log->steps[3].req.mode, static_cast<uint8_t>(msg::step_mode::decode));
  EXPECT_EQ(log->route_requests.size(), 1u) << "no re-route";
}

TEST_F(SessionPhases, OverloadedWaitsThenStepsAgainOnTheSameRoute) {
  to_stepping();
  answer_step(0, token(log->steps[0].req, 5));
  ASSERT_EQ(log->steps.size(), 2u);
  caf::anon_send(shards_raw.at(0), atom::cancel_atom_v, uint64_t{1}, caf::make_error(ec::overloaded, "queue full"));
  sched.run();
  EXPECT_EQ(phase(), session_phase::backing_off);
  EXPECT_EQ(log->steps.size(), 2u);
  sched.advance_time(opts.backoff);
  sched.run();
  EXPECT_EQ(phase(), session_phase::stepping);
  ASSERT_EQ(log->steps.size(), 3u);
  EXPECT_EQ(log->steps[2].shard, 0);
  EXPECT_EQ(log->steps[2].req.mode, static_cast<uint8_t>(msg::step_mode::decode)) << "nothing was lost: no re-prefill";
  EXPECT_EQ(log->steps[2].req.past_len, log->steps[1].req.past_len);
  EXPECT_EQ(log->route_requests.size(), 1u) << "no re-route";
  answer_step(2, token(log->steps[2].req, 6));
  EXPECT_EQ(log->tokens, (std::vector<int32_t>{5, 6}));
}

TEST_F(SessionPhases, RoutePushWhileBackingOffStepsAtOnce) {
  to_stepping();
  time_out_twice(*this);
  ASSERT_EQ(phase(), session_phase::backing_off);
  caf::anon_send(session, route(11, 1));
  sched.run();
  EXPECT_EQ(phase(), session_phase::stepping);
  EXPECT_EQ(log->steps.back().shard, 1);
  sched.advance_time(opts.backoff); // the old timer fires: ignored
  sched.run();
  EXPECT_EQ(phase(), session_phase::stepping);
  EXPECT_EQ(log->route_requests.size(), 1u);
}

TEST_F(SessionPhases, MissWhileSteppingRebuildsThatHopAtOnce) {
  to_stepping();
  answer_step(0, token(log->steps[0].req, 5));
  auto m = miss(log->steps[1].req);
  m.miss_hop = 0;
  answer_step(1, m);
  EXPECT_EQ(phase(), session_phase::stepping);
  ASSERT_EQ(log->steps.size(), 3u);
  const auto& r = log->steps[2].req;
  EXPECT_EQ(r.mode, static_cast<uint8_t>(msg::step_mode::decode));
  EXPECT_EQ(r.step_id, log->steps[1].req.step_id) << "the same step, sent again";
  EXPECT_EQ(r.rebuild, 1u) << "hop 0 rebuilds";
  EXPECT_EQ(r.past_len, 3);
  EXPECT_EQ(r.tokens, (std::vector<int32_t>{1, 2, 3, 5})) << "a rebuilt head gets every token";
  EXPECT_EQ(r.positions, (std::vector<int64_t>{0, 1, 2, 3}));
}

// A two-hop route: each miss adds its hop to the rebuilt ones; a route push
// that keeps the hops rebuilds nothing more; the counts follow.
TEST_F(SessionPhases, MissesAddTheirHopsAndAnUnchangedRouteKeepsTheRest) {
  start();
  auto two = route(10, 0);
  two.hops = {msg::hop{caf::actor_cast<msg::shard_actor>(shards_raw.at(0)), 0, 2},
              msg::hop{caf::actor_cast<msg::shard_actor>(shards_raw.at(1)), 3, 4}};
  answer_route(two);
  ASSERT_EQ(log->steps.size(), 1u);
  answer_step(0, token(log->steps[0].req, 5)); // prefill -> 5; decode in flight
  auto m = miss(log->steps[1].req);
  m.miss_hop = 1;
  answer_step(1, m);
  ASSERT_EQ(log->steps.size(), 3u);
  EXPECT_EQ(log->steps[2].req.rebuild, 2u) << "only hop 1 rebuilds";
  EXPECT_EQ(log->steps[2].req.tokens, (std::vector<int32_t>{5})) << "the kept head gets the new token only";
  EXPECT_EQ(log->steps[2].req.positions, (std::vector<int64_t>{3}));
  // The same hops at a newer epoch: the step goes again, nothing more rebuilds.
  auto bumped = two;
  bumped.epoch = 11;
  caf::anon_send(session, bumped);
  sched.run();
  ASSERT_EQ(log->steps.size(), 4u);
  EXPECT_EQ(log->steps[3].req.epoch, 11);
  EXPECT_EQ(log->steps[3].req.rebuild, 2u);
  EXPECT_EQ(log->steps[3].req.step_id, log->steps[1].req.step_id);
  m = miss(log->steps[3].req);
  m.miss_hop = 0; // the head lost its cache too
  answer_step(3, m);
  ASSERT_EQ(log->steps.size(), 5u);
  EXPECT_EQ(log->steps[4].req.rebuild, 3u) << "the head, then hop 1";
  EXPECT_EQ(log->steps[4].req.tokens, (std::vector<int32_t>{1, 2, 3, 5}));
  auto t = token(log->steps[4].req, 6);
  t.recomputed = 3 * 5; // what the shards report
  answer_step(4, t);
  EXPECT_EQ(log->tokens, (std::vector<int32_t>{5, 6}));
  ASSERT_EQ(log->steps.size(), 6u);
  EXPECT_EQ(log->steps[5].req.rebuild, 0u) << "the next step keeps every hop";
  EXPECT_EQ(log->steps[5].req.step_id, log->steps[1].req.step_id + 1);
  caf::anon_send(session, atom::cancel_atom_v);
  sched.run();
  session = nullptr;
}

TEST_F(SessionPhases, ResumeWhileRoutingIsIgnored) {
  start();
  caf::anon_send(session, atom::resume_atom_v);
  sched.run();
  EXPECT_EQ(phase(), session_phase::routing);
  EXPECT_TRUE(log->steps.empty());
  EXPECT_EQ(log->route_requests.size(), 1u);
  answer_route(route(10, 0));
  EXPECT_EQ(phase(), session_phase::stepping);
  EXPECT_EQ(log->steps.size(), 1u);
}

TEST_F(SessionPhases, PausedSessionTakesPushesAndRoutesOnResumeWhenIncomplete) {
  to_stepping({1});
  answer_step(0, token(log->steps[0].req, 5));
  EXPECT_EQ(phase(), session_phase::paused);
  EXPECT_EQ(log->steps.size(), 1u) << "no step while paused";
  auto empty = route(11, 0);
  empty.hops.clear();
  caf::anon_send(session, empty);
  sched.run();
  EXPECT_EQ(phase(), session_phase::paused);
  caf::anon_send(session, atom::resume_atom_v);
  sched.run();
  EXPECT_EQ(phase(), session_phase::routing);
  EXPECT_EQ(log->route_requests.size(), 2u);
  answer_route(route(12, 1));
  ASSERT_EQ(log->steps.size(), 2u);
  EXPECT_EQ(log->steps[1].shard, 1);
  EXPECT_EQ(log->steps[1].req.mode, static_cast<uint8_t>(msg::step_mode::decode));
  EXPECT_EQ(log->steps[1].req.rebuild, 1u) << "another shard: it rebuilds";
  EXPECT_EQ(log->steps[1].req.tokens, (std::vector<int32_t>{1, 2, 3, 5}));
}

TEST_F(SessionPhases, CancelWhileRouting) {
  start();
  expect_cancelled_and_released(0); // no route yet: nothing to release
}

TEST_F(SessionPhases, CancelWhileStepping) {
  to_stepping();
  const auto key = log->steps[0].req.key;
  expect_cancelled_and_released(1);
  EXPECT_EQ(log->releases[0].second, key) << "the release carries the owner's key";
}

TEST_F(SessionPhases, CancelWhileBackingOff) {
  to_stepping();
  time_out_twice(*this);
  ASSERT_EQ(phase(), session_phase::backing_off);
  expect_cancelled_and_released(0); // the failed route was dropped
}

TEST_F(SessionPhases, CancelWhilePaused) {
  to_stepping({1});
  answer_step(0, token(log->steps[0].req, 5));
  ASSERT_EQ(phase(), session_phase::paused);
  expect_cancelled_and_released(1);
}

TEST_F(SessionPhases, FinishReleasesWithTheKey) {
  opts.max_retries = 8;
  to_stepping();
  for (int i = 0; i < 10; ++i)
    answer_step(log->steps.size() - 1, token(log->steps.back().req, 10 + i));
  ASSERT_TRUE(log->result.has_value());
  EXPECT_EQ(log->result->finish, "length");
  EXPECT_EQ(log->tokens.size(), 10u);
  ASSERT_EQ(log->releases.size(), 1u);
  EXPECT_EQ(log->releases[0].second, log->steps[0].req.key);
  session = nullptr;
}

} // namespace
} // namespace strata
