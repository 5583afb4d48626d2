// Shard forward pass and the per-session KV cache.
//
// Decode (one token) is the hot path: every matrix product goes straight to
// BLAS gemv through preallocated workspace tensors (no tensor is allocated per
// token), and the small element-wise steps (RMSNorm, RoPE, attention, SwiGLU)
// are plain loops over raw floats, where per-op dispatch would cost more than
// the arithmetic.

#include "model/shard.hpp"

#include "model/error.hpp"
#include "model/kernels.hpp"
#include "model/weights.hpp"

#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <dlfcn.h>

namespace strata::model {

using detail::LayerWeights;
using detail::ShardWeights;

// ------------------------------------------------------------------ threads

void set_num_threads(int threads) {
  if (threads <= 0)
    return;
  at::set_num_threads(threads);
  // OpenBLAS keeps its own pool; ATen does not size it. Reach it if present.
  using setter = void (*)(int);
  if (auto fn = reinterpret_cast<setter>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
    fn(threads);
}

int num_threads() {
  return at::get_num_threads();
}

std::vector<int64_t> consecutive_positions(int64_t start, int64_t n) {
  std::vector<int64_t> p(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    p[static_cast<std::size_t>(i)] = start + i;
  return p;
}

// ------------------------------------------------------------------ KV cache

struct KVCache::Impl {
  uint64_t shard_uid = 0; // the shard that made this cache
  int64_t n_layers = 0;   // layers of that shard
  int64_t kv_dim = 0;     // n_kv_heads * head_dim
  int64_t seq_len = 0;
  // Each block: (n_layers, 2 = k|v, block_tokens, kv_dim) floats.
  std::vector<std::unique_ptr<float[]>> blocks;

  int64_t block_floats() const { return n_layers * 2 * block_tokens * kv_dim; }
  float* k(int64_t layer, int64_t pos) {
    return blocks[static_cast<std::size_t>(pos / block_tokens)].get() +
           ((layer * 2) * block_tokens + pos % block_tokens) * kv_dim;
  }
  float* v(int64_t layer, int64_t pos) {
    return blocks[static_cast<std::size_t>(pos / block_tokens)].get() +
           ((layer * 2 + 1) * block_tokens + pos % block_tokens) * kv_dim;
  }
  void reserve(int64_t tokens) {
    while (static_cast<int64_t>(blocks.size()) * block_tokens < tokens)
      blocks.emplace_back(new float[static_cast<std::size_t>(block_floats())]);
  }
};

KVCache::KVCache() = default;
KVCache::KVCache(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
}
KVCache::~KVCache() = default;
KVCache::KVCache(KVCache&&) noexcept = default;
KVCache& KVCache::operator=(KVCache&&) noexcept = default;

int64_t KVCache::seq_len() const {
  return impl_ ? impl_->seq_len : 0;
}

std::size_t KVCache::bytes() const {
  return impl_ ? impl_->blocks.size() * static_cast<std::size_t>(impl_->block_floats()) * sizeof(float) : 0;
}

std::size_t KVCache::bytes_for(int64_t tokens) const {
  if (!impl_ || tokens <= 0)
    return 0;
  const auto blocks = static_cast<std::size_t>((tokens + block_tokens - 1) / block_tokens);
  return std::max(blocks, impl_->blocks.size()) * static_cast<std::size_t>(impl_->block_floats()) * sizeof(float);
}

void KVCache::truncate(int64_t n) {
  if (!impl_ || n >= impl_->seq_len)
    return;
  if (n < 0)
    n = 0;
  impl_->seq_len = n;
  const auto keep = static_cast<std::size_t>((n + block_tokens - 1) / block_tokens);
  impl_->blocks.resize(keep);
}

// ------------------------------------------------------------------ shard

namespace {

std::atomic<uint64_t> next_shard_uid{1};

// Scratch tensors reused across calls; resized only when T changes.
struct Workspace {
  int64_t T = -1;
  at::Tensor x;    // (T, dim) residual stream
  at::Tensor xb;   // (T, dim) normalized input of a sub-block
  at::Tensor qkv;  // (T, q_dim + 2*kv_dim)
  at::Tensor att;  // (T, q_dim) attention output, heads concatenated
  at::Tensor h13;  // (T, 2*hidden) gate | up
  at::Tensor hb;   // (T, hidden) SwiGLU output
  at::Tensor xn;     // (dim) final-normed last row
  at::Tensor logits; // (vocab)
};

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

} // namespace

struct Shard::Impl {
  ModelConfig cfg;
  LayerRange range;
  ShardWeights w;
  uint64_t uid = next_shard_uid++;
  std::vector<float> rope_cos, rope_sin; // (max_seq_len, head_dim / 2)
  Workspace ws;
  std::vector<const float*> block_ptrs; // cache blocks of the call in flight

  void build_rope() {
    const int64_t half = cfg.head_dim / 2;
    rope_cos.resize(static_cast<std::size_t>(cfg.max_seq_len * half));
    rope_sin.resize(rope_cos.size());
    for (int64_t p = 0; p < half; ++p) {
      const float freq =
        1.0f / std::pow(static_cast<float>(cfg.rope_theta), static_cast<float>(2 * p) / static_cast<float>(cfg.head_dim));
      for (int64_t pos = 0; pos < cfg.max_seq_len; ++pos) {
        const float val = static_cast<float>(pos) * freq;
        rope_cos[static_cast<std::size_t>(pos * half + p)] = std::cos(val);
        rope_sin[static_cast<std::size_t>(pos * half + p)] = std::sin(val);
      }
    }
  }

  void ensure_workspace(int64_t T) {
    if (ws.T == T)
      return;
    auto opts = at::TensorOptions().dtype(at::kFloat);
    ws.x = at::empty({T, cfg.dim}, opts);
    ws.xb = at::empty({T, cfg.dim}, opts);
    ws.qkv = at::empty({T, cfg.q_dim() + 2 * cfg.kv_dim()}, opts);
    ws.att = at::empty({T, cfg.q_dim()}, opts);
    ws.h13 = at::empty({T, 2 * cfg.hidden_dim}, opts);
    ws.hb = at::empty({T, cfg.hidden_dim}, opts);
    if (!ws.xn.defined() && range.last == cfg.n_layers - 1) {
      ws.xn = at::empty({cfg.dim}, opts);
      ws.logits = at::empty({cfg.vocab_size}, opts);
    }
    ws.T = T;
  }

  // out = in @ w^T (T rows): our gemv for one row, BLAS sgemm for several.
  void linear(at::Tensor& out, const at::Tensor& in, const at::Tensor& w, const at::Tensor& w_t, int64_t T) {
    if (T == 1)
      detail::gemv(w.data_ptr<float>(), in.data_ptr<float>(), out.data_ptr<float>(), w.size(0), w.size(1), false);
    else
      at::mm_out(out, in, w_t);
  }

  // x += in @ w^T
  void residual(const at::Tensor& in, const at::Tensor& w, const at::Tensor& w_t, int64_t T) {
    if (T == 1)
      detail::gemv(w.data_ptr<float>(), in.data_ptr<float>(), ws.x.data_ptr<float>(), w.size(0), w.size(1), true);
    else
      ws.x.addmm_(in, w_t);
  }

  void rope(float* vec, int64_t n_heads, int64_t pos) const {
    const int64_t hd = cfg.head_dim, half = hd / 2;
    const float* c = rope_cos.data() + pos * half;
    const float* s = rope_sin.data() + pos * half;
    for (int64_t h = 0; h < n_heads; ++h) {
      float* v = vec + h * hd;
      if (cfg.rotary == RotaryLayout::interleaved) {
        for (int64_t p = 0; p < half; ++p) {
          const float v0 = v[2 * p], v1 = v[2 * p + 1];
          v[2 * p] = v0 * c[p] - v1 * s[p];
          v[2 * p + 1] = v0 * s[p] + v1 * c[p];
        }
      } else {
        for (int64_t p = 0; p < half; ++p) {
          const float v0 = v[p], v1 = v[p + half];
          v[p] = v0 * c[p] - v1 * s[p];
          v[p + half] = v1 * c[p] + v0 * s[p];
        }
      }
    }
  }

  // Causal grouped-query attention of T new rows against the cache of layer l.
  void attention(KVCache::Impl& cache, int64_t l, int64_t past, int64_t T) {
    const int64_t hd = cfg.head_dim, nh = cfg.n_heads, group = cfg.n_heads / cfg.n_kv_heads;
    const int64_t qkv_stride = cfg.q_dim() + 2 * cfg.kv_dim();
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const float* qkv = ws.qkv.data_ptr<float>();
    float* att = ws.att.data_ptr<float>();
    const int64_t ctx = past + T;
    block_ptrs.resize(cache.blocks.size());
    for (std::size_t b = 0; b < cache.blocks.size(); ++b)
      block_ptrs[b] = cache.blocks[b].get();
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, ctx * hd));
    at::parallel_for(0, T * nh, grain, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> scores;
      if (static_cast<int64_t>(scores.size()) < ctx)
        scores.resize(static_cast<std::size_t>(ctx));
      for (int64_t item = begin; item < end; ++item) {
        const int64_t t = item / nh, h = item % nh, g = h / group;
        const detail::CacheRows rows{block_ptrs.data(), KVCache::block_tokens, cfg.kv_dim(),
                                     (l * 2) * KVCache::block_tokens * cfg.kv_dim() + g * hd,
                                     (l * 2 + 1) * KVCache::block_tokens * cfg.kv_dim() + g * hd};
        // causal: row t sees positions 0 .. past + t
        detail::attend(qkv + t * qkv_stride + h * hd, rows, past + t + 1, hd, scale, scores.data(),
                       att + t * cfg.q_dim() + h * hd);
      }
    });
  }

  void check_positions(std::span<const int64_t> positions, int64_t T, const KVCache& cache) const {
    if (T <= 0)
      throw Error(errc::bad_shape, "a forward call needs at least one token");
    if (static_cast<int64_t>(positions.size()) != T)
      throw Error(errc::bad_shape, std::to_string(T) + " input rows but " + std::to_string(positions.size()) + " positions");
    if (!cache.impl_ || cache.impl_->shard_uid != uid)
      throw Error(errc::bad_argument, "the KV cache was not created by this shard (layers " +
                                        std::to_string(range.first) + "-" + std::to_string(range.last) + ")");
    const int64_t past = cache.seq_len();
    for (int64_t i = 0; i < T; ++i)
      if (positions[static_cast<std::size_t>(i)] != past + i)
        throw Error(errc::bad_position, "position " + std::to_string(positions[static_cast<std::size_t>(i)]) +
                                          " at index " + std::to_string(i) + " does not continue the cache, which holds " +
                                          std::to_string(past) + " tokens (expected " + std::to_string(past + i) + ")");
    if (past + T > cfg.max_seq_len)
      throw Error(errc::context_overflow, "sequence of " + std::to_string(past + T) + " tokens exceeds max_seq_len " +
                                            std::to_string(cfg.max_seq_len));
  }

  // Runs the layers over ws.x (already filled with T rows) and appends to the cache.
  ShardOutput run_layers(int64_t T, KVCache& cache_handle) {
    KVCache::Impl& cache = *cache_handle.impl_;
    const int64_t past = cache.seq_len;
    const int64_t D = cfg.dim, Q = cfg.q_dim(), KV = cfg.kv_dim(), H = cfg.hidden_dim;
    const int64_t qkv_stride = Q + 2 * KV;
    const float eps = static_cast<float>(cfg.norm_eps);
    cache.reserve(past + T);
    float* x = ws.x.data_ptr<float>();
    float* xb = ws.xb.data_ptr<float>();
    float* qkv = ws.qkv.data_ptr<float>();
    float* h13 = ws.h13.data_ptr<float>();
    float* hb = ws.hb.data_ptr<float>();
    for (int64_t l = 0; l < range.count(); ++l) {
      const LayerWeights& lw = w.layers[static_cast<std::size_t>(l)];
      // Attention block.
      for (int64_t t = 0; t < T; ++t)
        rmsnorm(xb + t * D, x + t * D, lw.attn_norm.data_ptr<float>(), D, eps);
      linear(ws.qkv, ws.xb, lw.wqkv, lw.wqkv_t, T);
      for (int64_t t = 0; t < T; ++t) {
        float* row = qkv + t * qkv_stride;
        if (lw.bqkv.defined()) {
          const float* b = lw.bqkv.data_ptr<float>();
          for (int64_t i = 0; i < qkv_stride; ++i)
            row[i] += b[i];
        }
        rope(row, cfg.n_heads, past + t);
        rope(row + Q, cfg.n_kv_heads, past + t);
        std::memcpy(cache.k(l, past + t), row + Q, static_cast<std::size_t>(KV) * sizeof(float));
        std::memcpy(cache.v(l, past + t), row + Q + KV, static_cast<std::size_t>(KV) * sizeof(float));
      }
      attention(cache, l, past, T);
      residual(ws.att, lw.wo, lw.wo_t, T);
      // Feed-forward block (SwiGLU).
      for (int64_t t = 0; t < T; ++t)
        rmsnorm(xb + t * D, x + t * D, lw.ffn_norm.data_ptr<float>(), D, eps);
      linear(ws.h13, ws.xb, lw.w13, lw.w13_t, T);
      for (int64_t t = 0; t < T; ++t) {
        const float* g = h13 + t * 2 * H;
        const float* u = g + H;
        float* o = hb + t * H;
        for (int64_t i = 0; i < H; ++i)
          o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
      }
      residual(ws.hb, lw.w2, lw.w2_t, T);
    }
    cache.seq_len = past + T; // commit: only now do the new tokens count
    ShardOutput out;
    if (w.final_norm.defined()) {
      float* xn = ws.xn.data_ptr<float>();
      rmsnorm(xn, x + (T - 1) * D, w.final_norm.data_ptr<float>(), D, eps);
      detail::gemv(w.classifier.data_ptr<float>(), xn, ws.logits.data_ptr<float>(), cfg.vocab_size, D, false);
      const float* lp = ws.logits.data_ptr<float>();
      out.logits.assign(lp, lp + cfg.vocab_size);
    } else {
      out.hidden.rows = T;
      out.hidden.cols = D;
      out.hidden.data.assign(x, x + T * D);
    }
    return out;
  }
};

Shard::Shard(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
}
Shard::~Shard() = default;

std::unique_ptr<Shard> Shard::load(const std::string& model, LayerRange range) {
  at::InferenceMode guard;
  auto src = detail::open_source(model);
  auto impl = std::make_unique<Impl>();
  impl->cfg = src->config();
  impl->range = range;
  impl->w = detail::load_weights(*src, range);
  impl->build_rope();
  return std::unique_ptr<Shard>(new Shard(std::move(impl)));
}

std::unique_ptr<Shard> Shard::load(const std::string& model) {
  auto src = detail::open_source(model);
  const int64_t n = src->config().n_layers;
  src.reset();
  return load(model, LayerRange{0, n - 1});
}

const ModelConfig& Shard::config() const {
  return impl_->cfg;
}

LayerRange Shard::range() const {
  return impl_->range;
}

std::size_t Shard::weight_bytes() const {
  std::size_t n = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined())
      n += static_cast<std::size_t>(t.numel()) * t.element_size();
  };
  add(impl_->w.embedding);
  for (auto& l : impl_->w.layers) {
    add(l.attn_norm), add(l.wqkv), add(l.bqkv), add(l.wo), add(l.ffn_norm), add(l.w13), add(l.w2);
  }
  add(impl_->w.final_norm);
  if (!impl_->w.classifier.is_same(impl_->w.embedding))
    add(impl_->w.classifier);
  return n;
}

KVCache Shard::new_cache() const {
  auto c = std::make_unique<KVCache::Impl>();
  c->shard_uid = impl_->uid;
  c->n_layers = impl_->range.count();
  c->kv_dim = impl_->cfg.kv_dim();
  return KVCache(std::move(c));
}

ShardOutput Shard::forward(std::span<const int32_t> tokens, std::span<const int64_t> positions, KVCache& cache) {
  at::InferenceMode guard;
  Impl& s = *impl_;
  if (!is_head())
    throw Error(errc::bad_argument, "shard " + std::to_string(s.range.first) + "-" + std::to_string(s.range.last) +
                                      " is not the head: it takes hidden states, not token ids");
  const auto T = static_cast<int64_t>(tokens.size());
  s.check_positions(positions, T, cache);
  for (int64_t i = 0; i < T; ++i) {
    const int32_t id = tokens[static_cast<std::size_t>(i)];
    if (id < 0 || id >= s.cfg.vocab_size)
      throw Error(errc::token_out_of_range, "token id " + std::to_string(id) + " at index " + std::to_string(i) +
                                              " is outside the vocabulary of " + std::to_string(s.cfg.vocab_size));
  }
  s.ensure_workspace(T);
  const float* emb = s.w.embedding.data_ptr<float>();
  float* x = s.ws.x.data_ptr<float>();
  for (int64_t i = 0; i < T; ++i)
    std::memcpy(x + i * s.cfg.dim, emb + static_cast<int64_t>(tokens[static_cast<std::size_t>(i)]) * s.cfg.dim,
                static_cast<std::size_t>(s.cfg.dim) * sizeof(float));
  return s.run_layers(T, cache);
}

ShardOutput Shard::forward(const Activation& hidden, std::span<const int64_t> positions, KVCache& cache) {
  at::InferenceMode guard;
  Impl& s = *impl_;
  if (is_head())
    throw Error(errc::bad_argument, "shard " + std::to_string(s.range.first) + "-" + std::to_string(s.range.last) +
                                      " is the head: it takes token ids, not hidden states");
  if (hidden.cols != s.cfg.dim || hidden.rows <= 0 ||
      static_cast<int64_t>(hidden.data.size()) != hidden.rows * hidden.cols)
    throw Error(errc::bad_shape, "hidden state of shape [" + std::to_string(hidden.rows) + ", " +
                                   std::to_string(hidden.cols) + "] with " + std::to_string(hidden.data.size()) +
                                   " values does not fit dim " + std::to_string(s.cfg.dim));
  s.check_positions(positions, hidden.rows, cache);
  s.ensure_workspace(hidden.rows);
  std::memcpy(s.ws.x.data_ptr<float>(), hidden.data.data(), hidden.data.size() * sizeof(float));
  return s.run_layers(hidden.rows, cache);
}

ModelConfig read_config(const std::string& model) {
  return detail::open_source(model)->config();
}

std::vector<std::string> builtin_model_names() {
  return {"tiny", "qwen2-0.5b"};
}

} // namespace strata::model
