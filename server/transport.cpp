#include "server/transport.hpp"

#include <cstdio>
#include <cstring>
#include <sstream>

namespace strata::server {

using nlohmann::json;

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

Reply Reply::json_body(int status, const json& j) { return {status, "application/json", dump(j), {}}; }

HttpConnection::HttpConnection(tcp::socket s, const TransportLimits& limits, std::shared_ptr<RequestSink> sink,
                               TransportCounters& counters)
  : sock_(std::move(s)), limits_(limits), sink_(std::move(sink)), counters_(counters),
    read_timer_(sock_.get_executor()), write_timer_(sock_.get_executor()) {
  ++counters_.open;
  // The kernel's share of what waits for a slow client is bounded too (Linux
  // would grow it to tcp_wmem's maximum, 4 MiB, per connection): together with
  // max_send_buffer, a client that stops reading holds little and stalls soon,
  // so that the write timeout finds it.
  beast::error_code ignored;
  sock_.set_option(net::socket_base::send_buffer_size(static_cast<int>(kernel_send_buffer)), ignored);
}

HttpConnection::~HttpConnection() { --counters_.open; }

void HttpConnection::start() { read(); }

void HttpConnection::refuse(const Reply& r) {
  phase_ = Phase::handling;
  respond(r, false);
}

void HttpConnection::read() {
  if (phase_ == Phase::closed)
    return;
  if (probe_in_flight_) {
    // The disconnect probe is still reading: end it first (it may already hold
    // the next request's first byte); its handler then reads.
    phase_ = Phase::awaiting_probe;
    beast::error_code ignored;
    sock_.cancel(ignored);
    return;
  }
  phase_ = Phase::reading;
  gone_ = nullptr;
  parser_.emplace();
  parser_->body_limit(limits_.max_body);
  parser_->header_limit(16 * 1024);
  // The whole request (header and body) must arrive within the header timeout
  // on a new connection; a keep-alive connection may first idle for the idle timeout.
  read_timer_.expires_after(first_request_ ? limits_.header_timeout : limits_.idle_timeout);
  first_request_ = false;
  read_timer_.async_wait([weak = weak_from_this()](beast::error_code ec) {
    if (ec)
      return; // cancelled: the request arrived
    if (auto self = weak.lock()) {
      ++self->counters_.timed_out;
      self->close();
    }
  });
  http::async_read(sock_, buf_, *parser_, [self = shared_from_this()](beast::error_code ec, std::size_t) {
    self->read_timer_.cancel();
    self->on_read(ec);
  });
}

void HttpConnection::on_read(beast::error_code ec) {
  if (phase_ == Phase::closed)
    return;
  if (ec == net::error::operation_aborted)
    return close(); // the read deadline passed
  if (ec == http::error::end_of_stream || ec == net::error::eof || ec == net::error::connection_reset)
    return close();
  phase_ = Phase::handling;
  if (ec == http::error::body_limit) {
    ApiError e;
    e.status = 413;
    e.message = "the request body is larger than the limit of " + std::to_string(limits_.max_body) + " bytes";
    e.code = "request_too_large";
    return sink_->on_unreadable(shared_from_this(), e);
  }
  if (ec) {
    ApiError e;
    e.status = 400;
    e.message = "malformed HTTP request: " + ec.message();
    return sink_->on_unreadable(shared_from_this(), e);
  }
  Request req;
  req.msg = parser_->release();
  const std::string target(req.msg.target());
  req.path = target.substr(0, target.find('?'));
  req.origin = std::string(req.msg[http::field::origin]);
  req.keep_alive = req.msg.keep_alive();
  sink_->on_request(shared_from_this(), std::move(req));
}

void HttpConnection::respond(const Reply& r, bool keep_alive) {
  if (phase_ != Phase::handling)
    return; // answered already, or the client is gone
  http::response<http::string_body> res{static_cast<http::status>(r.status), 11};
  res.set(http::field::server, "strata");
  res.set(http::field::content_type, r.content_type);
  for (auto& [k, v] : r.headers)
    res.set(k, v);
  res.keep_alive(keep_alive);
  res.body() = r.body;
  res.prepare_payload();
  std::ostringstream bytes;
  bytes << res;
  phase_ = Phase::responding;
  keep_alive_after_ = keep_alive;
  queue(bytes.str());
}

void HttpConnection::begin_stream(const std::vector<std::pair<std::string, std::string>>& headers) {
  if (phase_ != Phase::handling)
    return;
  phase_ = Phase::streaming;
  std::string extra;
  for (auto& [k, v] : headers)
    extra += k + ": " + v + "\r\n";
  queue("HTTP/1.1 200 OK\r\nServer: strata\r\nContent-Type: text/event-stream\r\nCache-Control: "
        "no-cache\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n" +
        extra + "\r\n");
}

void HttpConnection::send_event(std::string_view data) {
  if (phase_ != Phase::streaming)
    return;
  std::string ev = "data: ";
  ev.append(data);
  ev += "\n\n";
  char len[32];
  std::snprintf(len, sizeof len, "%zx\r\n", ev.size());
  queue(len + ev + "\r\n");
}

void HttpConnection::end_stream() {
  if (phase_ != Phase::streaming)
    return;
  phase_ = Phase::responding;
  keep_alive_after_ = false;
  queue("0\r\n\r\n");
}

void HttpConnection::watch_disconnect(std::function<void(bool)> gone) {
  if (phase_ == Phase::closed || probe_in_flight_)
    return;
  gone_ = std::move(gone);
  probe_in_flight_ = true;
  sock_.async_read_some(net::buffer(probe_), [self = shared_from_this()](beast::error_code ec, std::size_t n) {
    self->probe_in_flight_ = false;
    if (!ec && n == 1) { // the client's next request began: keep its first byte for the parser
      auto b = self->buf_.prepare(1);
      std::memcpy(b.data(), self->probe_, 1);
      self->buf_.commit(1);
    }
    if (self->phase_ == Phase::awaiting_probe) // the answer is out: read the next request
      return self->read();
    if (ec && ec != net::error::operation_aborted && self->gone_) {
      auto gone = std::move(self->gone_);
      self->gone_ = nullptr;
      gone(false);
    }
  });
}

void HttpConnection::when_answered(std::function<void()> done) {
  if (phase_ == Phase::reading || phase_ == Phase::awaiting_probe || phase_ == Phase::closed)
    return done();
  if (answered_) // two waiters: both are told
    answered_ = [first = std::move(answered_), second = std::move(done)] {
      first();
      second();
    };
  else
    answered_ = std::move(done);
}

void HttpConnection::answered() {
  if (auto done = std::move(answered_)) {
    answered_ = nullptr;
    done();
  }
}

void HttpConnection::close() {
  if (phase_ == Phase::closed)
    return answered();
  phase_ = Phase::closed;
  gone_ = nullptr; // (it may hold what holds this connection)
  out_.clear();
  queued_bytes_ = 0;
  read_timer_.cancel();
  write_timer_.cancel();
  beast::error_code ec;
  sock_.shutdown(tcp::socket::shutdown_send, ec);
  sock_.close(ec);
  answered();
}

void HttpConnection::queue(std::string bytes) {
  if (phase_ == Phase::closed)
    return;
  // A client that does not read: its bytes are not kept without bound (one
  // answer may be larger than the limit when nothing else waits).
  if (queued_bytes_ > 0 && queued_bytes_ + bytes.size() > limits_.max_send_buffer)
    return client_stalled(counters_.send_overflows);
  queued_bytes_ += bytes.size();
  out_.push_back(std::move(bytes));
  flush();
}

void HttpConnection::client_stalled(std::atomic<uint64_t>& counter) {
  ++counter;
  if (auto gone = std::move(gone_)) { // whoever answers it stops (a generation ends its sessions)
    gone_ = nullptr;
    gone(true);
  }
  close();
}

void HttpConnection::flush() {
  if (write_in_flight_ || out_.empty() || phase_ == Phase::closed)
    return;
  write_in_flight_ = true;
  const uint64_t seq = ++write_seq_;
  write_timer_.expires_after(limits_.write_timeout);
  write_timer_.async_wait([weak = weak_from_this(), seq](beast::error_code ec) {
    auto self = weak.lock();
    if (ec || !self || !self->write_in_flight_ || self->write_seq_ != seq)
      return; // that write finished in time
    self->client_stalled(self->counters_.write_timeouts);
  });
  net::async_write(sock_, net::buffer(out_.front()), [self = shared_from_this()](beast::error_code ec, std::size_t) {
    self->write_in_flight_ = false;
    self->write_timer_.cancel();
    if (self->phase_ == Phase::closed)
      return;
    self->queued_bytes_ -= self->out_.front().size();
    self->out_.pop_front();
    if (ec) // the client is gone
      return self->client_stalled(self->counters_.write_errors);
    if (!self->out_.empty())
      return self->flush();
    if (self->phase_ == Phase::responding)
      self->after_answer();
  });
}

void HttpConnection::after_answer() {
  if (!keep_alive_after_)
    return close();
  answered();
  read();
}

} // namespace strata::server
