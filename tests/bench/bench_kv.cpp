// strata_bench kv: decode speed at 8,192 tokens of context against at 64, per
// KV cache type (f32, bf16, f16, q8_0), on a Qwen2.5-0.5B-shaped model with
// Q8_0 weights (seeded random weights, quantized by llama-quantize), with the
// KV bytes one token takes; llama-bench on the same file at the same depths
// (its default f16 cache) when LLAMA_CPP_BIN is set. Where the CPU runs the
// AVX-512 attention kernels, the f16 and q8_0 caches are also measured with the
// portable ones (same bits, integer f16 conversion), in turn in the same run.
// A benchmark, not a test.
//
// Usage: strata_bench kv [DIR [LLAMA_BIN]] (STRATA_BENCH_THREADS, default 2;
// STRATA_BENCH_DEPTH, default 8192; STRATA_BENCH_KV_TYPES, default
// f32,bf16,f16,q8_0; STRATA_BENCH_ROUNDS, default 3: every row in turn each round,
// medians shown, the ratio the median of the rounds' ratios). llama-quantize is needed only while DIR
// holds no Q8_0 file from an earlier run.

#include "model/kernels/attention.hpp"
#include "model/transformer/kv_cache.hpp"
#include "model/transformer/shard.hpp"
#include "tests/bench/bench_gguf.hpp"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <algorithm>
#include <chrono>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

using namespace strata;
using namespace strata::benchgguf;
namespace fs = std::filesystem;

const Shape& w896_bench_shape(); // bench_types.cpp

int kv_bench_main(int argc, char** argv) {
  const fs::path dir = argc > 2 ? argv[2] : "build/bench-models";
  const char* env = std::getenv("LLAMA_CPP_BIN");
  const std::string llama = argc > 3 ? argv[3] : env ? env : "";
  const bool peer = !llama.empty() && fs::exists(fs::path(llama) / "llama-bench");
  const char* threads_env = std::getenv("STRATA_BENCH_THREADS");
  const int threads = std::max(1, threads_env ? std::atoi(threads_env) : 2);
  const char* depth_env = std::getenv("STRATA_BENCH_DEPTH");
  const int64_t depth = std::max<int64_t>(128, depth_env ? std::atoll(depth_env) : 8192);
  fs::create_directories(dir);
  const Shape& s = w896_bench_shape();
  const auto f32 = dir / (s.file + "-f32.gguf");
  if (!fs::exists(f32))
    make_model(s, f32);
  const auto q = dir / (s.file + "-q8_0-pure.gguf");
  // (a Q8_0 file written by an earlier run is measured without llama.cpp)
  if (!fs::exists(q) && (llama.empty() || !fs::exists(fs::path(llama) / "llama-quantize"))) {
    std::printf("strata_bench kv needs llama.cpp's llama-quantize (for Q8_0 weights): set LLAMA_CPP_BIN\n");
    return 2;
  }
  if (!quantize_file(llama, f32, q, "Q8_0", "--pure"))
    return 1;
  const char* rounds_env = std::getenv("STRATA_BENCH_ROUNDS");
  const int rounds = std::max(1, rounds_env ? std::atoi(rounds_env) : 3);
  std::printf("# strata_bench kv\n\n%s (Q8_0 weights), %d threads; decode tok/s: median of 24 steps after a context "
              "of 64 and of %lld tokens, %d interleaved rounds, medians\n\n",
              q.filename().c_str(), threads, static_cast<long long>(depth), rounds);
  std::printf("| KV type | KV bytes / token | decode at 64 | at %lld | ratio |\n|---|---|---|---|---|\n",
              static_cast<long long>(depth));
  const char* types_env = std::getenv("STRATA_BENCH_KV_TYPES");
  std::vector<std::string> types;
  std::stringstream list(types_env ? types_env : "f32,bf16,f16,q8_0");
  for (std::string t; std::getline(list, t, ',');)
    types.push_back(t);
  model::set_num_threads(threads);
  // Each type's shard with a cache filled to 64 and one to `depth` (prefilled
  // once, in pieces of 2,048 as the scheduler would); every round measures
  // every row in turn, and each measurement's steps are cut from the caches
  // again, so every round decodes at the same lengths.
  struct Type {
    std::string name;
    std::unique_ptr<model::Shard> shard;
    model::KVCache shallow, deep;
  };
  struct Row {
    Type* type;
    bool portable;
    std::string label;
    std::vector<double> at64, deep;
  };
  std::vector<std::unique_ptr<Type>> loaded;
  std::vector<Row> rows;
  const auto V = [&](model::Shard& sh) { return sh.config().vocab_size; };
  auto prefill = [&](model::Shard& sh, model::KVCache& c, int64_t n) {
    std::vector<int32_t> ids(static_cast<std::size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      ids[static_cast<std::size_t>(i)] = static_cast<int32_t>((i * 104729) % V(sh));
    for (int64_t at = 0; at < n; at += 2048) {
      const int64_t m = std::min<int64_t>(2048, n - at);
      sh.forward(std::span<const int32_t>(ids.data() + at, static_cast<std::size_t>(m)),
                 model::consecutive_positions(at, m), c);
    }
  };
  for (const auto& type : types) {
    model::LoadOptions o;
    o.kv_dtype = type;
    auto t = std::make_unique<Type>();
    t->name = type;
    t->shard = model::Shard::load(q.string(), o);
    t->shallow = t->shard->new_cache();
    t->deep = t->shard->new_cache();
    prefill(*t->shard, t->shallow, 64);
    prefill(*t->shard, t->deep, depth);
    const bool both = model::detail::attention_avx512_available();
    for (int portable = 0; portable <= (both ? 1 : 0); ++portable)
      rows.push_back(Row{t.get(), portable != 0,
                         type + (!both ? "" : portable ? " (portable kernels)" : " (AVX-512 kernels)"), {}, {}});
    loaded.push_back(std::move(t));
  }
  // Decode tok/s: the median of 24 steps (after 2 not counted), then the cache cut back.
  auto decode = [&](model::Shard& sh, model::KVCache& c) {
    const int64_t len = c.seq_len();
    std::vector<double> steps;
    int32_t next = 7;
    for (int i = 0; i < 26; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      auto out = sh.forward(std::span<const int32_t>(&next, 1), model::consecutive_positions(c.seq_len(), 1), c);
      steps.push_back(since(t0));
      next = static_cast<int32_t>(std::max_element(out.logits.begin(), out.logits.end()) - out.logits.begin());
    }
    c.truncate(len);
    steps.erase(steps.begin(), steps.begin() + 2);
    return 1.0 / median_of(steps);
  };
  for (int r = 0; r < rounds; ++r)
    for (auto& row : rows) {
      model::detail::set_attention_isa(row.portable ? model::detail::AttentionIsa::portable
                                                    : model::detail::AttentionIsa::best);
      row.at64.push_back(decode(*row.type->shard, row.type->shallow));
      row.deep.push_back(decode(*row.type->shard, row.type->deep));
    }
  model::detail::set_attention_isa(model::detail::AttentionIsa::best);
  for (const auto& row : rows) {
    std::vector<double> ratios;
    for (std::size_t i = 0; i < row.at64.size(); ++i)
      ratios.push_back(row.deep[i] / row.at64[i]);
    std::printf("| strata %s | %zu | %s | %s | %.2f |\n", row.label.c_str(),
                model::BlockPool::kv_bytes_per_token(row.type->shard->cache_shape()), fmt(median_of(row.at64)).c_str(),
                fmt(median_of(row.deep)).c_str(), median_of(ratios));
    std::fflush(stdout);
  }
  if (peer) {
    const double a = llama_speed(llama, q.string(), threads, 0, 64).decode;
    const double b = llama_speed(llama, q.string(), threads, 0, depth).decode;
    const auto& c = s;
    std::printf("| llama.cpp f16 | %llu | %s | %s | %s |\n",
                static_cast<unsigned long long>(uint64_t{c.layers} * 2 * c.kv_heads * c.head_dim * 2), fmt(a).c_str(),
                fmt(b).c_str(), ratio(b, a).c_str());
  }
  return 0;
}
