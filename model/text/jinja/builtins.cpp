#include "model/text/jinja/builtins.hpp"

#include "model/text/jinja/jinja.hpp"

#include <string.h> // memmem

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <set>

namespace strata::model::jinja {

namespace {

// s.find(sub, pos) in linear time whatever the strings hold (glibc's memmem is
// the two-way algorithm; std::string::find can take |s| x |sub| steps).
std::size_t find_sub(const std::string& s, const std::string& sub, std::size_t pos = 0) {
  if (pos > s.size())
    return std::string::npos;
  if (sub.empty())
    return pos;
  const void* at = ::memmem(s.data() + pos, s.size() - pos, sub.data(), sub.size());
  return at ? static_cast<std::size_t>(static_cast<const char*>(at) - s.data()) : std::string::npos;
}

[[noreturn]] void fail(const std::string& what, int line) { throw TemplateError(what, line); }
[[noreturn]] void unsupported(const std::string& what, int line) {
  throw TemplateError(what, line, TemplateError::Kind::unsupported);
}

const std::set<std::string>& filters() {
  static const std::set<std::string> f = {
    "abs", "attr", "capitalize", "count", "d", "default", "dictsort", "e", "escape", "first", "float",
    "indent", "int", "items", "join", "last", "length", "list", "lower", "map", "max", "min", "reject",
    "rejectattr", "replace", "reverse", "round", "safe", "select", "selectattr", "sort", "string", "sum",
    "title", "tojson", "trim", "unique", "upper", "wordcount"};
  return f;
}

const std::set<std::string>& tests() {
  static const std::set<std::string> t = {
    "boolean", "callable", "defined", "divisibleby", "eq", "equalto", "escaped", "even", "false", "float",
    "ge", "gt", "in", "integer", "iterable", "le", "lower", "lt", "mapping", "ne", "none", "number", "odd",
    "sameas", "sequence", "string", "true", "undefined", "upper", "==", "!=", "<", "<=", ">", ">="};
  return t;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

std::string strip(const std::string& s, const Value* chars, bool left, bool right) {
  bool set[256] = {}; // the bytes to drop: one lookup each, whatever the length of `chars`
  if (chars && chars->is_string())
    for (unsigned char c : chars->as_string())
      set[c] = true;
  const bool given = chars && chars->is_string();
  const auto drop = [&](char c) { return given ? set[static_cast<unsigned char>(c)] : is_space(c); };
  std::size_t a = 0, b = s.size();
  if (left)
    while (a < b && drop(s[a]))
      ++a;
  if (right)
    while (b > a && drop(s[b - 1]))
      --b;
  return s.substr(a, b - a);
}

std::string upper(std::string s) {
  for (auto& c : s)
    c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}
std::string lower(std::string s) {
  for (auto& c : s)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
std::string title(std::string s) {
  bool prev_cased = false;
  for (auto& c : s) {
    const bool alpha = std::isalpha(static_cast<unsigned char>(c));
    c = static_cast<char>(prev_cased ? std::tolower(static_cast<unsigned char>(c)) : std::toupper(static_cast<unsigned char>(c)));
    prev_cased = alpha;
  }
  return s;
}
std::string capitalize(std::string s) {
  s = lower(std::move(s));
  if (!s.empty())
    s[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(s[0])));
  return s;
}

std::string replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  std::string out;
  std::size_t pos = 0;
  int64_t done = 0;
  if (from.empty()) { // Python inserts `to` between every character
    for (auto& ch : utf8_chars(s)) {
      if (count < 0 || done < count) {
        out += to;
        ++done;
      }
      out += ch;
    }
    if (count < 0 || done < count)
      out += to;
    return out;
  }
  for (;;) {
    const auto at = find_sub(s, from, pos);
    if (at == std::string::npos || (count >= 0 && done >= count))
      break;
    out.append(s, pos, at - pos);
    out += to;
    pos = at + from.size();
    ++done;
  }
  out.append(s, pos);
  return out;
}

int64_t length(const Value& v) {
  switch (v.kind()) {
  case Value::Kind::string:
    return static_cast<int64_t>(utf8_chars(v.as_string()).size());
  case Value::Kind::array:
    return static_cast<int64_t>(v.array().size());
  case Value::Kind::object:
    return static_cast<int64_t>(v.object().items.size());
  case Value::Kind::undefined:
    return 0;
  default:
    throw TemplateError(std::string("object of type ") + v.type_name() + " has no length", 0);
  }
}

Array as_list(const Value& v, int line) {
  switch (v.kind()) {
  case Value::Kind::array:
    return v.array();
  case Value::Kind::string: {
    Array a;
    for (auto& c : utf8_chars(v.as_string()))
      a.push_back(Value(c));
    return a;
  }
  case Value::Kind::object: {
    Array a;
    for (auto& [k, x] : v.object().items)
      a.push_back(key_value(k));
    return a;
  }
  case Value::Kind::undefined:
    return {};
  default:
    fail(std::string("a ") + v.type_name() + " is not iterable", line);
  }
}

int64_t to_int(const Value& v, const Value* arg, int line) {
  const auto v_or = [&](const Value* a) {
    if (!a)
      return int64_t{0};
    if (a->kind() != Value::Kind::integer)
      fail("int(): the default must be an integer", line);
    return a->as_int();
  };
  switch (v.kind()) {
  case Value::Kind::integer:
    return v.as_int();
  case Value::Kind::real:
    return static_cast<int64_t>(v.as_double());
  case Value::Kind::boolean:
    return v.as_bool() ? 1 : 0;
  case Value::Kind::string: {
    const std::string s = strip(v.as_string(), nullptr, true, true);
    int64_t out = 0;
    auto r = std::from_chars(s.data(), s.data() + s.size(), out);
    if (r.ec == std::errc() && r.ptr == s.data() + s.size())
      return out;
    return v_or(arg);
  }
  default:
    return v_or(arg);
  }
}

// Python-style ordering for sort/min/max: numbers, then strings (optionally
// case-insensitive).
int compare(const Value& a, const Value& b, bool case_sensitive, int line) {
  if (a.is_number() && b.is_number())
    return a.as_double() < b.as_double() ? -1 : a.as_double() > b.as_double() ? 1 : 0;
  if (a.is_string() && b.is_string()) {
    const std::string x = case_sensitive ? a.as_string() : lower(a.as_string());
    const std::string y = case_sensitive ? b.as_string() : lower(b.as_string());
    return x.compare(y) < 0 ? -1 : x.compare(y) > 0 ? 1 : 0;
  }
  if (a.kind() == Value::Kind::boolean && b.kind() == Value::Kind::boolean)
    return static_cast<int>(a.as_bool()) - static_cast<int>(b.as_bool());
  fail(std::string("cannot order ") + a.type_name() + " and " + b.type_name(), line);
}

Value attr_path(const Value& v, const std::string& path, int line) {
  Value cur = v;
  std::size_t pos = 0;
  while (pos <= path.size()) {
    const auto dot = path.find('.', pos);
    const std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    if (!part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }))
      cur = get_item(cur, Value(static_cast<int64_t>(std::stoll(part))), line, "the item");
    else
      cur = cur.is_undefined() ? Value() : get_attr(cur, part, line, "the item");
    if (dot == std::string::npos)
      break;
    pos = dot + 1;
  }
  return cur;
}

bool bool_arg(const Args& a, std::size_t i, const char* name, bool dflt) {
  const Value* v = a.get(i, name);
  return v ? v->truthy() : dflt;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
    case '&': out += "&amp;"; break;
    case '<': out += "&lt;"; break;
    case '>': out += "&gt;"; break;
    case '"': out += "&#34;"; break;
    case '\'': out += "&#39;"; break;
    default: out += c;
    }
  }
  return out;
}

// select / reject / selectattr / rejectattr: the test named by args[first].
Array select(const Value& in, const Args& a, bool keep, bool by_attr, int line) {
  Array out;
  std::size_t next = 0;
  std::string attr;
  if (by_attr) {
    const Value* at = a.get(next++, "attribute");
    if (!at || !at->is_string())
      fail("selectattr/rejectattr need an attribute name", line);
    attr = at->as_string();
  }
  const Value* test = next < a.positional.size() ? &a.positional[next] : nullptr;
  Args rest;
  for (std::size_t k = next + 1; k < a.positional.size(); ++k)
    rest.positional.push_back(a.positional[k]);
  if (test && !test->is_string())
    fail("the test must be named by a string", line);
  if (test && !tests().count(test->as_string()))
    unsupported("unsupported test '" + test->as_string() + "'", line);
  for (auto& item : as_list(in, line)) {
    const Value v = by_attr ? attr_path(item, attr, line) : item;
    const bool pass = test ? apply_test(test->as_string(), v, rest, line) : v.truthy();
    if (pass == keep)
      out.push_back(item);
  }
  return out;
}

std::vector<std::string> split(const std::string& s, const Value* sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (!sep || sep->is_none()) { // runs of whitespace, ends ignored
    std::size_t i = 0;
    while (i < s.size()) {
      while (i < s.size() && is_space(s[i]))
        ++i;
      if (i >= s.size())
        break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
        std::string rest = s.substr(i);
        out.push_back(strip(rest, nullptr, false, true));
        return out;
      }
      std::size_t j = i;
      while (j < s.size() && !is_space(s[j]))
        ++j;
      out.push_back(s.substr(i, j - i));
      i = j;
    }
    return out;
  }
  const std::string& d = sep->as_string();
  if (d.empty())
    throw TemplateError("split(): empty separator", 0);
  std::size_t pos = 0;
  for (;;) {
    const auto at = find_sub(s, d, pos);
    if (at == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit))
      break;
    out.push_back(s.substr(pos, at - pos));
    pos = at + d.size();
  }
  out.push_back(s.substr(pos));
  return out;
}

} // namespace

bool known_filter(const std::string& name) { return filters().count(name) > 0; }
bool known_test(const std::string& name) { return tests().count(name) > 0; }

std::vector<std::string> utf8_chars(const std::string& s) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    std::size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    n = std::min(n, s.size() - i);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

Value get_attr(const Value& obj, const std::string& name, int line, const std::string& what) {
  switch (obj.kind()) {
  case Value::Kind::object:
    if (const Value* v = obj.object().find(name))
      return *v;
    return Value();
  case Value::Kind::undefined:
    fail(what + " is undefined (reading ." + name + ")", line);
  default:
    return Value();
  }
}

Value get_item(const Value& obj, const Value& key, int line, const std::string& what) {
  switch (obj.kind()) {
  case Value::Kind::object:
    if (key.is_string() || key.kind() == Value::Kind::integer)
      if (const Value* v = obj.object().find(key.is_string() ? dict_key(key.as_string()) : dict_key(key.as_int())))
        return *v;
    return Value();
  case Value::Kind::array:
  case Value::Kind::string: {
    if (key.kind() != Value::Kind::integer)
      return Value();
    if (obj.is_array()) {
      const auto n = static_cast<int64_t>(obj.array().size());
      int64_t i = key.as_int() < 0 ? key.as_int() + n : key.as_int();
      return i >= 0 && i < n ? obj.array()[static_cast<std::size_t>(i)] : Value();
    }
    const auto chars = utf8_chars(obj.as_string());
    const auto n = static_cast<int64_t>(chars.size());
    int64_t i = key.as_int() < 0 ? key.as_int() + n : key.as_int();
    return i >= 0 && i < n ? Value(chars[static_cast<std::size_t>(i)]) : Value();
  }
  case Value::Kind::undefined:
    fail(what + " is undefined (reading [" + key.repr() + "])", line);
  default:
    return Value();
  }
}

Value slice(const Value& obj, std::optional<int64_t> a, std::optional<int64_t> b, std::optional<int64_t> c, int line) {
  std::vector<std::string> chars;
  int64_t n = 0;
  if (obj.is_array())
    n = static_cast<int64_t>(obj.array().size());
  else if (obj.is_string()) {
    chars = utf8_chars(obj.as_string());
    n = static_cast<int64_t>(chars.size());
  } else if (obj.is_undefined()) {
    return Value();
  } else {
    fail(std::string("cannot slice a ") + obj.type_name(), line);
  }
  const int64_t step = c.value_or(1);
  if (step == 0)
    fail("slice step cannot be zero", line);
  // Python's slice.indices(n).
  const auto clamp = [&](std::optional<int64_t> v, int64_t dflt, int64_t lo, int64_t hi) {
    if (!v)
      return dflt;
    int64_t x = *v < 0 ? *v + n : *v;
    return std::clamp(x, lo, hi);
  };
  int64_t start, stop;
  if (step > 0) {
    start = clamp(a, 0, 0, n);
    stop = clamp(b, n, 0, n);
  } else {
    start = clamp(a, n - 1, -1, n - 1);
    stop = clamp(b, -1, -1, n - 1);
  }
  Array items;
  std::string s;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    if (obj.is_array())
      items.push_back(obj.array()[static_cast<std::size_t>(i)]);
    else
      s += chars[static_cast<std::size_t>(i)];
  }
  return obj.is_array() ? Value(std::move(items)) : Value(std::move(s));
}

bool contains(const Value& container, const Value& item, int line) {
  switch (container.kind()) {
  case Value::Kind::string:
    if (!item.is_string())
      fail(std::string("'in <string>' requires a string on the left, not ") + item.type_name(), line);
    return find_sub(container.as_string(), item.as_string()) != std::string::npos;
  case Value::Kind::array:
    return std::any_of(container.array().begin(), container.array().end(), [&](const Value& v) { return v == item; });
  case Value::Kind::object:
    return (item.is_string() && container.object().find(dict_key(item.as_string())) != nullptr) ||
           (item.kind() == Value::Kind::integer && container.object().find(dict_key(item.as_int())) != nullptr);
  case Value::Kind::undefined:
    return false;
  default:
    fail(std::string("argument of type ") + container.type_name() + " is not iterable", line);
  }
}

std::optional<Value> call_method(const Value& obj, const std::string& name, const Args& a, int line) {
  if (obj.is_string()) {
    const std::string& s = obj.as_string();
    const auto str_arg = [&](std::size_t i, const char* n) -> const std::string& {
      const Value* v = a.get(i, n);
      if (!v || !v->is_string())
        fail("str." + name + "() needs a string argument", line);
      return v->as_string();
    };
    if (name == "strip" || name == "lstrip" || name == "rstrip")
      return Value(strip(s, a.get(0, "chars"), name != "rstrip", name != "lstrip"));
    if (name == "upper")
      return Value(upper(s));
    if (name == "lower")
      return Value(lower(s));
    if (name == "title")
      return Value(title(s));
    if (name == "capitalize")
      return Value(capitalize(s));
    if (name == "startswith" || name == "endswith") {
      const Value* p = a.get(0, "prefix");
      if (!p)
        fail("str." + name + "() needs an argument", line);
      Array options = p->is_array() ? p->array() : Array{*p};
      for (auto& o : options) {
        if (!o.is_string())
          fail("str." + name + "() takes strings", line);
        const std::string& x = o.as_string();
        if (x.size() <= s.size() &&
            (name == "startswith" ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0))
          return Value(true);
      }
      return Value(false);
    }
    if (name == "split") {
      const Value* m = a.get(1, "maxsplit");
      Array out;
      for (auto& part : split(s, a.get(0, "sep"), m ? to_int(*m, nullptr, line) : -1))
        out.push_back(Value(part));
      return Value(std::move(out));
    }
    if (name == "splitlines") {
      Array out;
      std::size_t pos = 0;
      while (pos < s.size()) {
        const auto nl = s.find('\n', pos);
        std::string l = s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
        if (!l.empty() && l.back() == '\r')
          l.pop_back();
        out.push_back(Value(l));
        if (nl == std::string::npos)
          break;
        pos = nl + 1;
      }
      return Value(std::move(out));
    }
    if (name == "replace") {
      const Value* c = a.get(2, "count");
      return Value(replace(s, str_arg(0, "old"), str_arg(1, "new"), c ? to_int(*c, nullptr, line) : -1));
    }
    if (name == "join") {
      const Value* it = a.get(0, "iterable");
      if (!it)
        fail("str.join() needs an argument", line);
      std::string out;
      bool first = true;
      for (auto& v : as_list(*it, line)) {
        if (!v.is_string())
          fail(std::string("str.join() expects strings, found ") + v.type_name(), line);
        out += (first ? "" : s) + v.as_string();
        first = false;
      }
      return Value(std::move(out));
    }
    if (name == "find" || name == "count") {
      const std::string& sub = str_arg(0, "sub");
      if (name == "find") {
        const auto at = find_sub(s, sub);
        return Value(at == std::string::npos ? int64_t{-1} : static_cast<int64_t>(utf8_chars(s.substr(0, at)).size()));
      }
      if (sub.empty())
        return Value(length(obj) + 1);
      int64_t n = 0;
      for (std::size_t p = find_sub(s, sub); p != std::string::npos; p = find_sub(s, sub, p + sub.size()))
        ++n;
      return Value(n);
    }
    if (name == "isdigit" || name == "isspace" || name == "isalpha" || name == "isalnum") {
      if (s.empty())
        return Value(false);
      return Value(std::all_of(s.begin(), s.end(), [&](char ch) {
        const auto u = static_cast<unsigned char>(ch);
        return name == "isdigit" ? std::isdigit(u) != 0 : name == "isspace" ? is_space(ch)
             : name == "isalpha" ? std::isalpha(u) != 0 : std::isalnum(u) != 0;
      }));
    }
    return std::nullopt;
  }
  if (obj.is_object() && !obj.object().is_namespace) {
    const auto& o = obj.object();
    if (name == "items") {
      Array out;
      for (auto& [k, v] : o.items)
        out.push_back(Value(Array{key_value(k), v}));
      return Value(std::move(out));
    }
    if (name == "keys" || name == "values") {
      Array out;
      for (auto& [k, v] : o.items)
        out.push_back(name == "keys" ? key_value(k) : v);
      return Value(std::move(out));
    }
    if (name == "get") {
      const Value* k = a.get(0, "key");
      if (!k)
        fail("dict.get() needs a key", line);
      if (k->is_string() || k->kind() == Value::Kind::integer)
        if (const Value* v = o.find(k->is_string() ? dict_key(k->as_string()) : dict_key(k->as_int())))
          return *v;
      const Value* d = a.get(1, "default");
      return d ? *d : Value::none();
    }
    if (o.find(name))
      return std::nullopt; // a callable stored under that key
  }
  if (obj.is_undefined())
    fail("calling ." + name + "() on an undefined value", line);
  return std::nullopt;
}

Value apply_filter(const std::string& name, const Value& in, const Args& a, int line) {
  if (name == "trim")
    return in.is_string() ? Value(strip(in.as_string(), a.get(0, "chars"), true, true)) : Value(strip(in.str(), nullptr, true, true));
  if (name == "upper")
    return Value(upper(in.str()));
  if (name == "lower")
    return Value(lower(in.str()));
  if (name == "title")
    return Value(title(in.str()));
  if (name == "capitalize")
    return Value(capitalize(in.str()));
  if (name == "length" || name == "count") {
    try {
      return Value(length(in));
    } catch (const TemplateError& e) {
      fail(e.message(), line);
    }
  }
  if (name == "string")
    return Value(in.str());
  if (name == "safe")
    return in;
  if (name == "e" || name == "escape")
    return Value(html_escape(in.str()));
  if (name == "tojson") {
    const Value* ind = a.get(1, "indent");
    const Value* ascii = a.get(0, "ensure_ascii");
    if (ascii && ascii->truthy())
      unsupported("tojson(ensure_ascii=true) is not supported", line);
    if (a.get(2, "separators") && !a.get(2, "separators")->is_none())
      unsupported("tojson(separators=...) is not supported", line);
    int indent = -1;
    if (ind && !ind->is_none()) {
      if (ind->kind() != Value::Kind::integer || ind->as_int() < 0 || ind->as_int() > 64)
        fail("tojson(indent=...) takes an integer from 0 to 64", line);
      indent = static_cast<int>(ind->as_int());
    }
    return Value(in.to_json(indent, bool_arg(a, 3, "sort_keys", false)));
  }
  if (name == "first" || name == "last") {
    const Array l = as_list(in, line);
    if (l.empty())
      return Value();
    return name == "first" ? l.front() : l.back();
  }
  if (name == "join") {
    const Value* sep = a.get(0, "d");
    const Value* attr = a.get(1, "attribute");
    std::string out;
    bool first = true;
    for (auto& v : as_list(in, line)) {
      out += (first ? std::string() : sep ? sep->str() : std::string()) +
             (attr ? attr_path(v, attr->str(), line).str() : v.str());
      first = false;
    }
    return Value(std::move(out));
  }
  if (name == "default" || name == "d") {
    const Value* dflt = a.get(0, "default_value");
    const bool boolean = bool_arg(a, 1, "boolean", false);
    if (in.is_undefined() || (boolean && !in.truthy()))
      return dflt ? *dflt : Value(std::string());
    return in;
  }
  if (name == "list")
    return Value(as_list(in, line));
  if (name == "items") {
    if (in.is_undefined())
      return Value(Array{});
    if (!in.is_object())
      fail(std::string("items() needs a dict, not ") + in.type_name(), line);
    return *call_method(in, "items", {}, line);
  }
  if (name == "int")
    return Value(to_int(in, a.get(0, "default"), line));
  if (name == "float") {
    if (in.is_number())
      return Value(in.as_double());
    if (in.is_string()) {
      try {
        std::size_t used = 0;
        const std::string s = strip(in.as_string(), nullptr, true, true);
        const double d = std::stod(s, &used);
        if (used == s.size())
          return Value(d);
      } catch (const std::exception&) {
      }
    }
    const Value* d = a.get(0, "default");
    return d ? *d : Value(0.0);
  }
  if (name == "abs") {
    if (in.kind() == Value::Kind::integer)
      return Value(in.as_int() < 0 ? -in.as_int() : in.as_int());
    if (in.kind() == Value::Kind::real)
      return Value(std::fabs(in.as_double()));
    fail(std::string("abs() needs a number, not ") + in.type_name(), line);
  }
  if (name == "round") {
    if (!in.is_number())
      fail(std::string("round() needs a number, not ") + in.type_name(), line);
    const Value* p = a.get(0, "precision");
    const Value* m = a.get(1, "method");
    const double scale = std::pow(10.0, p ? static_cast<double>(to_int(*p, nullptr, line)) : 0.0);
    const std::string method = m ? m->str() : "common";
    const double x = in.as_double() * scale;
    const double r = method == "ceil" ? std::ceil(x) : method == "floor" ? std::floor(x) : std::round(x);
    return Value(r / scale);
  }
  if (name == "replace") {
    const Value* c = a.get(2, "count");
    const Value* from = a.get(0, "old");
    const Value* to = a.get(1, "new");
    if (!from || !to)
      fail("replace() needs the old and the new text", line);
    return Value(replace(in.str(), from->str(), to->str(), c && !c->is_none() ? to_int(*c, nullptr, line) : -1));
  }
  if (name == "reverse") {
    if (in.is_string()) {
      auto chars = utf8_chars(in.as_string());
      std::string out;
      for (auto it = chars.rbegin(); it != chars.rend(); ++it)
        out += *it;
      return Value(std::move(out));
    }
    Array l = as_list(in, line);
    std::reverse(l.begin(), l.end());
    return Value(std::move(l));
  }
  if (name == "sort" || name == "unique" || name == "min" || name == "max") {
    const bool unique = name == "unique";
    const bool reverse = name == "sort" && bool_arg(a, 0, "reverse", false);
    const bool cs = bool_arg(a, name == "sort" ? 1 : 0, "case_sensitive", false);
    const Value* attr = a.get(name == "sort" ? 2 : 1, "attribute");
    Array l = as_list(in, line);
    const auto key = [&](const Value& v) { return attr ? attr_path(v, attr->str(), line) : v; };
    if (unique) {
      Array out;
      for (auto& v : l)
        if (std::none_of(out.begin(), out.end(), [&](const Value& o) {
              detail::spend(); // n x n comparisons: counted as steps
              const Value x = key(o), y = key(v);
              return x.is_string() && y.is_string() && !cs ? lower(x.as_string()) == lower(y.as_string()) : x == y;
            }))
          out.push_back(v);
      return Value(std::move(out));
    }
    if (name == "min" || name == "max") {
      if (l.empty())
        return Value();
      Value best = l[0];
      for (auto& v : l) {
        const int c = compare(key(v), key(best), cs, line);
        if (name == "min" ? c < 0 : c > 0)
          best = v;
      }
      return best;
    }
    std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) {
      detail::spend();
      const int c = compare(key(x), key(y), cs, line);
      return reverse ? c > 0 : c < 0;
    });
    return Value(std::move(l));
  }
  if (name == "dictsort") {
    if (!in.is_object())
      fail(std::string("dictsort needs a dict, not ") + in.type_name(), line);
    const bool cs = bool_arg(a, 0, "case_sensitive", false);
    const Value* by = a.get(1, "by");
    const bool by_value = by && by->str() == "value";
    const bool reverse = bool_arg(a, 2, "reverse", false);
    Array items = call_method(in, "items", {}, line)->array();
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      const int c = compare(x.array()[by_value ? 1 : 0], y.array()[by_value ? 1 : 0], cs, line);
      return reverse ? c > 0 : c < 0;
    });
    return Value(std::move(items));
  }
  if (name == "map") {
    Array out;
    const Value* attr = nullptr;
    for (auto& [k, v] : a.named)
      if (k == "attribute")
        attr = &v;
    if (attr) {
      const Value* dflt = nullptr;
      for (auto& [k, v] : a.named)
        if (k == "default")
          dflt = &v;
      for (auto& v : as_list(in, line)) {
        Value x = attr_path(v, attr->str(), line);
        out.push_back(x.is_undefined() && dflt ? *dflt : x);
      }
      return Value(std::move(out));
    }
    if (a.positional.empty() || !a.positional[0].is_string())
      fail("map() needs attribute=NAME or a filter name", line);
    const std::string f = a.positional[0].as_string();
    if (!filters().count(f))
      unsupported("unsupported filter '" + f + "'", line);
    Args rest;
    rest.positional.assign(a.positional.begin() + 1, a.positional.end());
    rest.named = a.named;
    for (auto& v : as_list(in, line))
      out.push_back(apply_filter(f, v, rest, line));
    return Value(std::move(out));
  }
  if (name == "select" || name == "reject")
    return Value(select(in, a, name == "select", false, line));
  if (name == "selectattr" || name == "rejectattr")
    return Value(select(in, a, name == "selectattr", true, line));
  if (name == "attr") {
    const Value* n = a.get(0, "name");
    if (!n || !n->is_string())
      fail("attr() needs a name", line);
    return in.is_undefined() ? Value() : get_attr(in, n->as_string(), line, "the value");
  }
  if (name == "indent") {
    const Value* w = a.get(0, "width");
    const std::string pad = !w ? std::string(4, ' ') : w->is_string() ? w->as_string()
                                                     : std::string(static_cast<std::size_t>(std::clamp<int64_t>(to_int(*w, nullptr, line), 0, 256)), ' ');
    const bool first = bool_arg(a, 1, "first", false);
    const bool blank = bool_arg(a, 2, "blank", false);
    const std::string s = in.str();
    std::string out;
    std::size_t pos = 0;
    bool is_first = true;
    for (;;) {
      const auto nl = s.find('\n', pos);
      const std::string l = s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
      if ((is_first ? first : true) && (blank || !l.empty()))
        out += pad;
      out += l;
      if (nl == std::string::npos)
        break;
      out += '\n';
      pos = nl + 1;
      is_first = false;
    }
    return Value(std::move(out));
  }
  if (name == "wordcount")
    return Value(static_cast<int64_t>(split(in.str(), nullptr, -1).size()));
  if (name == "sum") {
    const Value* attr = a.get(0, "attribute");
    const Value* start = a.get(1, "start");
    bool real = start && start->kind() == Value::Kind::real;
    double d = start ? start->as_double() : 0;
    int64_t i = start && start->kind() == Value::Kind::integer ? start->as_int() : 0;
    for (auto& v : as_list(in, line)) {
      const Value x = attr ? attr_path(v, attr->str(), line) : v;
      if (!x.is_number())
        fail(std::string("sum() needs numbers, found ") + x.type_name(), line);
      if (x.kind() == Value::Kind::real)
        real = true;
      d += x.as_double();
      i += x.kind() == Value::Kind::integer ? x.as_int() : 0;
    }
    return real ? Value(d) : Value(i);
  }
  unsupported("unsupported filter '" + name + "'", line);
}

bool apply_test(const std::string& name, const Value& in, const Args& a, int line) {
  using K = Value::Kind;
  const auto arg = [&]() -> const Value& {
    if (a.positional.empty())
      fail("the test '" + name + "' needs an argument", line);
    return a.positional[0];
  };
  if (name == "defined")
    return !in.is_undefined();
  if (name == "undefined")
    return in.is_undefined();
  if (name == "none")
    return in.is_none();
  if (name == "boolean")
    return in.kind() == K::boolean;
  if (name == "true")
    return in.kind() == K::boolean && in.as_bool();
  if (name == "false")
    return in.kind() == K::boolean && !in.as_bool();
  if (name == "integer")
    return in.kind() == K::integer;
  if (name == "float")
    return in.kind() == K::real;
  if (name == "number")
    return in.is_number() || in.kind() == K::boolean;
  if (name == "string")
    return in.is_string();
  if (name == "mapping")
    return in.is_object() && !in.object().is_namespace;
  if (name == "iterable")
    return in.is_string() || in.is_array() || (in.is_object() && !in.object().is_namespace) || in.is_undefined();
  if (name == "sequence")
    return in.is_string() || in.is_array() || (in.is_object() && !in.object().is_namespace);
  if (name == "callable")
    return in.is_callable();
  if (name == "escaped")
    return false;
  if (name == "lower")
    return in.is_string() && lower(in.as_string()) == in.as_string();
  if (name == "upper")
    return in.is_string() && upper(in.as_string()) == in.as_string();
  if (name == "odd" || name == "even" || name == "divisibleby") {
    if (in.kind() != K::integer)
      fail("the test '" + name + "' needs an integer, not " + in.type_name(), line);
    if (name == "divisibleby") {
      const Value& d = arg();
      if (d.kind() != K::integer || d.as_int() == 0)
        fail("divisibleby needs a non-zero integer", line);
      return in.as_int() % d.as_int() == 0;
    }
    return (in.as_int() % 2 != 0) == (name == "odd");
  }
  if (name == "eq" || name == "equalto" || name == "==")
    return in == arg();
  if (name == "ne" || name == "!=")
    return !(in == arg());
  if (name == "sameas")
    return in == arg() && in.kind() == arg().kind();
  if (name == "in")
    return contains(arg(), in, line);
  if (name == "lt" || name == "<" || name == "le" || name == "<=" || name == "gt" || name == ">" || name == "ge" ||
      name == ">=") {
    const int c = compare(in, arg(), true, line);
    if (name == "lt" || name == "<")
      return c < 0;
    if (name == "le" || name == "<=")
      return c <= 0;
    if (name == "gt" || name == ">")
      return c > 0;
    return c >= 0;
  }
  unsupported("unsupported test '" + name + "'", line);
}

} // namespace strata::model::jinja
