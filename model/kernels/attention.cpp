// Attention entry points: each cache type's kernels live in attention_<type>.cpp;
// the f16 and q8_0 caches' also in attention_<type>_avx512.cpp, chosen where the
// CPU runs them.

#include "model/kernels/attention.hpp"

#include <atomic>

namespace strata::model::detail {

#define STRATA_ATTENTION_DECLARE(name)                                                                              \
  void attend_##name(const float* q, const CacheRows& rows, int64_t n, int64_t hd, float scale, float* scores,     \
                     float* out);                                                                                   \
  void attend_rows_##name(const float* q, int64_t q_stride, int64_t m, const CacheRows& rows, int64_t n0,           \
                          int64_t hd, float scale, float* scores, float* out, int64_t out_stride);                  \
  void attend_heads_##name(const float* q, int64_t m, const CacheRows& rows, int64_t n, int64_t hd, float scale,   \
                           float* scores, float* out);
STRATA_ATTENTION_DECLARE(f32)
STRATA_ATTENTION_DECLARE(bf16)
STRATA_ATTENTION_DECLARE(f16)
STRATA_ATTENTION_DECLARE(q8_0)
STRATA_ATTENTION_DECLARE(f16_avx512)
STRATA_ATTENTION_DECLARE(q8_0_avx512)

namespace {
std::atomic<bool> portable_only{false};
bool avx512() { return attention_avx512_available() && !portable_only.load(std::memory_order_relaxed); }
} // namespace

bool attention_avx512_available() {
  static const bool v = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
                        __builtin_cpu_supports("fma");
  return v;
}
void set_attention_isa(AttentionIsa isa) { portable_only.store(isa == AttentionIsa::portable); }

void attend(const float* q, const CacheRows& rows, int64_t n, int64_t hd, float scale, float* scores, float* out) {
  switch (rows.type) {
    case WType::bf16: return attend_bf16(q, rows, n, hd, scale, scores, out);
    case WType::f16:
      return avx512() ? attend_f16_avx512(q, rows, n, hd, scale, scores, out)
                      : attend_f16(q, rows, n, hd, scale, scores, out);
    case WType::q8_0:
      return avx512() ? attend_q8_0_avx512(q, rows, n, hd, scale, scores, out)
                      : attend_q8_0(q, rows, n, hd, scale, scores, out);
    default: return attend_f32(q, rows, n, hd, scale, scores, out);
  }
}

void attend_rows(const float* q, int64_t q_stride, int64_t m, const CacheRows& rows, int64_t n0, int64_t hd,
                 float scale, float* scores, float* out, int64_t out_stride) {
  switch (rows.type) {
    case WType::bf16: return attend_rows_bf16(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
    case WType::f16:
      return avx512() ? attend_rows_f16_avx512(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride)
                      : attend_rows_f16(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
    case WType::q8_0:
      return avx512() ? attend_rows_q8_0_avx512(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride)
                      : attend_rows_q8_0(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
    default: return attend_rows_f32(q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride);
  }
}

void attend_heads(const float* q, int64_t m, const CacheRows& rows, int64_t n, int64_t hd, float scale,
                  float* scores, float* out) {
  switch (rows.type) {
    case WType::bf16: return attend_heads_bf16(q, m, rows, n, hd, scale, scores, out);
    case WType::f16:
      return avx512() ? attend_heads_f16_avx512(q, m, rows, n, hd, scale, scores, out)
                      : attend_heads_f16(q, m, rows, n, hd, scale, scores, out);
    case WType::q8_0:
      return avx512() ? attend_heads_q8_0_avx512(q, m, rows, n, hd, scale, scores, out)
                      : attend_heads_q8_0(q, m, rows, n, hd, scale, scores, out);
    default: return attend_heads_f32(q, m, rows, n, hd, scale, scores, out);
  }
}

} // namespace strata::model::detail
