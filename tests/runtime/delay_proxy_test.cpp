// The delay proxy (issue 27): it delays what it should, both ways, keeps the
// order of a burst without serializing it, passes a closed end on, and reports
// a target it cannot reach by closing the client's connection.

#include "runtime/delay_proxy.hpp"

#include "model/base/error.hpp"

#include <utility> // (boost 1.74's asio uses std::exchange without including it)

#include <boost/asio.hpp>
#include <gtest/gtest.h>

#include <chrono>
#include <sys/socket.h>
#include <thread>

namespace strata {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using clk = std::chrono::steady_clock;

double ms_since(clk::time_point t0) {
  return std::chrono::duration<double, std::milli>(clk::now() - t0).count();
}

// An echo server on a thread: writes back whatever it reads, closes after EOF.
struct Echo {
  asio::io_context io;
  tcp::acceptor acceptor{io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)};
  std::thread thread;
  Echo() {
    thread = std::thread([this] {
      boost::system::error_code ec;
      while (true) {
        tcp::socket s(io);
        acceptor.accept(s, ec);
        if (ec)
          return;
        std::array<char, 4096> buf;
        while (true) {
          const auto n = s.read_some(asio::buffer(buf), ec);
          if (ec)
            break;
          asio::write(s, asio::buffer(buf.data(), n), ec);
        }
      }
    });
  }
  ~Echo() {
    ::shutdown(acceptor.native_handle(), SHUT_RDWR); // wakes the blocked accept (Linux)
    thread.join();
    boost::system::error_code ec;
    acceptor.close(ec);
  }
  uint16_t port() const { return acceptor.local_endpoint().port(); }
};

runtime::DelayProxyOptions to(uint16_t port, double delay_ms) {
  runtime::DelayProxyOptions o;
  o.target_port = port;
  o.delay = std::chrono::microseconds(static_cast<int64_t>(delay_ms * 1000));
  return o;
}

TEST(DelayProxy, DelaysEachDirectionKeepsOrderAndPassesTheEndOn) {
  Echo echo;
  const double d = 40;
  runtime::DelayProxy proxy(to(echo.port(), d));
  asio::io_context io;
  tcp::socket s(io);
  s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), proxy.port()));
  s.set_option(tcp::no_delay(true));
  // One round trip crosses the delay twice.
  for (int i = 0; i < 3; ++i) {
    const auto t0 = clk::now();
    asio::write(s, asio::buffer("ping", 4));
    std::array<char, 4> got{};
    asio::read(s, asio::buffer(got));
    const double rtt = ms_since(t0);
    EXPECT_EQ(std::string(got.data(), 4), "ping");
    EXPECT_GE(rtt, 2 * d) << "round trip " << i;
    EXPECT_LT(rtt, 2 * d + 1000) << "round trip " << i; // loose: a busy machine, not the delay, decides this
  }
  // A burst of 200 numbered chunks sent at once comes back whole and in order,
  // delayed as a burst (not 200 x the delay).
  std::vector<uint32_t> sent(200 * 64);
  for (std::size_t i = 0; i < sent.size(); ++i)
    sent[i] = static_cast<uint32_t>(i * 2654435761u);
  const auto t0 = clk::now();
  for (int c = 0; c < 200; ++c)
    asio::write(s, asio::buffer(sent.data() + c * 64, 64 * sizeof(uint32_t)));
  std::vector<uint32_t> back(sent.size());
  asio::read(s, asio::buffer(back));
  const double burst = ms_since(t0);
  EXPECT_EQ(back, sent);
  EXPECT_GE(burst, 2 * d);
  EXPECT_LT(burst, 20 * d) << "the chunks of a burst wait side by side";
  // Closing our sending side reaches the server after the delay; it closes, and
  // that end reaches us.
  s.shutdown(tcp::socket::shutdown_send);
  std::array<char, 1> one{};
  boost::system::error_code ec;
  s.read_some(asio::buffer(one), ec);
  EXPECT_EQ(ec, asio::error::eof);
  EXPECT_EQ(proxy.connections(), 1u);
  EXPECT_EQ(proxy.bytes_to_target(), 12 + sent.size() * sizeof(uint32_t));
  EXPECT_EQ(proxy.bytes_to_client(), proxy.bytes_to_target());
}

TEST(DelayProxy, AnUnreachableTargetClosesTheClientsConnection) {
  // A port bound but not listening (connections to it are refused) and kept
  // bound, so the proxy's own free port cannot be that one (it once was: a
  // proxy pointed at itself, now refused, see below).
  asio::io_context io;
  tcp::socket dead(io);
  dead.open(tcp::v4());
  dead.bind(tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  const uint16_t dead_port = dead.local_endpoint().port();
  runtime::DelayProxy proxy(to(dead_port, 5));
  tcp::socket s(io);
  s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), proxy.port()));
  std::array<char, 1> one{};
  boost::system::error_code ec;
  s.read_some(asio::buffer(one), ec);
  EXPECT_TRUE(ec == asio::error::eof || ec == asio::error::connection_reset) << ec.message();
}

TEST(DelayProxy, RefusesATargetThatIsItsOwnListeningAddress) {
  // The port it listens on, named as its target: every connection would open
  // another to the proxy itself, without end.
  uint16_t port = 0;
  {
    asio::io_context io;
    tcp::acceptor a(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    port = a.local_endpoint().port();
  }
  runtime::DelayProxyOptions o = to(port, 1);
  o.listen_port = port;
  try {
    runtime::DelayProxy p(o);
    ADD_FAILURE() << "a proxy whose target is itself was started";
  } catch (const model::Error& e) {
    EXPECT_EQ(e.code(), model::errc::bad_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("its own listening address"), std::string::npos) << e.what();
  }
}

TEST(DelayProxy, RefusesAnAddressItCannotListenOn) {
  runtime::DelayProxyOptions o = to(1, 1);
  o.listen_host = "203.0.113.1"; // TEST-NET-3: not an address of this machine
  EXPECT_THROW(runtime::DelayProxy p(o), std::exception);
}

} // namespace
} // namespace strata
