#pragma once
// The template engine's filters, tests, methods and Python-style item access.
// Internal to the engine; each throws TemplateError naming what is wrong.

#include "model/text/jinja/value.hpp"

#include <optional>
#include <string>
#include <vector>

namespace strata::model::jinja {

/// The characters (code points, as UTF-8) of `s`.
std::vector<std::string> utf8_chars(const std::string& s);
/// obj.name: a dict's key, else undefined; a method name is not an attribute
/// here (calls go through call_method). `what` names obj in errors.
Value get_attr(const Value& obj, const std::string& name, int line, const std::string& what);
/// obj[key]: Python indexing (negative from the end); missing is undefined.
Value get_item(const Value& obj, const Value& key, int line, const std::string& what);
/// obj[a:b:c] of a list or a string.
Value slice(const Value& obj, std::optional<int64_t> a, std::optional<int64_t> b, std::optional<int64_t> c,
            int line);
/// `item in container`.
bool contains(const Value& container, const Value& item, int line);
/// obj.name(args) for the string, dict and list methods templates use; nullopt
/// when obj has no such method (then obj.name must be a callable value).
std::optional<Value> call_method(const Value& obj, const std::string& name, const Args& a, int line);
Value apply_filter(const std::string& name, const Value& in, const Args& a, int line);
bool apply_test(const std::string& name, const Value& in, const Args& a, int line);

} // namespace strata::model::jinja
