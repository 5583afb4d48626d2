// Hugging Face `tokenizer.json` byte-level BPE (GPT-2 / Qwen style):
// added tokens are matched whole first, the rest is NFC-normalized, split by the
// pre-tokenizer regex (PCRE2, Unicode properties), mapped byte -> printable
// character, and merged by rank.

#include "model/error.hpp"
#include "model/tokenizer_impl.hpp"

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

class HfTokenizer final : public Tokenizer {
public:
  HfTokenizer(const std::string& path, const std::string& data) : path_(path) {
    json j;
    try {
      j = json::parse(data);
    } catch (const json::exception& e) {
      throw Error(errc::bad_format, "tokenizer '" + path + "' is not valid JSON: " + e.what());
    }
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
    // Vocabulary and merges.
    int64_t max_id = -1;
    for (auto& [tok, id] : model["vocab"].items()) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
        throw Error(errc::bad_format, "tokenizer '" + path + "': vocab entry '" + tok + "' has a bad id");
      vocab_[tok] = id.get<int32_t>();
      max_id = std::max<int64_t>(max_id, id.get<int64_t>());
    }
    if (model.contains("merges")) {
      int32_t rank = 0;
      for (auto& m : model["merges"]) {
        std::string a, b;
        if (m.is_array() && m.size() == 2) {
          a = m[0].get<std::string>();
          b = m[1].get<std::string>();
        } else if (m.is_string()) {
          const auto s = m.get<std::string>();
          const auto sp = s.find(' ', 1);
          if (sp == std::string::npos)
            throw Error(errc::bad_format, "tokenizer '" + path + "': merge '" + s + "' has no space");
          a = s.substr(0, sp);
          b = s.substr(sp + 1);
        } else {
          throw Error(errc::bad_format, "tokenizer '" + path + "': a merge is neither a pair nor a string");
        }
        ranks_.emplace(a + '\x01' + b, rank++);
      }
    }
    if (j.contains("added_tokens")) {
      for (auto& t : j["added_tokens"]) {
        const auto content = t.value("content", std::string{});
        const auto id = t.value("id", -1);
        if (content.empty() || id < 0)
          throw Error(errc::bad_format, "tokenizer '" + path + "': an added token lacks content or id");
        added_.emplace_back(content, id);
        added_by_id_[id] = content;
        max_id = std::max<int64_t>(max_id, id);
      }
    }
    // Longest first, so that a longer added token wins at the same offset.
    std::sort(added_.begin(), added_.end(), [](auto& x, auto& y) { return x.first.size() > y.first.size(); });
    id_to_token_.resize(static_cast<std::size_t>(max_id + 1));
    for (auto& [tok, id] : vocab_)
      id_to_token_[static_cast<std::size_t>(id)] = tok;
  }

  std::vector<int32_t> encode(std::string_view text, bool /*add_bos: no BOS in byte-level BPE*/) const override {
    check_utf8(text);
    std::vector<int32_t> ids;
    std::size_t pos = 0;
    while (pos < text.size()) {
      // Earliest added token; the longest one at that offset.
      std::size_t best = std::string_view::npos;
      const std::pair<std::string, int32_t>* hit = nullptr;
      for (auto& a : added_) {
        const auto f = text.find(a.first, pos);
        if (f != std::string_view::npos && (f < best)) {
          best = f;
          hit = &a;
        }
      }
      const std::size_t end = hit ? best : text.size();
      if (end > pos)
        encode_plain(text.substr(pos, end - pos), ids);
      if (!hit)
        break;
      ids.push_back(hit->second);
      pos = best + hit->first.size();
    }
    return ids;
  }

  std::string token_bytes(int32_t id, int32_t) const override {
    auto a = added_by_id_.find(id);
    if (a != added_by_id_.end())
      return a->second;
    if (id < 0 || id >= static_cast<int32_t>(id_to_token_.size()) || id_to_token_[static_cast<std::size_t>(id)].empty())
      throw Error(errc::token_out_of_range, "token id " + std::to_string(id) + " is not in tokenizer '" + path_ + "'");
    const std::string& tok = id_to_token_[static_cast<std::size_t>(id)];
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

  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token_.size()); }
  int32_t bos_id() const override { return -1; }
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
    std::string key;
    while (sym.size() > 1) {
      int32_t best = INT32_MAX;
      std::size_t at = 0;
      for (std::size_t i = 0; i + 1 < sym.size(); ++i) {
        key = sym[i];
        key += '\x01';
        key += sym[i + 1];
        auto it = ranks_.find(key);
        if (it != ranks_.end() && it->second < best) {
          best = it->second;
          at = i;
        }
      }
      if (best == INT32_MAX)
        break;
      sym[at] += sym[at + 1];
      sym.erase(sym.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    }
    for (auto& s : sym) {
      auto it = vocab_.find(s);
      if (it == vocab_.end())
        throw Error(errc::bad_text, "tokenizer '" + path_ + "' has no token for piece '" + s + "'");
      ids.push_back(it->second);
    }
  }

  std::string path_;
  bool nfc_ = false;
  Regex regex_;
  std::array<std::string, 256> byte_char_;
  std::unordered_map<std::string, unsigned char> char_byte_;
  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<std::string, int32_t> ranks_;
  std::vector<std::pair<std::string, int32_t>> added_;
  std::unordered_map<int32_t, std::string> added_by_id_;
  std::vector<std::string> id_to_token_;
};

} // namespace

std::unique_ptr<Tokenizer> make_hf_tokenizer(const std::string& path, const std::string& data) {
  return std::make_unique<HfTokenizer>(path, data);
}

} // namespace strata::model::detail
