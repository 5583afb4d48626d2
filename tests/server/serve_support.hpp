#pragma once
// What the tests of `strata serve` share: running the strata executable and
// shell commands, a coordinator with one node, HTTP with curl, raw sockets,
// and reading SSE bodies.

#include "tests/cluster/process.hpp"
#include "tests/support.hpp"

#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <chrono>
#include <netinet/in.h>
#include <poll.h>
#include <sstream>
#include <string>
#include <sys/socket.h>
#include <unistd.h>

namespace strata::servetest {

using test::Process;
using nlohmann::json;

inline const std::string exe = STRATA_EXE;

inline std::string sh(const std::string& cmd) {
  Process p({"/bin/sh", "-c", cmd});
  return p.drain();
}

inline bool have(const std::string& tool) { return sh("command -v " + tool + " >/dev/null && echo yes") == "yes\n"; }

inline std::string quote(const std::string& s) { // for /bin/sh single quotes
  std::string o = "'";
  for (char c : s)
    o += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return o + "'";
}

struct Http {
  int status = 0;
  std::string body;
};


// What a single-process run generates after `prompt` (greedy).
inline std::string local_text(const std::string& prompt, int max_tokens) {
  const auto out = sh(exe + " generate --model builtin:tiny --prompt " + quote(prompt) + " --max-tokens " +
                      std::to_string(max_tokens) + " 2>/dev/null");
  EXPECT_EQ(out.rfind(prompt, 0), 0u) << out;
  return out.substr(prompt.size(), out.size() - prompt.size() - 1); // without the prompt and the newline
}

inline std::string completion_body(const std::string& prompt, int max_tokens, bool stream, const std::string& more = "") {
  return json{{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"stream", stream}}.dump().insert(1, more);
}

// The text of an SSE response; `finish` gets the last finish_reason, `done` whether [DONE] came.
inline std::string sse_text(const std::string& body, std::string* finish = nullptr, bool* done = nullptr, json* usage = nullptr) {
  std::istringstream is(body);
  std::string line, text;
  while (std::getline(is, line)) {
    if (line.rfind("data: ", 0) != 0)
      continue;
    const auto data = line.substr(6);
    if (data == "[DONE]") {
      if (done)
        *done = true;
      continue;
    }
    auto j = json::parse(data);
    if (j.contains("usage") && usage)
      *usage = j["usage"];
    if (j["choices"].empty())
      continue;
    auto& ch = j["choices"][0];
    if (ch.contains("text"))
      text += ch["text"].get<std::string>();
    if (ch.contains("delta") && ch["delta"].contains("content"))
      text += ch["delta"]["content"].get<std::string>();
    if (!ch["finish_reason"].is_null() && finish)
      *finish = ch["finish_reason"].get<std::string>();
  }
  return text;
}


using test::connect_to;
using test::free_port;

// Waits until the peer closes `fd` (read returns 0 or an error); false after `timeout`.
inline bool closed_by_peer(int fd, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  char buf[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 1))) <= 0)
      continue;
    if (::read(fd, buf, sizeof buf) <= 0)
      return true;
  }
  return false;
}

inline uint16_t port_of(const std::string& ready_line) { // "ready http 127.0.0.1:PORT"
  return static_cast<uint16_t>(std::atoi(ready_line.c_str() + ready_line.rfind(':') + 1));
}

// A coordinator and one builtin:tiny node serving every layer.
struct OneNode {
  Process coordinator{{exe, "node", "--coordinator", "--listen", "127.0.0.1:0"}};
  std::string cluster = coordinator.wait_line("ready coordinator ").substr(18);
  Process node{{exe, "node", "--listen", "127.0.0.1:0", "--join", cluster, "--model", "builtin:tiny", "--layers", "0-4",
                "--threads", "1"}};
  bool ready = !node.wait_line("ready node ").empty();
};

} // namespace strata::servetest
