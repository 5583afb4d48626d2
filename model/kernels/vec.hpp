#pragma once
// Internal to model/kernels: GCC vector types.
//
// v16 (64 bytes) is for code built for AVX-512, where it is one register. GCC
// 12 also accepts it on AVX2 and SSE, but keeps every such vector in memory
// there and moves it through the stack at each operation (measured: the
// decode attention 20x slower than its AVX-512 build): code built for AVX2
// takes vec_ops.hpp's pair16 instead.

#include <cstdint>

namespace strata::model::detail {

// A 64-byte vector of floats (loads and stores: vec_ops.hpp's vload, vstore).
typedef float v16 __attribute__((vector_size(64)));

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// A fixed pairwise order, so every row reduces the same way: lanes i and i+8,
// then i and i+4, i and i+2, i and i+1.
inline __attribute__((always_inline)) float hsum(v16 v) {
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const float c0 = b[0] + b[2], c1 = b[1] + b[3];
  return c0 + c1;
}

} // namespace strata::model::detail
