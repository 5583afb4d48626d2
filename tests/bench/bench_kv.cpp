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
// f32,bf16,f16,q8_0). llama-quantize is needed only while DIR
// holds no Q8_0 file from an earlier run.

#include "model/kernels/attention.hpp"
#include "model/transformer/kv_cache.hpp"
#include "model/transformer/shard.hpp"
#include "tests/bench/bench_gguf.hpp"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
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
  std::printf("# strata_bench kv\n\n%s (Q8_0 weights), %d threads; decode tok/s: median of 24 steps after a context "
              "of 64 and of %lld tokens\n\n",
              q.filename().c_str(), threads, static_cast<long long>(depth));
  std::printf("| KV type | KV bytes / token | decode at 64 | at %lld | ratio |\n|---|---|---|---|---|\n",
              static_cast<long long>(depth));
  const char* types_env = std::getenv("STRATA_BENCH_KV_TYPES");
  std::vector<std::string> types;
  std::stringstream list(types_env ? types_env : "f32,bf16,f16,q8_0");
  for (std::string t; std::getline(list, t, ',');)
    types.push_back(t);
  for (const auto& type : types) {
    model::LoadOptions o;
    o.kv_dtype = type;
    auto shard = model::Shard::load(q.string(), o);
    const bool both = model::detail::attention_avx512_available() && (type == "f16" || type == "q8_0");
    for (int portable = 0; portable <= (both ? 1 : 0); ++portable) {
      model::detail::set_attention_isa(portable ? model::detail::AttentionIsa::portable
                                                : model::detail::AttentionIsa::best);
      const double a = strata_speed(*shard, threads, 0, 64).decode;
      const double b = strata_speed(*shard, threads, 0, depth).decode;
      std::printf("| strata %s%s | %zu | %s | %s | %s |\n", type.c_str(),
                  !both ? "" : portable ? " (portable kernels)" : " (AVX-512 kernels)",
                  model::BlockPool::kv_bytes_per_token(shard->cache_shape()), fmt(a).c_str(), fmt(b).c_str(),
                  ratio(b, a).c_str());
      std::fflush(stdout);
    }
    model::detail::set_attention_isa(model::detail::AttentionIsa::best);
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
