// libFuzzer target (clang): parses bytes as a GGUF file (header, metadata,
// tensor directory) and reads every key through the typed getters, the way a
// node reads a model file it was given. Anything but strata::model::Error
// escaping, a crash, a sanitizer report or an allocation over -malloc_limit_mb
// is a failure.

#include "model/base/error.hpp"
#include "model/formats/gguf.hpp"

#include <cstdint>

using namespace strata::model;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    GgufFile f("fuzz.gguf", data, size);
    // A getter asked for another type throws a typed error; nothing else may escape.
    auto ask = [](auto&& get) {
      try {
        (void)get();
      } catch (const Error&) {
      }
    };
    for (const auto& entry : f.metadata()) {
      const std::string& key = entry.first; // a plain reference: clang 14 lambdas cannot capture bindings
      ask([&] { return f.opt_string(key); });
      ask([&] { return f.opt_int(key); });
      ask([&] { return f.opt_float(key); });
      ask([&] { return f.opt_numbers(key); });
      ask([&] { return f.opt_strings(key); });
    }
    // Every byte a tensor claims must be readable.
    uint64_t sum = 0;
    for (const auto& [name, t] : f.tensors())
      if (t.nbytes > 0)
        sum += t.data[0] + t.data[t.nbytes - 1];
    return static_cast<int>(sum & 0);
  } catch (const Error&) {
    return 0;
  }
}
