#pragma once
// Internal to model/: fused few-row kernels for quantized and bf16 weights. The
// activations are quantized once per product the way llama.cpp pairs them with
// each weight type (q8_0 blocks of 32 for q8_0 / q4_0, q8_K blocks of 256 for
// q4_K / q6_K, bf16 for bf16); the dot products then run on the packed weights
// without expanding them: int8 products with AVX-512 VNNI (or AVX2
// maddubs), bf16 pairs with AVX-512 BF16. Torch-free.

#include "model/formats/wmatrix.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace strata::model::detail {

/// Activation rows quantized for one weight type.
/// An allocator of 64-byte aligned memory: the packed kernels' 512-bit loads
/// of interleaved activations then never straddle two cache lines.
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t n) noexcept { ::operator delete(p, n * sizeof(T), std::align_val_t{64}); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept { return true; }
};
template <class T>
using aligned_vector = std::vector<T, CacheLineAllocator<T>>;

struct QuantActs {
  WType for_type = WType::f32;
  int64_t rows = 0, cols = 0;
  std::vector<int8_t> q;      ///< (rows, cols) int8 values (q8 types)
  std::vector<uint16_t> bf;   ///< (rows, cols) bf16 bits (bf16)
  std::vector<float> d;       ///< one scale per block (32 or 256 values)
  std::vector<int32_t> sums;  ///< K types: the sum of every 16 values
  std::vector<int16_t> sums32; ///< the sum of every 32 values (|sum| <= 4064)
  std::vector<float> s;       ///< 32-value blocks: f16(sum x unrounded d), llama.cpp's q8_1 "s"
  /// q8_0 activations for packed weights (packed.hpp): each row's blocks
  /// interleaved as the packed weights are, groups in pairs step by step (row
  /// stride 256 x the groups, a partial last group's empty lanes zero), and
  /// -128 x each block's sum (the weights' +128 taken back).
  aligned_vector<int8_t> qi;
  std::vector<int32_t> corr;
  /// K-type activations for packed q4_K / q5_K / iq4_xs: per 32 values, the scale of their
  /// 256-value block and that scale times their sum. (qi and corr too; all
  /// three empty for the types interleaved by 16.)
  std::vector<float> d32, dsum32;
  /// q8_K activations for packed q2_K, q3_K and q6_K (interleaves_by_16; empty
  /// for the other K types): each 256-value block
  /// as 4 steps of 64 bytes, byte 4g + l of step k being value 16g + 4k + l,
  /// and per 16 values the block's scale times their sum.
  aligned_vector<int8_t> qi16;
  std::vector<float> dsum16;
};

/// The activation block a weight type pairs with, as llama.cpp pairs them: 32
/// (q8_0 / q8_1 blocks: q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl), 256 (q8_K: the K
/// types and iq4_xs), 0 for the float types.
int64_t acts_block(WType t);

/// Whether activations for `t` are interleaved by 16 (QuantActs::qi16: packed
/// q2_K, q3_K and q6_K read them) instead of as q8_0's (QuantActs::qi).
bool interleaves_by_16(WType t);

/// Which kernels run (tests compare them on one machine): best = what the CPU
/// has; avx2 = the AVX2 int8 kernels even where VNNI exists (bf16 then expands);
/// expand = no fused kernel (weights expanded to f32 in L1).
enum class FusedIsa { best, avx2, expand };
void set_fused_isa(FusedIsa isa);

/// Whether this CPU (and the setting above) has a fused kernel for `t`.
bool fused_available(WType t);
/// The kernel builds this CPU runs, for `strata status`: "avx512" (AVX-512 F,
/// BW, VL with F16C), "avx2" (AVX2, FMA, F16C) or "baseline", then "+vnni" where
/// the int8 kernels use AVX-512 VNNI and "+bf16" where bf16 weights use
/// AVX-512 BF16 (e.g. "avx512+vnni+bf16").
std::string kernel_builds();
/// `m` in the layout this CPU's kernels read fastest: packed q8_0 / q4_0 /
/// q5_0 / q4_1 / q5_1 / iq4_nl / q4_K / q5_K / q6_K / iq4_xs / q2_K / q3_K (packed.hpp) where
/// AVX-512 VNNI runs, else `m` itself. Either layout gives every kernel
/// setting the same products (a packed matrix under another setting is
/// unpacked on the fly).
WMatrix pack_for_kernels(const WMatrix& m);
/// Quantizes M rows of X for weights of type `t` (bf16 or a quantized type).
void quantize_acts(WType t, const float* X, int64_t M, int64_t cols, QuantActs& out);
/// The floats `a` stands for (rows x cols into `out`): what the fused kernels
/// multiply, for the paths that multiply in f32.
void expand_acts(const QuantActs& a, float* out);
/// Y[m * ldy + r] (=|+=) row r of W . row m of the activations, for r in [r0, r1).
void fused_rows(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r0, int64_t r1, bool accumulate);

} // namespace strata::model::detail
