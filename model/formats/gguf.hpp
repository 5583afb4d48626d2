#pragma once
// Our GGUF reader (versions 2 and 3): the header, the metadata key/value pairs
// and the tensor directory, every length and offset checked against the file.
// Tensors are views into the memory-mapped file. Torch-free.

#include "model/base/mapped_file.hpp"
#include "model/formats/quant.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace strata::model {

/// One metadata value. Arrays keep their element type; strings are bytes.
struct GgufValue {
  enum class Kind : uint8_t { u8, i8, u16, i16, u32, i32, f32, boolean, string, array, u64, i64, f64 };
  Kind kind = Kind::u8;
  std::variant<uint64_t, int64_t, double, bool, std::string> scalar;
  Kind elem = Kind::u8;                ///< arrays: the element kind
  std::vector<GgufValue> items;        ///< arrays of numbers and bools
  std::vector<std::string> strings;    ///< arrays of strings (kept apart: vocabularies are large)
  bool is_array() const { return kind == Kind::array; }
};

struct GgufTensor {
  std::string name;
  std::vector<int64_t> dims; ///< as GGUF stores them: dims[0] is the innermost (columns)
  uint32_t ggml_type = 0;
  std::optional<WType> type; ///< nullopt: a type strata does not implement
  uint64_t offset = 0;       ///< from the start of the data section
  uint64_t file_offset = 0;  ///< from the start of the file
  std::size_t nbytes = 0;    ///< 0 when the type is unknown
  const uint8_t* data = nullptr;
  int64_t numel() const;
};

class GgufFile {
public:
  /// Maps and parses `path`. Throws Error(bad_format) when it is not GGUF,
  /// Error(corrupt) naming the key or tensor whose length, type or offset lies,
  /// Error(unsupported) for versions other than 2 and 3.
  explicit GgufFile(const std::string& path);
  /// Parses GGUF bytes already in memory (the fuzz target; `data` must outlive it).
  GgufFile(const std::string& name, const uint8_t* data, std::size_t size);

  const std::string& path() const { return name_; }
  uint32_t version() const { return version_; }
  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  const std::map<std::string, GgufTensor>& tensors() const { return tensors_; }
  const GgufValue* find(const std::string& key) const;
  const GgufTensor* tensor(const std::string& name) const;

  /// Typed metadata access; each throws Error(bad_config) naming the key when it
  /// is present with another type, and (without a default) when it is missing.
  std::string get_string(const std::string& key) const;
  std::optional<std::string> opt_string(const std::string& key) const;
  int64_t get_int(const std::string& key) const;
  std::optional<int64_t> opt_int(const std::string& key) const;
  std::optional<double> opt_float(const std::string& key) const;
  std::optional<bool> opt_bool(const std::string& key) const;
  /// A string array (e.g. tokenizer.ggml.tokens); nullptr when absent.
  const std::vector<std::string>* opt_strings(const std::string& key) const;
  /// A numeric array as doubles; nullopt when absent.
  std::optional<std::vector<double>> opt_numbers(const std::string& key) const;

  /// Drops the mapping of the whole file (metadata and the tensor directory stay;
  /// tensor data pointers become null): a reader then maps only the tensors it
  /// needs (MappedFile with a range, at GgufTensor::file_offset).
  void release_mapping();

private:
  void parse(const uint8_t* data, std::size_t size);

  std::string name_;
  std::shared_ptr<MappedFile> file_;
  uint32_t version_ = 0;
  std::map<std::string, GgufValue> kv_;
  std::map<std::string, GgufTensor> tensors_;
};

/// The name of a ggml tensor type id ("q4_K", "iq2_xs", ...), or "type N".
std::string ggml_type_name(uint32_t type);

} // namespace strata::model
