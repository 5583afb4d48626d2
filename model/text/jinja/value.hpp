#pragma once
// The values a chat template computes with: Python's (None, bool, int, float,
// str, list, dict) plus Jinja's Undefined, namespaces and callables. Strings,
// lists and dicts are shared by reference, as in Python (strings are immutable;
// lists and dicts are read-only in the sandbox, namespaces are the one thing a
// template changes). While a render runs on this thread, every string, list and
// dict it creates is counted against its byte budget, and lists and dicts
// nested deeper than its limit are refused (detail::RenderBudget). Torch-free.

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace strata::model::jinja {

class Value;
using Array = std::vector<Value>;

/// A dict in insertion order (Python 3.7+ dicts, JSON objects). Keys are strings
/// or integers, stored as strings (dict_key()). `items` may be appended to
/// directly (keys unique); lookups of a dict with many keys go through an index
/// kept up to date with the appends.
struct Object {
  std::vector<std::pair<std::string, Value>> items;
  bool is_namespace = false; ///< namespace(): the one kind `set ns.x = ...` may change
  int depth = 1;             ///< 1 + the deepest list or dict among its values (kept by set())
  const Value* find(const std::string& key) const;
  void set(const std::string& key, Value v);

private:
  Value* slot(const std::string& key) const;
  mutable std::unordered_map<std::string, std::size_t> index_;
  mutable std::size_t indexed_ = 0; // items[0, indexed_) are in index_
};

/// Dict keys as Object stores them: a string as it is, an integer as NUL 'i' and
/// its digits ({0: 0, 512: 128} is a valid dict in Python's Jinja), a string that
/// starts with NUL escaped as NUL 's' and the string: no two keys collide.
std::string dict_key(const std::string& s);
std::string dict_key(int64_t i);
/// The key a stored key stands for: a string or an integer Value.
Value key_value(const std::string& stored);
/// How a stored key prints in JSON (integers as their digits, as json.dumps does).
std::string key_text(const std::string& stored);

/// Positional and keyword arguments of a call.
struct Args {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> named;
  /// Positional i, else the keyword `name`, else null.
  const Value* get(std::size_t i, const char* name) const;
};

using Function = std::function<Value(const Args&)>;

class Value {
public:
  enum class Kind : uint8_t { undefined, none, boolean, integer, real, string, array, object, callable };

  Value() = default; ///< undefined
  static Value none();
  Value(bool b);
  Value(int64_t i);
  Value(int i) : Value(static_cast<int64_t>(i)) {}
  Value(double d);
  Value(std::string s);
  Value(const char* s) : Value(std::string(s)) {}
  Value(Array a);
  Value(Object o);
  static Value function(std::string name, Function f);
  /// From JSON, nlohmann::json or ordered_json (objects keep the key order `j` has).
  template <class Json>
  static Value from_json(const Json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::undefined; }
  bool is_none() const { return kind_ == Kind::none; }
  bool is_string() const { return kind_ == Kind::string; }
  bool is_number() const { return kind_ == Kind::integer || kind_ == Kind::real; }
  bool is_array() const { return kind_ == Kind::array; }
  bool is_object() const { return kind_ == Kind::object; }
  bool is_callable() const { return kind_ == Kind::callable; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return i_; }
  double as_double() const { return kind_ == Kind::integer ? static_cast<double>(i_) : d_; }
  /// The string (a callable's name; "" for other kinds).
  const std::string& as_string() const;
  /// 0 for scalars, 1 + the deepest element for lists and dicts.
  int depth() const;
  Array& array() const { return *a_; }
  Object& object() const { return *o_; }
  const std::shared_ptr<Object>& object_ptr() const { return o_; }
  const Function& fn() const { return *f_; }

  /// Python truthiness (undefined is false).
  bool truthy() const;
  /// What `{{ v }}` prints: str(v) in Python (None, True, [1, 'a'], ...); undefined is "".
  std::string str() const;
  /// repr(v) in Python ('a' quoted).
  std::string repr() const;
  /// The type's name in messages: "str", "int", "list", "undefined", ...
  const char* type_name() const;
  /// json.dumps(v, ensure_ascii=False, indent=..., sort_keys=...) as Hugging
  /// Face's `tojson` filter writes it. indent < 0: one line with ", " and ": ".
  std::string to_json(int indent, bool sort_keys) const;

  /// Python ==.
  friend bool operator==(const Value& a, const Value& b);

private:
  Kind kind_ = Kind::undefined;
  bool b_ = false;
  int depth_ = 0; // lists
  int64_t i_ = 0;
  double d_ = 0;
  std::shared_ptr<const std::string> s_;
  std::shared_ptr<Array> a_;
  std::shared_ptr<Object> o_;
  std::shared_ptr<Function> f_;
};

namespace detail {

/// The budget of the render running on this thread (installed by
/// Template::render; none outside a render, where nothing is counted).
struct RenderBudget {
  std::size_t bytes_left = 0;
  std::size_t max_bytes = 0;
  int max_depth = 0;
  uint64_t steps_left = 0;
  uint64_t max_steps = 0;
  std::chrono::steady_clock::time_point deadline;
  const std::atomic<bool>* cancel = nullptr;
  uint32_t until_check = 1; // steps until the clock and the cancel flag are read again
};
RenderBudget*& current_budget();
/// Counts `bytes` about to be created; throws TemplateError (memory) past the budget.
void charge(std::size_t bytes);
/// Counts `n` steps of work (a statement, an expression, a loop iteration, a
/// comparison inside a filter); throws TemplateError (steps, time or cancelled).
void spend(uint64_t n = 1);
/// Throws TemplateError (nesting) when a list or dict of `depth` is past the limit.
void check_depth(int depth);

} // namespace detail

template <class Json>
Value Value::from_json(const Json& j) {
  using t = typename Json::value_t;
  switch (j.type()) {
  case t::null:
    return none();
  case t::boolean:
    return Value(j.template get<bool>());
  case t::number_integer:
    return Value(j.template get<int64_t>());
  case t::number_unsigned: {
    const auto u = j.template get<uint64_t>();
    return u > static_cast<uint64_t>(INT64_MAX) ? Value(static_cast<double>(u)) : Value(static_cast<int64_t>(u));
  }
  case t::number_float:
    return Value(j.template get<double>());
  case t::string:
    return Value(j.template get<std::string>());
  case t::array: {
    Array a;
    a.reserve(j.size());
    for (auto& e : j)
      a.push_back(from_json(e));
    return Value(std::move(a));
  }
  case t::object: {
    Object o;
    for (auto& [k, e] : j.items())
      o.items.emplace_back(dict_key(k), from_json(e));
    return Value(std::move(o));
  }
  default:
    return Value();
  }
}

} // namespace strata::model::jinja
