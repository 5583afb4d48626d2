// The fused kernels for CPUs with AVX-512 VNNI (int8) and AVX-512 BF16 (bf16).
// Library headers first: their inline functions must keep the default target
// (the linker may pick any translation unit's copy).
#include "model/kernels/kernels_q.hpp"

#include <immintrin.h>

#include <cstring>

#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")
#define KQ_NS vnni
#include "model/kernels/kernels_q_impl.hpp"

namespace strata::model::detail {

void fused_rows_vnni(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r0, int64_t r1, bool acc) {
  vnni::rows_impl<true>(W, A, Y, ldy, r0, r1, acc);
}

namespace {

// bf16 x bf16 pairs into f32 lanes (vdpbf16ps), R weight rows side by side with
// the next R prefetched (as the int8 kernels); a tail of cols % 32 in scalar.
template <int R>
void bf16_block(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r, int64_t r_end,
                bool accumulate) {
  const int64_t cols = W.cols, main = cols / 32 * 32;
  const std::size_t rb = W.row_bytes();
  const auto* w0 = reinterpret_cast<const uint16_t*>(W.row(r));
  const bool ahead = r + 2 * R <= r_end;
  for (int64_t m = 0; m < A.rows; ++m) {
    const uint16_t* a = A.bf.data() + m * cols;
    __m512 acc[R];
    for (int i = 0; i < R; ++i)
      acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < main; c += 32) {
      const __m512bh av = (__m512bh)_mm512_loadu_si512(a + c);
      for (int i = 0; i < R; ++i) {
        const uint16_t* w = reinterpret_cast<const uint16_t*>(reinterpret_cast<const uint8_t*>(w0) + i * rb);
        if (m == 0 && ahead)
          _mm_prefetch(reinterpret_cast<const char*>(w + c) + R * rb, _MM_HINT_T0);
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(w + c), av);
      }
    }
    for (int i = 0; i < R; ++i) {
      const uint16_t* w = reinterpret_cast<const uint16_t*>(reinterpret_cast<const uint8_t*>(w0) + i * rb);
      float s = _mm512_reduce_add_ps(acc[i]);
      for (int64_t c = main; c < cols; ++c) {
        const uint32_t wb = static_cast<uint32_t>(w[c]) << 16, ab = static_cast<uint32_t>(a[c]) << 16;
        float wf, af;
        std::memcpy(&wf, &wb, 4);
        std::memcpy(&af, &ab, 4);
        s += wf * af;
      }
      float& y = Y[m * ldy + r + i];
      y = accumulate ? y + s : s;
    }
  }
}

} // namespace

void fused_rows_bf16(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r0, int64_t r1,
                     bool accumulate) {
  vnni::by_fours(r0, r1, [&](auto R, int64_t r) { bf16_block<R>(W, A, Y, ldy, r, r1, accumulate); });
}

} // namespace strata::model::detail
