// The fused kernels for CPUs with AVX-512 VNNI (int8) and AVX-512 BF16 (bf16).
// Library headers first: their inline functions must keep the default target
// (the linker may pick any translation unit's copy).
#include "model/kernels_q.hpp"

#include <immintrin.h>

#include <cstring>

#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")
#define KQ_NS vnni
#include "model/kernels_q_impl.hpp"

namespace strata::model::detail {

void fused_rows_vnni(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r0, int64_t r1, bool acc) {
  vnni::rows_impl<true>(W, A, Y, ldy, r0, r1, acc);
}

// bf16 x bf16 pairs into f32 lanes (vdpbf16ps); a tail of cols % 32 in scalar.
void fused_rows_bf16(const WMatrix& W, const QuantActs& A, float* Y,
                                                                      int64_t ldy, int64_t r0, int64_t r1, bool accumulate) {
  const int64_t cols = W.cols, main = cols / 32 * 32;
  for (int64_t r = r0; r < r1; ++r) {
    const auto* w = reinterpret_cast<const uint16_t*>(W.row(r));
    for (int64_t m = 0; m < A.rows; ++m) {
      const uint16_t* a = A.bf.data() + m * cols;
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
      int64_t c = 0;
      for (; c + 64 <= main; c += 64) {
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(w + c), (__m512bh)_mm512_loadu_si512(a + c));
        acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(w + c + 32), (__m512bh)_mm512_loadu_si512(a + c + 32));
      }
      for (; c < main; c += 32)
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(w + c), (__m512bh)_mm512_loadu_si512(a + c));
      float s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
      for (; c < cols; ++c) {
        const uint32_t wb = static_cast<uint32_t>(w[c]) << 16, ab = static_cast<uint32_t>(a[c]) << 16;
        float wf, af;
        std::memcpy(&wf, &wb, 4);
        std::memcpy(&af, &ab, 4);
        s += wf * af;
      }
      float& y = Y[m * ldy + r];
      y = accumulate ? y + s : s;
    }
  }
}

} // namespace strata::model::detail
