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
  /// Maps only bytes [offset, offset + length) of `path` (the pages around
  /// them); data() points at `offset`. Throws Error(io / corrupt) when the file
  /// cannot be mapped or is shorter.
  MappedFile(const std::string& path, uint64_t offset, std::size_t length);
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
  void* base_ = nullptr;   // the mapping (page-aligned), when it differs from data_
  std::size_t mapped_ = 0; // its length
};

} // namespace strata::model
