#include "model/base/mapped_file.hpp"

#include "model/base/error.hpp"

#include <cerrno>
#include <cstring>
#include <utility>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace strata::model {

namespace {

// Opens `path` read-only and returns the descriptor and the file's size;
// throws Error(io) unless it is a regular file.
std::pair<int, uint64_t> open_regular(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw Error(errc::io, "cannot open '" + path + "': " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(errc::io, "'" + path + "' is not a regular file");
  }
  return {fd, static_cast<uint64_t>(st.st_size)};
}

} // namespace

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const auto [fd, fsize] = open_regular(path);
  size_ = static_cast<std::size_t>(fsize);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      throw Error(errc::io, "cannot map '" + path + "': " + std::strerror(e));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

MappedFile::MappedFile(const std::string& path, uint64_t offset, std::size_t length) : path_(path) {
  const auto [fd, fsize] = open_regular(path);
  if (offset > fsize || length > fsize - offset) {
    ::close(fd);
    throw Error(errc::corrupt, "'" + path + "' has " + std::to_string(fsize) + " bytes, fewer than the " +
                                 std::to_string(length) + " wanted at offset " + std::to_string(offset));
  }
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t start = offset / page * page;
  mapped_ = static_cast<std::size_t>(offset - start) + length;
  size_ = length;
  if (mapped_ > 0) {
    void* p = ::mmap(nullptr, mapped_, PROT_READ, MAP_PRIVATE, fd, static_cast<off_t>(start));
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      throw Error(errc::io, "cannot map '" + path + "': " + std::strerror(e));
    }
    base_ = p;
    data_ = static_cast<const uint8_t*>(p) + (offset - start);
  }
  ::close(fd);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
  : path_(std::move(other.path_)), data_(other.data_), size_(other.size_), base_(other.base_), mapped_(other.mapped_) {
  other.data_ = nullptr;
  other.size_ = 0;
  other.base_ = nullptr;
  other.mapped_ = 0;
}

MappedFile::~MappedFile() {
  if (base_ != nullptr)
    ::munmap(base_, mapped_);
  else if (data_ != nullptr)
    ::munmap(const_cast<uint8_t*>(data_), size_);
}

} // namespace strata::model
