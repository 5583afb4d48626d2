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
/// and the types llama-quantize writes as fallbacks and in the other mixes:
///   q4_1: 32 = f16 d, f16 m, 16 bytes of nibbles;          x = d * q + m
///   q5_0: 32 = f16 d, u32 of 5th bits, 16 bytes of nibbles; x = d * (q - 16)
///   q5_1: 32 = f16 d, f16 m, u32 of 5th bits, nibbles;      x = d * q + m
///   q2_K: 256 = 16 bytes of 4-bit scale|min, 64 bytes of 2-bit values, f16 d, f16 dmin
///   q3_K: 256 = 32 bytes of 3rd bits, 64 bytes of 2-bit values, 12 bytes of 6-bit scales, f16 d
///   q5_K: 256 = q4_K's fields plus 32 bytes of 5th bits
///   iq4_nl: 32 = f16 d, nibbles indexing a fixed non-linear table of 16 int8
///   iq4_xs: 256 = f16 d, 6-bit scales per 32 (u16 high bits, 4 bytes low bits), 128 bytes of
///           iq4_nl nibbles
enum class WType : uint8_t { f32, f16, bf16, q8_0, q4_0, q4_K, q6_K, q4_1, q5_0, q5_1, q2_K, q3_K, q5_K, iq4_nl, iq4_xs };

/// Every type, in declaration order.
inline constexpr WType all_wtypes[] = {WType::f32,  WType::f16,  WType::bf16, WType::q8_0,   WType::q4_0,
                                       WType::q4_K, WType::q6_K, WType::q4_1, WType::q5_0,   WType::q5_1,
                                       WType::q2_K, WType::q3_K, WType::q5_K, WType::iq4_nl, WType::iq4_xs};

/// The 16 values an iq4_nl / iq4_xs nibble stands for (times the block's scale).
inline constexpr int8_t iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

const char* to_string(WType t);
/// The names of to_string ("f32", "q4_K", "iq4_xs", ...), K types also in lower case ("q4_k").
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
/// for f32, f16, bf16, q8_0, q4_0 and q4_K; throws Error(unsupported) for the
/// others (they are read from GGUF files, never produced).
void quantize(WType t, const float* src, uint8_t* dst, int64_t n);
/// One q8_0 block of 32 values into 34 bytes, as quantize() writes it (d =
/// amax / 127 as f16, each value x / d rounded half away from zero): the KV
/// cache's rows, and the queries of a q8_0 cache's integer attention scores.
void quantize_q8_0_block(const float* x, uint8_t* dst);

/// The 16 6-bit scales packed in a q3_K block's 12 scale bytes, one a byte (not
/// yet minus 32), as four little-endian words.
inline void q3_K_scale_words(const uint8_t* packed, uint32_t aux[4]) {
  uint32_t a[3];
  __builtin_memcpy(a, packed, 12);
  constexpr uint32_t m1 = 0x03030303u, m4 = 0x0f0f0f0fu;
  aux[0] = (a[0] & m4) | (((a[2] >> 0) & m1) << 4);
  aux[1] = (a[1] & m4) | (((a[2] >> 2) & m1) << 4);
  aux[2] = ((a[0] >> 4) & m4) | (((a[2] >> 4) & m1) << 4);
  aux[3] = ((a[1] >> 4) & m4) | (((a[2] >> 6) & m1) << 4);
}
/// The 16 signed 6-bit scales (minus 32) packed in a q3_K block's 12 scale bytes.
void q3_K_scales(const uint8_t* packed, int8_t out[16]);

/// Scalar conversions (f16 / bf16 round to nearest even).
float f16_to_f32(uint16_t h);
float bf16_to_f32(uint16_t b);
uint16_t f32_to_f16(float f);
uint16_t f32_to_bf16(float f);

} // namespace strata::model
