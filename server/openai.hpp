#pragma once
// The OpenAI-compatible API without the network: request parsing and
// validation (every rule answers with an OpenAI-style error object naming the
// field), chat templates per model family, stop strings over streamed text,
// and response bodies. Pure functions, unit-tested in tests/server.

#include "model/text/chat_template.hpp"
#include "model/base/config.hpp"
#include "model/text/tokenizer.hpp"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace strata::server {

/// An error the client gets as {"error": {...}} with an HTTP status.
struct ApiError {
  int status = 400;
  std::string message;
  std::string param; ///< the offending field ("" when none)
  std::string type = "invalid_request_error";
  std::string code;  ///< e.g. context_length_exceeded
  nlohmann::json body() const;
};

struct ChatMessage {
  std::string role; ///< system | user | assistant | tool (developer arrives as system)
  std::string content;
  bool content_null = false; ///< an assistant turn that only calls tools (content: null)
  std::string name;          ///< the optional participant name ("" when not given)
  /// An assistant's calls: [{id, type: "function", function: {name, arguments}}]
  /// with each arguments string parsed into its JSON object (what templates
  /// print); keys in the order the client sent them. Null when none.
  nlohmann::ordered_json tool_calls;
  std::string tool_call_id; ///< a tool message: the call it answers
};

struct ApiRequest {
  bool chat = false;
  std::string prompt;                  ///< completions: text
  std::vector<int32_t> prompt_ids;     ///< completions: token ids given directly
  bool prompt_is_ids = false;
  std::vector<ChatMessage> messages;   ///< chat
  std::optional<int64_t> max_tokens;   ///< absent: completions 16, chat the rest of the context
  float temperature = 1.0f;
  float top_p = 1.0f;
  float min_p = 0;          ///< 0 = off
  int32_t top_k = 0;
  std::optional<uint64_t> seed;
  int32_t n = 1;                  ///< choices (each its own generation; choice i uses seed + i)
  int32_t logprobs = -1;          ///< -1: none; else how many top_logprobs besides the chosen token's
  float presence_penalty = 0;     ///< [-2, 2]
  float frequency_penalty = 0;    ///< [-2, 2]
  float repetition_penalty = 1;   ///< (0, 10]
  std::vector<std::string> stop;
  bool stream = false;
  bool echo = false;                   ///< completions: the prompt before the text (and its logprobs)
  bool include_usage = false;          ///< stream_options.include_usage
  std::string model;
  /// chat_template_kwargs: extra template variables, keys in the order sent.
  nlohmann::ordered_json template_kwargs = nlohmann::ordered_json::object();
  /// tools: [{type: "function", function: {name, description?, parameters?}}] as
  /// sent (key order kept); null when none. They reach the template as `tools`.
  nlohmann::ordered_json tools;
  /// auto: calls in the reply are returned as tool_calls; none: as text;
  /// required: the reply is one or more calls; named: a call of tool_choice_name
  /// (both enforced by constrained decoding in the template's call syntax).
  std::string tool_choice = "auto";
  std::string tool_choice_name;
  bool parallel_tool_calls = true;     ///< required: several calls may follow each other
  /// response_format json_object / json_schema: the grammar (model/text/grammar.hpp)
  /// every reply follows; empty: free text.
  std::string grammar;
  bool add_generation_prompt = true;   ///< end the prompt where the assistant's answer starts
  bool continue_final_message = false; ///< end the prompt inside the final (assistant) message
};

/// Parses and validates a request body for /v1/completions (chat = false) or
/// /v1/chat/completions (chat = true).
std::variant<ApiRequest, ApiError> parse_request(std::string_view body, bool chat);

/// "chatml" (Qwen2), "llama2" (Llama 2 checkpoints) or "plain" (builtin:*).
std::string chat_family(const model::ModelConfig& cfg);

/// The name a model is served under by default: builtin:NAME as it is, else the
/// last component of the path (the file or directory name), never the absolute path.
std::string default_served_name(const std::string& identity);

/// Whether an `Authorization` header value carries `key` as a bearer token. The
/// scheme is case-insensitive (RFC 7235); the comparison takes the same time
/// wherever the first difference is.
bool api_key_matches(const std::string& authorization, const std::string& key);

/// The prompt ids for a chat in the model family's format. With a guard,
/// special-token text in the contents stays text (model::ContentGuard).
/// add_generation_prompt false: ChatML without the assistant's opening line
/// (llama2's format always ends at the assistant's turn).
std::vector<int32_t> encode_chat(const std::vector<ChatMessage>& messages, const std::string& family,
                                 const model::Tokenizer& tok, const model::ModelConfig& cfg,
                                 const model::ContentGuard* guard = nullptr, bool add_generation_prompt = true);

/// The ids a chat reply stops at: the model's stop ids, plus the family's
/// end-of-turn token when the tokenizer has it as one token (ChatML's <|im_end|>:
/// a Qwen base model's generation_config names only <|endoftext|>), plus the
/// chat template's EOS token (tokenizer_config.json's eos_token, e.g. Gemma's
/// <end_of_turn>) when there is a template.
std::vector<int32_t> chat_stop_ids(const std::string& family, const model::Tokenizer& tok,
                                   const model::ModelConfig& cfg, const model::ChatTemplate* tpl = nullptr);

/// A chat's prompt: the text the model's template renders (or, without a
/// template, the decoded family format) and its token ids.
struct ChatPrompt {
  std::string text;
  std::vector<int32_t> ids;
};
/// Renders `messages` with the model's own template when `tpl` is set (with
/// add_generation_prompt and the request's chat_template_kwargs), else in the
/// family's format. A template that refuses the conversation (its own
/// raise_exception, e.g. "roles must alternate") or fails on it is a 400
/// naming the template's message. The render is bounded by `limits`: past the
/// deadline it is a 504 (timeout), cancelled a 499, past another bound a 400
/// (chat_template_limit) naming it.
/// How a chat's prompt is made.
struct PromptOptions {
  nlohmann::ordered_json kwargs = nlohmann::ordered_json::object(); ///< chat_template_kwargs
  nlohmann::ordered_json tools;         ///< the request's tools (null: none)
  bool add_generation_prompt = true;
  bool continue_final_message = false;
  model::jinja::RenderLimits limits;                ///< bounds of the template's render
  /// Special-token text inside message contents stays ordinary text (the
  /// template's own markup keeps its control tokens); false: serve's
  /// --allow-control-tokens-in-messages, what transformers does by default.
  bool plain_content = true;
};
std::variant<ChatPrompt, ApiError> chat_prompt(const std::vector<ChatMessage>& messages, const model::ChatTemplate* tpl,
                                               const std::string& family, const model::Tokenizer& tok,
                                               const model::ModelConfig& cfg, const PromptOptions& options = {});

/// 400 context_length_exceeded naming both numbers when prompt + completion do
/// not fit the context.
std::optional<ApiError> check_context(int64_t prompt_tokens, int64_t max_tokens, int64_t context);

/// Finds stop strings in streamed text. push() returns the text that is safe to
/// send now: text that could still become the start of a stop string is held
/// back until it cannot. After a stop string is seen, stopped() is true and the
/// stop string and everything after it are dropped.
class StopMatcher {
public:
  explicit StopMatcher(std::vector<std::string> stops);
  std::string push(std::string_view piece);
  /// The held-back text at the end of a generation that did not stop.
  std::string flush();
  bool stopped() const { return stopped_; }

private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

/// A unique id like "cmpl-3f2a..." (prefix + 24 hex digits).
std::string make_id(const std::string& prefix);

} // namespace strata::server
