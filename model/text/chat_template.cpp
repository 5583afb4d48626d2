#include "model/text/chat_template.hpp"

#include "model/base/error.hpp"
#include "model/formats/gguf.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

namespace strata::model {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

// ---------------------------------------------------------------- ContentGuard

ContentGuard::ContentGuard(const Tokenizer& tok, std::vector<std::string> extra) : tok_(tok), extra_(std::move(extra)) {
  // Four code points of the supplementary private-use area A (U+F0000..U+FFFFD),
  // 64 random bits: no client can guess it, no template or tokenizer treats it
  // specially, and it is taken out before anything is encoded.
  std::random_device rd;
  for (int k = 0; k < 4; ++k) {
    const uint32_t cp = 0xF0000u + (rd() & 0xFFFFu) % 0xFFFEu;
    marker_ += static_cast<char>(0xF0 | (cp >> 18));
    marker_ += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    marker_ += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    marker_ += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string ContentGuard::mark(std::string_view content) const {
  // Where a special token's text begins: the tokenizer's own matches, and every
  // occurrence of the extra texts.
  std::vector<std::size_t> starts;
  for (auto [at, len] : tok_.find_special(content))
    starts.push_back(at);
  for (auto& t : extra_)
    if (!t.empty())
      for (auto f = content.find(t); f != std::string_view::npos; f = content.find(t, f + 1))
        starts.push_back(f);
  if (starts.empty())
    return std::string(content);
  std::sort(starts.begin(), starts.end());
  starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
  std::string out;
  out.reserve(content.size() + starts.size() * marker_.size());
  std::size_t pos = 0;
  for (std::size_t at : starts) {
    // The marker goes after the text's first character (whole, so the content
    // stays valid UTF-8 for the template and the normalizer).
    std::size_t cut = at + 1;
    while (cut < content.size() && (static_cast<unsigned char>(content[cut]) & 0xC0) == 0x80)
      ++cut;
    if (cut < pos)
      continue;
    out.append(content.substr(pos, cut - pos));
    out += marker_;
    pos = cut;
  }
  out.append(content.substr(pos));
  return out;
}

ContentGuard::Stripped ContentGuard::strip(std::string_view prompt) const {
  Stripped s;
  s.text.reserve(prompt.size());
  std::size_t pos = 0;
  for (auto f = prompt.find(marker_); f != std::string_view::npos; f = prompt.find(marker_, pos)) {
    s.text.append(prompt.substr(pos, f - pos));
    if (s.plain_at.empty() || s.plain_at.back() != s.text.size())
      s.plain_at.push_back(s.text.size());
    pos = f + marker_.size();
  }
  s.text.append(prompt.substr(pos));
  return s;
}

std::vector<std::size_t> ContentGuard::slice(std::span<const std::size_t> all, std::size_t begin, std::size_t end) {
  std::vector<std::size_t> out;
  for (auto it = std::lower_bound(all.begin(), all.end(), begin); it != all.end() && *it < end; ++it)
    out.push_back(*it - begin);
  return out;
}

namespace {

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in)
    throw Error(errc::io, "cannot open '" + p.string() + "'");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// bos_token / eos_token in tokenizer_config.json: a string, {"content": ...} or null.
std::string token_text(const ojson& cfg, const char* key) {
  if (!cfg.contains(key))
    return {};
  const auto& v = cfg[key];
  if (v.is_string())
    return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  return {};
}

// chat_template: a string, or a list of {name, template} (the "default" one).
std::optional<std::string> template_in(const ojson& cfg, const std::string& where) {
  if (!cfg.is_object() || !cfg.contains("chat_template") || cfg["chat_template"].is_null())
    return std::nullopt;
  const auto& t = cfg["chat_template"];
  if (t.is_string())
    return t.get<std::string>();
  if (t.is_array()) {
    for (auto& e : t)
      if (e.is_object() && e.value("name", "") == "default" && e.contains("template") && e["template"].is_string())
        return e["template"].get<std::string>();
    throw Error(errc::bad_format, where + ": chat_template is a list without a template named 'default'");
  }
  throw Error(errc::bad_format, where + ": chat_template is neither a string nor a list of {name, template}");
}

std::string trimmed(std::string s) {
  const auto a = s.find_first_not_of(" \n\t\r");
  const auto b = s.find_last_not_of(" \n\t\r");
  return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

// What the tokenizer calls token `id` (for the BOS / EOS texts when no config names them).
std::string token_name(const Tokenizer* tok, int32_t id) {
  if (!tok || id < 0 || id >= tok->vocab_size())
    return {};
  try {
    return trimmed(tok->token_bytes(id, -1));
  } catch (const Error&) {
    return {};
  }
}

// A tokenizer_config.json, or an empty object when the file is not there.
// Throws Error(bad_format) naming it when it is not JSON.
ojson read_config(const fs::path& file) {
  std::error_code ec;
  if (!fs::is_regular_file(file, ec))
    return ojson::object();
  try {
    return ojson::parse(read_text(file));
  } catch (const ojson::exception& e) {
    throw Error(errc::bad_format, "'" + file.string() + "' is not valid JSON: " + e.what());
  }
}

// The BOS / EOS texts a template gets: the config's, else the tokenizer's names
// for the model's ids.
std::pair<std::string, std::string> token_texts(const ojson& config, const ModelConfig& cfg, const Tokenizer* tok) {
  std::string bos = token_text(config, "bos_token"), eos = token_text(config, "eos_token");
  if (bos.empty())
    bos = token_name(tok, cfg.bos_id);
  if (eos.empty() && !cfg.eos_ids.empty())
    eos = token_name(tok, cfg.eos_ids.front());
  return {bos, eos};
}

std::optional<ChatTemplate> from_dir(const fs::path& dir, const ModelConfig& cfg, const Tokenizer* tok) {
  std::error_code ec;
  const fs::path jinja_file = dir / "chat_template.jinja";
  const fs::path config_file = dir / "tokenizer_config.json";
  const ojson config = read_config(config_file);
  const auto [bos, eos] = token_texts(config, cfg, tok);
  if (fs::is_regular_file(jinja_file, ec))
    return ChatTemplate(read_text(jinja_file), "'" + jinja_file.string() + "'", bos, eos);
  if (auto t = template_in(config, "'" + config_file.string() + "'"))
    return ChatTemplate(*t, "the chat_template of '" + config_file.string() + "'", bos, eos);
  return std::nullopt;
}

std::optional<ChatTemplate> from_gguf(const std::string& path, const ModelConfig& cfg, const Tokenizer* tok) {
  GgufFile f(path);
  const auto t = f.opt_string("tokenizer.chat_template");
  if (!t)
    return std::nullopt;
  ojson names = ojson::object(); // the GGUF's own token texts, as a config would name them
  if (const auto* tokens = f.opt_strings("tokenizer.ggml.tokens")) {
    const auto name = [&](std::optional<int64_t> id) {
      return id && *id >= 0 && *id < static_cast<int64_t>(tokens->size()) ? (*tokens)[static_cast<std::size_t>(*id)]
                                                                         : std::string();
    };
    names["bos_token"] = name(f.opt_int("tokenizer.ggml.bos_token_id"));
    names["eos_token"] = name(f.opt_int("tokenizer.ggml.eos_token_id"));
  }
  const auto [bos, eos] = token_texts(names, cfg, tok);
  return ChatTemplate(*t, "the tokenizer.chat_template of '" + path + "'", bos, eos);
}

bool is_gguf(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::string(magic, 4) == "GGUF";
}

} // namespace

ChatTemplate::ChatTemplate(std::string text, std::string origin, std::string bos_token, std::string eos_token)
    : text_(std::move(text)), origin_(std::move(origin)), bos_(std::move(bos_token)), eos_(std::move(eos_token)) {
  try {
    tpl_ = std::make_shared<const jinja::Template>(jinja::Template::parse(text_));
  } catch (const jinja::TemplateError& e) {
    throw Error(e.unsupported() ? errc::unsupported : errc::bad_format, origin_ + ": " + e.what());
  }
}

ChatTemplate ChatTemplate::from_file(const std::string& path, const ModelConfig& cfg, const Tokenizer* tok) {
  const std::string text = read_text(path);
  const std::string where = "'" + path + "'";
  // A tokenizer_config.json (or any JSON object with chat_template) is accepted too.
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && text[first] == '{') {
    ojson config;
    try {
      config = ojson::parse(text);
    } catch (const ojson::exception&) {
      config = nullptr; // a template that starts with '{': not JSON
    }
    if (config.is_object()) {
      auto t = template_in(config, where);
      if (!t)
        throw Error(errc::bad_format, where + " is a JSON object without a chat_template");
      const auto [bos, eos] = token_texts(config, cfg, tok);
      return ChatTemplate(*t, "the chat_template of " + where, bos, eos);
    }
  }
  // A bare template: the BOS / EOS texts come from the model directory's
  // tokenizer_config.json when there is one (an unreadable one is passed over:
  // the file given is what counts), else from the tokenizer.
  ojson config = ojson::object();
  std::error_code ec;
  if (fs::is_directory(cfg.identity, ec)) {
    try {
      config = read_config(fs::path(cfg.identity) / "tokenizer_config.json");
    } catch (const Error&) {
    }
  }
  const auto [bos, eos] = token_texts(config, cfg, tok);
  return ChatTemplate(text, where, bos, eos);
}

std::optional<ChatTemplate> ChatTemplate::for_model(const ModelConfig& cfg, const Tokenizer* tok,
                                                    const std::string& tokenizer_path) {
  std::error_code ec;
  if (cfg.identity.rfind("builtin:", 0) != 0) {
    if (fs::is_directory(cfg.identity, ec)) {
      if (auto t = from_dir(cfg.identity, cfg, tok))
        return t;
    } else if (fs::is_regular_file(cfg.identity, ec) && is_gguf(cfg.identity)) {
      if (auto t = from_gguf(cfg.identity, cfg, tok))
        return t;
    }
  }
  if (!tokenizer_path.empty() && fs::is_regular_file(tokenizer_path, ec)) {
    if (is_gguf(tokenizer_path))
      return from_gguf(tokenizer_path, cfg, tok);
    return from_dir(fs::path(tokenizer_path).parent_path(), cfg, tok);
  }
  return std::nullopt;
}

std::string ChatTemplate::render(const ojson& messages, bool add_generation_prompt, const ojson& extra,
                                 const jinja::RenderLimits& limits) const {
  jinja::Object g;
  if (extra.is_object())
    for (auto& [k, v] : extra.items())
      g.set(k, jinja::Value::from_json(v));
  g.set("messages", jinja::Value::from_json(messages));
  g.set("add_generation_prompt", jinja::Value(add_generation_prompt));
  g.set("bos_token", jinja::Value(bos_));
  g.set("eos_token", jinja::Value(eos_));
  return tpl_->render(g, limits);
}

std::vector<int32_t> ChatTemplate::encode(const std::string& rendered, const Tokenizer& tok, const ModelConfig& cfg,
                                          std::span<const std::size_t> plain_at) const {
  // The id a special token's text stands for: the tokenizer's own when it
  // matches the text whole, else the model's.
  const auto id_of = [&](const std::string& text, int32_t fallback) {
    const auto ids = tok.encode(text, false);
    return ids.size() == 1 ? ids.front() : fallback;
  };
  const int32_t bos_id = bos_.empty() ? -1 : id_of(bos_, cfg.bos_id);
  const int32_t eos_id = eos_.empty() ? -1 : id_of(eos_, cfg.eos_ids.empty() ? -1 : cfg.eos_ids.front());
  std::vector<int32_t> out;
  std::size_t pos = 0;
  const SpecialText guard{true, plain_at};
  const auto flush = [&](std::size_t end) {
    if (end > pos) {
      const auto local = ContentGuard::slice(plain_at, pos, end);
      const auto part = tok.encode_with(std::string_view(rendered).substr(pos, end - pos), false, {true, local});
      out.insert(out.end(), part.begin(), part.end());
    }
  };
  // The next occurrence of `text` from `from` that may be a special token.
  const auto next_match = [&](const std::string& text, std::size_t from) {
    for (auto f = rendered.find(text, from); f != std::string::npos; f = rendered.find(text, f + 1))
      if (guard.allows(f, text.size()))
        return f;
    return std::string::npos;
  };
  while (pos < rendered.size()) {
    std::size_t at = std::string::npos, len = 0;
    int32_t id = -1;
    for (auto [text, tid] : {std::pair{&bos_, bos_id}, std::pair{&eos_, eos_id}}) {
      if (text->empty() || tid < 0)
        continue;
      const auto f = next_match(*text, pos);
      if (f != std::string::npos && (f < at || (f == at && text->size() > len))) {
        at = f;
        len = text->size();
        id = tid;
      }
    }
    if (at == std::string::npos) {
      flush(rendered.size());
      break;
    }
    flush(at);
    out.push_back(id);
    pos = at + len;
  }
  return out;
}

} // namespace strata::model
