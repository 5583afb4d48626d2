#pragma once
// Tokenizers: llama2.c `tokenizer.bin` (SentencePiece-style BPE by merge score),
// Hugging Face `tokenizer.json` (byte-level BPE), and a byte tokenizer for
// builtin models. Torch-free.

#include "model/base/config.hpp"

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::model {

/// How special (control) tokens written in a text are treated when it is
/// encoded: the texts of tokens such as `<|im_end|>` or `<start_of_turn>`.
struct SpecialText {
  /// Match them at all (false: each is encoded as the ordinary text it spells,
  /// as Hugging Face's split_special_tokens does).
  bool parse = true;
  /// Byte offsets (ascending) that no match may cover: a special token's text
  /// [begin, begin + len) with an offset in (begin, begin + len] is ordinary
  /// text (a chat message's content; see ContentGuard).
  std::span<const std::size_t> plain_at;
  /// Whether a match of [begin, begin + len) may become its special token.
  bool allows(std::size_t begin, std::size_t len) const;
};

class Tokenizer {
public:
  virtual ~Tokenizer() = default;
  /// Token ids of `text` (which must be valid UTF-8 for tokenizers that
  /// normalize). `add_bos` prepends BOS where the tokenizer has one. Special
  /// tokens written in the text become their ids.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos) const = 0;
  /// The same, with special tokens in the text treated as `special` says.
  /// Tokenizers that match no special tokens in text encode as encode() does.
  virtual std::vector<int32_t> encode_with(std::string_view text, bool add_bos, const SpecialText& special) const {
    (void)special;
    return encode(text, add_bos);
  }
  /// Where encode() would match special (control) tokens in `text`: (offset,
  /// length) of each, left to right. Empty for tokenizers that match none.
  virtual std::vector<std::pair<std::size_t, std::size_t>> find_special(std::string_view text) const {
    (void)text;
    return {};
  }
  /// The raw bytes token `id` contributes when it follows `prev` (-1 at the
  /// start of a text). Throws Error(token_out_of_range).
  virtual std::string token_bytes(int32_t id, int32_t prev) const = 0;
  virtual int64_t vocab_size() const = 0;
  /// -1 when the tokenizer has no BOS token.
  virtual int32_t bos_id() const = 0;
  /// "llama2c", "hf-bpe" or "bytes".
  virtual std::string kind() const = 0;

  /// Concatenated bytes of `ids`.
  std::string decode(std::span<const int32_t> ids) const;

  /// Loads a llama2.c `tokenizer.bin`, a Hugging Face `tokenizer.json` or the
  /// tokenizer in a GGUF file's metadata (by
  /// content), or "builtin:bytes". Throws Error naming the file when it is neither.
  static std::unique_ptr<Tokenizer> load(const std::string& path);
  /// The byte tokenizer of builtin models: 0 <unk>, 1 <s>, 2 </s>, 3 + byte.
  static std::unique_ptr<Tokenizer> bytes();
};

/// The tokenizer a model brings along: the byte tokenizer of builtin models, a
/// GGUF file's own, the `tokenizer.json` of a Hugging Face model directory; or
/// null (bring one with --tokenizer). A file that is there but cannot be read is
/// an error naming it.
std::unique_ptr<Tokenizer> default_tokenizer_for(const ModelConfig& cfg);

/// Turns a stream of token ids into text, holding back an incomplete UTF-8
/// character until the token that completes it arrives.
class StreamDecoder {
public:
  explicit StreamDecoder(const Tokenizer& tok) : tok_(tok) {}
  /// Text that is complete after `id`; may be empty.
  std::string push(int32_t id);
  /// Whatever is still held back (an incomplete character at the very end).
  std::string finish();

private:
  const Tokenizer& tok_;
  int32_t prev_ = -1;
  std::string pending_;
};

/// Length of the longest prefix of `s` that does not end inside a UTF-8
/// character that later bytes could complete.
std::size_t complete_utf8_prefix(std::string_view s);
/// Throws Error(bad_text) naming the offset of the first invalid byte.
void check_utf8(std::string_view s);

} // namespace strata::model
