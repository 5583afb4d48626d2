// The batched forward pass of a shard.
//
// Rows of all sequences of a batch share one pass over every weight matrix.
// Sequences of few rows (decode steps: one row each) are stacked and multiplied
// by our own kernel, which reads each weight once for all of them and gives every
// row the same rounding whatever else is in the batch; a sequence of many rows (a
// prefill chunk) is multiplied by itself through oneDNN's GEMM, so its numbers do
// not depend on its neighbours either. RMSNorm, RoPE, attention and SwiGLU are
// plain loops over raw floats; attention runs per sequence over its own cache
// blocks, in parallel over (row, head).

#include "model/base/error.hpp"
#include "model/base/parallel.hpp"
#include "model/formats/packed.hpp"
#include "model/formats/quant.hpp"
#include "model/kernels/activations.hpp"
#include "model/kernels/attention.hpp"
#include "model/kernels/kernels.hpp"
#include "model/transformer/sampler.hpp"
#include "model/transformer/shard_impl.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>

namespace strata::model {

using detail::LayerWeights;

namespace {

std::atomic<uint64_t> spreads{0};

void rmsnorm(float* out, const float* x, const float* w, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i)
    ss += x[i] * x[i];
  ss = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    out[i] = w[i] * (ss * x[i]);
}

template <class T>
T* grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n)
    v.resize(static_cast<std::size_t>(n));
  return v.data();
}

// One sequence as the pass sees it.
struct Seq {
  std::size_t index = 0; // in the caller's batch
  int64_t row0 = 0;      // first row in the workspace
  int64_t rows = 0;
  int64_t past = 0; // cached positions before this call
  KVView view;
};

// How the rows of a batch are grouped for the matrix products: [0, small_end)
// go through matmul_rows together; every sequence after that alone through GEMM.
struct Plan {
  std::vector<Seq> seqs;
  int64_t rows = 0;
  int64_t small_end = 0;
  int64_t max_ctx = 0;          // the longest sequence after this call
  std::vector<int32_t> row_seq; // row -> index into seqs
};

} // namespace

namespace {

void fill_rope(const ModelConfig& c, std::vector<float>& cos_t, std::vector<float>& sin_t) {
  const int64_t half = c.head_dim / 2;
  cos_t.resize(static_cast<std::size_t>(c.max_seq_len * half));
  sin_t.resize(cos_t.size());
  const auto inv = c.rope_inv_freq();
  const auto att = static_cast<float>(c.rope_attention_factor());
  for (int64_t p = 0; p < half; ++p) {
    const auto freq = static_cast<float>(inv[static_cast<std::size_t>(p)]);
    for (int64_t pos = 0; pos < c.max_seq_len; ++pos) {
      const float val = static_cast<float>(pos) * freq;
      cos_t[static_cast<std::size_t>(pos * half + p)] = att == 1.0f ? std::cos(val) : std::cos(val) * att;
      sin_t[static_cast<std::size_t>(pos * half + p)] = att == 1.0f ? std::sin(val) : std::sin(val) * att;
    }
  }
}

// ggml's CPU GELU, which the references were made with: the input rounded to
// fp16, a table of the tanh approximation at every fp16 value, the result an
// fp16; x >= 10 is x, x <= -10 is 0.
float gelu(float x) {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t i = 0; i < 65536; ++i) {
      const float v = f16_to_f32(static_cast<uint16_t>(i));
      const float y = 0.5f * v * (1.0f + std::tanh(0.79788456080286535587989211986876f * v * (1.0f + 0.044715f * v * v)));
      t[i] = f16_to_f32(f32_to_f16(y));
    }
    return t;
  }();
  if (x >= 10.f)
    return x;
  if (x <= -10.f)
    return 0.f;
  return table[f32_to_f16(x)];
}

} // namespace

void Shard::Impl::build_rope() {
  fill_rope(cfg, rope_cos, rope_sin);
  const bool scaled = cfg.rope_scaling.type != "none" || !cfg.rope_scaling.freq_factors.empty();
  if (cfg.rope_theta_local > 0 && (cfg.rope_theta_local != cfg.rope_theta || scaled)) {
    ModelConfig local = cfg; // gemma3's local layers: their own base, no scaling
    local.rope_theta = cfg.rope_theta_local;
    local.rope_scaling = RopeScaling{};
    fill_rope(local, rope_cos_local, rope_sin_local);
  }
}

namespace {

struct Pass {
  Shard::Impl& s;
  Plan& plan;

  const ModelConfig& cfg() const { return s.cfg; }

  // out (R, rows) = in (R, cols) W^T over the plan's groups; += when accumulate.
  void linear(float* out, const float* in, const detail::Linear& w, bool accumulate) {
    if (plan.small_end > 0)
      detail::matmul_rows(w, in, out, plan.small_end, accumulate);
    for (auto& q : plan.seqs)
      if (q.row0 >= plan.small_end)
        detail::matmul_gemm(w, in + q.row0 * w.cols, out + q.row0 * w.rows, q.rows, accumulate);
  }

  void rope(float* vec, int64_t n_heads, int64_t pos, bool local) const {
    const int64_t hd = cfg().head_dim, half = hd / 2;
    const bool own = local && !s.rope_cos_local.empty();
    const float* c = (own ? s.rope_cos_local : s.rope_cos).data() + pos * half;
    const float* sn = (own ? s.rope_sin_local : s.rope_sin).data() + pos * half;
    for (int64_t h = 0; h < n_heads; ++h) {
      float* v = vec + h * hd;
      if (cfg().rotary == RotaryLayout::interleaved) {
        for (int64_t p = 0; p < half; ++p) {
          const float v0 = v[2 * p], v1 = v[2 * p + 1];
          v[2 * p] = v0 * c[p] - v1 * sn[p];
          v[2 * p + 1] = v0 * sn[p] + v1 * c[p];
        }
      } else {
        for (int64_t p = 0; p < half; ++p) {
          const float v0 = v[p], v1 = v[p + half];
          v[p] = v0 * c[p] - v1 * sn[p];
          v[p + half] = v1 * c[p] + v0 * sn[p];
        }
      }
    }
  }

  // Causal grouped-query attention of every row against its own sequence's
  // cache. A one-row piece (a decode step) is one item per kv head: the query
  // heads that share it, up to 16 at a time (attend_heads: each cached row is
  // read once for all of them; one head with multi-head attention); a longer
  // piece is cut into groups of up to 16 rows per head (attend_rows), counted
  // from the piece's first row, so a row's arithmetic depends only on its own
  // piece.
  struct Item {
    int32_t seq, head;
    int64_t t0, m;
    bool heads = false; // m query heads from `head` at one position (a decode step)
  };
  std::vector<Item> items;

  void plan_attention() {
    const int64_t nh = cfg().n_heads;
    items.clear();
    for (std::size_t k = 0; k < plan.seqs.size(); ++k) {
      const auto& q = plan.seqs[k];
      const int64_t share = nh / cfg().n_kv_heads;
      // (multi-head attention too, one head a kv head: a decode step then adds
      // every score's products in the order a prefill piece does, and a
      // recovery that rebuilds the cache gets the same bits)
      if (q.rows == 1) {
        for (int64_t h0 = 0; h0 < nh; h0 += share)
          for (int64_t h = h0; h < h0 + share; h += detail::attend_group)
            items.push_back(Item{static_cast<int32_t>(k), static_cast<int32_t>(h), 0,
                                 std::min(detail::attend_group, h0 + share - h), true});
        continue;
      }
      for (int64_t t0 = 0; t0 < q.rows; t0 += detail::attend_group)
        for (int64_t h = 0; h < nh; ++h)
          items.push_back(Item{static_cast<int32_t>(k), static_cast<int32_t>(h), t0,
                               std::min(detail::attend_group, q.rows - t0)});
    }
  }

  // The cache rows item w reads at layer l (its sequence's blocks, its kv head).
  detail::CacheRows cache_rows(int64_t l, const Item& w, int64_t window, float softcap) const {
    const auto& c = cfg();
    const Seq& q = plan.seqs[static_cast<std::size_t>(w.seq)];
    const BlockPool* pool = q.view.pool;
    const int64_t g = w.head / (c.n_heads / c.n_kv_heads);
    return detail::CacheRows{q.view.blocks_of(l).data(), BlockPool::block_tokens, pool->head_row_bytes(),
                             pool->k_offset(l, 0, g), pool->v_offset(l, 0, g), window, softcap,
                             pool->shape().kv_type, pool->keys_by_dim()};
  }

  void attention(int64_t l) {
    const auto& c = cfg();
    const int64_t hd = c.head_dim;
    const int64_t qkv_stride = c.q_dim() + 2 * c.kv_dim();
    const float scale = c.query_scale > 0 ? static_cast<float>(c.query_scale) : 1.0f / std::sqrt(static_cast<float>(hd));
    const int64_t window = c.is_local(s.range.first + l) ? c.sliding_window : 0;
    const auto softcap = static_cast<float>(c.attn_softcap);
    const float* qkv = s.ws.qkv.data();
    float* att = s.ws.att.data();
    const int64_t max_ctx = plan.max_ctx;
    if (attention_spread(l, scale, window, softcap))
      return;
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, max_ctx * hd));
    detail::parallel_for(0, static_cast<int64_t>(items.size()), grain, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> scores;
      const auto need = static_cast<std::size_t>(detail::attend_scores_floats(max_ctx + 1));
      if (scores.size() < need)
        scores.resize(need);
      for (int64_t it = begin; it < end; ++it) {
        const Item& w = items[static_cast<std::size_t>(it)];
        const Seq& q = plan.seqs[static_cast<std::size_t>(w.seq)];
        const detail::CacheRows rows = cache_rows(l, w, window, softcap);
        const int64_t r = q.row0 + w.t0;
        const float* qp = qkv + r * qkv_stride + w.head * hd;
        float* op = att + r * c.q_dim() + w.head * hd;
        // causal: row t of the piece sees positions 0 .. past + t
        if (w.heads)
          detail::attend_heads(qp, w.m, rows, q.past + 1, hd, scale, scores.data(), op);
        else
          detail::attend_rows(qp, qkv_stride, w.m, rows, q.past + w.t0, hd, scale, scores.data(), op, c.q_dim());
      }
    });
  }

  // A round of decode steps with fewer attention items than threads (one
  // session of a model with one kv head, as Gemma 3 1B has) would leave threads
  // idle while one reads a long cache: each item is spread over `spans` threads,
  // its keys cut into spans for the scores and then its output columns for the
  // value pass (attend_heads_scores / _weights / _values: the same bits as one
  // attend_heads call, so a step's numbers do not depend on the threads).
  // False (nothing done) where no item has enough keys to be worth it.
  struct Piece {
    int32_t item, part, parts;
  };
  std::vector<Piece> pieces;
  std::vector<int32_t> item_spans;
  std::vector<int64_t> item_chunks; // heads_keys(...).chunks of each item

  bool attention_spread(int64_t l, float scale, int64_t window, float softcap) {
    const auto& c = cfg();
    const int64_t threads = detail::team_size();
    const auto n_items = static_cast<int64_t>(items.size());
    if (threads < 2 || n_items >= threads ||
        !std::all_of(items.begin(), items.end(), [](const Item& w) { return w.heads; }))
      return false;
    const int64_t hd = c.head_dim;
    const int64_t qkv_stride = c.q_dim() + 2 * c.kv_dim();
    auto rows_of = [&](const Item& w) { return cache_rows(l, w, window, softcap); };
    // Spans of at least 16 chunks (256 keys): below that the threads' meeting
    // points cost more than the work they share.
    const int64_t want = (threads + n_items - 1) / n_items;
    item_spans.assign(static_cast<std::size_t>(n_items), 1);
    item_chunks.resize(static_cast<std::size_t>(n_items));
    bool any = false;
    for (int64_t i = 0; i < n_items; ++i) {
      const Item& w = items[static_cast<std::size_t>(i)];
      const int64_t chunks = detail::heads_keys(rows_of(w), plan.seqs[static_cast<std::size_t>(w.seq)].past + 1).chunks;
      item_chunks[static_cast<std::size_t>(i)] = chunks;
      const int64_t spans = std::min(want, chunks / 16);
      if (spans > 1) {
        item_spans[static_cast<std::size_t>(i)] = static_cast<int32_t>(spans);
        any = true;
      }
    }
    if (!any)
      return false;
    spreads.fetch_add(1, std::memory_order_relaxed);
    const auto per_item = static_cast<std::size_t>(detail::attend_scores_floats(plan.max_ctx + 1));
    float* const scores = grow(s.ws.att_scores, n_items * static_cast<int64_t>(per_item));
    float* const maxima = grow(s.ws.att_max, n_items * want * detail::attend_heads_max_floats);
    pieces.clear();
    for (int64_t i = 0; i < n_items; ++i)
      for (int32_t p = 0; p < item_spans[static_cast<std::size_t>(i)]; ++p)
        pieces.push_back(Piece{static_cast<int32_t>(i), p, item_spans[static_cast<std::size_t>(i)]});
    const auto n_pieces = static_cast<int64_t>(pieces.size());
    const float* qkv = s.ws.qkv.data();
    float* att = s.ws.att.data();
    auto item_scores = [&](int64_t i) { return scores + static_cast<std::size_t>(i) * per_item; };
    auto item_max = [&](int64_t i) { return maxima + i * want * detail::attend_heads_max_floats; };
    // 1. Each span's scores (span boundaries on multiples of 4 chunks: the
    // kernel scores up to 4 chunks at a time).
    detail::parallel_for(0, n_pieces, 1, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        const Piece& pc = pieces[static_cast<std::size_t>(k)];
        const Item& w = items[static_cast<std::size_t>(pc.item)];
        const Seq& q = plan.seqs[static_cast<std::size_t>(w.seq)];
        const detail::CacheRows rows = rows_of(w);
        const int64_t chunks = item_chunks[static_cast<std::size_t>(pc.item)];
        auto bound = [&](int64_t p) { return p == pc.parts ? chunks : (chunks * p / pc.parts) & ~int64_t{3}; };
        const float* qp = qkv + q.row0 * qkv_stride + w.head * hd;
        detail::attend_heads_scores(qp, w.m, rows, q.past + 1, hd, scale, item_scores(pc.item), bound(pc.part),
                                    bound(pc.part + 1), item_max(pc.item) + pc.part * detail::attend_heads_max_floats);
      }
    });
    // 2. Each item's weights.
    detail::parallel_for(0, n_items, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const Item& w = items[static_cast<std::size_t>(i)];
        const Seq& q = plan.seqs[static_cast<std::size_t>(w.seq)];
        detail::attend_heads_weights(w.m, rows_of(w), q.past + 1, item_scores(i), item_max(i),
                                     item_spans[static_cast<std::size_t>(i)]);
      }
    });
    // 3. Each span of output columns (multiples of 64 where the head size
    // allows, so that the value pass keeps its widest tiles; else of 16).
    detail::parallel_for(0, n_pieces, 1, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        const Piece& pc = pieces[static_cast<std::size_t>(k)];
        const Item& w = items[static_cast<std::size_t>(pc.item)];
        const Seq& q = plan.seqs[static_cast<std::size_t>(w.seq)];
        float* op = att + q.row0 * c.q_dim() + w.head * hd;
        if (hd % 16 != 0) { // one piece does the columns
          if (pc.part == 0)
            detail::attend_heads_values(w.m, rows_of(w), q.past + 1, hd, item_scores(pc.item), 0, hd, op);
          continue;
        }
        const int64_t unit = hd % 64 == 0 && hd / 64 >= pc.parts ? 64 : 16, units = hd / unit;
        const int64_t c0 = units * pc.part / pc.parts * unit, c1 = units * (pc.part + 1) / pc.parts * unit;
        if (c1 > c0)
          detail::attend_heads_values(w.m, rows_of(w), q.past + 1, hd, item_scores(pc.item), c0, c1, op);
      }
    });
    return true;
  }

  // Row-wise work over all rows, split across threads when there is enough.
  template <class F>
  void rows_parallel(int64_t per_row, F&& f) {
    const int64_t R = plan.rows;
    if (R * per_row < (int64_t{1} << 16)) {
      f(0, R);
      return;
    }
    detail::parallel_for(0, R, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(per_row, 1)), f);
  }

  // Normalizes every row of `y` (R, D) with `w` and adds it to the residual `x`
  // (Gemma's norms after attention and after the FFN).
  void add_post_normed(float* x, float* y, const std::vector<float>& w) {
    const int64_t D = cfg().dim;
    const float eps = static_cast<float>(cfg().norm_eps);
    rows_parallel(2 * D, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        rmsnorm(y + r * D, y + r * D, w.data(), D, eps);
        for (int64_t i = 0; i < D; ++i)
          x[r * D + i] += y[r * D + i];
      }
    });
  }

  // gate | up (n, 2H) -> act(gate) * up (n, H).
  void gated(const float* h13, float* out, int64_t n, int64_t H) const {
    const bool gelu_act = cfg().ffn_act == FfnActivation::gelu_tanh;
    for (int64_t r = 0; r < n; ++r) {
      const float* g = h13 + r * 2 * H;
      const float* u = g + H;
      float* o = out + r * H;
      if (gelu_act)
        for (int64_t i = 0; i < H; ++i)
          o[i] = gelu(g[i]) * u[i];
      else
        detail::silu_mul(g, u, o, H);
    }
  }

  // One expert over the gathered rows `gx` (n, D): gy (n, D) = down(act(gate x) * up x),
  // with gh (n, 2 EH) and ga (n, EH) as scratch. `few`: the rows come from the
  // stacked few-row sequences and go through matmul_rows whatever n is (a row's
  // numbers must not depend on how many other sequences chose e); otherwise (one
  // long sequence's rows, n a function of its own tokens) GEMM above small_rows.
  void expert(const LayerWeights& lw, std::size_t e, const float* gx, int64_t n, bool few, float* gh, float* ga,
              float* gy) const {
    const int64_t EH = cfg().expert_hidden_dim;
    if (few || n <= detail::small_rows) {
      detail::matmul_rows(lw.expert_w13[e], gx, gh, n, false);
      gated(gh, ga, n, EH);
      detail::matmul_rows(lw.expert_w2[e], ga, gy, n, false);
    } else {
      detail::matmul_gemm(lw.expert_w13[e], gx, gh, n, false);
      gated(gh, ga, n, EH);
      detail::matmul_gemm(lw.expert_w2[e], ga, gy, n, false);
    }
  }

  // The mixture of experts over the normed rows `xb`, into `out` (R, D) (zeroed
  // here). Per row: the router's softmax over every expert, the k most
  // probable (the lower index first on ties), their probabilities renormalised.
  // Each expert's matrices are read once per group of rows that chose it: the
  // decode rows of all sequences together, a long sequence's rows on their
  // own, so a row's numbers never depend on the other sequences of the batch;
  // each row adds its experts' outputs in ascending expert order.
  void moe(const LayerWeights& lw, const float* xb, float* out) {
    const auto& c = cfg();
    auto& ws = s.ws;
    const int64_t R = plan.rows, D = c.dim, E = c.n_experts, K = c.n_experts_used;
    float* logits = grow(ws.router, R * E);
    detail::Linear router;
    router.add(lw.router);
    // Every row through matmul_rows, long sequences' too: f32 router logits
    // from sgemm differ in the last bits, and quantized experts would turn
    // that into whole rounding steps (the router is small: E x D).
    detail::matmul_rows(router, xb, logits, R, false);
    int32_t* chosen = grow(ws.chosen, R * K);
    float* weight = grow(ws.weight, R * K);
    for (int64_t r = 0; r < R; ++r) {
      const float* lg = logits + r * E;
      float mx = lg[0];
      for (int64_t e = 1; e < E; ++e)
        mx = std::max(mx, lg[e]);
      std::vector<float> p(static_cast<std::size_t>(E));
      float sum = 0.f;
      for (int64_t e = 0; e < E; ++e)
        sum += p[static_cast<std::size_t>(e)] = std::exp(lg[e] - mx);
      for (auto& v : p)
        v /= sum;
      std::vector<int32_t> order(static_cast<std::size_t>(E));
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int32_t a, int32_t b) {
        return p[static_cast<std::size_t>(a)] != p[static_cast<std::size_t>(b)] ? p[static_cast<std::size_t>(a)] > p[static_cast<std::size_t>(b)]
                                                                                : a < b;
      });
      float top = 0.f;
      for (int64_t k = 0; k < K; ++k)
        top += p[static_cast<std::size_t>(order[static_cast<std::size_t>(k)])];
      for (int64_t k = 0; k < K; ++k) {
        chosen[r * K + k] = order[static_cast<std::size_t>(k)];
        weight[r * K + k] = p[static_cast<std::size_t>(order[static_cast<std::size_t>(k)])] / top;
      }
    }
    std::memset(out, 0, static_cast<std::size_t>(R * D) * sizeof(float));
    // Groups of rows that share expert passes: the stacked decode rows, then each long sequence.
    std::vector<std::pair<int64_t, int64_t>> groups;
    if (plan.small_end > 0)
      groups.emplace_back(0, plan.small_end);
    for (auto& q : plan.seqs)
      if (q.row0 >= plan.small_end)
        groups.emplace_back(q.row0, q.row0 + q.rows);
    const int64_t EH = c.expert_hidden_dim;
    for (auto [g0, g1] : groups) {
      const bool few = g0 < plan.small_end;
      // Each expert's rows (ascending) and their weights.
      std::vector<std::vector<int64_t>> rows(static_cast<std::size_t>(E));
      std::vector<std::vector<float>> wts(static_cast<std::size_t>(E));
      for (int64_t r = g0; r < g1; ++r)
        for (int64_t k = 0; k < K; ++k) {
          const auto e = static_cast<std::size_t>(chosen[r * K + k]);
          rows[e].push_back(r);
          wts[e].push_back(weight[r * K + k]);
        }
      std::vector<std::size_t> used;
      for (std::size_t e = 0; e < rows.size(); ++e)
        if (!rows[e].empty())
          used.push_back(e);
      // The experts' products: for the few-row group each expert on one thread,
      // the experts side by side (one parallel region per layer instead of one
      // per product; a product's numbers do not depend on its thread); a long
      // sequence's experts one after the other, each GEMM using every thread.
      std::vector<std::vector<float>> ys(used.size());
      auto run = [&](std::size_t u) {
        const std::size_t e = used[u];
        const auto n = static_cast<int64_t>(rows[e].size());
        thread_local std::vector<float> gx, gh, ga;
        grow(gx, n * D);
        grow(gh, n * 2 * EH);
        grow(ga, n * EH);
        for (int64_t i = 0; i < n; ++i)
          std::memcpy(gx.data() + i * D, xb + rows[e][static_cast<std::size_t>(i)] * D,
                      static_cast<std::size_t>(D) * sizeof(float));
        ys[u].resize(static_cast<std::size_t>(n * D));
        expert(lw, e, gx.data(), n, few, gh.data(), ga.data(), ys[u].data());
      };
      if (few && used.size() > 1 && detail::team_size() > 1)
        detail::parallel_for(0, static_cast<int64_t>(used.size()), 1, [&](int64_t u0, int64_t u1) {
          for (int64_t u = u0; u < u1; ++u)
            run(static_cast<std::size_t>(u));
        });
      else
        for (std::size_t u = 0; u < used.size(); ++u)
          run(u);
      // Each row adds its experts' outputs in ascending expert order.
      for (std::size_t u = 0; u < used.size(); ++u) {
        const std::size_t e = used[u];
        const float* gy = ys[u].data();
        for (std::size_t i = 0; i < rows[e].size(); ++i) {
          float* o = out + rows[e][i] * D;
          const float wgt = wts[e][i];
          for (int64_t j = 0; j < D; ++j)
            o[j] += wgt * gy[static_cast<int64_t>(i) * D + j];
        }
      }
    }
  }

  void layers() {
    const auto& c = cfg();
    const int64_t R = plan.rows;
    const int64_t D = c.dim, Q = c.q_dim(), KV = c.kv_dim(), H = c.hidden_dim, hd = c.head_dim;
    const int64_t qkv_stride = Q + 2 * KV;
    const float eps = static_cast<float>(c.norm_eps);
    auto& ws = s.ws;
    float* x = ws.x.data();
    float* xb = grow(ws.xb, R * D);
    float* qkv = grow(ws.qkv, R * qkv_stride);
    grow(ws.att, R * Q);
    float* h13 = c.moe() ? nullptr : grow(ws.h13, R * 2 * H);
    float* hb = c.moe() ? nullptr : grow(ws.hb, R * H);
    float* tmp = c.sandwich_norms || c.moe() ? grow(ws.tmp, R * D) : nullptr;
    plan_attention();
    const WType kv_type = plan.seqs.front().view.pool->shape().kv_type;
    for (int64_t l = 0; l < s.range.count(); ++l) {
      const LayerWeights& lw = s.w.layers[static_cast<std::size_t>(l)];
      const bool local = c.is_local(s.range.first + l);
      // Attention block.
      rows_parallel(D, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          rmsnorm(xb + r * D, x + r * D, lw.attn_norm.data(), D, eps);
      });
      linear(qkv, xb, lw.wqkv, false);
      rows_parallel(qkv_stride, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const Seq& q = plan.seqs[static_cast<std::size_t>(plan.row_seq[static_cast<std::size_t>(r)])];
          const int64_t pos = q.past + (r - q.row0);
          float* row = qkv + r * qkv_stride;
          if (!lw.bqkv.empty()) {
            const float* b = lw.bqkv.data();
            for (int64_t i = 0; i < qkv_stride; ++i)
              row[i] += b[i];
          }
          if (c.qk_norm) { // each head of q and of k on its own
            for (int64_t h = 0; h < c.n_heads; ++h)
              rmsnorm(row + h * hd, row + h * hd, lw.q_norm.data(), hd, eps);
            for (int64_t h = 0; h < c.n_kv_heads; ++h)
              rmsnorm(row + Q + h * hd, row + Q + h * hd, lw.k_norm.data(), hd, eps);
          }
          rope(row, c.n_heads, pos, local);
          rope(row + Q, c.n_kv_heads, pos, local);
          for (int64_t g = 0; g < c.n_kv_heads; ++g) { // f32: a copy (keys by dimension)
            q.view.put_key(l, pos, g, row + Q + g * hd, hd);
            quantize(kv_type, row + Q + KV + g * hd, q.view.v(l, pos, g), hd);
          }
        }
      });
      attention(l);
      if (c.sandwich_norms) {
        linear(tmp, ws.att.data(), lw.wo, false);
        add_post_normed(x, tmp, lw.post_attn_norm);
      } else {
        linear(x, ws.att.data(), lw.wo, true);
      }
      // Feed-forward block: gated (SwiGLU / GeGLU), or a mixture of experts.
      rows_parallel(D, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          rmsnorm(xb + r * D, x + r * D, lw.ffn_norm.data(), D, eps);
      });
      if (c.moe()) {
        moe(lw, xb, tmp);
        if (c.sandwich_norms) {
          add_post_normed(x, tmp, lw.post_ffn_norm);
        } else {
          for (int64_t i = 0; i < R * D; ++i)
            x[i] += tmp[i];
        }
        continue;
      }
      linear(h13, xb, lw.w13, false);
      rows_parallel(4 * H, [&](int64_t r0, int64_t r1) { gated(h13 + r0 * 2 * H, hb + r0 * H, r1 - r0, H); });
      if (c.sandwich_norms) {
        linear(tmp, hb, lw.w2, false);
        add_post_normed(x, tmp, lw.post_ffn_norm);
      } else {
        linear(x, hb, lw.w2, true);
      }
    }
  }
};

} // namespace

std::vector<SeqOutcome> Shard::Impl::run(std::span<const SeqStep> batch) {
  std::vector<SeqOutcome> out(batch.size());
  const bool head = range.first == 0;
  const bool tail = range.last == cfg.n_layers - 1;
  const std::string layers = std::to_string(range.first) + "-" + std::to_string(range.last);
  // Check every sequence before touching anything; a failing one is left out.
  std::vector<std::size_t> ok;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const SeqStep& st = batch[i];
    try {
      const int64_t T = head ? static_cast<int64_t>(st.tokens.size()) : st.rows;
      if (head && st.hidden)
        throw Error(errc::bad_argument, "shard " + layers + " is the head: it takes token ids, not hidden states");
      if (!head && (!st.tokens.empty() || !st.hidden))
        throw Error(errc::bad_argument, "shard " + layers + " is not the head: it takes hidden states, not token ids");
      if (T <= 0)
        throw Error(errc::bad_shape, "a forward call needs at least one token");
      if (static_cast<int64_t>(st.positions.size()) != T)
        throw Error(errc::bad_shape,
                    std::to_string(T) + " input rows but " + std::to_string(st.positions.size()) + " positions");
      if (!st.cache || !st.cache->pool() || !(st.cache->pool()->shape() == cache_shape()) ||
          (st.cache->pool()->owner() != 0 && st.cache->pool()->owner() != uid))
        throw Error(errc::bad_argument, "the KV cache was not created by this shard (layers " + layers + ")");
      const int64_t past = st.cache->seq_len();
      for (int64_t t = 0; t < T; ++t)
        if (st.positions[static_cast<std::size_t>(t)] != past + t)
          throw Error(errc::bad_position, "position " + std::to_string(st.positions[static_cast<std::size_t>(t)]) +
                                            " at index " + std::to_string(t) +
                                            " does not continue the cache, which holds " + std::to_string(past) +
                                            " tokens (expected " + std::to_string(past + t) + ")");
      if (past + T > cfg.max_seq_len)
        throw Error(errc::context_overflow, "sequence of " + std::to_string(past + T) +
                                              " tokens exceeds max_seq_len " + std::to_string(cfg.max_seq_len));
      if (head)
        for (int64_t t = 0; t < T; ++t) {
          const int32_t id = st.tokens[static_cast<std::size_t>(t)];
          if (id < 0 || id >= cfg.vocab_size)
            throw Error(errc::token_out_of_range, "token id " + std::to_string(id) + " at index " + std::to_string(t) +
                                                    " is outside the vocabulary of " + std::to_string(cfg.vocab_size));
        }
      for (std::size_t j : ok)
        if (batch[j].cache == st.cache)
          throw Error(errc::bad_argument, "the same cache appears twice in one batch");
      if (!st.cache->reserve(past + T))
        throw Error(errc::cache_full, "the block pool has " + std::to_string(st.cache->pool()->available()) +
                                        " free blocks; " + std::to_string(st.cache->blocks_missing(past + T)) +
                                        " more are needed for " + std::to_string(past + T) + " positions");
      ok.push_back(i);
    } catch (const Error& e) {
      out[i].error = e;
    }
  }
  if (ok.empty())
    return out;

  // Few-row sequences first (stacked for matmul_rows), then the long ones.
  Plan plan;
  auto rows_of = [&](std::size_t i) {
    return head ? static_cast<int64_t>(batch[i].tokens.size()) : batch[i].rows;
  };
  std::stable_partition(ok.begin(), ok.end(), [&](std::size_t i) { return rows_of(i) <= detail::small_rows; });
  for (std::size_t i : ok) {
    Seq q;
    q.index = i;
    q.row0 = plan.rows;
    q.rows = rows_of(i);
    q.past = batch[i].cache->seq_len();
    q.view = batch[i].cache->view();
    if (q.rows <= detail::small_rows)
      plan.small_end = plan.rows + q.rows;
    plan.rows += q.rows;
    plan.max_ctx = std::max(plan.max_ctx, q.past + q.rows);
    plan.row_seq.insert(plan.row_seq.end(), static_cast<std::size_t>(q.rows), static_cast<int32_t>(plan.seqs.size()));
    plan.seqs.push_back(std::move(q));
  }

  const int64_t D = cfg.dim;
  float* x = grow(ws.x, plan.rows * D);
  for (auto& q : plan.seqs) {
    const SeqStep& st = batch[q.index];
    if (head) {
      const auto scale = static_cast<float>(cfg.embed_scale);
      for (int64_t t = 0; t < q.rows; ++t) {
        float* row = x + (q.row0 + t) * D;
        dequantize_rows(w.embedding, st.tokens[static_cast<std::size_t>(t)], 1, row);
        if (scale != 1.0f)
          for (int64_t i = 0; i < D; ++i)
            row[i] *= scale;
      }
    } else {
      std::memcpy(x + q.row0 * D, st.hidden, static_cast<std::size_t>(q.rows * D) * sizeof(float));
    }
  }
  Pass{*this, plan, {}, {}, {}, {}}.layers();
  // Commit: only now do the new positions count.
  for (auto& q : plan.seqs)
    batch[q.index].cache->commit(q.past + q.rows);

  if (tail) {
    // gemma2: logits = c tanh(logits / c)
    const auto softcap = [&](float* lg, int64_t count) {
      if (cfg.final_softcap <= 0)
        return;
      const auto cap = static_cast<float>(cfg.final_softcap), inv = 1.0f / cap;
      for (int64_t i = 0; i < count; ++i)
        lg[i] = cap * std::tanh(lg[i] * inv);
    };
    // The last row of every emitting sequence through the final norm and the
    // classifier, stacked: the classifier is read once for all of them.
    std::vector<const Seq*> emit;
    std::vector<int64_t> first_out; // per emitting sequence: its first row in the stacked logits
    int64_t S = 0;
    for (auto& q : plan.seqs)
      if (batch[q.index].emit) {
        emit.push_back(&q);
        first_out.push_back(S);
        S += std::clamp<int64_t>(batch[q.index].logit_rows, 1, q.rows);
      }
    if (S > 0) {
      float* xn = grow(ws.xn, S * D);
      float* lg = grow(ws.logits, S * cfg.vocab_size);
      for (std::size_t e = 0; e < emit.size(); ++e) {
        const Seq& q = *emit[e];
        const int64_t n = (e + 1 < emit.size() ? first_out[e + 1] : S) - first_out[e];
        for (int64_t k = 0; k < n; ++k)
          rmsnorm(xn + (first_out[e] + k) * D, x + (q.row0 + q.rows - n + k) * D, w.final_norm.data(), D,
                  static_cast<float>(cfg.norm_eps));
      }
      detail::matmul_rows(w.classifier, xn, lg, cfg.vocab_size, S, false);
      softcap(lg, S * cfg.vocab_size);
      for (std::size_t e = 0; e < emit.size(); ++e) {
        const int64_t end = e + 1 < emit.size() ? first_out[e + 1] : S;
        out[emit[e]->index].out.logits.assign(lg + first_out[e] * cfg.vocab_size, lg + end * cfg.vocab_size);
      }
    }
    // Prompt log-probabilities: every row of such a sequence, a few rows at a
    // time through the classifier, reduced at once to what was asked.
    for (auto& q : plan.seqs) {
      const auto& st = batch[q.index];
      if (st.row_targets.empty())
        continue;
      auto& o = out[q.index].out;
      const int64_t k = std::clamp<int64_t>(st.row_top, 0, 20);
      o.row_logprobs.assign(static_cast<std::size_t>(q.rows), 0.0f);
      o.row_top_ids.assign(static_cast<std::size_t>(q.rows * k), -1);
      o.row_top_logprobs.assign(static_cast<std::size_t>(q.rows * k), 0.0f);
      constexpr int64_t chunk = 16;
      float* xn = grow(ws.xn, chunk * D);
      float* lg = grow(ws.logits, chunk * cfg.vocab_size);
      for (int64_t r0 = 0; r0 < q.rows; r0 += chunk) {
        const int64_t n = std::min(chunk, q.rows - r0);
        for (int64_t r = 0; r < n; ++r)
          rmsnorm(xn + r * D, x + (q.row0 + r0 + r) * D, w.final_norm.data(), D,
                  static_cast<float>(cfg.norm_eps));
        detail::matmul_rows(w.classifier, xn, lg, cfg.vocab_size, n, false);
        softcap(lg, n * cfg.vocab_size);
        for (int64_t r = 0; r < n; ++r) {
          const float* row = lg + r * cfg.vocab_size;
          const auto i = static_cast<std::size_t>(r0 + r);
          const int32_t target = i < st.row_targets.size() ? st.row_targets[i] : -1;
          if (target < 0 && k == 0)
            continue;
          auto lp = token_logprobs(std::span<const float>(row, static_cast<std::size_t>(cfg.vocab_size)),
                                   target >= 0 && target < cfg.vocab_size ? target : 0, static_cast<int32_t>(k));
          o.row_logprobs[i] = target >= 0 ? lp.logprob : 0.0f;
          for (std::size_t j = 0; j < lp.top_ids.size(); ++j) {
            o.row_top_ids[i * static_cast<std::size_t>(k) + j] = lp.top_ids[j];
            o.row_top_logprobs[i * static_cast<std::size_t>(k) + j] = lp.top_logprobs[j];
          }
        }
      }
    }
  } else {
    // Every shard but the tail keeps its output rows beside its keys and values
    // (kv_cache.hpp): what the next shard got, to rebuild it from if it loses its cache.
    for (auto& q : plan.seqs)
      if (q.view.pool->shape().out_dim == D)
        for (int64_t t = 0; t < q.rows; ++t)
          std::memcpy(q.view.out(q.past + t), x + (q.row0 + t) * D, static_cast<std::size_t>(D) * sizeof(float));
    for (auto& q : plan.seqs) {
      if (!batch[q.index].emit)
        continue;
      auto& h = out[q.index].out.hidden;
      h.rows = q.rows;
      h.cols = D;
      h.data.assign(x + q.row0 * D, x + (q.row0 + q.rows) * D);
    }
  }
  return out;
}

uint64_t attention_spreads() {
  return spreads.load(std::memory_order_relaxed);
}

} // namespace strata::model
