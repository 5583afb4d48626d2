// What every TensorSource shares: the default matrix loader (widening through f32),
// the dtype a source is served in, and the dispatch from a model spec to its loader.

#include "model/base/error.hpp"
#include "model/formats/source.hpp"

#include <cstring>
#include <filesystem>
#include <fstream>

namespace strata::model::detail {

namespace fs = std::filesystem;

bool is_gguf_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i)
    out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::optional<std::pair<int64_t, std::string>> split_layer_name(const std::string& name) {
  if (name.size() < 3 || name[0] != 'L')
    return std::nullopt;
  auto dot = name.find('.');
  return std::make_pair(std::stoll(name.substr(1, dot - 1)), name.substr(dot + 1));
}

WMatrix TensorSource::load_matrix(const std::string& name, int64_t rows, int64_t cols) {
  return owned_f32(load(name, {rows, cols}), rows, cols);
}

std::string resolve_dtype(const TensorSource& src, const std::string& dtype) {
  if (src.native_types()) {
    if (dtype != "auto")
      throw Error(errc::bad_argument, "--dtype " + dtype + " cannot convert a GGUF file '" + src.config().identity +
                                        "': its tensors are served in the types the file stores (use --dtype auto)");
    return src.config().dtype;
  }
  if (dtype == "auto" || dtype == "f32")
    return "f32";
  if (dtype == "bf16" || dtype == "q8_0" || dtype == "q4_0")
    return dtype;
  if (dtype == "q4_K" || dtype == "q4_k")
    return "q4_K";
  throw Error(errc::bad_argument, "unknown --dtype '" + dtype + "' (auto, f32, bf16, q8_0, q4_0, q4_K)");
}

std::vector<WMatrix> TensorSource::load_experts(const std::string& name, int64_t, int64_t, int64_t) {
  throw Error(errc::unsupported, "model '" + config().identity + "' has no experts ('" + name +
                                   "'): mixtures of experts are read from GGUF files");
}

std::unique_ptr<TensorSource> open_source(const std::string& spec) {
  if (spec.rfind("builtin:", 0) == 0)
    return open_builtin(spec.substr(8));
  std::error_code ec;
  if (fs::is_directory(spec, ec))
    return open_hf_dir(spec);
  if (!fs::exists(spec, ec))
    throw Error(errc::io, "model '" + spec + "' does not exist (expected a llama2.c .bin file, a Hugging Face "
                          "directory or builtin:NAME)");
  if (is_gguf_file(spec))
    return open_gguf(spec);
  if (fs::path(spec).extension() == ".gguf") // never read as another format
    throw Error(errc::bad_format, "'" + spec + "' is named .gguf but is not a GGUF file (no GGUF magic)");
  return open_llama2c(spec);
}

} // namespace strata::model::detail
