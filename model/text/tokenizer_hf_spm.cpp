// Hugging Face `tokenizer.json` for SentencePiece-style BPE (Llama 2, Mistral,
// TinyLlama, Gemma, Yi): text between added tokens is normalized (a Sequence of
// Prepend / Replace, or one of them), pre-tokenized (none, Metaspace with its
// prepend scheme and split, or Split at a literal string), merged by rank over
// characters, and pieces the vocabulary lacks become their <0xXX> byte tokens
// (byte_fallback) or <unk> (fused when fuse_unk). Decoding turns "▁" back into
// spaces, <0xXX> into bytes, and strips the leading space the prepend added.

#include "model/base/error.hpp"
#include "model/text/tokenizer_hf_parts.hpp"
#include "model/text/tokenizer_impl.hpp"

#include <nlohmann/json.hpp>

#include <array>
#include <cstdio>
#include <unordered_map>

namespace strata::model::detail {

namespace {

using nlohmann::json;

const std::string metaspace = "\xE2\x96\x81"; // U+2581 ▁

std::string replace_all(std::string_view s, const std::string& from, const std::string& to) {
  std::string out;
  std::size_t pos = 0;
  while (true) {
    const auto at = s.find(from, pos);
    if (at == std::string_view::npos)
      break;
    out.append(s.substr(pos, at - pos));
    out += to;
    pos = at + from.size();
  }
  out.append(s.substr(pos));
  return out;
}

class HfSpmTokenizer final : public HfTokenizerBase {
public:
  HfSpmTokenizer(const std::string& path, const json& j) : path_(path) {
    const auto fail = [&](const std::string& what) {
      throw Error(errc::unsupported, "tokenizer '" + path + "': " + what);
    };
    const json& model = j["model"];
    if (model.value("type", std::string{}) != "BPE")
      fail("model type '" + model.value("type", std::string{}) + "' is not supported (BPE)");
    for (const char* k : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(k) && !model[k].is_null() && !(model[k].is_string() && model[k].get<std::string>().empty()))
        fail(std::string("BPE ") + k + " is not supported");
    byte_fallback_ = model.value("byte_fallback", false);
    fuse_unk_ = model.value("fuse_unk", false);
    ignore_merges_ = model.value("ignore_merges", false);
    v_.load(j, path);
    if (model.contains("unk_token") && model["unk_token"].is_string())
      unk_ = v_.id_of(model["unk_token"].get<std::string>());
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      byte_id_[static_cast<std::size_t>(b)] = v_.id_of(name);
      if (byte_id_[static_cast<std::size_t>(b)] >= 0)
        byte_of_[byte_id_[static_cast<std::size_t>(b)]] = static_cast<unsigned char>(b);
    }
    // Normalizer: Prepend / Replace (literal strings), alone or in a Sequence.
    const auto norm = [&](const json& n) {
      const auto t = n.value("type", std::string{});
      if (t == "Prepend") {
        steps_.push_back({true, {}, n.value("prepend", std::string{})});
      } else if (t == "Replace") {
        if (!n.contains("pattern") || !n["pattern"].contains("String"))
          fail("Replace normalizer with a regex pattern is not supported (only a literal String)");
        steps_.push_back({false, n["pattern"]["String"].get<std::string>(), n.value("content", std::string{})});
      } else {
        fail("normalizer '" + t + "' is not supported here (Prepend, Replace or a Sequence of them)");
      }
    };
    if (j.contains("normalizer") && j["normalizer"].is_object()) {
      const json& n = j["normalizer"];
      if (n.value("type", std::string{}) == "Sequence") {
        for (auto& x : n["normalizers"])
          norm(x);
      } else {
        norm(n);
      }
    }
    // Pre-tokenizer: none, Metaspace, or Split at a literal string.
    const json pre = j.contains("pre_tokenizer") ? j["pre_tokenizer"] : json();
    if (pre.is_object()) {
      const auto t = pre.value("type", std::string{});
      if (t == "Metaspace") {
        pre_ = Pre::metaspace;
        replacement_ = pre.value("replacement", metaspace);
        // Older files: add_prefix_space (true = "always"); newer: prepend_scheme.
        scheme_ = pre.contains("prepend_scheme") ? pre["prepend_scheme"].get<std::string>()
                                                 : (pre.value("add_prefix_space", true) ? "always" : "never");
        if (scheme_ != "always" && scheme_ != "first" && scheme_ != "never")
          fail("Metaspace prepend_scheme '" + scheme_ + "' is not supported");
        split_ = pre.value("split", true);
      } else if (t == "Split") {
        if (!pre.contains("pattern") || !pre["pattern"].contains("String"))
          fail("Split pre-tokenizer with a regex is not supported for this tokenizer kind");
        pre_ = Pre::split;
        split_at_ = pre["pattern"]["String"].get<std::string>();
        behavior_ = pre.value("behavior", std::string{});
        if (pre.value("invert", false) ||
            (behavior_ != "MergedWithPrevious" && behavior_ != "MergedWithNext" && behavior_ != "Isolated" &&
             behavior_ != "Removed"))
          fail("Split behavior '" + behavior_ + "' is not supported");
      } else {
        fail("pre-tokenizer '" + t + "' is not supported for this tokenizer kind");
      }
    }
    // Decoder: the Strip step's leading spaces (Llama 2: one), or Metaspace's prefix.
    if (j.contains("decoder") && j["decoder"].is_object()) {
      const json& d = j["decoder"];
      const auto scan = [&](const json& x) {
        const auto t = x.value("type", std::string{});
        if (t == "Strip")
          strip_start_ = x.value("start", 0);
        else if (t == "Metaspace")
          strip_start_ = x.value("prepend_scheme", std::string(x.value("add_prefix_space", true) ? "always" : "never")) != "never" ? 1 : 0;
        else if (t != "Replace" && t != "ByteFallback" && t != "Fuse")
          fail("decoder '" + t + "' is not supported for this tokenizer kind");
      };
      if (d.value("type", std::string{}) == "Sequence")
        for (auto& x : d["decoders"])
          scan(x);
      else
        scan(d);
    }
  }

  void encode_segment(std::string_view plain, int segment, std::vector<int32_t>& ids) const override {
    encode_plain(plain, segment, ids);
  }

  std::string token_bytes(int32_t id, int32_t prev) const override {
    if (auto a = v_.added_by_id.find(id); a != v_.added_by_id.end())
      return replace_all(a->second, metaspace, " "); // Gemma's whitespace runs are added tokens
    if (auto b = byte_of_.find(id); b != byte_of_.end())
      return std::string(1, static_cast<char>(b->second));
    if (id < 0 || id >= static_cast<int32_t>(v_.id_to_token.size()) || v_.id_to_token[static_cast<std::size_t>(id)].empty())
      throw Error(errc::token_out_of_range, "token id " + std::to_string(id) + " is not in tokenizer '" + path_ + "'");
    std::string s = replace_all(v_.id_to_token[static_cast<std::size_t>(id)], metaspace, " ");
    // The space the normalizer put before the text's first word is not part of it.
    for (int k = 0; prev < 0 && k < strip_start_ && !s.empty() && s[0] == ' '; ++k)
      s.erase(0, 1);
    return s;
  }

  int64_t vocab_size() const override { return static_cast<int64_t>(v_.id_to_token.size()); }
  int32_t bos_id() const override { return v_.bos; }
  std::string kind() const override { return "hf-spm"; }

private:
  enum class Pre : uint8_t { none, metaspace, split };
  struct Step {
    bool prepend;
    std::string from, to;
  };

  void encode_plain(std::string_view text, int segment, std::vector<int32_t>& ids) const {
    std::string s(text);
    for (auto& st : steps_)
      s = st.prepend ? st.to + s : replace_all(s, st.from, st.to);
    std::vector<std::string> words;
    switch (pre_) {
    case Pre::none:
      words.push_back(std::move(s));
      break;
    case Pre::metaspace: {
      s = replace_all(s, " ", replacement_);
      if ((scheme_ == "always" || (scheme_ == "first" && segment == 0)) && s.rfind(replacement_, 0) != 0)
        s = replacement_ + s;
      if (!split_) {
        words.push_back(std::move(s));
        break;
      }
      std::size_t start = 0;
      for (std::size_t at = s.find(replacement_, 1); at != std::string::npos; at = s.find(replacement_, at + 1)) {
        words.push_back(s.substr(start, at - start)); // each word starts at its ▁
        start = at;
      }
      words.push_back(s.substr(start));
      break;
    }
    case Pre::split: {
      std::size_t start = 0;
      std::string carry;
      for (std::size_t at = split_at_.empty() ? std::string::npos : s.find(split_at_); at != std::string::npos;
           at = s.find(split_at_, at + split_at_.size())) {
        std::string before = s.substr(start, at - start);
        if (behavior_ == "MergedWithPrevious") {
          words.push_back(carry + before + split_at_);
          carry.clear();
        } else if (behavior_ == "MergedWithNext") {
          words.push_back(carry + before);
          carry = split_at_;
        } else if (behavior_ == "Isolated") {
          words.push_back(before);
          words.push_back(split_at_);
        } else { // Removed
          words.push_back(before);
        }
        start = at + split_at_.size();
      }
      words.push_back(carry + s.substr(start));
      break;
    }
    }
    for (auto& w : words)
      if (!w.empty())
        bpe(w, ids);
  }

  void bpe(const std::string& word, std::vector<int32_t>& ids) const {
    if (ignore_merges_)
      if (auto it = v_.vocab.find(word); it != v_.vocab.end()) {
        ids.push_back(it->second);
        return;
      }
    std::vector<std::string> sym;
    for (std::size_t i = 0; i < word.size();) {
      const auto c = static_cast<unsigned char>(word[i]);
      const std::size_t len = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
      sym.push_back(word.substr(i, len));
      i += len;
    }
    v_.merge(sym);
    bool last_unk = false;
    for (auto& x : sym) {
      if (auto it = v_.vocab.find(x); it != v_.vocab.end()) {
        ids.push_back(it->second);
        last_unk = false;
        continue;
      }
      if (byte_fallback_) {
        bool all = true;
        for (unsigned char b : x)
          all = all && byte_id_[b] >= 0;
        if (all) {
          for (unsigned char b : x)
            ids.push_back(byte_id_[b]);
          last_unk = false;
          continue;
        }
      }
      if (unk_ < 0)
        throw Error(errc::bad_text, "tokenizer '" + path_ + "' has no token for '" + x + "' and no <unk>");
      if (!(fuse_unk_ && last_unk))
        ids.push_back(unk_);
      last_unk = true;
    }
  }

  std::string path_;
  bool byte_fallback_ = false, fuse_unk_ = false, ignore_merges_ = false;
  int32_t unk_ = -1;
  std::array<int32_t, 256> byte_id_{};
  std::unordered_map<int32_t, unsigned char> byte_of_;
  std::vector<Step> steps_;
  Pre pre_ = Pre::none;
  std::string replacement_ = metaspace, scheme_ = "always";
  bool split_ = true;
  std::string split_at_, behavior_;
  int strip_start_ = 0;
};

// Byte-level files name ByteLevel in their pre-tokenizer or decoder.
bool is_byte_level(const json& j) {
  const auto names_byte_level = [](const json& x) {
    if (!x.is_object())
      return false;
    if (x.value("type", std::string{}) == "ByteLevel")
      return true;
    for (const char* list : {"pretokenizers", "decoders"})
      if (x.contains(list))
        for (auto& e : x[list])
          if (e.is_object() && e.value("type", std::string{}) == "ByteLevel")
            return true;
    return false;
  };
  return (j.contains("pre_tokenizer") && names_byte_level(j["pre_tokenizer"])) ||
         (j.contains("decoder") && names_byte_level(j["decoder"]));
}

} // namespace

std::unique_ptr<Tokenizer> make_hf_spm_tokenizer(const std::string& path, const json& j) {
  return std::make_unique<HfSpmTokenizer>(path, j);
}

bool hf_is_byte_level(const json& j) { return is_byte_level(j); }

} // namespace strata::model::detail
