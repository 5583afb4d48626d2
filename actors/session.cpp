#include "actors/session.hpp"

#include <algorithm>

namespace strata::actors {

namespace {

using self_ptr = caf::stateful_actor<session_state>*;
using clk = std::chrono::steady_clock;

double ms_since(clk::time_point t0) {
  return std::chrono::duration<double, std::milli>(clk::now() - t0).count();
}

void release_caches(self_ptr self) {
  for (auto& h : self->state.route.hops)
    self->send(h.shard, atom::release_atom_v, self->state.req.session);
}

void finish(self_ptr self, const char* reason) {
  auto& st = self->state;
  st.result.finish = reason;
  st.result.total_ms = ms_since(st.started);
  release_caches(self);
  self->send(st.client, st.result);
  self->quit();
}

void fail(self_ptr self, caf::error err) {
  release_caches(self);
  self->send(self->state.client, std::move(err));
  self->quit();
}

void fetch_route(self_ptr self);
void send_step(self_ptr self);

// A step failed (timeout, stale epoch, shard gone): back off, then get the
// current route and re-prefill. Bounded.
void retry(self_ptr self, const caf::error& why) {
  auto& st = self->state;
  ++st.result.retries;
  if (++st.failures > st.opts.max_retries) {
    fail(self, caf::make_error(ec::retries_exhausted, "session '" + st.req.session + "' gave up after " +
                                                        std::to_string(st.failures - 1) +
                                                        " failed attempts; last: " + self->system().render(why)));
    return;
  }
  ++st.attempt; // whatever is still in flight no longer counts
  st.needs_prefill = true;
  const auto wait = st.opts.backoff * (1 << std::min(st.failures - 1, 8));
  self->delayed_send(self, wait, atom::retry_atom_v, st.attempt);
}

void on_token(self_ptr self, int32_t token) {
  auto& st = self->state;
  st.failures = 0;
  if (std::find(st.req.stop_ids.begin(), st.req.stop_ids.end(), token) != st.req.stop_ids.end())
    return finish(self, "stop");
  st.seq.push_back(token);
  st.result.ids.push_back(token);
  self->send(st.client, msg::token_event{st.req.session, static_cast<int64_t>(st.result.ids.size()) - 1, token});
  if (static_cast<int64_t>(st.result.ids.size()) >= st.req.max_tokens)
    return finish(self, "length");
  if (st.opts.max_context > 0 && static_cast<int64_t>(st.seq.size()) >= st.opts.max_context)
    return finish(self, "context");
  const auto n = static_cast<int64_t>(st.result.ids.size());
  if (std::find(st.req.pause_after.begin(), st.req.pause_after.end(), n) != st.req.pause_after.end()) {
    st.paused = true; // the client resumes us
    return;
  }
  send_step(self);
}

void send_step(self_ptr self) {
  auto& st = self->state;
  if (st.route.hops.empty()) {
    fetch_route(self);
    return;
  }
  msg::step_request r;
  r.session = st.req.session;
  r.epoch = st.route.epoch;
  r.step_id = ++st.step_id;
  r.recipe = st.route.recipe;
  r.route = st.route.hops;
  r.hop_index = 0;
  r.sampling = st.req.sampling;
  r.sampling.rng_state = st.rng_state;
  if (st.needs_prefill) {
    r.mode = static_cast<uint8_t>(msg::step_mode::prefill);
    r.past_len = 0;
    r.tokens = st.seq;
  } else {
    r.mode = static_cast<uint8_t>(msg::step_mode::decode);
    r.past_len = static_cast<int64_t>(st.seq.size()) - 1;
    r.tokens = {st.seq.back()};
  }
  for (int64_t i = 0; i < static_cast<int64_t>(r.tokens.size()); ++i)
    r.positions.push_back(r.past_len + i);
  const bool prefill = st.needs_prefill;
  if (prefill && st.result.steps > 0) {
    ++st.result.reprefills;
    st.result.recomputed_tokens += st.seq.size();
  }
  ++st.result.steps;
  const auto attempt = ++st.attempt;
  const auto t0 = clk::now();
  self->request(st.route.hops.front().shard, st.opts.step_timeout, std::move(r))
    .then(
      [=](msg::step_reply& rep) {
        auto& st = self->state;
        if (attempt != st.attempt)
          return; // superseded by a route change or a retry
        if (rep.kind == static_cast<uint8_t>(msg::reply_kind::cache_miss)) {
          if (rep.miss < msg::miss_reason_count)
            ++st.result.misses[rep.miss];
          if (++st.failures > st.opts.max_retries)
            return fail(self, caf::make_error(ec::retries_exhausted, "session '" + st.req.session +
                                                                       "': cache missed " + std::to_string(st.failures) +
                                                                       " times in a row; last: " + rep.detail));
          st.needs_prefill = true;
          return send_step(self);
        }
        if (prefill && !st.first_token_seen) {
          st.result.prefill_ms = ms_since(t0);
          st.first_token_seen = true;
        }
        st.needs_prefill = false;
        st.avoid.clear(); // a step went through: forget old suspicions
        st.rng_state = rep.rng_state;
        on_token(self, rep.token);
      },
      [=](caf::error& err) {
        auto& st = self->state;
        if (attempt != st.attempt)
          return;
        if (err == ec::incompatible_recipe || err == ec::budget_exceeded || err == ec::model_error ||
            err == ec::bad_shape || err == ec::bad_request)
          return fail(self, std::move(err));
        // stale epoch, timeout, a shard that went away: get a fresh route. A shard
        // this process cannot reach (even if the supervisor can) is avoided.
        if (err == caf::sec::request_receiver_down)
          for (auto& h : st.route.hops)
            if (std::find(st.avoid.begin(), st.avoid.end(), h.shard) == st.avoid.end())
              st.avoid.push_back(h.shard);
        st.route.hops.clear();
        retry(self, err);
      });
}

void fetch_route(self_ptr self) {
  auto& st = self->state;
  const auto attempt = ++st.attempt;
  self->request(st.supervisor, st.opts.route_timeout, atom::route_atom_v, st.avoid)
    .then(
      [=](msg::route_info& r) {
        auto& st = self->state;
        if (attempt != st.attempt)
          return;
        if (r.epoch >= st.route.epoch) {
          st.route = std::move(r);
          st.needs_prefill = true;
        }
        send_step(self);
      },
      [=](caf::error& err) {
        auto& st = self->state;
        if (attempt != st.attempt)
          return;
        if (err == ec::no_route)
          return fail(self, std::move(err));
        retry(self, err);
      });
}

} // namespace

caf::behavior session_actor(caf::stateful_actor<session_state>* self, caf::actor supervisor, caf::actor client,
                            msg::generation_request req, SessionOptions opts) {
  auto& st = self->state;
  st.req = std::move(req);
  st.opts = opts;
  st.client = client;
  st.supervisor = supervisor;
  st.seq = st.req.prompt;
  st.rng_state = st.req.sampling.rng_state;
  st.result.session = st.req.session;
  st.result.misses.assign(msg::miss_reason_count, 0);
  st.started = clk::now();
  if (st.req.prompt.empty()) {
    self->send(client, caf::make_error(ec::invalid_request, "session '" + st.req.session + "': the prompt is empty"));
    self->quit();
    return {};
  }
  if (opts.max_context > 0 && static_cast<int64_t>(st.req.prompt.size()) > opts.max_context) {
    self->send(client, caf::make_error(ec::invalid_request, "session '" + st.req.session + "': the prompt has " +
                                                              std::to_string(st.req.prompt.size()) +
                                                              " tokens, more than the context of " +
                                                              std::to_string(opts.max_context)));
    self->quit();
    return {};
  }
  self->send(supervisor, atom::subscribe_atom_v, caf::actor_cast<caf::actor>(self));
  if (st.req.max_tokens <= 0) {
    st.result.finish = "length";
    self->send(client, st.result);
    self->quit();
    return {};
  }
  fetch_route(self);
  return {
    [=](msg::route_info& r) {
      // The supervisor changed the route: take it and re-prefill.
      auto& st = self->state;
      if (r.epoch <= st.route.epoch)
        return;
      ++st.result.route_changes;
      if (r.hops.empty()) { // no complete route right now: ask (and wait, bounded)
        st.route.epoch = r.epoch;
        st.route.hops.clear();
        if (st.paused)
          return; // resume will fetch it
        return fetch_route(self);
      }
      st.route = std::move(r);
      st.needs_prefill = true;
      if (!st.paused)
        send_step(self); // supersedes the step in flight
    },
    [=](atom::resume_atom) {
      auto& st = self->state;
      if (!st.paused)
        return;
      st.paused = false;
      send_step(self);
    },
    [=](atom::retry_atom, uint64_t attempt) {
      if (attempt == self->state.attempt)
        fetch_route(self);
    },
    [=](atom::register_atom, caf::actor sup) {
      // A restarted coordinator: follow it; its route pushes (higher epochs) drive
      // the re-prefill, and a step lost with the old one times out and retries.
      auto& st = self->state;
      st.supervisor = sup;
      self->send(sup, atom::subscribe_atom_v, caf::actor_cast<caf::actor>(self));
      if (st.route.hops.empty() && !st.paused)
        fetch_route(self);
    },
    [=](atom::cancel_atom) {
      fail(self, caf::make_error(ec::cancelled, "session '" + self->state.req.session + "' was cancelled"));
    },
  };
}

} // namespace strata::actors
