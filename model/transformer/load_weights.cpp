// Loading a shard's weights from any TensorSource: matrices in their resident
// type (converted for --dtype), layers in parallel, with a progress line.

#include "model/base/error.hpp"
#include "model/kernels/kernels_q.hpp"
#include "model/transformer/weights.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <mutex>
#include <thread>
#include <malloc.h>
#include <unistd.h>

namespace strata::model::detail {

namespace {

// Progress on stderr (only when it is a terminal): bytes, MB/s and ETA,
// redrawn at most 5 times a second from the loading threads.
class Progress {
public:
  Progress(bool enabled, std::string what, std::size_t total)
      : enabled_(enabled && ::isatty(2) != 0), what_(std::move(what)), total_(std::max<std::size_t>(total, 1)),
        start_(std::chrono::steady_clock::now()) {}
  ~Progress() {
    if (enabled_ && printed_)
      std::fputc('\n', stderr);
  }
  void add(std::size_t bytes) {
    const auto done = done_ += bytes;
    if (!enabled_)
      return;
    std::lock_guard<std::mutex> lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    if (done < total_ && now - last_ < std::chrono::milliseconds(200))
      return;
    last_ = now;
    const double s = std::max(1e-3, std::chrono::duration<double>(now - start_).count());
    const double rate = static_cast<double>(done) / s;
    const double eta = rate > 0 ? static_cast<double>(total_ - std::min(done, total_)) / rate : 0;
    std::fprintf(stderr, "\r%s: %.1f / %.1f MB, %.0f MB/s, ETA %.0f s   ", what_.c_str(), static_cast<double>(done) / 1e6,
                 static_cast<double>(total_) / 1e6, rate / 1e6, eta);
    std::fflush(stderr);
    printed_ = true;
  }

private:
  bool enabled_;
  std::string what_;
  std::size_t total_;
  std::chrono::steady_clock::time_point start_, last_{};
  std::atomic<std::size_t> done_{0};
  std::mutex mutex_;
  bool printed_ = false;
};

// What one matrix becomes under the served dtype, in the layout the kernels
// read fastest (a matrix that is only looked up, the embedding, stays plain).
struct Conversion {
  std::optional<WType> target; // nullopt: keep
  bool classifier = false;
  bool multiplied = true;

  WMatrix operator()(WMatrix m) const {
    m = convert_type(std::move(m));
    return multiplied ? pack_for_kernels(m) : m;
  }

  WMatrix convert_type(WMatrix m) const {
    if (!target)
      return m;
    WType t = *target;
    if (classifier && (t == WType::q4_0 || t == WType::q4_K))
      t = WType::q8_0;
    if (t == WType::q4_K && m.cols % 256 != 0) // as llama.cpp falls back for such rows
      t = WType::q8_0;
    if (m.cols % block_values(t) != 0)
      t = WType::f16;
    return convert(m, t);
  }
};

} // namespace

ShardWeights load_weights(TensorSource& src, LayerRange range, const LoadOptions& options) {
  const ModelConfig& c = src.config();
  if (range.first < 0 || range.last >= c.n_layers || range.last < range.first)
    throw Error(errc::bad_argument, "layer range " + std::to_string(range.first) + "-" + std::to_string(range.last) +
                                      " is outside the model's " + std::to_string(c.n_layers) + " layers");
  const std::string dtype = resolve_dtype(src, options.dtype);
  Conversion conv;
  if (!src.native_types() && dtype != "f32")
    conv.target = parse_wtype(dtype);
  Conversion conv_cls = conv;
  conv_cls.classifier = true;
  Conversion conv_embed = conv;
  conv_embed.multiplied = false;

  const int64_t D = c.dim, H = c.hidden_dim, Q = c.q_dim(), KV = c.kv_dim(), V = c.vocab_size;
  const bool head = range.first == 0, tail = range.last == c.n_layers - 1;
  // f32 bytes as the estimate of work for the progress line.
  const std::size_t per_layer = static_cast<std::size_t>((Q + 2 * KV) * D + D * Q + 3 * H * D + 2 * D) * 4;
  const std::size_t total = per_layer * static_cast<std::size_t>(range.count()) +
                            static_cast<std::size_t>(head ? V * D * 4 : 0) +
                            static_cast<std::size_t>(tail && !(c.tied_embeddings && head) ? V * D * 4 : 0);
  Progress progress(options.progress, "loading " + c.identity + " layers " + std::to_string(range.first) + "-" +
                                        std::to_string(range.last) + " as " + dtype,
                    total);

  ShardWeights w;
  w.layers.resize(static_cast<std::size_t>(range.count()));
  // Jobs: one per layer, the embedding, the classifier.
  std::vector<std::function<void()>> jobs;
  if (head)
    jobs.push_back([&] {
      // Tied and also the tail: one matrix serves both, typed as a classifier.
      w.embedding = (c.tied_embeddings && tail ? conv_cls : conv_embed)(src.load_matrix("embed", V, D));
      progress.add(static_cast<std::size_t>(V * D * 4));
    });
  for (int64_t i = range.first; i <= range.last; ++i)
    jobs.push_back([&, i] {
      // (appended, not "L" + to_string(i): GCC 12 reports a false overflow in that operator+)
      const std::string p = std::string("L").append(std::to_string(i)).append(".");
      LayerWeights& lw = w.layers[static_cast<std::size_t>(i - range.first)];
      lw.attn_norm = src.load(p + "attn_norm", {D});
      if (src.has(p + "wqkv")) { // fused (phi3)
        lw.wqkv.add(conv(src.load_matrix(p + "wqkv", Q + 2 * KV, D)));
      } else {
        lw.wqkv.add(conv(src.load_matrix(p + "wq", Q, D)));
        lw.wqkv.add(conv(src.load_matrix(p + "wk", KV, D)));
        lw.wqkv.add(conv(src.load_matrix(p + "wv", KV, D)));
      }
      if (c.attention_bias)
        for (const auto& [part, n] : {std::pair{"bq", Q}, std::pair{"bk", KV}, std::pair{"bv", KV}}) {
          const std::vector<float> b = src.load(p + part, {n});
          lw.bqkv.insert(lw.bqkv.end(), b.begin(), b.end());
        }
      if (c.qk_norm) {
        lw.q_norm = src.load(p + "q_norm", {c.head_dim});
        lw.k_norm = src.load(p + "k_norm", {c.head_dim});
      }
      lw.wo.add(conv(src.load_matrix(p + "wo", D, Q)));
      lw.ffn_norm = src.load(p + "ffn_norm", {D});
      if (c.sandwich_norms) {
        lw.post_attn_norm = src.load(p + "post_attn_norm", {D});
        lw.post_ffn_norm = src.load(p + "post_ffn_norm", {D});
      }
      if (c.moe()) {
        const int64_t E = c.n_experts, EH = c.expert_hidden_dim;
        lw.router = owned_f32(src.load(p + "router", {E, D}), E, D);
        auto gate = src.load_experts(p + "experts_w1", E, EH, D);
        auto up = src.load_experts(p + "experts_w3", E, EH, D);
        auto down = src.load_experts(p + "experts_w2", E, D, EH);
        lw.expert_w13.resize(static_cast<std::size_t>(E));
        lw.expert_w2.resize(static_cast<std::size_t>(E));
        for (int64_t e = 0; e < E; ++e) {
          const auto k = static_cast<std::size_t>(e);
          lw.expert_w13[k].add(conv(std::move(gate[k])));
          lw.expert_w13[k].add(conv(std::move(up[k])));
          lw.expert_w2[k].add(conv(std::move(down[k])));
        }
      } else if (src.has(p + "w13")) { // fused gate | up (phi3)
        lw.w13.add(conv(src.load_matrix(p + "w13", 2 * H, D)));
        lw.w2.add(conv(src.load_matrix(p + "w2", D, H)));
      } else {
        lw.w13.add(conv(src.load_matrix(p + "w1", H, D)));
        lw.w13.add(conv(src.load_matrix(p + "w3", H, D)));
        lw.w2.add(conv(src.load_matrix(p + "w2", D, H)));
      }
      progress.add(per_layer);
    });
  if (tail && !(c.tied_embeddings && head))
    jobs.push_back([&] {
      w.classifier = conv_cls(src.load_matrix("cls", V, D));
      progress.add(static_cast<std::size_t>(V * D * 4));
    });

  std::atomic<std::size_t> next{0};
  std::mutex failed_mutex;
  std::exception_ptr failed;
  auto worker = [&] {
    for (std::size_t j; (j = next++) < jobs.size();) {
      {
        std::lock_guard<std::mutex> lock(failed_mutex);
        if (failed)
          return;
      }
      try {
        jobs[j]();
      } catch (...) {
        std::lock_guard<std::mutex> lock(failed_mutex);
        if (!failed)
          failed = std::current_exception();
      }
    }
  };
  const auto n_threads = std::min<std::size_t>(jobs.size(), std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  for (std::size_t t = 1; t < n_threads; ++t)
    threads.emplace_back(worker);
  worker();
  for (auto& t : threads)
    t.join();
  if (failed)
    std::rethrow_exception(failed);

  // Converting widened f32 copies leaves freed memory in the loading threads'
  // malloc arenas: give it back, so the process holds the weights, not their past.
  ::malloc_trim(0);
  if (tail) {
    w.final_norm = src.load("norm", {D});
    if (c.tied_embeddings && head)
      w.classifier = w.embedding; // same memory
  }
  return w;
}

} // namespace strata::model::detail
