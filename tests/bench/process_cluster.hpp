#pragma once
// Benchmarks only: a coordinator and shard-node processes on loopback; nodes
// can be restarted.

#include "runtime/cluster.hpp"
#include "tests/cluster/process.hpp"

#include <cstdio>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace strata::bench {

using test::Process;

// A coordinator and shard-node processes; nodes can be restarted.
struct ProcessCluster {
  std::vector<std::string> node_flags; ///< extra flags for every node
  std::string exe, model, address;
  std::string threads = "1";
  std::unique_ptr<Process> coordinator;
  struct Node {
    std::string layers, id;
    std::unique_ptr<Process> proc;
  };
  std::vector<Node> nodes;

  ProcessCluster(std::string exe_, std::string model_) : exe(std::move(exe_)), model(std::move(model_)) {
    coordinator = std::make_unique<Process>(std::vector<std::string>{exe, "node", "--coordinator", "--listen",
                                                                     "127.0.0.1:0", "--route-wait-ms", "20000"});
    const auto line = coordinator->wait_line("ready coordinator ");
    if (line.empty())
      throw std::runtime_error("coordinator did not start");
    address = line.substr(std::string("ready coordinator ").size());
  }
  // Starts a node; waits for it when `wait`.
  Node& start(const std::string& layers, bool wait = true) {
    Node n;
    n.layers = layers;
    std::vector<std::string> argv{exe, "node", "--listen", "127.0.0.1:0", "--join", address, "--model", model,
                                  "--layers", layers, "--threads", threads};
    argv.insert(argv.end(), node_flags.begin(), node_flags.end());
    n.proc = std::make_unique<Process>(argv);
    nodes.push_back(std::move(n));
    auto& ref = nodes.back();
    if (wait)
      identify(ref);
    return ref;
  }
  void identify(Node& n) {
    const auto line = n.proc->wait_line("ready node ", std::chrono::seconds(120));
    if (line.empty())
      throw std::runtime_error("node for layers " + n.layers + " did not start");
    n.id = node_id(line);
  }
  // "ready node ID layers ..." -> ID
  static std::string node_id(const std::string& line) {
    std::istringstream is(line);
    std::string r, w, id;
    is >> r >> w >> id;
    return id;
  }
  Node* by_id(const std::string& id) {
    for (auto& n : nodes) // a node dropped by the coordinator comes back with a new id
      if (n.proc && !n.id.empty() && n.id != "dead")
        if (auto line = n.proc->last_line("ready node "); !line.empty())
          n.id = node_id(line);
    for (auto& n : nodes)
      if (n.id == id)
        return &n;
    return nullptr;
  }
};

/// Every registered shard's counters, as the coordinator lists them.
inline std::vector<msg::shard_stats> cluster_stats(caf::actor_system& sys, const msg::supervisor_actor& sup) {
  msg::route_info all;
  std::vector<msg::shard_stats> out;
  for (auto& v : runtime::list_shards(sys, sup, all))
    out.push_back(v.stats);
  return out;
}

/// Per hop, input rows per batched round between two snapshots: "1.5 / 2.0 / 2.2".
inline std::string rows_per_round(const std::vector<msg::shard_stats>& before, const std::vector<msg::shard_stats>& after) {
  std::string out;
  for (std::size_t i = 0; i < after.size() && i < before.size(); ++i) {
    const double rounds = static_cast<double>(after[i].rounds - before[i].rounds);
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f",
                  rounds > 0 ? static_cast<double>(after[i].batched_rows - before[i].batched_rows) / rounds : 0.0);
    out += (out.empty() ? "" : " / ") + std::string(buf);
  }
  return out;
}

} // namespace strata::bench
