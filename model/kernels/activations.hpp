#pragma once
// Internal to model/: the gated FFN's activation, vectorized.
#include <cstdint>

namespace strata::model::detail {

/// o[i] = silu(g[i]) * u[i] = g[i] / (1 + e^-g[i]) * u[i] for i < n, eight
/// values a vector (a tail of n % 8 goes through the same vector code). e^x is
/// vec_ops.hpp's vexp (Cephes' expf, within 2 ulp of expf; the attention's
/// too): each value a pure function of its own inputs, whatever n, the row or
/// the batch, so a row's numbers do not depend on its neighbours.
/// o may alias g or u.
void silu_mul(const float* g, const float* u, float* o, int64_t n);

} // namespace strata::model::detail
