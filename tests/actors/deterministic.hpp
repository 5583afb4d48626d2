#pragma once
// An actor system on CAF's deterministic test coordinator: messages are
// delivered when the test runs the scheduler, and time moves only when the test
// advances it. Shared by the supervisor and session phase tests.

#include "actors/cluster.hpp"

#include <caf/scheduler/test_coordinator.hpp>

namespace strata::test {

struct DeterministicConfig : actors::actor_config {
  DeterministicConfig() { set("scheduler.policy", caf::atom("testing")); }
};

struct Deterministic {
  DeterministicConfig cfg;
  caf::actor_system sys{cfg};
  caf::scheduler::test_coordinator& sched = dynamic_cast<caf::scheduler::test_coordinator&>(sys.scheduler());
};

} // namespace strata::test
