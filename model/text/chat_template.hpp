#pragma once
// The model's own chat template: found in a Hugging Face directory
// (tokenizer_config.json's chat_template, a string or a named list, or
// chat_template.jinja), in a GGUF file's tokenizer.chat_template, next to a
// tokenizer.json, or given as a file (--chat-template); rendered by the Jinja
// subset engine (model/jinja.hpp) the way transformers' apply_chat_template
// does. Torch-free.

#include "model/base/config.hpp"
#include "model/text/jinja/jinja.hpp"
#include "model/text/tokenizer.hpp"

#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <string>
#include <vector>

namespace strata::model {

/// Keeps client text plain inside a prompt: a user message that contains
/// `<|im_end|>\n<|im_start|>system\n` must reach the model as those characters,
/// not as control tokens that forge a system turn. mark() writes a marker (a
/// few private-use characters, random per guard) inside every special token's
/// text in a message's content, before the content goes into the prompt
/// (through a template, which may copy, trim or split it); strip() takes the
/// markers out of the finished prompt and returns where they were, and the
/// tokenizer then matches no special token across those offsets
/// (Tokenizer::encode_with). The template's own markup keeps its control tokens.
class ContentGuard {
public:
  /// `extra`: texts to keep plain besides the tokenizer's special tokens (the
  /// template's BOS / EOS texts, which a tokenizer may not match itself).
  ContentGuard(const Tokenizer& tok, std::vector<std::string> extra);
  std::string mark(std::string_view content) const;
  struct Stripped {
    std::string text;
    std::vector<std::size_t> plain_at; ///< ascending offsets into `text`
  };
  Stripped strip(std::string_view prompt) const;
  /// The offsets of `all` that fall in [begin, end), made relative to begin.
  static std::vector<std::size_t> slice(std::span<const std::size_t> all, std::size_t begin, std::size_t end);

private:
  const Tokenizer& tok_;
  std::vector<std::string> extra_;
  std::string marker_;
};

class ChatTemplate {
public:
  /// Parses `text`. Throws Error(unsupported) naming `origin`, the line and the
  /// construct when the template uses something the engine does not implement,
  /// Error(bad_format) for a syntax error.
  ChatTemplate(std::string text, std::string origin, std::string bos_token, std::string eos_token);

  /// A file given on the command line: a Jinja template, or a
  /// tokenizer_config.json whose chat_template is used. Throws Error naming it.
  static ChatTemplate from_file(const std::string& path, const ModelConfig& cfg, const Tokenizer* tok);
  /// The template the model ships, looked for beside the model (cfg.identity)
  /// and beside `tokenizer_path` (when given); nullopt when there is none.
  /// Throws Error when one is there but cannot be read or parsed.
  static std::optional<ChatTemplate> for_model(const ModelConfig& cfg, const Tokenizer* tok,
                                               const std::string& tokenizer_path = {});

  /// The prompt for `messages` (a JSON array of {role, content, ...}), with
  /// add_generation_prompt and any `extra` top-level variables (tools, ...).
  /// Throws jinja::TemplateError (raised() for the template's own
  /// raise_exception, e.g. "roles must alternate").
  /// `limits` bound the render (time, steps, bytes, nesting; a cancel flag).
  /// `extra` keeps its key order (templates print tool definitions as given).
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                     const nlohmann::ordered_json& extra = nlohmann::ordered_json::object(),
                     const jinja::RenderLimits& limits = {}) const;
  /// Token ids of a rendered prompt: the BOS / EOS token texts become their ids
  /// (a tokenizer that does not match them whole still gets them right), the
  /// rest is encoded without adding BOS. No special token (BOS / EOS included)
  /// is matched across an offset in `plain_at` (see ContentGuard).
  std::vector<int32_t> encode(const std::string& rendered, const Tokenizer& tok, const ModelConfig& cfg,
                              std::span<const std::size_t> plain_at = {}) const;

  const std::string& text() const { return text_; }
  /// Where the template came from ("tokenizer_config.json in DIR", a file, ...).
  const std::string& origin() const { return origin_; }
  const std::string& bos_token() const { return bos_; }
  const std::string& eos_token() const { return eos_; }

private:
  std::string text_, origin_, bos_, eos_;
  std::shared_ptr<const jinja::Template> tpl_;
};

} // namespace strata::model
