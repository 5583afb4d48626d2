// GGUF reader: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
// Little-endian. Header: "GGUF", u32 version, u64 tensor count, u64 metadata
// count; then metadata (string key, u32 type, value), tensor infos (string
// name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64 offset), padding to
// general.alignment (32 by default), and the data section.

#include "model/formats/gguf.hpp"

#include "model/base/error.hpp"

#include <cstring>

namespace strata::model {

namespace {

const char* kind_name(GgufValue::Kind k) {
  static const char* names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64"};
  return names[static_cast<int>(k)];
}

// A bounds-checked cursor over the file.
class Reader {
public:
  Reader(const std::string& name, const uint8_t* data, std::size_t size) : name_(name), p_(data), size_(size) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(errc::corrupt, "GGUF file '" + name_ + "': " + what + " (at byte " + std::to_string(off_) + " of " +
                                 std::to_string(size_) + ")");
  }
  std::size_t left() const { return size_ - off_; }
  std::size_t offset() const { return off_; }

  template <class T>
  T get(const std::string& what) {
    if (left() < sizeof(T))
      fail(what + " is cut off: the file ends");
    T v;
    std::memcpy(&v, p_ + off_, sizeof(T));
    off_ += sizeof(T);
    return v;
  }

  std::string string(const std::string& what) {
    const auto n = get<uint64_t>(what + " length");
    if (n > left())
      fail(what + " claims " + std::to_string(n) + " bytes but " + std::to_string(left()) + " are left");
    std::string s(reinterpret_cast<const char*>(p_ + off_), static_cast<std::size_t>(n));
    off_ += static_cast<std::size_t>(n);
    return s;
  }

private:
  std::string name_;
  const uint8_t* p_;
  std::size_t size_;
  std::size_t off_ = 0;
};

std::size_t min_size(GgufValue::Kind k) {
  using K = GgufValue::Kind;
  switch (k) {
    case K::u8: case K::i8: case K::boolean: return 1;
    case K::u16: case K::i16: return 2;
    case K::u32: case K::i32: case K::f32: return 4;
    case K::string: case K::u64: case K::i64: case K::f64: return 8;
    case K::array: return 12;
  }
  return 1;
}

GgufValue read_value(Reader& r, uint32_t type, const std::string& key, int depth) {
  using K = GgufValue::Kind;
  if (type > 12)
    r.fail("metadata key '" + key + "' has unknown value type " + std::to_string(type));
  GgufValue v;
  v.kind = static_cast<K>(type);
  switch (v.kind) {
    case K::u8: v.scalar = uint64_t{r.get<uint8_t>(key)}; break;
    case K::i8: v.scalar = int64_t{r.get<int8_t>(key)}; break;
    case K::u16: v.scalar = uint64_t{r.get<uint16_t>(key)}; break;
    case K::i16: v.scalar = int64_t{r.get<int16_t>(key)}; break;
    case K::u32: v.scalar = uint64_t{r.get<uint32_t>(key)}; break;
    case K::i32: v.scalar = int64_t{r.get<int32_t>(key)}; break;
    case K::u64: v.scalar = r.get<uint64_t>(key); break;
    case K::i64: v.scalar = r.get<int64_t>(key); break;
    case K::f32: v.scalar = double{r.get<float>(key)}; break;
    case K::f64: v.scalar = r.get<double>(key); break;
    case K::boolean: {
      const auto b = r.get<uint8_t>(key);
      if (b > 1)
        r.fail("metadata key '" + key + "' is a bool holding " + std::to_string(b));
      v.scalar = b == 1;
      break;
    }
    case K::string: v.scalar = r.string("metadata key '" + key + "'"); break;
    case K::array: {
      if (depth >= 2)
        r.fail("metadata key '" + key + "' nests arrays more than two deep");
      const auto et = r.get<uint32_t>(key + " element type");
      if (et > 12)
        r.fail("metadata key '" + key + "' is an array of unknown type " + std::to_string(et));
      v.elem = static_cast<K>(et);
      const auto n = r.get<uint64_t>(key + " element count");
      if (n > r.left() / min_size(v.elem))
        r.fail("metadata key '" + key + "' claims " + std::to_string(n) + " elements of " + kind_name(v.elem) +
               " but " + std::to_string(r.left()) + " bytes are left");
      if (v.elem == K::string) {
        v.strings.reserve(static_cast<std::size_t>(n));
        for (uint64_t i = 0; i < n; ++i)
          v.strings.push_back(r.string("metadata key '" + key + "' element " + std::to_string(i)));
      } else {
        v.items.reserve(static_cast<std::size_t>(n));
        for (uint64_t i = 0; i < n; ++i)
          v.items.push_back(read_value(r, et, key, depth + 1));
      }
      break;
    }
  }
  return v;
}

// Bytes per block and values per block of every ggml type we know the size of.
struct TypeInfo {
  const char* name;
  int64_t block;
  std::size_t bytes;
};

const TypeInfo* type_info(uint32_t t) {
  static const TypeInfo table[] = {
    {"f32", 1, 4},       {"f16", 1, 2},       {"q4_0", 32, 18},    {"q4_1", 32, 20},   {nullptr, 0, 0},
    {nullptr, 0, 0},     {"q5_0", 32, 22},    {"q5_1", 32, 24},    {"q8_0", 32, 34},   {"q8_1", 32, 36},
    {"q2_K", 256, 84},   {"q3_K", 256, 110},  {"q4_K", 256, 144},  {"q5_K", 256, 176}, {"q6_K", 256, 210},
    {"q8_K", 256, 292},  {"iq2_xxs", 256, 66}, {"iq2_xs", 256, 74}, {"iq3_xxs", 256, 98}, {"iq1_s", 256, 50},
    {"iq4_nl", 32, 18},  {"iq3_s", 256, 110}, {"iq2_s", 256, 82},  {"iq4_xs", 256, 136}, {"i8", 1, 1},
    {"i16", 1, 2},       {"i32", 1, 4},       {"i64", 1, 8},       {"f64", 1, 8},      {"iq1_m", 256, 56},
    {"bf16", 1, 2},
  };
  if (t < sizeof table / sizeof table[0] && table[t].name)
    return &table[t];
  return nullptr;
}

std::optional<WType> resident(uint32_t t) {
  switch (t) {
    case 0: return WType::f32;
    case 1: return WType::f16;
    case 2: return WType::q4_0;
    case 3: return WType::q4_1;
    case 6: return WType::q5_0;
    case 7: return WType::q5_1;
    case 8: return WType::q8_0;
    case 10: return WType::q2_K;
    case 11: return WType::q3_K;
    case 13: return WType::q5_K;
    case 20: return WType::iq4_nl;
    case 23: return WType::iq4_xs;
    case 12: return WType::q4_K;
    case 14: return WType::q6_K;
    case 30: return WType::bf16;
    default: return std::nullopt;
  }
}

} // namespace

std::string ggml_type_name(uint32_t type) {
  if (auto* t = type_info(type))
    return t->name;
  return "type " + std::to_string(type);
}

int64_t GgufTensor::numel() const {
  int64_t n = 1;
  for (auto d : dims)
    n *= d;
  return n;
}

GgufFile::GgufFile(const std::string& path) : name_(path), file_(std::make_shared<MappedFile>(path)) {
  parse(file_->data(), file_->size());
}

GgufFile::GgufFile(const std::string& name, const uint8_t* data, std::size_t size) : name_(name) {
  parse(data, size);
}

void GgufFile::parse(const uint8_t* data, std::size_t size) {
  if (size < 4 || std::memcmp(data, "GGUF", 4) != 0)
    throw Error(errc::bad_format, "'" + name_ + "' is not a GGUF file (no GGUF magic)");
  Reader r(name_, data, size);
  r.get<uint32_t>("magic");
  version_ = r.get<uint32_t>("version");
  if (version_ != 2 && version_ != 3)
    throw Error(errc::unsupported, "GGUF file '" + name_ + "' has version " + std::to_string(version_) +
                                     " (versions 2 and 3 are supported)");
  const auto n_tensors = r.get<uint64_t>("tensor count");
  const auto n_kv = r.get<uint64_t>("metadata count");
  if (n_kv > r.left() / 12)
    r.fail("metadata count " + std::to_string(n_kv) + " does not fit the file");
  if (n_tensors > r.left() / 24)
    r.fail("tensor count " + std::to_string(n_tensors) + " does not fit the file");
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = r.string("metadata key " + std::to_string(i));
    const auto type = r.get<uint32_t>("type of metadata key '" + key + "'");
    GgufValue v = read_value(r, type, key, 0);
    if (!kv_.emplace(key, std::move(v)).second)
      r.fail("metadata key '" + key + "' appears twice");
  }
  uint64_t alignment = 32;
  if (auto* a = find("general.alignment")) {
    if (a->is_array() || !std::holds_alternative<uint64_t>(a->scalar))
      throw Error(errc::corrupt, "GGUF file '" + name_ + "': general.alignment is not an unsigned integer");
    alignment = std::get<uint64_t>(a->scalar);
    if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > (1u << 20))
      throw Error(errc::corrupt, "GGUF file '" + name_ + "': general.alignment " + std::to_string(alignment) +
                                   " is not a power of two up to 1 MiB");
  }
  std::vector<GgufTensor> infos;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensor t;
    t.name = r.string("tensor " + std::to_string(i) + " name");
    const auto nd = r.get<uint32_t>("tensor '" + t.name + "' n_dims");
    if (nd == 0 || nd > 4)
      r.fail("tensor '" + t.name + "' has " + std::to_string(nd) + " dimensions (1 to 4 allowed)");
    uint64_t numel = 1;
    for (uint32_t d = 0; d < nd; ++d) {
      const auto n = r.get<uint64_t>("tensor '" + t.name + "' dims");
      if (n == 0 || n > (uint64_t{1} << 40) || numel > (uint64_t{1} << 48) / n)
        r.fail("tensor '" + t.name + "' has dimension " + std::to_string(n) + " (too large or zero)");
      numel *= n;
      t.dims.push_back(static_cast<int64_t>(n));
    }
    t.ggml_type = r.get<uint32_t>("tensor '" + t.name + "' type");
    t.offset = r.get<uint64_t>("tensor '" + t.name + "' offset");
    t.type = resident(t.ggml_type);
    if (auto* ti = type_info(t.ggml_type)) {
      if (t.dims[0] % ti->block != 0)
        r.fail("tensor '" + t.name + "' of type " + ti->name + " has " + std::to_string(t.dims[0]) +
               " columns, not a multiple of its block of " + std::to_string(ti->block));
      t.nbytes = static_cast<std::size_t>(numel / static_cast<uint64_t>(ti->block)) * ti->bytes;
    }
    if (t.offset % alignment != 0)
      r.fail("tensor '" + t.name + "' offset " + std::to_string(t.offset) + " is not aligned to " +
             std::to_string(alignment));
    infos.push_back(std::move(t));
  }
  const std::size_t data_start = (r.offset() + alignment - 1) / alignment * alignment;
  if (data_start > size && n_tensors > 0)
    throw Error(errc::corrupt, "GGUF file '" + name_ + "' ends before its data section");
  const std::size_t data_size = size > data_start ? size - data_start : 0;
  for (auto& t : infos) {
    if (t.offset > data_size || t.nbytes > data_size - t.offset)
      throw Error(errc::corrupt, "GGUF file '" + name_ + "': tensor '" + t.name + "' (" + ggml_type_name(t.ggml_type) +
                                   ", " + std::to_string(t.nbytes) + " bytes at data offset " + std::to_string(t.offset) +
                                   ") lies beyond the end of the file (data section of " + std::to_string(data_size) +
                                   " bytes)");
    t.data = data + data_start + t.offset;
    t.file_offset = data_start + t.offset;
    const std::string name = t.name;
    if (!tensors_.emplace(name, std::move(t)).second)
      throw Error(errc::corrupt, "GGUF file '" + name_ + "': tensor '" + name + "' appears twice");
  }
}

void GgufFile::release_mapping() {
  file_.reset();
  for (auto& [name, t] : tensors_)
    t.data = nullptr;
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

const GgufTensor* GgufFile::tensor(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

namespace {
[[noreturn]] void wrong_type(const std::string& file, const std::string& key, const char* wanted, const GgufValue& v) {
  throw Error(errc::bad_config, "GGUF file '" + file + "': metadata key '" + key + "' is " +
                                  (v.is_array() ? std::string("an array") : std::string("a ") + kind_name(v.kind)) +
                                  ", expected " + wanted);
}
} // namespace

std::optional<std::string> GgufFile::opt_string(const std::string& key) const {
  const auto* v = find(key);
  if (!v)
    return std::nullopt;
  if (v->kind != GgufValue::Kind::string)
    wrong_type(name_, key, "a string", *v);
  return std::get<std::string>(v->scalar);
}

std::string GgufFile::get_string(const std::string& key) const {
  auto s = opt_string(key);
  if (!s)
    throw Error(errc::bad_config, "GGUF file '" + name_ + "' has no metadata key '" + key + "'");
  return *s;
}

std::optional<int64_t> GgufFile::opt_int(const std::string& key) const {
  const auto* v = find(key);
  if (!v)
    return std::nullopt;
  if (v->is_array())
    wrong_type(name_, key, "an integer", *v);
  if (auto* u = std::get_if<uint64_t>(&v->scalar)) {
    if (*u > static_cast<uint64_t>(INT64_MAX))
      throw Error(errc::bad_config, "GGUF file '" + name_ + "': metadata key '" + key + "' is out of range");
    return static_cast<int64_t>(*u);
  }
  if (auto* i = std::get_if<int64_t>(&v->scalar))
    return *i;
  wrong_type(name_, key, "an integer", *v);
}

int64_t GgufFile::get_int(const std::string& key) const {
  auto i = opt_int(key);
  if (!i)
    throw Error(errc::bad_config, "GGUF file '" + name_ + "' has no metadata key '" + key + "'");
  return *i;
}

std::optional<double> GgufFile::opt_float(const std::string& key) const {
  const auto* v = find(key);
  if (!v)
    return std::nullopt;
  if (!v->is_array()) {
    if (auto* d = std::get_if<double>(&v->scalar))
      return *d;
  }
  if (auto i = opt_int(key))
    return static_cast<double>(*i);
  return std::nullopt;
}

std::optional<bool> GgufFile::opt_bool(const std::string& key) const {
  const auto* v = find(key);
  if (!v)
    return std::nullopt;
  if (v->is_array() || v->kind != GgufValue::Kind::boolean)
    wrong_type(name_, key, "a bool", *v);
  return std::get<bool>(v->scalar);
}

const std::vector<std::string>* GgufFile::opt_strings(const std::string& key) const {
  const auto* v = find(key);
  if (!v)
    return nullptr;
  if (!v->is_array() || v->elem != GgufValue::Kind::string)
    wrong_type(name_, key, "an array of strings", *v);
  return &v->strings;
}

std::optional<std::vector<double>> GgufFile::opt_numbers(const std::string& key) const {
  const auto* v = find(key);
  if (!v)
    return std::nullopt;
  if (!v->is_array() || v->elem == GgufValue::Kind::string || v->elem == GgufValue::Kind::array)
    wrong_type(name_, key, "an array of numbers", *v);
  std::vector<double> out;
  out.reserve(v->items.size());
  for (auto& x : v->items) {
    if (auto* u = std::get_if<uint64_t>(&x.scalar))
      out.push_back(static_cast<double>(*u));
    else if (auto* i = std::get_if<int64_t>(&x.scalar))
      out.push_back(static_cast<double>(*i));
    else if (auto* d = std::get_if<double>(&x.scalar))
      out.push_back(*d);
    else if (auto* b = std::get_if<bool>(&x.scalar))
      out.push_back(*b ? 1.0 : 0.0);
  }
  return out;
}

} // namespace strata::model
