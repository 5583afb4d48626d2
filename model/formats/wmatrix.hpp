#pragma once
// Internal to model/: a weight matrix as it is kept in memory, in its own type
// (f32, f16, bf16 or GGUF blocks), and a linear layer's weight as matrices
// stacked by output rows. Torch-free.

#include "model/formats/quant.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace strata::model::detail {

/// (rows, cols), row-major as in torch.nn.Linear; each row is cols / block_values
/// blocks of `type`. `data` points into memory `keep` holds alive (an owned
/// buffer or a mapped file).
struct WMatrix {
  WType type = WType::f32;
  int64_t rows = 0;
  int64_t cols = 0;
  const uint8_t* data = nullptr;
  std::shared_ptr<const void> keep;
  /// The rows are in a kernel's packed layout (packed.hpp), not the type's
  /// plain blocks: read them through packed.hpp's functions.
  bool packed = false;

  std::size_t row_bytes() const { return model::row_bytes(type, cols); }
  std::size_t bytes() const { return row_bytes() * static_cast<std::size_t>(rows); }
  const uint8_t* row(int64_t r) const { return data + row_bytes() * static_cast<std::size_t>(r); }
  const float* f32() const { return reinterpret_cast<const float*>(data); }
};

/// An owned copy of `n` floats as an f32 matrix (rows, cols).
WMatrix owned_f32(std::vector<float> values, int64_t rows, int64_t cols);
/// `m` converted to `type` (a new owned buffer); `m` itself when it already is.
/// Throws Error(unsupported) when `type` cannot be produced (K types) and
/// Error(bad_config) when the columns are not a multiple of its block.
WMatrix convert(const WMatrix& m, WType type);

/// A linear layer's weight: `parts` stacked by output rows (q | k | v, gate | up),
/// each in its own type (a Q4_K_M file mixes q4_K and q6_K).
struct Linear {
  std::vector<WMatrix> parts;
  int64_t rows = 0;
  int64_t cols = 0;
  void add(WMatrix m) {
    cols = m.cols;
    rows += m.rows;
    parts.push_back(std::move(m));
  }
  std::size_t bytes() const {
    std::size_t n = 0;
    for (auto& p : parts)
      n += p.bytes();
    return n;
  }
};

} // namespace strata::model::detail
