#pragma once
// The values a chat template computes with: Python's (None, bool, int, float,
// str, list, dict) plus Jinja's Undefined, namespaces and callables. Lists and
// dicts are shared by reference, as in Python. Torch-free.

#include <nlohmann/json.hpp>

#include <climits>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace strata::model::jinja {

class Value;
using Array = std::vector<Value>;

/// A dict in insertion order (Python 3.7+ dicts, JSON objects). String keys only.
struct Object {
  std::vector<std::pair<std::string, Value>> items;
  bool is_namespace = false; ///< namespace(): the one kind `set ns.x = ...` may change
  const Value* find(const std::string& key) const;
  void set(const std::string& key, Value v);
};

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
  const std::string& as_string() const { return s_; }
  Array& array() const { return *a_; }
  Object& object() const { return *o_; }
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
  int64_t i_ = 0;
  double d_ = 0;
  std::string s_;
  std::shared_ptr<Array> a_;
  std::shared_ptr<Object> o_;
  std::shared_ptr<Function> f_;
};

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
      o.items.emplace_back(k, from_json(e));
    return Value(std::move(o));
  }
  default:
    return Value();
  }
}

} // namespace strata::model::jinja
