// The gated FFN's activation (activations.hpp): SiLU times the up projection,
// eight lanes at a time. std::exp per value took 5 % of a decode round of the
// 0.5B model at 1 and at 8 rows (perf, `strata_bench batch file`); here a
// vector of 8 values costs about what one std::exp did.
#include "model/kernels/activations.hpp"

#include "model/kernels/vec.hpp"

#include <cmath>
#include <cstring>

namespace strata::model::detail {

namespace {

typedef int32_t vi8 __attribute__((vector_size(32)));

// e^-x for 8 lanes: k = round(-x / ln 2), r = -x - k ln 2 (in two parts), a
// degree-7 polynomial in r, times 2^k; 0 where -x < -87.3 (and for NaN, whose
// silu is NaN through the multiplication by x below), the largest finite
// range's value where -x > 88.7.
inline __attribute__((always_inline)) v8 exp_neg8(v8 x) {
  v8 y = -x;
  const v8 lo = v8{} - 87.33654f, hi = v8{} + 88.72283f;
  const vi8 under = ~(y >= lo);
  y = y >= lo ? y : lo;
  y = y > hi ? hi : y;
  const v8 shifter = v8{} + 12582912.0f; // 1.5 * 2^23: rounds |y / ln2| < 2^22 to an integer
  const v8 kf = (y * 1.44269504088896341f + shifter) - shifter;
  const v8 r = y - kf * 0.693359375f - kf * -2.12194440e-4f;
  const v8 r2 = r * r;
  v8 p = v8{} + 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r2 + r + 1.0f;
  const vi8 k = __builtin_convertvector(kf, vi8);
  v8 two_k;
  const vi8 bits = (k + 127) << 23;
  std::memcpy(&two_k, &bits, sizeof two_k);
  const v8 e = p * two_k;
  return under ? v8{} : e;
}

inline __attribute__((always_inline)) v8 silu_mul8(v8 g, v8 u) { return g / (1.0f + exp_neg8(g)) * u; }

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

float silu_mul_reference(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

} // namespace strata::model::detail
