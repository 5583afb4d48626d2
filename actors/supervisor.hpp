#pragma once
// The route supervisor: a registry of shard actors and their layer ranges. It
// plans routes (chains covering every layer, preferring the least-loaded
// shards), monitors every shard, bumps the epoch when a shard goes down, a
// shard registers or an operator asks, and tells subscribed sessions the new
// route so they re-prefill.
//
// Interface (untyped actor):
//   (register_atom, actor, first, last, cache_recipe) -> int64 epoch | incompatible_recipe
//   (route_atom)               -> route_info; waits up to `route_wait` for a complete
//                                 route, then ec::no_route
//   (route_atom, vector<actor> avoid) -> the same, avoiding shards the caller
//                                 cannot reach if another complete route exists
//   (subscribe_atom, actor)    -> the session receives route_info on every change
//   (bump_atom)                -> int64 new epoch
//   (stats_atom)               -> route_info of the current plan (epoch, hops)
//   (get_atom)                 -> route_info listing every registered shard

#include "messages/messages.hpp"

#include <caf/all.hpp>

#include <chrono>
#include <optional>

namespace strata::actors {

struct SupervisorOptions {
  std::chrono::milliseconds route_wait{5000};
};

struct shard_entry {
  caf::actor actor;
  int64_t first = 0;
  int64_t last = 0;
  uint64_t load = 0; ///< routes handed out through this shard
};

struct supervisor_state {
  std::vector<shard_entry> shards;
  std::optional<msg::cache_recipe> recipe;
  /// Starts at the coordinator's start time (ms since 1970, x1000), so epochs
  /// keep growing across coordinator restarts and shards never see one go back.
  int64_t epoch = 1;
  std::vector<caf::actor> sessions;
  struct waiter {
    caf::response_promise rp;
    caf::actor_clock::time_point deadline;
  };
  std::vector<waiter> waiting;
  SupervisorOptions opts;
  static inline const char* name = "strata.supervisor";

  /// A complete chain of shards, least-loaded first; empty hops when none exists.
  /// Shards in `avoid` are used only when no complete chain exists without them.
  msg::route_info plan(bool count_load, const std::vector<caf::actor>& avoid = {});
  void changed(caf::event_based_actor* self);
};

caf::behavior supervisor_actor(caf::stateful_actor<supervisor_state>* self, SupervisorOptions opts);

} // namespace strata::actors
