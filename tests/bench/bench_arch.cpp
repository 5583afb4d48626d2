// strata_bench arch: decode and prefill speed of a Qwen3-MoE-shaped and a
// Gemma-3-shaped model (seeded random weights, written here as f32 GGUF and,
// when llama.cpp's tools are at hand, quantized by llama-quantize to Q4_K_M),
// next to llama.cpp's llama-bench on the very same files, interleaved (strata,
// then llama.cpp, per file). MoE decode is also set against the roofline of the
// bytes a token actually reads (the active experts, not all of them); Gemma 3
// decode at 8k of context against its speed at 512 (its windows keep long
// contexts cheap): in the table's rows, and strata alone with steps at the two
// contexts in turn (the VM's spells fall on both alike). A benchmark, not a
// test: it prints tables, asserts nothing.
//
// Usage: strata_bench arch [DIR [LLAMA_BIN]] (STRATA_BENCH_ROUNDS: rounds of
// strata then llama.cpp, default 3, medians; STRATA_BENCH_KV: strata's KV cache
// type, default f32; STRATA_BENCH_ARCH=moe|gemma|gemma1b: one model only, all: the
// three, default moe and gemma): DIR holds the generated files
// (default build/bench-models), LLAMA_BIN the folder with llama-bench and
// llama-quantize (default: $LLAMA_CPP_BIN; none: strata alone, on f32).

#include "model/formats/gguf.hpp"
#include "model/transformer/shard.hpp"
#include "tests/bench/bench_gguf.hpp"

#include <algorithm>
#include <cstdlib>
#include <utility>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <vector>

using namespace strata;
using namespace strata::benchgguf;
namespace fs = std::filesystem;
using clk = std::chrono::steady_clock;

double bench_bandwidth(int threads); // bench_model.cpp

namespace {

constexpr int turn_steps = 8;

// Decode at 512 and at 8,192 tokens of context, strata alone, in turn: two
// caches filled once, then turns of turn_steps steps on each (the first turn
// a warm-up), so that the VM's slow and fast spells fall on both alike; the
// median step of each. (The table's rows run minutes apart, with llama.cpp
// between them.) Each step adds a token: the contexts end 8 x 16 past them.
std::tuple<double, double, int> contexts_in_turn(model::Shard& shard, int threads) {
  model::set_num_threads(threads);
  auto short_ctx = filled_cache(shard, 512), long_ctx = filled_cache(shard, 8192);
  std::vector<double> a, b;
  int32_t next_a = 7, next_b = 7;
  auto turn = [&](model::KVCache& c, int32_t& next, std::vector<double>* out) {
    for (int i = 0; i < turn_steps; ++i) {
      const auto t0 = clk::now();
      auto o = shard.forward(std::span<const int32_t>(&next, 1), model::consecutive_positions(c.seq_len(), 1), c);
      if (out)
        out->push_back(1e3 * since(t0));
      next = static_cast<int32_t>(std::max_element(o.logits.begin(), o.logits.end()) - o.logits.begin());
    }
  };
  constexpr int turns = 16;
  for (int t = 0; t < turns; ++t) {
    turn(short_ctx, next_a, t == 0 ? nullptr : &a);
    turn(long_ctx, next_b, t == 0 ? nullptr : &b);
  }
  return {median_of(a), median_of(b), turns - 1};
}

} // namespace

namespace {

// Qwen3-30B-A3B (dim 2048, 48 layers, 128 experts of 768, 8 active, 32/4 heads x
// 128) scaled down: 48 experts of 512, 8 active, dim 1024, 12 layers, 8/2 heads x
// 128. Gemma-3-4B (dim 2560, 34 layers, 8/4 heads x 256, FFN 10240, window 1024,
// 5 local layers in 6) scaled down: dim 1024, 12 layers, 8/4 heads x 128, FFN
// 4096, window 1024, pattern 6. Widths are multiples of 256 (K-quants apply).
const Shape moe_shape{"qwen3moe", "qwen3moe-bench", 1024, 12, 8, 2, 128, 0, 32768, 16384, 48, 8, 512, 0, 0};
const Shape gemma_shape{"gemma3", "gemma3-bench", 1024, 12, 8, 4, 128, 4096, 32768, 16384, 0, 0, 0, 1024, 6, true, false, true};
// Gemma-3-1B's own dimensions (1.0 B parameters: dim 1152, 26 layers, 4 heads /
// 1 kv head of 256, FFN 6912, vocabulary 262,144, window 512, 5 local layers in
// 6), seeded random weights: the smallest Gemma 3 people run, with its real
// proportions of weights to cache. (The scaled-down shape above keeps 4 kv heads
// of 128 against a 1024-wide model: per token and layer its cache is 3x larger
// beside its weights than Gemma-3-4B's, so long contexts weigh more there.)
// Only on request (STRATA_BENCH_ARCH=gemma1b or all): its f32 file is 4 GB.
const Shape gemma1b_shape{"gemma3", "gemma3-1b-bench", 1152, 26, 4, 1, 256, 6912, 262144, 32768, 0, 0, 0, 512, 6, true, false, true};

// The models by their STRATA_BENCH_ARCH name, and whether a run without it measures them.
struct Model {
  const char* key;
  const Shape& shape;
  bool by_default;
};
const Model models[] = {{"moe", moe_shape, true}, {"gemma", gemma_shape, true}, {"gemma1b", gemma1b_shape, false}};

// Bytes one decoded token reads: every tensor, the experts' only k/E of theirs
// (the router picks k), the tied embedding in full (it is the classifier).
double active_bytes(const std::string& file, const Shape& s) {
  model::GgufFile g(file);
  double total = 0;
  for (auto& [name, t] : g.tensors()) {
    double b = static_cast<double>(t.nbytes);
    if (name.find("_exps.") != std::string::npos)
      b *= static_cast<double>(s.used) / static_cast<double>(s.experts);
    total += b;
  }
  return total;
}

} // namespace

int arch_bench_main(int argc, char** argv) {
  const fs::path dir = argc > 2 ? argv[2] : "build/bench-models";
  const char* env = std::getenv("LLAMA_CPP_BIN");
  const std::string llama = argc > 3 ? argv[3] : env ? env : "";
  const bool peer = !llama.empty() && fs::exists(fs::path(llama) / "llama-bench") &&
                    fs::exists(fs::path(llama) / "llama-quantize");
  const std::string only = std::getenv("STRATA_BENCH_ARCH") ? std::getenv("STRATA_BENCH_ARCH") : "";
  if (!only.empty() && only != "all" &&
      std::none_of(std::begin(models), std::end(models), [&](const Model& m) { return only == m.key; })) {
    std::fprintf(stderr, "bench arch: unknown STRATA_BENCH_ARCH '%s' (moe, gemma, gemma1b or all)\n", only.c_str());
    return 2;
  }
  fs::create_directories(dir);
  const char* rounds_env = std::getenv("STRATA_BENCH_ROUNDS");
  const int rounds = std::max(1, rounds_env ? std::atoi(rounds_env) : 3);
  std::printf("# strata_bench arch\n\nFiles in %s; peer: %s\n", dir.c_str(),
              peer ? (llama + " (llama-bench, llama-quantize)").c_str() : "none (set LLAMA_CPP_BIN): strata alone, f32");
  const double bw1 = bench_bandwidth(1), bw2 = bench_bandwidth(2);
  std::printf("read bandwidth: %.1f GB/s (1 thread), %.1f GB/s (2 threads); %d interleaved rounds "
              "(STRATA_BENCH_ROUNDS), medians\n",
              bw1, bw2, rounds);
  // STRATA_BENCH_KV=bf16|f16|q8_0: strata's KV cache type (default f32; llama.cpp keeps f16);
  // STRATA_BENCH_ARCH=moe|gemma|gemma1b: one model only; all: the three (default: moe and gemma).
  model::LoadOptions opts;
  if (const char* kv = std::getenv("STRATA_BENCH_KV"))
    opts.kv_dtype = kv;
  std::printf("strata's KV cache: %s (STRATA_BENCH_KV)\n", opts.kv_dtype.c_str());
  for (const Model& m : models) {
    if (only.empty() ? !m.by_default : only != "all" && only != m.key)
      continue;
    const Shape* s = &m.shape;
    const auto f32 = dir / (s->file + "-f32.gguf");
    if (!fs::exists(f32)) {
      const auto t0 = clk::now();
      make_model(*s, f32);
      std::printf("wrote %s in %.0f s\n", f32.c_str(), since(t0));
    }
    std::string file = f32.string();
    if (peer) {
      const auto q = dir / (s->file + "-q4_k_m.gguf");
      if (!quantize_file(llama, f32, q, "Q4_K_M"))
        return 1;
      file = q.string();
    }
    auto shard = model::Shard::load(file, opts);
    const auto& c = shard->config();
    const double active = active_bytes(file, *s);
    std::printf("\n## %s: %s\n\n%s, %.2f GB resident, %.0f MB read per token\n\n", s->file.c_str(),
                fs::path(file).filename().c_str(), c.summary().c_str(),
                static_cast<double>(shard->weight_bytes()) / 1e9, active / 1e6);
    if (s->experts > 0) {
      std::printf("| threads | strata prefill 512 tok/s | llama.cpp | ratio | strata decode tok/s | llama.cpp | ratio | "
                  "roofline of active bytes tok/s | strata %% of roofline |\n|---|---|---|---|---|---|---|---|---|\n");
      for (int t : {1, 2}) {
        const auto [a, b] = interleaved(*shard, llama, file, t, 512, 0, peer, rounds);
        const double roof = (t == 1 ? bw1 : bw2) * 1e9 / active;
        std::printf("| %d | %s | %s | %s | %s | %s | %s | %s | %.0f %% |\n", t, fmt(a.prefill).c_str(),
                    fmt(b.prefill).c_str(), ratio(a.prefill, b.prefill).c_str(), fmt(a.decode).c_str(),
                    fmt(b.decode).c_str(), ratio(a.decode, b.decode).c_str(), fmt(roof).c_str(),
                    100.0 * a.decode / roof);
        std::fflush(stdout);
      }
    } else {
      std::printf("| threads | context | strata prefill 512 tok/s | llama.cpp | ratio | strata decode tok/s | llama.cpp | "
                  "ratio |\n|---|---|---|---|---|---|---|---|\n");
      double at512 = 0, at8k = 0, l512 = 0, l8k = 0;
      for (int t : {1, 2})
        for (int64_t depth : {int64_t{512}, int64_t{8192}}) {
          if (t == 1 && depth > 512)
            continue; // the 8k prefill alone takes minutes on one thread
          const auto [a, b] = interleaved(*shard, llama, file, t, depth == 512 ? 512 : 0, depth, peer, rounds);
          if (t == 2)
            (depth == 512 ? at512 : at8k) = a.decode, (depth == 512 ? l512 : l8k) = b.decode;
          std::printf("| %d | %lld | %s | %s | %s | %s | %s | %s |\n", t, static_cast<long long>(depth),
                      fmt(a.prefill).c_str(), fmt(b.prefill).c_str(), ratio(a.prefill, b.prefill).c_str(),
                      fmt(a.decode).c_str(), fmt(b.decode).c_str(), ratio(a.decode, b.decode).c_str());
          std::fflush(stdout);
        }
      std::printf("\ndecode at 512 / at 8192 of context (2 threads): strata %s, llama.cpp %s\n",
                  ratio(at512, at8k).c_str(), ratio(l512, l8k).c_str());
      const auto [ms512, ms8k, turns] = contexts_in_turn(*shard, 2);
      std::printf("strata alone, steps at the two contexts in turn (%d turns of %d steps each, 2 threads): "
                  "%.2f / %.2f ms a step, ratio %.2f\n",
                  turns, turn_steps, ms512, ms8k, ms8k / ms512);
    }
  }
  return 0;
}
