// Multi-process tests on loopback: a coordinator and shard nodes are separate
// `strata node` processes talking BASP over real TCP; clients are separate
// `strata generate --cluster` processes.

#include "tests/cluster/cluster_support.hpp"
#include "tests/cluster/process.hpp"
#include "model/transformer/shard.hpp"
#include "tests/support.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <arpa/inet.h>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <netinet/in.h>
#include <random>
#include <sstream>
#include <sys/socket.h>

namespace strata {
namespace {

using test::Process;
using namespace clustertest;

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
  EXPECT_NE(out.find("cache misses 1, recoveries 1"), std::string::npos) << out;
  EXPECT_EQ(ex.wait_exit(), 0);
}


// Per shard node in `strata status --json`: sessions and orphans.
struct NodeRow {
  long sessions = -1, orphans = -1;
};
std::vector<NodeRow> status_rows(const std::string& address) {
  const auto out = run("status --json --cluster " + address);
  auto j = nlohmann::json::parse(out.substr(std::min(out.find('{'), out.size())), nullptr, false);
  std::vector<NodeRow> rows;
  if (!j.is_object() || !j.contains("shards"))
    return rows;
  for (auto& s : j["shards"])
    rows.push_back({s["sessions"].get<long>(), s["orphans"].get<long>()});
  return rows;
}

TEST(Cluster, ConcurrentClientsNeverShareCaches) {
  // Four `strata generate --cluster` processes at once, prompts of nearly equal
  // length, four rounds: every output equals the single-process ids.
  Cluster c;
  ASSERT_TRUE(c.add_ready("0-2"));
  ASSERT_TRUE(c.add_ready("3-4"));
  const std::vector<std::string> prompts = {"Once upon a time A", "Once upon a time B", "Once upon a time C",
                                            "Once upon a time DD"};
  auto args = [](const std::string& p) { return "--prompt '" + p + "' --max-tokens 200 --output ids"; };
  std::vector<std::string> expected;
  for (auto& p : prompts) {
    expected.push_back(ids_line(run("generate --model builtin:tiny " + args(p))));
    ASSERT_FALSE(expected.back().empty());
  }
  for (int round = 0; round < 4; ++round) {
    std::vector<std::unique_ptr<Process>> clients;
    for (auto& p : prompts)
      clients.push_back(std::make_unique<Process>(
        std::vector<std::string>{"/bin/sh", "-c", exe + " generate --cluster " + c.address + " " + args(p) + " 2>&1"}));
    for (std::size_t i = 0; i < clients.size(); ++i) {
      const auto out = clients[i]->drain();
      EXPECT_EQ(ids_line(out), expected[i]) << "round " << round << ", client " << i << ":\n" << out;
      EXPECT_EQ(clients[i]->wait_exit(), 0);
    }
  }
  for (auto& r : status_rows(c.address))
    EXPECT_EQ(r.sessions, 0) << "every client released its caches";
}

// The generated text of `generate` output with stderr mixed in: everything
// before the first "[strata]" summary line, without line ends.
std::string text_of(const std::string& out) {
  std::string t = out.substr(0, out.find("[strata]"));
  while (!t.empty() && t.back() == '\n')
    t.pop_back();
  return t;
}

TEST(Cluster, FaultsDuringConcurrentLoadChangeNoToken) {
  // Four users generate at once while faults hit the cluster under them: one
  // client's run kills the node of its hop 1 (a replica takes over for everyone
  // routed through it; the death bumps the epoch for every session in flight),
  // one evicts its cache on hop 0, one bumps the epoch. Each client's text equals
  // the same request run alone in one process. (Which other sessions are still in
  // flight when a fault lands depends on timing; the faults' own sessions always are.)
  Cluster c;
  for (auto layers : {"0-2", "0-2", "3-4", "3-4"}) // each range has a replica
    ASSERT_TRUE(c.add_ready(layers));
  const std::vector<std::string> prompts = {"Once upon a time A", "Once upon a time B", "Once upon a time C",
                                            "Once upon a time DD"};
  const std::vector<std::string> faults = {"--inject kill:1@40", "--inject evict:0@20", "--inject epoch@30", ""};
  std::vector<std::string> alone;
  for (auto& p : prompts) {
    const auto out = run("generate --model builtin:tiny --prompt '" + p + "' --max-tokens 480");
    alone.push_back(text_of(out));
  }
  std::vector<std::unique_ptr<Process>> clients;
  for (std::size_t i = 0; i < prompts.size(); ++i)
    clients.push_back(std::make_unique<Process>(std::vector<std::string>{
      "/bin/sh", "-c", "exec " + exe + " generate --cluster " + c.address + " --prompt '" + prompts[i] +
                         "' --max-tokens 480 " + faults[i] + " 2>&1"}));
  for (std::size_t i = 0; i < clients.size(); ++i) {
    const auto out = clients[i]->drain();
    EXPECT_EQ(text_of(out), alone[i]) << "client " << i << " (" << faults[i] << ")";
    EXPECT_EQ(clients[i]->wait_exit(), 0);
    // Each fault reached its own session: the eviction as a miss it recovered
    // from by rebuilding that hop; the kill and the bump as route changes. (The
    // kill takes the node the coordinator's plan names for hop 1, which may be the
    // replica this session is not on: then it keeps its shards and rebuilds nothing.)
    const auto at = out.find("recoveries ");
    ASSERT_NE(at, std::string::npos) << out;
    const auto rc = out.find("route changes ");
    ASSERT_NE(rc, std::string::npos) << out;
    if (faults[i].find("evict") != std::string::npos) {
      EXPECT_GE(std::atoi(out.c_str() + at + 11), 1) << "client " << i << ":\n" << out;
    } else if (!faults[i].empty()) {
      EXPECT_GE(std::atoi(out.c_str() + rc + 14), 1) << "client " << i << ":\n" << out;
    }
    if (!faults[i].empty()) { // rebuilt: the lost hop's layers only, never more than a full re-prefill
      const auto lt = out.find("recomputed ");
      ASSERT_NE(lt, std::string::npos) << out;
      const auto full = out.find("(full re-prefill: ");
      ASSERT_NE(full, std::string::npos) << out;
      EXPECT_LE(std::atoll(out.c_str() + lt + 11), std::atoll(out.c_str() + full + 18)) << out;
    }
  }
  // Nothing is left behind on the nodes that remain.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  std::vector<NodeRow> rows;
  do
    rows = status_rows(c.address);
  while (std::chrono::steady_clock::now() < deadline &&
         std::any_of(rows.begin(), rows.end(), [](auto& r) { return r.sessions != 0; }));
  EXPECT_EQ(rows.size(), 3u) << "one node was killed";
  for (auto& r : rows)
    EXPECT_EQ(r.sessions, 0);
}

TEST(Cluster, KilledClientsCachesAreDroppedWithinSeconds) {
  Cluster c;
  ASSERT_TRUE(c.add_ready("0-2"));
  ASSERT_TRUE(c.add_ready("3-4"));
  Process gen({exe, "generate", "--cluster", c.address, "--prompt", "Once upon a time", "--max-tokens", "480"});
  // Text streams once the generation is under way: stop the client there (its
  // caches are on both nodes), then kill -9 it. (A stopped client also stops
  // its heartbeats and lease renewals, so the nodes may drop it even earlier.)
  ASSERT_TRUE(gen.wait_bytes(std::string("Once upon a time").size() + 20)); // the prompt and 20 tokens
  gen.signal(SIGSTOP);
  gen.signal(SIGKILL);
  std::vector<NodeRow> rows;
  const auto t0 = std::chrono::steady_clock::now();
  bool dropped = false;
  while (!dropped && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
    rows = status_rows(c.address);
    dropped = rows.size() == 2 && std::all_of(rows.begin(), rows.end(), [](auto& r) { return r.sessions == 0; });
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_TRUE(dropped);
  EXPECT_LT(took, std::chrono::seconds(5));
  for (auto& r : rows)
    EXPECT_EQ(r.orphans, 1) << "dropped as an orphan, not released by the client";
}

TEST(Cluster, StatusShowsAddressesLivenessRolesAndTheLogSaysWhyNodesLeft) {
  // The coordinator's log (stderr) is read too.
  Process coordinator({"/bin/sh", "-c", "exec " + exe + " node --coordinator --listen 127.0.0.1:0 2>&1"});
  const auto ready = coordinator.wait_line("ready coordinator ");
  ASSERT_FALSE(ready.empty());
  const std::string address = ready.substr(std::string("ready coordinator ").size());
  std::vector<std::unique_ptr<Process>> nodes;
  for (auto layers : {"0-2", "3-4", "1-3"}) {
    nodes.push_back(std::make_unique<Process>(std::vector<std::string>{
      exe, "node", "--listen", "127.0.0.1:0", "--join", address, "--model", "builtin:tiny", "--layers", layers,
      "--threads", "1"}));
    ASSERT_FALSE(nodes.back()->wait_line("ready node ").empty());
  }
  EXPECT_FALSE(coordinator.wait_containing("coordinator: shard node").empty());
  EXPECT_FALSE(coordinator.wait_containing("overlaps layers").empty()) << "the 1-3 node is called out";
  // Text: aligned columns, the route, the unused range.
  const auto text = run("status --cluster " + address);
  EXPECT_NE(text.find("route: 0-2 -> 3-4"), std::string::npos) << text;
  EXPECT_NE(text.find("note: node 2 (layers 1-3) is in no complete route"), std::string::npos) << text;
  std::istringstream is(text);
  std::vector<std::string> lines;
  for (std::string l; std::getline(is, l);)
    if (!l.empty() && (l[0] == '#' || std::isdigit(static_cast<unsigned char>(l[0]))))
      lines.push_back(l);
  ASSERT_EQ(lines.size(), 4u) << text;
  for (const char* col : {"address", "layers", "alive", "role", "sessions"}) {
    const auto at = lines[0].find(col);
    ASSERT_NE(at, std::string::npos) << col;
    for (std::size_t r = 1; r < lines.size(); ++r)
      EXPECT_TRUE(lines[r].size() > at && lines[r][at] != ' ' && lines[r][at - 1] == ' ')
        << "column '" << col << "' is not aligned:\n" << text;
  }
  // JSON for scripts.
  const auto out = run("status --json --cluster " + address);
  auto j = nlohmann::json::parse(out.substr(std::min(out.find('{'), out.size())), nullptr, false);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_TRUE(j["route_complete"].get<bool>());
  ASSERT_EQ(j["shards"].size(), 3u);
  const std::vector<std::string> roles = {"route", "route", "unused"};
  for (std::size_t i = 0; i < 3; ++i) {
    auto& sh = j["shards"][i];
    EXPECT_EQ(sh["address"].get<std::string>().rfind("127.0.0.1:", 0), 0u) << sh;
    EXPECT_GE(sh["silent_ms"].get<int64_t>(), 0);
    EXPECT_LT(sh["silent_ms"].get<int64_t>(), 3000) << "heartbeats arrive every second";
    EXPECT_EQ(sh["incarnation"], 1);
    EXPECT_EQ(sh["role"], roles[i]);
    // The block pool: sized by --cache-bytes (1 GiB by default), nothing held now.
    EXPECT_GT(sh["pool_blocks"].get<uint64_t>(), 0u) << sh;
    EXPECT_EQ(sh["pool_used"].get<uint64_t>(), 0u) << sh;
    EXPECT_LE(sh["pool_blocks"].get<uint64_t>() * sh["block_bytes"].get<uint64_t>(), uint64_t{1} << 30) << sh;
    EXPECT_EQ(sh["queued"].get<uint64_t>(), 0u) << sh;
  }
  // Deaths are logged with their reason: a killed node's connection is lost,
  // a frozen node stops its heartbeats.
  nodes[2]->signal(SIGKILL);
  const auto killed = coordinator.wait_containing("is gone:", std::chrono::seconds(10));
  EXPECT_NE(killed.find("connection lost"), std::string::npos) << killed;
  EXPECT_NE(killed.find("layers 1-3"), std::string::npos) << killed;
  nodes[1]->signal(SIGSTOP);
  const auto frozen = coordinator.wait_containing("is gone:", std::chrono::seconds(10));
  EXPECT_NE(frozen.find("heartbeat timeout"), std::string::npos) << frozen;
  EXPECT_NE(frozen.find("layers 3-4"), std::string::npos) << frozen;
  EXPECT_FALSE(coordinator.wait_containing("no complete route").empty());
  nodes[1]->signal(SIGCONT);
}

TEST(Cluster, IncompatibleNodeIsRefused) {
  Cluster c;
  ASSERT_TRUE(c.add_ready("0-4"));
  auto& bad = c.add("0-0", "builtin:qwen2-0.5b");
  EXPECT_EQ(bad.wait_exit(std::chrono::seconds(60)), 3);
}

// Two nodes serving a GGUF file (one file: weights, config, tokenizer), one
// layer each, give five concurrent clients the ids one process gives the same
// request alone, also while faults hit three of them (an eviction, a desync,
// an epoch bump). Returns the cluster for more checks.
std::unique_ptr<Cluster> gguf_clients_with_faults_equal_one_process(const std::string& model) {
  auto c = std::make_unique<Cluster>();
  EXPECT_FALSE(c->add("0", model).wait_line("ready node ").empty());
  EXPECT_FALSE(c->add("1", model).wait_line("ready node ").empty());
  const std::string args = " --prompt-ids 1,100,200,300 --max-tokens 24 --output ids";
  const auto local = ids_line(run("generate --model " + model + args));
  EXPECT_FALSE(local.empty());
  // (fault, what the client's summary must then report; "" = nothing to check)
  const std::vector<std::pair<std::string, std::string>> runs = {
    {"", ""}, {"", ""}, {" --inject evict:1@5", "evicted_lru=1"}, {" --inject desync:0@9", "seq_mismatch=1"},
    {" --inject epoch@12", ""}};
  std::vector<std::unique_ptr<Process>> clients;
  for (const auto& [faults, report] : runs)
    clients.push_back(std::make_unique<Process>(
      std::vector<std::string>{"/bin/sh", "-c", exe + " generate --cluster " + c->address + args + faults + " 2>&1"}));
  for (std::size_t i = 0; i < clients.size(); ++i) {
    const auto out = clients[i]->drain();
    EXPECT_EQ(ids_line(out), local) << out;
    // The fault reached its session, and only its: as the miss it names, or,
    // when another client's epoch bump re-routed this session at that moment
    // (its caches then opened afresh at the new epoch, so an eviction has
    // nothing left to hit, or the desynchronised step's answer came for the old
    // route and was dropped, the step sent again), as a route change.
    const auto rc = out.find("route changes ");
    const bool rerouted = rc != std::string::npos && std::atoi(out.c_str() + rc + 14) >= 1;
    EXPECT_TRUE(out.find(runs[i].second) != std::string::npos || (!runs[i].second.empty() && rerouted)) << out;
    if (runs[i].second.empty()) {
      EXPECT_EQ(out.find("cache misses 0"), out.find("cache misses")) << "another client's fault hit this one: " << out;
    }
  }
  return c;
}

// Nodes serving a GGUF file give concurrent clients, faults among them, the
// ids of one process; a node keeping the weights in another type is refused by
// the coordinator.
TEST(Cluster, GgufNodesServeAndAnotherWeightTypeIsRefused) {
  STRATA_REQUIRE_SHARED("models/gguf/rand256-q8_0.gguf");
  const auto model = test::shared_path("models/gguf/rand256-q8_0.gguf");
  const auto cluster = gguf_clients_with_faults_equal_one_process(model);
  Cluster& c = *cluster;
  // A GGUF file is served in its own types: --dtype is refused at start.
  auto node_cmd = [&](const std::string& address, const std::string& m, const std::string& layers,
                      const std::string& dtype) {
    return std::make_unique<Process>(std::vector<std::string>{
      "/bin/sh", "-c",
      exe + " node --listen 127.0.0.1:0 --join " + address + " --model " + m + " --layers " + layers +
        " --threads 1 --dtype " + dtype + " 2>&1"});
  };
  auto bad = node_cmd(c.address, model, "0", "q8_0");
  const auto bad_out = bad->drain();
  EXPECT_NE(bad->wait_exit(std::chrono::seconds(60)), 0);
  EXPECT_NE(bad_out.find("GGUF"), std::string::npos) << bad_out;
  // A node converting to q8_0 meets a cluster serving f32: refused, naming both.
  Cluster d;
  ASSERT_TRUE(d.add_ready("0-2"));
  auto q8 = node_cmd(d.address, "builtin:tiny", "3-4", "q8_0");
  const auto q8_out = q8->drain();
  EXPECT_EQ(q8->wait_exit(std::chrono::seconds(60)), 3);
  EXPECT_NE(q8_out.find("weights q8_0"), std::string::npos) << q8_out;
  EXPECT_NE(q8_out.find("weights f32"), std::string::npos) << q8_out;
}

// The same over llama.cpp's 896-wide Q4_K_M file, whose nodes multiply packed
// q5_0 and q8_0 rows of 28 blocks (pairs of full groups, a full group paired
// with a partial one), packed q6_K and q4_K: five clients at once, three of
// them meeting a fault, each with the ids of one process alone.
TEST(Cluster, PackedQ4KMNodesGiveConcurrentClientsWithFaultsTheIdsOfOneProcess) {
  STRATA_REQUIRE_SHARED("models/gguf/qwen2-w896-rand-q4_k_m.gguf");
  gguf_clients_with_faults_equal_one_process(test::shared_path("models/gguf/qwen2-w896-rand-q4_k_m.gguf"));
}

// The new architectures across processes: a Gemma-3-shaped model (sliding
// windows; its generations run 4x past the window) and a Qwen3-MoE one, each
// split over node processes with a replica, four clients at once, three of them
// meeting a fault (a killed node the replica replaces, an eviction, an epoch
// bump): every client's ids equal llama.cpp's for the same file, and
// `status --json` names the architecture, the experts and the window.
TEST(Cluster, NewArchitecturesAcrossProcessesWithFaultsEqualLlamaCpp) {
  struct Family {
    std::string name;
    std::vector<std::string> layers; // node ranges; the first range has a replica
    std::string kill;                // the fault that kills the replicated range's node
  };
  for (const Family& f : {Family{"gemma3", {"0-1", "0-1", "2"}, "kill:0@20"},
                          Family{"qwen3moe", {"0", "0", "1"}, "kill:0@20"}}) {
    SCOPED_TRACE(f.name);
    const std::string file = "models/gguf/" + f.name + "-rand-f32.gguf";
    STRATA_REQUIRE_SHARED(file);
    const auto model = test::shared_path(file);
    const auto ref = test::read_json(test::shared_path("models/gguf/" + f.name + "-rand.gguf-ref.json"));
    const auto& cases = ref["files"][f.name + "-rand-f32.gguf"];
    ASSERT_GE(cases.size(), 4u);
    Cluster c;
    for (const auto& l : f.layers)
      ASSERT_FALSE(c.add(l, model).wait_line("ready node ").empty());
    const std::vector<std::string> faults = {" --inject " + f.kill, " --inject evict:1@10", " --inject epoch@30", ""};
    std::vector<std::unique_ptr<Process>> clients;
    std::vector<std::string> want;
    for (std::size_t i = 0; i < 4; ++i) {
      std::string ids, expect;
      for (auto id : cases[i]["prompt_ids"])
        ids += (ids.empty() ? "" : ",") + std::to_string(id.get<int>());
      for (auto id : cases[i]["generated_ids"])
        expect += (expect.empty() ? "" : " ") + std::to_string(id.get<int>());
      want.push_back(expect);
      clients.push_back(std::make_unique<Process>(std::vector<std::string>{
        "/bin/sh", "-c",
        exe + " generate --cluster " + c.address + " --prompt-ids " + ids + " --max-tokens " +
          std::to_string(cases[i]["generated_ids"].size()) + " --output ids" + faults[i] + " 2>&1"}));
    }
    for (std::size_t i = 0; i < clients.size(); ++i) {
      const auto out = clients[i]->drain();
      EXPECT_EQ(ids_line(out), want[i]) << "client " << i << " (" << faults[i] << "):\n" << out;
      EXPECT_EQ(clients[i]->wait_exit(), 0);
    }
    const auto st = nlohmann::json::parse(run("status --cluster " + c.address + " --json"));
    EXPECT_EQ(st["architecture"], f.name);
    for (const auto& s : st["shards"]) // every node names the kernel builds its CPU runs
      EXPECT_EQ(s["kernels"], model::kernel_builds());
    if (f.name == "qwen3moe") {
      EXPECT_EQ(st["experts"], 4);
      EXPECT_EQ(st["experts_active"], 2);
    } else {
      EXPECT_EQ(st["sliding_window"], 16);
      EXPECT_EQ(st["window_layers"], 2);
    }
    // ... and so does the OpenAI front door's model list.
    Process serve({exe, "serve", "--cluster", c.address, "--http", "127.0.0.1:0", "--tokenizer", model});
    const auto ready = serve.wait_line("ready http ");
    ASSERT_FALSE(ready.empty());
    Process curl({"/bin/sh", "-c", "curl -s http://" + ready.substr(std::string("ready http ").size()) + "/v1/models"});
    const auto models = nlohmann::json::parse(curl.drain());
    const auto& m = models["data"][0];
    EXPECT_EQ(m["architecture"], f.name);
    if (f.name == "qwen3moe") {
      EXPECT_EQ(m["experts"]["total"], 4);
      EXPECT_EQ(m["experts"]["active"], 2);
      EXPECT_FALSE(m.contains("sliding_window"));
    } else {
      EXPECT_EQ(m["sliding_window"]["size"], 16);
      EXPECT_EQ(m["sliding_window"]["layers"], 2);
      EXPECT_EQ(m["sliding_window"]["of_layers"], 3);
      EXPECT_FALSE(m.contains("experts"));
    }
  }
}

// Clients at once through the cluster at `address`, client i with extra[i]
// (speculation and a fault, or nothing): each one's ids equal the same request
// run alone in one process, and each speculating client says it speculated and
// that its fault was injected.
void speculative_crowd_equals_alone(const std::string& address, const std::vector<std::string>& extra) {
  const std::string text = "--prompt 'the cat sat on the mat, the cat sat on the mat, the cat sat on the' --max-tokens 40 --output ids";
  const auto alone = ids_line(run("generate --model builtin:tiny " + text));
  ASSERT_FALSE(alone.empty());
  std::vector<std::unique_ptr<Process>> clients;
  for (auto& e : extra)
    clients.push_back(std::make_unique<Process>(std::vector<std::string>{
      "/bin/sh", "-c", "exec " + exe + " generate --cluster " + address + " " + text + e + " 2>&1"}));
  for (std::size_t i = 0; i < clients.size(); ++i) {
    const auto out = clients[i]->drain();
    EXPECT_EQ(ids_line(out), alone) << "client " << i << " (" << extra[i] << "):\n" << out;
    EXPECT_EQ(clients[i]->wait_exit(), 0);
    if (extra[i].find("--speculate") != std::string::npos || extra[i].find("--draft-model") != std::string::npos) {
      EXPECT_NE(out.find("[strata] speculation ("), std::string::npos) << out;
    }
    if (extra[i].find("--inject") != std::string::npos) {
      EXPECT_NE(out.find("1 injected failures"), std::string::npos) << out;
    }
  }
}

// Across a simulated network (issue 27): every node behind a `strata
// delay-proxy` at 25 ms one way (so one token's trip crosses 4 delays), the
// nodes told to behave as on separate machines. Four clients at once, three of
// them speculating (by lookup with an eviction, with a draft model and an epoch
// bump, by lookup with hop 1's node killed, each at a step in the middle; a
// replica takes over), one plain: each client's ids equal the same request run alone in
// one process, and the proxies carried the traffic.
TEST(Cluster, ThroughDelayProxiesSpeculativeAndPlainClientsEqualAlone) {
  Cluster c;
  ASSERT_FALSE(c.address.empty());
  std::vector<std::unique_ptr<Process>> proxies;
  for (auto layers : {"0-1", "2-3", "2-3", "4"}) { // 2-3 twice: a replica takes over from the killed one
    const auto port = free_port();
    proxies.push_back(std::make_unique<Process>(std::vector<std::string>{
      "/bin/sh", "-c",
      "exec " + exe + " delay-proxy --listen 127.0.0.1:0 --to 127.0.0.1:" + std::to_string(port) + " --delay-ms 25 2>&1"}));
    const auto ready = proxies.back()->wait_line("ready delay-proxy ");
    ASSERT_FALSE(ready.empty());
    const auto proxy_addr = ready.substr(std::string("ready delay-proxy ").size(), ready.find(" ->") - std::string("ready delay-proxy ").size());
    c.nodes.push_back(std::make_unique<Process>(std::vector<std::string>{
      exe, "node", "--listen", "127.0.0.1:" + std::to_string(port), "--advertise", proxy_addr, "--assume-remote",
      "--join", c.address, "--model", "builtin:tiny", "--layers", layers, "--threads", "1"}));
    ASSERT_FALSE(c.nodes.back()->wait_line("ready node ").empty()) << layers;
  }
  speculative_crowd_equals_alone(c.address, {" --speculate 6 --inject evict:1@12",
                                             " --draft-model builtin:tiny --inject epoch@20",
                                             " --speculate 6 --inject kill:1@16", ""});
  for (auto& p : proxies) {
    p->stop(SIGTERM);
    const auto summary = p->drain();
    const auto at = summary.find("delay-proxy: ");
    ASSERT_NE(at, std::string::npos) << summary;
    EXPECT_GT(std::atoi(summary.c_str() + at + 13), 0) << "connections through the proxy:\n" << summary;
  }
}

TEST(Cluster, SpeculativeClientsThroughOneNodeProcessWithFaultsEqualAlone) {
  // The one-shard pipeline across processes: every layer on one node (and a
  // replica that takes over when it is killed). Four clients at once: lookup
  // with an eviction, the draft model with an epoch bump, lookup with the node
  // killed mid-generation, plain. Each equals the single-process run.
  Cluster c;
  ASSERT_FALSE(c.address.empty());
  ASSERT_TRUE(c.add_ready("0-4"));
  ASSERT_TRUE(c.add_ready("0-4"));
  speculative_crowd_equals_alone(c.address, {" --speculate 6 --inject evict:0@12",
                                             " --draft-model builtin:tiny --inject epoch@20",
                                             " --speculate 6 --inject kill:0@16", ""});
  // Exactly one of the two nodes was killed.
  const int exited = (c.nodes[0]->wait_exit(std::chrono::milliseconds(100)) != -1) +
                     (c.nodes[1]->wait_exit(std::chrono::milliseconds(100)) != -1);
  EXPECT_EQ(exited, 1);
}

TEST(Cluster, NonLoopbackNeedsInsecure) {
  const auto out = run("node --coordinator --listen 0.0.0.0:0");
  EXPECT_NE(out.find("--insecure"), std::string::npos) << out;
}

TEST(Cluster, ForgedFrameHeadersOnAPlainPortAreRefusedWithoutAllocating) {
  Cluster c;
  const auto port = free_port();
  // stderr too: the node says when it refuses a connection.
  Process node({"/bin/sh", "-c",
                "exec " + exe + " node --listen 127.0.0.1:" + std::to_string(port) + " --join " + c.address +
                  " --model builtin:tiny --layers 0-4 --threads 1 2>&1"});
  const auto ready = node.wait_line("ready node ");
  ASSERT_FALSE(ready.empty());
  const long before = rss_kb(node.pid());
  ASSERT_GT(before, 0);
  // 20 connections, each a BASP header claiming 1 GiB or 4 GiB, held open.
  std::vector<int> held;
  for (int i = 0; i < 20; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    unsigned char hdr[32] = {};
    hdr[0] = 1; // client handshake
    if (i % 2 == 0)
      hdr[4] = 0x40; // 1 GiB
    else
      hdr[4] = hdr[5] = hdr[6] = hdr[7] = 0xff; // 4 GiB - 1
    ASSERT_EQ(::send(fd, hdr, sizeof hdr, MSG_NOSIGNAL), 32);
    held.push_back(fd);
  }
  for (int i = 0; i < 20; ++i)
    ASSERT_FALSE(node.wait_containing("refused a TCP connection whose frame announces").empty()) << i;
  const long after = rss_kb(node.pid());
  std::printf("node RSS %ld kB before, %ld kB with 20 forged headers held open\n", before, after);
  EXPECT_LT(after - before, 64 * 1024) << "RSS grew from " << before << " kB to " << after << " kB";
  // Alive, the same incarnation (not declared dead and restarted), and serving.
  EXPECT_EQ(ids_line(run("generate --cluster " + c.address + " " + prompt)), local_ids());
  const auto status = run("status --cluster " + c.address);
  EXPECT_NE(status.find(node_id(ready)), std::string::npos) << status;
  for (int fd : held)
    ::close(fd);
}

TEST(Cluster, TlsClusterEqualsPlainAndRefusesStrangers) {
  if (!have_openssl())
    GTEST_SKIP() << "the openssl command is not installed";
  TlsCluster c;
  ASSERT_FALSE(c.address.empty());
  const auto client = flat(tls_args(c.dir, "client"));
  // Three clients in a row (each exits without a TLS close): identical output, and
  // the nodes stay registered as they were (no node was dropped).
  const auto expected = local_ids();
  for (int i = 0; i < 3; ++i) {
    const auto out = run("generate --cluster " + c.address + client + " " + prompt);
    EXPECT_EQ(ids_line(out), expected) << "client " << i << " printed:\n" << out; // the whole story when it fails
  }
  const auto status = run("status --cluster " + c.address + client);
  EXPECT_NE(status.find("shard nodes 3"), std::string::npos) << status;
  for (auto& n : c.nodes)
    EXPECT_TRUE(n->last_line("ready node ").empty()) << "a node registered again";
  // Refused at the handshake, before any message is decoded: no certificate,
  // a certificate from another CA, an expired certificate.
  for (const auto& who : {std::string(), flat(tls_args(c.dir, "rogue", "ca")), flat(tls_args(c.dir, "expired"))}) {
    const auto out = run("status --cluster " + c.address + who);
    EXPECT_NE(out.find("disconnect_during_handshake"), std::string::npos) << who << ": " << out;
  }
  // A node with a rogue certificate says why it cannot join, and is not listed.
  Process rogue({"/bin/sh", "-c",
                 exe + " node --listen 127.0.0.1:0 --join " + c.address + " --model builtin:tiny --layers 0-1" +
                   flat(tls_args(c.dir, "rogue", "rogue")) + " 2>&1"});
  EXPECT_FALSE(rogue.wait_containing("node: cannot reach the coordinator").empty());
  EXPECT_NE(run("status --cluster " + c.address + client).find("shard nodes 3"), std::string::npos);
}

TEST(Cluster, TlsNodeBackAsNewIncarnationUnderConcurrentClientsChangesNoToken) {
  // Three TLS clients at once; one freezes the node of hop 0 at its token 10
  // past the liveness bound, so that node comes back as a new process (a new
  // node id, the same address) while every session is mid-generation, and the
  // other nodes learn of it in the same route push. Each client's ids equal the
  // same request alone. (Both ends of a node pair once connected to each other
  // at that moment; CAF could drop both half-made TLS links, and a client whose
  // steps were relayed between the pair got request_receiver_down until it gave
  // up: one run in four on a loaded machine.)
  if (!have_openssl())
    GTEST_SKIP() << "the openssl command is not installed";
  TlsCluster c;
  ASSERT_FALSE(c.address.empty());
  const std::string gen = "generate --cluster " + c.address + flat(tls_args(c.dir, "client")) +
                          " --prompt-ids 1,2,3 --max-tokens 300 --output ids";
  const auto alone = ids_line(run("generate --model builtin:tiny --prompt-ids 1,2,3 --max-tokens 300 --output ids"));
  ASSERT_FALSE(alone.empty());
  const std::vector<std::string> faults = {"", "--inject freeze:0@10", ""};
  std::vector<std::unique_ptr<Process>> clients;
  for (auto& f : faults)
    clients.push_back(
      std::make_unique<Process>(std::vector<std::string>{"/bin/sh", "-c", "exec " + exe + " " + gen + " " + f + " 2>&1"}));
  for (std::size_t i = 0; i < clients.size(); ++i) {
    const auto out = clients[i]->drain();
    EXPECT_EQ(ids_line(out), alone) << "client " << i << " (" << faults[i] << ") printed:\n" << out;
    EXPECT_EQ(clients[i]->wait_exit(), 0);
  }
  // The frozen node did come back as a new incarnation and serves.
  EXPECT_FALSE(c.nodes[0]->last_line("ready node ").empty()) << "node 0 never registered again";
  const auto out = run("generate --cluster " + c.address + flat(tls_args(c.dir, "client")) + " " + prompt);
  EXPECT_EQ(ids_line(out), local_ids()) << out;
}

TEST(Cluster, ForgedFramesOnATlsPortLeaveTheNodeServingWithBoundedMemory) {
  if (!have_openssl())
    GTEST_SKIP() << "the openssl command is not installed";
  TlsCluster c;
  const pid_t node = c.nodes[0]->pid();
  const long before = rss_kb(node);
  ASSERT_GT(before, 0);
  std::mt19937 rng(7);
  for (int round = 0; round < 20; ++round) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(c.ports[0]);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    // A BASP header (operation, padding, payload length, operation data, source,
    // destination) claiming a 4 GiB payload, then random bytes and a truncation.
    unsigned char hdr[32] = {};
    hdr[0] = static_cast<unsigned char>(round % 8);
    hdr[4] = hdr[5] = hdr[6] = hdr[7] = 0xff;
    std::string junk(reinterpret_cast<char*>(hdr), sizeof hdr);
    for (int i = 0; i < 4096; ++i)
      junk += static_cast<char>(rng());
    (void)!::send(fd, junk.data(), junk.size() - (round % 3) * 100, MSG_NOSIGNAL);
    ::close(fd);
  }
  // Still serving its cluster, and it did not allocate for the lying lengths.
  EXPECT_EQ(ids_line(run("generate --cluster " + c.address + flat(tls_args(c.dir, "client")) + " " + prompt)),
            local_ids());
  const long after = rss_kb(node);
  std::printf("node RSS %ld kB before, %ld kB after 20 forged connections\n", before, after);
  EXPECT_LT(after - before, 64 * 1024) << "RSS grew from " << before << " kB to " << after << " kB";
}

TEST(Cluster, ForgedFrameHeadersFromACertificateHolderAreRefused) {
  if (!have_openssl())
    GTEST_SKIP() << "the openssl command is not installed";
  TlsCluster c;
  const pid_t node = c.nodes[0]->pid();
  const long before = rss_kb(node);
  // A peer with a valid cluster certificate completes the TLS handshake, then
  // sends a BASP header claiming 4 GiB (and keeps the connection open a while).
  const auto args = tls_args(c.dir, "client");
  const std::string cmd = "(printf '\\001\\000\\000\\000\\377\\377\\377\\377'; head -c 24 /dev/zero; sleep 3) | "
                          "openssl s_client -quiet -connect 127.0.0.1:" + std::to_string(c.ports[0]) + " -cert " +
                          args[1] + " -key " + args[3] + " -CAfile " + args[5] + " >/dev/null 2>&1";
  std::vector<std::unique_ptr<Process>> forgers;
  for (int i = 0; i < 5; ++i)
    forgers.push_back(std::make_unique<Process>(std::vector<std::string>{"/bin/sh", "-c", cmd}));
  for (auto& f : forgers)
    f->wait_exit(std::chrono::seconds(20));
  const long after = rss_kb(node);
  std::printf("node RSS %ld kB before, %ld kB after 5 forged TLS frames\n", before, after);
  EXPECT_LT(after - before, 64 * 1024) << "RSS grew from " << before << " kB to " << after << " kB";
  EXPECT_EQ(ids_line(run("generate --cluster " + c.address + flat(tls_args(c.dir, "client")) + " " + prompt)),
            local_ids());
  EXPECT_EQ(c.nodes[0]->wait_exit(std::chrono::milliseconds(10)), -1) << "the node is still running";
}

} // namespace
} // namespace strata
