#pragma once
// tool_choice "required" and a named function, enforced: the grammar
// (model/text/grammar.hpp) of a reply that is nothing but calls, in the syntax
// the model's template writes them (tool_calls.hpp reads them back), each
// call's arguments under its tool's `parameters` schema.

#include "server/tool_calls.hpp"

#include <nlohmann/json.hpp>

#include <string>

namespace strata::server {

/// `tools`: the request's tools (validated); `only`: the one tool a named
/// choice forces ("" for required: any of them); `parallel`: several calls may
/// follow each other. Throws model::Error(bad_argument) for a parameters
/// schema the grammar cannot honour (naming tools[k].function.parameters).
std::string tool_call_grammar(ToolSyntax syntax, const nlohmann::ordered_json& tools, const std::string& only,
                              bool parallel);

} // namespace strata::server
