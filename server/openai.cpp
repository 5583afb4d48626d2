#include "server/openai.hpp"
#include "server/ordered_json.hpp"

#include "model/base/error.hpp"
#include "model/text/json_schema.hpp"

#include <cctype>

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>

namespace strata::server {

using nlohmann::json;
using ojson = nlohmann::ordered_json;

json ApiError::body() const {
  json e = {{"message", message}, {"type", type}};
  e["param"] = param.empty() ? json(nullptr) : json(param);
  e["code"] = code.empty() ? json(nullptr) : json(code);
  return json{{"error", e}};
}

namespace {

ApiError bad(std::string param, std::string message, std::string code = "") {
  ApiError e;
  e.param = std::move(param);
  e.message = std::move(message);
  e.code = std::move(code);
  return e;
}

template <class J>
const char* type_name(const J& v) {
  switch (v.type()) {
    case J::value_t::null: return "null";
    case J::value_t::boolean: return "a boolean";
    case J::value_t::string: return "a string";
    case J::value_t::array: return "an array";
    case J::value_t::object: return "an object";
    case J::value_t::number_float: return "a number";
    default: return "an integer";
  }
}

// Reads an optional number field within [lo, hi]; a bound is open when the flag says so.
std::optional<ApiError> number(const json& j, const char* name, float& out, double lo, double hi, bool lo_open) {
  if (!j.contains(name) || j[name].is_null())
    return std::nullopt;
  const auto& v = j[name];
  if (!v.is_number())
    return bad(name, std::string("'") + name + "' must be a number, not " + type_name(v));
  const double x = v.get<double>();
  auto fmt = [](double d) {
    std::ostringstream os;
    os << d;
    return os.str();
  };
  // The bounds hold for the value as it is used: a float (1e-320 is a positive
  // double but 0 as a float).
  const float f = static_cast<float>(x);
  const bool double_ok = std::isfinite(x) && x <= hi && (lo_open ? x > lo : x >= lo);
  if (!double_ok || !std::isfinite(f) || f > hi || (lo_open ? f <= lo : f < lo))
    return bad(name, std::string("'") + name + "' must be " +
                       (lo_open ? "greater than " + fmt(lo) + " and at most " : "between " + fmt(lo) + " and ") + fmt(hi) +
                       (double_ok ? " as a 32-bit float" : "") + ", not " + v.dump());
  out = f;
  return std::nullopt;
}

std::optional<ApiError> integer(const json& j, const char* name, int64_t& out, int64_t lo, int64_t hi) {
  const auto& v = j[name];
  if (!v.is_number_integer())
    return bad(name, std::string("'") + name + "' must be an integer, not " + type_name(v));
  const bool out_of_range = v.is_number_unsigned()
                              ? (v.get<uint64_t>() > static_cast<uint64_t>(hi) ||
                                 (lo > 0 && v.get<uint64_t>() < static_cast<uint64_t>(lo)))
                              : (v.get<int64_t>() < lo || v.get<int64_t>() > hi);
  if (out_of_range)
    return bad(name, std::string("'") + name + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi) +
                       ", not " + v.dump());
  out = v.is_number_unsigned() ? static_cast<int64_t>(v.get<uint64_t>()) : v.get<int64_t>();
  return std::nullopt;
}

std::optional<ApiError> text_content(const ojson& v, const std::string& param, std::string& out) {
  if (v.is_string()) {
    out = v.get<std::string>();
    return std::nullopt;
  }
  if (v.is_array()) { // [{"type": "text", "text": "..."}]
    out.clear();
    for (auto& part : v) {
      if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
        return bad(param, "'" + param + "' parts must be {\"type\": \"text\", \"text\": string}; only text is supported");
      out += part["text"].get<std::string>();
    }
    return std::nullopt;
  }
  return bad(param, "'" + param + "' must be a string or an array of text parts, not " + type_name(v));
}

// Fields a client may send that strata does not implement: accepted only at
// their neutral value, otherwise a 400 that says so.
std::optional<ApiError> unsupported(const json& j) {
  auto neutral = [&](const char* name, auto ok) -> std::optional<ApiError> {
    if (!j.contains(name) || j[name].is_null() || ok(j[name]))
      return std::nullopt;
    return bad(name, std::string("'") + name + "' = " + j[name].dump() + " is not supported by strata");
  };
  auto is_one = [](const json& v) { return v.is_number_integer() && v.get<int64_t>() == 1; };
  auto is_zero = [](const json& v) { return v.is_number() && v.get<double>() == 0.0; };
  auto is_false = [](const json& v) { return v.is_boolean() && !v.get<bool>(); };
  auto is_empty = [](const json& v) { return (v.is_object() || v.is_array()) && v.empty(); };
  auto is_unit = [](const json& v) { return v.is_number() && v.get<double>() == 1.0; };
  // (Extensions vLLM and llama-server accept that would change the sampling are
  // refused the same way, never ignored.)
  for (auto r : {neutral("best_of", is_one), neutral("typical_p", is_unit), neutral("length_penalty", is_unit),
                 neutral("ignore_eos", is_false), neutral("mirostat", is_zero),
                 neutral("logit_bias", is_empty),
                 neutral("functions", is_empty), neutral("suffix", [](const json& v) {
                   return v.is_string() && v.get<std::string>().empty();
                 })})
    if (r)
      return r;
  return std::nullopt;
}

bool too_deep(const ojson& root);

// response_format: text, json_object, or json_schema {name, schema, strict}:
// the schema is compiled here, so one it cannot honour is a 400 naming the keyword.
std::optional<ApiError> parse_response_format(const ojson& j, ApiRequest& r) {
  if (!j.contains("response_format") || j["response_format"].is_null())
    return std::nullopt;
  const auto& f = j["response_format"];
  if (!f.is_object() || !f.contains("type") || !f["type"].is_string())
    return bad("response_format", "'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}");
  const auto type = f["type"].get<std::string>();
  if (type == "text")
    return std::nullopt;
  if (type == "json_object") {
    r.grammar = model::json_object_grammar();
    return std::nullopt;
  }
  if (type != "json_schema")
    return bad("response_format.type", "'response_format.type' = \"" + type +
                                         "\" is not supported (text, json_object and json_schema are)");
  if (!f.contains("json_schema") || !f["json_schema"].is_object())
    return bad("response_format.json_schema", "'response_format.json_schema' must be an object {name, schema, strict}");
  const auto& js = f["json_schema"];
  if (!js.contains("name") || !js["name"].is_string() || js["name"].get<std::string>().empty() ||
      js["name"].get<std::string>().size() > 64)
    return bad("response_format.json_schema.name", "'response_format.json_schema.name' must be a string of 1-64 characters");
  if (js.contains("strict") && !js["strict"].is_null() && !js["strict"].is_boolean())
    return bad("response_format.json_schema.strict", "'response_format.json_schema.strict' must be a boolean");
  if (!js.contains("schema") || js["schema"].is_null()) {
    r.grammar = model::json_object_grammar();
    return std::nullopt;
  }
  if (too_deep(js["schema"]))
    return bad("response_format.json_schema.schema", "'response_format.json_schema.schema' is nested deeper than 32 levels");
  try {
    r.grammar = model::json_schema_grammar(js["schema"], "response_format.json_schema.schema");
  } catch (const model::Error& e) {
    return bad("response_format.json_schema.schema", e.message());
  }
  return std::nullopt;
}

// Whether a value nests deeper than the template engine's bound (32 levels;
// counted without recursion: the client decides the depth).
bool too_deep(const ojson& root) {
  std::vector<std::pair<const ojson*, int>> todo{{&root, 1}};
  while (!todo.empty()) {
    auto [v, depth] = todo.back();
    todo.pop_back();
    if (depth > 32)
      return true;
    if (v->is_structured())
      for (auto& e : *v)
        todo.emplace_back(&e, depth + 1);
  }
  return false;
}

// A string field of an object: absent or null is "", another type a 400.
std::optional<ApiError> optional_string(const ojson& o, const std::string& key, const std::string& param,
                                        std::string& out) {
  if (!o.contains(key) || o[key].is_null())
    return std::nullopt;
  if (!o[key].is_string())
    return bad(param, "'" + param + "' must be a string, not " + type_name(o[key]));
  out = o[key].get<std::string>();
  return std::nullopt;
}

// An assistant message's tool_calls, as OpenAI clients send them: each
// {id, type: "function", function: {name, arguments: a JSON string}}. The
// arguments are parsed (keys in their order): templates print them as objects.
std::optional<ApiError> parse_tool_calls(const ojson& v, const std::string& p, ojson& out,
                                         std::vector<std::string>& ids) {
  if (!v.is_array() || v.empty())
    return bad(p, "'" + p + "' must be a non-empty array of tool calls");
  out = ojson::array();
  for (std::size_t k = 0; k < v.size(); ++k) {
    const std::string c = p + "[" + std::to_string(k) + "]";
    const auto& call = v[k];
    if (!call.is_object())
      return bad(c, "'" + c + "' must be an object {id, type, function}");
    std::string id, type = "function", name;
    if (auto e = optional_string(call, "id", c + ".id", id))
      return e;
    if (id.empty())
      return bad(c + ".id", "'" + c + ".id' is required (the tool message that answers the call names it)");
    if (auto e = optional_string(call, "type", c + ".type", type))
      return e;
    if (type != "function")
      return bad(c + ".type", "'" + c + ".type' must be \"function\", not \"" + type + "\"");
    if (!call.contains("function") || !call["function"].is_object())
      return bad(c + ".function", "'" + c + ".function' must be an object {name, arguments}");
    const auto& f = call["function"];
    if (auto e = optional_string(f, "name", c + ".function.name", name))
      return e;
    if (name.empty())
      return bad(c + ".function.name", "'" + c + ".function.name' is required");
    const std::string ap = c + ".function.arguments";
    ojson args = ojson::object();
    if (f.contains("arguments") && !f["arguments"].is_null()) {
      const auto& a = f["arguments"];
      if (a.is_object())
        args = a; // some clients send the object itself
      else if (a.is_string())
        args = parse_ordered(a.get<std::string>());
      else
        return bad(ap, "'" + ap + "' must be a string holding a JSON object, not " + type_name(a));
      if (args.is_discarded() || !args.is_object())
        return bad(ap, "'" + ap + "' must be a JSON object in a string (as the model wrote it), not " + a.dump());
      if (too_deep(args))
        return bad(ap, "'" + ap + "' is nested deeper than 32 levels");
    }
    ids.push_back(id);
    out.push_back({{"id", id}, {"type", "function"}, {"function", {{"name", name}, {"arguments", std::move(args)}}}});
  }
  return std::nullopt;
}

// The messages of a chat body (as /v1/chat/completions and /apply-template take
// them): the roles and fields OpenAI clients send, tool rounds included.
std::optional<ApiError> parse_messages(const ojson& j, std::vector<ChatMessage>& out) {
  if (!j.contains("messages"))
    return bad("messages", "'messages' is required");
  const auto& m = j["messages"];
  if (!m.is_array() || m.empty())
    return bad("messages", "'messages' must be a non-empty array");
  std::vector<std::string> call_ids; // of the tool calls made so far
  for (std::size_t i = 0; i < m.size(); ++i) {
    const std::string p = "messages[" + std::to_string(i) + "]";
    if (!m[i].is_object())
      return bad(p, "'" + p + "' must be an object with 'role' and 'content'");
    const std::string role = m[i].contains("role") && m[i]["role"].is_string() ? m[i]["role"].get<std::string>() : "";
    if (role != "system" && role != "user" && role != "assistant" && role != "developer" && role != "tool")
      return bad(p + ".role", "'" + p + ".role' must be one of system, developer, user, assistant, tool");
    ChatMessage msg{role == "developer" ? "system" : role, {}};
    if (auto e = optional_string(m[i], "name", p + ".name", msg.name))
      return e;
    const bool has_calls = m[i].contains("tool_calls") && !m[i]["tool_calls"].is_null();
    if (has_calls) {
      if (role != "assistant")
        return bad(p + ".tool_calls", "'" + p + ".tool_calls': only assistant messages make tool calls");
      if (auto e = parse_tool_calls(m[i]["tool_calls"], p + ".tool_calls", msg.tool_calls, call_ids))
        return e;
    }
    if (!m[i].contains("content") || m[i]["content"].is_null()) {
      if (role != "assistant" || !has_calls)
        return bad(p + ".content", "'" + p + ".content' is required" +
                                     std::string(role == "assistant" ? " (or 'tool_calls')" : ""));
      msg.content_null = true;
    } else if (auto e = text_content(m[i]["content"], p + ".content", msg.content)) {
      return e;
    }
    if (role == "tool") {
      if (auto e = optional_string(m[i], "tool_call_id", p + ".tool_call_id", msg.tool_call_id))
        return e;
      if (msg.tool_call_id.empty())
        return bad(p + ".tool_call_id", "'" + p + ".tool_call_id' is required: the id of the call it answers");
      if (std::find(call_ids.begin(), call_ids.end(), msg.tool_call_id) == call_ids.end())
        return bad(p + ".tool_call_id", "'" + p + ".tool_call_id' = \"" + msg.tool_call_id +
                                          "\" answers no tool call of an earlier assistant message");
    }
    out.push_back(std::move(msg));
  }
  return std::nullopt;
}

// tools, tool_choice and parallel_tool_calls. The tools reach the template as
// sent (key order kept). Output is not parsed into tool_calls yet, so a choice
// that would force a call (required, a named function) is refused, not hoped for.
std::optional<ApiError> parse_tools(const ojson& j, ApiRequest& r) {
  if (j.contains("tools") && !j["tools"].is_null()) {
    const auto& t = j["tools"];
    if (!t.is_array())
      return bad("tools", std::string("'tools' must be an array, not ") + type_name(t));
    std::vector<std::string> names;
    for (std::size_t k = 0; k < t.size(); ++k) {
      const std::string p = "tools[" + std::to_string(k) + "]";
      if (!t[k].is_object() || t[k].value("type", "") != "function")
        return bad(p, "'" + p + "' must be {\"type\": \"function\", \"function\": {...}}");
      if (!t[k].contains("function") || !t[k]["function"].is_object())
        return bad(p + ".function", "'" + p + ".function' must be an object {name, description, parameters}");
      const auto& f = t[k]["function"];
      std::string name, description;
      if (auto e = optional_string(f, "name", p + ".function.name", name))
        return e;
      const bool name_ok = !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char ch) {
        return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-';
      });
      if (!name_ok)
        return bad(p + ".function.name", "'" + p + ".function.name' must be 1-64 letters, digits, '_' or '-', not \"" +
                                           name + "\"");
      if (std::find(names.begin(), names.end(), name) != names.end())
        return bad(p + ".function.name", "'" + p + ".function.name': \"" + name + "\" is defined twice");
      names.push_back(name);
      if (auto e = optional_string(f, "description", p + ".function.description", description))
        return e;
      if (f.contains("parameters") && !f["parameters"].is_null() && !f["parameters"].is_object())
        return bad(p + ".function.parameters", "'" + p + ".function.parameters' must be a JSON Schema object");
      if (f.contains("strict") && !f["strict"].is_null() && !f["strict"].is_boolean())
        return bad(p + ".function.strict", "'" + p + ".function.strict' must be a boolean");
    }
    if (too_deep(t))
      return bad("tools", "'tools' is nested deeper than 32 levels");
    if (!t.empty())
      r.tools = t;
  }
  if (j.contains("tool_choice") && !j["tool_choice"].is_null()) {
    const auto& c = j["tool_choice"];
    if (r.tools.is_null())
      return bad("tool_choice", "'tool_choice' needs 'tools'");
    if (c.is_string() && (c == "auto" || c == "none" || c == "required")) {
      r.tool_choice = c.get<std::string>();
    } else if (c.is_object() && c.value("type", "") == "function" && c.contains("function") &&
               c["function"].is_object() && c["function"].contains("name") && c["function"]["name"].is_string()) {
      r.tool_choice = "named";
      r.tool_choice_name = c["function"]["name"].get<std::string>();
      const bool offered = std::any_of(r.tools.begin(), r.tools.end(), [&](const ojson& t) {
        return t["function"]["name"] == r.tool_choice_name;
      });
      if (!offered)
        return bad("tool_choice.function.name", "'tool_choice.function.name': \"" + r.tool_choice_name +
                                                  "\" is not one of the tools");
    } else {
      return bad("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                "\"function\": {\"name\": ...}}, not " + c.dump());
    }
  }
  if (j.contains("parallel_tool_calls") && !j["parallel_tool_calls"].is_null()) {
    if (!j["parallel_tool_calls"].is_boolean())
      return bad("parallel_tool_calls", std::string("'parallel_tool_calls' must be a boolean, not ") +
                                          type_name(j["parallel_tool_calls"]));
    r.parallel_tool_calls = j["parallel_tool_calls"].get<bool>();
  }
  // A forced call is decoded under its parameters' schema: one it cannot honour is a 400 now.
  if (r.tool_choice == "required" || r.tool_choice == "named")
    for (std::size_t k = 0; k < r.tools.size(); ++k) {
      const auto& f = r.tools[k]["function"];
      if (!f.contains("parameters") || f["parameters"].is_null())
        continue;
      const std::string p = "tools[" + std::to_string(k) + "].function.parameters";
      try {
        (void)model::json_schema_grammar(f["parameters"], p);
      } catch (const model::Error& e) {
        return bad(p, e.message());
      }
    }
  return std::nullopt;
}

// A boolean field: absent or null leaves `out` as it is.
std::optional<ApiError> boolean(const ojson& j, const char* name, bool& out) {
  if (!j.contains(name) || j[name].is_null())
    return std::nullopt;
  if (!j[name].is_boolean())
    return bad(name, std::string("'") + name + "' must be a boolean, not " + type_name(j[name]));
  out = j[name].get<bool>();
  return std::nullopt;
}

} // namespace

std::variant<ApiRequest, ApiError> parse_request(std::string_view body, bool chat) {
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded())
    return bad("", "the request body is not valid JSON");
  if (!j.is_object())
    return bad("", std::string("the request body must be a JSON object, not ") + type_name(j));
  ApiRequest r;
  r.chat = chat;
  if (j.contains("model") && !j["model"].is_null()) {
    if (!j["model"].is_string())
      return bad("model", std::string("'model' must be a string, not ") + type_name(j["model"]));
    r.model = j["model"].get<std::string>();
  }
  // Schemas and chat fields are read in the order the client wrote their keys:
  // templates print tool definitions and arguments as they come, and structured
  // output follows a schema's properties in its order.
  const ojson oj = parse_ordered(body);
  if (auto e = parse_response_format(oj, r))
    return *e;
  if (chat) {
    if (auto e = parse_messages(oj, r.messages))
      return *e;
    if (auto e = parse_tools(oj, r))
      return *e;
    if (auto e = boolean(oj, "add_generation_prompt", r.add_generation_prompt))
      return *e;
    if (auto e = boolean(oj, "continue_final_message", r.continue_final_message))
      return *e;
    if (r.continue_final_message && r.add_generation_prompt)
      return bad("continue_final_message", "'continue_final_message' continues the final message: it needs "
                                           "'add_generation_prompt': false");
    if (r.continue_final_message && r.messages.back().role != "assistant")
      return bad("continue_final_message", "'continue_final_message' needs the final message to be the assistant's");
    if (oj.contains("chat_template_kwargs") && !oj["chat_template_kwargs"].is_null()) {
      const auto& kw = oj["chat_template_kwargs"];
      if (!kw.is_object())
        return bad("chat_template_kwargs", "'chat_template_kwargs' must be an object");
      for (auto& [k, v] : kw.items())
        if (k == "messages" || k == "add_generation_prompt" || k == "bos_token" || k == "eos_token" ||
            (k == "tools" && !r.tools.is_null()))
          return bad("chat_template_kwargs", "'chat_template_kwargs' cannot set '" + k + "'");
      // The template engine walks values recursively: nesting is bounded.
      if (too_deep(kw))
        return bad("chat_template_kwargs", "'chat_template_kwargs' is nested deeper than 32 levels");
      r.template_kwargs = kw;
    }
  } else {
    for (const char* field : {"tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
                              "continue_final_message"})
      if (j.contains(field) && !j[field].is_null())
        return bad(field, std::string("'") + field + "' is a chat field: /v1/completions takes the prompt as it is");
    if (!j.contains("prompt"))
      return bad("prompt", "'prompt' is required");
    const auto& p = j["prompt"];
    if (p.is_string()) {
      r.prompt = p.get<std::string>();
    } else if (p.is_array() && !p.empty() && std::all_of(p.begin(), p.end(), [](auto& x) { return x.is_number_integer(); })) {
      r.prompt_is_ids = true;
      for (auto& x : p) {
        const auto id = x.get<int64_t>();
        if (id < 0 || id > INT32_MAX)
          return bad("prompt", "'prompt' token id " + std::to_string(id) + " is out of range");
        r.prompt_ids.push_back(static_cast<int32_t>(id));
      }
    } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
      r.prompt = p[0].get<std::string>();
    } else if (p.is_array()) {
      return bad("prompt", "'prompt' must be a string, one string in an array, or an array of token ids; several "
                           "prompts in one request are not supported");
    } else {
      return bad("prompt", std::string("'prompt' must be a string, not ") + type_name(p));
    }
    if (!r.prompt_is_ids && r.prompt.empty())
      return bad("prompt", "'prompt' is empty");
  }
  for (const char* name : {"max_tokens", "max_completion_tokens"})
    if (j.contains(name) && !j[name].is_null()) {
      int64_t v = 0;
      if (auto e = integer(j, name, v, 0, int64_t{1} << 31))
        return *e;
      r.max_tokens = v;
    }
  // echo (completions): the prompt comes back before the completion, with its
  // log-probabilities under logprobs (what log-likelihood evaluation reads).
  if (j.contains("echo") && !j["echo"].is_null()) {
    if (!j["echo"].is_boolean())
      return bad("echo", std::string("'echo' must be a boolean, not ") + type_name(j["echo"]));
    r.echo = j["echo"].get<bool>();
    if (r.echo && chat)
      return bad("echo", "'echo' is a completions field: chat replies do not repeat the conversation");
  }
  if (r.max_tokens && *r.max_tokens == 0 && !r.echo)
    return bad("max_tokens", "'max_tokens' must be at least 1 (0 only with 'echo': the prompt scored alone)");
  if (auto e = number(j, "temperature", r.temperature, 0.0, 2.0, false))
    return *e;
  if (auto e = number(j, "top_p", r.top_p, 0.0, 1.0, true))
    return *e;
  if (auto e = number(j, "min_p", r.min_p, 0.0, 1.0, false))
    return *e;
  if (j.contains("top_k") && !j["top_k"].is_null()) {
    int64_t v = 0;
    if (auto e = integer(j, "top_k", v, 0, 1 << 20))
      return *e;
    r.top_k = static_cast<int32_t>(v);
  }
  if (j.contains("seed") && !j["seed"].is_null()) {
    const auto& v = j["seed"];
    if (!v.is_number_integer())
      return bad("seed", std::string("'seed' must be an integer, not ") + type_name(v));
    r.seed = v.is_number_unsigned() ? v.get<uint64_t>() : static_cast<uint64_t>(v.get<int64_t>());
  }
  if (j.contains("stop") && !j["stop"].is_null()) {
    const auto& v = j["stop"];
    if (v.is_string()) {
      r.stop.push_back(v.get<std::string>());
    } else if (v.is_array() && v.size() <= 4 && std::all_of(v.begin(), v.end(), [](auto& x) { return x.is_string(); })) {
      for (auto& x : v)
        r.stop.push_back(x.get<std::string>());
    } else {
      return bad("stop", "'stop' must be a string or an array of at most 4 strings");
    }
    for (auto& s : r.stop)
      if (s.empty())
        return bad("stop", "'stop' strings must not be empty");
  }
  if (j.contains("stream") && !j["stream"].is_null()) {
    if (!j["stream"].is_boolean())
      return bad("stream", std::string("'stream' must be a boolean, not ") + type_name(j["stream"]));
    r.stream = j["stream"].get<bool>();
  }
  if (j.contains("stream_options") && !j["stream_options"].is_null()) {
    const auto& o = j["stream_options"];
    if (!o.is_object())
      return bad("stream_options", "'stream_options' must be an object");
    if (o.contains("include_usage")) {
      if (!o["include_usage"].is_boolean())
        return bad("stream_options.include_usage", "'stream_options.include_usage' must be a boolean");
      r.include_usage = o["include_usage"].get<bool>();
    }
  }
  if (j.contains("n") && !j["n"].is_null()) {
    int64_t v = 0;
    if (auto e = integer(j, "n", v, 1, 16))
      return *e;
    r.n = static_cast<int32_t>(v);
  }
  if (auto e = number(j, "presence_penalty", r.presence_penalty, -2.0, 2.0, false))
    return *e;
  if (auto e = number(j, "frequency_penalty", r.frequency_penalty, -2.0, 2.0, false))
    return *e;
  if (auto e = number(j, "repetition_penalty", r.repetition_penalty, 0.0, 10.0, true))
    return *e;
  // logprobs: completions take how many top tokens (0..20); chat takes
  // logprobs: true and top_logprobs (0..20).
  const bool has_lp = j.contains("logprobs") && !j["logprobs"].is_null();
  const bool has_top = j.contains("top_logprobs") && !j["top_logprobs"].is_null();
  if (chat) {
    if (has_lp && !j["logprobs"].is_boolean())
      return bad("logprobs", std::string("'logprobs' must be a boolean, not ") + type_name(j["logprobs"]));
    const bool want = has_lp && j["logprobs"].get<bool>();
    int64_t top = 0;
    if (has_top) {
      if (auto e = integer(j, "top_logprobs", top, 0, 20))
        return *e;
      if (!want && top > 0)
        return bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    }
    if (want)
      r.logprobs = static_cast<int32_t>(top);
  } else {
    if (has_top)
      return bad("top_logprobs", "'top_logprobs' is a chat field; completions take 'logprobs': N");
    if (has_lp) {
      int64_t top = 0;
      if (auto e = integer(j, "logprobs", top, 0, 20))
        return *e;
      r.logprobs = static_cast<int32_t>(top);
    }
  }
  if (auto e = unsupported(j))
    return *e;
  return r;
}

bool api_key_matches(const std::string& authorization, const std::string& key) {
  static const std::string scheme = "bearer";
  bool ok = authorization.size() > scheme.size() && authorization[scheme.size()] == ' ';
  for (std::size_t i = 0; ok && i < scheme.size(); ++i)
    ok = std::tolower(static_cast<unsigned char>(authorization[i])) == scheme[i];
  std::size_t at = scheme.size();
  while (at < authorization.size() && authorization[at] == ' ')
    ++at;
  const std::string token = ok ? authorization.substr(at) : std::string();
  // Constant time in the key's length: every byte is compared, no early exit.
  unsigned diff = token.size() == key.size() ? 0u : 1u;
  for (std::size_t i = 0; i < key.size(); ++i)
    diff |= static_cast<unsigned char>(key[i]) ^ static_cast<unsigned char>(i < token.size() ? token[i] : 0);
  return ok && !key.empty() && diff == 0;
}

std::string default_served_name(const std::string& identity) {
  if (identity.rfind("builtin:", 0) == 0)
    return identity;
  std::string p = identity;
  while (p.size() > 1 && p.back() == '/')
    p.pop_back();
  const auto slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

std::string chat_family(const model::ModelConfig& cfg) {
  if (cfg.identity.rfind("builtin:", 0) == 0)
    return "plain";
  return cfg.architecture == "qwen2" ? "chatml" : "llama2";
}

std::vector<int32_t> chat_stop_ids(const std::string& family, const model::Tokenizer& tok,
                                   const model::ModelConfig& cfg, const model::ChatTemplate* tpl) {
  std::vector<int32_t> ids = cfg.eos_ids;
  const auto add = [&](const std::string& text) {
    if (text.empty())
      return;
    const auto end = tok.encode(text, false);
    if (end.size() == 1 && (cfg.vocab_size <= 0 || end.front() < cfg.vocab_size) && std::find(ids.begin(), ids.end(), end.front()) == ids.end())
      ids.push_back(end.front());
  };
  if (family == "chatml")
    add("<|im_end|>");
  if (tpl)
    add(tpl->eos_token());
  return ids;
}

std::variant<ChatPrompt, ApiError> chat_prompt(const std::vector<ChatMessage>& messages, const model::ChatTemplate* tpl,
                                               const std::string& family, const model::Tokenizer& tok,
                                               const model::ModelConfig& cfg, const PromptOptions& options) {
  ChatPrompt p;
  std::optional<model::ContentGuard> guard;
  if (options.plain_content) {
    std::vector<std::string> extra;
    if (tpl)
      extra = {tpl->bos_token(), tpl->eos_token()};
    guard.emplace(tok, std::move(extra));
  }
  const auto tool_round = std::find_if(messages.begin(), messages.end(), [](const ChatMessage& m) {
    return m.role == "tool" || !m.tool_calls.is_null();
  });
  if (!tpl) {
    // The built-in formats have no way to write tools or tool turns.
    if (!options.tools.is_null())
      return bad("tools", "this model has no chat template: its built-in " + family + " format cannot express tools");
    if (tool_round != messages.end())
      return bad("messages[" + std::to_string(tool_round - messages.begin()) + "]",
                 "this model has no chat template: its built-in " + family + " format cannot express tool calls or "
                 "tool results");
    if (options.continue_final_message || (!options.add_generation_prompt && family == "llama2"))
      return bad(options.continue_final_message ? "continue_final_message" : "add_generation_prompt",
                 "this model has no chat template: its built-in " + family + " format always ends with the "
                 "assistant's turn to answer");
    p.ids = encode_chat(messages, family, tok, cfg, guard ? &*guard : nullptr, options.add_generation_prompt);
    p.text = tok.decode(p.ids);
    return p;
  }
  // What a template never mentions it cannot print: refused, not dropped.
  const auto& src = tpl->text();
  if (!options.tools.is_null() && src.find("tools") == std::string::npos)
    return bad("tools", "the model's chat template does not take tools (" + tpl->origin() + ")");
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const auto& m = messages[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.tool_calls.is_null() && src.find("tool_calls") == std::string::npos)
      return bad(at + ".tool_calls", "the model's chat template does not print tool calls (" + tpl->origin() + ")");
    if (m.role == "tool" && src.find("tool") == std::string::npos)
      return bad(at + ".role", "the model's chat template knows nothing of tools (" + tpl->origin() + ")");
  }
  // Every string a client wrote is marked (tool arguments and definitions too:
  // they are printed into the prompt like contents).
  const auto mark = [&](const ojson& v) {
    if (!guard)
      return v;
    ojson out = v;
    std::vector<ojson*> todo{&out};
    while (!todo.empty()) {
      ojson* x = todo.back();
      todo.pop_back();
      if (x->is_string()) {
        *x = guard->mark(x->get<std::string>());
      } else if (x->is_array()) {
        for (auto& e : *x)
          todo.push_back(&e);
      } else if (x->is_object()) {
        ojson o = ojson::object();
        for (auto& [k, e] : x->items())
          o[guard->mark(k)] = std::move(e);
        *x = std::move(o);
        for (auto& [k, e] : x->items())
          todo.push_back(&e);
      }
    }
    return out;
  };
  nlohmann::ordered_json msgs = nlohmann::ordered_json::array();
  for (auto& m : messages) {
    ojson o = {{"role", m.role}};
    // content null (a turn that only calls tools) reaches the template as "", as
    // vLLM passes it: shipped templates test it as a string (Qwen3's fails on None).
    o["content"] = guard ? guard->mark(m.content) : m.content;
    if (!m.name.empty())
      o["name"] = guard ? guard->mark(m.name) : m.name;
    if (!m.tool_calls.is_null())
      o["tool_calls"] = mark(m.tool_calls);
    if (!m.tool_call_id.empty())
      o["tool_call_id"] = guard ? guard->mark(m.tool_call_id) : m.tool_call_id;
    msgs.push_back(std::move(o));
  }
  ojson extra = options.kwargs;
  if (!options.tools.is_null())
    extra["tools"] = mark(options.tools);
  std::vector<std::size_t> plain_at;
  try {
    p.text = tpl->render(msgs, options.add_generation_prompt, extra, options.limits);
    if (options.continue_final_message) {
      // As transformers does: the prompt ends where the final message's content
      // (without surrounding space) ends, so the model writes on from there.
      auto last = msgs.back()["content"].is_string() ? msgs.back()["content"].get<std::string>() : std::string();
      const auto b = last.find_first_not_of(" \t\n\r"), e = last.find_last_not_of(" \t\n\r");
      last = b == std::string::npos ? std::string() : last.substr(b, e - b + 1);
      const auto at = last.empty() ? std::string::npos : p.text.rfind(last);
      if (at == std::string::npos)
        return bad("continue_final_message", "the model's chat template does not print the final message's content as "
                                             "it was given, so it cannot be continued");
      p.text.resize(at + last.size());
    }
    if (guard) {
      auto stripped = guard->strip(p.text);
      p.text = std::move(stripped.text);
      plain_at = std::move(stripped.plain_at);
    }
  } catch (const model::jinja::TemplateError& e) {
    using L = model::jinja::TemplateError::Limit;
    if (e.limit() == L::time) {
      ApiError t;
      t.status = 504;
      t.type = "server_error";
      t.code = "timeout";
      t.message = "the request timed out while the chat template was rendered (" + std::string(e.what()) + ")";
      return t;
    }
    if (e.limit() == L::cancelled) {
      ApiError c;
      c.status = 499;
      c.code = "cancelled";
      c.message = "the request ended while the chat template was rendered";
      return c;
    }
    if (e.limit() != L::none)
      return bad("messages", std::string("the model's chat template reached its ") + model::jinja::to_string(e.limit()) +
                               " limit on this conversation: " + e.what(), "chat_template_limit");
    return bad("messages", std::string("the model's chat template ") +
                             (e.raised() ? "refuses this conversation: " + e.message() : "failed on it: " + e.message()));
  }
  p.ids = tpl->encode(p.text, tok, cfg, plain_at);
  return p;
}

std::vector<int32_t> encode_chat(const std::vector<ChatMessage>& messages, const std::string& family,
                                 const model::Tokenizer& tok, const model::ModelConfig& cfg,
                                 const model::ContentGuard* guard, bool add_generation_prompt) {
  const bool bos = cfg.bos_id >= 0 && tok.bos_id() == cfg.bos_id;
  // A message's content as it goes into the prompt text, and the prompt's ids.
  const auto content = [&](const ChatMessage& m) { return guard ? guard->mark(m.content) : m.content; };
  const auto encode = [&](const std::string& text, bool with_bos) {
    if (!guard)
      return tok.encode(text, with_bos);
    const auto s = guard->strip(text);
    return tok.encode_with(s.text, with_bos, {true, s.plain_at});
  };
  if (family == "chatml") {
    std::string text;
    for (auto& m : messages)
      text += "<|im_start|>" + m.role + "\n" + content(m) + "<|im_end|>\n";
    if (add_generation_prompt)
      text += "<|im_start|>assistant\n";
    return encode(text, bos);
  }
  if (family == "llama2") {
    // <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {answer} </s><s>[INST] {user} [/INST]
    std::vector<int32_t> ids;
    std::string system, pending;
    const int32_t eos = cfg.eos_ids.empty() ? 2 : cfg.eos_ids.front();
    for (auto& m : messages) {
      if (m.role == "system") {
        system += (system.empty() ? "" : "\n") + content(m);
      } else if (m.role == "user") {
        std::string u = content(m);
        if (!system.empty()) {
          u = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + u;
          system.clear();
        }
        pending = "[INST] " + u + " [/INST]";
      } else { // assistant: closes the turn
        auto part = encode(pending + " " + content(m) + " ", bos);
        ids.insert(ids.end(), part.begin(), part.end());
        ids.push_back(eos);
        pending.clear();
      }
    }
    if (pending.empty())
      pending = "[INST] " + (system.empty() ? std::string() : "<<SYS>>\n" + system + "\n<</SYS>>\n\n") + " [/INST]";
    auto part = encode(pending, bos);
    ids.insert(ids.end(), part.begin(), part.end());
    return ids;
  }
  std::string text; // plain: the contents, one per line
  for (std::size_t i = 0; i < messages.size(); ++i)
    text += (i ? "\n" : "") + content(messages[i]);
  return encode(text, bos);
}

std::optional<ApiError> check_context(int64_t prompt_tokens, int64_t max_tokens, int64_t context) {
  if (prompt_tokens + max_tokens <= context)
    return std::nullopt;
  return bad("max_tokens",
             "This model's maximum context length is " + std::to_string(context) + " tokens. However, you requested " +
               std::to_string(prompt_tokens + max_tokens) + " tokens (" + std::to_string(prompt_tokens) +
               " in the prompt, " + std::to_string(max_tokens) + " for the completion). Please reduce the prompt or " +
               "max_tokens.",
             "context_length_exceeded");
}

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}

std::string StopMatcher::push(std::string_view piece) {
  if (stopped_)
    return {};
  held_.append(piece);
  // The earliest complete stop string ends the text.
  std::size_t cut = std::string::npos;
  for (auto& s : stops_)
    if (auto at = held_.find(s); at != std::string::npos)
      cut = std::min(cut, at);
  if (cut != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, cut);
    held_.clear();
    return out;
  }
  // Hold back the longest tail that is a proper prefix of some stop string.
  std::size_t keep = 0;
  for (auto& s : stops_)
    for (std::size_t n = std::min(s.size() - 1, held_.size()); n > keep; --n)
      if (held_.compare(held_.size() - n, n, s, 0, n) == 0) {
        keep = n;
        break;
      }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::flush() {
  std::string out;
  if (!stopped_)
    out.swap(held_);
  return out;
}

std::string make_id(const std::string& prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* hex = "0123456789abcdef";
  std::string id = prefix;
  for (int i = 0; i < 24; ++i)
    id += hex[rng() % 16];
  return id;
}

} // namespace strata::server
