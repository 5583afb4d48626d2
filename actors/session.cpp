#include "actors/session.hpp"

#include "messages/session_id.hpp"

#include <algorithm>

namespace strata::actors {

const char* to_string(session_phase p) {
  switch (p) {
    case session_phase::routing: return "routing";
    case session_phase::stepping: return "stepping";
    case session_phase::backing_off: return "backing_off";
    case session_phase::paused: return "paused";
    case session_phase::ended: return "ended";
  }
  return "unknown";
}

namespace {

using clk = std::chrono::steady_clock;
using behavior = session_impl_actor::behavior_type;

double ms_since(clk::time_point t0) {
  return std::chrono::duration<double, std::milli>(clk::now() - t0).count();
}

// ---------------------------------------------------------------- endings

void release_caches(session_self self) {
  for (auto& h : self->state.route.hops)
    self->send(h.shard, atom::release_atom_v, self->state.req.session, self->state.key);
  if (self->state.opts.drafter)
    self->send(self->state.opts.drafter, atom::release_atom_v, self->state.req.session);
}

void finish(session_self self, const char* reason) {
  auto& st = self->state;
  st.phase = session_phase::ended;
  st.result.finish = reason;
  st.result.total_ms = ms_since(st.started);
  release_caches(self);
  self->send(st.client, st.result);
  self->quit();
}

void fail(session_self self, caf::error err) {
  self->state.phase = session_phase::ended;
  release_caches(self);
  self->send(self->state.client, std::move(err));
  self->quit();
}

// ---------------------------------------------------------------- phases

void go_routing(session_self self);
void go_stepping(session_self self);
void go_backing_off(session_self self, const caf::error& why);
behavior routing(session_self self);
behavior stepping(session_self self);
behavior backing_off(session_self self);
behavior paused(session_self self);

// Takes a pushed route if it is newer. Returns false for a stale push.
bool take_push(session_self self, msg::route_info& r) {
  auto& st = self->state;
  if (r.epoch <= st.route.epoch)
    return false;
  ++st.result.route_changes;
  if (r.hops.empty()) { // no complete route right now
    st.route.epoch = r.epoch;
    st.route.hops.clear();
  } else {
    st.route = std::move(r); // the next send rebuilds only the hops that changed
  }
  return true;
}

// A restarted coordinator: follow it; its pushes (higher epochs) drive the
// re-prefill, and a step lost with the old one times out and retries.
void follow(session_self self, msg::supervisor_actor sup) {
  auto& st = self->state;
  st.supervisor = std::move(sup);
  st.supervisor_lost.reset();
  self->monitor(st.supervisor);
  self->send(st.supervisor, atom::subscribe_atom_v);
}

// Takes one token; false when the generation ended with it.
bool take_token(session_self self, int32_t token) {
  auto& st = self->state;
  if (std::find(st.req.stop_ids.begin(), st.req.stop_ids.end(), token) != st.req.stop_ids.end()) {
    finish(self, "stop");
    return false;
  }
  if (st.constraint && !st.constraint->accept(token)) {
    fail(self, caf::make_error(ec::model_error, "session '" + st.req.session + "': the tail sent token " +
                                                  std::to_string(token) + ", which the grammar does not allow"));
    return false;
  }
  st.seq.push_back(token);
  st.result.ids.push_back(token);
  if (st.req.sampling.penalized())
    ++st.penalty_counts[token];
  msg::token_event ev;
  ev.session = st.req.session;
  ev.index = static_cast<int64_t>(st.result.ids.size()) - 1;
  ev.token = token;
  ev.logprob = st.last_logprob;
  ev.top_ids = std::move(st.last_top_ids);
  ev.top_logprobs = std::move(st.last_top_logprobs);
  if (ev.index == 0 && !st.result.prompt_logprobs.empty()) { // a stream echoes the prompt first
    ev.prompt_logprobs = st.result.prompt_logprobs;
    ev.prompt_top_ids = st.result.prompt_top_ids;
    ev.prompt_top_logprobs = st.result.prompt_top_logprobs;
  }
  self->send(st.client, std::move(ev));
  if (st.constraint && st.constraint->complete() && !st.constraint->can_continue()) {
    finish(self, "stop"); // the grammar is done: nothing but a stop token could follow
    return false;
  }
  if (static_cast<int64_t>(st.result.ids.size()) >= st.req.max_tokens) {
    finish(self, "length");
    return false;
  }
  if (st.opts.max_context > 0 && static_cast<int64_t>(st.seq.size()) >= st.opts.max_context) {
    finish(self, "context");
    return false;
  }
  return true;
}

// After the tokens of a step: pause at a pause point, else the next step.
void after_tokens(session_self self) {
  auto& st = self->state;
  st.failures = 0;
  st.last_token_at = clk::now();
  const auto n = static_cast<int64_t>(st.result.ids.size());
  if (std::find(st.req.pause_after.begin(), st.req.pause_after.end(), n) != st.req.pause_after.end()) {
    st.phase = session_phase::paused; // the client resumes us
    ++st.awaited;
    self->become(paused(self));
    return;
  }
  go_stepping(self);
}

// How many tokens the next step may propose: the controller's choice, and never
// so many that the step could run past a pause point, max_tokens or the context.
std::size_t draft_room(const session_state& st) {
  const auto& sp = st.req.sampling;
  if (st.req.speculate == 0 || sp.penalized() || sp.logprobs >= 0 || st.constraint)
    return 0;
  const auto n = static_cast<int64_t>(st.result.ids.size());
  int64_t room = std::min<int64_t>(st.drafting.next(), msg::max_draft);
  room = std::min(room, st.req.max_tokens - n - 1);
  for (auto p : st.req.pause_after)
    if (p > n)
      room = std::min(room, p - n - 1);
  if (st.opts.max_context > 0) // rows up to position L - 1 + room, the tokens after them too
    room = std::min(room, st.opts.max_context - static_cast<int64_t>(st.seq.size()) - 1);
  return static_cast<std::size_t>(std::max<int64_t>(0, room));
}

void on_step_reply(session_self self, bool prefill, clk::time_point t0, msg::step_reply& rep) {
  auto& st = self->state;
  st.overloads = 0;
  const double ms = ms_since(t0);
  {
    // What steps take now, for the next deadlines.
    if (prefill) {
      const double per = ms / static_cast<double>(std::max<std::size_t>(1, st.inflight.tokens.size()));
      st.prefill_ms_per_token = st.prefill_ms_per_token == 0 ? per : 0.7 * st.prefill_ms_per_token + 0.3 * per;
    } else {
      st.decode_ms = st.decode_ms == 0 ? ms : 0.7 * st.decode_ms + 0.3 * ms;
    }
  }
  // A plain decode trip (no rebuild, not resent) tells the drafting control what a trip costs.
  const double trip_ms = !prefill && st.inflight.rebuild == 0 && !st.resent ? ms : -1;
  st.result.recomputed_layer_tokens += rep.recomputed;
  if (rep.kind == static_cast<uint8_t>(msg::reply_kind::cache_miss)) {
    if (rep.miss < msg::miss_reason_count)
      ++st.result.misses[rep.miss];
    if (++st.failures > st.opts.max_retries)
      return fail(self, caf::make_error(ec::retries_exhausted, "session '" + st.req.session + "': cache missed " +
                                                                 std::to_string(st.failures) +
                                                                 " times in a row; last: " + rep.detail));
    // That hop rebuilds on the resend. (A hop that was already rebuilding cannot
    // miss; if one says so, or names no hop of the route, rebuild them all.)
    const auto k = rep.miss_hop;
    const auto& hops = st.route.hops;
    if (k >= 0 && k < static_cast<int64_t>(hops.size()) && k < 64 &&
        ((st.inflight.rebuild >> k) & 1u) == 0)
      st.lost.push_back(hops[static_cast<std::size_t>(k)].shard);
    else
      for (auto& h : hops)
        st.lost.push_back(h.shard);
    return go_stepping(self);
  }
  if (prefill && !st.first_token_seen) {
    st.result.prefill_ms = ms_since(t0);
    st.first_token_seen = true;
  }
  // Every hop of the route now holds the session's state.
  st.prefilled = true;
  st.step_pending = false;
  st.kept_hops = st.route.hops;
  st.lost.clear();
  st.avoid.clear(); // a step went through: forget old suspicions
  st.rng_state = rep.rng_state;
  st.last_logprob = rep.logprob;
  st.last_top_ids = std::move(rep.top_ids);
  st.last_top_logprobs = std::move(rep.top_logprobs);
  if (rep.accepted.size() > st.draft.size() || !std::equal(rep.accepted.begin(), rep.accepted.end(), st.draft.begin()))
    return fail(self, caf::make_error(ec::model_error, "session '" + st.req.session + "': the tail accepted " +
                                                         std::to_string(rep.accepted.size()) +
                                                         " tokens that are not a prefix of the " +
                                                         std::to_string(st.draft.size()) + " proposed"));
  if (!st.draft.empty()) {
    st.result.proposed += st.draft.size();
    st.result.accepted += rep.accepted.size();
    // (The draft model's time counts as the proposals' cost, as their rows do.)
    st.drafting.observe(static_cast<uint32_t>(st.draft.size()), static_cast<uint32_t>(rep.accepted.size()),
                        trip_ms >= 0 ? trip_ms + st.draft_ms : -1);
  } else if (!prefill) {
    st.drafting.plain_step(trip_ms);
  }
  st.draft.clear();
  if (st.req.prompt_logprobs >= 0 && st.result.prompt_logprobs.empty() && prefill) {
    const auto n = st.req.prompt.size() - 1, k = static_cast<std::size_t>(st.req.prompt_logprobs);
    if (rep.prompt_logprobs.size() != n || rep.prompt_top_ids.size() != n * k || rep.prompt_top_logprobs.size() != n * k)
      return fail(self, caf::make_error(ec::model_error, "session '" + st.req.session + "': the tail scored " +
                                                           std::to_string(rep.prompt_logprobs.size()) + " of the " +
                                                           std::to_string(n) + " prompt tokens after the first"));
    st.result.prompt_logprobs = std::move(rep.prompt_logprobs);
    st.result.prompt_top_ids = std::move(rep.prompt_top_ids);
    st.result.prompt_top_logprobs = std::move(rep.prompt_top_logprobs);
  }
  if (st.req.max_tokens <= 0) // only the prompt's log-probabilities were asked for
    return finish(self, "length");
  for (auto t : rep.accepted)
    if (!take_token(self, t))
      return;
  if (take_token(self, rep.token))
    after_tokens(self);
}

void send_step(session_self self);

// Constrained decoding: the tokens the grammar allows next (and the stop tokens
// once the text is complete), as ids when few, else as bits. False (the
// session failed) when the grammar allows no token of the vocabulary.
bool allow_tokens(session_self self, msg::sampling_state& sp) {
  auto& st = self->state;
  std::shared_ptr<const model::TokenBits> mask;
  try {
    mask = st.constraint->allowed();
  } catch (const model::Error& e) {
    fail(self, caf::make_error(ec::bad_request, "session '" + st.req.session + "': grammar: " + e.message()));
    return false;
  }
  const auto V = static_cast<std::size_t>(st.opts.vocabulary->size());
  std::size_t n = 0;
  for (auto w : *mask)
    n += static_cast<std::size_t>(__builtin_popcountll(w));
  const bool complete = st.constraint->complete();
  if (n == 0 && !(complete && !st.req.stop_ids.empty())) {
    fail(self, caf::make_error(ec::bad_request, "session '" + st.req.session +
                                                  "': the grammar allows no token of the vocabulary after " +
                                                  std::to_string(st.result.ids.size()) + " generated tokens"));
    return false;
  }
  sp.allowed_ids.clear();
  sp.allowed_bits.clear();
  if (n + st.req.stop_ids.size() <= V / 32) {
    for (std::size_t w = 0; w < mask->size(); ++w)
      for (uint64_t b = (*mask)[w]; b != 0; b &= b - 1)
        sp.allowed_ids.push_back(static_cast<int32_t>(w * 64 + static_cast<std::size_t>(__builtin_ctzll(b))));
    if (complete)
      sp.allowed_ids.insert(sp.allowed_ids.end(), st.req.stop_ids.begin(), st.req.stop_ids.end());
  } else {
    sp.allowed_bits = *mask;
    if (complete)
      for (auto id : st.req.stop_ids)
        if (id >= 0 && static_cast<std::size_t>(id) < V)
          sp.allowed_bits[static_cast<std::size_t>(id) >> 6] |= uint64_t{1} << (id & 63);
  }
  return true;
}

void go_overloaded(session_self self, const caf::error& why);

void on_step_error(session_self self, caf::error& err) {
  auto& st = self->state;
  if (err == ec::overloaded)
    return go_overloaded(self, err);
  if (err == caf::sec::request_timeout && !st.resent) {
    // Slow is not lost: send the very same step again (same id). A shard that
    // applied it answers it as a duplicate; one that still has it queued runs
    // the first copy and answers the second as a duplicate.
    ++st.result.retries;
    st.resent = true;
    return send_step(self);
  }
  if (err == ec::incompatible_recipe || err == ec::budget_exceeded || err == ec::model_error ||
      err == ec::bad_shape || err == ec::bad_request || err == ec::session_conflict)
    return fail(self, std::move(err));
  // stale epoch, timeout, a shard that went away: get a fresh route. A shard
  // this process cannot reach (even if the supervisor can) is avoided.
  if (err == caf::sec::request_receiver_down)
    for (auto& h : st.route.hops)
      if (std::find(st.avoid.begin(), st.avoid.end(), h.shard) == st.avoid.end())
        st.avoid.push_back(h.shard);
  st.route.hops.clear();
  go_backing_off(self, err);
}

// routing: one route request in flight.
void go_routing(session_self self) {
  auto& st = self->state;
  st.phase = session_phase::routing;
  const auto tag = ++st.awaited;
  self->request(st.supervisor, st.opts.route_timeout, atom::route_atom_v, st.avoid)
    .then(
      [=](msg::route_info& r) {
        auto& st = self->state;
        if (tag != st.awaited)
          return; // superseded
        if (r.epoch >= st.route.epoch && !r.hops.empty())
          st.route = std::move(r);
        go_stepping(self);
      },
      [=](caf::error& err) {
        auto& st = self->state;
        if (tag != st.awaited)
          return;
        if (err == ec::no_route)
          return fail(self, std::move(err));
        go_backing_off(self, err);
      });
  self->become(routing(self));
}

// Which hops of the current route must rebuild the pending step's caches: those
// that missed it, and those whose shard and layers did not hold the session's
// state at its last token (a route change). Bit i: hop i.
uint64_t rebuild_mask(const session_state& st) {
  uint64_t mask = 0;
  for (std::size_t i = 0; i < st.route.hops.size() && i < 64; ++i) {
    const auto& h = st.route.hops[i];
    const bool held = std::any_of(st.kept_hops.begin(), st.kept_hops.end(), [&](const msg::hop& k) {
      return k.shard == h.shard && k.first == h.first && k.last == h.last;
    });
    const bool lost = std::find(st.lost.begin(), st.lost.end(), h.shard) != st.lost.end();
    if (!held || lost)
      mask |= uint64_t{1} << i;
  }
  return mask;
}

// stepping: one step in flight (or, with no complete route, routing). A step
// that has not yielded its token yet is sent again under the same id.
void go_stepping(session_self self) {
  auto& st = self->state;
  if (st.route.hops.empty())
    return go_routing(self);
  st.phase = session_phase::stepping;
  if (!st.step_pending) {
    ++st.step_id;
    st.step_pending = true;
    st.recovery_counted = false;
    st.draft.clear();
    st.draft_ms = 0;
    st.drafted = !st.prefilled;
  }
  if (!st.drafted) {
    const auto room = draft_room(st);
    if (room > 0 && st.opts.drafter) {
      // Ask the draft model first; its answer (or its failure) sends the step.
      const auto tag = ++st.awaited;
      const auto asked = clk::now();
      self->request(st.opts.drafter, st.opts.draft_timeout, atom::propose_atom_v, st.req.session, st.seq,
                    static_cast<uint32_t>(room))
        .then(
          [=](std::vector<int32_t>& proposal) {
            auto& st = self->state;
            if (tag != st.awaited)
              return;
            st.draft_ms = ms_since(asked);
            if (proposal.size() > room)
              proposal.resize(room);
            if (proposal.empty()) { // declined (too many sessions drafting) or nothing to propose: ask again later
              ++st.result.declined;
              st.drafting.declined();
            }
            st.draft = std::move(proposal);
            st.drafted = true;
            go_stepping(self);
          },
          [=](caf::error&) {
            auto& st = self->state;
            if (tag != st.awaited)
              return;
            st.drafted = true; // this step goes without proposals
            go_stepping(self);
          });
      self->become(stepping(self));
      return;
    }
    if (room > 0)
      st.draft = lookup_proposal(st.seq, room);
    st.drafted = true;
  }
  msg::step_request r;
  r.session = st.req.session;
  r.key = st.key;
  r.epoch = st.route.epoch;
  r.step_id = st.step_id;
  r.recipe = st.route.recipe;
  r.route = st.route.hops;
  r.hop_index = 0;
  r.sampling = st.req.sampling;
  r.sampling.rng_state = st.rng_state;
  if (r.sampling.penalized()) {
    r.sampling.penalty_ids.clear();
    r.sampling.penalty_counts.clear();
    for (auto [id, n] : st.penalty_counts) {
      r.sampling.penalty_ids.push_back(id);
      r.sampling.penalty_counts.push_back(n);
    }
  }
  if (st.constraint && !allow_tokens(self, r.sampling))
    return;
  const auto L = static_cast<int64_t>(st.seq.size());
  if (!st.prefilled) {
    // The prompt's prefill (again, if it failed): every hop opens its cache.
    r.mode = static_cast<uint8_t>(msg::step_mode::prefill);
    r.past_len = 0;
  } else {
    r.mode = static_cast<uint8_t>(msg::step_mode::decode);
    r.past_len = L - 1;
    r.rebuild = rebuild_mask(st);
    if (r.rebuild != 0 && st.route.hops.size() > msg::max_route_hops) {
      // A route too long for the mask: every hop rebuilds (a full re-prefill).
      r.mode = static_cast<uint8_t>(msg::step_mode::prefill);
      r.past_len = 0;
      r.rebuild = 0;
    }
  }
  const bool head_rebuilds = r.mode == static_cast<uint8_t>(msg::step_mode::prefill) || (r.rebuild & 1u) != 0;
  const int64_t from = head_rebuilds ? 0 : r.past_len;
  r.tokens.assign(st.seq.begin() + from, st.seq.end());
  r.tokens.insert(r.tokens.end(), st.draft.begin(), st.draft.end());
  r.draft = static_cast<uint32_t>(st.draft.size());
  // The prompt's log-probabilities come with the first prefill that goes through.
  if (st.req.prompt_logprobs >= 0 && r.mode == static_cast<uint8_t>(msg::step_mode::prefill) && !st.prefilled)
    r.prompt_logprobs = st.req.prompt_logprobs;
  r.positions = model::consecutive_positions(from, L - from + static_cast<int64_t>(st.draft.size()));
  if (st.prefilled && (r.rebuild != 0 || r.mode == static_cast<uint8_t>(msg::step_mode::prefill)) &&
      !st.recovery_counted) {
    // A recovery: the positions before this step must be rebuilt somewhere.
    // (What the rebuilt hops computed comes back in the reply; a full
    // re-prefill would have recomputed every layer over them.)
    st.recovery_counted = true;
    ++st.result.reprefills;
    st.result.recomputed_tokens += static_cast<uint64_t>(L - 1);
    st.result.full_layer_tokens += static_cast<uint64_t>(L - 1) * static_cast<uint64_t>(st.route.recipe.n_layers);
  }
  ++st.result.steps;
  st.inflight = std::move(r);
  st.resent = false;
  send_step(self);
}

// Sends st.inflight with a deadline that follows the observed step times.
void send_step(session_self self) {
  auto& st = self->state;
  const bool prefill = st.inflight.mode == static_cast<uint8_t>(msg::step_mode::prefill);
  const double expect = prefill ? st.prefill_ms_per_token * static_cast<double>(st.inflight.tokens.size())
                                : st.decode_ms;
  auto deadline = std::max(st.opts.step_timeout,
                           std::chrono::milliseconds(static_cast<int64_t>(expect * st.opts.deadline_factor)));
  if (st.resent)
    deadline *= 2;
  const auto tag = ++st.awaited;
  const auto t0 = clk::now();
  self->request(st.route.hops.front().shard, deadline, st.inflight)
    .then(
      [=](msg::step_reply& rep) {
        if (tag == self->state.awaited)
          on_step_reply(self, prefill, t0, rep);
      },
      [=](caf::error& err) {
        if (tag == self->state.awaited)
          on_step_error(self, err);
      });
  self->become(stepping(self));
}

// The shard's queue was full: nothing was applied. Wait, then send the step
// again on the same route (no re-route, no re-prefill).
void go_overloaded(session_self self, const caf::error& why) {
  auto& st = self->state;
  ++st.result.retries;
  if (++st.overloads > st.opts.max_overloaded)
    return fail(self, caf::make_error(ec::retries_exhausted, "session '" + st.req.session + "': the shards stayed "
                                                               "overloaded for " + std::to_string(st.overloads - 1) +
                                                               " attempts; last: " + self->system().render(why)));
  st.phase = session_phase::backing_off;
  st.retry_step = true;
  const auto tag = ++st.awaited;
  const auto wait = st.opts.backoff * (1 << std::min(st.overloads - 1, 5));
  self->delayed_send(self, wait, atom::retry_atom_v, tag);
  self->become(backing_off(self));
}

// backing_off: a failure; wait (doubling per failure in a row), then route again.
void go_backing_off(session_self self, const caf::error& why) {
  auto& st = self->state;
  st.retry_step = false;
  ++st.result.retries;
  if (st.supervisor_lost) {
    // This process lost its connection to the coordinator (its process died, or
    // the connection was dropped: a peer silent past the liveness bound): the
    // failure is the connection's, not the route's. Wait for the client to
    // reconnect and send `register`; the lease timer ends the session with
    // cluster_lost when none comes within cluster_wait.
    st.phase = session_phase::backing_off;
    const auto tag = ++st.awaited;
    self->delayed_send(self, std::min(st.opts.cluster_wait, std::chrono::milliseconds(200)), atom::retry_atom_v, tag);
    self->become(backing_off(self));
    return;
  }
  if (++st.failures > st.opts.max_retries) {
    fail(self, caf::make_error(ec::retries_exhausted, "session '" + st.req.session + "' gave up after " +
                                                        std::to_string(st.failures - 1) +
                                                        " failed attempts; last: " + self->system().render(why)));
    return;
  }
  st.phase = session_phase::backing_off;
  const auto tag = ++st.awaited; // whatever is still in flight no longer counts
  const auto wait = st.opts.backoff * (1 << std::min(st.failures - 1, 8));
  self->delayed_send(self, wait, atom::retry_atom_v, tag);
  self->become(backing_off(self));
}

// Handlers every phase shares.
auto on_cancel(session_self self) {
  return [=](atom::cancel_atom) {
    fail(self, caf::make_error(ec::cancelled, "session '" + self->state.req.session + "' was cancelled"));
  };
}

auto on_lease(session_self self) {
  return [=](atom::lease_atom) {
    auto& st = self->state;
    // The coordinator went away, none took its place (a client that reconnects
    // would have sent `register` by now) and no token came since: the cluster
    // is gone. A session whose shards still answer goes on without it.
    if (st.supervisor_lost && clk::now() - std::max(*st.supervisor_lost, st.last_token_at) >= st.opts.cluster_wait)
      return fail(self, caf::make_error(ec::cluster_lost, "session '" + st.req.session + "': the coordinator went away "
                                                          "and none came back within " +
                                                          std::to_string(st.opts.cluster_wait.count()) + " ms"));
    for (auto& h : st.route.hops)
      self->send(h.shard, atom::lease_atom_v, st.req.session, st.key);
    self->delayed_send(self, st.opts.lease_renew, atom::lease_atom_v);
  };
}

behavior routing(session_self self) {
  return {
    [=](msg::route_info& r) {
      if (take_push(self, r) && !self->state.route.hops.empty())
        go_stepping(self); // supersedes the route request
    },
    [=](atom::resume_atom) {},               // not paused
    [=](atom::retry_atom, uint64_t) {},      // a timer from an earlier phase
    [=](atom::register_atom, msg::supervisor_actor sup) {
      follow(self, std::move(sup));
      go_routing(self); // ask the new supervisor
    },
    on_cancel(self),
    on_lease(self),
  };
}

behavior stepping(session_self self) {
  return {
    [=](msg::route_info& r) {
      if (take_push(self, r))
        go_stepping(self); // supersedes the step in flight (routing when no route is complete)
    },
    [=](atom::resume_atom) {},
    [=](atom::retry_atom, uint64_t) {},
    [=](atom::register_atom, msg::supervisor_actor sup) { follow(self, std::move(sup)); },
    on_cancel(self),
    on_lease(self),
  };
}

behavior backing_off(session_self self) {
  return {
    [=](msg::route_info& r) {
      if (take_push(self, r) && !self->state.route.hops.empty())
        go_stepping(self); // a new complete route: no need to wait
    },
    [=](atom::resume_atom) {},
    [=](atom::retry_atom, uint64_t tag) {
      auto& st = self->state;
      if (tag != st.awaited)
        return;
      if (st.retry_step && !st.route.hops.empty()) {
        // The refused step was never applied: send it again as it was.
        st.phase = session_phase::stepping;
        st.resent = false;
        send_step(self);
      } else {
        go_routing(self);
      }
    },
    [=](atom::register_atom, msg::supervisor_actor sup) {
      follow(self, std::move(sup));
      if (!self->state.retry_step)
        go_routing(self); // ask the new supervisor now
    },
    on_cancel(self),
    on_lease(self),
  };
}

behavior paused(session_self self) {
  return {
    [=](msg::route_info& r) { take_push(self, r); }, // remembered; used on resume
    [=](atom::resume_atom) { go_stepping(self); },
    [=](atom::retry_atom, uint64_t) {},
    [=](atom::register_atom, msg::supervisor_actor sup) { follow(self, std::move(sup)); },
    on_cancel(self),
    on_lease(self),
  };
}

} // namespace

behavior session(session_self self, msg::supervisor_actor supervisor, msg::session_client_actor client, msg::generation_request req,
                 SessionOptions opts) {
  auto& st = self->state;
  st.req = std::move(req);
  st.opts = opts;
  st.client = client;
  st.supervisor = supervisor;
  st.key = msg::mint_session_key();
  if (st.req.session.empty())
    st.req.session = msg::mint_session_id("s");
  st.seq = st.req.prompt;
  st.rng_state = st.req.sampling.rng_state;
  // (A draft model's proposals each cost a pass of it: it starts at 2 and grows as they are taken.)
  st.drafting = DraftControl(std::min(st.req.speculate, msg::max_draft), 3, st.opts.drafter ? 2 : UINT32_MAX);
  if (st.req.sampling.penalized() && st.req.sampling.repetition_penalty != 1.0f)
    for (auto id : st.req.prompt) // the repetition penalty sees the prompt too (count 0)
      st.penalty_counts.emplace(id, 0);
  st.result.session = st.req.session;
  st.result.misses.assign(msg::miss_reason_count, 0);
  st.started = clk::now();
  auto refuse = [&](std::string why) -> behavior {
    st.phase = session_phase::ended;
    self->send(client, caf::make_error(ec::invalid_request, std::move(why)));
    self->quit();
    return paused(self); // never runs: the actor has quit
  };
  if (!msg::valid_session_id(st.req.session))
    return refuse("a session id must be 1-128 printable ASCII characters (use mint_session_id)");
  const auto& sp = st.req.sampling;
  if (!(sp.temperature >= 0 && sp.temperature <= 100) || sp.top_k < 0 || !(sp.top_p > 0 && sp.top_p <= 1) ||
      !(sp.min_p >= 0 && sp.min_p <= 1) || !(sp.presence_penalty >= -2 && sp.presence_penalty <= 2) ||
      !(sp.frequency_penalty >= -2 && sp.frequency_penalty <= 2) ||
      !(sp.repetition_penalty > 0 && sp.repetition_penalty <= 10) || sp.logprobs < -1 || sp.logprobs > 20)
    return refuse("session '" + st.req.session + "': sampling settings out of range (temperature " +
                  std::to_string(sp.temperature) + " must be in [0, 100], top_k " + std::to_string(sp.top_k) +
                  " >= 0, top_p " + std::to_string(sp.top_p) + " in (0, 1], min_p " + std::to_string(sp.min_p) +
                  " in [0, 1], presence and frequency penalties in [-2, 2], repetition penalty in (0, 10], logprobs " +
                  "in [-1, 20])");
  if (st.req.speculate > msg::max_draft)
    return refuse("session '" + st.req.session + "': speculate " + std::to_string(st.req.speculate) +
                  " proposes more than the " + std::to_string(msg::max_draft) + " tokens a step may carry");
  if (st.req.prompt.empty())
    return refuse("session '" + st.req.session + "': the prompt is empty");
  if (!st.req.grammar.empty()) {
    if (!opts.vocabulary)
      return refuse("session '" + st.req.session + "': a grammar needs the tokenizer's vocabulary, which this " +
                    "process was not given");
    try {
      st.constraint = std::make_shared<model::ConstraintMatcher>(opts.vocabulary->constraint(st.req.grammar));
    } catch (const model::Error& e) {
      return refuse("session '" + st.req.session + "': " + e.message());
    }
  }
  if (opts.max_context > 0 && static_cast<int64_t>(st.req.prompt.size()) > opts.max_context)
    return refuse("session '" + st.req.session + "': the prompt has " + std::to_string(st.req.prompt.size()) +
                  " tokens, more than the context of " + std::to_string(opts.max_context));
  if (st.req.prompt_logprobs < -1 || st.req.prompt_logprobs > 20)
    return refuse("session '" + st.req.session + "': prompt_logprobs " + std::to_string(st.req.prompt_logprobs) +
                  " must be in [-1, 20]");
  if (st.req.max_tokens <= 0 && st.req.prompt_logprobs < 0) {
    st.phase = session_phase::ended;
    st.result.finish = "length";
    self->send(client, st.result);
    self->quit();
    return paused(self);
  }
  self->set_down_handler([self](caf::down_msg& dm) {
    auto& st = self->state;
    if (dm.source == st.supervisor.address() && !st.supervisor_lost)
      st.supervisor_lost = clk::now(); // the lease timer checks how long ago
  });
  self->monitor(supervisor);
  self->send(supervisor, atom::subscribe_atom_v);
  self->delayed_send(self, opts.lease_renew, atom::lease_atom_v);
  go_routing(self);
  return routing(self);
}

msg::session_actor spawn_session(caf::actor_system& sys, msg::supervisor_actor supervisor, msg::session_client_actor client,
                                 msg::generation_request req, SessionOptions opts) {
  return sys.spawn(session, std::move(supervisor), std::move(client), std::move(req), opts);
}

} // namespace strata::actors
