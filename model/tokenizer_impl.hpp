#pragma once
// Internal to model/: constructors of the file-backed tokenizers.

#include "model/tokenizer.hpp"

namespace strata::model::detail {

std::unique_ptr<Tokenizer> make_llama2c_tokenizer(const std::string& path, const std::string& data);
std::unique_ptr<Tokenizer> make_hf_tokenizer(const std::string& path, const std::string& data);
/// The tokenizer in a GGUF file's metadata.
std::unique_ptr<Tokenizer> make_gguf_tokenizer(const std::string& path);

} // namespace strata::model::detail
