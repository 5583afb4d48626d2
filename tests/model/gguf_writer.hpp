#pragma once
// A minimal GGUF (v3) writer for tests: metadata and tensors, with knobs to make
// the file lie (offsets, counts, lengths). Not a product feature.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace strata::test {

class GgufWriter {
public:
  uint32_t version = 3;
  // Extra bytes added to the declared length of the next string written (a lie).
  void u32(uint32_t v) { put(&v, 4); }
  void u64(uint64_t v) { put(&v, 8); }
  void str(const std::string& s) {
    u64(s.size());
    meta_.append(s);
  }

  void kv_string(const std::string& k, const std::string& v) {
    key(k, 8);
    str(v);
    ++n_kv_;
  }
  void kv_u32(const std::string& k, uint32_t v) {
    key(k, 4);
    u32(v);
    ++n_kv_;
  }
  void kv_f32(const std::string& k, float v) {
    key(k, 6);
    put(&v, 4);
    ++n_kv_;
  }
  void kv_strings(const std::string& k, const std::vector<std::string>& v) {
    key(k, 9);
    u32(8);
    u64(v.size());
    for (auto& s : v)
      str(s);
    ++n_kv_;
  }
  void kv_f32s(const std::string& k, const std::vector<float>& v) {
    key(k, 9);
    u32(6);
    u64(v.size());
    for (float f : v)
      put(&f, 4);
    ++n_kv_;
  }
  void kv_i32s(const std::string& k, const std::vector<int32_t>& v) {
    key(k, 9);
    u32(5);
    u64(v.size());
    for (int32_t x : v)
      put(&x, 4);
    ++n_kv_;
  }
  /// Raw metadata bytes (for lies); counts as `entries` keys.
  void raw_meta(const std::string& bytes, uint64_t entries) {
    meta_ += bytes;
    n_kv_ += entries;
  }

  /// A tensor: dims innermost first (as GGUF stores them), ggml type, bytes.
  void tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t type, const std::string& bytes,
              int64_t offset_lie = 0) {
    tensors_.push_back({name, std::move(dims), type, bytes, offset_lie});
  }
  /// f32 tensor from values.
  void tensor_f32(const std::string& name, std::vector<uint64_t> dims, const std::vector<float>& v) {
    std::string b(v.size() * 4, '\0');
    std::memcpy(b.data(), v.data(), b.size());
    tensor(name, std::move(dims), 0, b);
  }

  std::string bytes() const {
    std::string out = "GGUF";
    auto add = [&](const void* p, std::size_t n) { out.append(static_cast<const char*>(p), n); };
    add(&version, 4);
    const uint64_t nt = tensors_.size();
    add(&nt, 8);
    add(&n_kv_, 8);
    out += meta_;
    uint64_t off = 0;
    std::vector<uint64_t> offsets;
    for (auto& t : tensors_) {
      offsets.push_back(off);
      off += (t.bytes.size() + 31) / 32 * 32;
    }
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      auto& t = tensors_[i];
      const uint64_t n = t.name.size();
      add(&n, 8);
      out += t.name;
      const auto nd = static_cast<uint32_t>(t.dims.size());
      add(&nd, 4);
      for (auto d : t.dims)
        add(&d, 8);
      add(&t.type, 4);
      const uint64_t o = offsets[i] + static_cast<uint64_t>(t.offset_lie);
      add(&o, 8);
    }
    out.resize((out.size() + 31) / 32 * 32, '\0');
    for (auto& t : tensors_) {
      out += t.bytes;
      out.resize((out.size() + 31) / 32 * 32, '\0');
    }
    return out;
  }

private:
  struct T {
    std::string name;
    std::vector<uint64_t> dims;
    uint32_t type;
    std::string bytes;
    int64_t offset_lie;
  };
  void put(const void* p, std::size_t n) { meta_.append(static_cast<const char*>(p), n); }
  void key(const std::string& k, uint32_t type) {
    str(k);
    u32(type);
  }
  std::string meta_;
  uint64_t n_kv_ = 0;
  std::vector<T> tensors_;
};

} // namespace strata::test
