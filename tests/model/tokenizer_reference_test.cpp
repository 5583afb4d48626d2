// Tokenizers against the reference encodings in ../shared/models.

#include "model/base/error.hpp"
#include "model/text/tokenizer.hpp"
#include "tests/support.hpp"

#include <random>

namespace strata {
namespace {

// Random valid UTF-8: ASCII, Latin, CJK, emoji, with spaces and newlines.
std::string random_utf8(std::mt19937& rng, int chars) {
  static const std::vector<std::pair<uint32_t, uint32_t>> ranges = {
    {0x20, 0x7E}, {0x20, 0x20}, {0x0A, 0x0A}, {0xA0, 0x17F}, {0x391, 0x3C9}, {0x410, 0x44F},
    {0x4E00, 0x4FFF}, {0x3041, 0x3096}, {0x1F300, 0x1F64F}, {0x09, 0x09}};
  std::string s;
  for (int i = 0; i < chars; ++i) {
    auto [lo, hi] = ranges[rng() % ranges.size()];
    uint32_t cp = lo + static_cast<uint32_t>(rng() % (hi - lo + 1));
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else if (cp < 0x800) {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      s += static_cast<char>(0xE0 | (cp >> 12));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      s += static_cast<char>(0xF0 | (cp >> 18));
      s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  return s;
}

// Streaming decode of ids gives the same text as decode() and never emits a
// partial UTF-8 character.
void expect_stream_matches(const model::Tokenizer& tok, const std::vector<int32_t>& ids, const std::string& text) {
  model::StreamDecoder dec(tok);
  std::string out;
  for (auto id : ids) {
    auto piece = dec.push(id);
    EXPECT_EQ(model::complete_utf8_prefix(piece), piece.size());
    out += piece;
  }
  out += dec.finish();
  EXPECT_EQ(out, text);
}

TEST(Llama2Tokenizer, EncodesReferenceCases) {
  STRATA_REQUIRE_SHARED("models/llama2-tokenizer.bin");
  auto tok = model::Tokenizer::load(test::shared_path("models/llama2-tokenizer.bin"));
  EXPECT_EQ(tok->vocab_size(), 32000);
  const auto cases = test::read_json(test::shared_path("models/llama2-tokenizer.cases.json"));
  ASSERT_FALSE(cases["cases"].empty());
  for (const auto& c : cases["cases"]) {
    const auto text = c["text"].get<std::string>();
    const auto ids = tok->encode(text, true);
    EXPECT_EQ(ids, c["ids"].get<std::vector<int32_t>>()) << "text: '" << text << "'";
    EXPECT_EQ(tok->decode(ids), text);
    expect_stream_matches(*tok, ids, text);
  }
}

TEST(Llama2Tokenizer, RoundTripsRandomUtf8) {
  STRATA_REQUIRE_SHARED("models/llama2-tokenizer.bin");
  auto tok = model::Tokenizer::load(test::shared_path("models/llama2-tokenizer.bin"));
  std::mt19937 rng(7);
  for (int i = 0; i < 200; ++i) {
    const auto text = random_utf8(rng, 1 + static_cast<int>(rng() % 40));
    const auto ids = tok->encode(text, i % 2 == 0);
    ASSERT_EQ(tok->decode(ids), text) << "case " << i;
    expect_stream_matches(*tok, ids, text);
  }
}

TEST(QwenTokenizer, EncodesReferenceCases) {
  STRATA_REQUIRE_SHARED("models/qwen-tokenizer.json");
  auto tok = model::Tokenizer::load(test::shared_path("models/qwen-tokenizer.json"));
  const auto cases = test::read_json(test::shared_path("models/qwen-tokenizer.cases.json"));
  ASSERT_FALSE(cases["cases"].empty());
  for (const auto& c : cases["cases"]) {
    const auto text = c["text"].get<std::string>();
    const auto ids = tok->encode(text, false);
    EXPECT_EQ(ids, c["ids"].get<std::vector<int32_t>>()) << "text: '" << text << "'";
    EXPECT_EQ(tok->decode(ids), text);
    expect_stream_matches(*tok, ids, text);
  }
}

TEST(QwenTokenizer, RoundTripsRandomUtf8) {
  STRATA_REQUIRE_SHARED("models/qwen-tokenizer.json");
  auto tok = model::Tokenizer::load(test::shared_path("models/qwen-tokenizer.json"));
  std::mt19937 rng(11);
  // The generated characters are all NFC-stable, so decode(encode(t)) == t.
  for (int i = 0; i < 200; ++i) {
    const auto text = random_utf8(rng, 1 + static_cast<int>(rng() % 40));
    const auto ids = tok->encode(text, false);
    ASSERT_EQ(tok->decode(ids), text) << "case " << i;
    expect_stream_matches(*tok, ids, text);
  }
}

TEST(QwenTokenizer, NormalizesToNfcAndMatchesSpecialTokensWhole) {
  STRATA_REQUIRE_SHARED("models/qwen-tokenizer.json");
  auto tok = model::Tokenizer::load(test::shared_path("models/qwen-tokenizer.json"));
  // "e" + combining acute (NFD) encodes like the precomposed "é".
  EXPECT_EQ(tok->encode("caf\x65\xCC\x81", false), tok->encode("caf\xC3\xA9", false));
  const auto ids = tok->encode("<|im_start|>user\nhi<|im_end|>", false);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 151644);
  EXPECT_EQ(ids.back(), 151645);
  EXPECT_MODEL_ERROR(tok->encode("bad \xFF byte", false), model::errc::bad_text, "offset 4");
  EXPECT_MODEL_ERROR(tok->token_bytes(999999, -1), model::errc::token_out_of_range, "999999");
}

TEST(Tokenizers, WrongFormatIsATypedError) {
  STRATA_REQUIRE_SHARED("models/stories260K.bin");
  EXPECT_MODEL_ERROR(model::Tokenizer::load(test::shared_path("models/stories260K.bin")), model::errc::bad_format,
                     "stories260K.bin");
  EXPECT_MODEL_ERROR(model::Tokenizer::load(test::shared_path("models/qwen-tokenizer.cases.json")),
                     model::errc::bad_format, "model");
  EXPECT_MODEL_ERROR(model::Tokenizer::load("/nonexistent/tok.bin"), model::errc::io, "/nonexistent/tok.bin");
  auto dir = test::scratch_dir("tok_trunc");
  auto bytes = test::read_file(test::shared_path("models/llama2-tokenizer.bin"));
  test::write_file(dir / "t.bin", bytes.substr(0, bytes.size() - 3));
  EXPECT_MODEL_ERROR(model::Tokenizer::load((dir / "t.bin").string()), model::errc::bad_format, "token 31999");
}

} // namespace
} // namespace strata
