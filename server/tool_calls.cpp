#include "server/tool_calls.hpp"
#include "server/ordered_json.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <random>

namespace strata::server {

namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view hermes_open = "<tool_call>", hermes_close = "</tool_call>";
constexpr std::string_view mistral_mark = "[TOOL_CALLS]", python_tag = "<|python_tag|>";

// The longest tail of `s` that is a proper prefix of `tag`: text that may still
// become the tag when more arrives.
std::size_t partial_tail(std::string_view s, std::string_view tag) {
  for (std::size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n)
    if (s.substr(s.size() - n) == tag.substr(0, n))
      return n;
  return 0;
}

std::string_view trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos)
    return {};
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

} // namespace

ToolSyntax tool_syntax_of(std::string_view t) {
  if (t.find(mistral_mark) != std::string_view::npos)
    return ToolSyntax::mistral;
  if (t.find(hermes_open) != std::string_view::npos)
    return ToolSyntax::hermes;
  // Llama 3.1+: the template tells the model to answer with {"name": ..., "parameters": ...}.
  if (t.find(python_tag) != std::string_view::npos || t.find("\"parameters\": ") != std::string_view::npos)
    return ToolSyntax::llama3;
  return ToolSyntax::hermes;
}

const char* to_string(ToolSyntax s) {
  switch (s) {
    case ToolSyntax::llama3: return "llama3";
    case ToolSyntax::mistral: return "mistral";
    default: return "hermes";
  }
}

ToolCallParser::ToolCallParser(ToolSyntax syntax, std::vector<std::string> names)
  : syntax_(syntax), names_(std::move(names)), rng_(std::random_device{}()) {}

std::string ToolCallParser::new_id() {
  static constexpr char alnum[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::mt19937_64 g(rng_++);
  std::string id = syntax_ == ToolSyntax::mistral ? "" : "call_";
  const int n = syntax_ == ToolSyntax::mistral ? 9 : 24;
  for (int i = 0; i < n; ++i)
    id += alnum[g() % (sizeof alnum - 1)];
  return id;
}

// One call: {"name": N, "arguments": {...}} (Llama: "parameters"); arguments
// may come as a string holding the object.
bool ToolCallParser::take_call(std::string_view text, Out& out) {
  const ojson j = parse_ordered(trim(text));
  if (j.is_discarded() || !j.is_object() || !j.contains("name") || !j["name"].is_string())
    return false;
  const auto name = j["name"].get<std::string>();
  if (!names_.empty() && std::find(names_.begin(), names_.end(), name) == names_.end())
    return false;
  ojson args = ojson::object();
  for (const char* key : {"arguments", "parameters"})
    if (j.contains(key) && !j[key].is_null()) {
      args = j[key].is_string() ? parse_ordered(j[key].get<std::string>()) : j[key];
      break;
    }
  if (args.is_discarded() || !args.is_object())
    return false;
  out.calls.push_back({new_id(), name, args.dump()});
  ++made_;
  return true;
}

// Several calls: a JSON array of them, or (Llama 3.2) objects separated by ';'.
// All of them or none.
bool ToolCallParser::take_calls(std::string_view text, Out& out) {
  Out got;
  const auto body = trim(text);
  const ojson j = parse_ordered(body);
  bool ok = !j.is_discarded();
  if (ok && j.is_array()) {
    for (auto& e : j)
      ok = ok && take_call(e.dump(), got);
  } else if (ok) {
    ok = take_call(body, got);
  } else { // not one JSON value: objects separated by ';'
    ok = true;
    for (std::size_t at = 0; ok && at <= body.size();) {
      const auto semi = std::min(body.find(';', at), body.size());
      ok = take_call(body.substr(at, semi - at), got);
      at = semi + 1;
    }
  }
  if (!ok || got.calls.empty()) {
    made_ -= got.calls.size();
    return false;
  }
  for (auto& c : got.calls)
    out.calls.push_back(std::move(c));
  return true;
}

// Text before `tag` is content; so is text that cannot be the start of it
// (unless the reply goes on, a tail that may become the tag is held). Once the
// tag is there it is taken off and the call begins.
bool ToolCallParser::opens(std::string_view tag, Out& out, bool end) {
  const auto at = held_.find(tag);
  if (at == std::string::npos) {
    const auto keep = end ? 0 : partial_tail(held_, tag);
    out.content += held_.substr(0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
    return false;
  }
  out.content += held_.substr(0, at);
  held_.erase(0, at + tag.size());
  in_call_ = true;
  return true;
}

void ToolCallParser::scan(Out& out, bool end) {
  switch (syntax_) {
    case ToolSyntax::hermes:
      for (;;) {
        if (!in_call_ && !opens(hermes_open, out, end))
          return;
        const auto close = held_.find(hermes_close);
        if (close == std::string::npos) {
          if (!end)
            return;
          // The reply ended inside the call (a model may stop right after the
          // object): a complete object is still a call.
          if (!take_call(held_, out))
            out.content += std::string(hermes_open) + held_;
          held_.clear();
          in_call_ = false;
          return;
        }
        if (!take_call(std::string_view(held_).substr(0, close), out))
          out.content += std::string(hermes_open) + held_.substr(0, close + hermes_close.size());
        held_.erase(0, close + hermes_close.size());
        in_call_ = false;
      }
    case ToolSyntax::mistral:
      if (!in_call_ && !opens(mistral_mark, out, end))
        return;
      if (end) { // the calls run to the end of the reply
        if (!take_calls(held_, out))
          out.content += std::string(mistral_mark) + held_;
        held_.clear();
        in_call_ = false;
      }
      return;
    case ToolSyntax::llama3:
      if (!started_) {
        // A reply that is a call starts with it: {"name": ...} or <|python_tag|>.
        const auto first = held_.find_first_not_of(" \t\r\n");
        if (first == std::string::npos && !end)
          return;
        const std::string_view rest = first == std::string::npos ? std::string_view() : std::string_view(held_).substr(first);
        if (!end && rest.size() < python_tag.size() && python_tag.substr(0, rest.size()) == rest)
          return; // could still become <|python_tag|>
        started_ = true;
        in_call_ = !rest.empty() && (rest.front() == '{' || rest.substr(0, python_tag.size()) == python_tag);
      }
      if (!in_call_) {
        out.content += held_;
        held_.clear();
        return;
      }
      if (end) {
        std::string_view body = trim(held_);
        if (body.substr(0, python_tag.size()) == python_tag)
          body.remove_prefix(python_tag.size());
        if (!take_calls(body, out))
          out.content += held_;
        held_.clear();
        in_call_ = false;
      }
      return;
  }
}

ToolCallParser::Out ToolCallParser::push(std::string_view piece) {
  Out out;
  held_.append(piece);
  scan(out, false);
  return out;
}

ToolCallParser::Out ToolCallParser::finish() {
  Out out;
  scan(out, true);
  return out;
}

} // namespace strata::server
