// Attention over a bf16 cache, built for AVX2 with FMA and F16C, for CPUs that have
// them but not AVX-512: 16-lane vectors as two halves of 8 (vec_ops.hpp; see
// attention_impl.hpp). Chosen at run time (attention.cpp); the same bits as
// attention_bf16.cpp.
// Library headers first: their inline functions must keep the default target
// (the linker may pick any translation unit's copy).
#include "model/formats/quant.hpp"
#include "model/kernels/attention.hpp"
#include "model/kernels/vec.hpp"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#pragma GCC target("avx2,fma,f16c")
#define STRATA_ATTENTION_AVX2
#define STRATA_ATTENTION_NS avx2
#include "model/kernels/attention_impl.hpp"

STRATA_ATTENTION_KERNELS_WITH(KvBf16, bf16_avx2, )
