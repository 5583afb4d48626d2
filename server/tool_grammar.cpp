#include "server/tool_grammar.hpp"

#include "model/text/json_schema.hpp"

namespace strata::server {

std::string tool_call_grammar(ToolSyntax syntax, const nlohmann::ordered_json& tools, const std::string& only,
                              bool parallel) {
  model::JsonGrammar g;
  const std::string w = g.ws();
  // One call's JSON object: {"name": "<tool>", "arguments"|"parameters": <its parameters>}.
  const char* args_key = syntax == ToolSyntax::llama3 ? "parameters" : "arguments";
  std::string calls;
  for (std::size_t k = 0; k < tools.size(); ++k) {
    const auto& f = tools[k]["function"];
    const auto name = f["name"].get<std::string>();
    if (!only.empty() && name != only)
      continue;
    const std::string args = f.contains("parameters") && !f["parameters"].is_null()
                               ? g.value(f["parameters"], "tools[" + std::to_string(k) + "].function.parameters")
                               : g.any_object();
    const std::string call = "\"{\" " + w + " " + model::JsonGrammar::literal("\"name\"") + " " + w + " \":\" " + w +
                             " " + model::JsonGrammar::literal(nlohmann::json(name).dump()) + " " + w + " \",\" " + w +
                             " " + model::JsonGrammar::literal(std::string("\"") + args_key + "\"") + " " + w +
                             " \":\" " + w + " " + args + " " + w + " \"}\"";
    calls += (calls.empty() ? "" : " | ") + call;
  }
  const std::string one = g.rule("call", calls);
  std::string root;
  switch (syntax) {
    case ToolSyntax::hermes: {
      const std::string tagged = g.rule("tagged", "\"<tool_call>\\n\" " + one + " \"\\n</tool_call>\"");
      root = tagged + (parallel ? " ( \"\\n\" " + tagged + " )*" : "");
      break;
    }
    case ToolSyntax::llama3: root = one + (parallel ? " ( \"; \" " + one + " )*" : ""); break;
    case ToolSyntax::mistral:
      root = "\"[TOOL_CALLS][\" " + one + (parallel ? " ( \", \" " + one + " )*" : "") + " \"]\"";
      break;
  }
  return g.grammar(root);
}

} // namespace strata::server
