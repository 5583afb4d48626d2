#pragma once
// Our own safetensors reader and writer: an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}}, then raw data.
// Reading maps the file; tensors are views into the map. Torch-free.

#include "model/base/mapped_file.hpp"
#include "model/formats/quant.hpp"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace strata::model {

enum class DType : uint8_t { f32, f16, bf16 };
const char* to_string(DType d);
std::size_t dtype_size(DType d);

struct TensorView {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr; // points into the mapped file
  std::size_t nbytes = 0;
  int64_t numel() const;
};

class SafetensorsFile {
public:
  /// Maps and validates `path`: every offset inside the data section, sizes
  /// matching dtype x shape, known dtypes. Throws Error naming file and tensor.
  explicit SafetensorsFile(const std::string& path);

  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  const TensorView& at(const std::string& name) const;
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::string& path() const { return file_.path(); }

private:
  MappedFile file_;
  std::map<std::string, TensorView> tensors_;
};

/// A tensor to write: f32 data with a shape, stored as `dtype`.
struct TensorToWrite {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
  DType dtype = DType::f32;
};

/// Writes a safetensors file (f16/bf16 are rounded to nearest even).
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors);

} // namespace strata::model
