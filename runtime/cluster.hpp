#pragma once
// strata across processes: `strata node` (a coordinator hosting the route
// supervisor, or a shard node that loads its layer range, publishes its shard
// actor and registers with the coordinator), and the client side used by
// `strata generate --cluster`, `strata status` and `strata inject`.
// Transport is CAF's io module (BASP over TCP); heartbeats detect frozen peers.
// Implemented by purpose: network.cpp (endpoints, the actor system of a cluster
// process, connecting, the network options), node.cpp (`strata node`),
// cluster_client.cpp (a client's view of the cluster, remote injections) and
// status_commands.cpp (`strata status`, `strata inject`).

#include "actors/cluster.hpp"
#include "runtime/args.hpp"

#include <caf/all.hpp>
#include <caf/io/all.hpp>

#include <chrono>
#include <cstdint>
#include <string>

namespace strata::runtime {

struct Endpoint {
  std::string host;
  uint16_t port = 0;
};

/// "HOST:PORT" (port 0 = any free port). Throws UsageError.
Endpoint parse_endpoint(const std::string& text, const std::string& option);
bool is_loopback(const std::string& host);

/// Liveness settings every process of a cluster must share.
struct Liveness {
  std::chrono::milliseconds heartbeat{200};
  std::chrono::milliseconds dead_after{1500}; ///< a silent peer is declared dead after this
};

/// Mutual TLS between processes (CAF's OpenSSL module): this process's
/// certificate and key, and the cluster CA that every peer's certificate must
/// be signed by. All three or none; every process of a cluster uses the same mode.
struct Tls {
  std::string cert, key, ca;
  bool enabled() const { return !cert.empty(); }
};

/// Adds --heartbeat-ms, --dead-after-ms, --tls-cert, --tls-key, --tls-ca.
void add_network_options(Args& a);
Liveness liveness_from(const Args& a);
/// --dtype as LoadOptions (with a progress line while loading).
model::LoadOptions load_options_from(const Args& a);
/// Throws UsageError unless all three files are given and readable (or none).
Tls tls_from(const Args& a);

/// An actor_system_config with strata's types, the middleman and heartbeats;
/// with TLS, the OpenSSL module (and no automatic connections: CAF 0.17 makes
/// those over plain TCP, so traffic between nodes is relayed over the TLS links).
struct cluster_config : actors::actor_config {
  explicit cluster_config(Liveness l = {}, const Tls& tls = {});
};

/// The actor system of a process that talks to a cluster as a client (generate,
/// status, inject, the example actor). It is never destroyed: CAF 0.17's
/// ~actor_system waits for every actor a peer has seen to be released, which a
/// peer may never do, so clients end through end_process() instead.
caf::actor_system& client_system(Liveness l = {}, const Tls& tls = {});

/// Flushes stdout/stderr and ends the process with `code` without running
/// destructors (see client_system). main() ends every `strata` command this way.
[[noreturn]] void end_process(int code);

/// `strata node ...`; returns the process exit code.
int run_node(int argc, char** argv);
/// `strata status ...`
int run_status(int argc, char** argv);
/// `strata inject ...`
int run_inject(int argc, char** argv);

/// Connects to a coordinator and returns its supervisor. Throws model::Error(io).
/// Uses TLS when the system was configured with it.
msg::supervisor_actor connect_coordinator(caf::actor_system& sys, const Endpoint& ep);
/// The same without throwing; gives up (sec::request_timeout) when the TCP, TLS
/// and BASP handshakes have not completed `within`.
caf::expected<msg::supervisor_actor> try_connect(caf::actor_system& sys, const Endpoint& ep,
                                                 std::chrono::milliseconds within = std::chrono::milliseconds(10000));
/// After a coordinator restart: tries to connect every 200 ms until `within` has
/// passed; returns the new supervisor, or an invalid handle.
msg::supervisor_actor reconnect_coordinator(caf::actor_system& sys, const Endpoint& ep,
                                            std::chrono::milliseconds within = std::chrono::milliseconds(10000));

/// One request to a remote actor (the coordinator's supervisor) that waits for
/// its reply at most `timeout`, and no longer than it takes to learn that the
/// actor's process went away: a helper actor monitors `dest` and answers with
/// ec::cluster_lost when it goes down (a request already sent to a process that
/// dies would otherwise wait out its whole timeout).
template <class Reply, class Dest, class... Ts>
caf::expected<Reply> ask_watched(caf::actor_system& sys, const Dest& dest, std::chrono::milliseconds timeout, Ts... xs) {
  auto helper = sys.spawn([=](caf::event_based_actor* self) -> caf::behavior {
    return {[=](atom::tick_atom) -> caf::result<Reply> {
      auto rp = std::make_shared<caf::typed_response_promise<Reply>>(self->make_response_promise<Reply>());
      self->monitor(dest);
      self->set_down_handler([=](caf::down_msg&) {
        if (rp->pending())
          rp->deliver(caf::make_error(ec::cluster_lost, "the coordinator went away"));
        self->quit();
      });
      self->request(dest, timeout, xs...)
        .then(
          [=](Reply& r) {
            if (rp->pending())
              rp->deliver(std::move(r));
            self->quit();
          },
          [=](caf::error& e) {
            if (rp->pending())
              rp->deliver(std::move(e));
            self->quit();
          });
      return *rp;
    }};
  });
  caf::scoped_actor self{sys};
  caf::expected<Reply> out{caf::error{}};
  self->request(helper, caf::infinite, atom::tick_atom_v)
    .receive([&](Reply& r) { out = std::move(r); }, [&](caf::error& e) { out = std::move(e); });
  return out;
}

/// A registered shard with its stats (answered = it replied within 2 s).
struct ShardView {
  msg::hop hop;
  msg::shard_stats stats;
  bool answered = false;
};

/// The supervisor's view: epoch, recipe and every registered shard (in
/// registration order, not a chain). Throws model::Error(io) if the coordinator
/// does not answer within 10 s.
msg::route_info cluster_view(caf::actor_system& sys, msg::supervisor_actor sup);

/// The cluster's model as its shard nodes reported it (no model files needed).
/// Throws model::Error(io) if the coordinator does not answer within 10 s, and
/// model::Error(bad_argument) when no shard node has registered yet.
msg::model_facts cluster_model(caf::actor_system& sys, msg::supervisor_actor sup);
/// The supervisor's whole status (recipe, shards with their stats). Throws model::Error(io).
msg::cluster_status cluster_status(caf::actor_system& sys, msg::supervisor_actor sup);

/// Every registered shard, in registration order, with its stats; `all` gets
/// the supervisor's view (epoch, recipe). Throws model::Error(io) if the
/// coordinator does not answer within 10 s.
std::vector<ShardView> list_shards(caf::actor_system& sys, msg::supervisor_actor sup, msg::route_info& all);

/// `strata inject`: kind kill|freeze|evict|epoch against node `node` (an index
/// from `strata status` or a node id); evict drops `session` ("" = all). Returns
/// what was done, one line. Throws model::Error naming what is wrong.
std::string inject_node(caf::actor_system& sys, msg::supervisor_actor sup, const std::string& kind, const std::string& node,
                        const std::string& session, int64_t seconds);

/// Applies an injection against a cluster of processes: hop I is looked up in
/// the supervisor's current plan.
void apply_remote_injection(caf::actor_system& sys, msg::supervisor_actor supervisor, const actors::Injection& inj,
                            const std::string& session);

} // namespace strata::runtime
