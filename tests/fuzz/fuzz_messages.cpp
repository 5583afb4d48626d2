// libFuzzer target (clang): decodes bytes as every strata message type, the
// way a node decodes what a peer sent it. The first byte picks the type; 0
// decodes a whole caf::message (type names + values, as in a BASP payload).
// Whatever decodes must encode and decode again to the same bytes. Crashes,
// sanitizer reports, leaks and allocations over -rss_limit_mb are failures.

#include "messages/messages.hpp"

#include <caf/all.hpp>

#include <cstdint>
#include <cstdlib>
#include <vector>

using namespace strata;

namespace {

struct config : caf::actor_system_config {
  config() { msg::register_types(*this); }
};

caf::actor_system& sys() {
  // Never destroyed: libFuzzer exits through exit(), and CAF's static state
  // may already be gone by the time ~actor_system would run.
  static auto* s = new caf::actor_system(*new config);
  return *s;
}

template <class T>
void decode(const char* data, std::size_t size) {
  caf::binary_deserializer src{sys(), data, size};
  T x;
  if (src(x))
    return; // refused with an error: fine
  std::vector<char> once;
  caf::binary_serializer sink{sys(), once};
  if (sink(x))
    std::abort(); // decoded but cannot be encoded again
  T y;
  caf::binary_deserializer again{sys(), once.data(), once.size()};
  if (again(y))
    std::abort();
  std::vector<char> twice;
  caf::binary_serializer sink2{sys(), twice};
  if (sink2(y) || once != twice)
    std::abort(); // not stable
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  if (size < 1)
    return 0;
  const char* p = reinterpret_cast<const char*>(data + 1);
  const std::size_t n = size - 1;
  switch (data[0] % 14) {
    case 0: {
      caf::binary_deserializer src{sys(), p, n};
      caf::message m;
      (void)src(m);
      break;
    }
    case 1: decode<msg::tensor_blob>(p, n); break;
    case 2: decode<msg::cache_recipe>(p, n); break;
    case 3: decode<msg::hop>(p, n); break;
    case 4: decode<msg::route_info>(p, n); break;
    case 5: decode<msg::sampling_state>(p, n); break;
    case 6: decode<msg::step_request>(p, n); break;
    case 7: decode<msg::step_reply>(p, n); break;
    case 8: decode<msg::shard_stats>(p, n); break;
    case 9: decode<msg::token_event>(p, n); break;
    case 10: decode<msg::generation_result>(p, n); break;
    case 11: decode<msg::model_facts>(p, n); break;
    case 12: decode<msg::session_key>(p, n); break;
    default: decode<msg::generation_request>(p, n); break;
  }
  return 0;
}
