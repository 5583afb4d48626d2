#include "actors/shard_actor.hpp"

#include "model/error.hpp"
#include "model/sampler.hpp"

namespace strata::actors {

using msg::step_mode;
using msg::step_reply;

namespace {

caf::error to_caf(const model::Error& e) {
  const auto code = e.code() == model::errc::bad_shape || e.code() == model::errc::bad_position ? ec::bad_shape
                                                                                                  : ec::model_error;
  return caf::make_error(code, std::string(e.what()));
}

} // namespace

msg::shard_stats shard_state::stats() const {
  msg::shard_stats s;
  s.first = shard->range().first;
  s.last = shard->range().last;
  s.cache_bytes = store->bytes();
  s.sessions = store->sessions();
  const auto& c = store->counters();
  s.hits = c.hits;
  s.misses.assign(std::begin(c.misses), std::end(c.misses));
  s.evictions = c.evictions_lru + c.evictions_ttl;
  s.steps = steps;
  s.duplicates = duplicates;
  s.conflicts = c.conflicts;
  s.orphans = c.orphans;
  return s;
}

void shard_state::adopt(self_ptr self, const std::string& session) {
  const auto& sender = self->current_sender();
  if (!sender || sender == self->ctrl())
    return; // an anonymous or injected step: the lease alone covers it
  disown(session); // a re-opened session is filed once, under its newest opener
  auto [it, fresh] = owned.try_emplace(caf::actor_cast<caf::actor_addr>(sender));
  if (fresh)
    self->monitor(sender);
  it->second.insert(session);
}

void shard_state::disown(const std::string& session) {
  for (auto& entry : owned)
    entry.second.erase(session);
}

caf::result<step_reply> shard_state::handle(self_ptr self, msg::step_request& req) {
  const auto range = shard->range();
  // Validate before touching any state.
  if (req.recipe != recipe)
    return caf::make_error(ec::incompatible_recipe, "request for model '" + req.recipe.model + "' (" +
                                                      req.recipe.architecture + ", " + std::to_string(req.recipe.n_layers) +
                                                      " layers) but this shard serves '" + recipe.model + "' (" +
                                                      recipe.architecture + ", " + std::to_string(recipe.n_layers) +
                                                      " layers)");
  if (req.hop_index >= req.route.size() || req.route[req.hop_index].first != range.first ||
      req.route[req.hop_index].last != range.last)
    return caf::make_error(ec::incompatible_recipe, "hop " + std::to_string(req.hop_index) +
                                                      " of the route does not name this shard's layers " +
                                                      std::to_string(range.first) + "-" + std::to_string(range.last));
  if (req.mode > 1)
    return caf::make_error(ec::bad_request, "unknown step mode " + std::to_string(req.mode));
  if (req.key.empty())
    return caf::make_error(ec::bad_request, "step for session '" + req.session + "' carries no session key");
  const auto& lim = request_limits;
  if (static_cast<int64_t>(std::max(req.tokens.size(), req.positions.size())) > lim.max_step_tokens)
    return caf::make_error(ec::bad_request, "step carries " + std::to_string(std::max(req.tokens.size(), req.positions.size())) +
                                              " tokens; this node accepts at most " + std::to_string(lim.max_step_tokens) +
                                              " per step (--max-prompt)");
  const std::size_t bytes = req.tokens.size() * sizeof(int32_t) + req.positions.size() * sizeof(int64_t) +
                            req.hidden.bytes.size() + req.session.size();
  if (bytes > lim.max_message_bytes)
    return caf::make_error(ec::bad_request, "step message carries " + std::to_string(bytes) +
                                              " bytes; this node accepts at most " + std::to_string(lim.max_message_bytes) +
                                              " (--max-message-bytes)");
  const bool head = range.first == 0;
  const auto T = static_cast<int64_t>(req.positions.size());
  if (T == 0 || (head && static_cast<int64_t>(req.tokens.size()) != T))
    return caf::make_error(ec::bad_shape, "step carries " + std::to_string(req.tokens.size()) + " tokens and " +
                                            std::to_string(T) + " positions");
  if (req.past_len < 0 || req.positions.front() != req.past_len)
    return caf::make_error(ec::bad_request, "positions must start at past_len " + std::to_string(req.past_len));
  const auto mode = static_cast<step_mode>(req.mode);
  if (mode == step_mode::prefill && req.past_len != 0)
    return caf::make_error(ec::bad_request, "a prefill must start at position 0");

  // Failure injection hooks.
  if (desync_next) {
    desync_next = false;
    req.past_len += 1;
  }
  if (dup_next && mode == step_mode::decode) {
    dup_next = false;
    // The same step once more; its answer comes back here and is dropped.
    self->request(caf::actor_cast<msg::shard_actor>(self), std::chrono::minutes(1), req).then([](const step_reply&) {}, [](caf::error&) {});
  }

  SessionCacheStore::Lookup found =
    mode == step_mode::prefill ? store->open(req.session, req.key, req.epoch)
                               : store->find(req.session, req.key, req.epoch, req.past_len, req.step_id);
  if (found.err)
    return std::move(found.err);
  if (mode == step_mode::prefill && found.ctx)
    adopt(self, req.session);
  if (found.ctx == nullptr) {
    step_reply miss;
    miss.session = req.session;
    miss.epoch = req.epoch;
    miss.step_id = req.step_id;
    miss.kind = static_cast<uint8_t>(msg::reply_kind::cache_miss);
    miss.miss = static_cast<uint8_t>(found.miss);
    miss.miss_hop = req.hop_index;
    miss.detail = found.detail;
    return miss;
  }
  auto& ctx = *found.ctx;
  const bool tail = range.last == recipe.n_layers - 1;
  if (found.duplicate) {
    // Already applied: never advance the cache twice; answer as the first time.
    ++duplicates;
    if (tail)
      return ctx.replay_reply;
    auto next = req;
    next.tokens.clear();
    next.hidden = ctx.replay_hidden;
    next.hop_index += 1;
    auto rp = self->make_response_promise<step_reply>();
    rp.delegate(next.route[next.hop_index].shard, std::move(next));
    return rp;
  }
  if (auto err = store->reserve(ctx, req.past_len + T))
    return err;
  model::ShardOutput out;
  try {
    if (head) {
      out = shard->forward(req.tokens, req.positions, ctx.cache);
    } else {
      out = shard->forward(req.hidden.to_activation(), req.positions, ctx.cache);
    }
  } catch (const model::Error& e) {
    return to_caf(e);
  }
  ++steps;
  store->committed(ctx, req.step_id, req.past_len);
  if (tail) {
    model::Sampler sampler({req.sampling.temperature, req.sampling.top_k, req.sampling.top_p, 0, req.sampling.min_p});
    sampler.set_state(req.sampling.rng_state);
    step_reply r;
    r.session = req.session;
    r.epoch = req.epoch;
    r.step_id = req.step_id;
    r.kind = static_cast<uint8_t>(msg::reply_kind::token);
    r.token = sampler.sample(out.logits);
    r.rng_state = sampler.state();
    ctx.replay_reply = r;
    return r;
  }
  auto next = std::move(req);
  next.tokens.clear();
  next.hidden = msg::tensor_blob::from(out.hidden);
  next.hop_index += 1;
  ctx.replay_hidden = next.hidden;
  if (next.hop_index >= next.route.size())
    return caf::make_error(ec::bad_request, "the route ends before the tail shard");
  auto rp = self->make_response_promise<step_reply>();
  rp.delegate(next.route[next.hop_index].shard, std::move(next));
  return rp;
}

shard_impl_actor::behavior_type shard_actor(shard_state::self_ptr self, std::shared_ptr<model::Shard> shard,
                                            StoreLimits limits, ShardHooks hooks, RequestLimits request_limits,
                                            std::chrono::milliseconds lease_period) {
  auto& st = self->state;
  st.hooks = std::move(hooks);
  st.request_limits = request_limits;
  if (st.request_limits.max_step_tokens <= 0)
    st.request_limits.max_step_tokens = shard->config().max_seq_len;
  st.shard = shard;
  st.recipe = msg::cache_recipe::of(shard->config());
  st.store = std::make_unique<SessionCacheStore>(limits, [shard] { return shard->new_cache(); });
  st.lease_period = lease_period;
  // An owner that went down (its process died, or it ended without releasing):
  // drop its sessions now.
  self->set_down_handler([=](caf::down_msg& dm) {
    auto& st = self->state;
    auto it = st.owned.find(dm.source);
    if (it == st.owned.end())
      return;
    for (auto& session : it->second)
      st.store->orphan(session);
    st.owned.erase(it);
  });
  if (limits.lease_missed > 0)
    self->delayed_send(self, lease_period, atom::tick_atom_v);
  return {
    [=](msg::step_request& req) -> caf::result<step_reply> {
      try {
        return self->state.handle(self, req);
      } catch (const std::exception& e) { // nothing escapes a handler
        return caf::make_error(ec::model_error, std::string("shard failed on this step: ") + e.what());
      }
    },
    [=](atom::release_atom, const std::string& session, const msg::session_key& key) {
      auto& st = self->state;
      if (!st.store->release(session, key)) // a refused one (another owner's id) is counted in conflicts
        st.disown(session);
    },
    [=](atom::lease_atom, const std::string& session, const msg::session_key& key) {
      self->state.store->renew(session, key);
    },
    [=](atom::stats_atom) { return self->state.stats(); },
    [=](atom::tick_atom) {
      // One lease period: contexts nobody renewed for lease_missed periods are orphans.
      auto& st = self->state;
      for (auto& session : st.store->lease_sweep())
        st.disown(session);
      self->delayed_send(self, st.lease_period, atom::tick_atom_v);
    },
    [=](atom::evict_atom, const std::string& session, uint8_t reason) {
      if (reason == 0)
        reason = static_cast<uint8_t>(msg::miss_reason::evicted_lru);
      if (reason >= msg::miss_reason_count)
        return;
      if (session.empty())
        self->state.store->evict_all(static_cast<msg::miss_reason>(reason));
      else if (static_cast<msg::miss_reason>(reason) == msg::miss_reason::unknown_session)
        self->state.store->forget(session);
      else
        self->state.store->evict(session, static_cast<msg::miss_reason>(reason));
    },
    [=](atom::desync_atom) { self->state.desync_next = true; },
    [=](atom::dup_atom) { self->state.dup_next = true; },
    [=](atom::crash_atom) -> caf::result<void> {
      if (!self->state.hooks.crash)
        return caf::make_error(ec::bad_request, "crash injection needs a node process");
      self->state.hooks.crash();
      return caf::unit;
    },
    [=](atom::freeze_atom, int64_t ms) -> caf::result<void> {
      if (!self->state.hooks.freeze)
        return caf::make_error(ec::bad_request, "freeze injection needs a node process");
      self->state.hooks.freeze(ms);
      return caf::unit;
    },
  };
}

msg::shard_full_actor spawn_shard(caf::actor_system& sys, std::shared_ptr<model::Shard> shard, StoreLimits limits,
                                  ShardHooks hooks, RequestLimits request_limits, std::chrono::milliseconds lease_period) {
  return sys.spawn<caf::detached>(shard_actor, std::move(shard), limits, std::move(hooks), request_limits,
                                  lease_period);
}

} // namespace strata::actors
