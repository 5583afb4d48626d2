// Attention over a cache kept in q8_0 blocks: one cache type per file, so the types'
// kernels compile side by side.
#include "model/kernels/attention_impl.hpp"

STRATA_ATTENTION_KERNELS(KvQ8, q8_0)
