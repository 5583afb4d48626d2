// `strata status` and `strata inject`.

#include "runtime/cluster.hpp"

#include "model/base/error.hpp"
#include "runtime/args.hpp"
#include "runtime/log.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>

namespace strata::runtime {

using namespace std::chrono_literals;

namespace {

// Which registered ranges can be part of some complete chain over [0, n).
std::vector<bool> usable_ranges(const std::vector<msg::shard_status>& shards, int64_t n) {
  std::vector<bool> from_start(static_cast<std::size_t>(n + 1), false), to_end(static_cast<std::size_t>(n + 1), false);
  from_start[0] = true;
  to_end[static_cast<std::size_t>(n)] = true;
  for (int64_t layer = 0; layer < n; ++layer) // ranges are sorted by nothing: relax until stable
    for (auto& s : shards)
      if (s.shard.first >= 0 && s.shard.last < n && from_start[static_cast<std::size_t>(s.shard.first)])
        from_start[static_cast<std::size_t>(s.shard.last + 1)] = true;
  for (int64_t layer = 0; layer < n; ++layer)
    for (auto& s : shards)
      if (s.shard.first >= 0 && s.shard.last < n && to_end[static_cast<std::size_t>(s.shard.last + 1)])
        to_end[static_cast<std::size_t>(s.shard.first)] = true;
  std::vector<bool> out;
  for (auto& s : shards)
    out.push_back(s.shard.first >= 0 && s.shard.last < n && from_start[static_cast<std::size_t>(s.shard.first)] &&
                  to_end[static_cast<std::size_t>(s.shard.last + 1)]);
  return out;
}

} // namespace

int run_status(int argc, char** argv) {
  Args a;
  a.option("cluster", "HOST:PORT", "the coordinator").option("json", "", "print one JSON object (for scripts)");
  add_network_options(a);
  a.parse(argc, argv, 2);
  log::configure_from(a, "client");
  if (a.help_requested()) {
    std::cout << "usage: strata status --cluster HOST:PORT [--json]\n\nPrints the cluster: model, epoch, the current "
                 "route, and per shard node: id, address, layers, liveness (time since its last heartbeat),\n"
                 "incarnation, its part in routes (route, spare, unused), cache bytes, sessions, hits, orphans,\n"
                 "conflicts and misses by reason.\n\noptions:\n"
              << a.help_text();
    return 0;
  }
  const Endpoint ep = parse_endpoint(a.required("cluster"), "cluster");
  auto& sys = client_system(liveness_from(a), tls_from(a));
  auto sup = connect_coordinator(sys, ep);
  auto cs = cluster_status(sys, sup);
  // The model's facts as its shards reported them (architecture, experts, windows).
  msg::model_facts facts;
  try {
    facts = cluster_model(sys, sup);
  } catch (const model::Error&) {
    // no shard has registered yet: the facts stay empty
  }
  const auto model_cfg = facts.to_config(); // vocab_size 0: no shard has registered yet
  const auto kind = facts.vocab_size > 0 ? model_cfg.describe() : std::string("-");
  caf::scoped_actor self{sys};
  struct Row {
    msg::shard_stats stats;
    bool answered = false;
  };
  std::vector<Row> rows;
  for (auto& s : cs.shards) {
    Row r;
    self->request(s.shard.shard, 2s, atom::stats_atom_v)
      .receive([&](msg::shard_stats& st) { r.stats = std::move(st), r.answered = true; }, [](caf::error&) {});
    rows.push_back(std::move(r));
  }
  const auto usable = usable_ranges(cs.shards, cs.recipe.n_layers);
  auto in_route = [&](const msg::shard_status& s) {
    return std::any_of(cs.plan.hops.begin(), cs.plan.hops.end(), [&](auto& h) { return h.shard == s.shard.shard; });
  };
  auto role = [&](std::size_t i) {
    return in_route(cs.shards[i]) ? "route" : usable[i] ? "spare" : "unused";
  };
  const char* reasons[] = {"", "unknown", "ttl", "lru", "released", "superseded", "seq"};
  if (a.has("json")) {
    nlohmann::json j;
    j["cluster"] = ep.host + ":" + std::to_string(ep.port);
    j["model"] = cs.recipe.model;
    j["architecture"] = facts.architecture;
    j["experts"] = facts.n_experts;
    j["experts_active"] = facts.n_experts_used;
    j["sliding_window"] = facts.sliding_window;
    j["window_layers"] = model_cfg.local_layers();
    j["epoch"] = cs.epoch;
    j["route_complete"] = !cs.plan.hops.empty();
    j["route"] = nlohmann::json::array();
    for (std::size_t i = 0; i < cs.plan.hops.size(); ++i)
      j["route"].push_back({{"first", cs.plan.hops[i].first},
                            {"last", cs.plan.hops[i].last},
                            {"node", caf::to_string(cs.plan.hops[i].shard.node())},
                            {"address", i < cs.plan.addresses.size() ? cs.plan.addresses[i] : ""}});
    j["shards"] = nlohmann::json::array();
    for (std::size_t i = 0; i < cs.shards.size(); ++i) {
      auto& s = cs.shards[i];
      auto& st = rows[i].stats;
      nlohmann::json misses = nlohmann::json::object();
      for (std::size_t r = 1; r < st.misses.size() && r < 7; ++r)
        misses[reasons[r]] = st.misses[r];
      j["shards"].push_back({{"index", i},
                             {"node", caf::to_string(s.shard.shard.node())},
                             {"address", s.address},
                             {"first", s.shard.first},
                             {"last", s.shard.last},
                             {"silent_ms", s.silent_ms},
                             {"incarnation", s.incarnation},
                             {"role", role(i)},
                             {"answering", rows[i].answered},
                             {"cache_bytes", st.cache_bytes},
                             {"sessions", st.sessions},
                             {"hits", st.hits},
                             {"orphans", st.orphans},
                             {"conflicts", st.conflicts},
                             {"pool_blocks", st.pool_blocks},
                             {"pool_used", st.pool_used},
                             {"window_used", st.window_used},
                             {"block_bytes", st.block_bytes},
                             {"kv_dtype", st.kv_dtype},
                             {"kernels", st.kernels},
                             {"kv_bytes_per_token", st.kv_bytes_per_token},
                             {"kept_bytes_per_token", st.kept_bytes_per_token},
                             {"queued", st.queued},
                             {"rounds", st.rounds},
                             {"batched_rows", st.batched_rows},
                             {"max_batch", st.max_batch},
                             {"overloaded", st.overloaded},
                             {"misses", misses}});
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("cluster %s:%u  model %s (%s)  epoch %lld  shard nodes %zu\n", ep.host.c_str(), ep.port,
              cs.recipe.model.empty() ? "-" : cs.recipe.model.c_str(), kind.c_str(), static_cast<long long>(cs.epoch),
              cs.shards.size());
  std::string route;
  for (auto& h : cs.plan.hops)
    route += (route.empty() ? "" : " -> ") + std::to_string(h.first) + "-" + std::to_string(h.last);
  std::printf("route: %s\n", route.empty() ? "none complete (some layers have no node)" : route.c_str());
  // An aligned table: every column as wide as its widest cell.
  std::vector<std::vector<std::string>> table = {{"#", "node", "address", "layers", "alive", "inc", "role", "cache-bytes",
                                                  "pool(used/blocks)", "window-used", "kv", "bytes/token(kv+kept)", "kernels", "rounds", "max-batch", "queued", "overloaded",
                                                  "sessions", "hits", "orphans", "conflicts",
                                                  "misses(unknown,ttl,lru,released,superseded,seq)"}};
  for (std::size_t i = 0; i < cs.shards.size(); ++i) {
    auto& s = cs.shards[i];
    auto& st = rows[i].stats;
    char alive[32];
    std::snprintf(alive, sizeof alive, "%.1fs ago", static_cast<double>(s.silent_ms) / 1000.0);
    std::string misses;
    for (std::size_t r = 1; r < st.misses.size(); ++r)
      misses.append(r > 1 ? "," : "").append(std::to_string(st.misses[r])); // (not "," + to_string: GCC 12 misreports it)
    auto n = [](uint64_t v) { return std::to_string(v); };
    table.push_back({std::to_string(i), caf::to_string(s.shard.shard.node()), s.address.empty() ? "-" : s.address,
                     std::to_string(s.shard.first) + "-" + std::to_string(s.shard.last),
                     rows[i].answered ? std::string(alive) : "not answering", std::to_string(s.incarnation), role(i),
                     n(st.cache_bytes), n(st.pool_used) + "/" + n(st.pool_blocks),
                     st.window_block_bytes > 0 ? n(st.window_used) : "-", rows[i].answered ? st.kv_dtype : "-",
                     rows[i].answered ? n(st.kv_bytes_per_token) + "+" + n(st.kept_bytes_per_token) : "-",
                     rows[i].answered && !st.kernels.empty() ? st.kernels : "-", n(st.rounds), n(st.max_batch),
                     n(st.queued), n(st.overloaded), n(st.sessions), n(st.hits), n(st.orphans), n(st.conflicts),
                     rows[i].answered ? misses : "-"});
  }
  std::vector<std::size_t> width(table[0].size(), 0);
  for (auto& r : table)
    for (std::size_t c = 0; c < r.size(); ++c)
      width[c] = std::max(width[c], r[c].size());
  for (auto& r : table) {
    std::string line;
    for (std::size_t c = 0; c < r.size(); ++c)
      line += r[c] + (c + 1 < r.size() ? std::string(width[c] - r[c].size() + 2, ' ') : "");
    std::printf("%s\n", line.c_str());
  }
  for (std::size_t i = 0; i < cs.shards.size(); ++i)
    if (!usable[i])
      std::printf("note: node %zu (layers %lld-%lld) is in no complete route: its range overlaps or leaves a gap\n", i,
                  static_cast<long long>(cs.shards[i].shard.first), static_cast<long long>(cs.shards[i].shard.last));
  return 0;
}

int run_inject(int argc, char** argv) {
  Args a;
  a.option("cluster", "HOST:PORT", "the coordinator")
    .option("node", "ID", "node index from 'strata status' or its node id")
    .option("session", "ID", "evict: only this session (default: all)")
    .option("seconds", "N", "freeze: how long (default 3)");
  add_network_options(a);
  a.parse(argc, argv, 2, "KIND");
  log::configure_from(a, "client");
  if (a.help_requested()) {
    std::cout << "usage: strata inject kill|freeze|evict|epoch --cluster HOST:PORT [--node ID] [--session ID] "
                 "[--seconds N]\n\nkill: the node exits as if killed; freeze: it stops answering for N seconds; "
                 "evict: it drops one or all sessions; epoch: the supervisor bumps the route epoch.\n\noptions:\n"
              << a.help_text();
    return 0;
  }
  if (a.positionals().size() != 1)
    throw UsageError("give exactly one kind: kill, freeze, evict or epoch");
  const std::string kind = a.positionals()[0];
  if (kind != "kill" && kind != "freeze" && kind != "evict" && kind != "epoch")
    throw UsageError("unknown kind '" + kind + "' (kill, freeze, evict, epoch)");
  if (kind != "epoch" && !a.has("node"))
    throw UsageError(kind + " needs --node ID");
  const int64_t seconds = a.integer("seconds", 3, 1, 3600);
  const Endpoint ep = parse_endpoint(a.required("cluster"), "cluster");
  auto& sys = client_system(liveness_from(a), tls_from(a));
  auto sup = connect_coordinator(sys, ep);
  std::printf("%s\n", inject_node(sys, sup, kind, a.str("node"), a.str("session"), seconds).c_str());
  return 0;
}

} // namespace strata::runtime
