// `strata node`: a coordinator (the route supervisor) or a shard node (its layer
// range, registered with the coordinator), the waiter process that restarts a node
// as a new incarnation, and the registrar that keeps a node registered.

#include "runtime/cluster.hpp"

#include "actors/shard_actor.hpp"
#include "model/base/error.hpp"
#include "runtime/args.hpp"
#include "runtime/frame_guard.hpp"
#include "runtime/log.hpp"
#include "runtime/peers.hpp"

#include <caf/openssl/all.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <pthread.h>
#include <thread>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

namespace strata::runtime {

using namespace std::chrono_literals;

namespace {

// ---------------------------------------------------------------- signals

std::atomic<int> node_exit_code{0};

// Blocks SIGINT/SIGTERM in this thread (and every thread started later), so that
// one thread can wait for them with sigwait.
sigset_t block_stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

pthread_t signal_thread;

// Ends the node from any thread: the signal thread wakes from sigwait.
void stop_node(int code) {
  node_exit_code = code;
  ::pthread_kill(signal_thread, SIGTERM);
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
  o.kv_dtype = a.has("kv-dtype") ? a.str("kv-dtype") : o.kv_dtype;
  o.progress = true; // drawn only when stderr is a terminal
  return o;
}

int run_node(int argc, char** argv) {
  if (std::getenv(waiter_env)) {
    ::unsetenv(waiter_env);
    run_waiter(); // returns in each new worker
  }
  // The stop signals are blocked before any other thread exists (the math pools
  // that loading starts, CAF's), so every thread inherits the block and only the
  // signal thread takes them: a SIGTERM that a pool thread took would end the
  // process by the signal instead of with the node's exit code. Loading can be
  // interrupted too. A node holds no state worth saving (sessions re-prefill
  // elsewhere), and CAF keeps actors that peers have seen alive in its registry,
  // so ~actor_system would wait for them forever: the node ends by ending the
  // process, which closes its sockets.
  const sigset_t stop_signals = block_stop_signals();
  std::thread stopper([stop_signals, argv] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    if (sig == SIGINT)
      log::info("stopping (interrupted)");
    if (node_exit_code.load() == reincarnate_code)
      reincarnate(argv);
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(node_exit_code.load());
  });
  signal_thread = stopper.native_handle();
  stopper.detach();
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
    .option("assume-remote", "", "treat every other node as on another machine, even on this one (no lockstep "
                                 "waits for co-located pipelines; for measuring cross-machine behaviour here)")
    .option("route-wait-ms", "MS", "coordinator: how long a session waits for a complete route (default 10000, at most 60000)")
    .option("threads", "N", "threads for tensor math (default: all cores)")
    .option("dtype", "auto|f32|bf16|q8_0|q4_0|q4_K", "how weights are kept in memory (default auto: GGUF types as stored, others f32); nodes of a cluster must agree")
    .option("kv-dtype", "f32|bf16|f16|q8_0", "how the KV cache keeps keys and values (default f32); nodes of a cluster must agree")
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
    sched.detect_colocation = !a.has("assume-remote");
  }
  const Liveness live = liveness_from(a);
  model::set_num_threads(static_cast<int>(a.integer("threads", 0, 0, 1024)));
  std::shared_ptr<model::Shard> shard;
  if (!coordinator)
    shard = model::Shard::load(a.required("model"), range, load_options_from(a));

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
  for (;;)
    ::pause(); // the signal thread ends the process
}

} // namespace strata::runtime
