#include "actors/supervisor.hpp"

#include <algorithm>
#include <functional>

namespace strata::actors {

msg::route_info supervisor_state::plan_for(const caf::actor_addr& session, const std::vector<msg::shard_actor>& avoid,
                                           bool sticky) {
  auto it = sticky ? given.find(session) : given.end();
  const bool subscribed =
    std::any_of(sessions.begin(), sessions.end(), [&](const msg::session_actor& s) { return s.address() == session; });
  auto r = plan(true, avoid, it == given.end() ? std::vector<msg::shard_actor>{} : it->second);
  if (subscribed && !r.hops.empty()) {
    auto& g = given[session];
    g.clear();
    for (auto& h : r.hops)
      g.push_back(h.shard);
  }
  return r;
}

msg::route_info supervisor_state::plan(bool count_load, const std::vector<msg::shard_actor>& avoid,
                                       const std::vector<msg::shard_actor>& prefer) {
  msg::route_info r;
  r.epoch = epoch;
  if (!recipe)
    return r;
  r.recipe = *recipe;
  const int64_t n = recipe->n_layers;
  // Depth-first over shards starting where the previous one ended, trying the
  // least-loaded candidates first.
  std::vector<std::size_t> chain;
  bool allow_avoided = false;
  auto avoided = [&](const msg::shard_actor& a) { return std::find(avoid.begin(), avoid.end(), a) != avoid.end(); };
  std::function<bool(int64_t)> dfs = [&](int64_t layer) -> bool {
    if (layer == n)
      return true;
    std::vector<std::size_t> cands;
    for (std::size_t i = 0; i < shards.size(); ++i)
      if (shards[i].first == layer && (allow_avoided || !avoided(shards[i].actor)))
        cands.push_back(i);
    auto preferred = [&](std::size_t i) {
      return std::find(prefer.begin(), prefer.end(), shards[i].actor) != prefer.end();
    };
    std::stable_sort(cands.begin(), cands.end(), [&](auto a, auto b) {
      const bool pa = preferred(a), pb = preferred(b);
      return pa != pb ? pa : shards[a].load < shards[b].load;
    });
    for (auto i : cands) {
      chain.push_back(i);
      if (dfs(shards[i].last + 1))
        return true;
      chain.pop_back();
    }
    return false;
  };
  if (!dfs(0)) {
    if (avoid.empty())
      return r;
    allow_avoided = true; // better a shard the caller doubts than no route
    chain.clear();
    if (!dfs(0))
      return r;
  }
  for (auto i : chain) {
    if (count_load)
      ++shards[i].load;
    r.hops.push_back(msg::hop{shards[i].actor, shards[i].first, shards[i].last});
    r.addresses.push_back(shards[i].address);
  }
  return r;
}

namespace {

std::string describe(const msg::route_info& r, int64_t n_layers) {
  if (r.hops.empty())
    return "no complete route covers layers 0-" + std::to_string(n_layers - 1);
  std::string out;
  for (std::size_t i = 0; i < r.hops.size(); ++i)
    out += (i ? ", " : "") + std::to_string(r.hops[i].first) + "-" + std::to_string(r.hops[i].last) + " on " +
           caf::to_string(r.hops[i].shard.node()) +
           (i < r.addresses.size() && !r.addresses[i].empty() ? " (" + r.addresses[i] + ")" : "");
  return out;
}

int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
    .count();
}

} // namespace

template <class Self>
void supervisor_state::changed(Self* self, const std::string& why) {
  ++epoch;
  const auto now = plan(false);
  if (opts.log)
    say(2, "epoch " + std::to_string(epoch) + " (" + why + "): route " + describe(now, recipe ? recipe->n_layers : 0));
  // Sessions learn the new epoch and route (or that none is complete now).
  for (auto& s : sessions)
    self->send(s, plan_for(s.address()));
  if (!now.hops.empty()) { // (load counting changes which replicas, not whether a route exists)
    for (auto& w : waiting)
      w.rp.deliver(plan_for(w.who, {}, false));
    waiting.clear();
  }
}

namespace {

using self_ptr = supervisor_impl_actor::stateful_pointer<supervisor_state>;

caf::result<msg::route_info> route_request(self_ptr self, const std::vector<msg::shard_actor>& avoid) {
  auto& st = self->state;
  auto r = st.plan_for(caf::actor_cast<caf::actor_addr>(self->current_sender()), avoid, false);
  if (!r.hops.empty())
    return r;
  auto rp = self->make_response_promise<msg::route_info>();
  st.waiting.push_back({rp, self->clock().now() + st.opts.route_wait, // the actor clock: testable
                        caf::actor_cast<caf::actor_addr>(self->current_sender())});
  self->delayed_send(self, st.opts.route_wait, atom::tick_atom_v);
  return rp;
}

} // namespace

supervisor_impl_actor::behavior_type supervisor(self_ptr self, SupervisorOptions opts) {
  self->state.opts = opts;
  self->state.epoch = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count() *
                      1000;
  self->set_down_handler([=](caf::down_msg& dm) {
    auto& st = self->state;
    auto it = std::find_if(st.shards.begin(), st.shards.end(), [&](auto& e) { return e.actor.address() == dm.source; });
    if (it != st.shards.end()) {
      // Silent for longer than a heartbeat period: the node froze or was cut
      // off (its process may live on); otherwise its connection went away.
      const auto silent =
        std::chrono::duration_cast<std::chrono::milliseconds>(self->clock().now() - it->last_seen).count();
      const std::string reason = silent > 1000 ? "heartbeat timeout: silent for " + std::to_string(silent) + " ms"
                                               : "connection lost (" + self->system().render(dm.reason) + ")";
      st.say(3, "shard node " + caf::to_string(it->actor.node()) + " (layers " + std::to_string(it->first) + "-" +
                  std::to_string(it->last) + (it->address.empty() ? "" : ", " + it->address) + ") is gone: " + reason);
      st.shards.erase(it);
      st.changed(self, "a shard left");
      return;
    }
    st.sessions.erase(std::remove_if(st.sessions.begin(), st.sessions.end(),
                                     [&](auto& s) { return s.address() == dm.source; }),
                      st.sessions.end());
    st.given.erase(dm.source);
  });
  return {
    [=](atom::register_atom, msg::shard_actor shard, int64_t first, int64_t last, msg::cache_recipe recipe,
        msg::model_facts facts, std::string address) -> caf::result<int64_t> {
      auto& st = self->state;
      if (!shard)
        return caf::make_error(ec::bad_request, "registration names no shard actor");
      if (st.recipe && !(*st.recipe == recipe))
        return caf::make_error(ec::incompatible_recipe,
                               "shard for layers " + std::to_string(first) + "-" + std::to_string(last) + " serves '" +
                                 recipe.model + "' (" + recipe.architecture + ", " + std::to_string(recipe.n_layers) +
                                 " layers, " + std::to_string(recipe.n_kv_heads) + "x" + std::to_string(recipe.head_dim) +
                                 " KV in " + recipe.kv_dtype + ", weights " + recipe.dtype + ") but the cluster serves '" +
                                 st.recipe->model + "' (" +
                                 st.recipe->architecture + ", " + std::to_string(st.recipe->n_layers) + " layers, " +
                                 std::to_string(st.recipe->n_kv_heads) + "x" + std::to_string(st.recipe->head_dim) +
                                 " KV in " + st.recipe->kv_dtype + ", weights " + st.recipe->dtype +
                                 "): nodes of a cluster must agree on model, --dtype and --kv-dtype");
      if (first < 0 || last < first || last >= recipe.n_layers)
        return caf::make_error(ec::bad_request, "layer range " + std::to_string(first) + "-" + std::to_string(last) +
                                                  " is outside the model's " + std::to_string(recipe.n_layers) + " layers");
      if (facts.vocab_size <= 0 || facts.max_seq_len <= 0 || facts.n_layers != recipe.n_layers)
        return caf::make_error(ec::bad_request, "shard for layers " + std::to_string(first) + "-" + std::to_string(last) +
                                                  " reports no usable model facts (vocabulary " +
                                                  std::to_string(facts.vocab_size) + ", context " +
                                                  std::to_string(facts.max_seq_len) + ")");
      if (st.facts.vocab_size > 0 && !(st.facts == facts))
        return caf::make_error(ec::incompatible_recipe,
                               "shard for layers " + std::to_string(first) + "-" + std::to_string(last) +
                                 " reports other model facts (vocabulary " + std::to_string(facts.vocab_size) +
                                 ", context " + std::to_string(facts.max_seq_len) + ") than the cluster's (vocabulary " +
                                 std::to_string(st.facts.vocab_size) + ", context " +
                                 std::to_string(st.facts.max_seq_len) + ")");
      st.recipe = recipe;
      st.facts = std::move(facts);
      self->monitor(shard);
      if (address.size() > 300)
        return caf::make_error(ec::bad_request, "advertised address is longer than 300 characters");
      const int64_t incarnation = address.empty() ? 1 : ++st.registrations[address];
      for (auto& e : st.shards) // a range that overlaps another without matching it is never part of a route
        if (e.first <= last && first <= e.last && !(e.first == first && e.last == last))
          st.say(3, "shard for layers " + std::to_string(first) + "-" + std::to_string(last) +
                      " overlaps layers " + std::to_string(e.first) + "-" + std::to_string(e.last) +
                      " of another node: routes use only ranges that line up");
      st.say(2, "shard node " + caf::to_string(shard.node()) + " joined: layers " + std::to_string(first) + "-" +
                  std::to_string(last) + (address.empty() ? "" : " at " + address) + ", incarnation " +
                  std::to_string(incarnation));
      st.shards.push_back(shard_entry{shard, first, last, 0, std::move(address), self->clock().now(), incarnation,
                                      unix_ms()});
      st.changed(self, "a shard joined");
      return st.epoch;
    },
    [=](atom::route_atom, const std::vector<msg::shard_actor>& avoid) { return route_request(self, avoid); },
    [=](atom::tick_atom) {
      auto& st = self->state;
      const auto now = self->clock().now();
      for (auto it = st.waiting.begin(); it != st.waiting.end();) {
        if (it->deadline <= now) {
          it->rp.deliver(caf::make_error(ec::no_route, "no complete route covers all layers after waiting " +
                                                         std::to_string(st.opts.route_wait.count()) + " ms"));
          it = st.waiting.erase(it);
        } else {
          ++it;
        }
      }
    },
    [=](atom::subscribe_atom) {
      // The subscriber is the sender: nobody subscribes another actor.
      auto s = caf::actor_cast<msg::session_actor>(self->current_sender());
      if (!s)
        return;
      self->monitor(s);
      self->state.sessions.push_back(s);
    },
    [=](atom::bump_atom) {
      self->state.changed(self, "bumped by an operator");
      return self->state.epoch;
    },
    [=](atom::heartbeat_atom, const msg::shard_actor& shard) {
      for (auto& e : self->state.shards)
        if (e.actor == shard)
          e.last_seen = self->clock().now();
    },
    [=](atom::status_atom) {
      auto& st = self->state;
      msg::cluster_status out;
      out.epoch = st.epoch;
      if (st.recipe)
        out.recipe = *st.recipe;
      const auto now = self->clock().now();
      for (auto& e : st.shards)
        out.shards.push_back(msg::shard_status{
          msg::hop{e.actor, e.first, e.last}, e.address,
          std::chrono::duration_cast<std::chrono::milliseconds>(now - e.last_seen).count(), e.incarnation, e.since_ms});
      out.plan = st.plan(false);
      return out;
    },
    [=](atom::stats_atom) { return self->state.plan(false); },
    [=](caf::get_atom) {
      // Every registered shard (not a chain), in registration order.
      auto& st = self->state;
      msg::route_info all;
      all.epoch = st.epoch;
      if (st.recipe)
        all.recipe = *st.recipe;
      for (auto& e : st.shards) {
        all.hops.push_back(msg::hop{e.actor, e.first, e.last});
        all.addresses.push_back(e.address);
      }
      return all;
    },
    [=](atom::model_atom) { return self->state.facts; },
  };
}

msg::supervisor_actor spawn_supervisor(caf::actor_system& sys, SupervisorOptions opts) {
  return sys.spawn(supervisor, opts);
}

} // namespace strata::actors
