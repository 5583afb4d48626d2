#pragma once
// DelayProxy: a TCP forwarder that holds every chunk it reads for a fixed time
// in each direction before writing it on, in order: what a link with that
// one-way delay does to a connection (bandwidth is not limited). For measuring
// strata across a simulated network on one machine (`strata delay-proxy`,
// `scripts/bench wan`): point a node's --advertise at a proxy that forwards to
// the node's --listen address, and every connection to the node crosses the
// delay (both ways).
//
// One thread runs all connections (boost::asio). Each direction of a
// connection is a queue of (due time, bytes): reading goes on while earlier
// chunks wait, so a burst is delayed as a whole, not serialized by the delay.
// A direction holding more than `max_queued_bytes` stops reading until it drains
// (the sender sees TCP back-pressure). An end closed on one side is passed on
// once what was read before it has been delivered.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

namespace strata::runtime {

struct DelayProxyOptions {
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0; ///< 0: any free port (port() tells which)
  std::string target_host = "127.0.0.1";
  uint16_t target_port = 0;
  std::chrono::microseconds delay{0}; ///< one way, each direction
  std::size_t max_queued_bytes = std::size_t{64} << 20;
};

class DelayProxy {
public:
  /// Binds the listening socket (throws model::Error(io) naming the address
  /// when it cannot) and starts forwarding on a thread of its own.
  explicit DelayProxy(DelayProxyOptions opts);
  ~DelayProxy(); ///< stops: closes every connection
  DelayProxy(const DelayProxy&) = delete;
  DelayProxy& operator=(const DelayProxy&) = delete;

  uint16_t port() const;
  /// Connections accepted so far, and bytes delivered in each direction.
  uint64_t connections() const;
  uint64_t bytes_to_target() const;
  uint64_t bytes_to_client() const;
  /// Changes the delay of chunks read from now on (earlier ones keep theirs).
  void set_delay(std::chrono::microseconds delay);
  void stop();

  struct Impl;

private:
  std::shared_ptr<Impl> impl_;
  std::thread thread_;
};

/// `strata delay-proxy --listen HOST:PORT --to HOST:PORT --delay-ms D`.
int cmd_delay_proxy(int argc, char** argv);

} // namespace strata::runtime
