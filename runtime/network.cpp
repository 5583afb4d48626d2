// How a process reaches a cluster: endpoints, the actor system of a cluster process
// (liveness, TLS), connecting to the coordinator, and the options for all of that.

#include "runtime/cluster.hpp"

#include "model/base/error.hpp"
#include "runtime/args.hpp"
#include "runtime/log.hpp"
#include "runtime/peers.hpp"

#include <caf/openssl/all.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <unistd.h>

namespace strata::runtime {

using namespace std::chrono_literals;

Endpoint parse_endpoint(const std::string& text, const std::string& option) {
  const auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size())
    throw UsageError("--" + option + " expects HOST:PORT, got '" + text + "'");
  Endpoint ep;
  ep.host = text.substr(0, colon);
  const std::string p = text.substr(colon + 1);
  char* end = nullptr;
  const long v = std::strtol(p.c_str(), &end, 10);
  if (*end != '\0' || v < 0 || v > 65535)
    throw UsageError("--" + option + ": '" + p + "' is not a port number (0-65535)");
  ep.port = static_cast<uint16_t>(v);
  return ep;
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1" || host == "[::1]";
}

cluster_config::cluster_config(Liveness l, const Tls& tls) {
  load<caf::io::middleman>();
  set("middleman.heartbeat-interval", caf::timespan{l.heartbeat});
  set("middleman.connection-timeout", caf::timespan{l.dead_after});
  if (tls.enabled()) {
    load<caf::openssl::manager>(); // after the middleman
    set("openssl.certificate", tls.cert);
    set("openssl.key", tls.key);
    set("openssl.cafile", tls.ca);
  }
  // Never CAF's automatic connections: they open a second listener on every
  // interface of every process. Direct connections come from runtime/peers.
  set("middleman.enable-automatic-connections", false);
}

caf::actor_system& client_system(Liveness l, const Tls& tls) {
  struct Client {
    cluster_config cfg;
    caf::actor_system sys;
    Client(Liveness l, const Tls& tls) : cfg(l, tls), sys(cfg) {}
  };
  return (new Client(l, tls))->sys; // deliberately never destroyed
}

void end_process(int code) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  std::_Exit(code);
}

caf::expected<msg::supervisor_actor> try_connect(caf::actor_system& sys, const Endpoint& ep,
                                                 std::chrono::milliseconds within) {
  // CAF's remote_actor waits for the TLS and BASP handshakes without a limit: a
  // coordinator that accepts the connection but never completes them would hold
  // this process forever. The same request to the middleman, with a deadline.
  auto mm = sys.has_openssl_manager() ? sys.openssl_manager().actor_handle() : sys.middleman().actor_handle();
  auto f = caf::make_function_view(mm, caf::duration{within});
  auto x = f(caf::connect_atom_v, ep.host, ep.port);
  if (!x)
    return std::move(x.error());
  auto& [nid, ptr, ifs] = *x;
  if (!ptr)
    return caf::sec::no_actor_published_at_port;
  if (!sys.assignable(ifs, sys.message_types<msg::supervisor_actor>()))
    return caf::sec::unexpected_actor_messaging_interface;
  return caf::actor_cast<msg::supervisor_actor>(std::move(ptr));
}

namespace {

// try_connect on fresh connections until `within` has passed: each attempt
// bounded by what is left (at least 100 ms, at most `cap`), `pause` after each
// failed one; ends at the first error that again(error, attempts so far)
// declines, or with the last error once less than 100 ms is left.
template <class Again>
caf::expected<msg::supervisor_actor> connect_within(caf::actor_system& sys, const Endpoint& ep,
                                                    std::chrono::milliseconds within, std::chrono::milliseconds cap,
                                                    std::chrono::milliseconds pause, Again&& again) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  caf::expected<msg::supervisor_actor> sup = caf::sec::request_timeout;
  for (int attempts = 0;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (attempts > 0 && left < 100ms)
      return sup;
    sup = try_connect(sys, ep, std::clamp(left, 100ms, std::max(cap, 100ms)));
    ++attempts;
    if (sup || !again(sup.error(), attempts))
      return sup;
    caf::scoped_actor wait{sys}; // a short back-off: a quick failure must not spin
    wait->receive(caf::after(pause) >> [] {});
  }
}

} // namespace

msg::supervisor_actor reconnect_coordinator(caf::actor_system& sys, const Endpoint& ep, std::chrono::milliseconds within) {
  auto sup = connect_within(sys, ep, within, within, 200ms, [](const caf::error&, int) { return true; });
  if (!sup)
    return msg::supervisor_actor{};
  spawn_peer_connector(sys, *sup);
  return *sup;
}

msg::supervisor_actor connect_coordinator(caf::actor_system& sys, const Endpoint& ep) {
  // A handshake that stalls is tried again on fresh connections for up to 15 s:
  // the coordinator accepted but did not answer within 5 s, or not before the
  // next heartbeat tick (CAF closes a connection whose handshake has not
  // answered by then with connection_timeout: 0-200 ms by default, which a
  // coordinator starved of CPU on a loaded machine can miss). A refusal is final.
  const auto stalled = [](const caf::error& e) {
    return e == caf::sec::request_timeout || e == caf::sec::connection_timeout;
  };
  constexpr auto window = 15s;
  int attempts = 0;
  auto sup = connect_within(sys, ep, window, 5s, 100ms, [&](const caf::error& e, int n) {
    attempts = n;
    if (!stalled(e))
      return false;
    (n == 1 ? log::warn : log::debug)("the coordinator at " + ep.host + ":" + std::to_string(ep.port) +
                                      " accepted the connection but did not complete the handshake (" +
                                      sys.render(e) + "); trying again on a fresh connection");
    return true;
  });
  if (!sup) {
    throw model::Error(model::errc::io, "cannot reach the coordinator at " + ep.host + ":" + std::to_string(ep.port) +
                                          ": " +
                                          (stalled(sup.error())
                                             ? "it accepted the connection but did not complete the handshake (" +
                                                 std::to_string(attempts) + " attempts in " +
                                                 std::to_string(window.count()) + " s; the last: " +
                                                 sys.render(sup.error()) + ")"
                                             : sys.render(sup.error())));
  }
  spawn_peer_connector(sys, *sup); // direct connections to the shard nodes
  return *sup;
}

void add_network_options(Args& a) {
  a.option("heartbeat-ms", "MS", "heartbeat interval between processes (default 200)")
    .option("dead-after-ms", "MS", "a silent peer is declared dead after this (default 1500)")
    .option("tls-cert", "FILE", "mutual TLS: this process's certificate (PEM; see 'strata certs')")
    .option("tls-key", "FILE", "mutual TLS: its private key (PEM)")
    .option("tls-ca", "FILE", "mutual TLS: the cluster CA certificate peers must be signed by");
  log::add_options(a);
}

Liveness liveness_from(const Args& a) {
  Liveness l;
  l.heartbeat = std::chrono::milliseconds(a.integer("heartbeat-ms", 200, 10, 60000));
  l.dead_after = std::chrono::milliseconds(a.integer("dead-after-ms", 1500, 50, 600000));
  if (l.dead_after <= l.heartbeat)
    throw UsageError("--dead-after-ms must be larger than --heartbeat-ms");
  return l;
}

Tls tls_from(const Args& a) {
  Tls t{a.str("tls-cert"), a.str("tls-key"), a.str("tls-ca")};
  const int given = !t.cert.empty() + !t.key.empty() + !t.ca.empty();
  if (given == 0)
    return t;
  if (given != 3)
    throw UsageError("TLS needs all three of --tls-cert, --tls-key and --tls-ca");
  for (auto [opt, path] : {std::pair{"tls-cert", t.cert}, {"tls-key", t.key}, {"tls-ca", t.ca}})
    if (::access(path.c_str(), R_OK) != 0)
      throw UsageError(std::string("--") + opt + ": cannot read '" + path + "'");
  return t;
}

} // namespace strata::runtime
