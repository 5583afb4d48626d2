#pragma once
// The one error enum of strata's actor layer, carried inside caf::error
// (category "strata"). Values are spaced so they stay stable on the wire.

#include <caf/error.hpp>
#include <caf/message.hpp>
#include <caf/make_message.hpp>

#include <cstdint>
#include <string>

namespace strata {

enum class ec : uint8_t {
  none = 0,
  /// A request carries a route epoch older than the newest the shard has seen for
  /// that session.
  stale_epoch = 10,
  /// The request's cache recipe (model, dtype, KV geometry, layer range) does not
  /// match the shard.
  incompatible_recipe = 11,
  /// One session alone needs more cache than the shard's whole byte budget.
  budget_exceeded = 12,
  /// An activation or token list has the wrong shape for the shard.
  bad_shape = 13,
  /// A malformed request (mode, positions, empty input, ...).
  bad_request = 14,
  /// A step, release or lease names a session id whose caches another owner
  /// holds (a different session key); nothing of the owner's was touched.
  session_conflict = 15,
  /// The shard's queue is full (or its cache pool is held by steps in flight):
  /// retry later, with backoff. Nothing was changed.
  overloaded = 16,
  /// The shard's model rejected the input (token out of range, context overflow).
  model_error = 20,
  /// No complete route covers all layers within the wait bound.
  no_route = 30,
  /// A step got no answer within its deadline, and retries ran out.
  step_timeout = 31,
  /// Recovery did not succeed within the retry bound.
  retries_exhausted = 32,
  /// The request was invalid before anything ran (prompt, sampling settings).
  invalid_request = 33,
  /// The session's coordinator went away and no coordinator took its place
  /// within the client's route wait.
  cluster_lost = 34,
  /// The generation was cancelled by its client.
  cancelled = 40,
};

const char* to_string(ec code);

/// Renders errors of the "strata" category for actor_system_config::add_error_category.
std::string render_error(uint8_t code, const caf::message& context);

} // namespace strata

CAF_ERROR_CODE_ENUM(strata::ec, "strata")
