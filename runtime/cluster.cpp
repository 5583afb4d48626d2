#include "runtime/cluster.hpp"

#include "actors/shard_actor.hpp"
#include "model/base/error.hpp"
#include "runtime/args.hpp"
#include "runtime/frame_guard.hpp"
#include "runtime/log.hpp"
#include "runtime/peers.hpp"

#include <caf/openssl/all.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
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

caf::expected<msg::supervisor_actor> try_connect(caf::actor_system& sys, const Endpoint& ep) {
  if (sys.has_openssl_manager())
    return caf::openssl::remote_actor<msg::supervisor_actor>(sys, ep.host, ep.port);
  return sys.middleman().remote_actor<msg::supervisor_actor>(ep.host, ep.port);
}

msg::supervisor_actor reconnect_coordinator(caf::actor_system& sys, const Endpoint& ep, std::chrono::seconds within) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < deadline) {
    if (auto sup = try_connect(sys, ep)) {
      spawn_peer_connector(sys, *sup);
      return *sup;
    }
    caf::scoped_actor pause{sys}; // back off before the next attempt
    pause->receive(caf::after(200ms) >> [] {});
  }
  return msg::supervisor_actor{};
}

msg::supervisor_actor connect_coordinator(caf::actor_system& sys, const Endpoint& ep) {
  auto sup = try_connect(sys, ep);
  if (!sup)
    throw model::Error(model::errc::io, "cannot reach the coordinator at " + ep.host + ":" + std::to_string(ep.port) +
                                          ": " + sys.render(sup.error()));
  spawn_peer_connector(sys, *sup); // direct connections to the shard nodes
  return *sup;
}

namespace {

// ---------------------------------------------------------------- signals

std::atomic<int> node_exit_code{0};

// Blocks SIGINT/SIGTERM in this thread (and every thread started later), so that
// the main thread can wait for them with sigwait.
sigset_t block_stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

// Ends the node from any thread: main wakes from sigwait.
void stop_node(int code) {
  node_exit_code = code;
  ::kill(::getpid(), SIGTERM);
}

// ---------------------------------------------------------------- incarnations

// A node that its coordinator declared dead (frozen, or cut off longer than the
// liveness bound) must not come back under the same CAF node id: its peers
// buried that id, and CAF 0.17 does not reliably route to a node id again after
// its connection was dropped (actor-framework issue #546). Such a node exits
// with this code and comes back as a new process (new pid, so new node id): the
// original process turns into a small waiter that starts and watches workers,
// so the pid that whoever started the node holds keeps standing for the node.
constexpr int reincarnate_code = 75;
constexpr const char* waiter_env = "STRATA_NODE_WAITER";
constexpr const char* worker_env = "STRATA_NODE_WORKER";

pid_t worker_pid = 0;

void forward_to_worker(int sig) {
  if (worker_pid > 0)
    ::kill(worker_pid, sig);
}

// Runs in the waiter: starts a worker, restarts it while it asks for a new
// incarnation, and ends like the worker ended otherwise. Returns in a worker.
void run_waiter() {
  sigset_t none;
  sigemptyset(&none);
  pthread_sigmask(SIG_SETMASK, &none, nullptr); // exec kept the node's blocked signals
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCONT})
    std::signal(sig, forward_to_worker);
  const pid_t waiter = ::getpid();
  while (true) {
    const pid_t child = ::fork();
    if (child < 0) {
      std::perror("strata node: fork");
      std::_Exit(1);
    }
    if (child == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL); // the waiter killed (kill -9): the worker goes too
      if (::getppid() != waiter)
        std::_Exit(1);
      for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCONT})
        std::signal(sig, SIG_DFL);
      ::setenv(worker_env, "1", 1);
      return;
    }
    worker_pid = child;
    int status = 0;
    while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
    }
    worker_pid = 0;
    if (WIFEXITED(status) && WEXITSTATUS(status) == reincarnate_code) {
      log::info("starting a new incarnation");
      continue;
    }
    if (WIFSIGNALED(status)) {
      std::signal(WTERMSIG(status), SIG_DFL);
      ::kill(::getpid(), WTERMSIG(status));
    }
    std::_Exit(WIFEXITED(status) ? WEXITSTATUS(status) : 1);
  }
}

// Called instead of exiting when the node must come back as a new process.
[[noreturn]] void reincarnate(char** argv) {
  std::fflush(stdout);
  std::fflush(stderr);
  if (std::getenv(worker_env))
    std::_Exit(reincarnate_code); // our waiter starts the next worker
  // Become the waiter: same pid, same arguments, none of this process's sockets.
  ::close_range(3, ~0U, CLOSE_RANGE_CLOEXEC);
  ::setenv(waiter_env, "1", 1);
  ::execv("/proc/self/exe", argv);
  std::perror("strata node: cannot restart itself");
  std::_Exit(1);
}

// ---------------------------------------------------------------- registrar

struct registrar_state {
  msg::shard_full_actor shard;
  std::function<msg::shard_full_actor()> respawn; // a fresh shard actor over the same weights
  bool replacing = false;
  msg::supervisor_actor coordinator;
  Endpoint join;
  model::LayerRange range;
  msg::cache_recipe recipe;
  msg::model_facts facts;
  std::string address; // advertised HOST:PORT ("" = none)
  caf::actor peers;    // this node's peer connector
  bool announced = false;
  bool beating = false;
  caf::node_id coordinator_node; // the coordinator this node last registered with
  bool lost = false;             // ... and lost since
  std::string last_connect_error;
  static inline const char* name = "strata.registrar";
};

using reconnect_atom = caf::atom_constant<caf::atom("reconnect")>;
using beat_atom = caf::atom_constant<caf::atom("beat")>;

void try_register(caf::stateful_actor<registrar_state>* self) {
  auto& sys = self->system();
  auto mm = sys.has_openssl_manager() ? sys.openssl_manager().actor_handle() : sys.middleman().actor_handle();
  auto& st = self->state;
  self->request(mm, 5s, caf::connect_atom::value, st.join.host, st.join.port)
    .then(
      [=](const caf::node_id& nid, caf::strong_actor_ptr& p, const std::set<std::string>&) {
        auto& st = self->state;
        if (!p) {
          self->delayed_send(self, 500ms, reconnect_atom::value);
          return;
        }
        if (st.lost && nid == st.coordinator_node) {
          // The same coordinator is still up, so it was this node that went
          // away (frozen or cut off): its peers buried this node id.
          log::warn("the coordinator declared this node dead (frozen or cut off longer than the liveness bound); "
                    "coming back as a new incarnation");
          stop_node(reincarnate_code);
          return;
        }
        st.coordinator_node = nid;
        st.lost = false;
        st.coordinator = caf::actor_cast<msg::supervisor_actor>(std::move(p));
        self->monitor(st.coordinator);
        self->request(st.coordinator, 5s, atom::register_atom_v, msg::shard_actor{st.shard}, st.range.first,
                      st.range.last, st.recipe, st.facts, st.address)
          .then(
            [=](int64_t epoch) {
              auto& st = self->state;
              if (st.peers)
                self->send_exit(st.peers, caf::exit_reason::user_shutdown);
              st.peers = spawn_peer_connector(self->system(), st.coordinator, st.address);
              log::info(std::string(st.announced ? "re-registered" : "registered") + " with the coordinator at " +
                        st.join.host + ":" + std::to_string(st.join.port) + ": layers " + std::to_string(st.range.first) +
                        "-" + std::to_string(st.range.last) + (st.address.empty() ? "" : " at " + st.address) +
                        ", epoch " + std::to_string(epoch));
              if (!st.beating) { // heartbeats to the coordinator: liveness in `strata status`
                st.beating = true;
                self->send(self, beat_atom::value);
              }
              std::printf("%s node %s layers %lld-%lld epoch %lld\n", st.announced ? "re-registered" : "ready",
                          caf::to_string(st.shard.node()).c_str(), static_cast<long long>(st.range.first),
                          static_cast<long long>(st.range.last), static_cast<long long>(epoch));
              std::fflush(stdout);
              st.announced = true;
            },
            [=](caf::error& e) {
              if (e == ec::incompatible_recipe || e == ec::bad_request) {
                log::error("the coordinator refused this node: " + self->system().render(e));
                stop_node(3);
                return;
              }
              self->delayed_send(self, 500ms, reconnect_atom::value);
            });
      },
      [=](caf::error& e) {
        // Say why once per kind of failure (a TLS refusal reads disconnect_during_handshake).
        auto& st = self->state;
        auto why = self->system().render(e);
        if (why != st.last_connect_error) {
          log::warn("cannot reach the coordinator at " + st.join.host + ":" + std::to_string(st.join.port) + ": " + why +
                    " (retrying)");
          st.last_connect_error = std::move(why);
        }
        self->delayed_send(self, 500ms, reconnect_atom::value);
      });
}

caf::behavior registrar(caf::stateful_actor<registrar_state>* self, std::function<msg::shard_full_actor()> respawn,
                        Endpoint join, model::LayerRange range, msg::cache_recipe recipe, msg::model_facts facts,
                        std::string address) {
  auto& st = self->state;
  st.respawn = std::move(respawn);
  st.shard = st.respawn();
  st.join = std::move(join);
  st.range = range;
  st.recipe = std::move(recipe);
  st.facts = std::move(facts);
  st.address = std::move(address);
  self->set_down_handler([=](caf::down_msg& dm) {
    auto& st = self->state;
    if (st.replacing && dm.source == st.shard.address()) {
      // The old shard actor is gone: a fresh one (same weights, empty caches,
      // new actor id) registers as a new incarnation.
      st.replacing = false;
      st.shard = st.respawn();
      self->delayed_send(self, 200ms, reconnect_atom::value);
      return;
    }
    if (dm.source != st.coordinator.address())
      return;
    // The coordinator went away (restart, network, or this node was frozen and
    // every peer dropped it): peers consider this node's actors dead, so come
    // back with a new shard actor, once the old one has stopped using the weights.
    st.coordinator = msg::supervisor_actor{};
    st.lost = true;
    log::warn("lost the coordinator (" + self->system().render(dm.reason) + "); re-registering");
    st.replacing = true;
    self->monitor(st.shard);
    self->send_exit(st.shard, caf::exit_reason::user_shutdown);
  });
  try_register(self);
  return {
    [=](reconnect_atom) { try_register(self); },
    [=](beat_atom) {
      auto& st = self->state;
      if (st.coordinator)
        self->send(st.coordinator, atom::heartbeat_atom_v, msg::shard_actor{st.shard});
      self->delayed_send(self, 500ms, beat_atom::value);
    },
  };
}

// Freezes this process for `ms`: a helper child stops and later continues us.
void freeze_process(int64_t ms) {
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child == 0) {
    ::kill(parent, SIGSTOP);
    ::usleep(static_cast<useconds_t>(ms * 1000));
    ::kill(parent, SIGCONT);
    ::_exit(0);
  }
}


} // namespace

void add_network_options(Args& a) {
  a.option("heartbeat-ms", "MS", "heartbeat interval between processes (default 200)")
    .option("dead-after-ms", "MS", "a silent peer is declared dead after this (default 1500)")
    .option("tls-cert", "FILE", "mutual TLS: this process's certificate (PEM; see 'strata certs')")
    .option("tls-key", "FILE", "mutual TLS: its private key (PEM)")
    .option("tls-ca", "FILE", "mutual TLS: the cluster CA certificate peers must be signed by");
  log::add_options(a);
}

bool prefix_cache_from(const Args& a) {
  if (!a.has("prefix-cache"))
    return true;
  const auto v = a.str("prefix-cache");
  if (v != "on" && v != "off")
    throw UsageError("--prefix-cache takes on or off, not '" + v + "'");
  return v == "on";
}

model::LoadOptions load_options_from(const Args& a) {
  model::LoadOptions o;
  o.dtype = a.has("dtype") ? a.str("dtype") : "auto";
  o.progress = true; // drawn only when stderr is a terminal
  return o;
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

int run_node(int argc, char** argv) {
  if (std::getenv(waiter_env)) {
    ::unsetenv(waiter_env);
    run_waiter(); // returns in each new worker
  }
  Args a;
  a.option("listen", "HOST:PORT", "address to listen on (port 0: any free port)")
    .option("coordinator", "", "host the route supervisor (no model needed)")
    .option("join", "HOST:PORT", "the coordinator to register with (shard nodes)")
    .option("model", "PATH|builtin:NAME", "model to serve (shard nodes): llama2.c .bin, GGUF file, HF directory or builtin")
    .option("layers", "A-B", "layer range to serve (shard nodes)")
    .option("cache-bytes", "N", "KV cache byte budget (default 1 GiB)")
    .option("max-sessions", "N", "most sessions cached at once (default 64)")
    .option("prefix-cache", "on|off", "share full KV blocks of common prompt prefixes between sessions (default on)")
    .option("ttl", "S", "seconds an idle session's cache is kept (default 600)")
    .option("max-prompt", "N", "most tokens one step may carry (default: the model's context)")
    .option("max-message-bytes", "N", "largest step message accepted (default 67108864)")
    .option("max-batch-tokens", "N", "input rows one batched round may run (default 256)")
    .option("prefill-chunk", "N", "rows per piece of a long prompt, so decodes keep flowing (default 128)")
    .option("max-queue", "N", "steps waiting before new ones get 'overloaded' (default 512)")
    .option("route-wait-ms", "MS", "coordinator: how long a session waits for a complete route (default 10000, at most 60000)")
    .option("threads", "N", "threads for tensor math (default: all cores)")
    .option("dtype", "auto|f32|bf16|q8_0|q4_0|q4_K", "how weights are kept in memory (default auto: GGUF types as stored, others f32); nodes of a cluster must agree")
    .option("insecure", "", "allow a non-loopback address without TLS (traffic is not authenticated)")
    .option("advertise", "HOST:PORT", "the address other processes reach this node at (default: --listen)");
  add_network_options(a);
  a.parse(argc, argv, 2);
  if (a.help_requested()) {
    std::cout << "usage: strata node --listen HOST:PORT (--coordinator | --join HOST:PORT --model M --layers A-B)\n\n"
              << "Starts a node. A coordinator hosts the route supervisor; a shard node loads only its\n"
              << "layers, publishes its shard actor and registers with the coordinator (again after the\n"
              << "coordinator restarts). Prints one 'ready ...' line when serving; stops on SIGINT/SIGTERM.\n\noptions:\n"
              << a.help_text();
    return 0;
  }
  log::configure_from(a, a.has("coordinator") ? "coordinator" : "node");
  const Endpoint listen = parse_endpoint(a.required("listen"), "listen");
  const bool coordinator = a.has("coordinator");
  const Tls tls = tls_from(a);
  if (!is_loopback(listen.host) && !tls.enabled()) {
    if (!a.has("insecure"))
      throw UsageError("binding to non-loopback address '" + listen.host +
                       "' needs TLS (--tls-cert, --tls-key, --tls-ca; see 'strata certs') or an explicit --insecure");
    log::warn("listening on " + listen.host + " without TLS (--insecure): any peer that can connect can send "
              "messages to this node");
  }
  Endpoint join;
  model::LayerRange range;
  actors::StoreLimits limits;
  actors::RequestLimits request_limits;
  actors::SchedulerLimits sched;
  if (!coordinator) {
    join = parse_endpoint(a.required("join"), "join");
    range = model::parse_layer_range(a.required("layers"));
    limits.max_bytes = static_cast<std::size_t>(a.integer("cache-bytes", int64_t{1} << 30, 1, INT64_MAX));
    limits.max_sessions = static_cast<std::size_t>(a.integer("max-sessions", 64, 1, 1 << 20));
    limits.prefix_cache = prefix_cache_from(a);
    limits.ttl = std::chrono::seconds(a.integer("ttl", 600, 1, 86400 * 30));
    request_limits.max_step_tokens = a.integer("max-prompt", 0, 1, int64_t{1} << 30);
    request_limits.max_message_bytes =
      static_cast<std::size_t>(a.integer("max-message-bytes", int64_t{64} << 20, 1024, int64_t{1} << 40));
    // No BASP frame may announce more than a step may carry, plus room for the
    // envelope (runtime/frame_guard): a lying header cannot make CAF allocate.
    frames::set_limit(request_limits.max_message_bytes + (uint64_t{1} << 20));
    sched.max_batch_tokens = a.integer("max-batch-tokens", sched.max_batch_tokens, 1, 1 << 20);
    sched.prefill_chunk = a.integer("prefill-chunk", sched.prefill_chunk, 1, 1 << 20);
    sched.max_queue = static_cast<std::size_t>(a.integer("max-queue", static_cast<int64_t>(sched.max_queue), 1, 1 << 20));
  }
  const Liveness live = liveness_from(a);
  model::set_num_threads(static_cast<int>(a.integer("threads", 0, 0, 1024)));
  std::shared_ptr<model::Shard> shard;
  if (!coordinator)
    shard = model::Shard::load(a.required("model"), range, load_options_from(a));

  const sigset_t stop_signals = block_stop_signals();
  cluster_config cfg{live, tls};
  caf::actor_system sys{cfg};
  msg::supervisor_actor supervisor;
  msg::shard_full_actor published;
  caf::actor helper;
  std::function<msg::shard_full_actor()> respawn;
  if (coordinator) {
    actors::SupervisorOptions opts;
    opts.route_wait = std::chrono::milliseconds(a.integer("route-wait-ms", 10000, 1, 60000)); // < the sessions' route timeout
    opts.log = [](int level, const std::string& text) { log::write(static_cast<log::level>(level), text); };
    supervisor = actors::spawn_supervisor(sys, opts);
  } else {
    actors::ShardHooks hooks;
    hooks.crash = [] { std::_Exit(137); };
    hooks.freeze = [](int64_t ms) { freeze_process(ms); };
    published = actors::spawn_shard(sys, shard, limits, hooks, request_limits, std::chrono::milliseconds(1000), sched);
    respawn = [&sys, shard, limits, hooks, request_limits, sched, first = std::make_shared<msg::shard_full_actor>(published)]() mutable {
      if (*first) { // the published actor serves the first incarnation
        auto a = std::move(*first);
        *first = msg::shard_full_actor{};
        return a;
      }
      return actors::spawn_shard(sys, shard, limits, hooks, request_limits, std::chrono::milliseconds(1000), sched);
    };
  }
  auto publish = [&](const auto& handle) {
    return tls.enabled() ? caf::openssl::publish(handle, listen.port, listen.host.c_str(), true)
                         : sys.middleman().publish(handle, listen.port, listen.host.c_str(), true);
  };
  auto port = coordinator ? publish(supervisor) : publish(published);
  if (!port) {
    log::error("cannot listen on " + listen.host + ":" + std::to_string(listen.port) + ": " +
               sys.render(port.error()));
    std::_Exit(1);
  }
  if (coordinator) {
    log::info("coordinator listening on " + listen.host + ":" + std::to_string(*port) + ", route wait " +
              a.str("route-wait-ms", "10000") + " ms");
    std::printf("ready coordinator %s:%u\n", listen.host.c_str(), *port);
    std::fflush(stdout);
  } else {
    // The address peers connect to: --advertise, else the listen address
    // unless it is a wildcard (then peers reach this node through the coordinator).
    std::string advertise = a.str("advertise");
    if (!advertise.empty())
      parse_endpoint(advertise, "advertise"); // HOST:PORT or a usage error
    if (advertise.empty() && listen.host != "0.0.0.0" && listen.host != "::" && listen.host != "[::]")
      advertise = listen.host + ":" + std::to_string(*port);
    helper = sys.spawn(registrar, respawn, join, range, msg::cache_recipe::of(shard->config()),
                       msg::model_facts::of(shard->config()), advertise);
  }
  int sig = 0;
  sigwait(&stop_signals, &sig);
  // A node holds no state worth saving (sessions re-prefill elsewhere), and CAF
  // keeps actors that peers have seen alive in its registry, so ~actor_system
  // would wait for them forever: close the sockets by ending the process.
  if (sig == SIGINT)
    log::info("stopping (interrupted)");
  if (node_exit_code.load() == reincarnate_code)
    reincarnate(argv);
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(node_exit_code.load());
}

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
    case actors::Injection::evict: {
      // The session's cache for hop I's layers lives on whichever replica its
      // route took, which need not be the one in the current plan: evict the
      // session on every node serving those layers (a no-op where it has none).
      const auto& hop = plan.hops[static_cast<std::size_t>(inj.shard)];
      for (auto& h : cluster_view(sys, supervisor).hops)
        if (h.first == hop.first && h.last == hop.last)
          self->request(caf::actor_cast<msg::shard_injection_actor>(h.shard), 10s, atom::evict_atom_v, session,
                        static_cast<uint8_t>(inj.reason))
            .receive([] {}, [](caf::error&) {});
      break;
    }
    case actors::Injection::desync: self->send(target, atom::desync_atom_v); break;
    case actors::Injection::dup: self->send(target, atom::dup_atom_v); break;
    case actors::Injection::epoch: break;
  }
}

namespace {

// One blocking request to the supervisor (10 s); throws model::Error(io) when it
// does not answer.
template <class Reply, class... Ts>
Reply ask_supervisor(caf::actor_system& sys, const msg::supervisor_actor& sup, Ts... xs) {
  caf::scoped_actor self{sys};
  caf::error err;
  Reply out;
  self->request(sup, 10s, xs...).receive([&](Reply& r) { out = std::move(r); }, [&](caf::error& e) { err = e; });
  if (err)
    throw model::Error(model::errc::io, "the coordinator did not answer: " + sys.render(err));
  return out;
}

} // namespace

msg::route_info cluster_view(caf::actor_system& sys, msg::supervisor_actor sup) {
  return ask_supervisor<msg::route_info>(sys, sup, caf::get_atom_v);
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
  auto cs = ask_supervisor<msg::cluster_status>(sys, sup, atom::status_atom_v);
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
                             {"block_bytes", st.block_bytes},
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
  std::printf("cluster %s:%u  model %s  epoch %lld  shard nodes %zu\n", ep.host.c_str(), ep.port,
              cs.recipe.model.empty() ? "-" : cs.recipe.model.c_str(), static_cast<long long>(cs.epoch),
              cs.shards.size());
  std::string route;
  for (auto& h : cs.plan.hops)
    route += (route.empty() ? "" : " -> ") + std::to_string(h.first) + "-" + std::to_string(h.last);
  std::printf("route: %s\n", route.empty() ? "none complete (some layers have no node)" : route.c_str());
  // An aligned table: every column as wide as its widest cell.
  std::vector<std::vector<std::string>> table = {{"#", "node", "address", "layers", "alive", "inc", "role", "cache-bytes",
                                                  "pool(used/blocks)", "rounds", "max-batch", "queued", "overloaded",
                                                  "sessions", "hits", "orphans", "conflicts",
                                                  "misses(unknown,ttl,lru,released,superseded,seq)"}};
  for (std::size_t i = 0; i < cs.shards.size(); ++i) {
    auto& s = cs.shards[i];
    auto& st = rows[i].stats;
    char alive[32];
    std::snprintf(alive, sizeof alive, "%.1fs ago", static_cast<double>(s.silent_ms) / 1000.0);
    std::string misses;
    for (std::size_t r = 1; r < st.misses.size(); ++r)
      misses += (r > 1 ? "," : "") + std::to_string(st.misses[r]);
    auto n = [](uint64_t v) { return std::to_string(v); };
    table.push_back({std::to_string(i), caf::to_string(s.shard.shard.node()), s.address.empty() ? "-" : s.address,
                     std::to_string(s.shard.first) + "-" + std::to_string(s.shard.last),
                     rows[i].answered ? std::string(alive) : "not answering", std::to_string(s.incarnation), role(i),
                     n(st.cache_bytes), n(st.pool_used) + "/" + n(st.pool_blocks), n(st.rounds), n(st.max_batch),
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
