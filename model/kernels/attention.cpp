// Attention entry points: each cache type's kernels live in attention_<type>.cpp
// (built for AVX-512 and for the baseline), attention_<type>_avx2.cpp (AVX2, for
// CPUs without AVX-512) and attention_<type>_avx512.cpp
// (AVX-512; with F16C for the f16 and q8_0 caches), each chosen where the CPU runs it.

#include "model/kernels/attention.hpp"

#include <algorithm>
#include <atomic>

namespace strata::model::detail {

#define STRATA_ATTENTION_DECLARE(name)                                                                              \
  void attend_rows_##name(const float* q, int64_t q_stride, int64_t m, const CacheRows& rows, int64_t n0,           \
                          int64_t hd, float scale, float* scores, float* out, int64_t out_stride);                  \
  void attend_heads_##name(const float* q, int64_t m, const CacheRows& rows, int64_t n, int64_t hd, float scale,   \
                           float* scores, float* out);                                                          \
  void attend_heads_scores_##name(const float* q, int64_t m, const CacheRows& rows, int64_t n, int64_t hd,          \
                                  float scale, float* scores, int64_t k0, int64_t k1, float* mx);                   \
  void attend_heads_weights_##name(int64_t m, const CacheRows& rows, int64_t n, float* scores, const float* mx,     \
                                   int64_t parts);                                                                  \
  void attend_heads_values_##name(int64_t m, const CacheRows& rows, int64_t n, int64_t hd, const float* scores,     \
                                  int64_t c0, int64_t c1, float* out);
STRATA_ATTENTION_DECLARE(f32)
STRATA_ATTENTION_DECLARE(bf16)
STRATA_ATTENTION_DECLARE(f16)
STRATA_ATTENTION_DECLARE(q8_0)
STRATA_ATTENTION_DECLARE(f32_avx512)
STRATA_ATTENTION_DECLARE(bf16_avx512)
STRATA_ATTENTION_DECLARE(f16_avx512)
STRATA_ATTENTION_DECLARE(q8_0_avx512)
STRATA_ATTENTION_DECLARE(f32_avx2)
STRATA_ATTENTION_DECLARE(bf16_avx2)
STRATA_ATTENTION_DECLARE(f16_avx2)
STRATA_ATTENTION_DECLARE(q8_0_avx2)

bool attention_avx512_available() {
  static const bool v = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
                        __builtin_cpu_supports("fma");
  return v;
}
bool attention_avx2_available() {
  static const bool v =
    __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return v;
}

namespace {
// The build each cache type runs: 0 = attention_<type>.cpp's (its AVX-512 clone
// where the CPU has AVX-512), 1 = the AVX2 build, 2 = the AVX-512 with F16C build
// (f16 and q8_0; the others run 0 there).
enum Build { plain = 0, avx2 = 1, avx512 = 2 };
Build best_build() {
  return attention_avx512_available() ? avx512 : attention_avx2_available() ? avx2 : plain;
}
std::atomic<int> chosen{best_build()};
Build build() { return static_cast<Build>(chosen.load(std::memory_order_relaxed)); }
bool q8_vnni() {
  static const bool v = __builtin_cpu_supports("avx512vnni");
  return v;
}
} // namespace

namespace {
std::atomic<int64_t> run_bytes{value_run_bytes_default};
} // namespace
void set_value_run_bytes(int64_t bytes) { run_bytes.store(std::max<int64_t>(1, bytes), std::memory_order_relaxed); }
int64_t value_run_bytes() { return run_bytes.load(std::memory_order_relaxed); }

void set_attention_isa(AttentionIsa isa) {
  switch (isa) {
    case AttentionIsa::portable: chosen.store(plain); break;
    case AttentionIsa::avx2: chosen.store(attention_avx2_available() ? avx2 : plain); break;
    default: chosen.store(best_build()); break;
  }
}

// Each entry point by cache type and build: fn_<type>_avx512, fn_<type>_avx2 or fn_<type>.
#define STRATA_ATTENTION_PICK(fn, type, ...)                                                                        \
  return build() == avx512 ? fn##_##type##_avx512(__VA_ARGS__)                                                      \
         : build() == avx2 ? fn##_##type##_avx2(__VA_ARGS__)                                                        \
                           : fn##_##type(__VA_ARGS__)
// The q8_0 cache's AVX-512 build also needs VNNI (its integer scores): an
// AVX-512 CPU without it runs the AVX2 build.
#define STRATA_ATTENTION_PICK_Q8(fn, ...)                                                                           \
  return build() == avx512 && q8_vnni() ? fn##_q8_0_avx512(__VA_ARGS__)                                             \
         : build() != plain             ? fn##_q8_0_avx2(__VA_ARGS__)                                               \
                                        : fn##_q8_0(__VA_ARGS__)
#define STRATA_ATTENTION_DISPATCH(fn, ...)                                                                          \
  switch (rows.type) {                                                                                              \
    case WType::bf16: STRATA_ATTENTION_PICK(fn, bf16, __VA_ARGS__);                                                 \
    case WType::f16: STRATA_ATTENTION_PICK(fn, f16, __VA_ARGS__);                                                   \
    case WType::q8_0: STRATA_ATTENTION_PICK_Q8(fn, __VA_ARGS__);                                                    \
    default: STRATA_ATTENTION_PICK(fn, f32, __VA_ARGS__);                                                           \
  }

void attend_rows(const float* q, int64_t q_stride, int64_t m, const CacheRows& rows, int64_t n0, int64_t hd,
                 float scale, float* scores, float* out, int64_t out_stride) {
  STRATA_ATTENTION_DISPATCH(attend_rows, q, q_stride, m, rows, n0, hd, scale, scores, out, out_stride)
}

void attend_heads(const float* q, int64_t m, const CacheRows& rows, int64_t n, int64_t hd, float scale,
                  float* scores, float* out) {
  STRATA_ATTENTION_DISPATCH(attend_heads, q, m, rows, n, hd, scale, scores, out)
}

void attend_heads_scores(const float* q, int64_t m, const CacheRows& rows, int64_t n, int64_t hd, float scale,
                         float* scores, int64_t k0, int64_t k1, float* mx) {
  STRATA_ATTENTION_DISPATCH(attend_heads_scores, q, m, rows, n, hd, scale, scores, k0, k1, mx)
}

void attend_heads_weights(int64_t m, const CacheRows& rows, int64_t n, float* scores, const float* mx, int64_t parts) {
  STRATA_ATTENTION_DISPATCH(attend_heads_weights, m, rows, n, scores, mx, parts)
}

void attend_heads_values(int64_t m, const CacheRows& rows, int64_t n, int64_t hd, const float* scores, int64_t c0,
                         int64_t c1, float* out) {
  STRATA_ATTENTION_DISPATCH(attend_heads_values, m, rows, n, hd, scores, c0, c1, out)
}

} // namespace strata::model::detail
