// Shared tokenizer pieces: loading by content, decoding, the byte tokenizer,
// UTF-8 helpers and the streaming decoder.

#include "model/text/tokenizer.hpp"

#include "model/base/error.hpp"
#include "model/text/tokenizer_impl.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

namespace strata::model {

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  int32_t prev = -1;
  for (auto id : ids) {
    out += token_bytes(id, prev);
    prev = id;
  }
  return out;
}

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& path) {
  if (path == "builtin:bytes")
    return bytes();
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw Error(errc::io, "cannot open tokenizer '" + path + "'");
  char magic[4] = {};
  if (in.read(magic, 4) && std::string_view(magic, 4) == "GGUF")
    return detail::make_gguf_tokenizer(path);
  in.clear();
  in.seekg(0);
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::size_t i = 0;
  while (i < data.size() && (data[i] == ' ' || data[i] == '\n' || data[i] == '\r' || data[i] == '\t'))
    ++i;
  if (i < data.size() && data[i] == '{')
    return detail::make_hf_tokenizer(path, data);
  return detail::make_llama2c_tokenizer(path, data);
}

bool SpecialText::allows(std::size_t begin, std::size_t len) const {
  if (!parse)
    return false;
  // The first protected offset after `begin`: in the match when not past its end
  // (a guard's marker sits after a special text's first character, which for a
  // one-character token is its end).
  auto it = std::upper_bound(plain_at.begin(), plain_at.end(), begin);
  return it == plain_at.end() || *it > begin + len;
}

namespace {

class ByteTokenizer final : public Tokenizer {
public:
  std::vector<int32_t> encode(std::string_view text, bool add_bos) const override {
    std::vector<int32_t> ids;
    ids.reserve(text.size() + 1);
    if (add_bos)
      ids.push_back(1);
    for (unsigned char c : text)
      ids.push_back(static_cast<int32_t>(c) + 3);
    return ids;
  }
  std::string token_bytes(int32_t id, int32_t) const override {
    if (id < 0 || id >= 259)
      throw Error(errc::token_out_of_range, "token id " + std::to_string(id) + " is outside the byte vocabulary of 259");
    return id < 3 ? std::string{} : std::string(1, static_cast<char>(id - 3));
  }
  int64_t vocab_size() const override { return 259; }
  int32_t bos_id() const override { return 1; }
  std::string kind() const override { return "bytes"; }
};

} // namespace

std::unique_ptr<Tokenizer> Tokenizer::bytes() {
  return std::make_unique<ByteTokenizer>();
}

std::unique_ptr<Tokenizer> default_tokenizer_for(const ModelConfig& cfg) {
  if (cfg.identity == "builtin:tiny" || cfg.identity == "builtin:tiny-mha" || cfg.identity == "builtin:tiny-mqa")
    return Tokenizer::bytes();
  // A GGUF file carries its tokenizer (read from the shard's own copy).
  if (cfg.dtype.rfind("gguf:", 0) == 0)
    return Tokenizer::load(cfg.identity);
  // A Hugging Face model directory ships its tokenizer.json beside config.json.
  std::error_code ec;
  const auto in_dir = std::filesystem::path(cfg.identity) / "tokenizer.json";
  if (std::filesystem::is_directory(cfg.identity, ec) && std::filesystem::is_regular_file(in_dir, ec))
    return Tokenizer::load(in_dir.string());
  return nullptr;
}

std::size_t complete_utf8_prefix(std::string_view s) {
  // Look back at most 3 bytes for a lead byte whose sequence is not finished.
  const std::size_t n = s.size();
  for (std::size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80)
      continue; // continuation byte: keep looking for the lead
    std::size_t need = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    return need > back ? n - back : n;
  }
  return n;
}

void check_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t len;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07;
    } else {
      throw Error(errc::bad_text, "text is not valid UTF-8: byte 0x" + std::to_string(c) + " at offset " +
                                    std::to_string(i) + " cannot start a character");
    }
    if (i + len > s.size())
      throw Error(errc::bad_text, "text is not valid UTF-8: character at offset " + std::to_string(i) + " is truncated");
    for (std::size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80)
        throw Error(errc::bad_text, "text is not valid UTF-8: offset " + std::to_string(i + k) +
                                      " should be a continuation byte");
      cp = (cp << 6) | (cc & 0x3F);
    }
    const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      throw Error(errc::bad_text, "text is not valid UTF-8: invalid code point at offset " + std::to_string(i));
    i += len;
  }
}

std::string StreamDecoder::push(int32_t id) {
  pending_ += tok_.token_bytes(id, prev_);
  prev_ = id;
  const std::size_t n = complete_utf8_prefix(pending_);
  std::string out = pending_.substr(0, n);
  pending_.erase(0, n);
  return out;
}

std::string StreamDecoder::finish() {
  std::string out;
  out.swap(pending_);
  return out;
}

} // namespace strata::model
