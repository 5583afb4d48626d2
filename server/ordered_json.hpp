#pragma once
// JSON with its object keys in the order they were written, parsed in linear
// time: nlohmann::ordered_json's own parser looks every key up in the object
// built so far (80,000 keys from a client took seconds).

#include <nlohmann/json.hpp>

#include <string_view>

namespace strata::server {

/// The value `text` holds, keys in their order (a repeated key keeps its first
/// place and its last value, as Python's json does), or a discarded value
/// (is_discarded()) when `text` is not JSON.
nlohmann::ordered_json parse_ordered(std::string_view text);

} // namespace strata::server
