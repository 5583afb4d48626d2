#pragma once
// Read-only memory map of a whole file (RAII). Torch-free.

#include <cstddef>
#include <cstdint>
#include <string>

namespace strata::model {

class MappedFile {
public:
  /// Maps `path`; throws Error(io) naming the path on failure.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(MappedFile&&) noexcept;
  MappedFile& operator=(MappedFile&&) = delete;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::string& path() const { return path_; }

private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

} // namespace strata::model
