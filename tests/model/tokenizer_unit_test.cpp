#include "model/base/error.hpp"
#include "model/text/tokenizer.hpp"
#include "tests/support.hpp"

namespace strata {
namespace {

TEST(ByteTokenizer, EncodesBytesAfterBos) {
  auto t = model::Tokenizer::bytes();
  EXPECT_EQ(t->encode("Hi", true), (std::vector<int32_t>{1, 75, 108}));
  EXPECT_EQ(t->decode(t->encode("h\xC3\xA9!", true)), "h\xC3\xA9!");
  EXPECT_MODEL_ERROR(t->token_bytes(259, -1), model::errc::token_out_of_range, "259");
}

TEST(Utf8, CompletePrefixHoldsBackSplitCharacters) {
  EXPECT_EQ(model::complete_utf8_prefix("abc"), 3u);
  EXPECT_EQ(model::complete_utf8_prefix("ab\xC3"), 2u);
  EXPECT_EQ(model::complete_utf8_prefix("ab\xE4\xBD"), 2u);
  EXPECT_EQ(model::complete_utf8_prefix("ab\xE4\xBD\xA0"), 5u);
  EXPECT_EQ(model::complete_utf8_prefix("\xF0\x9F\x9A"), 0u);
  EXPECT_EQ(model::complete_utf8_prefix("\xF0\x9F\x9A\x80"), 4u);
}

TEST(Utf8, StreamDecoderEmitsACharacterOnceComplete) {
  auto t = model::Tokenizer::bytes();
  model::StreamDecoder d(*t);
  EXPECT_EQ(d.push(1), "");
  EXPECT_EQ(d.push(0xE4 + 3), "");
  EXPECT_EQ(d.push(0xBD + 3), "");
  EXPECT_EQ(d.push(0xA0 + 3), "\xE4\xBD\xA0");
  EXPECT_EQ(d.push('x' + 3), "x");
  EXPECT_EQ(d.push(0xC3 + 3), "");
  EXPECT_EQ(d.finish(), "\xC3");
}

TEST(Utf8, CheckNamesTheOffset) {
  EXPECT_NO_THROW(model::check_utf8("plain \xC3\xA9 \xF0\x9F\x9A\x80"));
  EXPECT_MODEL_ERROR(model::check_utf8("ab\x80"), model::errc::bad_text, "offset 2");
  EXPECT_MODEL_ERROR(model::check_utf8("ab\xC3"), model::errc::bad_text, "truncated");
  EXPECT_MODEL_ERROR(model::check_utf8("\xED\xA0\x80"), model::errc::bad_text, "invalid code point");
  EXPECT_MODEL_ERROR(model::check_utf8("\xC0\xAF"), model::errc::bad_text, "invalid code point");
}

} // namespace
} // namespace strata
