#include "runtime/peers.hpp"

#include <caf/io/all.hpp>
#include <caf/openssl/all.hpp>

#include <set>

namespace strata::runtime {

namespace {

using namespace std::chrono_literals;

struct connector_state {
  msg::supervisor_actor supervisor;
  std::string self_address;
  std::set<std::string> connected; // addresses with a direct connection (or one on the way)
  bool retry_pending = false;      // a refresh is scheduled after a failed connection
  std::chrono::milliseconds retry_wait{250};
  static inline const char* name = "strata.peers";
};

// Whether this process opens the connection to the node at `address`. Clients
// connect to every node; of two nodes, only the one with the smaller address
// connects: when both connected to each other at once (a node coming back while
// the others learn of it in the same route push), CAF 0.17 could drop both
// half-made connections, leaving the pair without a direct link and their
// relayed traffic undeliverable (request_receiver_down on every step).
bool initiates(const std::string& self_address, const std::string& address) {
  return self_address.empty() || self_address < address;
}

void refresh(caf::stateful_actor<connector_state>* self);

// A connection that failed is tried again after a pause (doubling to 8 s while
// failures go on), not only on the next route change.
void retry_later(caf::stateful_actor<connector_state>* self) {
  auto& st = self->state;
  if (st.retry_pending)
    return;
  st.retry_pending = true;
  self->delayed_send(self, st.retry_wait, atom::tick_atom_v);
  st.retry_wait = std::min(st.retry_wait * 2, std::chrono::milliseconds(8000));
}

void refresh(caf::stateful_actor<connector_state>* self) {
  self->request(self->state.supervisor, 10s, caf::get_atom_v)
    .then(
      [=](msg::route_info& all) {
        auto& st = self->state;
        std::set<std::string> listed(all.addresses.begin(), all.addresses.end());
        // Forget nodes that left, so that a new one on the same address is connected again.
        for (auto it = st.connected.begin(); it != st.connected.end();)
          it = listed.count(*it) ? std::next(it) : st.connected.erase(it);
        auto& sys = self->system();
        auto mm = sys.has_openssl_manager() ? sys.openssl_manager().actor_handle() : sys.middleman().actor_handle();
        for (auto& a : listed) {
          const auto colon = a.rfind(':');
          if (a.empty() || a == st.self_address || st.connected.count(a) || colon == std::string::npos ||
              !initiates(st.self_address, a))
            continue;
          st.connected.insert(a);
          const auto port = static_cast<uint16_t>(std::strtoul(a.c_str() + colon + 1, nullptr, 10));
          self->request(mm, 10s, caf::connect_atom_v, a.substr(0, colon), port)
            .then([=](const caf::node_id&, caf::strong_actor_ptr&, const std::set<std::string>&) {
                    self->state.retry_wait = std::chrono::milliseconds(250);
                  },
                  [=](caf::error&) {
                    self->state.connected.erase(a);
                    retry_later(self);
                  });
        }
      },
      [=](caf::error&) { retry_later(self); });
}

caf::behavior connector(caf::stateful_actor<connector_state>* self, msg::supervisor_actor supervisor,
                        std::string self_address) {
  self->state.supervisor = supervisor;
  self->state.self_address = std::move(self_address);
  self->monitor(supervisor);
  self->set_down_handler([=](caf::down_msg&) { self->quit(); });
  self->send(supervisor, atom::subscribe_atom_v);
  refresh(self);
  return {
    [=](msg::route_info&) { refresh(self); }, // a change: nodes may have joined or left
    [=](atom::tick_atom) {
      self->state.retry_pending = false;
      refresh(self);
    },
  };
}

} // namespace

caf::actor spawn_peer_connector(caf::actor_system& sys, msg::supervisor_actor supervisor, std::string self_address) {
  return sys.spawn<caf::hidden>(connector, std::move(supervisor), std::move(self_address));
}

} // namespace strata::runtime
