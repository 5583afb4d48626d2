#pragma once
// Weight types kept resident in memory, and their blocks as GGUF defines them:
// element <-> block arithmetic, dequantization to f32 and quantization from f32.
// Torch-free.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace strata::model {

/// How a weight matrix is stored. The quantized types are blocks along a row:
///   q8_0: 32 values = f16 scale d + 32 int8;                x = d * q
///   q4_0: 32 values = f16 d + 16 bytes of nibbles;         x = d * (q - 8)
///   q4_K: 256 values = f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
///   q6_K: 256 values = 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, f16 d
enum class WType : uint8_t { f32, f16, bf16, q8_0, q4_0, q4_K, q6_K };

const char* to_string(WType t);
/// "f32", "f16", "bf16", "q8_0", "q4_0", "q4_K" (or "q4_k"), "q6_K" (or "q6_k").
std::optional<WType> parse_wtype(const std::string& s);
/// Values per block (1 for f32/f16/bf16).
int64_t block_values(WType t);
/// Bytes per block.
std::size_t block_bytes(WType t);
/// Bytes of a row of `cols` values; `cols` must be a multiple of block_values(t).
std::size_t row_bytes(WType t, int64_t cols);

/// Dequantizes `n` values (a multiple of block_values(t)) starting at `src`.
void dequantize(WType t, const uint8_t* src, float* dst, int64_t n);
/// Quantizes `n` values (a multiple of block_values(t)) as llama.cpp's reference
/// quantizers do (round to nearest; q4_0 takes the signed extreme as -8 d);
/// q4_K with a simple min/max quantizer (not llama.cpp's search). Implemented
/// for f32, f16, bf16, q8_0, q4_0 and q4_K; throws Error(unsupported) for q6_K.
void quantize(WType t, const float* src, uint8_t* dst, int64_t n);

/// Scalar conversions (f16 / bf16 round to nearest even).
float f16_to_f32(uint16_t h);
float bf16_to_f32(uint16_t b);
uint16_t f32_to_f16(float f);
uint16_t f32_to_bf16(float f);

} // namespace strata::model
