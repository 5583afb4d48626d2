#include "model/formats/safetensors.hpp"

#include "model/base/error.hpp"

#include <nlohmann/json.hpp>

#include <bit>
#include <cstring>
#include <fstream>
#include <limits>

namespace strata::model {

using nlohmann::json;

const char* to_string(DType d) {
  switch (d) {
    case DType::f32: return "F32";
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
  }
  return "?";
}

std::size_t dtype_size(DType d) {
  return d == DType::f32 ? 4 : 2;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (auto s : shape)
    n *= s;
  return n;
}

namespace {

[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  throw Error(errc::corrupt, "safetensors file '" + path + "': " + what);
}

} // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
  const auto size = file_.size();
  if (size < 8)
    throw Error(errc::bad_format, "safetensors file '" + path + "' is shorter than its 8-byte header length");
  uint64_t header_len = 0;
  std::memcpy(&header_len, file_.data(), 8); // little-endian on every platform we build for
  if (header_len > size - 8)
    corrupt(path, "header length " + std::to_string(header_len) + " exceeds the file size " + std::to_string(size));
  if (header_len > (uint64_t{100} << 20))
    corrupt(path, "header length " + std::to_string(header_len) + " is over the 100 MiB limit");
  json header;
  try {
    header = json::parse(file_.data() + 8, file_.data() + 8 + header_len);
  } catch (const json::exception& e) {
    throw Error(errc::bad_format, "safetensors file '" + path + "': header is not JSON (" + e.what() + ")");
  }
  if (!header.is_object())
    throw Error(errc::bad_format, "safetensors file '" + path + "': header is not a JSON object");
  const uint8_t* data_start = file_.data() + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__")
      continue;
    const std::string where = "tensor '" + name + "'";
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets"))
      corrupt(path, where + " lacks dtype, shape or data_offsets");
    TensorView v;
    const auto& dt = entry["dtype"];
    if (!dt.is_string())
      corrupt(path, where + ": dtype is not a string");
    const auto dts = dt.get<std::string>();
    if (dts == "F32")
      v.dtype = DType::f32;
    else if (dts == "F16")
      v.dtype = DType::f16;
    else if (dts == "BF16")
      v.dtype = DType::bf16;
    else
      throw Error(errc::unsupported, "safetensors file '" + path + "': " + where + " has dtype " + dts +
                                       " (supported: F32, F16, BF16)");
    const auto& shape = entry["shape"];
    if (!shape.is_array())
      corrupt(path, where + ": shape is not an array");
    uint64_t numel = 1;
    for (auto& s : shape) {
      if (!s.is_number_integer() || s.get<int64_t>() < 0)
        corrupt(path, where + ": shape has a non-integer or negative dimension");
      auto d = s.get<uint64_t>();
      if (d != 0 && numel > std::numeric_limits<uint64_t>::max() / 8 / d)
        corrupt(path, where + ": shape overflows");
      numel *= d;
      v.shape.push_back(static_cast<int64_t>(d));
    }
    const auto& off = entry["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      corrupt(path, where + ": data_offsets must be two non-negative integers");
    auto begin = off[0].get<uint64_t>();
    auto end = off[1].get<uint64_t>();
    if (begin > end || end > data_size)
      corrupt(path, where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                      "] lie outside the data section of " + std::to_string(data_size) + " bytes");
    if (end - begin != numel * dtype_size(v.dtype))
      corrupt(path, where + ": " + std::to_string(end - begin) + " bytes of data but dtype " + dts + " x shape needs " +
                      std::to_string(numel * dtype_size(v.dtype)));
    v.data = data_start + begin;
    v.nbytes = end - begin;
    tensors_.emplace(name, std::move(v));
  }
}

const TensorView& SafetensorsFile::at(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end())
    throw Error(errc::missing_tensor, "safetensors file '" + path() + "' has no tensor '" + name + "'");
  return it->second;
}

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors) {
  json header = json::object();
  uint64_t offset = 0;
  for (auto& t : tensors) {
    int64_t numel = 1;
    for (auto s : t.shape)
      numel *= s;
    if (numel != static_cast<int64_t>(t.data.size()))
      throw Error(errc::bad_argument, "write_safetensors: tensor '" + t.name + "' shape does not match its data");
    const uint64_t n = static_cast<uint64_t>(numel) * dtype_size(t.dtype);
    header[t.name] = {{"dtype", to_string(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0)
    h.push_back(' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out)
    throw Error(errc::io, "cannot write '" + path + "'");
  const uint64_t hl = h.size();
  out.write(reinterpret_cast<const char*>(&hl), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (auto& t : tensors) {
    if (t.dtype == DType::f32) {
      out.write(reinterpret_cast<const char*>(t.data.data()), static_cast<std::streamsize>(t.data.size() * 4));
    } else {
      std::vector<uint16_t> buf(t.data.size());
      for (std::size_t i = 0; i < buf.size(); ++i)
        buf[i] = t.dtype == DType::f16 ? f32_to_f16(t.data[i]) : f32_to_bf16(t.data[i]);
      out.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size() * 2));
    }
  }
  if (!out)
    throw Error(errc::io, "short write to '" + path + "'");
}

} // namespace strata::model
