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
#include "model/kernels/kernels.hpp"
#include "model/transformer/shard_impl.hpp"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <numeric>

namespace strata::model {

using detail::LayerWeights;

namespace {

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

void Shard::Impl::build_rope() {
  const int64_t half = cfg.head_dim / 2;
  rope_cos.resize(static_cast<std::size_t>(cfg.max_seq_len * half));
  rope_sin.resize(rope_cos.size());
  const auto inv = cfg.rope_inv_freq();
  const auto att = static_cast<float>(cfg.rope_attention_factor());
  for (int64_t p = 0; p < half; ++p) {
    const auto freq = static_cast<float>(inv[static_cast<std::size_t>(p)]);
    for (int64_t pos = 0; pos < cfg.max_seq_len; ++pos) {
      const float val = static_cast<float>(pos) * freq;
      rope_cos[static_cast<std::size_t>(pos * half + p)] = att == 1.0f ? std::cos(val) : std::cos(val) * att;
      rope_sin[static_cast<std::size_t>(pos * half + p)] = att == 1.0f ? std::sin(val) : std::sin(val) * att;
    }
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

  void rope(float* vec, int64_t n_heads, int64_t pos) const {
    const int64_t hd = cfg().head_dim, half = hd / 2;
    const float* c = s.rope_cos.data() + pos * half;
    const float* sn = s.rope_sin.data() + pos * half;
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
  // cache. A one-row piece (a decode step) is one item per head; a longer piece
  // is cut into groups of up to 16 rows per head (attend_rows), counted from the
  // piece's first row, so a row's arithmetic depends only on its own piece.
  struct Item {
    int32_t seq, head;
    int64_t t0, m;
  };
  std::vector<Item> items;

  void plan_attention() {
    const int64_t nh = cfg().n_heads;
    const bool grouped = cfg().head_dim <= 256;
    items.clear();
    for (std::size_t k = 0; k < plan.seqs.size(); ++k) {
      const auto& q = plan.seqs[k];
      const int64_t g = q.rows == 1 || !grouped ? 1 : detail::attend_group;
      for (int64_t t0 = 0; t0 < q.rows; t0 += g)
        for (int64_t h = 0; h < nh; ++h)
          items.push_back(Item{static_cast<int32_t>(k), static_cast<int32_t>(h), t0, std::min(g, q.rows - t0)});
    }
  }

  void attention(int64_t l) {
    const auto& c = cfg();
    const int64_t hd = c.head_dim, group = c.n_heads / c.n_kv_heads;
    const int64_t qkv_stride = c.q_dim() + 2 * c.kv_dim();
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const float* qkv = s.ws.qkv.data();
    float* att = s.ws.att.data();
    const int64_t max_ctx = plan.max_ctx;
    const BlockPool* pool = plan.seqs.front().view.pool;
    const int64_t k0 = pool->k_offset(l, 0), v0 = pool->v_offset(l, 0);
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, max_ctx * hd));
    at::parallel_for(0, static_cast<int64_t>(items.size()), grain, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> scores;
      const auto need = static_cast<std::size_t>(detail::attend_group * (max_ctx + 1));
      if (scores.size() < need)
        scores.resize(need);
      for (int64_t it = begin; it < end; ++it) {
        const Item& w = items[static_cast<std::size_t>(it)];
        const Seq& q = plan.seqs[static_cast<std::size_t>(w.seq)];
        const int64_t g = w.head / group;
        const detail::CacheRows rows{q.view.blocks.data(), BlockPool::block_tokens, c.kv_dim(), k0 + g * hd,
                                     v0 + g * hd};
        const int64_t r = q.row0 + w.t0;
        const float* qp = qkv + r * qkv_stride + w.head * hd;
        float* op = att + r * c.q_dim() + w.head * hd;
        // causal: row t of the piece sees positions 0 .. past + t
        if (w.m == 1 && q.rows == 1)
          detail::attend(qp, rows, q.past + w.t0 + 1, hd, scale, scores.data(), op);
        else
          detail::attend_rows(qp, qkv_stride, w.m, rows, q.past + w.t0, hd, scale, scores.data(), op, c.q_dim());
      }
    });
  }

  // Row-wise work over all rows, split across threads when there is enough.
  template <class F>
  void rows_parallel(int64_t per_row, F&& f) {
    const int64_t R = plan.rows;
    if (R * per_row < (int64_t{1} << 16)) {
      f(0, R);
      return;
    }
    at::parallel_for(0, R, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(per_row, 1)), f);
  }

  void layers() {
    const auto& c = cfg();
    const int64_t R = plan.rows;
    const int64_t D = c.dim, Q = c.q_dim(), KV = c.kv_dim(), H = c.hidden_dim;
    const int64_t qkv_stride = Q + 2 * KV;
    const float eps = static_cast<float>(c.norm_eps);
    auto& ws = s.ws;
    float* x = ws.x.data();
    float* xb = grow(ws.xb, R * D);
    float* qkv = grow(ws.qkv, R * qkv_stride);
    grow(ws.att, R * Q);
    float* h13 = grow(ws.h13, R * 2 * H);
    float* hb = grow(ws.hb, R * H);
    plan_attention();
    for (int64_t l = 0; l < s.range.count(); ++l) {
      const LayerWeights& lw = s.w.layers[static_cast<std::size_t>(l)];
      // Attention block.
      rows_parallel(D, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          rmsnorm(xb + r * D, x + r * D, lw.attn_norm.data_ptr<float>(), D, eps);
      });
      linear(qkv, xb, lw.wqkv, false);
      rows_parallel(qkv_stride, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const Seq& q = plan.seqs[static_cast<std::size_t>(plan.row_seq[static_cast<std::size_t>(r)])];
          const int64_t pos = q.past + (r - q.row0);
          float* row = qkv + r * qkv_stride;
          if (lw.bqkv.defined()) {
            const float* b = lw.bqkv.data_ptr<float>();
            for (int64_t i = 0; i < qkv_stride; ++i)
              row[i] += b[i];
          }
          rope(row, c.n_heads, pos);
          rope(row + Q, c.n_kv_heads, pos);
          std::memcpy(q.view.k(l, pos), row + Q, static_cast<std::size_t>(KV) * sizeof(float));
          std::memcpy(q.view.v(l, pos), row + Q + KV, static_cast<std::size_t>(KV) * sizeof(float));
        }
      });
      attention(l);
      linear(x, ws.att.data(), lw.wo, true);
      // Feed-forward block (SwiGLU).
      rows_parallel(D, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          rmsnorm(xb + r * D, x + r * D, lw.ffn_norm.data_ptr<float>(), D, eps);
      });
      linear(h13, xb, lw.w13, false);
      rows_parallel(4 * H, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const float* g = h13 + r * 2 * H;
          const float* u = g + H;
          float* o = hb + r * H;
          for (int64_t i = 0; i < H; ++i)
            o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
        }
      });
      linear(x, hb, lw.w2, true);
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
      for (int64_t t = 0; t < q.rows; ++t)
        dequantize(w.embedding.type, w.embedding.row(st.tokens[static_cast<std::size_t>(t)]), x + (q.row0 + t) * D, D);
    } else {
      std::memcpy(x + q.row0 * D, st.hidden, static_cast<std::size_t>(q.rows * D) * sizeof(float));
    }
  }
  Pass{*this, plan}.layers();
  // Commit: only now do the new positions count.
  for (auto& q : plan.seqs)
    batch[q.index].cache->commit(q.past + q.rows);

  if (tail) {
    // The last row of every emitting sequence through the final norm and the
    // classifier, stacked: the classifier is read once for all of them.
    std::vector<const Seq*> emit;
    for (auto& q : plan.seqs)
      if (batch[q.index].emit)
        emit.push_back(&q);
    const auto S = static_cast<int64_t>(emit.size());
    if (S > 0) {
      float* xn = grow(ws.xn, S * D);
      float* lg = grow(ws.logits, S * cfg.vocab_size);
      for (int64_t k = 0; k < S; ++k)
        rmsnorm(xn + k * D, x + (emit[static_cast<std::size_t>(k)]->row0 + emit[static_cast<std::size_t>(k)]->rows - 1) * D,
                w.final_norm.data_ptr<float>(), D, static_cast<float>(cfg.norm_eps));
      detail::matmul_rows(w.classifier, xn, lg, cfg.vocab_size, S, false);
      for (int64_t k = 0; k < S; ++k)
        out[emit[static_cast<std::size_t>(k)]->index].out.logits.assign(lg + k * cfg.vocab_size,
                                                                        lg + (k + 1) * cfg.vocab_size);
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

} // namespace strata::model
