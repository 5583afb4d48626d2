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
#include <string>
#include <vector>

namespace strata::model {

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
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                     const nlohmann::json& extra = nlohmann::json::object()) const;
  /// Token ids of a rendered prompt: the BOS / EOS token texts become their ids
  /// (a tokenizer that does not match them whole still gets them right), the
  /// rest is encoded without adding BOS.
  std::vector<int32_t> encode(const std::string& rendered, const Tokenizer& tok, const ModelConfig& cfg) const;

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
