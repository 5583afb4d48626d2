// Multi-process tests on loopback: a coordinator and shard nodes are separate
// `strata node` processes talking BASP over real TCP; clients are separate
// `strata generate --cluster` processes.

#include "tests/cluster/process.hpp"
#include "tests/support.hpp"

#include <cstdlib>
#include <memory>
#include <sstream>

namespace strata {
namespace {

using test::Process;

const std::string exe = STRATA_EXE;

struct Cluster {
  std::unique_ptr<Process> coordinator;
  std::vector<std::unique_ptr<Process>> nodes;
  std::string address; // HOST:PORT of the coordinator

  explicit Cluster(std::string listen = "127.0.0.1:0") { start_coordinator(listen); }
  void start_coordinator(const std::string& listen) {
    coordinator = std::make_unique<Process>(
      std::vector<std::string>{exe, "node", "--coordinator", "--listen", listen, "--route-wait-ms", "15000"});
    const auto line = coordinator->wait_line("ready coordinator ");
    address = line.empty() ? "" : line.substr(std::string("ready coordinator ").size());
  }
  Process& add(const std::string& layers, const std::string& model = "builtin:tiny") {
    nodes.push_back(std::make_unique<Process>(std::vector<std::string>{
      exe, "node", "--listen", "127.0.0.1:0", "--join", address, "--model", model, "--layers", layers, "--threads", "1"}));
    return *nodes.back();
  }
  bool add_ready(const std::string& layers) { return !add(layers).wait_line("ready node ").empty(); }
};

std::string run(const std::string& args) {
  Process p({"/bin/sh", "-c", exe + " " + args + " 2>&1"});
  return p.drain();
}

std::string ids_line(const std::string& out) {
  // The ids line is the one made only of digits and spaces.
  std::istringstream is(out);
  std::string line;
  while (std::getline(is, line))
    if (!line.empty() && line.find_first_not_of("0123456789 ") == std::string::npos)
      return line;
  return "";
}

const std::string prompt = "--prompt 'Once upon a time' --max-tokens 40 --output ids";

std::string local_ids() {
  return ids_line(run("generate --model builtin:tiny " + prompt));
}

TEST(Cluster, ThreeNodesEqualOneProcess) {
  Cluster c;
  ASSERT_FALSE(c.address.empty());
  ASSERT_TRUE(c.add_ready("0-1"));
  ASSERT_TRUE(c.add_ready("2-3"));
  ASSERT_TRUE(c.add_ready("4"));
  const auto expected = local_ids();
  ASSERT_FALSE(expected.empty());
  const auto out = run("generate --cluster " + c.address + " " + prompt);
  EXPECT_EQ(ids_line(out), expected) << out;
  const auto status = run("status --cluster " + c.address);
  EXPECT_NE(status.find("shard nodes 3"), std::string::npos) << status;
  EXPECT_NE(status.find("2-3"), std::string::npos) << status;
}

TEST(Cluster, KilledNodeReplicaTakesOver) {
  Cluster c;
  ASSERT_TRUE(c.add_ready("0-1"));
  ASSERT_TRUE(c.add_ready("2-3"));
  ASSERT_TRUE(c.add_ready("2-3")); // replica
  ASSERT_TRUE(c.add_ready("4"));
  const auto out = run("generate --cluster " + c.address + " " + prompt + " --inject kill:1@10");
  EXPECT_EQ(ids_line(out), local_ids()) << out;
  EXPECT_NE(out.find("route changes"), std::string::npos) << out;
  // Exactly one of the two replicas is gone.
  const int exited = (c.nodes[1]->wait_exit(std::chrono::milliseconds(100)) != -1) +
                     (c.nodes[2]->wait_exit(std::chrono::milliseconds(100)) != -1);
  EXPECT_EQ(exited, 1);
}

TEST(Cluster, KilledNodeRestartsAndTheSessionWaitsForIt) {
  Cluster c;
  ASSERT_TRUE(c.add_ready("0-1"));
  ASSERT_TRUE(c.add_ready("2-3"));
  ASSERT_TRUE(c.add_ready("4"));
  Process gen({"/bin/sh", "-c", exe + " generate --cluster " + c.address + " " + prompt + " --inject kill:1@10 2>&1"});
  // The node serving hop 1 exits (137, as if killed); start a new one for its layers.
  EXPECT_EQ(c.nodes[1]->wait_exit(std::chrono::seconds(30)), 137);
  ASSERT_TRUE(c.add_ready("2-3"));
  const auto out = gen.drain();
  EXPECT_EQ(ids_line(out), local_ids()) << out;
}

TEST(Cluster, FrozenNodeIsDetectedAndRoutedAround) {
  Cluster c;
  ASSERT_TRUE(c.add_ready("0-1"));
  ASSERT_TRUE(c.add_ready("2-3"));
  ASSERT_TRUE(c.add_ready("2-3"));
  ASSERT_TRUE(c.add_ready("4"));
  const auto t0 = std::chrono::steady_clock::now();
  const auto out = run("generate --cluster " + c.address + " " + prompt + " --inject freeze:1@10");
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(ids_line(out), local_ids()) << out;
  // Frozen for 3 s, declared dead after 1.5 s of silence: the route goes around it
  // and the generation ends in about 2 s, well before the 10 s step deadline.
  EXPECT_LT(took, std::chrono::seconds(9)) << out;
}

// How many shard nodes `strata status` lists.
int shard_nodes(const std::string& address) {
  const auto out = run("status --cluster " + address);
  const auto at = out.find("shard nodes ");
  return at == std::string::npos ? -1 : std::atoi(out.c_str() + at + 12);
}

TEST(Cluster, StoppedNodeComesBackAsNewIncarnation) {
  Cluster c;
  auto& node = c.add("0-4");
  const auto first = node.wait_line("ready node ");
  ASSERT_FALSE(first.empty());
  node.signal(SIGSTOP); // a real SIGSTOP, from outside
  // The coordinator declares it dead (1.5 s without heartbeats).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (shard_nodes(c.address) != 0 && std::chrono::steady_clock::now() < deadline) {
  }
  ASSERT_EQ(shard_nodes(c.address), 0);
  node.signal(SIGCONT);
  // Its peers buried its node id, so it returns as a new process with a new id,
  // while the pid that was started keeps standing for it.
  const auto second = node.wait_line("ready node ");
  ASSERT_FALSE(second.empty());
  EXPECT_NE(first.substr(0, first.find(" layers")), second.substr(0, second.find(" layers")));
  EXPECT_EQ(shard_nodes(c.address), 1);
  EXPECT_EQ(ids_line(run("generate --cluster " + c.address + " " + prompt)), local_ids());
  // Stopping the pid stops the node.
  node.signal(SIGTERM);
  EXPECT_EQ(node.wait_exit(std::chrono::seconds(10)), 0);
  EXPECT_EQ(shard_nodes(c.address), 0);
}

TEST(Cluster, CoordinatorRestartMidGeneration) {
  Cluster c;
  ASSERT_TRUE(c.add_ready("0-1"));
  ASSERT_TRUE(c.add_ready("2-3"));
  ASSERT_TRUE(c.add_ready("4"));
  const std::string longer = "--prompt 'Once upon a time' --max-tokens 400 --output text";
  const auto expected = run("generate --model builtin:tiny " + longer);
  Process gen({"/bin/sh", "-c", exe + " generate --cluster " + c.address + " " + longer + " 2>/dev/null"});
  // Once text streams, the generation is under way: kill the coordinator and
  // start a new one on the same address. Nodes re-register, the client reconnects.
  ASSERT_FALSE(gen.wait_line("Once").empty());
  c.coordinator->signal(SIGKILL);
  c.coordinator->wait_exit();
  const std::string old = c.address;
  c.start_coordinator(old);
  ASSERT_EQ(c.address, old);
  for (auto& n : c.nodes)
    EXPECT_FALSE(n->wait_line("re-registered").empty());
  const auto out = gen.drain();
  EXPECT_EQ(out, expected.substr(0, expected.find("[strata]")));
}

TEST(Cluster, ExampleActorScriptsGenerationsAgainstProcesses) {
  Cluster c;
  ASSERT_TRUE(c.add_ready("0-1"));
  ASSERT_TRUE(c.add_ready("0-1")); // the example kills hop 0: a replica takes over
  ASSERT_TRUE(c.add_ready("2-3"));
  ASSERT_TRUE(c.add_ready("4"));
  Process ex({STRATA_EXAMPLE, "--cluster", c.address});
  const auto out = ex.drain();
  EXPECT_NE(out.find("identical with and without failures: yes"), std::string::npos) << out;
  EXPECT_NE(out.find("cache misses 1, re-prefills 1"), std::string::npos) << out;
  EXPECT_EQ(ex.wait_exit(), 0);
}

TEST(Cluster, IncompatibleNodeIsRefused) {
  Cluster c;
  ASSERT_TRUE(c.add_ready("0-4"));
  auto& bad = c.add("0-0", "builtin:qwen2-0.5b");
  EXPECT_EQ(bad.wait_exit(std::chrono::seconds(60)), 3);
}

TEST(Cluster, NonLoopbackNeedsInsecure) {
  const auto out = run("node --coordinator --listen 0.0.0.0:0");
  EXPECT_NE(out.find("--insecure"), std::string::npos) << out;
}

} // namespace
} // namespace strata
