#pragma once
// The route supervisor: a registry of shard actors and their layer ranges. It
// plans routes (chains covering every layer, preferring the least-loaded
// shards), monitors every shard, bumps the epoch when a shard goes down, a
// shard registers or an operator asks, and tells subscribed sessions the new
// route so they re-prefill.
//
// Interfaces (messages/messages.hpp): msg::supervisor_actor (register, route,
// subscribe, stats, get, model) and msg::supervisor_injection_actor (bump).
// Every registered shard reports the model's facts (msg::model_facts); the
// first one becomes the cluster's, later ones must agree like the recipe.

#include "messages/messages.hpp"

#include <caf/all.hpp>

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>

namespace strata::actors {

struct SupervisorOptions {
  std::chrono::milliseconds route_wait{5000};
  /// Receives what an operator should see (level 2 info, 3 warn; text), e.g.
  /// joins, deaths with their reason, route changes. Empty: silent.
  std::function<void(int level, const std::string&)> log;
};

/// The supervisor's own type: both interfaces plus its route-wait timer.
using supervisor_impl_actor =
  msg::supervisor_actor::extend_with<msg::supervisor_injection_actor>::extend<caf::reacts_to<atom::tick_atom>>;

struct shard_entry {
  msg::shard_actor actor;
  int64_t first = 0;
  int64_t last = 0;
  uint64_t load = 0; ///< routes handed out through this shard
  std::string address; ///< the node's advertised HOST:PORT ("" = none)
  caf::actor_clock::time_point last_seen{}; ///< its last heartbeat (or registration)
  int64_t incarnation = 1;
  int64_t since_ms = 0;
};

struct supervisor_state {
  std::vector<shard_entry> shards;
  std::optional<msg::cache_recipe> recipe;
  msg::model_facts facts;
  /// Starts at the coordinator's start time (ms since 1970, x1000), so epochs
  /// keep growing across coordinator restarts and shards never see one go back.
  int64_t epoch = 1;
  std::vector<msg::session_actor> sessions;
  /// The shards last planned for each subscribed session: a new plan keeps them
  /// where they still fit, so a change elsewhere does not move a session's hops to
  /// other replicas (each moved hop would rebuild its cache).
  std::map<caf::actor_addr, std::vector<msg::shard_actor>> given;
  std::map<std::string, int64_t> registrations; ///< per advertised address (incarnations)
  struct waiter {
    caf::typed_response_promise<msg::route_info> rp;
    caf::actor_clock::time_point deadline;
    caf::actor_addr who; ///< the requester
  };
  std::vector<waiter> waiting;
  SupervisorOptions opts;
  static inline const char* name = "strata.supervisor";

  /// A complete chain of shards, those in `prefer` first, then least-loaded first;
  /// empty hops when none exists. Shards in `avoid` are used only when no complete
  /// chain exists without them.
  msg::route_info plan(bool count_load, const std::vector<msg::shard_actor>& avoid = {},
                       const std::vector<msg::shard_actor>& prefer = {});
  /// plan(true, avoid) for a subscribed session, remembered for it; `sticky`:
  /// preferring what it was given before (a push after a change elsewhere). A
  /// session's own route request comes after a failure it cannot pin on one hop
  /// (a timeout), so it is planned afresh: least-loaded replicas first.
  msg::route_info plan_for(const caf::actor_addr& session, const std::vector<msg::shard_actor>& avoid = {},
                           bool sticky = true);
  template <class Self>
  void changed(Self* self, const std::string& why);
  void say(int level, const std::string& text) const {
    if (opts.log)
      opts.log(level, text);
  }
};

supervisor_impl_actor::behavior_type supervisor(supervisor_impl_actor::stateful_pointer<supervisor_state> self,
                                                SupervisorOptions opts);

/// Spawns a route supervisor.
msg::supervisor_actor spawn_supervisor(caf::actor_system& sys, SupervisorOptions opts = {});

} // namespace strata::actors
