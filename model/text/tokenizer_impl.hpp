#pragma once
// Internal to model/: constructors of the file-backed tokenizers.

#include "model/text/tokenizer.hpp"

#include <nlohmann/json.hpp>

namespace strata::model::detail {

std::unique_ptr<Tokenizer> make_llama2c_tokenizer(const std::string& path, const std::string& data);
std::unique_ptr<Tokenizer> make_hf_tokenizer(const std::string& path, const std::string& data);
/// tokenizer.json of SentencePiece-style BPE (no ByteLevel step; tokenizer_hf_spm.cpp).
std::unique_ptr<Tokenizer> make_hf_spm_tokenizer(const std::string& path, const nlohmann::json& j);
/// Whether a tokenizer.json names ByteLevel in its pre-tokenizer or decoder.
bool hf_is_byte_level(const nlohmann::json& j);
/// The tokenizer in a GGUF file's metadata.
std::unique_ptr<Tokenizer> make_gguf_tokenizer(const std::string& path);

} // namespace strata::model::detail
