// strata_bench types: decode speed per weight type next to llama.cpp on the very
// same GGUF files. A Qwen3-shaped model (dim 1024, widths multiples of 256, so
// every type applies) is written as seeded f32 and quantized by llama-quantize
// --pure into each type; a Qwen2.5-0.5B-shaped one (dim 896) into Q4_K_M and
// Q5_K_M as llama-quantize mixes them for such widths (q5_0 / q5_1 / q8_0
// fallbacks beside the K types: every Qwen2.5-0.5B download). Rounds of strata,
// then llama-bench, interleaved per file; medians. A benchmark, not a test.
//
// Usage: strata_bench types [DIR [LLAMA_BIN]] (STRATA_BENCH_ROUNDS, default 3;
// STRATA_BENCH_THREADS, default 2; STRATA_BENCH_TYPES: a comma list of the
// llama-quantize type names to run, default all).

#include "model/formats/gguf.hpp"
#include "model/transformer/shard.hpp"
#include "tests/bench/bench_gguf.hpp"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

using namespace strata;
using namespace strata::benchgguf;
namespace fs = std::filesystem;
using clk = std::chrono::steady_clock;

namespace {

// Qwen3-0.6B-like widths rounded to multiples of 256 (dim 1024, 8/4 heads x 128,
// FFN 3072), 12 layers, a 32k vocabulary; output tied.
const Shape dense_shape{"qwen3", "qwen3-types-bench", 1024, 12, 8, 4, 128, 3072, 32768, 4096};
// Qwen2.5-0.5B: dim 896, 24 layers, 14/2 heads x 64, FFN 4864, q/k/v biases,
// output tied, a context of 32k; the vocabulary cut to 32k (151,936 in the real
// model) to keep the files small.
const Shape w896_shape{"qwen2", "qwen2-w896-bench", 896, 24, 14, 2, 64, 4864, 32768, 32768,
                       0, 0, 0, 0, 0, false, true, false};

// The tensor types a file holds, as "q5_0 x 96, q8_0 x 2, ...".
std::string type_mix(const std::string& file) {
  model::GgufFile g(file);
  std::map<std::string, int> n;
  for (auto& [name, t] : g.tensors())
    if (t.dims.size() >= 2)
      ++n[model::ggml_type_name(t.ggml_type)];
  std::string out;
  for (auto& [t, k] : n)
    out += (out.empty() ? "" : ", ") + t + " x " + std::to_string(k);
  return out;
}

} // namespace

const Shape& w896_bench_shape() { // for bench_kv.cpp
  return w896_shape;
}

int types_bench_main(int argc, char** argv) {
  const fs::path dir = argc > 2 ? argv[2] : "build/bench-models";
  const char* env = std::getenv("LLAMA_CPP_BIN");
  const std::string llama = argc > 3 ? argv[3] : env ? env : "";
  if (llama.empty() || !fs::exists(fs::path(llama) / "llama-bench") || !fs::exists(fs::path(llama) / "llama-quantize")) {
    std::printf("strata_bench types needs llama.cpp's llama-quantize and llama-bench: set LLAMA_CPP_BIN "
                "(../shared/docs/peers.md says how to build them)\n");
    return 2;
  }
  fs::create_directories(dir);
  const char* rounds_env = std::getenv("STRATA_BENCH_ROUNDS");
  const int rounds = std::max(1, rounds_env ? std::atoi(rounds_env) : 3);
  const char* threads_env = std::getenv("STRATA_BENCH_THREADS");
  const int threads = std::max(1, threads_env ? std::atoi(threads_env) : 2);
  std::vector<std::string> wanted;
  if (const char* t = std::getenv("STRATA_BENCH_TYPES")) {
    std::stringstream ss(t);
    for (std::string x; std::getline(ss, x, ',');)
      wanted.push_back(x);
  }
  auto want = [&](const std::string& t) { return wanted.empty() || std::find(wanted.begin(), wanted.end(), t) != wanted.end(); };

  std::printf("# strata_bench types\n\nFiles in %s; peer %s; %d threads; %d interleaved rounds "
              "(STRATA_BENCH_ROUNDS) of strata then llama-bench, medians of decode tok/s (24 tokens after a "
              "1-token context)\n\n",
              dir.c_str(), llama.c_str(), threads, rounds);
  std::printf("| model | llama-quantize | tensor types (matrices) | MB | strata decode tok/s | llama.cpp | ratio |\n"
              "|---|---|---|---|---|---|---|\n");
  struct Job {
    const Shape* shape;
    std::string type;
    bool pure;
  };
  std::vector<Job> jobs;
  for (const char* t : {"Q8_0", "Q6_K", "Q5_K_M", "Q5_1", "Q5_0", "Q4_K_M", "IQ4_NL", "IQ4_XS", "Q4_1", "Q4_0",
                        "Q3_K_M", "Q2_K"})
    jobs.push_back({&dense_shape, t, true});
  jobs.push_back({&w896_shape, "Q4_K_M", false});
  jobs.push_back({&w896_shape, "Q5_K_M", false});
  for (const auto& j : jobs) {
    if (!want(j.type))
      continue;
    const auto f32 = dir / (j.shape->file + "-f32.gguf");
    if (!fs::exists(f32)) {
      const auto t0 = clk::now();
      make_model(*j.shape, f32);
      std::fprintf(stderr, "wrote %s in %.0f s\n", f32.c_str(), since(t0));
    }
    std::string lower = j.type;
    for (auto& c : lower)
      c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const auto q = dir / (j.shape->file + "-" + lower + (j.pure ? "-pure" : "") + ".gguf");
    if (!quantize_file(llama, f32, q, j.type, j.pure ? "--pure" : ""))
      return 1;
    auto shard = model::Shard::load(q.string());
    const auto [a, b] = interleaved(*shard, llama, q.string(), threads, 0, 0, true, rounds);
    std::printf("| %s | %s%s | %s | %.0f | %s | %s | %s |\n", j.shape->file.c_str(), j.type.c_str(),
                j.pure ? " --pure" : "", type_mix(q.string()).c_str(), static_cast<double>(fs::file_size(q)) / 1e6,
                fmt(a.decode).c_str(), fmt(b.decode).c_str(), ratio(a.decode, b.decode).c_str());
    std::fflush(stdout);
  }
  return 0;
}
