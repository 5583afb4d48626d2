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
  return s;
}

caf::result<step_reply> shard_state::handle(caf::stateful_actor<shard_state>* self, msg::step_request& req) {
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
    self->send(self, req); // the same step once more; its answer comes back here and is dropped
  }

  SessionCacheStore::Lookup found =
    mode == step_mode::prefill ? store->open(req.session, req.epoch)
                               : store->find(req.session, req.epoch, req.past_len, req.step_id);
  if (found.err)
    return std::move(found.err);
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
    auto rp = self->make_response_promise();
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
    model::Sampler sampler({req.sampling.temperature, req.sampling.top_k, req.sampling.top_p, 0});
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
  auto rp = self->make_response_promise();
  rp.delegate(next.route[next.hop_index].shard, std::move(next));
  return rp;
}

caf::behavior shard_actor(caf::stateful_actor<shard_state>* self, std::shared_ptr<model::Shard> shard,
                          StoreLimits limits, ShardHooks hooks, RequestLimits request_limits) {
  auto& st = self->state;
  st.hooks = std::move(hooks);
  st.request_limits = request_limits;
  if (st.request_limits.max_step_tokens <= 0)
    st.request_limits.max_step_tokens = shard->config().max_seq_len;
  st.shard = shard;
  st.recipe = msg::cache_recipe::of(shard->config());
  st.store = std::make_unique<SessionCacheStore>(limits, [shard] { return shard->new_cache(); });
  return {
    [=](msg::step_request& req) -> caf::result<step_reply> { return self->state.handle(self, req); },
    [=](const step_reply&) {
      // The answer to an injected duplicate: nothing to do.
    },
    [=](atom::release_atom, const std::string& session) { self->state.store->release(session); },
    [=](atom::stats_atom) { return self->state.stats(); },
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

caf::actor spawn_shard(caf::actor_system& sys, std::shared_ptr<model::Shard> shard, StoreLimits limits,
                       ShardHooks hooks, RequestLimits request_limits) {
  return sys.spawn<caf::detached>(shard_actor, std::move(shard), limits, std::move(hooks), request_limits);
}

} // namespace strata::actors
