#include "actors/shard_actor.hpp"

#include "model/base/error.hpp"
#include "model/transformer/math_thread.hpp"
#include "model/transformer/sampler.hpp"

#include <cstring>
#include <optional>

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
  s.pool_blocks = static_cast<uint64_t>(pool->capacity());
  s.pool_used = static_cast<uint64_t>(pool->in_use());
  s.block_bytes = pool->block_bytes();
  s.kv_dtype = model::to_string(pool->shape().kv_type);
  s.kernels = model::kernel_builds();
  s.kv_bytes_per_token = model::BlockPool::kv_bytes_per_token(pool->shape());
  s.kept_bytes_per_token = model::BlockPool::out_bytes_per_token(pool->shape());
  s.queued = scheduler->queued();
  s.rounds = rounds;
  s.batched_rows = batched_rows;
  s.max_batch = max_batch;
  s.overloaded = overloaded;
  s.computed = computed;
  s.recomputed = recomputed;
  s.prefix_hit_tokens = c.prefix_hit_tokens;
  s.rolled_back = c.rolled_back;
  s.prefix_blocks = static_cast<uint64_t>(pool->published());
  s.prefix_cached = static_cast<uint64_t>(pool->cached());
  if (const auto* lp = pool->local()) {
    s.window_used = static_cast<uint64_t>(lp->in_use());
    s.window_block_bytes = lp->block_bytes();
  }
  return s;
}

void shard_state::adopt(self_ptr self, const caf::strong_actor_ptr& owner, const std::string& session) {
  if (!owner || owner == self->ctrl())
    return; // an anonymous or injected step: the lease alone covers it
  disown(session); // a re-opened session is filed once, under its newest opener
  auto [it, fresh] = owned.try_emplace(caf::actor_cast<caf::actor_addr>(owner));
  if (fresh)
    self->monitor(owner);
  it->second.insert(session);
}

caf::result<void> shard_state::inject_next(std::set<std::string>& set, const std::string& session,
                                           const char* what) {
  constexpr std::size_t max_id = 1024;
  if (session.empty() || session.size() > max_id)
    return caf::make_error(ec::bad_request, std::string(what) + " injection needs a session id of 1-" +
                                              std::to_string(max_id) + " bytes, not " + std::to_string(session.size()));
  if (set.size() >= max_injected && !set.count(session))
    return caf::make_error(ec::overloaded, std::string(what) + " injection: " + std::to_string(max_injected) +
                                             " sessions are already waiting for one");
  set.insert(session);
  return caf::unit;
}

void shard_state::disown(const std::string& session) {
  for (auto& entry : owned)
    entry.second.erase(session);
}

namespace {

step_reply miss_reply(const msg::step_request& req, const SessionCacheStore::Lookup& found) {
  step_reply miss;
  miss.session = req.session;
  miss.epoch = req.epoch;
  miss.step_id = req.step_id;
  miss.kind = static_cast<uint8_t>(msg::reply_kind::cache_miss);
  miss.miss = static_cast<uint8_t>(found.miss);
  miss.miss_hop = req.hop_index;
  miss.detail = found.detail;
  miss.recomputed = req.recomputed; // what hops before this one rebuilt on the way
  return miss;
}

// Node ids print as HOST-HASH#PID: the same hash is the same machine.
bool same_host(const caf::node_id& a, const caf::node_id& b) {
  if (a == b)
    return true;
  const auto x = caf::to_string(a), y = caf::to_string(b);
  const auto i = x.find('#'), j = y.find('#');
  return i != std::string::npos && j != std::string::npos && x.compare(0, i, y, 0, j) == 0;
}

} // namespace

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
  const bool tail = range.last == recipe.n_layers - 1;
  if (!tail && req.hop_index + 1 >= req.route.size())
    return caf::make_error(ec::bad_request, "the route ends before the tail shard");
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
  if (req.prompt_logprobs < -1 || req.prompt_logprobs > 20 ||
      (req.prompt_logprobs >= 0 && (req.mode != static_cast<uint8_t>(step_mode::prefill) || req.draft > 0)))
    return caf::make_error(ec::bad_request, "prompt_logprobs " + std::to_string(req.prompt_logprobs) +
                                              " must be -1, or 0-20 on a prefill without proposals");
  // Later hops see only the proposals' ids (the tail verifies them), or every
  // token of a prefill that asks for prompt log-probabilities (the tail scores them).
  if (!head && req.tokens.size() != (req.prompt_logprobs >= 0 ? static_cast<std::size_t>(T) : req.draft))
    return caf::make_error(ec::bad_shape, "a step past the head carries " + std::to_string(req.tokens.size()) +
                                            " token ids for " + std::to_string(req.draft) + " proposals" +
                                            (req.prompt_logprobs >= 0 ? " and " + std::to_string(T) + " scored rows" : ""));
  if (!head) // the proposals' ids (the head's forward pass checks its own tokens)
    for (auto id : req.tokens)
      if (id < 0 || id >= shard->config().vocab_size)
        return caf::make_error(ec::bad_request, "token id " + std::to_string(id) + " is outside the vocabulary of " +
                                                  std::to_string(shard->config().vocab_size));
  if (req.draft > msg::max_draft || static_cast<int64_t>(req.draft) >= T)
    return caf::make_error(ec::bad_request, "step proposes " + std::to_string(req.draft) + " tokens in " +
                                              std::to_string(T) + " rows (at most " + std::to_string(msg::max_draft) +
                                              ", and fewer than the rows)");
  if (req.draft > 0 && (req.sampling.penalized() || req.sampling.logprobs >= 0 || req.sampling.constrained()))
    return caf::make_error(ec::bad_request,
                           "a speculative step carries no penalties or allowed tokens and asks no logprobs");
  const auto mode = static_cast<step_mode>(req.mode);
  if (mode == step_mode::prefill && req.past_len != 0)
    return caf::make_error(ec::bad_request, "a prefill must start at position 0");
  if ((req.rebuild != 0 && req.route.size() > msg::max_route_hops) ||
      (req.route.size() < msg::max_route_hops && (req.rebuild >> req.route.size()) != 0))
    return caf::make_error(ec::bad_request, "the rebuild mask names hops past the route's " +
                                              std::to_string(req.route.size()) + " (at most " +
                                              std::to_string(msg::max_route_hops) + " hops)");
  // A rebuilt hop gets its rows from position 0, a kept one from past_len.
  const bool rebuilt = mode == step_mode::prefill || (req.hop_index < 64 && ((req.rebuild >> req.hop_index) & 1u) != 0);
  const int64_t from = rebuilt ? 0 : req.past_len;
  if (req.past_len < 0 || req.positions.front() != from)
    return caf::make_error(ec::bad_request, "positions must start at " + std::string(rebuilt ? "0 on a hop that rebuilds" : "past_len ") +
                                              (rebuilt ? "" : std::to_string(req.past_len)));
  for (int64_t i = 1; i < T; ++i)
    if (req.positions[static_cast<std::size_t>(i)] != from + i)
      return caf::make_error(ec::bad_shape, "positions must be consecutive from " + std::to_string(from) + "; index " +
                                              std::to_string(i) + " holds " +
                                              std::to_string(req.positions[static_cast<std::size_t>(i)]));
  if (from + T <= req.past_len)
    return caf::make_error(ec::bad_request, "a rebuild must reach past past_len " + std::to_string(req.past_len) +
                                              " (it ends at " + std::to_string(from + T) + ")");
  if (req.blocks.size() % 2 != 0 || req.blocks_from < 0 ||
      (req.blocks_from + static_cast<int64_t>(req.blocks.size() / 2)) * model::BlockPool::block_tokens > from + T)
    return caf::make_error(ec::bad_request, "the step names block ids past its " + std::to_string(from + T) +
                                              " positions");
  QueuedStep q;
  q.rows = T;
  q.from = from;
  q.rebuilt = rebuilt;
  // An injected duplicate is a copy of the request as it came (its hidden state
  // is moved out below).
  std::optional<msg::step_request> dup_copy;
  if (mode == step_mode::decode && dup_next.count(req.session) != 0)
    dup_copy = req;
  if (!head) {
    try {
      auto a = req.hidden.to_activation();
      if (a.rows != T || a.cols != shard->config().dim)
        return caf::make_error(ec::bad_shape, "hidden state of shape [" + std::to_string(a.rows) + ", " +
                                                std::to_string(a.cols) + "] does not fit " + std::to_string(T) +
                                                " positions of dim " + std::to_string(shard->config().dim));
      q.hidden = std::move(a.data);
    } catch (const model::Error& e) {
      return to_caf(e);
    }
    req.hidden = {};
  }
  if (scheduler->full()) {
    ++overloaded;
    return caf::make_error(ec::overloaded, "shard " + std::to_string(range.first) + "-" + std::to_string(range.last) +
                                             " has " + std::to_string(scheduler->queued()) +
                                             " steps waiting (the most it queues); retry later");
  }

  // Failure injection hooks.
  if (!rebuilt && desync_next.erase(req.session) > 0) {
    req.past_len += 1;
    q.from += 1;
  }
  if (dup_copy) {
    dup_next.erase(req.session);
    // The same step once more; its answer comes back here and is dropped.
    self->request(caf::actor_cast<msg::shard_actor>(self), std::chrono::minutes(1), std::move(*dup_copy))
      .then([](const step_reply&) {}, [](caf::error&) {});
  }

  if (req.epoch != colocated_epoch) { // a route is fixed per epoch: look at its hops once
    colocated_epoch = req.epoch;
    colocated = scheduler->limits().detect_colocation && req.route.size() > 1 && std::all_of(req.route.begin(), req.route.end(), [&](const msg::hop& h) {
                  return h.shard && same_host(h.shard.node(), self->node());
                });
  }
  if (auto it = expected.find(req.session); it != expected.end()) {
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - it->second).count();
    return_ms = return_ms < 0 ? ms : 0.8 * return_ms + 0.2 * ms;
    expected.erase(it);
  }
  q.owner = self->current_sender();
  q.req = std::move(req);
  q.promise = self->make_response_promise<step_reply>();
  auto rp = q.promise;
  scheduler->push(std::move(q));
  schedule_round(self);
  return rp;
}

void shard_state::start_early(self_ptr self) {
  if (round_delayed && expected.empty()) { // nobody left to wait for: no need to wait out the timer
    round_delayed = false;
    self->send(self, atom::round_atom_v, round_id);
  }
}

void shard_state::not_coming_back(self_ptr self, const std::string& session) {
  if (expected.erase(session) != 0)
    start_early(self);
}

void shard_state::schedule_round(self_ptr self) {
  if (round_pending)
    return start_early(self);
  round_pending = true;
  ++round_id;
  // Sessions answered last round are still out: wait a little for them, so a
  // batch that left together is run together. A round starts early once all of
  // them are here. How long:
  // * they come back within a fifth of a round (one shard): up to that;
  // * every hop of their route runs on this machine (processes or actors that
  //   share its cores) and this is the head: up to 1.5 times the time they take
  //   to come back, so the batch moves through the pipeline in lockstep instead
  //   of splitting into groups whose rounds compete for the same cores. Only the
  //   head waits that long: the batch it forms reaches every later hop as one
  //   burst, and a later hop that also waited could wait for a session that is
  //   itself held upstream by a round waiting for a session held here (groups
  //   then take turns, each round waiting out the other: measured 600 ms between
  //   tokens instead of 120 with 2 sessions on 3 processes);
  // * otherwise (a later hop, or a pipeline across machines, whose stages should
  //   overlap): up to the gather window, for the burst of messages a batch arrives as.
  if (!expected.empty()) {
    double wait_ms = std::min(static_cast<double>(scheduler->limits().gather.count()) / 1000.0, 0.2 * round_ms);
    if (return_ms >= 0 && return_ms < 0.2 * round_ms)
      wait_ms = std::min(std::max(2 * return_ms, 0.2), 0.2 * round_ms);
    else if (colocated && return_ms >= 0 && shard->range().first == 0)
      wait_ms = std::min(1.5 * return_ms, 5000.0);
    if (wait_ms > 0) {
      self->delayed_send(self, std::chrono::microseconds(static_cast<int64_t>(wait_ms * 1000)), atom::round_atom_v,
                         round_id);
      round_delayed = true;
      return;
    }
  }
  self->send(self, atom::round_atom_v, round_id);
}

void shard_state::round(self_ptr self) {
  round_pending = false;
  round_delayed = false;
  expected.clear();
  const auto range = shard->range();
  const bool head = range.first == 0;
  const bool tail = range.last == recipe.n_layers - 1;
  const int64_t dim = shard->config().dim;
  const auto layers = static_cast<uint64_t>(range.count());
  struct Active {
    StepScheduler::Piece piece;
    SessionCacheStore::Context* ctx;
  };
  std::vector<Active> active;
  auto pinned = [&](const SessionCacheStore::Context& c) {
    return std::any_of(active.begin(), active.end(), [&](const Active& a) { return a.ctx == &c; });
  };
  // Per sequence, exactly what a lone step gets: lookups, misses, duplicates.
  for (auto piece : scheduler->pick()) {
    auto& q = *piece.step;
    auto& req = q.req;
    const bool opening = piece.begin == 0 && q.rebuilt;
    auto found = opening ? store->open(req.session, req.key, req.epoch, req.step_id, pinned)
                         : store->find(req.session, req.key, req.epoch, q.from + piece.begin,
                                       piece.begin == 0 ? req.step_id : -1);
    if (found.err) {
      q.promise.deliver(std::move(found.err));
      scheduler->erase(piece.step);
      continue;
    }
    if (found.ctx == nullptr) {
      q.promise.deliver(miss_reply(req, found));
      scheduler->erase(piece.step);
      continue;
    }
    if (found.duplicate) {
      // Already applied: never advance the cache twice; answer as the first time.
      ++duplicates;
      if (tail) {
        auto r = found.ctx->replay_reply;
        r.recomputed = req.recomputed;
        q.promise.deliver(std::move(r));
      } else {
        pass_on(q, *found.ctx);
      }
      scheduler->erase(piece.step);
      continue;
    }
    if (opening) {
      adopt(self, q.owner, req.session);
      // The prefix cache: the block ids of this sequence, then the longest run of
      // them already published here (always leaving the last row to compute).
      auto& ctx = *found.ctx;
      const int64_t L = q.from + q.rows;
      // (With the prefix cache off there are no ids to make, learn or publish.)
      if (head && pool->prefix_cache()) {
        ctx.tokens.assign(req.tokens.begin(), req.tokens.end());
        prefix_ids->extend(ctx.ids, ctx.tokens);
      } else if (!head && pool->prefix_cache() && req.blocks_from == 0) {
        for (std::size_t i = 0; i + 1 < req.blocks.size(); i += 2)
          ctx.ids.push_back(model::BlockId{req.blocks[i], req.blocks[i + 1]});
      }
      // (Only blocks wholly before a speculative step's proposals: rows that may
      // be cut back must never lie in a shared block.)
      // (Nor on a tail that scores the prompt: it needs every row's logits.)
      const int64_t skip =
        store->share_prefix(ctx, tail && req.prompt_logprobs >= 0 ? 0 : L - 1 - static_cast<int64_t>(req.draft));
      if (skip > 0) {
        q.done = skip;
        piece.begin = skip;
        piece.end = scheduler->piece_end(q, skip);
      }
    }
    active.push_back(Active{piece, found.ctx});
  }
  // Blocks for every sequence; pinned ones are never evicted for another.
  for (auto it = active.begin(); it != active.end();) {
    auto& q = *it->piece.step;
    auto err = store->reserve(*it->ctx, q.from + it->piece.end,
                              [&](const SessionCacheStore::Context& c) { return &c != it->ctx && pinned(c); });
    if (err == ec::overloaded) {
      it = active.erase(it); // stays queued: next round, when the others are done
      continue;
    }
    if (err) {
      q.promise.deliver(std::move(err));
      scheduler->erase(it->piece.step);
      it = active.erase(it);
      continue;
    }
    ++it;
  }
  if (!active.empty()) {
    std::vector<model::SeqStep> batch(active.size());
    for (std::size_t i = 0; i < active.size(); ++i) {
      auto& [piece, ctx] = active[i];
      auto& q = *piece.step;
      const auto n = static_cast<std::size_t>(piece.end - piece.begin);
      auto& st = batch[i];
      if (head)
        st.tokens = std::span<const int32_t>(q.req.tokens).subspan(static_cast<std::size_t>(piece.begin), n);
      else {
        st.hidden = q.hidden.data() + piece.begin * dim;
        st.rows = piece.end - piece.begin;
      }
      st.positions = std::span<const int64_t>(q.req.positions).subspan(static_cast<std::size_t>(piece.begin), n);
      st.cache = &ctx->cache;
      // The tail only needs the logits of the last row; other shards keep their
      // output rows in the cache blocks and pass them on from there.
      st.emit = tail && piece.last();
      st.logit_rows = static_cast<int64_t>(q.req.draft) + 1; // the scheduler keeps them in the last piece
      if (tail && q.req.prompt_logprobs >= 0) { // row i scores token i + 1 of the prompt
        if (q.row_targets.empty()) {
          q.row_targets.assign(q.req.tokens.begin() + 1, q.req.tokens.end());
          q.row_targets.push_back(-1);
        }
        st.row_targets = std::span<const int32_t>(q.row_targets).subspan(static_cast<std::size_t>(piece.begin), n);
        st.row_top = q.req.prompt_logprobs;
      }
      batched_rows += n;
    }
    ++rounds;
    max_batch = std::max<uint64_t>(max_batch, active.size());
    std::vector<model::SeqOutcome> outs;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      outs = model::run_math([&] { return shard->forward(batch); });
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      round_ms = round_ms == 0 ? ms : 0.8 * round_ms + 0.2 * ms;
    } catch (const std::exception& e) { // nothing of the caches was committed
      for (auto& a : active) {
        a.piece.step->promise.deliver(caf::make_error(ec::model_error, std::string("shard failed on this step: ") + e.what()));
        scheduler->erase(a.piece.step);
      }
      active.clear();
    }
    for (std::size_t i = 0; i < active.size(); ++i) {
      auto& [piece, ctx] = active[i];
      auto& q = *piece.step;
      auto& res = outs[i];
      if (res.error) {
        q.promise.deliver(to_caf(*res.error));
        scheduler->erase(piece.step);
        continue;
      }
      q.done = piece.end;
      if (!res.out.row_logprobs.empty()) { // prompt log-probabilities of this piece's rows
        q.prompt_logprobs.insert(q.prompt_logprobs.end(), res.out.row_logprobs.begin(), res.out.row_logprobs.end());
        q.prompt_top_ids.insert(q.prompt_top_ids.end(), res.out.row_top_ids.begin(), res.out.row_top_ids.end());
        q.prompt_top_logprobs.insert(q.prompt_top_logprobs.end(), res.out.row_top_logprobs.begin(),
                                     res.out.row_top_logprobs.end());
      }
      {
        // Work done, and the part of it that recomputed positions a lost cache held.
        const int64_t p0 = q.from + piece.begin, p1 = q.from + piece.end;
        computed += static_cast<uint64_t>(p1 - p0) * layers;
        if (q.rebuilt && q.req.mode != static_cast<uint8_t>(step_mode::prefill))
          q.recomputed += static_cast<uint64_t>(std::max<int64_t>(0, std::min(p1, q.req.past_len) - p0)) * layers;
      }
      if (!piece.last())
        continue; // more pieces in later rounds
      ++steps;
      if (pool->prefix_cache() && !q.rebuilt) { // ids of newly full blocks (a rebuilt context made all at opening)
        if (head) { // the head knows every token of the sequence
          ctx->tokens.resize(static_cast<std::size_t>(q.from));
          ctx->tokens.insert(ctx->tokens.end(), q.req.tokens.begin(), q.req.tokens.end());
          prefix_ids->extend(ctx->ids, ctx->tokens);
        } else {
          for (std::size_t k = 0; k + 1 < q.req.blocks.size(); k += 2)
            if (static_cast<std::size_t>(q.req.blocks_from) + k / 2 == ctx->ids.size())
              ctx->ids.push_back(model::BlockId{q.req.blocks[k], q.req.blocks[k + 1]});
        }
      }
      store->committed(*ctx, q.req.step_id, q.req.past_len, static_cast<int64_t>(q.req.draft));
      recomputed += q.recomputed;
      q.req.recomputed += q.recomputed;
      expected.emplace(q.req.session, std::chrono::steady_clock::now());
      if (tail) {
        model::Sampler sampler(
          {q.req.sampling.temperature, q.req.sampling.top_k, q.req.sampling.top_p, 0, q.req.sampling.min_p});
        sampler.set_state(q.req.sampling.rng_state);
        step_reply r;
        r.session = q.req.session;
        r.epoch = q.req.epoch;
        r.step_id = q.req.step_id;
        r.kind = static_cast<uint8_t>(msg::reply_kind::token);
        r.recomputed = q.req.recomputed;
        try {
          const auto& sp = q.req.sampling;
          const auto V = static_cast<std::size_t>(shard->config().vocab_size);
          const auto draft = static_cast<std::size_t>(q.req.draft);
          if (draft > 0) {
            // Verify the proposals row by row: row i's logits judge proposal i
            // (the token at row i + 1); the first one refused ends the run with
            // the model's own token, and if all pass, the last row gives one more.
            // (Every hop's request carries the proposals as the last `draft` tokens.)
            const auto& lg = res.out.logits;
            for (std::size_t i = 0; i <= draft; ++i) {
              std::span<const float> row(lg.data() + i * V, V);
              if (i == draft) {
                r.token = sampler.sample(row);
                break;
              }
              const int32_t proposed = q.req.tokens[q.req.tokens.size() - draft + i];
              const auto v = sampler.verify(row, proposed);
              if (!v.accepted) {
                r.token = v.token;
                break;
              }
              r.accepted.push_back(proposed);
            }
          } else if (sp.penalized() || sp.constrained()) {
            std::vector<float> logits(res.out.logits.begin(), res.out.logits.end());
            if (sp.penalized())
              model::apply_penalties(logits, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty,
                                     sp.penalty_ids, sp.penalty_counts);
            if (sp.constrained())
              model::apply_allowed(logits, sp.allowed_ids, sp.allowed_bits);
            r.token = sampler.sample(logits);
          } else {
            r.token = sampler.sample(res.out.logits);
          }
          if (sp.logprobs >= 0) { // the model's own distribution, before penalties and sampling settings
            auto lp = model::token_logprobs(res.out.logits, r.token, std::min<int32_t>(sp.logprobs, 20));
            r.logprob = lp.logprob;
            r.top_ids = std::move(lp.top_ids);
            r.top_logprobs = std::move(lp.top_logprobs);
          }
        } catch (const model::Error& e) {
          q.promise.deliver(to_caf(e));
          scheduler->erase(piece.step);
          continue;
        }
        r.rng_state = sampler.state();
        if (q.req.prompt_logprobs >= 0 && !q.prompt_logprobs.empty()) { // the last row scored nothing
          const auto k = static_cast<std::size_t>(q.req.prompt_logprobs);
          r.prompt_logprobs.assign(q.prompt_logprobs.begin(), q.prompt_logprobs.end() - 1);
          r.prompt_top_ids.assign(q.prompt_top_ids.begin(), q.prompt_top_ids.end() - static_cast<std::ptrdiff_t>(k));
          r.prompt_top_logprobs.assign(q.prompt_top_logprobs.begin(),
                                       q.prompt_top_logprobs.end() - static_cast<std::ptrdiff_t>(k));
        }
        ctx->replay_reply = r;
        q.promise.deliver(std::move(r));
      } else {
        pass_on(q, *ctx);
      }
      scheduler->erase(piece.step);
    }
  }
  if (!scheduler->empty() && !round_pending)
    schedule_round(self);
}

void shard_state::pass_on(QueuedStep& q, const SessionCacheStore::Context& ctx) {
  // The next hop gets rows from 0 when it rebuilds, else from past_len: both
  // read from the output rows this shard keeps in its blocks (so a hop after a
  // lost one is rebuilt without any recomputation up here).
  const auto& req = q.req;
  const auto next_hop_index = req.hop_index + 1;
  const bool next_rebuilds = req.mode == static_cast<uint8_t>(step_mode::prefill) ||
                             (next_hop_index < 64 && ((req.rebuild >> next_hop_index) & 1u) != 0);
  const int64_t L = ctx.cache.seq_len();
  const int64_t send_from = next_rebuilds ? 0 : req.past_len;
  const int64_t dim = shard->config().dim;
  msg::step_request next = req;
  if (next.tokens.size() > req.draft && req.prompt_logprobs < 0) // the proposals travel on to the tail, which verifies them
    next.tokens.erase(next.tokens.begin(), next.tokens.end() - static_cast<std::ptrdiff_t>(req.draft));
  next.hop_index = next_hop_index;
  next.positions = model::consecutive_positions(send_from, L - send_from);
  auto& blob = next.hidden;
  blob.dtype = 0;
  blob.shape = {L - send_from, dim};
  blob.bytes.resize(static_cast<std::size_t>((L - send_from) * dim) * sizeof(float));
  const auto view = ctx.cache.view();
  for (int64_t p = send_from; p < L; ++p)
    std::memcpy(blob.bytes.data() + static_cast<std::size_t>((p - send_from) * dim) * sizeof(float), view.out(p),
                static_cast<std::size_t>(dim) * sizeof(float));
  constexpr auto bt = model::BlockPool::block_tokens;
  next.blocks_from = send_from / bt;
  next.blocks = to_words(ctx.ids, static_cast<std::size_t>(next.blocks_from), static_cast<std::size_t>(L / bt));
  auto dest = next.route[next.hop_index].shard;
  q.promise.delegate(dest, std::move(next));
}

shard_impl_actor::behavior_type shard_actor(shard_state::self_ptr self, std::shared_ptr<model::Shard> shard,
                                            StoreLimits limits, ShardHooks hooks, RequestLimits request_limits,
                                            std::chrono::milliseconds lease_period, SchedulerLimits sched) {
  auto& st = self->state;
  st.hooks = std::move(hooks);
  st.request_limits = request_limits;
  if (st.request_limits.max_step_tokens <= 0)
    st.request_limits.max_step_tokens = shard->config().max_seq_len;
  st.shard = shard;
  st.recipe = msg::cache_recipe::of(shard->config());
  st.pool = shard->new_pool(limits.max_bytes);
  st.pool->set_prefix_cache(limits.prefix_cache);
  st.prefix_ids = std::make_unique<PrefixIds>(st.recipe);
  st.store = std::make_unique<SessionCacheStore>(limits, st.pool);
  st.scheduler = std::make_unique<StepScheduler>(sched);
  st.lease_period = lease_period;
  // An owner that went down (its process died, or it ended without releasing):
  // drop its sessions now.
  self->set_down_handler([=](caf::down_msg& dm) {
    auto& st = self->state;
    auto it = st.owned.find(dm.source);
    if (it == st.owned.end())
      return;
    for (auto& session : it->second) {
      st.store->orphan(session);
      st.not_coming_back(self, session);
    }
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
      st.desync_next.erase(session); // (injected on a replica its route never took)
      st.dup_next.erase(session);
      if (!st.store->release(session, key)) { // a refused one (another owner's id) is counted in conflicts
        st.disown(session);
        st.not_coming_back(self, session);
      }
    },
    [=](atom::lease_atom, const std::string& session, const msg::session_key& key) {
      self->state.store->renew(session, key);
    },
    [=](atom::stats_atom) { return self->state.stats(); },
    [=](atom::round_atom, uint64_t id) {
      if (!self->state.round_pending || id != self->state.round_id)
        return; // that round ran already (a timer and an early start both fire)
      try {
        self->state.round(self);
      } catch (const std::exception& e) { // nothing escapes a handler: fail what was queued
        auto& st = self->state;
        st.round_pending = false;
        while (!st.scheduler->empty()) {
          auto pieces = st.scheduler->pick();
          for (auto& p : pieces) {
            p.step->promise.deliver(caf::make_error(ec::model_error, std::string("shard round failed: ") + e.what()));
            st.scheduler->erase(p.step);
          }
        }
      }
    },
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
    [=](atom::desync_atom, const std::string& session) -> caf::result<void> {
      return self->state.inject_next(self->state.desync_next, session, "desync");
    },
    [=](atom::dup_atom, const std::string& session) -> caf::result<void> {
      return self->state.inject_next(self->state.dup_next, session, "dup");
    },
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
                                  ShardHooks hooks, RequestLimits request_limits, std::chrono::milliseconds lease_period,
                                  SchedulerLimits sched) {
  return sys.spawn<caf::detached>(shard_actor, std::move(shard), limits, std::move(hooks), request_limits,
                                  lease_period, sched);
}

} // namespace strata::actors
