// The tokenizer a GGUF file carries in its metadata (tokenizer.ggml.*):
//   "llama": a SentencePiece-style vocabulary with scores; served by the
//            llama.cpp-compatible merge-by-score tokenizer of llama2.c files
//            (pieces with "▁" written as spaces, byte tokens <0xXX> at 3..258);
//   "gpt2":  byte-level BPE with merges; served by the tokenizer.json reader,
//            with the pre-tokenizer regex llama.cpp uses for tokenizer.ggml.pre
//            and the control / user-defined tokens as added tokens.

#include "model/base/error.hpp"
#include "model/formats/gguf.hpp"
#include "model/text/tokenizer_impl.hpp"

#include <nlohmann/json.hpp>

#include <cstring>

namespace strata::model::detail {

namespace {

void put_bytes(std::string& out, const void* p, std::size_t n) {
  out.append(static_cast<const char*>(p), n);
}

std::unique_ptr<Tokenizer> spm_from(const GgufFile& f, const std::vector<std::string>& tokens) {
  const std::string where = "GGUF file '" + f.path() + "'";
  const auto scores = f.opt_numbers("tokenizer.ggml.scores");
  if (!scores || scores->size() != tokens.size())
    throw Error(errc::bad_config, where + ": tokenizer.ggml.scores must hold one score per token (" +
                                    std::to_string(tokens.size()) + ")");
  if (auto bos = f.opt_int("tokenizer.ggml.bos_token_id"); bos && *bos != 1)
    throw Error(errc::unsupported, where + ": a SentencePiece vocabulary with BOS id " + std::to_string(*bos) +
                                     " is not supported (BOS 1, EOS 2, bytes at 3..258)");
  if (tokens.size() < 259 || tokens[3] != "<0x00>" || tokens[258] != "<0xFF>")
    throw Error(errc::unsupported, where + ": the SentencePiece vocabulary does not keep its byte tokens "
                                           "<0x00>..<0xFF> at ids 3..258");
  // The llama2.c tokenizer.bin layout: max length, then (score, length, bytes).
  std::string data(4, '\0');
  int32_t max_len = 1;
  static const std::string space_mark = "\xE2\x96\x81"; // U+2581
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    std::string piece = tokens[i];
    for (std::size_t p = 0; (p = piece.find(space_mark, p)) != std::string::npos;)
      piece.replace(p, space_mark.size(), " ");
    const float score = static_cast<float>((*scores)[i]);
    const auto len = static_cast<int32_t>(piece.size());
    max_len = std::max(max_len, len);
    put_bytes(data, &score, 4);
    put_bytes(data, &len, 4);
    data += piece;
  }
  std::memcpy(data.data(), &max_len, 4);
  return make_llama2c_tokenizer(f.path(), data);
}

std::unique_ptr<Tokenizer> bpe_from(const GgufFile& f, const std::vector<std::string>& tokens) {
  using nlohmann::json;
  const std::string where = "GGUF file '" + f.path() + "'";
  const auto* merges = f.opt_strings("tokenizer.ggml.merges");
  if (!merges)
    throw Error(errc::bad_config, where + ": a gpt2 tokenizer needs tokenizer.ggml.merges");
  const auto types = f.opt_numbers("tokenizer.ggml.token_type");
  if (types && types->size() != tokens.size())
    throw Error(errc::bad_config, where + ": tokenizer.ggml.token_type has " + std::to_string(types->size()) +
                                    " entries for " + std::to_string(tokens.size()) + " tokens");
  const std::string pre = f.opt_string("tokenizer.ggml.pre").value_or("default");
  std::string pattern;
  if (pre == "qwen2")
    pattern = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  else if (pre == "llama3" || pre == "llama-bpe" || pre == "smaug-bpe")
    pattern = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  else if (pre == "default" || pre == "gpt-2" || pre == "gpt2")
    pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
  else
    throw Error(errc::unsupported, where + ": tokenizer.ggml.pre '" + pre +
                                     "' is not supported (qwen2, llama-bpe, gpt2/default)");
  json vocab = json::object();
  json added = json::array();
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const int t = types ? static_cast<int>((*types)[i]) : 1;
    // 3: control (<|im_start|>), 4: user-defined: matched whole in the text.
    if (t == 3 || t == 4)
      added.push_back({{"id", static_cast<int64_t>(i)}, {"content", tokens[i]}, {"special", t == 3}});
    else
      vocab[tokens[i]] = static_cast<int64_t>(i);
  }
  json j = {{"model", {{"type", "BPE"}, {"vocab", std::move(vocab)}, {"merges", *merges}}},
            {"pre_tokenizer",
             {{"type", "Sequence"},
              {"pretokenizers",
               json::array({{{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
                            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}}},
            {"added_tokens", std::move(added)}};
  return make_hf_tokenizer(f.path(), j.dump());
}

} // namespace

std::unique_ptr<Tokenizer> make_gguf_tokenizer(const std::string& path) {
  GgufFile f(path);
  const std::string where = "GGUF file '" + path + "'";
  const auto model = f.opt_string("tokenizer.ggml.model");
  if (!model)
    throw Error(errc::bad_config, where + " carries no tokenizer (tokenizer.ggml.model is missing)");
  const auto* tokens = f.opt_strings("tokenizer.ggml.tokens");
  if (!tokens || tokens->empty())
    throw Error(errc::bad_config, where + ": tokenizer.ggml.tokens is missing or empty");
  if (*model == "llama")
    return spm_from(f, *tokens);
  if (*model == "gpt2")
    return bpe_from(f, *tokens);
  throw Error(errc::unsupported, where + ": tokenizer.ggml.model '" + *model + "' is not supported (llama, gpt2)");
}

} // namespace strata::model::detail
