// Hugging Face `tokenizer.json` byte-level BPE (GPT-2 / Qwen / Llama 3 style):
// added tokens are matched whole first, the rest is NFC-normalized, split by the
// pre-tokenizer regex (PCRE2, Unicode properties), mapped byte -> printable
// character, and merged by rank.

#include "model/base/error.hpp"
#include "model/text/tokenizer_hf_parts.hpp"
#include "model/text/tokenizer_impl.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>
#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <array>
#include <climits>
#include <unordered_map>

namespace strata::model::detail {

namespace {

using nlohmann::json;

const char* gpt2_pattern =
  R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string utf8_of(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

struct Regex {
  pcre2_code* code = nullptr;
  ~Regex() {
    if (code)
      pcre2_code_free(code);
  }
};

class HfTokenizer final : public HfTokenizerBase {
public:
  HfTokenizer(const std::string& path, const json& j) : path_(path) {
    auto fail = [&](const std::string& what) {
      throw Error(errc::unsupported, "tokenizer '" + path + "': " + what);
    };
    if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
      throw Error(errc::bad_format, "tokenizer '" + path + "' has no \"model\" object (not a tokenizer.json)");
    const json& model = j["model"];
    if (model.value("type", std::string{}) != "BPE")
      fail("model type '" + model.value("type", std::string{}) + "' is not supported (BPE)");
    if (!model.contains("vocab") || !model["vocab"].is_object())
      throw Error(errc::bad_format, "tokenizer '" + path + "': model.vocab is missing");
    // Normalizer: none or NFC.
    if (j.contains("normalizer") && !j["normalizer"].is_null()) {
      const auto t = j["normalizer"].value("type", std::string{});
      if (t != "NFC")
        fail("normalizer '" + t + "' is not supported (NFC or none)");
      nfc_ = true;
    }
    // Pre-tokenizer: Sequence[Split(Regex), ByteLevel(use_regex=false)] or ByteLevel(use_regex=true).
    std::string pattern;
    const json& pre = j.value("pre_tokenizer", json{});
    auto take = [&](const json& p) {
      const auto t = p.value("type", std::string{});
      if (t == "Split") {
        if (!p.contains("pattern") || !p["pattern"].contains("Regex"))
          fail("Split pre-tokenizer without a Regex pattern");
        if (p.value("behavior", std::string{}) != "Isolated" || p.value("invert", false))
          fail("Split pre-tokenizer behavior must be Isolated, not inverted");
        pattern = p["pattern"]["Regex"].get<std::string>();
      } else if (t == "ByteLevel") {
        if (p.value("add_prefix_space", false))
          fail("ByteLevel add_prefix_space is not supported");
        if (p.value("use_regex", true))
          pattern = gpt2_pattern;
      } else {
        fail("pre-tokenizer '" + t + "' is not supported");
      }
    };
    if (pre.is_object() && pre.value("type", std::string{}) == "Sequence") {
      for (auto& p : pre["pretokenizers"])
        take(p);
    } else if (pre.is_object()) {
      take(pre);
    }
    if (pattern.empty())
      fail("no pre-tokenizer regex found");
    int err = 0;
    PCRE2_SIZE erroff = 0;
    regex_.code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                                PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &erroff, nullptr);
    if (!regex_.code) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      fail("pre-tokenizer regex does not compile at " + std::to_string(erroff) + ": " + reinterpret_cast<char*>(msg));
    }
    pcre2_jit_compile(regex_.code, PCRE2_JIT_COMPLETE); // best effort
    // Byte <-> printable character table of byte-level BPE.
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
      byte_char_[static_cast<std::size_t>(b)] = utf8_of(cp);
      char_byte_[byte_char_[static_cast<std::size_t>(b)]] = static_cast<unsigned char>(b);
    }
    v_.load(j, path);
    ignore_merges_ = model.value("ignore_merges", false);
    for (const char* k : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(k) && !model[k].is_null() && !(model[k].is_string() && model[k].get<std::string>().empty()))
        fail(std::string("BPE ") + k + " is not supported");
  }

  void encode_segment(std::string_view plain, int, std::vector<int32_t>& ids) const override {
    encode_plain(plain, ids);
  }

  std::string token_bytes(int32_t id, int32_t) const override {
    auto a = v_.added_by_id.find(id);
    if (a != v_.added_by_id.end())
      return a->second;
    if (id < 0 || id >= static_cast<int32_t>(v_.id_to_token.size()) || v_.id_to_token[static_cast<std::size_t>(id)].empty())
      throw Error(errc::token_out_of_range, "token id " + std::to_string(id) + " is not in tokenizer '" + path_ + "'");
    const std::string& tok = v_.id_to_token[static_cast<std::size_t>(id)];
    std::string out;
    std::size_t i = 0;
    while (i < tok.size()) {
      std::size_t len = 1;
      const auto c = static_cast<unsigned char>(tok[i]);
      if (c >= 0xC0)
        len = c >= 0xE0 ? (c >= 0xF0 ? 4 : 3) : 2;
      auto it = char_byte_.find(tok.substr(i, len));
      if (it != char_byte_.end())
        out += static_cast<char>(it->second);
      else
        out += tok.substr(i, len);
      i += len;
    }
    return out;
  }

  int64_t vocab_size() const override { return static_cast<int64_t>(v_.id_to_token.size()); }
  int32_t bos_id() const override { return v_.bos; }
  std::string kind() const override { return "hf-bpe"; }

private:
  void encode_plain(std::string_view text, std::vector<int32_t>& ids) const {
    std::string normalized;
    if (nfc_) {
      UErrorCode status = U_ZERO_ERROR;
      const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(status);
      icu::UnicodeString u = icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), static_cast<int32_t>(text.size())));
      icu::UnicodeString n = nfc->normalize(u, status);
      if (U_FAILURE(status))
        throw Error(errc::bad_text, "NFC normalization failed: " + std::string(u_errorName(status)));
      n.toUTF8String(normalized);
      text = normalized;
    }
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(regex_.code, nullptr);
    PCRE2_SIZE start = 0;
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    while (start < text.size()) {
      const int rc = pcre2_match(regex_.code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, md, nullptr);
      if (rc < 0) { // no more matches: the rest is one piece
        bpe(text.substr(start), ids);
        break;
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      if (ov[0] > start)
        bpe(text.substr(start, ov[0] - start), ids); // unmatched gap
      if (ov[1] == ov[0]) { // empty match: step one character
        std::size_t step = 1;
        while (ov[0] + step < text.size() && (static_cast<unsigned char>(text[ov[0] + step]) & 0xC0) == 0x80)
          ++step;
        bpe(text.substr(ov[0], step), ids);
        start = ov[0] + step;
      } else {
        bpe(text.substr(ov[0], ov[1] - ov[0]), ids);
        start = ov[1];
      }
    }
    pcre2_match_data_free(md);
  }

  void bpe(std::string_view piece, std::vector<int32_t>& ids) const {
    if (piece.empty())
      return;
    std::vector<std::string> sym;
    sym.reserve(piece.size());
    for (unsigned char c : piece)
      sym.push_back(byte_char_[c]);
    if (ignore_merges_) { // a word the vocabulary has whole is taken as it is (Llama 3)
      std::string whole;
      for (auto& x : sym)
        whole += x;
      if (auto it = v_.vocab.find(whole); it != v_.vocab.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    v_.merge(sym);
    for (auto& x : sym) {
      auto it = v_.vocab.find(x);
      if (it == v_.vocab.end())
        throw Error(errc::bad_text, "tokenizer '" + path_ + "' has no token for piece '" + x + "'");
      ids.push_back(it->second);
    }
  }

  std::string path_;
  bool nfc_ = false;
  Regex regex_;
  std::array<std::string, 256> byte_char_;
  std::unordered_map<std::string, unsigned char> char_byte_;
  bool ignore_merges_ = false;
};

} // namespace

std::unique_ptr<Tokenizer> make_hf_tokenizer(const std::string& path, const std::string& data) {
  json j;
  try {
    j = json::parse(data);
  } catch (const json::exception& e) {
    throw Error(errc::bad_format, "tokenizer '" + path + "' is not valid JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
    throw Error(errc::bad_format, "tokenizer '" + path + "' has no \"model\" object (not a tokenizer.json)");
  // SentencePiece-style files (Llama 2, Mistral, Gemma) have no ByteLevel step.
  if (!hf_is_byte_level(j))
    return make_hf_spm_tokenizer(path, j);
  return std::make_unique<HfTokenizer>(path, j);
}

} // namespace strata::model::detail
