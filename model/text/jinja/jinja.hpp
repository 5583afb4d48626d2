#pragma once
// A template engine for the Jinja subset that Hugging Face chat templates use,
// with the settings transformers renders them with (trim_blocks, lstrip_blocks,
// loop controls, the sandbox's read-only lists and dicts). Statements: if / elif
// / else, for (with loop.*, else, an if filter, tuple targets, break/continue),
// set (names, namespace attributes, blocks), macro, generation, filter blocks.
// Expressions: literals, lists, dicts, tuples, attribute / item / slice access,
// calls, filters, tests, arithmetic, comparisons, `in`, `~`, conditional
// expressions. docs/operations.md lists the filters, tests, methods and globals.
// Anything else is a TemplateError at parse time (unknown statements, filters,
// tests) or at render time (an unknown method), never silently ignored.
// Every parse and render is bounded (nesting, steps, time, bytes of values,
// output; RenderLimits), and a render can be cancelled from another thread: a
// template from a downloaded file or an operator, fed with client data, can
// neither wedge nor exhaust the process. Torch-free.

#include "model/text/jinja/value.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

namespace strata::model::jinja {

/// A template that cannot be parsed or rendered. `line` is 1-based (0 when
/// unknown). The kind says whose fault it is: the template's own
/// raise_exception(message), a construct the engine does not implement, or
/// anything else (a syntax or type error).
class TemplateError : public std::runtime_error {
public:
  enum class Kind : uint8_t { error, unsupported, raised, limit };
  /// Which bound a `limit` error hit.
  enum class Limit : uint8_t { none, nesting, steps, time, memory, recursion, output, cancelled };
  TemplateError(const std::string& message, int line, Kind kind = Kind::error);
  /// A bound was reached: `what` names it in the message.
  TemplateError(const std::string& message, int line, Limit limit);
  int line() const { return line_; }
  bool raised() const { return kind_ == Kind::raised; }
  bool unsupported() const { return kind_ == Kind::unsupported; }
  /// Limit::none unless a bound of RenderLimits (or the parser's nesting) was reached.
  Limit limit() const { return limit_; }
  /// The message without the line.
  const std::string& message() const { return message_; }

private:
  int line_;
  Kind kind_;
  Limit limit_ = Limit::none;
  std::string message_;
};

/// The name of a bound in messages and metrics: "nesting", "steps", "time", ...
const char* to_string(TemplateError::Limit l);

/// Deepest nesting the parser accepts: expressions inside expressions
/// (parentheses, operators, calls) and blocks inside blocks each.
constexpr int max_parse_nesting = 128;

/// Bounds on one render. The defaults are far above what any real chat template
/// needs (the 13 shipped templates in tests/data use under 20,000 steps, 100 KB
/// of values and a nesting of 3 on a 4-turn chat).
struct RenderLimits {
  /// Statements executed, expressions evaluated and loop iterations, together.
  uint64_t max_steps = 20'000'000;
  /// Bytes of the strings and list / dict slots the render creates (an upper
  /// bound on what it holds at any time, since values are immutable and shared).
  std::size_t max_bytes = std::size_t{256} << 20;
  /// Characters of the rendered text.
  std::size_t max_output = std::size_t{64} << 20;
  /// Macro calls inside macro calls; lists and dicts inside each other.
  int max_depth = 64;
  /// The render stops when this passes (steady clock; max() = never).
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  /// The render stops when this becomes true (its client left); may be null.
  const std::atomic<bool>* cancel = nullptr;
};

struct Node;

class Template {
public:
  /// Throws TemplateError naming the line and what is wrong.
  static Template parse(std::string_view text);
  /// Renders with `globals` as the top-level variables (messages, bos_token,
  /// add_generation_prompt, ...); raise_exception, namespace, range, dict and
  /// strftime_now are built in. Throws TemplateError (Kind::limit when a bound
  /// of `limits` is reached, naming it).
  std::string render(const Object& globals, const RenderLimits& limits = {}) const;

private:
  std::shared_ptr<const Node> root_;
};

} // namespace strata::model::jinja
