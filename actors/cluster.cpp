#include "actors/cluster.hpp"

#include "actors/shard_actor.hpp"
#include "messages/session_id.hpp"
#include "model/base/error.hpp"

#include <algorithm>
#include <charconv>

namespace strata::actors {

actor_config::actor_config() {
  msg::register_types(*this);
  // Workers that wait on a condition variable, not CAF's default work-stealing
  // workers that poll: on a machine whose cores the model's threads keep busy,
  // polling workers take cycles from the math (measured: a 0.5B decode step took
  // 137 ms instead of 94 ms at 2 threads) and add latency to every hop.
  set("scheduler.policy", caf::atom("sharing"));
}

std::vector<Injection> parse_injections(const std::string& spec, int64_t n_shards, bool allow_freeze) {
  std::vector<Injection> out;
  if (spec.empty())
    return out;
  std::size_t pos = 0;
  auto bad = [](const std::string& item, const std::string& why) {
    return model::Error(model::errc::bad_argument, "injection '" + item + "': " + why +
                                                     " (forms: evict:I@S, kill:I@S, epoch@S, desync:I@S, dup:I@S)");
  };
  auto number = [&](const std::string& item, const std::string& s) {
    int64_t v = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc{} || p != s.data() + s.size() || s.empty() || v < 0)
      throw bad(item, "'" + s + "' is not a non-negative number");
    return v;
  };
  while (pos <= spec.size()) {
    auto comma = spec.find(',', pos);
    const std::string item = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    pos = comma == std::string::npos ? spec.size() + 1 : comma + 1;
    if (item.empty())
      throw bad(item, "empty item");
    const auto at = item.find('@');
    if (at == std::string::npos)
      throw bad(item, "missing '@S'");
    const std::string head = item.substr(0, at);
    Injection inj{};
    inj.at_token = number(item, item.substr(at + 1));
    const auto colon = head.find(':');
    const std::string kind = head.substr(0, colon);
    if (kind == "epoch") {
      if (colon != std::string::npos)
        throw bad(item, "epoch takes no shard");
      inj.kind = Injection::epoch;
    } else {
      if (colon == std::string::npos)
        throw bad(item, "missing ':I' (the shard index)");
      inj.shard = number(item, head.substr(colon + 1));
      if (inj.shard >= n_shards)
        throw bad(item, "shard " + std::to_string(inj.shard) + " does not exist (there are " +
                          std::to_string(n_shards) + ")");
      if (kind == "evict")
        inj.kind = Injection::evict;
      else if (kind == "kill")
        inj.kind = Injection::kill;
      else if (kind == "desync")
        inj.kind = Injection::desync;
      else if (kind == "dup")
        inj.kind = Injection::dup;
      else if (kind == "freeze" && allow_freeze)
        inj.kind = Injection::freeze;
      else if (kind == "freeze")
        throw bad(item, "freeze needs a cluster of processes (--cluster)");
      else
        throw bad(item, "unknown kind '" + kind + "'");
    }
    out.push_back(inj);
  }
  return out;
}

LocalCluster::LocalCluster(caf::actor_system& sys, std::string model, std::vector<model::LayerRange> ranges,
                           ClusterOptions opts)
  : sys_(sys), model_(std::move(model)), ranges_(std::move(ranges)), opts_(opts) {
  supervisor_ = spawn_supervisor(sys_, opts_.supervisor);
  for (std::size_t i = 0; i < ranges_.size(); ++i)
    shards_.push_back(spawn_and_register(i));
  model::check_route_covers(ranges_, config_.n_layers);
}

LocalCluster::~LocalCluster() {
  for (auto& s : shards_)
    caf::anon_send_exit(s, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(supervisor_, caf::exit_reason::user_shutdown);
}

msg::shard_full_actor LocalCluster::spawn_and_register(std::size_t i) {
  std::shared_ptr<model::Shard> shard = model::Shard::load(model_, ranges_[i], opts_.load);
  config_ = shard->config();
  auto a = spawn_shard(sys_, shard, opts_.limits, {}, {}, opts_.lease_period, opts_.scheduler);
  caf::scoped_actor self{sys_};
  caf::error err;
  self->request(supervisor_, std::chrono::seconds(10), atom::register_atom_v, msg::shard_actor{a}, ranges_[i].first,
                ranges_[i].last, msg::cache_recipe::of(shard->config()), msg::model_facts::of(shard->config()),
                std::string{})
    .receive([](int64_t) {}, [&](caf::error& e) { err = std::move(e); });
  if (err) {
    caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    throw model::Error(model::errc::bad_argument, "registering shard " + std::to_string(i) + ": " + sys_.render(err));
  }
  return a;
}

SessionOptions LocalCluster::session_options() const {
  auto o = opts_.session;
  o.max_context = config_.max_seq_len;
  return o;
}

Outcome LocalCluster::generate(msg::generation_request req, const std::function<void(const msg::token_event&)>& on_token) {
  return generate(std::move(req), std::vector<Injection>{}, on_token);
}

Outcome LocalCluster::generate(msg::generation_request req, const std::vector<Injection>& inject,
                               const std::function<void(const msg::token_event&)>& on_token) {
  return run_generation(
    sys_, supervisor_, std::move(req), session_options(), inject,
    [this](const Injection& inj, const std::string& session) { apply(inj, session); }, on_token);
}

Outcome run_generation(caf::actor_system& sys, msg::supervisor_actor supervisor, msg::generation_request req, SessionOptions opts,
                       const std::vector<Injection>& inject,
                       const std::function<void(const Injection&, const std::string& session)>& apply,
                       const std::function<void(const msg::token_event&)>& on_token,
                       const std::function<msg::supervisor_actor()>& reconnect,
                       const std::function<void(msg::session_actor session)>& on_session) {
  caf::scoped_actor self{sys};
  if (reconnect)
    self->monitor(supervisor);
  if (req.session.empty())
    req.session = msg::mint_session_id("gen");
  const std::string session = req.session;
  std::vector<bool> done(inject.size(), false);
  auto fire = [&](int64_t tokens) {
    for (std::size_t k = 0; k < inject.size(); ++k)
      if (!done[k] && inject[k].at_token <= tokens) {
        done[k] = true;
        apply(inject[k], session);
      }
  };
  fire(0);
  for (auto& inj : inject)
    if (inj.at_token > 0)
      req.pause_after.push_back(inj.at_token);
  auto s = spawn_session(sys, supervisor, caf::actor_cast<msg::session_client_actor>(self), std::move(req), opts);
  if (on_session)
    on_session(s); // e.g. to cancel it from elsewhere
  Outcome out;
  bool finished = false;
  // The session bounds every step itself; this is only a backstop.
  const auto backstop = opts.step_timeout * (opts.max_retries + 4) + opts.route_timeout + std::chrono::seconds(30);
  while (!finished) {
    self->receive(
      [&](msg::token_event& ev) {
        if (on_token)
          on_token(ev);
        const bool paused = std::any_of(inject.begin(), inject.end(), [&](auto& i) { return i.at_token == ev.index + 1; });
        fire(ev.index + 1);
        if (paused) // the session waits at this step: inject, then let it go on
          self->send(s, atom::resume_atom_v);
      },
      [&](msg::generation_result& r) {
        out.result = std::move(r);
        finished = true;
      },
      [&](caf::error& e) {
        out.error = std::move(e);
        finished = true;
      },
      [&](caf::down_msg& dm) {
        if (dm.source != supervisor.address() || !reconnect)
          return;
        if (auto fresh = reconnect()) {
          supervisor = fresh;
          self->monitor(supervisor);
          self->send(s, atom::register_atom_v, supervisor);
        }
      },
      caf::after(backstop) >> [&] {
        caf::anon_send(s, atom::cancel_atom_v);
        out.error = caf::make_error(ec::step_timeout, "session '" + session + "' produced nothing for " +
                                                        std::to_string(backstop.count()) + " ms");
        finished = true;
      });
  }
  return out;
}

void wait_until_unregistered(caf::actor_system& sys, const msg::supervisor_actor& supervisor,
                             const msg::shard_actor& shard,
                             std::chrono::milliseconds timeout) {
  caf::scoped_actor self{sys};
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    bool listed = false;
    self->request(supervisor, timeout, caf::get_atom_v)
      .receive(
        [&](msg::route_info& all) {
          listed = std::any_of(all.hops.begin(), all.hops.end(), [&](auto& h) { return h.shard == shard; });
        },
        [](caf::error&) {});
    if (!listed)
      return;
  }
}

void LocalCluster::kill_and_replace(std::size_t i) {
  // Kill, wait until the shard is gone and the supervisor has seen it go, then
  // register the replacement: the supervisor sees "down" before "registered",
  // as it would for a restarted node.
  caf::scoped_actor self{sys_};
  const auto old = shards_.at(i);
  self->monitor(old);
  caf::anon_send_exit(old, caf::exit_reason::kill);
  self->receive([](caf::down_msg&) {}, caf::after(std::chrono::seconds(30)) >> [] {});
  wait_until_unregistered(sys_, supervisor_, old);
  shards_[i] = spawn_and_register(i);
}

void LocalCluster::evict(std::size_t i, const std::string& session, msg::miss_reason why) {
  caf::anon_send(injector(i), atom::evict_atom_v, session, static_cast<uint8_t>(why));
}

namespace {

// A fault aimed at `session` (desync_atom or dup_atom), once the shard has it in place.
template <class Atom>
void inject_aimed(caf::actor_system& sys, const msg::shard_injection_actor& shard, Atom what,
                  const std::string& session) {
  caf::scoped_actor self{sys};
  self->request(shard, std::chrono::seconds(10), what, session).receive([] {}, [](caf::error&) {});
}

} // namespace

void LocalCluster::desync(std::size_t i, const std::string& session) {
  inject_aimed(sys_, injector(i), atom::desync_atom_v, session);
}

void LocalCluster::duplicate_next(std::size_t i, const std::string& session) {
  inject_aimed(sys_, injector(i), atom::dup_atom_v, session);
}

int64_t LocalCluster::bump_epoch() {
  caf::scoped_actor self{sys_};
  int64_t epoch = -1;
  self->request(caf::actor_cast<msg::supervisor_injection_actor>(supervisor_), std::chrono::seconds(10),
                atom::bump_atom_v)
    .receive([&](int64_t e) { epoch = e; }, [](caf::error&) {});
  return epoch;
}

void LocalCluster::apply(const Injection& inj, const std::string& session) {
  switch (inj.kind) {
    case Injection::evict: evict(static_cast<std::size_t>(inj.shard), session, inj.reason); break;
    case Injection::kill: kill_and_replace(static_cast<std::size_t>(inj.shard)); break;
    case Injection::epoch: bump_epoch(); break;
    case Injection::desync: desync(static_cast<std::size_t>(inj.shard), session); break;
    case Injection::dup: duplicate_next(static_cast<std::size_t>(inj.shard), session); break;
    case Injection::freeze: break; // parse_injections refuses it in process
  }
}

std::vector<msg::shard_stats> LocalCluster::stats() {
  caf::scoped_actor self{sys_};
  std::vector<msg::shard_stats> out;
  for (auto& s : shards_)
    self->request(s, std::chrono::seconds(10), atom::stats_atom_v)
      .receive([&](msg::shard_stats& st) { out.push_back(std::move(st)); }, [](caf::error&) {});
  return out;
}

} // namespace strata::actors
