#pragma once
// An in-process cluster: a route supervisor and one detached shard actor per
// layer range, all in one actor system; a blocking helper that runs one
// generation through a session actor; and the failure injections the command
// line and the tests use. Nothing here shares memory between actors: messages
// carry values, so the same actors work across processes.

#include "actors/cache_store.hpp"
#include "actors/scheduler.hpp"
#include "actors/session.hpp"
#include "actors/supervisor.hpp"
#include "messages/messages.hpp"

#include <caf/all.hpp>

#include <functional>
#include <string>
#include <vector>

namespace strata::actors {

/// actor_system_config with strata's message types and error renderer.
struct actor_config : caf::actor_system_config {
  actor_config();
};

struct ClusterOptions {
  StoreLimits limits;
  SchedulerLimits scheduler;
  std::chrono::milliseconds lease_period{1000}; ///< shards sweep leases this often
  SupervisorOptions supervisor;
  SessionOptions session;
  model::LoadOptions load; ///< how shards load their weights (--dtype)
};

/// One failure to inject during a generation: `kind` at the moment `at_token`
/// tokens have been generated.
struct Injection {
  enum Kind { evict, kill, epoch, desync, dup, freeze } kind;
  int64_t shard = 0;
  int64_t at_token = 0;
  msg::miss_reason reason = msg::miss_reason::evicted_lru; ///< for evict
};

/// Parses "evict:I@S,kill:I@S,epoch@S,desync:I@S,dup:I@S" (and "freeze:I@S"
/// when `allow_freeze`, for multi-process clusters). Throws
/// model::Error(bad_argument) naming the bad item.
std::vector<Injection> parse_injections(const std::string& spec, int64_t n_shards, bool allow_freeze = false);

/// The outcome of one generation.
struct Outcome {
  msg::generation_result result;
  caf::error error; ///< set when the generation failed
  bool ok() const { return !error; }
};

/// Runs one generation through a session actor on `supervisor`, streaming
/// tokens to `on_token`. The session pauses at each injection's token count
/// until `apply` has put the failure in place. Blocks until the end.
/// `reconnect` (optional) is called when the supervisor goes down and returns a
/// new one (or an invalid handle); the session is told to follow it.
Outcome run_generation(caf::actor_system& sys, msg::supervisor_actor supervisor, msg::generation_request req, SessionOptions opts,
                       const std::vector<Injection>& inject,
                       const std::function<void(const Injection&, const std::string& session)>& apply,
                       const std::function<void(const msg::token_event&)>& on_token,
                       const std::function<msg::supervisor_actor()>& reconnect = {},
                       const std::function<void(msg::session_actor session)>& on_session = {});

/// Blocks until `supervisor` no longer lists `shard` among its registered shards
/// (it saw the shard go down), or `timeout` passes.
void wait_until_unregistered(caf::actor_system& sys, const msg::supervisor_actor& supervisor,
                             const msg::shard_actor& shard,
                             std::chrono::milliseconds timeout = std::chrono::seconds(10));

class LocalCluster {
public:
  LocalCluster(caf::actor_system& sys, std::string model, std::vector<model::LayerRange> ranges,
               ClusterOptions opts = {});
  ~LocalCluster();
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  msg::supervisor_actor supervisor() const { return supervisor_; }
  msg::shard_actor shard(std::size_t i) const { return shards_.at(i); }
  /// The same shard's injection interface (tests and tools only).
  msg::shard_injection_actor injector(std::size_t i) const { return shards_.at(i); }
  std::size_t size() const { return shards_.size(); }
  const model::ModelConfig& config() const { return config_; }
  /// Session options with the model's context length filled in.
  SessionOptions session_options() const;

  /// Runs one generation to its end. `on_token` sees each token as it streams.
  Outcome generate(msg::generation_request req, const std::function<void(const msg::token_event&)>& on_token = {});
  /// The same with injections applied exactly when their token counts are
  /// reached (the session pauses there until they are done).
  Outcome generate(msg::generation_request req, const std::vector<Injection>& inject,
                   const std::function<void(const msg::token_event&)>& on_token = {});

  // Failure injection.
  void kill_and_replace(std::size_t i);
  void evict(std::size_t i, const std::string& session, msg::miss_reason why);
  /// The session's next request at shard i carries a wrong past_len.
  void desync(std::size_t i, const std::string& session);
  /// The session's next decode request at shard i is delivered twice.
  void duplicate_next(std::size_t i, const std::string& session);
  int64_t bump_epoch();
  void apply(const Injection& inj, const std::string& session);

  std::vector<msg::shard_stats> stats();

private:
  msg::shard_full_actor spawn_and_register(std::size_t i);

  caf::actor_system& sys_;
  std::string model_;
  std::vector<model::LayerRange> ranges_;
  ClusterOptions opts_;
  model::ModelConfig config_;
  msg::supervisor_actor supervisor_;
  std::vector<msg::shard_full_actor> shards_;
};

} // namespace strata::actors
