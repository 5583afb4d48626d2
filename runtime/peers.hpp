#pragma once
// Direct connections between the processes of a cluster, without CAF's
// "automatic connections" (which open a second listener on every interface of
// every process, whatever --listen says). Each shard node advertises the
// HOST:PORT it listens on when it registers; a peer connector in every process
// (nodes and clients alike) subscribes to the supervisor and, whenever the route
// changes, connects to every advertised address it is not connected to yet
// (of two nodes, the one with the smaller address connects; a failed attempt is
// tried again after a pause).
// Until it is, CAF relays over other processes; that relay has failed after a
// dropped half-made connection (request_receiver_down on every step), hence
// the retries. With TLS the connections are TLS too.

#include "messages/messages.hpp"

#include <caf/all.hpp>

#include <string>

namespace strata::runtime {

/// Spawns a connector for `supervisor` (it ends with the supervisor, or with an
/// exit message). `self_address` (a node's own advertised address) is skipped.
caf::actor spawn_peer_connector(caf::actor_system& sys, msg::supervisor_actor supervisor,
                                std::string self_address = {});

} // namespace strata::runtime
