#pragma once
// The one place that mints session ids and session keys. Ids name a session in
// logs, events and steps; keys are the secret that proves ownership of its
// caches on every shard (see msg::session_key and docs/protocol.md). Both come
// from 128 bits of the operating system's randomness, never from a counter or
// a constant, so concurrent clients cannot collide.

#include "messages/messages.hpp"

#include <string>

namespace strata::msg {

/// "PREFIX-" + 32 hex digits (128 random bits). PREFIX says who started it
/// (cli, http, example, bench, test) and is for humans only.
std::string mint_session_id(const std::string& prefix);

/// A fresh non-zero 128-bit session key.
session_key mint_session_key();

/// Ids a session accepts from a client: 1-128 printable ASCII characters.
bool valid_session_id(const std::string& id);

} // namespace strata::msg
