// The fused int8 kernels for CPUs with AVX2 (no VNNI).
// Library headers first: their inline functions must keep the default target
// (the linker may pick any translation unit's copy).
#include "model/kernels/kernels_q.hpp"

#include <immintrin.h>

#include <cstring>

#pragma GCC target("avx2,fma,f16c")
#define KQ_NS avx2
#include "model/kernels/kernels_q_impl.hpp"

namespace strata::model::detail {

void fused_rows_avx2(const WMatrix& W, const QuantActs& A, float* Y, int64_t ldy, int64_t r0, int64_t r1, bool acc) {
  avx2::rows_impl<false>(W, A, Y, ldy, r0, r1, acc);
}

} // namespace strata::model::detail
