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
// tests) or at render time (an unknown method), never silently ignored. Torch-free.

#include "model/text/jinja/value.hpp"

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
  enum class Kind : uint8_t { error, unsupported, raised };
  TemplateError(const std::string& message, int line, Kind kind = Kind::error);
  int line() const { return line_; }
  bool raised() const { return kind_ == Kind::raised; }
  bool unsupported() const { return kind_ == Kind::unsupported; }
  /// The message without the line.
  const std::string& message() const { return message_; }

private:
  int line_;
  Kind kind_;
  std::string message_;
};

struct Node;

class Template {
public:
  /// Throws TemplateError naming the line and what is wrong.
  static Template parse(std::string_view text);
  /// Renders with `globals` as the top-level variables (messages, bos_token,
  /// add_generation_prompt, ...); raise_exception, namespace, range, dict and
  /// strftime_now are built in. Throws TemplateError.
  std::string render(const Object& globals) const;

private:
  std::shared_ptr<const Node> root_;
};

} // namespace strata::model::jinja
