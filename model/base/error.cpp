#include "model/base/error.hpp"

namespace strata::model {

const char* to_string(errc code) {
  switch (code) {
    case errc::io: return "io_error";
    case errc::bad_format: return "bad_format";
    case errc::corrupt: return "corrupt";
    case errc::unsupported: return "unsupported";
    case errc::missing_tensor: return "missing_tensor";
    case errc::bad_config: return "bad_config";
    case errc::bad_argument: return "bad_argument";
    case errc::token_out_of_range: return "token_out_of_range";
    case errc::context_overflow: return "context_overflow";
    case errc::bad_position: return "bad_position";
    case errc::bad_shape: return "bad_shape";
    case errc::cache_full: return "cache_full";
    case errc::bad_text: return "bad_text";
  }
  return "unknown_error";
}

Error::Error(errc code, const std::string& message)
  : std::runtime_error(std::string(to_string(code)) + ": " + message),
    code_(code),
    message_(message) {
}

} // namespace strata::model
