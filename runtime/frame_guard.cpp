#include "runtime/frame_guard.hpp"

#include "runtime/log.hpp"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace strata::runtime::frames {

namespace {

constexpr std::size_t header_size = 32;      // BASP header of CAF 0.17
constexpr std::size_t payload_len_at = 4;    // after operation, 2 padding bytes, flags; big-endian u32

std::atomic<uint64_t> max_payload{uint64_t{65} << 20};
std::atomic<uint64_t> refusals{0};

struct State {
  enum Kind : uint8_t { unknown, ignored, basp, refused } kind = unknown;
  uint8_t header_got = 0;
  unsigned char header[header_size];
  uint64_t payload_left = 0;
};

// Built on first use and never destroyed: close() is called before main and
// after static destruction too.
struct Registry {
  std::mutex mu;
  std::unordered_map<uintptr_t, State> tcp, tls;
};

Registry& reg() {
  static auto* r = new Registry;
  return *r;
}

std::unordered_map<uintptr_t, State>& states(stream kind) {
  return kind == stream::tcp ? reg().tcp : reg().tls;
}

} // namespace

void set_limit(uint64_t bytes) {
  max_payload = bytes;
}

uint64_t limit() {
  return max_payload.load();
}

bool is_basp_start(unsigned char first_byte) {
  return first_byte < 0x20;
}

bool feed(stream kind, uintptr_t key, const unsigned char* data, std::size_t n, bool (*classify)(uintptr_t)) {
  if (n == 0)
    return true;
  std::lock_guard<std::mutex> g(reg().mu);
  State& s = states(kind)[key];
  if (s.kind == State::unknown) {
    if (kind == stream::tls)
      s.kind = State::basp; // strata's TLS connections are all BASP
    else
      s.kind = (classify == nullptr || classify(key)) && is_basp_start(data[0]) ? State::basp : State::ignored;
  }
  if (s.kind == State::ignored)
    return true;
  if (s.kind == State::refused)
    return false;
  while (n > 0) {
    if (s.payload_left > 0) {
      const auto take = static_cast<std::size_t>(std::min<uint64_t>(n, s.payload_left));
      s.payload_left -= take;
      data += take;
      n -= take;
      continue;
    }
    const std::size_t take = std::min(n, header_size - s.header_got);
    std::memcpy(s.header + s.header_got, data, take);
    s.header_got = static_cast<uint8_t>(s.header_got + take);
    data += take;
    n -= take;
    if (s.header_got < header_size)
      break;
    s.header_got = 0;
    const unsigned char* p = s.header + payload_len_at;
    const uint64_t len = (uint64_t{p[0]} << 24) | (uint64_t{p[1]} << 16) | (uint64_t{p[2]} << 8) | uint64_t{p[3]};
    if (len > max_payload.load()) {
      s.kind = State::refused;
      ++refusals;
      log::warn(std::string("refused a ") + (kind == stream::tcp ? "TCP" : "TLS") +
                " connection whose frame announces " + std::to_string(len) + " bytes (limit " +
                std::to_string(max_payload.load()) + ")");
      return false;
    }
    s.payload_left = len;
  }
  return true;
}

void forget(stream kind, uintptr_t key) {
  std::lock_guard<std::mutex> g(reg().mu);
  states(kind).erase(key);
}

uint64_t refused_count() {
  return refusals.load();
}

} // namespace strata::runtime::frames
