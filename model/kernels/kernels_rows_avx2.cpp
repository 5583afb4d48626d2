// The few-row f32 product and the FMA peak loop built for AVX2 with FMA, for
// CPUs that have them but not AVX-512: 16-lane vectors as two halves of 8
// (kernels_rows_impl.hpp). Chosen at run time by kernels.cpp; the same bits as
// its builds.
// Library headers first: their inline functions must keep the default target
// (the linker may pick any translation unit's copy).
#include "model/formats/packed.hpp"
#include "model/formats/wmatrix.hpp"
#include "model/kernels/vec.hpp"

#include <cstdint>
#include <type_traits>

#pragma GCC target("avx2,fma")
#define STRATA_ROWS_AVX2
#define STRATA_ROWS_NS avx2
#include "model/kernels/kernels_rows_impl.hpp"

namespace strata::model::detail {

void rows_kernel_avx2(const float* W, const float* X, float* Y, int64_t ldy, int64_t M, int64_t r0, int64_t r1,
                      int64_t cols, bool accumulate) {
  avx2::rows_kernel(W, X, Y, ldy, M, r0, r1, cols, accumulate);
}
void rows_kernel_q_avx2(const WMatrix& W, const float* X, float* Y, int64_t ldy, int64_t M, int64_t r0, int64_t r1,
                        float* buf, bool accumulate) {
  avx2::rows_kernel_q(W, X, Y, ldy, M, r0, r1, buf, accumulate);
}
double fma_loop_avx2(int64_t iters) { return avx2::fma_loop(iters); }

} // namespace strata::model::detail
