#pragma once
// The syntax tree the parser (jinja_parse.cpp) builds and the interpreter
// (jinja_eval.cpp) walks. Internal to the template engine.

#include "model/text/jinja/jinja.hpp"
#include "model/text/jinja/value.hpp"

#include <memory>
#include <string>
#include <vector>

namespace strata::model::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind : uint8_t {
    literal,   ///< value
    name,      ///< name
    list,      ///< args
    tuple,     ///< args
    dict,      ///< args: key, value, key, value, ...
    attr,      ///< args[0].name
    index,     ///< args[0][args[1]]
    slice,     ///< args[0][args[1]:args[2]:args[3]] (null parts absent)
    call,      ///< args[0](args[1..], kwargs)
    filter,    ///< args[0] | name(args[1..], kwargs)
    test,      ///< args[0] is [not] name(args[1..]); negate
    unary,     ///< op args[0]: "not", "-", "+"
    binary,    ///< args[0] op args[1]
    cond,      ///< args[1] if args[0] else args[2] (args[2] may be null)
  };
  Kind kind;
  int line = 0;
  int depth = 1; ///< 1 + the deepest operand: the interpreter recurses this deep
  Value value;
  std::string name; ///< name, attribute, filter, test or operator
  bool negate = false;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;

  /// Deepest tree the parser builds (a chain like a ~ b ~ c ~ ... counts one per operator).
  static constexpr int max_depth = 4 * max_parse_nesting;
  /// Appends an operand (may be null: an absent part); throws TemplateError
  /// (nesting) when the tree would get deeper than max_depth.
  void add(ExprPtr x) {
    grow(x.get());
    args.push_back(std::move(x));
  }
  void add_kw(std::string key, ExprPtr x) {
    grow(x.get());
    kwargs.emplace_back(std::move(key), std::move(x));
  }

private:
  void grow(const Expr* x) {
    if (x && x->depth + 1 > depth) {
      depth = x->depth + 1;
      if (depth > max_depth)
        throw TemplateError("an expression nested deeper than " + std::to_string(max_depth) + " operators", line,
                            TemplateError::Limit::nesting);
    }
  }
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct Node {
  enum class Kind : uint8_t {
    body,      ///< children
    text,      ///< text
    output,    ///< {{ expr }}
    if_,       ///< conds[i] -> bodies[i]; bodies.back() is else when bodies.size() > conds.size()
    for_,      ///< targets in expr [if cond]: bodies[0], else bodies[1]
    set,       ///< targets (or ns.attr in attr) = expr, or = rendered bodies[0]
    macro,     ///< name(params = defaults): bodies[0]
    break_,
    continue_,
    filter_block, ///< bodies[0] | expr (a filter expression whose input is replaced)
  };
  Kind kind;
  int line = 0;
  std::string text;
  std::vector<std::string> targets;
  std::string attr;
  ExprPtr expr;
  ExprPtr cond;
  std::vector<ExprPtr> conds;
  std::vector<Body> bodies;
  std::vector<std::pair<std::string, ExprPtr>> params;
};

} // namespace strata::model::jinja

namespace strata::model::jinja {
/// Whether the interpreter implements a filter / test of this name (the parser
/// refuses others at parse time).
bool known_filter(const std::string& name);
bool known_test(const std::string& name);
} // namespace strata::model::jinja
