#pragma once
// JSON Schema to grammar (grammar.hpp text form) for structured outputs: the
// subset OpenAI's strict mode and llama.cpp's json-schema-to-grammar take.
// Every text the grammar allows parses as JSON and validates against the
// schema; a keyword that would need more than that is refused by name.
//
// Supported: type (string, number, integer, boolean, null, object, array, or
// a list of them), enum, const, anyOf / oneOf (alternatives), allOf of one,
// $ref to #, #/$defs/..., #/definitions/...; objects: properties (in the
// schema's order), required, additionalProperties (false, or a schema /
// true when there are no properties: a map); arrays: items, minItems,
// maxItems; strings: minLength, maxLength, format date / time / date-time /
// uuid; integers: minimum / maximum / exclusiveMinimum / exclusiveMaximum
// when the range is at least 0 or spans at most 1024 values; nullable.
// Annotations (title, description, default, examples, $schema, $id,
// $comment, deprecated, readOnly, writeOnly, strict) are ignored.
#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <string_view>

namespace strata::model {

/// Builds a grammar of JSON values rule by rule.
class JsonGrammar {
public:
  /// The rule (its name) for values valid under `schema`. `path` names where
  /// the schema sits, for errors. Throws Error(bad_argument) "<path>: ..."
  /// naming the keyword it cannot honour.
  std::string value(const nlohmann::ordered_json& schema, const std::string& path);
  /// Any JSON value / any JSON object.
  std::string any_value();
  std::string any_object();
  /// The rule for optional whitespace between JSON tokens.
  std::string ws();
  /// A grammar literal spelling `s` ("..." with escapes).
  static std::string literal(std::string_view s);
  /// Adds `name ::= body` (name made unique); returns the name.
  std::string rule(const std::string& name, const std::string& body);
  /// The grammar text: `root ::= root_body` and every rule made so far.
  std::string grammar(const std::string& root_body) const;

private:
  std::string value_at(const nlohmann::ordered_json& s, const std::string& path, int depth);
  std::string typed(const nlohmann::ordered_json& s, const std::string& type, const std::string& path, int depth);
  std::string object(const nlohmann::ordered_json& s, const std::string& path, int depth);
  std::string array(const nlohmann::ordered_json& s, const std::string& path, int depth);
  std::string string(const nlohmann::ordered_json& s, const std::string& path);
  std::string integer(const nlohmann::ordered_json& s, const std::string& path);
  std::string primitive(const std::string& name);
  std::string ref(const std::string& target, const std::string& path, int depth);

  nlohmann::ordered_json root_;
  std::map<std::string, std::string> rules_; // name -> body
  std::map<std::string, std::string> refs_;  // $ref -> rule name
  std::map<std::string, std::string> memo_;  // primitives by name
  int next_ = 0;
};

/// The grammar text for one JSON value valid under `schema`.
std::string json_schema_grammar(const nlohmann::ordered_json& schema, const std::string& path);
/// The grammar text for any JSON object (response_format json_object).
std::string json_object_grammar();

} // namespace strata::model
