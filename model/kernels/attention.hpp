#pragma once
// Internal to model/: attention of query rows against a sequence's cached rows,
// read in the cache's stored type. Torch-free.

#include "model/formats/wmatrix.hpp"

#include <cstddef>
#include <cstdint>

namespace strata::model::detail {

/// Where one attention head finds cached rows: row j of K starts at byte
/// blocks[j / block_tokens] + k_offset + (j % block_tokens) * row_stride, V
/// likewise; its head_dim values are of `type` (f32, bf16, f16, or q8_0 blocks
/// of 32: head_dim a multiple of 32).
struct CacheRows {
  const uint8_t* const* blocks;
  int64_t block_tokens;
  std::size_t row_stride;
  std::size_t k_offset;
  std::size_t v_offset;
  /// Sliding window: the query at position p sees keys p' with p - p' < window
  /// (0: every earlier key). Blocks wholly before the window are never read.
  int64_t window = 0;
  /// Scores become softcap * tanh(score / softcap) before the softmax (0: off).
  float softcap = 0.f;
  WType type = WType::f32;
  /// f32 or q8_0 keys stored by dimension (BlockPool's keys_by_dim): key j's
  /// parts lie in the run from blocks[j / block_tokens] + k_offset as the
  /// by_dim_* offsets below give them for slot j % block_tokens; row_stride
  /// then applies to the values only.
  bool keys_by_dim = false;
};

/// Keys by dimension inside a kv head's run of bt keys (one block), slot s:
/// f32 value i at float by_dim_f32(bt, i, s); q8_0 block b (values 32 b ..
/// 32 b + 31) has its f16 scale at byte by_dim_q8_scale(bt, b, s) and its
/// unit u (values 32 b + 4 u .. + 3) at byte by_dim_q8_unit(bt, b, u, s): the
/// run holds, per block, the bt scales, then each unit of the bt slots side by
/// side. So 16 consecutive slots' value i (q8_0: unit u, or scale) are one load.
constexpr std::size_t by_dim_f32(int64_t bt, int64_t i, int64_t s) { return static_cast<std::size_t>(i * bt + s); }
constexpr std::size_t by_dim_q8_scale(int64_t bt, int64_t b, int64_t s) {
  return static_cast<std::size_t>(34 * bt * b + 2 * s);
}
constexpr std::size_t by_dim_q8_unit(int64_t bt, int64_t b, int64_t u, int64_t s) {
  return static_cast<std::size_t>(34 * bt * b + 2 * bt + 4 * (u * bt + s));
}

/// Attention of query rows against a sequence's cached rows: out =
/// softmax(q.K^T * scale) V over the keys a row sees (with a window only the
/// last `window` of them), head sizes up to max_head_dim. Two kernels, the same
/// bits for the same query at the same position: a score adds its products in
/// order of the head dimension, the softmax weights are summed by key position
/// mod 16 in one fixed tree, the value pass adds keys in order. So a decode step
/// equals the stateless recomputation of its position, and a rebuilt cache the
/// one it replaces.
///
/// Up to 16 consecutive query rows of one head (rows of one piece of one
/// sequence) against cached rows: row t (0 <= t < m) sees the first n0 + t + 1
/// cached rows (causal). Query row t starts at q + t * q_stride, its output at
/// out + t * out_stride. Each key is read once for all rows and no horizontal
/// sums are needed (the rows' queries are transposed into vector lanes); a row's
/// result does not depend on m. `scores` has room for 16 * (n0 + m) floats.
void attend_rows(const float* q, int64_t q_stride, int64_t m, const CacheRows& rows, int64_t n0, int64_t head_dim,
                 float scale, float* scores, float* out, int64_t out_stride);
constexpr int64_t attend_group = 16;

/// Up to 16 query heads of one position that share a kv head (a decode step;
/// one head where each has its own kv head), query head t at q + t * head_dim, its output at
/// out + t * head_dim, against cached rows 0..n-1: each key and value row is
/// read once for all of them, not once per head. A head's result does not
/// depend on m, and is the same bits as attend_rows gives the same query as row
/// n-1 of a piece. `scores` has room for attend_scores_floats(n) floats.
void attend_heads(const float* q, int64_t m, const CacheRows& rows, int64_t n, int64_t head_dim, float scale,
                  float* scores, float* out);

/// attend_heads in three steps, so that one such call (the heads of one kv head
/// against a long cache: a decode step of a model with one or two kv heads) can
/// be spread over threads. However the work is split, every number is the same
/// bits as attend_heads gives. The keys form heads_keys(rows, n).chunks chunks
/// of 16.
///  1. attend_heads_scores: chunks [k0, k1) scored into `scores` (each chunk's
///     own floats: calls on disjoint chunks may run at once), the heads' maxima
///     of them into mx (attend_heads_max_floats floats).
///  2. attend_heads_weights, once every chunk has its scores: the maxima of
///     `parts` calls of step 1 (at mx, mx + attend_heads_max_floats, ...)
///     merged, and the scores made the softmax's weights.
///  3. attend_heads_values: output columns [c0, c1) of every head (multiples of
///     16 where head_dim is one, else 0 and head_dim); calls on disjoint
///     columns may run at once.
void attend_heads_scores(const float* q, int64_t m, const CacheRows& rows, int64_t n, int64_t head_dim, float scale,
                         float* scores, int64_t k0, int64_t k1, float* mx);
void attend_heads_weights(int64_t m, const CacheRows& rows, int64_t n, float* scores, const float* mx, int64_t parts);
void attend_heads_values(int64_t m, const CacheRows& rows, int64_t n, int64_t head_dim, const float* scores,
                         int64_t c0, int64_t c1, float* out);
constexpr int64_t attend_heads_max_floats = 16 * 16;
/// The keys a decode step at n cached rows sees: [lo, n) (the window's, if
/// any), scored in `chunks` chunks of 16 from `base` (lo rounded down to 16).
struct HeadsKeys {
  int64_t lo, base, chunks;
};
inline HeadsKeys heads_keys(const CacheRows& rows, int64_t n) {
  const int64_t lo = rows.window > 0 && n > rows.window ? n - rows.window : 0;
  const int64_t base = lo & ~int64_t{15};
  return {lo, base, (n - base + 15) / 16};
}

/// Which build of the kernels runs (tests and benches compare them on one
/// machine; all give the same bits): best = the widest this CPU runs (AVX-512,
/// with F16C's vcvtph2ps for f16 values; else AVX2; else the baseline),
/// avx2 = the AVX2 build (where the CPU has AVX2), portable = the plain build
/// (its AVX-512 clone where the CPU has it; f16 values converted by integer
/// arithmetic). Process-wide.
enum class AttentionIsa { best, avx2, portable };
void set_attention_isa(AttentionIsa isa);
/// Bytes of value rows (of the columns a call computes) the value pass covers
/// per run: every pass of columns over one run, then the next run, so a run's
/// later passes find it in L2 (attention_impl.hpp, value_columns_w). Tests
/// shorten it so that short sequences cross runs; process-wide; no result's
/// bits depend on it.
constexpr int64_t value_run_bytes_default = 128 << 10;
void set_value_run_bytes(int64_t bytes);
int64_t value_run_bytes();
/// Whether this CPU runs the AVX-512 attention kernels.
bool attention_avx512_available();
/// Whether this CPU runs the AVX2 ones (AVX2, FMA, F16C).
bool attention_avx2_available();

/// The largest head size the kernels take (ModelConfig::validate refuses larger).
constexpr int64_t max_head_dim = 512;

/// The scratch every kernel here needs against n cached rows.
constexpr int64_t attend_scores_floats(int64_t n) { return attend_group * (n + 80); }

} // namespace strata::model::detail
