#pragma once
// Internal to model/: weight rows regrouped for a kernel (the "packed" layout
// of a WMatrix). Only the layout lives here: which CPUs use it is the kernels'
// choice (kernels_q.hpp: pack_for_kernels). Torch-free.
//
// q8_0, packed: each row keeps its bytes (row_bytes() is unchanged) but its
// first 8 * (nb / 8) blocks go in groups of 8: the 8 f16 scales (16 bytes),
// then 8 steps of 32 bytes where step s holds values 4s .. 4s+3 of block j at
// bytes 4j .. 4j+3, each stored as the unsigned byte value + 128. One 32-byte
// vector then carries 4 values of each of 8 blocks, so an int8 dot product
// (vpdpbusd) leaves block j's sum in lane j after the 8 steps, and the 8 block
// scales meet those sums in one vector operation. The last nb % 8 = L blocks
// form a partial group laid out alike with L lanes: L scales, then 8 steps of
// 4L bytes (34L bytes, as their plain form). Groups then go in pairs (2p,
// 2p + 1, wherever group 2p + 1 exists, full or partial): both groups' scales
// (16 + 2L bytes), then step s of the one and step s of the other side by side
// (32 + 4L bytes), so one 64-byte load carries a step of up to 16 blocks; a
// last group without a partner keeps the single-group form.
//
// q4_K, packed: each 144-byte block keeps its 16 header bytes (d, dmin, the
// 12 bytes of 6-bit scales and mins, re-encoded for one vector decode: bytes
// 4-11 the low 4 bits of scale j (low nibble) and min j (high nibble), bytes
// 12-15 a word whose bits 2j, 2j+1 are scale j's top 2 bits and bits 16 + 2j,
// 17 + 2j min j's); its 128 bytes of nibbles go in 4 chunks
// of 32 where byte 4j + l of chunk k holds value 4k + l of sub-block j (low
// nibble) and value 4k + 16 + l (high nibble). One load and two masks then
// give 4 values of each of the 8 sub-blocks, lane j for sub-block j, the same
// lanes as the activations of a packed q8_0 group (a q4_K block is 8 blocks
// of 32). iq4_xs, packed: alike, each 136-byte block keeping its 8 header
// bytes (d, the high and low bits of the 8 scales) before its 4 chunks.
//
// q4_0, q5_0, q4_1 and q5_1, packed: groups of 8 blocks as q8_0's (a partial
// last group of L = nb % 8 laid out alike), each group (L blocks) being its L
// f16 scales, (q4_1, q5_1) its L f16 mins, then 4 chunks of 4L bytes where
// byte 4j + l of chunk k holds value 4k + l of block j (low nibble) and value
// 4k + 16 + l (high nibble), then (q5_0, q5_1) the 4L bytes of 5th bits, byte
// 4j + l holding in bit k value 4k + l's and in bit 4 + k value 4k + 16 + l's
// (k, l < 4): beside the nibbles they complete, so a shift and a mask bring
// each to bit 4 of its byte. iq4_nl blocks (an f16 scale and 16 bytes of
// nibbles, as q4_0's) pack as q4_0. q5_K, packed: as q4_K, with its 32 bytes
// of 5th bits (bytes 16-47, before the chunks) re-encoded alike: bit k of
// byte 4j + l is value 4k + l of sub-block j's, bit 4 + k value 4k + 16 + l's.
//
// q2_K, packed: each 84-byte block keeps its 16 bytes of scales (scale | min
// << 4 of each group of 16) and its f16 d, dmin (bytes 80-83); its 64 bytes
// of 2-bit values hold value 4k + l of group g in bits 2k, 2k+1 of byte
// 4g + l. One 64-byte load and a shift and a mask then give 4 values of each
// of the 16 groups, lane g for group g (activations: QuantActs::qi16).
//
// q3_K, packed: its 12 bytes of scales and f16 d stay (bytes 96-109); bytes
// 0-63 hold the 2 low bits of each value as packed q2_K's, bytes 64-95 the
// 3rd bits as 4 little-endian 64-bit words: bit x = 4g + l (the lane byte of
// the 2 low bits) of word k is value 4k + l of group g's, so step k's 3rd
// bits are one mask register.
//
// q6_K, packed: its 16 int8 scales and f16 d stay (bytes 192-209); lane byte
// x = 4g + l (l < 4) of step k (k < 4) stands for value 4k + l of group g
// (of 16): its low 4 bits in byte 64 (k % 2) + x (the low nibble for k < 2,
// the high one for k >= 2), its high 2 bits at bits 2k, 2k + 1 of byte 128 +
// x. Two 64-byte loads of nibbles and one of high bits give every step.

#include "model/formats/wmatrix.hpp"

#include <cstdint>
#include <functional>

namespace strata::model::detail {

/// Blocks per group of the packed layout.
constexpr int64_t pack_group = 8;

/// Whether `m` can take a packed layout (plain q8_0, q4_0, q5_0, q4_1, q5_1, iq4_nl, q4_K, q5_K,
/// q6_K, iq4_xs, q2_K or q3_K).
bool packable(const WMatrix& m);
/// Calls f(r0, r1) over pieces covering rows [0, rows), in any order and on
/// any threads (pack_rows' rows are independent).
using RowRunner = std::function<void(int64_t rows, const std::function<void(int64_t, int64_t)>& f)>;
/// A packed copy of a packable matrix (an owned buffer), its rows converted
/// through `run` (all on the calling thread when empty); throws
/// Error(bad_argument) for any other.
WMatrix pack_rows(const WMatrix& m, const RowRunner& run = {});
/// Rows r .. r+n-1 of `m` in the plain layout of its type, into `out`
/// (n * m.row_bytes() bytes): a copy when `m` is not packed.
void unpack_rows(const WMatrix& m, int64_t r, int64_t n, uint8_t* out);
/// Rows r .. r+n-1 of `m` as floats (n * m.cols), whatever its layout.
void dequantize_rows(const WMatrix& m, int64_t r, int64_t n, float* out);

} // namespace strata::model::detail
