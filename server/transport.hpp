#pragma once
// The HTTP transport (Boost.Beast, HTTP/1.1): one TCP connection. It reads
// requests (the whole request within the header timeout on a new connection; a
// keep-alive connection may first idle for the idle timeout), hands each to its
// RequestSink, writes the answer (one response, or a chunked event stream), and
// notices a client that goes away while its request is being answered. It knows
// nothing of endpoints, authentication or generations. Internal to server/.

#include "server/openai.hpp"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

/// One whole response.
struct Reply {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers; ///< extra response headers
  static Reply json_body(int status, const nlohmann::json& j);
  static Reply error(const ApiError& e) { return json_body(e.status, e.body()); }
};

/// JSON text that never throws: invalid UTF-8 (a sampled model can produce any
/// bytes) becomes U+FFFD.
std::string dump(const nlohmann::json& j);

struct TransportLimits {
  std::size_t max_body = 1 << 20;                  ///< larger bodies are unreadable (413)
  std::chrono::milliseconds header_timeout{10000}; ///< a request (header + body) must arrive within this
  std::chrono::milliseconds idle_timeout{30000};   ///< an idle keep-alive connection is closed after this
  std::chrono::milliseconds write_timeout{30000};  ///< a write the client does not take within this closes it
  std::size_t max_send_buffer = 1 << 20;           ///< bytes queued behind a write in flight; past it the client is gone
};

/// The kernel send buffer of every connection (SO_SNDBUF; Linux doubles it).
constexpr std::size_t kernel_send_buffer = 128 << 10;

/// Counters the transport keeps for the whole server.
struct TransportCounters {
  std::atomic<std::size_t> open{0};          ///< open connections
  std::atomic<uint64_t> timed_out{0};        ///< closed by the header or idle deadline
  std::atomic<uint64_t> write_timeouts{0};   ///< closed: a write waited longer than the write timeout
  std::atomic<uint64_t> send_overflows{0};   ///< closed: more than max_send_buffer waited to be written
  std::atomic<uint64_t> write_errors{0};     ///< closed: a write failed (the client reset the connection)
};

/// A request as it arrived.
struct Request {
  http::request<http::string_body> msg;
  std::string path;   ///< the target without its query
  std::string origin; ///< the Origin header ("" when none)
  bool keep_alive = true;
};

class HttpConnection;
using ConnectionPtr = std::shared_ptr<HttpConnection>;

/// Where requests go. Every call comes on the connection's io thread; the sink
/// answers each request exactly once (respond(), or a stream), from any thread
/// through the connection's executor.
class RequestSink {
public:
  virtual ~RequestSink() = default;
  virtual void on_request(const ConnectionPtr& c, Request req) = 0;
  /// A request that could not be read (malformed: 400, body too large: 413);
  /// answer it with keep_alive false.
  virtual void on_unreadable(const ConnectionPtr& c, const ApiError& why) = 0;
};

class HttpConnection : public std::enable_shared_from_this<HttpConnection> {
public:
  /// What the connection is doing. Every transition is on the io thread.
  enum class Phase : uint8_t {
    reading,       ///< waiting for a request (its deadline armed)
    handling,      ///< a request is with the sink; nothing of its answer is written yet
    responding,    ///< one response is being written; then the next request, or close
    streaming,     ///< an event stream is open (chunked); it ends with close
    awaiting_probe, ///< the answer is out; the next read starts when the disconnect probe returns
    closed,
  };

  HttpConnection(tcp::socket s, const TransportLimits& limits, std::shared_ptr<RequestSink> sink,
                 TransportCounters& counters);
  ~HttpConnection();
  HttpConnection(const HttpConnection&) = delete;
  HttpConnection& operator=(const HttpConnection&) = delete;

  /// Reads the first request.
  void start();
  /// Answers without reading a request (a connection over the cap): `r`, then close.
  void refuse(const Reply& r);

  /// Answers the request being handled: writes `r`, then reads the next request
  /// when `keep_alive` (and the sink has not asked to close), else closes.
  void respond(const Reply& r, bool keep_alive);
  /// Opens an event stream: 200, text/event-stream, chunked, Connection: close,
  /// with `headers` added.
  void begin_stream(const std::vector<std::pair<std::string, std::string>>& headers);
  /// One Server-Sent Event ("data: <data>\n\n") as a chunk.
  void send_event(std::string_view data);
  /// The last event's chunk is followed by the terminal chunk; the connection
  /// closes once it is out.
  void end_stream();
  /// While the request is being answered, watches the socket: calls `gone` once
  /// (on the io thread) if the client closes or resets the connection
  /// (`write_failed` false) or a write to it fails (true). A byte that arrives
  /// instead (the client's next request) is kept for the parser.
  void watch_disconnect(std::function<void(bool write_failed)> gone);
  /// Calls `done` once (on the io thread) when the answer being written is all
  /// out or the connection closes; at once when neither an answer nor a
  /// stream is in progress. (A stopping server waits for its last answers.)
  void when_answered(std::function<void()> done);
  void close();

  Phase phase() const { return phase_; }
  bool streaming() const { return phase_ == Phase::streaming; }
  net::any_io_executor executor() { return sock_.get_executor(); }

private:
  void read();
  void on_read(beast::error_code ec);
  void queue(std::string bytes);
  void flush();
  void after_answer(); // the whole answer is out
  void client_stalled(std::atomic<uint64_t>& counter); // it does not take what is written: close

  tcp::socket sock_;
  TransportLimits limits_;
  std::shared_ptr<RequestSink> sink_;
  TransportCounters& counters_;
  Phase phase_ = Phase::handling;
  beast::flat_buffer buf_;
  std::optional<http::request_parser<http::string_body>> parser_;
  net::steady_timer read_timer_;
  bool first_request_ = true;
  bool keep_alive_after_ = false; // what after_answer() does: read the next request, or close
  // Writes: one at a time, in order, with at most max_send_buffer bytes waiting
  // behind the one in flight, which must finish within the write timeout.
  std::deque<std::string> out_;
  std::size_t queued_bytes_ = 0; // in out_, the write in flight included
  bool write_in_flight_ = false;
  uint64_t write_seq_ = 0; // which write the write timer is for
  net::steady_timer write_timer_;
  // The disconnect probe: a one-byte read outstanding while the request is answered.
  char probe_[1] = {};
  bool probe_in_flight_ = false;
  std::function<void(bool)> gone_;
  std::function<void()> answered_;
  void answered(); // calls answered_ once
};

} // namespace strata::server
