// Clients whose cluster disappears, and strangers that connect to every port
// with garbage or say nothing at all: a client ends with a typed error in time
// whatever phase it was in, and legitimate generations stay exact.

#include "runtime/delay_proxy.hpp"
#include "tests/cluster/cluster_support.hpp"

#include <chrono>
#include <future>
#include <random>
#include <thread>

namespace strata {
namespace {

using namespace clustertest;
using clk = std::chrono::steady_clock;

// A client process: when it exited, with what code and output.
struct Client {
  std::unique_ptr<Process> p;
  explicit Client(const std::string& args) : p(std::make_unique<Process>(std::vector<std::string>{"/bin/sh", "-c", "exec " + exe + " " + args + " 2>&1"})) {}
};

// Kills every process of a cluster at once (kill -9: no goodbye on any connection).
void kill_all(std::unique_ptr<Process>& coordinator, std::vector<std::unique_ptr<Process>>& nodes) {
  coordinator->signal(SIGKILL);
  for (auto& n : nodes)
    n->signal(SIGKILL);
}

// How long after the kill the client exited, with its output (-1: still running after 30 s).
std::pair<double, std::string> exit_after_kill(Client& c, clk::time_point killed) {
  const int code = c.p->wait_exit(std::chrono::seconds(30));
  const double s = std::chrono::duration<double>(clk::now() - killed).count();
  const auto out = c.p->drain();
  EXPECT_EQ(code, 1) << out;
  return {code < 0 ? -1.0 : s, out};
}

// The route wait the clients are given, and what "in time" means for them.
constexpr int route_wait_ms = 2000;
constexpr double in_time_s = route_wait_ms / 1000.0 + 2.0;

void lost_cluster_case(bool tls) {
  std::string dir;
  std::unique_ptr<Process> coordinator;
  std::vector<std::unique_ptr<Process>> nodes;
  std::string address, client;
  if (tls) {
    auto c = std::make_unique<TlsCluster>();
    dir = c->dir;
    address = c->address;
    coordinator = std::move(c->coordinator);
    nodes = std::move(c->nodes);
    client = flat(tls_args(dir, "client"));
  } else {
    Cluster c;
    address = c.address;
    ASSERT_TRUE(c.add_ready("0-1"));
    ASSERT_TRUE(c.add_ready("2-4"));
    coordinator = std::move(c.coordinator);
    nodes = std::move(c.nodes);
  }
  ASSERT_FALSE(address.empty());
  // Mid-generation: at token 10 each client freezes a node for 3 s (the
  // session waits on it), and the whole cluster is killed meanwhile. Three
  // clients at once: a crowd. Each asks for as many tokens as the model's
  // context holds (512 with the prompt): every freeze stalls every client, and
  // on a loaded machine the last one reached token 10 only after the other two
  // had generated all of 300 tokens and exited (a fresh-root run, 2026-12-06).
  const std::string gen = "generate --cluster " + address + client + " --route-wait-ms " + std::to_string(route_wait_ms) +
                          " --prompt-ids 1,2,3 --max-tokens 509 --output ids";
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < 3; ++i)
    clients.push_back(std::make_unique<Client>(gen + " --inject freeze:" + std::to_string(i % 2) + "@10"));
  // Each client says when it froze its node at token 10 (a frozen node stalls
  // every session on it for 3 s): once all three have, all three are
  // mid-generation, however long a loaded machine took to start them (a fixed
  // 2.5 s once missed a TLS client still in its handshake).
  for (auto& c : clients)
    ASSERT_FALSE(c->p->wait_line("[strata] injected freeze", std::chrono::seconds(60)).empty())
      << "a client never reached token 10:\n" << c->p->drain();
  kill_all(coordinator, nodes);
  const auto killed = clk::now();
  for (auto& c : clients) {
    auto [s, out] = exit_after_kill(*c, killed);
    std::printf("%s client, cluster killed mid-generation: exited %.2f s after the kill: %s\n", tls ? "TLS" : "plain", s,
                out.substr(out.rfind("error:") == std::string::npos ? 0 : out.rfind("error:")).c_str());
    EXPECT_GE(s, 0) << "still running 30 s after its cluster died";
    EXPECT_LE(s, in_time_s) << out;
    EXPECT_NE(out.find("cluster_lost"), std::string::npos) << out;
  }
}

TEST(LostCluster, AClientMidGenerationEndsWithClusterLostWithinTheRouteWait) {
  lost_cluster_case(false);
}

TEST(LostCluster, ATlsClientMidGenerationEndsWithClusterLostWithinTheRouteWait) {
  if (!have_openssl())
    GTEST_SKIP() << "the openssl command is not installed";
  lost_cluster_case(true);
}

TEST(LostCluster, AClientWaitingForARouteEndsWhenTheCoordinatorGoes) {
  // Only layers 0-1 are served: the coordinator holds the route request for its
  // route wait (15 s); it dies once the client has asked (the client says so at
  // debug level: a slow client start no longer turns this into a failed connect).
  Cluster c;
  ASSERT_TRUE(c.add_ready("0-1"));
  Client waiting("generate --cluster " + c.address + " --route-wait-ms " + std::to_string(route_wait_ms) +
                 " --log-level debug --prompt-ids 1,2,3 --max-tokens 20 --output ids");
  ASSERT_FALSE(waiting.p->wait_containing("asking it for a route").empty()) << "the client never connected";
  kill_all(c.coordinator, c.nodes);
  auto [s, out] = exit_after_kill(waiting, clk::now());
  std::printf("client waiting for a route: exited %.2f s after the coordinator died\n", s);
  EXPECT_GE(s, 0);
  EXPECT_LE(s, in_time_s) << out;
  EXPECT_NE(out.find("cluster_lost"), std::string::npos) << out;
}

// ---------------------------------------------------------------- strangers

uint16_t port_of(const std::string& address) {
  return static_cast<uint16_t>(std::atoi(address.c_str() + address.rfind(':') + 1));
}

// One round of strangers on `ports`: connections that send random bytes (some
// a TLS or BASP-looking start, some cut short) and close, and connections that
// open and say nothing (returned, to be closed after the round).
std::vector<int> strangers(const std::vector<uint16_t>& ports, std::mt19937& rng) {
  std::vector<int> half_open;
  for (auto port : ports) {
    for (int k = 0; k < 10; ++k) {
      const int fd = test::connect_to(port);
      if (fd < 0)
        continue;
      std::string junk(1 + rng() % 3000, '\0');
      for (auto& ch : junk)
        ch = static_cast<char>(rng());
      if (k % 3 == 0)
        junk.replace(0, 3, "\x16\x03\x01"); // a TLS handshake record's start
      else if (k % 3 == 1)
        junk[0] = 1; // a BASP handshake's type
      (void)!::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
      ::close(fd);
    }
    for (int k = 0; k < 3; ++k)
      if (const int fd = test::connect_to(port); fd >= 0)
        half_open.push_back(fd);
  }
  return half_open;
}

TEST(HostilePeers, GarbageAndSilentConnectionsOnEveryPortNeverDisturbLegitimateGenerations) {
  // A TLS cluster and a plain one (with `strata serve` in front): 4 rounds of
  // strangers on every port, each round with legitimate generations in flight
  // (two TLS clients, a plain client and an HTTP completion at once).
  if (!have_openssl())
    GTEST_SKIP() << "the openssl command is not installed";
  TlsCluster t;
  ASSERT_FALSE(t.address.empty());
  Cluster p;
  ASSERT_TRUE(p.add_ready("0-4"));
  Process serve({exe, "serve", "--cluster", p.address, "--http", "127.0.0.1:0"});
  const auto http = serve.wait_line("ready http ");
  ASSERT_FALSE(http.empty());
  std::vector<uint16_t> ports = {port_of(t.address), port_of(p.address), port_of(http)};
  for (auto port : t.ports)
    ports.push_back(port);
  const auto expected = local_ids();
  ASSERT_FALSE(expected.empty());
  const std::string tls_gen = "generate --cluster " + t.address + flat(tls_args(t.dir, "client")) + " " + prompt;
  const std::string plain_gen = "generate --cluster " + p.address + " " + prompt;
  const std::string completion = "curl -s -m 60 --data-binary '{\"prompt\": \"Once upon a time\", \"max_tokens\": 12, "
                                 "\"temperature\": 0}' http://" + http.substr(11) + "/v1/completions";
  const auto http_expected = run("generate --model builtin:tiny --prompt 'Once upon a time' --max-tokens 12");
  std::mt19937 rng(2024);
  int exact = 0, total = 0;
  const int rounds = 4; // docs/security.md: 20 rounds measured by hand, 80 of 80 exact
  for (int round = 0; round < rounds; ++round) {
    auto a = std::async(std::launch::async, [&] { return run(tls_gen); });
    auto b = std::async(std::launch::async, [&] { return run(tls_gen); });
    auto c = std::async(std::launch::async, [&] { return run(plain_gen); });
    auto d = std::async(std::launch::async, [&] {
      Process curl({"/bin/sh", "-c", completion});
      return curl.drain();
    });
    const auto held = strangers(ports, rng);
    for (auto* f : {&a, &b, &c}) {
      const auto out = f->get();
      const auto ids = ids_line(out);
      ++total;
      exact += ids == expected;
      EXPECT_EQ(ids, expected) << "round " << round << ":\n" << out;
    }
    const auto body = d.get();
    ++total;
    const bool http_ok = body.find("\"text\"") != std::string::npos &&
                         http_expected.find(nlohmann::json::parse(body, nullptr, false)["choices"][0]["text"].get<std::string>()) !=
                           std::string::npos;
    exact += http_ok;
    EXPECT_TRUE(http_ok) << "round " << round << ": " << body;
    for (int fd : held)
      ::close(fd);
  }
  std::printf("%d of %d generations exact across %d rounds of strangers on %zu ports\n", exact, total, rounds,
              ports.size());
  // Every node is still the incarnation it was (none was declared dead).
  for (auto& n : t.nodes)
    EXPECT_TRUE(n->last_line("ready node ").empty()) << "a node registered again";
}

TEST(HostilePeers, AClientWhoseHandshakeStallsTriesAgainOnAFreshConnection) {
  // The coordinator's side of the first handshakes is held 3 s (a proxy in
  // front of it, what a coordinator starved of CPU looks like): CAF closes each
  // connection at its next heartbeat tick (connection_timeout). Three clients at
  // once: each says so and tries again on a fresh connection, which the proxy
  // now passes on at once, and each generates the ids of the same request alone.
  Cluster c;
  ASSERT_TRUE(c.add_ready("0-4"));
  runtime::DelayProxyOptions o;
  o.target_port = port_of(c.address);
  o.delay = std::chrono::seconds(3);
  runtime::DelayProxy proxy(o);
  constexpr int n = 3;
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < n; ++i)
    clients.push_back(std::make_unique<Client>("generate --cluster 127.0.0.1:" + std::to_string(proxy.port()) + " " + prompt));
  std::vector<bool> warned;
  for (auto& cl : clients) // every first handshake stalled before any is let through
    warned.push_back(!cl->p->wait_containing("trying again on a fresh connection").empty());
  proxy.set_delay(std::chrono::microseconds(0));
  const auto expected = local_ids();
  for (int i = 0; i < n; ++i) {
    auto& cl = *clients[static_cast<std::size_t>(i)];
    EXPECT_TRUE(warned[static_cast<std::size_t>(i)]) << "client " << i << "'s first handshake did not stall";
    EXPECT_EQ(cl.p->wait_exit(std::chrono::seconds(60)), 0) << "client " << i;
    const auto out = cl.p->drain();
    EXPECT_EQ(ids_line(out), expected) << "client " << i << ":\n" << out;
  }
  EXPECT_GE(proxy.connections(), static_cast<uint64_t>(2 * n));
}

} // namespace
} // namespace strata
