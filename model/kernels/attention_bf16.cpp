// Attention over a cache kept in bf16: one cache type per file, so the types'
// kernels compile side by side.
#include "model/kernels/attention_impl.hpp"

STRATA_ATTENTION_KERNELS(KvBf16, bf16)
