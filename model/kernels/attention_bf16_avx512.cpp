// Attention over a cache kept in bf16, built for AVX-512 (every bf16 value widens by a shift),
// the whole file under one target: attention_bf16.cpp's x86-64-v4 clone ran the
// decode step 15-20 % slower (`scripts/bench attention`, docs/benchmarks.md).
// Chosen at run time where the CPU has AVX-512 (attention.cpp); the same bits as
// attention_bf16.cpp.
// Library headers first: their inline functions must keep the default target
// (the linker may pick any translation unit's copy).
#include "model/formats/quant.hpp"
#include "model/kernels/attention.hpp"
#include "model/kernels/vec.hpp"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")
// GCC 12's AVX-512 intrinsics start from a self-initialised "undefined"
// vector, which -Wmaybe-uninitialized reports at every inlined use (a false
// positive, gone in GCC 13).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define STRATA_ATTENTION_AVX512
#define STRATA_ATTENTION_NS avx512
#include "model/kernels/attention_impl.hpp"

STRATA_ATTENTION_KERNELS_WITH(KvBf16, bf16_avx512, )
