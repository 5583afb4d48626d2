#pragma once
// Internal to model/: constructors of the file-backed tokenizers.

#include "model/tokenizer.hpp"

namespace strata::model::detail {

std::unique_ptr<Tokenizer> make_llama2c_tokenizer(const std::string& path, const std::string& data);
std::unique_ptr<Tokenizer> make_hf_tokenizer(const std::string& path, const std::string& data);

} // namespace strata::model::detail
