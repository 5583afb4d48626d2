// A client's view of a cluster: the supervisor's route, model and shards, and
// failures injected into remote nodes (the CLI's --inject, `strata inject`, serve's page).

#include "runtime/cluster.hpp"

#include "model/base/error.hpp"
#include "runtime/log.hpp"

namespace strata::runtime {

using namespace std::chrono_literals;

namespace {

// Makes the node of `target` exit abruptly, then waits until the supervisor
// (connected to that node directly) has seen it go, so that sessions re-plan
// around it instead of timing out on it.
void crash_and_wait(caf::actor_system& sys, msg::supervisor_actor supervisor, msg::shard_actor target) {
  caf::anon_send(caf::actor_cast<msg::shard_injection_actor>(target), atom::crash_atom_v);
  actors::wait_until_unregistered(sys, supervisor, target);
}

} // namespace

void apply_remote_injection(caf::actor_system& sys, msg::supervisor_actor supervisor, const actors::Injection& inj,
                            const std::string& session) {
  caf::scoped_actor self{sys};
  if (inj.kind == actors::Injection::epoch) {
    self->request(caf::actor_cast<msg::supervisor_injection_actor>(supervisor), 10s, atom::bump_atom_v)
      .receive([](int64_t) {}, [](caf::error&) {});
    return;
  }
  msg::route_info plan;
  self->request(supervisor, 10s, atom::stats_atom_v)
    .receive([&](msg::route_info& r) { plan = std::move(r); }, [](caf::error&) {});
  if (inj.shard >= static_cast<int64_t>(plan.hops.size()))
    return; // no such hop in the current plan (e.g. no complete route)
  auto shard = plan.hops[static_cast<std::size_t>(inj.shard)].shard;
  auto target = caf::actor_cast<msg::shard_injection_actor>(shard);
  switch (inj.kind) {
    case actors::Injection::kill: crash_and_wait(sys, supervisor, shard); break;
    case actors::Injection::freeze: self->send(target, atom::freeze_atom_v, int64_t{3000}); break;
    case actors::Injection::evict:
    case actors::Injection::desync:
    case actors::Injection::dup: {
      // The session's cache for hop I's layers (and its next step there) lives on
      // whichever replica its route took, which need not be the one in the
      // current plan: inject on every node serving those layers (a no-op where
      // the session never comes), each answering once the fault is in place.
      const auto& hop = plan.hops[static_cast<std::size_t>(inj.shard)];
      for (auto& h : cluster_view(sys, supervisor).hops) {
        if (h.first != hop.first || h.last != hop.last)
          continue;
        auto ask = [&](auto... xs) {
          self->request(caf::actor_cast<msg::shard_injection_actor>(h.shard), 10s, xs...)
            .receive([] {}, [](caf::error&) {});
        };
        if (inj.kind == actors::Injection::evict)
          ask(atom::evict_atom_v, session, static_cast<uint8_t>(inj.reason));
        else if (inj.kind == actors::Injection::desync)
          ask(atom::desync_atom_v, session);
        else
          ask(atom::dup_atom_v, session);
      }
      break;
    }
    case actors::Injection::epoch: break;
  }
}

namespace {

// One blocking request to the supervisor (10 s, less when its process goes
// away); throws model::Error(io) when it does not answer.
template <class Reply, class... Ts>
Reply ask_supervisor(caf::actor_system& sys, const msg::supervisor_actor& sup, Ts... xs) {
  auto r = ask_watched<Reply>(sys, sup, 10s, xs...);
  if (!r)
    throw model::Error(model::errc::io, "the coordinator did not answer: " + sys.render(r.error()));
  return std::move(*r);
}

} // namespace

msg::route_info cluster_view(caf::actor_system& sys, msg::supervisor_actor sup) {
  return ask_supervisor<msg::route_info>(sys, sup, caf::get_atom_v);
}

msg::cluster_status cluster_status(caf::actor_system& sys, msg::supervisor_actor sup) {
  return ask_supervisor<msg::cluster_status>(sys, sup, atom::status_atom_v);
}

msg::model_facts cluster_model(caf::actor_system& sys, msg::supervisor_actor sup) {
  auto facts = ask_supervisor<msg::model_facts>(sys, sup, atom::model_atom_v);
  if (facts.vocab_size <= 0)
    throw model::Error(model::errc::bad_argument, "the cluster has no model yet: no shard node has registered");
  return facts;
}

std::vector<ShardView> list_shards(caf::actor_system& sys, msg::supervisor_actor sup, msg::route_info& all) {
  all = cluster_view(sys, sup);
  caf::scoped_actor self{sys};
  std::vector<ShardView> out;
  for (auto& h : all.hops) {
    ShardView v{h, {}, false};
    self->request(h.shard, 2s, atom::stats_atom_v)
      .receive(
        [&](msg::shard_stats& s) {
          v.stats = std::move(s);
          v.answered = true;
        },
        [](caf::error&) {});
    out.push_back(std::move(v));
  }
  return out;
}

std::string inject_node(caf::actor_system& sys, msg::supervisor_actor sup, const std::string& kind, const std::string& node,
                        const std::string& session, int64_t seconds) {
  caf::scoped_actor self{sys};
  if (kind == "epoch") {
    int64_t epoch = -1;
    caf::error err;
    self->request(caf::actor_cast<msg::supervisor_injection_actor>(sup), 10s, atom::bump_atom_v).receive([&](int64_t e) { epoch = e; }, [&](caf::error& e) { err = e; });
    if (err)
      throw model::Error(model::errc::io, "epoch: the coordinator did not answer: " + sys.render(err));
    return "epoch " + std::to_string(epoch);
  }
  if (kind != "kill" && kind != "freeze" && kind != "evict")
    throw model::Error(model::errc::bad_argument, "unknown injection '" + kind + "' (kill, freeze, evict, epoch)");
  if (seconds < 1 || seconds > 3600)
    throw model::Error(model::errc::bad_argument, "freeze seconds must be 1-3600, not " + std::to_string(seconds));
  msg::route_info all;
  auto shards = list_shards(sys, sup, all);
  const ShardView* target = nullptr;
  for (std::size_t i = 0; i < shards.size(); ++i)
    if (node == std::to_string(i) || node == caf::to_string(shards[i].hop.shard.node()))
      target = &shards[i];
  if (!target)
    throw model::Error(model::errc::bad_argument, "no shard node '" + node + "' (see 'strata status')");
  if (kind == "kill") {
    crash_and_wait(sys, sup, target->hop.shard);
  } else if (kind == "freeze") {
    // A request, so that a client does not end before the message left; the
    // node may freeze before its answer does, so no answer is fine too.
    self->request(caf::actor_cast<msg::shard_injection_actor>(target->hop.shard), 2s, atom::freeze_atom_v,
                  seconds * 1000).receive([] {}, [](caf::error&) {});
  } else {
    bool done = false;
    std::string why;
    self->request(caf::actor_cast<msg::shard_injection_actor>(target->hop.shard), 10s, atom::evict_atom_v, session,
                  static_cast<uint8_t>(msg::miss_reason::evicted_lru))
      .receive([&] { done = true; }, [&](caf::error& e) { why = sys.render(e); });
    if (!done)
      throw model::Error(model::errc::io, "evict: the node did not confirm: " + why);
  }
  return kind + " sent to node " + caf::to_string(target->hop.shard.node()) + " (layers " +
         std::to_string(target->hop.first) + "-" + std::to_string(target->hop.last) + ")";
}

} // namespace strata::runtime
