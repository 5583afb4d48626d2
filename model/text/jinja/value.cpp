#include "model/text/jinja/value.hpp"
#include "model/text/jinja/jinja.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace strata::model::jinja {

namespace detail {

RenderBudget*& current_budget() {
  thread_local RenderBudget* budget = nullptr;
  return budget;
}

void charge(std::size_t bytes) {
  RenderBudget* b = current_budget();
  if (!b)
    return;
  if (bytes > b->bytes_left) {
    b->bytes_left = 0;
    throw TemplateError("the template's values exceed " + std::to_string(b->max_bytes >> 20) +
                          " MiB (strings, lists and dicts it created)",
                        0, TemplateError::Limit::memory);
  }
  b->bytes_left -= bytes;
}

void spend(uint64_t n) {
  RenderBudget* b = current_budget();
  if (!b)
    return;
  if (n > b->steps_left) {
    b->steps_left = 0;
    throw TemplateError("the template ran more than " + std::to_string(b->max_steps) + " steps", 0,
                        TemplateError::Limit::steps);
  }
  b->steps_left -= n;
  if (n < b->until_check) {
    b->until_check -= static_cast<uint32_t>(n);
    return;
  }
  b->until_check = 1024;
  if (b->cancel && b->cancel->load(std::memory_order_relaxed))
    throw TemplateError("the render was cancelled (its request ended)", 0, TemplateError::Limit::cancelled);
  if (std::chrono::steady_clock::now() > b->deadline)
    throw TemplateError("the render ran out of time (the request's timeout)", 0, TemplateError::Limit::time);
}

void check_depth(int depth) {
  RenderBudget* b = current_budget();
  if (b && depth > b->max_depth)
    throw TemplateError("lists and dicts nested deeper than " + std::to_string(b->max_depth), 0,
                        TemplateError::Limit::nesting);
}

} // namespace detail

namespace {

// Recursion over values (printing, JSON, equality) is bounded: a namespace can be
// stored inside itself, and nothing else may recurse without end.
constexpr int max_walk_depth = 256;

class WalkGuard {
public:
  WalkGuard() {
    if (++depth() > max_walk_depth) {
      --depth();
      throw TemplateError("a value nested deeper than " + std::to_string(max_walk_depth) +
                            " levels (or containing itself) cannot be printed or compared",
                          0, TemplateError::Limit::nesting);
    }
  }
  ~WalkGuard() { --depth(); }
  WalkGuard(const WalkGuard&) = delete;
  WalkGuard& operator=(const WalkGuard&) = delete;

private:
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
};

// Dicts with more keys than this are looked up through their index.
constexpr std::size_t index_from = 8;

} // namespace

Value* Object::slot(const std::string& key) const {
  auto& mut = const_cast<Object&>(*this);
  if (items.size() <= index_from) {
    for (auto& [k, v] : mut.items)
      if (k == key)
        return &v;
    return nullptr;
  }
  for (; indexed_ < items.size(); ++indexed_) // items appended since the last lookup
    index_.emplace(items[indexed_].first, indexed_);
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &mut.items[it->second].second;
}

const Value* Object::find(const std::string& key) const { return slot(key); }

std::string dict_key(const std::string& s) { return !s.empty() && s[0] == '\0' ? std::string("\0s", 2) + s : s; }
std::string dict_key(int64_t i) { return std::string("\0i", 2) + std::to_string(i); }

Value key_value(const std::string& stored) {
  if (stored.size() < 2 || stored[0] != '\0')
    return Value(stored);
  if (stored[1] == 'i')
    return Value(static_cast<int64_t>(std::stoll(stored.substr(2))));
  return Value(stored.substr(2));
}

std::string key_text(const std::string& stored) {
  const Value k = key_value(stored);
  return k.is_string() ? k.as_string() : std::to_string(k.as_int());
}

void Object::set(const std::string& key, Value v) {
  const int d = v.depth() + 1;
  if (d > depth) {
    detail::check_depth(d);
    depth = d;
  }
  if (Value* old = slot(key)) {
    *old = std::move(v);
    return;
  }
  detail::charge(sizeof(std::pair<std::string, Value>) + key.size());
  items.emplace_back(key, std::move(v));
}

const Value* Args::get(std::size_t i, const char* name) const {
  if (i < positional.size())
    return &positional[i];
  for (auto& [k, v] : named)
    if (k == name)
      return &v;
  return nullptr;
}

Value Value::none() {
  Value v;
  v.kind_ = Kind::none;
  return v;
}
Value::Value(bool b) : kind_(Kind::boolean), b_(b) {}
Value::Value(int64_t i) : kind_(Kind::integer), i_(i) {}
Value::Value(double d) : kind_(Kind::real), d_(d) {}
Value::Value(std::string s) : kind_(Kind::string) {
  detail::charge(s.size() + sizeof(std::string));
  s_ = std::make_shared<const std::string>(std::move(s));
}
Value::Value(Array a) : kind_(Kind::array) {
  int d = 0;
  for (auto& x : a)
    d = std::max(d, x.depth());
  depth_ = d + 1;
  detail::check_depth(depth_);
  detail::charge(a.size() * sizeof(Value) + sizeof(Array));
  a_ = std::make_shared<Array>(std::move(a));
}
Value::Value(Object o) : kind_(Kind::object) {
  int d = 0;
  for (auto& [k, x] : o.items)
    d = std::max(d, x.depth());
  o.depth = std::max(o.depth, d + 1);
  detail::check_depth(o.depth);
  detail::charge(o.items.size() * sizeof(std::pair<std::string, Value>) + sizeof(Object));
  o_ = std::make_shared<Object>(std::move(o));
}

const std::string& Value::as_string() const {
  static const std::string empty;
  return s_ ? *s_ : empty;
}

int Value::depth() const {
  switch (kind_) {
  case Kind::array: return depth_;
  case Kind::object: return o_->depth;
  default: return 0;
  }
}

Value Value::function(std::string name, Function f) {
  Value v;
  v.kind_ = Kind::callable;
  v.s_ = std::make_shared<const std::string>(std::move(name));
  v.f_ = std::make_shared<Function>(std::move(f));
  return v;
}

bool Value::truthy() const {
  switch (kind_) {
  case Kind::undefined:
  case Kind::none:
    return false;
  case Kind::boolean:
    return b_;
  case Kind::integer:
    return i_ != 0;
  case Kind::real:
    return d_ != 0;
  case Kind::string:
    return !as_string().empty();
  case Kind::array:
    return !a_->empty();
  case Kind::object:
    return o_->is_namespace || !o_->items.empty();
  case Kind::callable:
    return true;
  }
  return false;
}

namespace {

// Python's float repr: the shortest digits that round-trip, fixed notation for
// exponents in [-4, 16), else d.ddde+XX; always a '.' or an exponent.
std::string float_repr(double d) {
  if (std::isnan(d))
    return "nan";
  if (std::isinf(d))
    return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  const auto e = sci.find('e');
  std::string mant = sci.substr(0, e);
  const int exp = std::stoi(sci.substr(e + 1));
  std::string sign;
  if (mant[0] == '-') {
    sign = "-";
    mant.erase(0, 1);
  }
  std::string digits;
  for (char c : mant)
    if (c != '.')
      digits += c;
  if (exp >= -4 && exp < 16) {
    std::string out;
    if (exp < 0) {
      out = "0." + std::string(static_cast<std::size_t>(-exp - 1), '0') + digits;
    } else if (static_cast<int>(digits.size()) <= exp + 1) {
      out = digits + std::string(static_cast<std::size_t>(exp + 1) - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, static_cast<std::size_t>(exp + 1)) + "." + digits.substr(static_cast<std::size_t>(exp + 1));
    }
    return sign + out;
  }
  std::string out = digits.substr(0, 1);
  if (digits.size() > 1)
    out += "." + digits.substr(1);
  char eb[16];
  std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
  return sign + out + eb;
}

std::string py_quote(const std::string& s) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == '\\')
      out += "\\\\";
    else if (c == static_cast<unsigned char>(q))
      out += std::string("\\") + q;
    else if (c == '\n')
      out += "\\n";
    else if (c == '\r')
      out += "\\r";
    else if (c == '\t')
      out += "\\t";
    else if (c < 0x20 || c == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      out += b;
    } else
      out += static_cast<char>(c);
  }
  return out + q;
}

void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
    case '"': out += "\\\""; break;
    case '\\': out += "\\\\"; break;
    case '\n': out += "\\n"; break;
    case '\r': out += "\\r"; break;
    case '\t': out += "\\t"; break;
    case '\b': out += "\\b"; break;
    case '\f': out += "\\f"; break;
    default:
      if (c < 0x20) {
        char b[8];
        std::snprintf(b, sizeof b, "\\u%04x", c);
        out += b;
      } else {
        out += static_cast<char>(c);
      }
    }
  }
  out += '"';
}

void json_write(std::string& out, const Value& v, int indent, bool sort_keys, int depth) {
  const WalkGuard guard;
  const auto newline = [&](int d) {
    out += '\n';
    out.append(static_cast<std::size_t>(indent * d), ' ');
  };
  // [a, b] or {k: v}: `n` items that `item(i)` writes, with json.dumps's
  // separators (", " on one line; "," and a newline with an indent).
  const auto list = [&](char open, char close, std::size_t n, auto&& item) {
    out += open;
    if (n > 0) {
      for (std::size_t i = 0; i < n; ++i) {
        if (i)
          out += indent >= 0 ? "," : ", ";
        if (indent >= 0)
          newline(depth + 1);
        item(i);
      }
      if (indent >= 0)
        newline(depth);
    }
    out += close;
  };
  switch (v.kind()) {
  case Value::Kind::undefined:
  case Value::Kind::none:
  case Value::Kind::callable:
    out += "null";
    return;
  case Value::Kind::boolean:
    out += v.as_bool() ? "true" : "false";
    return;
  case Value::Kind::integer:
    out += std::to_string(v.as_int());
    return;
  case Value::Kind::real: {
    const double d = v.as_double();
    out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : float_repr(d);
    return;
  }
  case Value::Kind::string:
    json_string(out, v.as_string());
    return;
  case Value::Kind::array: {
    const auto& a = v.array();
    list('[', ']', a.size(), [&](std::size_t i) { json_write(out, a[i], indent, sort_keys, depth + 1); });
    return;
  }
  case Value::Kind::object: {
    std::vector<const std::pair<std::string, Value>*> items;
    for (auto& kv : v.object().items)
      items.push_back(&kv);
    if (sort_keys)
      std::sort(items.begin(), items.end(), [](auto* a, auto* b) { return key_text(a->first) < key_text(b->first); });
    list('{', '}', items.size(), [&](std::size_t i) {
      json_string(out, key_text(items[i]->first));
      out += ": ";
      json_write(out, items[i]->second, indent, sort_keys, depth + 1);
    });
    return;
  }
  }
}

} // namespace

std::string Value::str() const {
  switch (kind_) {
  case Kind::undefined:
    return "";
  case Kind::string:
    return as_string();
  default:
    return repr();
  }
}

std::string Value::repr() const {
  const WalkGuard guard;
  switch (kind_) {
  case Kind::undefined:
    return "";
  case Kind::none:
    return "None";
  case Kind::boolean:
    return b_ ? "True" : "False";
  case Kind::integer:
    return std::to_string(i_);
  case Kind::real:
    return float_repr(d_);
  case Kind::string:
    return py_quote(as_string());
  case Kind::array: {
    std::string out = "[";
    for (std::size_t i = 0; i < a_->size(); ++i)
      out += (i ? ", " : "") + (*a_)[i].repr();
    return out + "]";
  }
  case Kind::object: {
    if (o_->is_namespace)
      return "<Namespace>";
    std::string out = "{";
    for (std::size_t i = 0; i < o_->items.size(); ++i)
      out += (i ? ", " : "") + key_value(o_->items[i].first).repr() + ": " + o_->items[i].second.repr();
    return out + "}";
  }
  case Kind::callable:
    return "<function " + as_string() + ">";
  }
  return "";
}

const char* Value::type_name() const {
  switch (kind_) {
  case Kind::undefined: return "undefined";
  case Kind::none: return "NoneType";
  case Kind::boolean: return "bool";
  case Kind::integer: return "int";
  case Kind::real: return "float";
  case Kind::string: return "str";
  case Kind::array: return "list";
  case Kind::object: return o_->is_namespace ? "namespace" : "dict";
  case Kind::callable: return "function";
  }
  return "?";
}

std::string Value::to_json(int indent, bool sort_keys) const {
  std::string out;
  json_write(out, *this, indent, sort_keys, 0);
  return out;
}

bool operator==(const Value& a, const Value& b) {
  const WalkGuard guard;
  using K = Value::Kind;
  const auto numeric = [](const Value& v) {
    return v.kind() == K::integer || v.kind() == K::real || v.kind() == K::boolean;
  };
  if (numeric(a) && numeric(b)) {
    const auto num = [](const Value& v) {
      return v.kind() == K::boolean ? (v.as_bool() ? 1.0 : 0.0) : v.as_double();
    };
    if (a.kind() == K::integer && b.kind() == K::integer)
      return a.as_int() == b.as_int();
    return num(a) == num(b);
  }
  if (a.kind() != b.kind())
    return false;
  switch (a.kind()) {
  case K::undefined:
  case K::none:
    return true;
  case K::string:
    return a.as_string() == b.as_string();
  case K::array: {
    const auto &x = a.array(), &y = b.array();
    if (x.size() != y.size())
      return false;
    for (std::size_t i = 0; i < x.size(); ++i)
      if (!(x[i] == y[i]))
        return false;
    return true;
  }
  case K::object: {
    const auto &x = a.object(), &y = b.object();
    if (&x == &y)
      return true;
    if (x.items.size() != y.items.size())
      return false;
    for (auto& [k, v] : x.items) {
      const Value* w = y.find(k);
      if (!w || !(v == *w))
        return false;
    }
    return true;
  }
  case K::callable:
    return &a.fn() == &b.fn();
  default:
    return false;
  }
}

} // namespace strata::model::jinja
