#include "messages/session_id.hpp"

#include <cstdio>
#include <mutex>
#include <random>

namespace strata::msg {

namespace {

// std::random_device reads the kernel's randomness (getrandom on Linux); it is
// not guaranteed thread-safe, hence the lock.
uint64_t random64() {
  static std::mutex mu;
  static std::random_device rd;
  std::lock_guard<std::mutex> g(mu);
  return (static_cast<uint64_t>(rd()) << 32) ^ static_cast<uint64_t>(rd());
}

} // namespace

std::string mint_session_id(const std::string& prefix) {
  char hex[33];
  std::snprintf(hex, sizeof hex, "%016llx%016llx", static_cast<unsigned long long>(random64()),
                static_cast<unsigned long long>(random64()));
  return (prefix.empty() ? std::string("s") : prefix) + "-" + hex;
}

session_key mint_session_key() {
  session_key k;
  do {
    k.hi = random64();
    k.lo = random64();
  } while (k.empty());
  return k;
}

bool valid_session_id(const std::string& id) {
  if (id.empty() || id.size() > 128)
    return false;
  for (unsigned char c : id)
    if (c < 0x21 || c > 0x7e)
      return false;
  return true;
}

} // namespace strata::msg
