// The gated FFN's activation (activations.hpp): SiLU times the up projection,
// eight lanes at a time. std::exp per value took 5 % of a decode round of the
// 0.5B model at 1 and at 8 rows (perf, `strata_bench batch file`); here a
// vector of 8 values costs about what one std::exp did.
#include "model/kernels/activations.hpp"

#include "model/kernels/vec.hpp"

#include <cstring>
#include <type_traits>

namespace strata::model::detail {

namespace {

#include "model/kernels/vec_ops.hpp"

typedef int32_t vi8 __attribute__((vector_size(32)));

inline __attribute__((always_inline)) v8 silu_mul8(v8 g, v8 u) { return g / (1.0f + vexp<v8, vi8>(-g)) * u; }

} // namespace

// Built for x86-64-v4 and -v3 (both with FMA: the same contractions, so the
// same bits) and the baseline.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) void
silu_mul(const float* g, const float* u, float* o, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8 gv, uv;
    std::memcpy(&gv, g + i, sizeof gv);
    std::memcpy(&uv, u + i, sizeof uv);
    const v8 ov = silu_mul8(gv, uv);
    std::memcpy(o + i, &ov, sizeof ov);
  }
  if (i < n) { // the tail in a vector of its own, the unused lanes zero
    v8 gv{}, uv{};
    const auto bytes = static_cast<std::size_t>(n - i) * sizeof(float);
    std::memcpy(&gv, g + i, bytes);
    std::memcpy(&uv, u + i, bytes);
    const v8 ov = silu_mul8(gv, uv);
    std::memcpy(o + i, &ov, bytes);
  }
}

} // namespace strata::model::detail
