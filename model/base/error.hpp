#pragma once
// Typed errors raised by the model layer. Every error names what is wrong
// (a file, a field, a token id) so that a caller can print it as is.

#include <cstdint>
#include <stdexcept>
#include <string>

namespace strata::model {

/// What kind of failure occurred. Values are spaced so they stay stable if the
/// enum is ever put on the wire.
enum class errc : uint8_t {
  io = 1,                 ///< a file could not be opened, read or mapped
  bad_format = 10,        ///< a file is not in the expected format at all
  corrupt = 11,           ///< a file is in the right format but inconsistent (sizes, offsets)
  unsupported = 12,       ///< a valid file uses a feature strata does not implement
  missing_tensor = 13,    ///< a tensor the shard needs is absent from the checkpoint
  bad_config = 20,        ///< a configuration value is missing or out of range
  bad_argument = 30,      ///< an argument is invalid (layer range, sampler settings, ...)
  token_out_of_range = 31,///< a token id is outside the vocabulary
  context_overflow = 32,  ///< the sequence would exceed max_seq_len
  bad_position = 33,      ///< positions are not the next ones the cache expects
  bad_shape = 34,         ///< an activation has the wrong shape for this shard
  cache_full = 35,        ///< the block pool has too few free blocks for the sequence
  bad_text = 40,          ///< text is not valid UTF-8
};

const char* to_string(errc code);

/// Exception thrown by the model layer. `what()` is "<code>: <message>".
class Error : public std::runtime_error {
public:
  Error(errc code, const std::string& message);
  errc code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }

private:
  errc code_;
  std::string message_;
};

} // namespace strata::model
