// Attention over a cache kept in f32: one cache type per file, so the types'
// kernels compile side by side.
#include "model/kernels/attention_impl.hpp"

STRATA_ATTENTION_KERNELS(KvF32, f32)
