// Attention over a cache kept in q8_0 blocks, built for AVX-512 with F16C and VNNI:
// each block's f16 scale converts with vcvtph2ps, the integer scores run on vpdpbusd
// (attention_impl.hpp). Chosen at run time where the CPU has them (attention.cpp; an
// AVX-512 CPU without VNNI runs the AVX2 build); the same bits as attention_q8_0.cpp.
// Library headers first: their inline functions must keep the default target
// (the linker may pick any translation unit's copy).
#include "model/formats/quant.hpp"
#include "model/kernels/attention.hpp"
#include "model/kernels/vec.hpp"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
// GCC 12's AVX-512 intrinsics start from a self-initialised "undefined"
// vector, which -Wmaybe-uninitialized reports at every inlined use (a false
// positive, gone in GCC 13).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define STRATA_ATTENTION_AVX512
#define STRATA_ATTENTION_VNNI
#define STRATA_ATTENTION_NS avx512
#include "model/kernels/attention_impl.hpp"

STRATA_ATTENTION_KERNELS_WITH(KvQ8, q8_0_avx512, )
