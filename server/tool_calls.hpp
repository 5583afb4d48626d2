#pragma once
// A reply's tool calls, read out of the text the model writes, in the syntax its
// chat template taught it: Hermes / Qwen2.5 / Qwen3 (<tool_call>{...}</tool_call>),
// Llama 3.1-3.3 (a JSON object {"name", "parameters"}, optionally after
// <|python_tag|>), Mistral ([TOOL_CALLS][{...}, ...]). What is not a well-formed
// call of an offered tool stays text, exactly as the model wrote it.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace strata::server {

enum class ToolSyntax { hermes, llama3, mistral };

/// The syntax a chat template writes calls in (what its own tool-call markup
/// shows); Hermes tags for a template that shows none of them.
ToolSyntax tool_syntax_of(std::string_view template_text);
const char* to_string(ToolSyntax s);

struct ToolCallOut {
  std::string id;        ///< call_... (Mistral: 9 letters and digits, as its template demands)
  std::string name;
  std::string arguments; ///< a JSON object, as OpenAI returns it: a string
};

/// Splits a reply, piece by piece as it streams, into content and calls.
/// Content that may still turn out to start a call is held back until it is
/// known; everything else goes out at once. The pieces' content, concatenated,
/// equals the reply without its calls whatever the pieces were.
class ToolCallParser {
public:
  /// `names`: the tools offered; a call of another name stays text.
  ToolCallParser(ToolSyntax syntax, std::vector<std::string> names);
  struct Out {
    std::string content;
    std::vector<ToolCallOut> calls;
  };
  Out push(std::string_view piece);
  /// The end of the reply: what is held back is decided (an unfinished call is text).
  Out finish();
  /// Calls found so far.
  std::size_t calls() const { return made_; }

private:
  void scan(Out& out, bool end);
  bool opens(std::string_view tag, Out& out, bool end); // content up to `tag`; true once it is found
  bool take_call(std::string_view json, Out& out);
  bool take_calls(std::string_view json, Out& out); // an array, or objects separated by ';'
  std::string new_id();

  ToolSyntax syntax_;
  std::vector<std::string> names_;
  std::string held_;       // text not yet decided
  bool in_call_ = false;   // hermes: inside <tool_call>; mistral: after [TOOL_CALLS]; llama3: a JSON reply
  bool started_ = false;   // llama3: the reply's first non-space text was seen
  std::size_t made_ = 0;
  uint64_t rng_;
};

} // namespace strata::server
