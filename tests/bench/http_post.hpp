#pragma once
// Benchmarks only: one HTTP/1.1 POST from this process over a plain socket,
// the client the serve benchmarks give every server alike. A curl process per
// request cost 10-20 ms of CPU to start; 8 or 16 of them starting together on
// a 2-core machine took those cores from the server under test at the moment
// a crowd's prompts arrived (its prefill rounds ran 3-4 times longer than
// alone), which charged the client's start-up to the crowd's throughput.

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdlib>
#include <string>

namespace strata::bench {

/// POSTs `body` (JSON) to base + path (base: "http://HOST:PORT") and returns
/// the response's body, or "" when the server cannot be reached, answers
/// nothing within timeout_s, or sends what this does not read (chunked
/// bodies are decoded).
inline std::string http_post(const std::string& base, const std::string& path, const std::string& body,
                             int timeout_s = 600) {
  const std::string prefix = "http://";
  if (base.compare(0, prefix.size(), prefix) != 0)
    return "";
  const std::string hostport = base.substr(prefix.size());
  const auto colon = hostport.rfind(':');
  if (colon == std::string::npos)
    return "";
  const std::string host = hostport.substr(0, colon), port = hostport.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr)
    return "";
  const int fd = ::socket(res->ai_family, res->ai_socktype, res->ai_protocol);
  if (fd < 0 || ::connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
    ::freeaddrinfo(res);
    if (fd >= 0)
      ::close(fd);
    return "";
  }
  ::freeaddrinfo(res);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  const std::string req = "POST " + path + " HTTP/1.1\r\nHost: " + hostport +
                          "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
                          "\r\nConnection: close\r\n\r\n" + body;
  for (std::size_t sent = 0; sent < req.size();) {
    const ssize_t n = ::send(fd, req.data() + sent, req.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) {
      ::close(fd);
      return "";
    }
    sent += static_cast<std::size_t>(n);
  }
  // Everything until the server closes (Connection: close), within the deadline.
  std::string in;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  char buf[16384];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) {
      ::close(fd);
      return "";
    }
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n < 0) {
      ::close(fd);
      return "";
    }
    if (n == 0)
      break;
    in.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  const auto head_end = in.find("\r\n\r\n");
  if (head_end == std::string::npos)
    return "";
  std::string head = in.substr(0, head_end), payload = in.substr(head_end + 4);
  for (auto& c : head)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (head.find("transfer-encoding: chunked") == std::string::npos)
    return payload;
  std::string out;
  for (std::size_t at = 0;;) { // size line (hex), CRLF, data, CRLF; a zero size ends
    const auto eol = payload.find("\r\n", at);
    if (eol == std::string::npos)
      return "";
    const std::size_t size = std::strtoul(payload.substr(at, eol - at).c_str(), nullptr, 16);
    if (size == 0)
      return out;
    if (eol + 2 + size > payload.size())
      return "";
    out.append(payload, eol + 2, size);
    at = eol + 2 + size + 2;
  }
}

} // namespace strata::bench
