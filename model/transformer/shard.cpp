// Shard: loading a layer range, its cache geometry, thread settings, and the
// single-sequence entry points over the batched forward pass (forward.cpp).

#include "model/transformer/shard.hpp"

#include "model/base/error.hpp"
#include "model/base/parallel.hpp"
#include "model/kernels/kernels.hpp"
#include "model/kernels/kernels_q.hpp"
#include "model/transformer/shard_impl.hpp"

#include <atomic>
#include <cmath>
#include <cstring>
#include <omp.h>
#include <limits>

namespace strata::model {

using detail::LayerWeights;
using detail::ShardWeights;

// ------------------------------------------------------------------ threads

// OpenMP keeps the thread count per calling thread: a count set on the main
// thread does not reach the math thread (math_thread.hpp). Every forward call
// applies the process's setting to its own thread (once per change; base/parallel.hpp).
void detail::apply_threads() {
  (void)detail::team_size();
}

void set_num_threads(int threads) {
  if (threads <= 0)
    return;
  detail::set_team_size(threads);
}

int num_threads() {
  return detail::team_size();
}

void release_math_threads() {
  omp_pause_resource_all(omp_pause_soft);
}

std::vector<int64_t> consecutive_positions(int64_t start, int64_t n) {
  std::vector<int64_t> p(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    p[static_cast<std::size_t>(i)] = start + i;
  return p;
}

// ------------------------------------------------------------------ shard

namespace {
std::atomic<uint64_t> next_shard_uid{1};
} // namespace

WType parse_kv_dtype(const std::string& name, const ModelConfig& cfg) {
  const auto t = parse_wtype(name);
  if (!t || (*t != WType::f32 && *t != WType::bf16 && *t != WType::f16 && *t != WType::q8_0))
    throw Error(errc::bad_argument, "unknown KV cache type '" + name + "' (f32, bf16, f16 or q8_0)");
  if (*t == WType::q8_0 && cfg.head_dim % 32 != 0)
    throw Error(errc::bad_argument, "a q8_0 KV cache needs a head_dim that is a multiple of 32; this model's is " +
                                      std::to_string(cfg.head_dim) + " (use f16 or bf16)");
  return *t;
}

namespace {
// Loading packs weights on the calling thread; the shard's math mostly runs on
// another one (the process's math thread): the loading thread's team goes when
// the load returns or throws.
struct ReleaseMathThreads {
  ~ReleaseMathThreads() { release_math_threads(); }
};
} // namespace

Shard::Shard(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
}
Shard::~Shard() = default;

std::unique_ptr<Shard> Shard::load(const std::string& model, LayerRange range, const LoadOptions& options) {
  const ReleaseMathThreads release;
  auto src = detail::open_source(model);
  auto impl = std::make_unique<Impl>();
  impl->uid = next_shard_uid++;
  impl->cfg = src->config();
  impl->cfg.dtype = detail::resolve_dtype(*src, options.dtype);
  impl->kv_type = parse_kv_dtype(options.kv_dtype, impl->cfg);
  impl->cfg.kv_dtype = to_string(impl->kv_type);
  impl->range = range;
  impl->w = detail::load_weights(*src, range, options);
  impl->build_rope();
  return std::unique_ptr<Shard>(new Shard(std::move(impl)));
}

std::unique_ptr<Shard> Shard::load(const std::string& model, const LoadOptions& options) {
  const ReleaseMathThreads release;
  auto src = detail::open_source(model);
  const int64_t n = src->config().n_layers;
  src.reset();
  return load(model, LayerRange{0, n - 1}, options);
}

const ModelConfig& Shard::config() const {
  return impl_->cfg;
}

LayerRange Shard::range() const {
  return impl_->range;
}

WType Shard::kv_type() const {
  return impl_->kv_type;
}

std::size_t Shard::weight_bytes() const {
  std::size_t n = 0;
  auto add = [&](const std::vector<float>& t) { n += t.size() * sizeof(float); };
  n += impl_->w.embedding.bytes();
  for (auto& l : impl_->w.layers) {
    add(l.attn_norm), add(l.bqkv), add(l.ffn_norm);
    n += l.wqkv.bytes() + l.wo.bytes() + l.w13.bytes() + l.w2.bytes() + l.router.bytes();
    for (std::size_t e = 0; e < l.expert_w13.size(); ++e)
      n += l.expert_w13[e].bytes() + l.expert_w2[e].bytes();
  }
  add(impl_->w.final_norm);
  if (impl_->w.classifier.data != impl_->w.embedding.data)
    n += impl_->w.classifier.bytes();
  return n;
}

CacheShape Shard::cache_shape() const {
  return impl_->cache_shape();
}

std::shared_ptr<BlockPool> Shard::new_pool(std::size_t budget_bytes) const {
  const auto shape = impl_->cache_shape();
  return std::make_shared<BlockPool>(shape, BlockPool::blocks_for_budget(shape, budget_bytes), impl_->uid);
}

KVCache Shard::new_cache() const {
  if (!impl_->default_pool)
    impl_->default_pool =
      std::make_shared<BlockPool>(impl_->cache_shape(), std::numeric_limits<int32_t>::max(), impl_->uid);
  return KVCache(impl_->default_pool);
}

std::vector<SeqOutcome> Shard::forward(std::span<const SeqStep> batch) {
  detail::apply_threads();
  return impl_->run(batch);
}

namespace {

ShardOutput forward_one(Shard& shard, const SeqStep& step) {
  auto out = shard.forward(std::span<const SeqStep>(&step, 1));
  if (out.front().error)
    throw *out.front().error;
  return std::move(out.front().out);
}

} // namespace

ShardOutput Shard::forward(std::span<const int32_t> tokens, std::span<const int64_t> positions, KVCache& cache) {
  SeqStep step;
  step.tokens = tokens;
  step.positions = positions;
  step.cache = &cache;
  return forward_one(*this, step);
}

ShardOutput Shard::forward(const Activation& hidden, std::span<const int64_t> positions, KVCache& cache) {
  if (is_head())
    throw Error(errc::bad_argument, "shard " + std::to_string(range().first) + "-" + std::to_string(range().last) +
                                      " is the head: it takes token ids, not hidden states");
  if (hidden.cols != config().dim || hidden.rows <= 0 ||
      static_cast<int64_t>(hidden.data.size()) != hidden.rows * hidden.cols)
    throw Error(errc::bad_shape, "hidden state of shape [" + std::to_string(hidden.rows) + ", " +
                                   std::to_string(hidden.cols) + "] with " + std::to_string(hidden.data.size()) +
                                   " values does not fit dim " + std::to_string(config().dim));
  SeqStep step;
  step.hidden = hidden.data.data();
  step.rows = hidden.rows;
  step.positions = positions;
  step.cache = &cache;
  return forward_one(*this, step);
}

double fma_rate_per_thread(double seconds) {
  return detail::fma_rate_per_thread(seconds);
}

std::string kernel_builds() {
  return detail::kernel_builds();
}

ModelConfig read_config(const std::string& model) {
  return detail::open_source(model)->config();
}

std::vector<std::string> builtin_model_names() {
  return {"tiny", "qwen2-0.5b"};
}

} // namespace strata::model
