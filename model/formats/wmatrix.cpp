// Weight matrices in memory: owned f32 copies and conversion between resident types.

#include "model/base/error.hpp"
#include "model/formats/wmatrix.hpp"
#include "model/formats/packed.hpp"

#include <memory>
#include <string>
#include <vector>

namespace strata::model::detail {

WMatrix owned_f32(std::vector<float> values, int64_t rows, int64_t cols) {
  auto buf = std::make_shared<std::vector<float>>(std::move(values));
  WMatrix m;
  m.type = WType::f32;
  m.rows = rows;
  m.cols = cols;
  m.data = reinterpret_cast<const uint8_t*>(buf->data());
  m.keep = std::move(buf);
  return m;
}

WMatrix convert(const WMatrix& m, WType type) {
  if (m.type == type)
    return m;
  if (m.cols % block_values(type) != 0)
    throw Error(errc::bad_config, std::string("a matrix of ") + std::to_string(m.cols) + " columns cannot be stored as " +
                                    to_string(type) + " (blocks of " + std::to_string(block_values(type)) + ")");
  auto buf = std::make_shared<std::vector<uint8_t>>(row_bytes(type, m.cols) * static_cast<std::size_t>(m.rows));
  std::vector<float> row(static_cast<std::size_t>(m.cols));
  WMatrix out;
  out.type = type;
  out.rows = m.rows;
  out.cols = m.cols;
  for (int64_t r = 0; r < m.rows; ++r) {
    dequantize_rows(m, r, 1, row.data());
    quantize(type, row.data(), buf->data() + out.row_bytes() * static_cast<std::size_t>(r), m.cols);
  }
  out.data = buf->data();
  out.keep = std::move(buf);
  return out;
}

} // namespace strata::model::detail
