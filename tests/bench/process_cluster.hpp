#pragma once
// Benchmarks only: a coordinator and shard-node processes on loopback; nodes
// can be restarted.

#include "tests/cluster/process.hpp"

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


} // namespace strata::bench
