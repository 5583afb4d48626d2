// The packed layouts of q8_0, q4_0, q5_0, q4_1, q5_1, iq4_nl, q4_K, q5_K, q6_K, iq4_xs, q2_K and q3_K rows (see packed.hpp).

#include "model/formats/packed.hpp"

#include "model/base/error.hpp"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace strata::model::detail {

namespace {

constexpr std::size_t q8_block = 34; // f16 scale + 32 int8

uint32_t ld32(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// One row of nb blocks: plain -> packed (pack) or packed -> plain (!pack).
// Group g (of L = 8 blocks, the last one of nb % 8) starts at byte 34 * 8g:
// its L scales, then 8 steps of 4L bytes.
void convert_row(const uint8_t* in, uint8_t* out, int64_t nb, bool pack) {
  for (int64_t g = 0; g * pack_group < nb; ++g) {
    const int L = static_cast<int>(std::min<int64_t>(pack_group, nb - g * pack_group));
    const std::size_t base = static_cast<std::size_t>(g * pack_group) * q8_block;
    const uint8_t* src = in + base;
    uint8_t* dst = out + base;
    for (int j = 0; j < L; ++j) {
      // scale of block j: plain bytes 34j, 34j+1; packed bytes 2j, 2j+1
      std::memcpy(pack ? dst + 2 * j : dst + j * q8_block, pack ? src + j * q8_block : src + 2 * j, 2);
      for (int s = 0; s < 8; ++s)
        for (int l = 0; l < 4; ++l) {
          const std::size_t plain = j * q8_block + 2 + 4 * s + l, packed = 2 * L + 4 * L * s + 4 * j + l;
          if (pack)
            dst[packed] = static_cast<uint8_t>(src[plain] ^ 0x80u);
          else
            dst[plain] = static_cast<uint8_t>(src[packed] ^ 0x80u);
        }
    }
  }
}

// q4_K's 12 bytes of 6-bit scales sc_j and mins m_j (j = 0..7), plain: bytes
// 0-3 sc_j | (sc_{j+4} >> 4) << 6, bytes 4-7 m_j | (m_{j+4} >> 4) << 6, bytes
// 8-11 (sc_{j+4} & 15) | (m_{j+4} & 15) << 4 (j < 4). Packed, for one vector
// decode: bytes 0-7 (sc_j & 15) | (m_j & 15) << 4, then a little-endian word
// whose bits 2j, 2j+1 are sc_j >> 4 and bits 16 + 2j, 17 + 2j m_j >> 4. Both
// use all 96 bits: the one converts to the other exactly.
void convert_scales_q4_K(const uint8_t* in, uint8_t* out, bool pack) {
  int sc[8], mn[8];
  if (pack) {
    for (int j = 0; j < 4; ++j) {
      sc[j] = in[j] & 63;
      mn[j] = in[j + 4] & 63;
      sc[j + 4] = (in[j + 8] & 15) | ((in[j] >> 6) << 4);
      mn[j + 4] = (in[j + 8] >> 4) | ((in[j + 4] >> 6) << 4);
    }
    uint32_t hi = 0;
    for (int j = 0; j < 8; ++j) {
      out[j] = static_cast<uint8_t>((sc[j] & 15) | ((mn[j] & 15) << 4));
      hi |= static_cast<uint32_t>(sc[j] >> 4) << (2 * j) | static_cast<uint32_t>(mn[j] >> 4) << (16 + 2 * j);
    }
    std::memcpy(out + 8, &hi, 4);
    return;
  }
  uint32_t hi;
  std::memcpy(&hi, in + 8, 4);
  for (int j = 0; j < 8; ++j) {
    sc[j] = (in[j] & 15) | static_cast<int>((hi >> (2 * j)) & 3) << 4;
    mn[j] = (in[j] >> 4) | static_cast<int>((hi >> (16 + 2 * j)) & 3) << 4;
  }
  for (int j = 0; j < 4; ++j) {
    out[j] = static_cast<uint8_t>(sc[j] | (sc[j + 4] >> 4) << 6);
    out[j + 4] = static_cast<uint8_t>(mn[j] | (mn[j + 4] >> 4) << 6);
    out[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | (mn[j + 4] & 15) << 4);
  }
}

// One row of nb 256-value blocks of BB bytes with H header bytes and 128
// bytes of nibbles (q4_K: 144 / 16, q5_K: 176 / 48, iq4_xs: 136 / 8): plain ->
// packed (pack) or back. The header stays (q4_K's and q5_K's scales and mins
// re-encoded as above; q5_K's 32 bytes of 5th bits re-encoded below); byte
// 4j + l of chunk k (32 bytes) holds value 4k + l of sub-block j in its low
// nibble and value 4k + 16 + l in its high nibble. Plain q4_K / q5_K:
// sub-block 2c's value v is the low nibble of byte 32c + v, sub-block 2c + 1's
// the high nibble; plain iq4_xs: sub-block j's value v (< 16) the low nibble
// of byte 16j + v, value v + 16 its high nibble. q5_K's 5th bits: plain, bit
// j of byte v is value v of sub-block j's; packed, bit k of byte 4j + l is
// value 4k + l of sub-block j's and bit 4 + k value 4k + 16 + l's (beside
// the chunk bytes that hold those values, as packed q5_0's).
template <std::size_t BB, std::size_t H, bool XS>
void convert_row_k256(const uint8_t* in, uint8_t* out, int64_t nb, bool pack) {
  constexpr bool Q5 = BB == 176;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* src = in + BB * b;
    uint8_t* dst = out + BB * b;
    std::memcpy(dst, src, H);
    if constexpr (!XS)
      convert_scales_q4_K(src + 4, dst + 4, pack);
    if constexpr (Q5) { // 4 bytes at a time: byte l of each word is lane l
      const uint8_t* from = src + 16;
      uint8_t* to = dst + 16;
      uint32_t words[8] = {}; // packed: sub-block j's 4 bytes; plain: bytes 4w .. 4w + 3
      constexpr uint32_t ones = 0x01010101u;
      for (int j = 0; j < 8; ++j)
        for (int k = 0; k < 4; ++k)
          for (int h = 0; h < 2; ++h) {
            if (pack) // bit j of plain bytes 4k + 16h + l -> bit k + 4h of packed byte 4j + l
              words[j] |= ((ld32(from + 4 * k + 16 * h) >> j) & ones) << (k + 4 * h);
            else
              words[k + 4 * h] |= ((ld32(from + 4 * j) >> (k + 4 * h)) & ones) << j;
          }
      std::memcpy(to, words, 32);
    }
    // Byte 4j + l of chunk k holds the nibbles of values 4k + l and 4k + 16 + l
    // of sub-block j: iq4_xs's plain byte 16j + 4k + l as it is; q4_K's (q5_K's)
    // the low (j even) or high (j odd) nibbles of plain bytes 32 (j / 2) + 4k + l
    // and that + 16.
    const uint8_t* from = src + H;
    uint8_t* to = dst + H;
    uint32_t plain[32] = {}; // (unpacking q4_K / q5_K: both nibbles of each word)
    for (int j = 0; j < 8; ++j)
      for (int k = 0; k < 4; ++k) {
        const int packed = 32 * k + 4 * j, at = XS ? 16 * j + 4 * k : 32 * (j / 2) + 4 * k, sh = 4 * (j % 2);
        if constexpr (XS) {
          std::memcpy(pack ? to + packed : to + at, pack ? from + at : from + packed, 4);
          continue;
        }
        constexpr uint32_t lo4 = 0x0F0F0F0Fu; // 4 values at a time: byte l of a word is value 4k + l
        if (pack) {
          const uint32_t w = ((ld32(from + at) >> sh) & lo4) | ((ld32(from + at + 16) >> sh) & lo4) << 4;
          std::memcpy(to + packed, &w, 4);
        } else { // plain bytes at and at + 16 hold sub-blocks j and j ^ 1: this sets j's nibbles
          const uint32_t w = ld32(from + packed);
          plain[at / 4] |= (w & lo4) << sh;
          plain[at / 4 + 4] |= ((w >> 4) & lo4) << sh;
        }
      }
    if (!XS && !pack)
      std::memcpy(to, plain, 128);
  }
}

// The 2-bit values of a q2_K / q3_K block (64 bytes each side), 4 at a time:
// plain, values 4k .. 4k+3 of group g = 8h + 2j + p are bits 2j of the 4 bytes at
// 32h + 16p + 4k; packed, bits 2k of bytes 4g .. 4g+3.
void convert_2_bits(const uint8_t* from, uint8_t* to, bool pack) {
  constexpr uint32_t lo2 = 0x03030303u;
  uint32_t w[16] = {};
  for (int g = 0; g < 16; ++g) {
    const int j = g % 8 / 2, o = 32 * (g / 8) + 16 * (g % 2);
    for (int k = 0; k < 4; ++k) {
      if (pack)
        w[g] |= ((ld32(from + o + 4 * k) >> (2 * j)) & lo2) << (2 * k);
      else
        w[(o + 4 * k) / 4] |= ((ld32(from + 4 * g) >> (2 * k)) & lo2) << (2 * j);
    }
  }
  std::memcpy(to, w, 64);
}

// One row of nb q2_K blocks: plain -> packed (pack) or back. The 16 bytes of
// scales and the f16 d, dmin (bytes 80-83) stay; the 2-bit values as above.
void convert_row_q2_K(const uint8_t* in, uint8_t* out, int64_t nb, bool pack) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* src = in + 84 * b;
    uint8_t* dst = out + 84 * b;
    std::memcpy(dst, src, 16);
    std::memcpy(dst + 80, src + 80, 4);
    convert_2_bits(src + 16, dst + 16, pack);
  }
}

// One row of nb q3_K blocks: plain -> packed (pack) or back. The 12 bytes of
// scales and the f16 d (bytes 96-109) stay. Plain: value l of group g = 8h +
// 2j + p has its 2 low bits at bits 2j of qs[32h + 16p + l] (bytes 32-95) and
// its 3rd at bit 4h + j of hmask[16p + l] (bytes 0-31). Packed: the 2 low bits
// as packed q2_K's (bits 2k of byte 4g + l' for value 4k + l' of group g,
// bytes 0-63); the 3rd bits in bytes 64-95 as 4 little-endian 64-bit words,
// bit x = 4g + l' (the lane byte of the 2 low bits) of word k holding value
// 4k + l''s: bit x % 8 of byte 64 + 8k + x / 8.
void convert_row_q3_K(const uint8_t* in, uint8_t* out, int64_t nb, bool pack) {
  constexpr uint32_t ones = 0x01010101u;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* src = in + 110 * b;
    uint8_t* dst = out + 110 * b;
    std::memcpy(dst + 96, src + 96, 14);
    convert_2_bits(pack ? src + 32 : src, pack ? dst : dst + 32, pack);
    // The 3rd bits of values 4k .. 4k+3 of group g = 8h + 2j + p: plain, bits
    // 4h + j of the 4 bytes at hmask + 16p + 4k; packed, bits 4g .. 4g+3 of word k.
    uint64_t words[4] = {};
    uint32_t plain[8] = {};
    if (!pack)
      std::memcpy(words, src + 64, 32);
    for (int g = 0; g < 16; ++g) {
      const int sh = 4 * (g / 8) + g % 8 / 2, o = 16 * (g % 2);
      for (int k = 0; k < 4; ++k) {
        if (pack) {
          const uint32_t t = (ld32(src + o + 4 * k) >> sh) & ones; // byte l: bit 0 for value l
          words[k] |= static_cast<uint64_t>((t | t >> 7 | t >> 14 | t >> 21) & 0xF) << (4 * g);
        } else {
          const auto c = static_cast<uint32_t>(words[k] >> (4 * g)) & 0xF;
          plain[(o + 4 * k) / 4] |= ((c & 1) | (c & 2) << 7 | (c & 4) << 14 | (c & 8) << 21) << sh;
        }
      }
    }
    if (pack)
      std::memcpy(dst + 64, words, 32);
    else
      std::memcpy(dst, plain, 32);
  }
}

// One row of nb q6_K blocks: plain -> packed (pack) or back. The 16 int8
// scales and the f16 d (bytes 192-209) stay. Plain: value 128n + 32j + l
// (j < 4, l < 32) has its low 4 bits in ql[64n + 32 (j % 2) + l] (shifted by
// 4 (j / 2)) and its high 2 in qh[32n + l] (bits 2j, 2j + 1). Packed: value
// 4k + l' of group g (k, l' < 4; lane byte x = 4g + l') has its low 4 bits in
// byte 64 (k % 2) + x (shifted by 4 (k / 2)) and its high 2 in byte 128 + x
// (bits 2k, 2k + 1).
void convert_row_q6_K(const uint8_t* in, uint8_t* out, int64_t nb, bool pack) {
  constexpr uint32_t lo4 = 0x0F0F0F0Fu, lo2 = 0x03030303u;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* src = in + 210 * b;
    uint8_t* dst = out + 210 * b;
    std::memcpy(dst + 192, src + 192, 18);
    // 4 values at a time (a 32-bit word, byte l for value 4k + l of group g):
    // plain, their low 4 bits are bits 4 (j / 2) of the bytes at ql + o, their high
    // 2 bits 2j of those at qh + oh; packed, the nibbles k % 2 (shifted by 4 (k / 2))
    // and the high bits 2k of bytes 4g .. 4g + 3.
    uint32_t w[96] = {}; // the side written: packed [nibbles 0 | nibbles 1 | high], or plain [ql | qh]
    for (int g = 0; g < 16; ++g) {
      const int n = g / 8, j = g % 8 / 2;
      for (int k = 0; k < 4; ++k) {
        const int o = 64 * n + 32 * (j % 2) + 16 * (g % 2) + 4 * k, oh = 128 + 32 * n + 16 * (g % 2) + 4 * k;
        const int nib = 16 * (k % 2) + g, high = 32 + g; // packed words
        if (pack) {
          w[nib] |= ((ld32(src + o) >> (4 * (j / 2))) & lo4) << (4 * (k / 2));
          w[high] |= ((ld32(src + oh) >> (2 * j)) & lo2) << (2 * k);
        } else {
          w[o / 4] |= ((ld32(src + 4 * nib) >> (4 * (k / 2))) & lo4) << (4 * (j / 2));
          w[oh / 4] |= ((ld32(src + 4 * high) >> (2 * k)) & lo2) << (2 * j);
        }
      }
    }
    std::memcpy(dst, w, 192);
  }
}

// A q5_0 block's 32 5th bits: plain, bit v of the little-endian word is value
// v's; packed, bit k of byte l is value 4k + l's and bit 4 + k value 4k + 16 +
// l's (k, l < 4), beside the nibbles of the chunk (k) that hold those values.
void spread_5th_bits(const uint8_t* in, uint8_t* out, bool pack) {
  uint32_t word = 0;
  if (pack)
    std::memcpy(&word, in, 4);
  uint8_t bytes[4] = {0, 0, 0, 0};
  if (!pack)
    std::memcpy(bytes, in, 4);
  for (int l = 0; l < 4; ++l)
    for (int k = 0; k < 4; ++k)
      for (int h = 0; h < 2; ++h) {
        const int v = 4 * k + 16 * h + l, bit = k + 4 * h;
        if (pack)
          bytes[l] = static_cast<uint8_t>(bytes[l] | ((word >> v) & 1u) << bit);
        else
          word |= static_cast<uint32_t>((bytes[l] >> bit) & 1u) << v;
      }
  if (pack)
    std::memcpy(out, bytes, 4);
  else
    std::memcpy(out, &word, 4);
}

// One row of nb q4_0 (iq4_nl blocks are alike), q5_0, q4_1 or q5_1 blocks
// (Q5: a 5th bit per value; MIN: an f16 min after the scale). Plain: d, [m],
// [qh: bit v the 5th bit of value v], 16 bytes whose low nibbles are values
// 0..15 and high nibbles 16..31. Packed, group g of L blocks at byte BB * 8g:
// the L scales, [the L mins], 4 chunks of 4L bytes (byte 4j + l of chunk k:
// value 4k + l of block j in the low nibble, 4k + 16 + l in the high one), [the
// L blocks' 5th bits, 4 bytes each as spread_5th_bits packs them].
template <bool Q5, bool MIN>
void convert_row_q4(const uint8_t* in, uint8_t* out, int64_t nb, bool pack) {
  constexpr int64_t H = MIN ? 4 : 2, BB = 16 + H + (Q5 ? 4 : 0), QS = H + (Q5 ? 4 : 0);
  for (int64_t g = 0; g * pack_group < nb; ++g) {
    const int64_t L = std::min<int64_t>(pack_group, nb - g * pack_group);
    const std::size_t base = static_cast<std::size_t>(g * pack_group * BB);
    const uint8_t* src = in + base;
    uint8_t* dst = out + base;
    // n bytes at `plain` of the group's plain blocks <-> at `packed` of the packed group.
    auto move = [&](int64_t plain, int64_t packed, std::size_t n) {
      std::memcpy(pack ? dst + packed : dst + plain, pack ? src + plain : src + packed, n);
    };
    for (int64_t j = 0; j < L; ++j) {
      move(j * BB, 2 * j, 2);
      if (MIN)
        move(j * BB + 2, 2 * L + 2 * j, 2);
      if (Q5)
        spread_5th_bits(pack ? src + j * BB + H : src + (H + 16) * L + 4 * j,
                        pack ? dst + (H + 16) * L + 4 * j : dst + j * BB + H, pack);
      // Plain byte 4k + l of the nibbles holds values 4k + l and 4k + 16 + l, as
      // byte 4j + l of chunk k does.
      for (int64_t k = 0; k < 4; ++k)
        move(j * BB + QS + 4 * k, H * L + 4 * L * k + 4 * j, 4);
    }
  }
}

// q8_0's pairs of groups (2p, 2p + 1 where group 2p + 1 exists: group 2p has
// 8 blocks, group 2p + 1 L <= 8; 272 + 34L bytes at 544p): group 2p's 16
// bytes of scales, group 2p + 1's 2L, then step s of group 2p (32 bytes) and
// step s of group 2p + 1 (4L bytes) side by side for s = 0..7; from the groups
// one after the other (interleave) or back.
void pair_steps(const uint8_t* in, uint8_t* out, int64_t nb, bool interleave) {
  constexpr std::size_t G = pack_group * q8_block; // 272
  for (int64_t p = 0; (2 * p + 1) * pack_group < nb; ++p) {
    const std::size_t L = static_cast<std::size_t>(std::min<int64_t>(pack_group, nb - (2 * p + 1) * pack_group));
    const uint8_t* src = in + 2 * G * static_cast<std::size_t>(p);
    uint8_t* dst = out + 2 * G * static_cast<std::size_t>(p);
    auto move = [&](std::size_t apart, std::size_t together, std::size_t n) {
      std::memcpy(interleave ? dst + together : dst + apart, interleave ? src + apart : src + together, n);
    };
    const std::size_t head = 16 + 2 * L, step = 32 + 4 * L;
    move(0, 0, 16);
    move(G, 16, 2 * L);
    for (std::size_t st = 0; st < 8; ++st) {
      move(16 + 32 * st, head + step * st, 32);
      move(G + 2 * L + 4 * L * st, head + step * st + 32, 4 * L);
    }
  }
}

void convert_q8_0(const uint8_t* in, uint8_t* out, int64_t nb, bool pack) {
  thread_local std::vector<uint8_t> row;
  const std::size_t bytes = static_cast<std::size_t>(nb) * q8_block;
  row.resize(bytes);
  if (pack) {
    convert_row(in, row.data(), nb, true);
    std::memcpy(out, row.data(), bytes); // the bytes no pair holds
    pair_steps(row.data(), out, nb, true);
  } else {
    std::memcpy(row.data(), in, bytes);
    pair_steps(in, row.data(), nb, false);
    convert_row(row.data(), out, nb, false);
  }
}

void convert(const WMatrix& m, const uint8_t* in, uint8_t* out, bool pack) {
  switch (m.type) {
    case WType::q4_K: return convert_row_k256<144, 16, false>(in, out, m.cols / 256, pack);
    case WType::iq4_xs: return convert_row_k256<136, 8, true>(in, out, m.cols / 256, pack);
    case WType::q2_K: return convert_row_q2_K(in, out, m.cols / 256, pack);
    case WType::q3_K: return convert_row_q3_K(in, out, m.cols / 256, pack);
    case WType::q6_K: return convert_row_q6_K(in, out, m.cols / 256, pack);
    case WType::q5_K: return convert_row_k256<176, 48, false>(in, out, m.cols / 256, pack);
    case WType::q4_0: case WType::iq4_nl: return convert_row_q4<false, false>(in, out, m.cols / 32, pack);
    case WType::q5_0: return convert_row_q4<true, false>(in, out, m.cols / 32, pack);
    case WType::q4_1: return convert_row_q4<false, true>(in, out, m.cols / 32, pack);
    case WType::q5_1: return convert_row_q4<true, true>(in, out, m.cols / 32, pack);
    default: return convert_q8_0(in, out, m.cols / 32, pack);
  }
}

} // namespace

bool packable(const WMatrix& m) {
  switch (m.type) {
    case WType::q8_0: case WType::q4_0: case WType::q5_0: case WType::q4_1: case WType::q5_1: case WType::iq4_nl:
    case WType::q4_K: case WType::q5_K: case WType::q6_K: case WType::iq4_xs: case WType::q2_K: case WType::q3_K:
      return !m.packed;
    default: return false;
  }
}

WMatrix pack_rows(const WMatrix& m, const RowRunner& run) {
  if (!packable(m))
    throw Error(errc::bad_argument, std::string("pack_rows: a ") + (m.packed ? "packed " : "") + to_string(m.type) +
                                      " matrix has no packed layout");
  auto buf = std::make_shared<std::vector<uint8_t>>(m.bytes());
  const std::size_t rb = m.row_bytes();
  auto rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      convert(m, m.row(r), buf->data() + rb * static_cast<std::size_t>(r), true);
  };
  if (run)
    run(m.rows, rows);
  else
    rows(0, m.rows);
  WMatrix out = m;
  out.data = buf->data();
  out.keep = std::move(buf);
  out.packed = true;
  return out;
}

void unpack_rows(const WMatrix& m, int64_t r, int64_t n, uint8_t* out) {
  const std::size_t rb = m.row_bytes();
  if (!m.packed) {
    std::memcpy(out, m.row(r), rb * static_cast<std::size_t>(n));
    return;
  }
  for (int64_t i = 0; i < n; ++i)
    convert(m, m.row(r + i), out + rb * static_cast<std::size_t>(i), false);
}

void dequantize_rows(const WMatrix& m, int64_t r, int64_t n, float* out) {
  if (!m.packed) {
    dequantize(m.type, m.row(r), out, n * m.cols);
    return;
  }
  thread_local std::vector<uint8_t> plain;
  plain.resize(m.row_bytes());
  for (int64_t i = 0; i < n; ++i) {
    unpack_rows(m, r + i, 1, plain.data());
    dequantize(m.type, plain.data(), out + i * m.cols, m.cols);
  }
}

} // namespace strata::model::detail
