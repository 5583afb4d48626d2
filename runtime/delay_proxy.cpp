#include "runtime/delay_proxy.hpp"

#include "model/base/error.hpp"
#include "runtime/args.hpp"
#include "runtime/cluster.hpp"

#include <utility> // (boost 1.74's asio uses std::exchange without including it)

#include <boost/asio.hpp>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstdio>
#include <deque>
#include <iostream>
#include <vector>

namespace strata::runtime {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using clk = std::chrono::steady_clock;
using boost::system::error_code;

struct DelayProxy::Impl {
  DelayProxyOptions opts;
  asio::io_context io;
  tcp::acceptor acceptor{io};
  tcp::endpoint target;
  std::atomic<uint64_t> connections{0}, to_target{0}, to_client{0};
  std::atomic<int64_t> delay_us{0};
};

namespace {

// One direction of a connection: chunks read from `from`, each written to `to`
// once its due time comes, in order.
struct Direction {
  explicit Direction(asio::io_context& io) : timer(io) {}
  tcp::socket* from = nullptr;
  tcp::socket* to = nullptr;
  std::array<uint8_t, 64 * 1024> buf{};
  std::deque<std::pair<clk::time_point, std::vector<uint8_t>>> queue;
  std::size_t queued = 0;
  bool reading = false, writing = false, ended = false, closed_on = false;
  asio::steady_timer timer;
  std::atomic<uint64_t>* delivered = nullptr;
};

struct Conn : std::enable_shared_from_this<Conn> {
  Conn(DelayProxy::Impl& impl, tcp::socket c)
    : impl(impl), client(std::move(c)), target(impl.io), up(impl.io), down(impl.io) {
    up.from = &client;
    up.to = &target;
    up.delivered = &impl.to_target;
    down.from = &target;
    down.to = &client;
    down.delivered = &impl.to_client;
  }
  DelayProxy::Impl& impl;
  tcp::socket client, target;
  Direction up, down;
  bool dead = false;

  void start() {
    auto self = shared_from_this();
    target.async_connect(impl.target, [self](const error_code& ec) {
      if (ec)
        return self->close(); // the client sees the connection end, as with a refused one
      error_code ignore;
      self->client.set_option(tcp::no_delay(true), ignore);
      self->target.set_option(tcp::no_delay(true), ignore);
      self->read(self->up);
      self->read(self->down);
    });
  }

  void read(Direction& d) {
    if (dead || d.ended || d.reading || d.queued >= impl.opts.max_queued_bytes)
      return; // (a full queue resumes reading once a write drains it)
    d.reading = true;
    auto self = shared_from_this();
    d.from->async_read_some(asio::buffer(d.buf), [self, &d](const error_code& ec, std::size_t n) {
      d.reading = false;
      if (self->dead)
        return;
      if (ec) { // end of stream or reset: pass the end on after what came before it
        d.ended = true;
        return self->pump(d);
      }
      d.queue.emplace_back(clk::now() + std::chrono::microseconds(self->impl.delay_us.load()), std::vector<uint8_t>(d.buf.begin(), d.buf.begin() + static_cast<std::ptrdiff_t>(n)));
      d.queued += n;
      self->pump(d);
      self->read(d);
    });
  }

  void pump(Direction& d) {
    if (dead || d.writing)
      return;
    if (d.queue.empty()) {
      if (d.ended && !d.closed_on) {
        d.closed_on = true;
        error_code ignore;
        d.to->shutdown(tcp::socket::shutdown_send, ignore);
        if (up.closed_on && down.closed_on)
          close();
      }
      return;
    }
    d.writing = true;
    auto self = shared_from_this();
    d.timer.expires_at(d.queue.front().first);
    d.timer.async_wait([self, &d](const error_code& ec) {
      if (ec || self->dead) {
        d.writing = false;
        return;
      }
      asio::async_write(*d.to, asio::buffer(d.queue.front().second), [self, &d](const error_code& ec, std::size_t n) {
        d.writing = false;
        if (ec || self->dead)
          return self->close();
        *d.delivered += n;
        d.queued -= d.queue.front().second.size();
        d.queue.pop_front();
        self->read(d); // if a full queue had stopped it
        self->pump(d);
      });
    });
  }

  void close() {
    if (dead)
      return;
    dead = true;
    error_code ignore;
    client.close(ignore);
    target.close(ignore);
    up.timer.cancel();
    down.timer.cancel();
  }
};

void accept_next(DelayProxy::Impl& impl) {
  impl.acceptor.async_accept([&impl](const error_code& ec, tcp::socket s) {
    if (ec == asio::error::operation_aborted || !impl.acceptor.is_open())
      return;
    if (!ec) {
      ++impl.connections;
      std::make_shared<Conn>(impl, std::move(s))->start();
    }
    accept_next(impl);
  });
}

tcp::endpoint resolve(asio::io_context& io, const std::string& host, uint16_t port, const char* what) {
  error_code ec;
  tcp::resolver r(io);
  auto res = r.resolve(host, std::to_string(port), ec);
  if (ec || res.empty())
    throw model::Error(model::errc::io, std::string("delay proxy: cannot resolve the ") + what + " address " + host +
                                          ":" + std::to_string(port) + (ec ? ": " + ec.message() : ""));
  return res.begin()->endpoint();
}

} // namespace

DelayProxy::DelayProxy(DelayProxyOptions opts) : impl_(std::make_shared<Impl>()) {
  impl_->opts = std::move(opts);
  auto& o = impl_->opts;
  if (o.delay.count() < 0)
    throw model::Error(model::errc::bad_argument, "delay proxy: the delay must be >= 0");
  impl_->delay_us = o.delay.count();
  impl_->target = resolve(impl_->io, o.target_host, o.target_port, "target");
  const auto listen = resolve(impl_->io, o.listen_host, o.listen_port, "listen");
  error_code ec;
  impl_->acceptor.open(listen.protocol(), ec);
  if (!ec)
    impl_->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec)
    impl_->acceptor.bind(listen, ec);
  if (!ec)
    impl_->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec)
    throw model::Error(model::errc::io, "delay proxy: cannot listen on " + o.listen_host + ":" +
                                          std::to_string(o.listen_port) + ": " + ec.message());
  // A target that is this very listener (given so, or a free port picked for
  // it that the target named): every connection would open another to itself.
  const auto bound = impl_->acceptor.local_endpoint(ec);
  const auto& t = impl_->target;
  if (!ec && t.port() == bound.port() &&
      (t.address() == bound.address() || bound.address().is_unspecified() ||
       (t.address().is_loopback() && bound.address().is_loopback()))) {
    impl_->acceptor.close(ec);
    throw model::Error(model::errc::bad_argument, "delay proxy: the target " + o.target_host + ":" +
                                                    std::to_string(o.target_port) +
                                                    " is its own listening address (it would connect to itself)");
  }
  accept_next(*impl_);
  thread_ = std::thread([impl = impl_] { impl->io.run(); });
}

DelayProxy::~DelayProxy() {
  stop();
}

void DelayProxy::stop() {
  if (!thread_.joinable())
    return;
  impl_->io.stop();
  thread_.join();
  error_code ignore;
  impl_->acceptor.close(ignore);
}

uint16_t DelayProxy::port() const {
  error_code ec;
  auto ep = impl_->acceptor.local_endpoint(ec);
  return ec ? 0 : ep.port();
}
void DelayProxy::set_delay(std::chrono::microseconds delay) {
  impl_->delay_us = std::max<int64_t>(0, delay.count());
}

uint64_t DelayProxy::connections() const { return impl_->connections; }
uint64_t DelayProxy::bytes_to_target() const { return impl_->to_target; }
uint64_t DelayProxy::bytes_to_client() const { return impl_->to_client; }

int cmd_delay_proxy(int argc, char** argv) {
  Args a;
  a.option("listen", "HOST:PORT", "where to accept connections (port 0: any free port)")
    .option("to", "HOST:PORT", "where to forward them")
    .option("delay-ms", "MS", "one-way delay in each direction (default 0; fractions allowed)");
  a.parse(argc, argv, 2);
  if (a.help_requested()) {
    std::cout << "usage: strata delay-proxy --listen HOST:PORT --to HOST:PORT --delay-ms MS\n\n"
              << "Forwards TCP connections, holding every chunk MS milliseconds in each direction (in order):\n"
              << "a link with that one-way delay. Point a node's --advertise at it to measure a cluster\n"
              << "across a simulated network (scripts/bench wan). Runs until SIGINT or SIGTERM.\n\noptions:\n"
              << a.help_text();
    return 0;
  }
  const auto listen = parse_endpoint(a.required("listen"), "listen");
  const auto to = parse_endpoint(a.required("to"), "to");
  DelayProxyOptions o;
  o.listen_host = listen.host;
  o.listen_port = listen.port;
  o.target_host = to.host;
  o.target_port = to.port;
  o.delay = std::chrono::microseconds(static_cast<int64_t>(a.number("delay-ms", 0.0, 0.0, 600000.0) * 1000.0));
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr); // before the proxy's thread starts: only sigwait sees them
  DelayProxy proxy(o);
  std::printf("ready delay-proxy %s:%u -> %s:%u delay %.3f ms\n", listen.host.c_str(), proxy.port(), to.host.c_str(),
              to.port, static_cast<double>(o.delay.count()) / 1000.0);
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  proxy.stop();
  std::fprintf(stderr, "[strata] delay-proxy: %llu connections, %llu bytes to %s:%u, %llu back\n",
               static_cast<unsigned long long>(proxy.connections()),
               static_cast<unsigned long long>(proxy.bytes_to_target()), to.host.c_str(), to.port,
               static_cast<unsigned long long>(proxy.bytes_to_client()));
  return 0;
}

} // namespace strata::runtime
