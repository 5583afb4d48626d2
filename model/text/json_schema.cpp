#include "model/text/json_schema.hpp"

#include "model/base/error.hpp"
#include "model/text/regex_grammar.hpp"

#include <array>
#include <cmath>
#include <optional>
#include <set>

namespace strata::model {

namespace {

using ojson = nlohmann::ordered_json;
constexpr int max_depth = 64;
constexpr int64_t max_enumerated_range = 1024;

[[noreturn]] void refuse(const std::string& path, const std::string& what) {
  throw Error(errc::bad_argument, path + ": " + what);
}

const std::set<std::string>& ignored_keywords() {
  static const std::set<std::string> k{"title",    "description", "default",   "examples", "$schema",
                                       "$id",      "$comment",    "deprecated", "readOnly", "writeOnly",
                                       "strict",   "$defs",       "definitions"};
  return k;
}

// Keywords each type honours (anything else that constrains is refused).
const std::set<std::string>& known_keywords() {
  static const std::set<std::string> k{"type",      "enum",      "const",    "anyOf",     "oneOf",
                                       "allOf",     "$ref",      "nullable", "properties", "required",
                                       "additionalProperties",   "items",    "minItems",  "maxItems",
                                       "minLength", "maxLength", "format",   "minimum",   "maximum",
                                       "exclusiveMinimum",       "exclusiveMaximum", "pattern"};
  return k;
}

// A count range (minItems / maxItems, minLength / maxLength): each in [0, 10000];
// the maximum -1 when absent.
std::pair<int64_t, int64_t> bounds(const ojson& s, const char* lo, const char* hi, const std::string& path) {
  auto count = [&](const char* k, int64_t dflt) {
    if (!s.contains(k))
      return dflt;
    const auto& v = s[k];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 10000)
      refuse(path + "." + k, "must be an integer in [0, 10000]");
    return v.get<int64_t>();
  };
  const int64_t mn = count(lo, 0), mx = count(hi, -1);
  if (mx >= 0 && mx < mn)
    refuse(path + "." + hi, std::string("is below ") + lo);
  return {mn, mx};
}

std::string quoted_json(const ojson& v) {
  return v.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
}

} // namespace

std::string JsonGrammar::literal(std::string_view s) {
  std::string out = "\"";
  static const char* hex = "0123456789abcdef";
  for (char c : s) {
    const auto b = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (b < 0x20 || b >= 0x7f) {
      out += "\\x";
      out += hex[b >> 4];
      out += hex[b & 15];
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string JsonGrammar::rule(const std::string& name, const std::string& body) {
  std::string n = name + "-" + std::to_string(next_++);
  rules_.emplace(n, body);
  return n;
}

std::string JsonGrammar::grammar(const std::string& root_body) const {
  std::string out = "root ::= " + root_body + "\n";
  for (const auto& [n, b] : rules_)
    out += n + " ::= " + b + "\n";
  return out;
}

std::string JsonGrammar::primitive(const std::string& name) {
  auto it = memo_.find(name);
  if (it != memo_.end())
    return it->second;
  std::string body;
  if (name == "ws") {
    body = R"(( " " | "\n" [ \t]{0,20} )?)";
  } else if (name == "mb") {
    // One well-formed non-ASCII UTF-8 character.
    const std::string cont = "[\\x80-\\xbf]";
    body = "[\\xc2-\\xdf] " + cont + " | \"\\xe0\" [\\xa0-\\xbf] " + cont + " | [\\xe1-\\xec\\xee\\xef] " + cont + " " + cont +
           " | \"\\xed\" [\\x80-\\x9f] " + cont + " | \"\\xf0\" [\\x90-\\xbf] " + cont + " " + cont +
           " | [\\xf1-\\xf3] " + cont + " " + cont + " " + cont + " | \"\\xf4\" [\\x80-\\x8f] " + cont + " " + cont;
  } else if (name == "char") {
    // One code point of a JSON string: printable ASCII but " and \, an escape
    // (\u of anything but a surrogate), or a well-formed UTF-8 sequence.
    const std::string h = primitive("hex");
    body = "[\\x20-\\x21\\x23-\\x5b\\x5d-\\x7f] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" ( [0-9a-cA-C] " + h + " " + h + " " + h +
           " | [dD] [0-7] " + h + " " + h + " | [eEfF] " + h + " " + h + " " + h + " ) ) | " + primitive("mb");
  } else if (name == "hex") {
    body = "[0-9a-fA-F]";
  } else if (name == "string") {
    body = "\"\\\"\" " + primitive("char") + "* \"\\\"\"";
  } else if (name == "integer") {
    body = R"("-"? ( "0" | [1-9] [0-9]{0,15} ))";
  } else if (name == "number") {
    body = R"("-"? ( "0" | [1-9] [0-9]{0,15} ) ( "." [0-9]{1,16} )? ( [eE] [-+]? [1-9] [0-9]? )?)";
  } else if (name == "boolean") {
    body = R"("true" | "false")";
  } else if (name == "null") {
    body = R"("null")";
  } else if (name == "value") {
    // Any JSON value; objects and arrays recurse through it.
    const std::string v = rule("value", "PLACEHOLDER");
    memo_.emplace(name, v);
    const std::string w = primitive("ws");
    const std::string kv = primitive("string") + " " + w + " \":\" " + w + " " + v + " " + w;
    const std::string obj = "\"{\" " + w + " ( " + kv + " ( \",\" " + w + " " + kv + " )* )? \"}\"";
    const std::string arr = "\"[\" " + w + " ( " + v + " " + w + " ( \",\" " + w + " " + v + " " + w + " )* )? \"]\"";
    rules_[v] = obj + " | " + arr + " | " + primitive("string") + " | " + primitive("number") + " | " +
                primitive("boolean") + " | " + primitive("null");
    return v;
  } else if (name == "object") {
    const std::string w = primitive("ws");
    const std::string v = primitive("value");
    const std::string kv = primitive("string") + " " + w + " \":\" " + w + " " + v + " " + w;
    body = "\"{\" " + w + " ( " + kv + " ( \",\" " + w + " " + kv + " )* )? \"}\"";
  } else {
    throw Error(errc::bad_argument, "unknown primitive " + name);
  }
  const std::string r = rule(name, body);
  memo_.emplace(name, r);
  return r;
}

std::string JsonGrammar::ws() { return primitive("ws"); }
std::string JsonGrammar::any_value() { return primitive("value"); }
std::string JsonGrammar::any_object() { return primitive("object"); }

std::string JsonGrammar::value(const ojson& schema, const std::string& path) {
  // Each schema is its own document: # and #/$defs/... refer into it.
  root_ = schema;
  refs_.clear();
  return value_at(schema, path, 0);
}

std::string JsonGrammar::ref(const std::string& target, const std::string& path, int depth) {
  auto it = refs_.find(target);
  if (it != refs_.end())
    return it->second;
  const ojson* node = nullptr;
  if (target == "#") {
    node = &root_;
  } else if (target.rfind("#/$defs/", 0) == 0 || target.rfind("#/definitions/", 0) == 0) {
    const bool defs = target[2] == '$';
    const std::string name = target.substr(defs ? 8 : 14);
    const char* key = defs ? "$defs" : "definitions";
    if (root_.is_object() && root_.contains(key) && root_[key].is_object() && root_[key].contains(name))
      node = &root_[key][name];
    else
      refuse(path, "$ref '" + target + "' names no definition");
  } else {
    refuse(path, "$ref '" + target + "' is not supported (only #, #/$defs/<name> and #/definitions/<name>)");
  }
  // Named before it is built: a recursive schema refers to itself.
  const std::string r = rule("ref", "PLACEHOLDER");
  refs_.emplace(target, r);
  rules_[r] = value_at(*node, path + ".$ref", depth + 1);
  return r;
}

std::string JsonGrammar::value_at(const ojson& s, const std::string& path, int depth) {
  if (depth > max_depth)
    refuse(path, "nested deeper than " + std::to_string(max_depth));
  if (s.is_boolean()) {
    if (!s.get<bool>())
      refuse(path, "the schema false allows no value");
    return any_value();
  }
  if (!s.is_object())
    refuse(path, "a schema must be an object or a boolean");
  for (const auto& [k, v] : s.items()) {
    (void)v;
    if (!known_keywords().count(k) && !ignored_keywords().count(k))
      refuse(path, "'" + k + "' is not supported");
  }
  std::string body;
  if (s.contains("$ref")) {
    if (!s["$ref"].is_string())
      refuse(path + ".$ref", "must be a string");
    body = ref(s["$ref"].get<std::string>(), path, depth);
  } else if (s.contains("const")) {
    body = literal(quoted_json(s["const"]));
  } else if (s.contains("enum")) {
    const auto& e = s["enum"];
    if (!e.is_array() || e.empty())
      refuse(path + ".enum", "must be a non-empty array");
    for (std::size_t i = 0; i < e.size(); ++i)
      body += (i ? " | " : "") + literal(quoted_json(e[i]));
  } else if (s.contains("anyOf") || s.contains("oneOf")) {
    const char* key = s.contains("anyOf") ? "anyOf" : "oneOf";
    const auto& a = s[key];
    if (!a.is_array() || a.empty())
      refuse(path + "." + key, "must be a non-empty array");
    for (std::size_t i = 0; i < a.size(); ++i)
      body += (i ? " | " : "") + value_at(a[i], path + "." + key + "[" + std::to_string(i) + "]", depth + 1);
  } else if (s.contains("allOf")) {
    const auto& a = s["allOf"];
    if (!a.is_array() || a.size() != 1)
      refuse(path + ".allOf", "only allOf with one schema is supported");
    body = value_at(a[0], path + ".allOf[0]", depth + 1);
  } else if (s.contains("type")) {
    const auto& t = s["type"];
    if (t.is_string()) {
      body = typed(s, t.get<std::string>(), path, depth);
    } else if (t.is_array() && !t.empty()) {
      for (std::size_t i = 0; i < t.size(); ++i) {
        if (!t[i].is_string())
          refuse(path + ".type", "must name types");
        body += (i ? " | " : "") + typed(s, t[i].get<std::string>(), path, depth);
      }
    } else {
      refuse(path + ".type", "must be a type name or a list of them");
    }
  } else if (s.contains("properties")) {
    body = object(s, path, depth);
  } else if (s.contains("items")) {
    body = array(s, path, depth);
  } else {
    body = any_value();
  }
  if (s.contains("nullable") && s["nullable"].is_boolean() && s["nullable"].get<bool>())
    body = "( " + body + " ) | " + primitive("null");
  return rule("v", body);
}

std::string JsonGrammar::typed(const ojson& s, const std::string& type, const std::string& path, int depth) {
  if (type == "object")
    return object(s, path, depth);
  if (type == "array")
    return array(s, path, depth);
  if (type == "string")
    return string(s, path);
  if (type == "integer")
    return integer(s, path);
  if (type == "number") {
    for (const char* k : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
      if (s.contains(k))
        refuse(path, std::string("'") + k + "' is supported for integers only");
    return primitive("number");
  }
  if (type == "boolean")
    return primitive("boolean");
  if (type == "null")
    return primitive("null");
  refuse(path + ".type", "unknown type '" + type + "'");
}

std::string JsonGrammar::object(const ojson& s, const std::string& path, int depth) {
  const std::string w = ws();
  std::set<std::string> required;
  if (s.contains("required")) {
    if (!s["required"].is_array())
      refuse(path + ".required", "must be an array of names");
    for (const auto& r : s["required"]) {
      if (!r.is_string())
        refuse(path + ".required", "must be an array of names");
      required.insert(r.get<std::string>());
    }
  }
  const ojson empty = ojson::object();
  const ojson& props = s.contains("properties") ? s["properties"] : empty;
  if (!props.is_object())
    refuse(path + ".properties", "must be an object");
  for (const auto& r : required)
    if (!props.contains(r))
      refuse(path + ".required", "names '" + r + "', which is not in properties (not supported)");
  if (props.empty()) {
    // A map: additionalProperties' schema for every value (anything when absent or true).
    if (s.contains("additionalProperties")) {
      const auto& ap = s["additionalProperties"];
      if (ap.is_boolean() && !ap.get<bool>())
        return "\"{\" " + w + " \"}\"";
      if (!ap.is_boolean()) {
        const std::string v = value_at(ap, path + ".additionalProperties", depth + 1);
        const std::string kv = primitive("string") + " " + w + " \":\" " + w + " " + v + " " + w;
        return "\"{\" " + w + " ( " + kv + " ( \",\" " + w + " " + kv + " )* )? \"}\"";
      }
    }
    return any_object();
  }
  // Properties in the schema's order; required ones always, optional ones may
  // be left out. rest[i][e]: properties from i on, e = something came before.
  std::vector<std::string> kv;
  std::vector<bool> req;
  for (const auto& [name, sub] : props.items()) {
    const std::string v = value_at(sub, path + ".properties." + name, depth + 1);
    kv.push_back(literal(quoted_json(ojson(name))) + " " + w + " \":\" " + w + " " + v + " " + w);
    req.push_back(required.count(name) > 0);
  }
  const std::size_t n = kv.size();
  std::vector<std::array<std::string, 2>> rest(n + 1);
  for (std::size_t i = n; i-- > 0;) {
    for (std::size_t e = 0; e < 2; ++e) {
      const std::string sep = e ? "\",\" " + w + " " : "";
      const std::string take = sep + kv[i] + " " + rest[i + 1][1];
      rest[i][e] = rule("props", req[i] ? take : take + " | " + rest[i + 1][e]); // an empty alternative: left out
    }
  }
  // rest[0][0] may match nothing when every property is optional.
  return "\"{\" " + w + " " + rest[0][0] + " \"}\"";
}

std::string JsonGrammar::array(const ojson& s, const std::string& path, int depth) {
  const std::string w = ws();
  std::string item = any_value();
  if (s.contains("items")) {
    if (s["items"].is_array())
      refuse(path + ".items", "a list of item schemas (tuples) is not supported");
    item = value_at(s["items"], path + ".items", depth + 1);
  }
  if (s.contains("uniqueItems") && s["uniqueItems"].is_boolean() && s["uniqueItems"].get<bool>())
    refuse(path, "'uniqueItems' is not supported");
  const auto [mn, mx] = bounds(s, "minItems", "maxItems", path);
  if (mx == 0)
    return "\"[\" " + w + " \"]\"";
  const std::string one = item + " " + w;
  const std::string more = "( \",\" " + w + " " + one + " )";
  std::string reps;
  const int64_t lo = std::max<int64_t>(mn - 1, 0);
  if (mx < 0)
    reps = more + (lo == 0 ? "*" : "{" + std::to_string(lo) + ",}");
  else
    reps = more + "{" + std::to_string(lo) + "," + std::to_string(mx - 1) + "}";
  const std::string list = one + " " + reps;
  return "\"[\" " + w + " " + (mn == 0 ? "( " + list + " )?" : list) + " \"]\"";
}

std::string JsonGrammar::string(const ojson& s, const std::string& path) {
  if (s.contains("pattern")) {
    if (!s["pattern"].is_string())
      refuse(path + ".pattern", "must be a string");
    for (const char* k : {"minLength", "maxLength", "format"})
      if (s.contains(k))
        refuse(path, std::string("'") + k + "' together with 'pattern' is not supported");
    const std::string body = regex_grammar(s["pattern"].get<std::string>(), primitive("char"), primitive("mb"), path);
    return "\"\\\"\" " + body + " \"\\\"\"";
  }
  if (s.contains("format")) {
    if (!s["format"].is_string())
      refuse(path + ".format", "must be a string");
    const std::string f = s["format"].get<std::string>();
    const std::string d2 = "[0-9] [0-9]";
    const std::string date = "[0-9] [0-9] [0-9] [0-9] \"-\" ( \"0\" [1-9] | \"1\" [0-2] ) \"-\" ( \"0\" [1-9] | [1-2] [0-9] | \"3\" [0-1] )";
    const std::string time = "( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" ( [0-5] [0-9] | \"60\" ) ( \".\" [0-9]{1,9} )? ( \"Z\" | [+-] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] )";
    std::string body;
    if (f == "date")
      body = date;
    else if (f == "time")
      body = time;
    else if (f == "date-time")
      body = date + " \"T\" " + time;
    else if (f == "uuid")
      body = "[0-9a-f]{8} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{12}";
    else
      refuse(path + ".format", "format '" + f + "' is not supported (date, time, date-time, uuid are)");
    for (const char* k : {"minLength", "maxLength"})
      if (s.contains(k))
        refuse(path, std::string("'") + k + "' together with 'format' is not supported");
    return "\"\\\"\" " + body + " \"\\\"\"";
  }
  const auto [mn, mx] = bounds(s, "minLength", "maxLength", path);
  if (mn == 0 && mx < 0)
    return primitive("string");
  const std::string reps =
    mx < 0 ? "{" + std::to_string(mn) + ",}" : "{" + std::to_string(mn) + "," + std::to_string(mx) + "}";
  return "\"\\\"\" " + primitive("char") + reps + " \"\\\"\"";
}

std::string JsonGrammar::integer(const ojson& s, const std::string& path) {
  auto bound = [&](const char* k) -> std::optional<double> {
    if (!s.contains(k))
      return std::nullopt;
    if (!s[k].is_number())
      refuse(path + "." + k, "must be a number");
    return s[k].get<double>();
  };
  auto mn = bound("minimum"), mx = bound("maximum");
  if (auto e = bound("exclusiveMinimum"))
    mn = std::max(mn.value_or(-INFINITY), std::floor(*e) + 1);
  if (auto e = bound("exclusiveMaximum"))
    mx = std::min(mx.value_or(INFINITY), std::ceil(*e) - 1);
  if (mn)
    mn = std::ceil(*mn);
  if (mx)
    mx = std::floor(*mx);
  if (!mn && !mx)
    return primitive("integer");
  if (mn && mx) {
    if (*mx < *mn)
      refuse(path, "the integer range is empty");
    if (*mx - *mn < static_cast<double>(max_enumerated_range) && std::fabs(*mn) < 1e15 && std::fabs(*mx) < 1e15) {
      std::string body;
      for (auto v = static_cast<int64_t>(*mn); v <= static_cast<int64_t>(*mx); ++v)
        body += (body.empty() ? "" : " | ") + literal(std::to_string(v));
      return "( " + body + " )";
    }
  }
  if (mn && !mx && *mn >= 0 && *mn <= 1)
    return *mn == 0 ? R"(( "0" | [1-9] [0-9]{0,15} ))" : R"(( [1-9] [0-9]{0,15} ))";
  refuse(path, "integer 'minimum' / 'maximum' are supported for ranges from 0 or 1 up, or of at most " +
                 std::to_string(max_enumerated_range) + " values");
}

std::string json_schema_grammar(const nlohmann::ordered_json& schema, const std::string& path) {
  JsonGrammar g;
  const std::string v = g.value(schema, path);
  return g.grammar(v);
}

std::string json_object_grammar() {
  JsonGrammar g;
  const std::string v = g.any_object();
  return g.grammar(v);
}

} // namespace strata::model
