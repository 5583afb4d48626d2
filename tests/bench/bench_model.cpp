// strata_bench model: decode speed of stories260K, of a Qwen2.5-0.5B-shaped
// builtin against the DRAM roofline, cached vs stateless step times, and decode /
// prefill / memory per weight type (also alone: strata_bench dtypes).
// A benchmark, not a test: it prints a table and asserts nothing.

#include "model/kernels/kernels.hpp"
#include "model/formats/packed.hpp"
#include "model/kernels/kernels_q.hpp"
#include "model/kernels/attention.hpp"
#include "model/formats/quant.hpp"
#include "model/formats/safetensors.hpp"
#include "model/transformer/shard.hpp"
#include "runtime/generator.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <random>
#include <cstring>
#include <cstdlib>
#include <string>
#include <sys/resource.h>
#include <thread>
#include <unistd.h>
#include <vector>

using namespace strata;
using clk = std::chrono::steady_clock;

namespace {

double seconds_since(clk::time_point t0) {
  return std::chrono::duration<double>(clk::now() - t0).count();
}

double cpu_seconds() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return static_cast<double>(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
         static_cast<double>(r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1e6;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Vectorized sum of [lo, hi) read as four interleaved streams (like the four
// rows the gemv kernel reads at once), so one thread keeps enough loads in flight.
__attribute__((target_clones("avx512f", "avx2", "default"))) float sum_range(const float* p, std::size_t lo,
                                                                             std::size_t hi) {
  const std::size_t q = (hi - lo) / 4;
  const float *a = p + lo, *b = a + q, *c = b + q, *d = c + q;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (std::size_t i = 0; i < q; ++i) {
    s0 += a[i];
    s1 += b[i];
    s2 += c[i];
    s3 += d[i];
  }
  return s0 + s1 + s2 + s3;
}

// Read bandwidth in GB/s: `threads` threads each summing their part of a 1 GiB buffer.
double measure_bandwidth(int threads) {
  const std::size_t n = (std::size_t{1} << 30) / sizeof(float);
  static std::vector<float> buf(n, 1.0f);
  std::vector<double> runs;
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<double> sums(static_cast<std::size_t>(threads));
    auto t0 = clk::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        const std::size_t lo = n / threads * t, hi = t == threads - 1 ? n : n / threads * (t + 1);
        sums[static_cast<std::size_t>(t)] = sum_range(buf.data(), lo, hi);
      });
    for (auto& t : ts)
      t.join();
    runs.push_back(static_cast<double>(n * sizeof(float)) / seconds_since(t0) / 1e9);
    if (std::accumulate(sums.begin(), sums.end(), 0.0) < 0)
      std::puts("impossible");
  }
  return median(runs);
}

void bench_stories(const std::string& path) {
  if (!std::filesystem::exists(path)) {
    std::printf("stories260K: %s absent, skipped\n", path.c_str());
    return;
  }
  runtime::LocalPipeline pipe(path);
  runtime::GenerateRequest req;
  req.prompt_ids = {1};
  req.max_tokens = 256; // llama2.c's default -n 256
  std::printf("\n## stories260K decode (greedy, prompt [BOS], 256 tokens, median of 7 runs)\n\n");
  std::printf("| threads | tok/s |\n|---|---|\n");
  for (int threads : {1, 2}) {
    model::set_num_threads(threads);
    std::vector<double> tps;
    for (int rep = 0; rep < 7; ++rep) {
      auto t0 = clk::now();
      auto res = runtime::generate(pipe, req);
      tps.push_back(static_cast<double>(res.ids.size()) / seconds_since(t0));
    }
    std::printf("| %d | %.0f |\n", threads, median(tps));
  }
}

void bench_qwen_shape(double bw1, double bw2, bool sweep) {
  auto t0 = clk::now();
  auto shard = model::Shard::load("builtin:qwen2-0.5b");
  const auto& c = shard->config();
  std::printf("\n## builtin:qwen2-0.5b (dim 896, 24 layers, 14/2 heads, hidden 4864, vocab 151936, tied, f32)\n\n");
  std::printf("load: %.1f s, weights %.2f GB\n\n", seconds_since(t0), static_cast<double>(shard->weight_bytes()) / 1e9);
  // Bytes read per decoded token: every layer matrix + the (tied) classifier.
  const double per_token = static_cast<double>(shard->weight_bytes());
  std::printf("| threads | decode tok/s | cores busy | bandwidth GB/s | roofline tok/s | %% of roofline |\n"
              "|---|---|---|---|---|---|\n");
  for (int threads : {1, 2}) {
    model::set_num_threads(threads);
    auto cache = shard->new_cache();
    std::vector<int32_t> prompt = {9707, 11, 1879, 0};
    auto out = shard->forward(prompt, model::consecutive_positions(0, 4), cache);
    std::vector<double> step;
    const double cpu0 = cpu_seconds();
    const auto wall0 = clk::now();
    for (int i = 0; i < 12; ++i) {
      int32_t next = static_cast<int32_t>(std::max_element(out.logits.begin(), out.logits.end()) - out.logits.begin());
      auto s0 = clk::now();
      out = shard->forward(std::span<const int32_t>(&next, 1), model::consecutive_positions(cache.seq_len(), 1), cache);
      step.push_back(seconds_since(s0));
    }
    const double busy = (cpu_seconds() - cpu0) / seconds_since(wall0);
    step.erase(step.begin(), step.begin() + 2); // warm-up
    const double tps = 1.0 / median(step);
    const double bw = threads == 1 ? bw1 : bw2;
    const double roof = bw * 1e9 / per_token;
    std::printf("| %d | %.2f | %.2f | %.1f | %.2f | %.0f %% |\n", threads, tps, busy, bw, roof, 100.0 * tps / roof);
  }
  if (!sweep)
    return;
  // Cached step vs stateless step at several lengths (2 threads).
  model::set_num_threads(2);
  std::printf("\n### cached vs stateless decode step, 2 threads\n\n");
  std::printf("| context | cached step ms | stateless step ms (recompute the prefix) |\n|---|---|---|\n");
  for (int64_t len : {64, 256, 1024, 2048}) {
    std::vector<int32_t> ids(static_cast<std::size_t>(len));
    for (int64_t i = 0; i < len; ++i)
      ids[static_cast<std::size_t>(i)] = static_cast<int32_t>((i * 7919) % c.vocab_size);
    auto cache = shard->new_cache();
    auto s0 = clk::now();
    shard->forward(ids, model::consecutive_positions(0, len), cache); // = one stateless step at this length
    const double stateless = seconds_since(s0);
    std::vector<double> step;
    for (int i = 0; i < 6; ++i) {
      int32_t t = 42;
      auto s1 = clk::now();
      shard->forward(std::span<const int32_t>(&t, 1), model::consecutive_positions(cache.seq_len(), 1), cache);
      step.push_back(seconds_since(s1));
    }
    std::printf("| %lld | %.1f | %.0f |\n", static_cast<long long>(len), median(step) * 1e3, stateless * 1e3);
  }
}

// Resident set of this process in bytes (/proc/self/statm).
double rss_bytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  long pages = 0, resident = 0;
  if (f) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2)
      resident = 0;
    std::fclose(f);
  }
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
}

// Decode and prefill of builtin:qwen2-0.5b per resident weight type. The five
// shards are loaded side by side and measured interleaved (round-robin, 5
// rounds), so the VM's noise hits every type alike; ratios are to f32.
void bench_dtypes(double bw1, double bw2) {
  struct Row {
    std::string dtype;
    std::unique_ptr<model::Shard> shard;
    double rss = 0, load_s = 0;
    std::vector<double> step[2];
    double prefill_s[2] = {0, 0};
  };
  std::vector<Row> rows;
  for (const char* dt : {"f32", "bf16", "q8_0", "q4_0", "q4_K"}) {
    Row r;
    r.dtype = dt;
    model::LoadOptions o;
    o.dtype = dt;
    const double rss0 = rss_bytes();
    auto t0 = clk::now();
    r.shard = model::Shard::load("builtin:qwen2-0.5b", o);
    r.load_s = seconds_since(t0);
    r.rss = rss_bytes() - rss0;
    rows.push_back(std::move(r));
  }
  const auto& c = rows.front().shard->config();
  const double params = static_cast<double>(c.n_layers) *
                          static_cast<double>((c.q_dim() + 2 * c.kv_dim()) * c.dim + c.dim * c.q_dim() + 3 * c.hidden_dim * c.dim) +
                        static_cast<double>(c.vocab_size * c.dim);
  for (int ti = 0; ti < 2; ++ti) {
    model::set_num_threads(ti + 1);
    for (int round = 0; round < 5; ++round)
      for (auto& r : rows) {
        auto cache = r.shard->new_cache();
        std::vector<int32_t> prompt(128);
        for (int i = 0; i < 128; ++i)
          prompt[static_cast<std::size_t>(i)] = (i * 7919 + 13) % static_cast<int32_t>(c.vocab_size);
        auto p0 = clk::now();
        auto out = r.shard->forward(prompt, model::consecutive_positions(0, 128), cache);
        const double ps = seconds_since(p0);
        if (round > 0 && (r.prefill_s[ti] == 0 || ps < r.prefill_s[ti]))
          r.prefill_s[ti] = ps;
        for (int i = 0; i < 6; ++i) {
          int32_t next = static_cast<int32_t>(std::max_element(out.logits.begin(), out.logits.end()) - out.logits.begin());
          auto s0 = clk::now();
          out = r.shard->forward(std::span<const int32_t>(&next, 1), model::consecutive_positions(cache.seq_len(), 1), cache);
          if (i > 0)
            r.step[ti].push_back(seconds_since(s0));
        }
      }
  }
  std::printf("\n## builtin:qwen2-0.5b per weight type (--dtype), interleaved, median of 25 decode steps after a 128-token prompt\n\n");
  std::printf("| dtype | weights GB | RSS growth GB | load s | threads | decode tok/s | x f32 | bytes/token MB | %% of roofline | prefill GFLOP/s |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n");
  for (int ti = 0; ti < 2; ++ti) {
    const double f32_tps = 1.0 / median(rows.front().step[ti]);
    for (auto& r : rows) {
      const double tps = 1.0 / median(r.step[ti]);
      const double bytes = static_cast<double>(r.shard->weight_bytes());
      const double roof = (ti == 0 ? bw1 : bw2) * 1e9 / bytes;
      std::printf("| %s | %.2f | %.2f | %.1f | %d | %.2f | %.2f | %.0f | %.0f %% | %.1f |\n", r.dtype.c_str(), bytes / 1e9,
                  r.rss / 1e9, r.load_s, ti + 1, tps, tps / f32_tps, bytes / 1e6, 100.0 * tps / roof,
                  2.0 * params * 128 / r.prefill_s[ti] / 1e9);
    }
  }
}

// The product kernel alone, per type, on one ffn_down-shaped matrix of the
// Qwen2.5-0.5B shape (896 x 4864: its 4864 columns are a multiple of the K
// types' 256, unlike the 896-column matrices), 1 and 8 activation rows (a
// decode step alone and in a batch of 8). Random blocks with tame scales;
// reps interleaved across types. Where the CPU has AVX-512, f32 and bf16 are
// also measured with the f32 product's AVX2 build (what CPUs without AVX-512 run).
void bench_kernels() {
  // The product of each type's matrix with 1 and N activation rows, then what
  // packing each matrix at load costs. STRATA_BENCH_SHAPE=ROWSxCOLS: another matrix (a small one stays in cache:
  // the kernels' arithmetic alone); STRATA_BENCH_M=N: N activation rows for the
  // second column instead of 8.
  int64_t rows = 896, cols = 4864;
  if (const char* sh = std::getenv("STRATA_BENCH_SHAPE"))
    if (std::sscanf(sh, "%ldx%ld", &rows, &cols) != 2 || rows <= 0 || cols <= 0 || cols % 32 != 0) {
      std::fprintf(stderr, "STRATA_BENCH_SHAPE: ROWSxCOLS with COLS a multiple of 32 (the 256-value types are left out where it is not one of 256)\n");
      std::exit(2);
    }
  int64_t many = 8;
  if (const char* m = std::getenv("STRATA_BENCH_M"))
    many = std::clamp<int64_t>(std::atol(m), 1, 64);
  const int64_t Ms[] = {1, many};
  struct K {
    model::WType t;
    std::string label;
    std::vector<uint8_t> bytes;
    model::detail::WMatrix w;
    std::vector<double> s[2][2]; // [threads - 1][M index]
    bool avx2 = false;           // through the f32 product's AVX2 build
  };
  std::vector<K> ks;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 0.05f);
  // STRATA_BENCH_TYPES=q8_0,q4_K: only those (f32 is always kept: the "x f32" column).
  const char* only = std::getenv("STRATA_BENCH_TYPES");
  for (auto t : model::all_wtypes) {
    if (t == model::WType::f16)
      continue;
    if (cols % model::block_values(t) != 0)
      continue;
    if (only && t != model::WType::f32 &&
        ("," + std::string(only) + ",").find("," + std::string(model::to_string(t)) + ",") == std::string::npos)
      continue;
    K k;
    k.t = t;
    k.bytes.resize(model::row_bytes(t, cols) * rows);
    if (t == model::WType::f32 || t == model::WType::bf16 || t == model::WType::q8_0 || t == model::WType::q4_0) {
      std::vector<float> v(static_cast<std::size_t>(rows * cols));
      for (auto& x : v)
        x = nd(rng);
      model::quantize(t, v.data(), k.bytes.data(), rows * cols);
    } else { // random quants, every f16 scale field of a sensible size
      for (auto& b : k.bytes)
        b = static_cast<uint8_t>(rng());
      const std::size_t bb = model::block_bytes(t);
      const uint16_t d = model::f32_to_f16(0.001f);
      std::vector<std::size_t> at; // the block's f16 fields
      switch (t) {
        case model::WType::q6_K: at = {208}; break;
        case model::WType::q2_K: at = {80, 82}; break;
        case model::WType::q3_K: at = {108}; break;
        case model::WType::q4_K: case model::WType::q5_K: case model::WType::q4_1: case model::WType::q5_1: at = {0, 2}; break;
        default: at = {0}; break;
      }
      for (std::size_t b = 0; b < k.bytes.size(); b += bb)
        for (auto o : at)
          std::memcpy(&k.bytes[b + o], &d, 2);
    }
    k.w.type = t;
    k.w.rows = rows;
    k.w.cols = cols;
    k.w.data = k.bytes.data();
    k.label = model::to_string(t);
    ks.push_back(std::move(k));
    if ((t == model::WType::f32 || t == model::WType::bf16) && __builtin_cpu_supports("avx512f") &&
        model::detail::attention_avx2_available()) {
      K a;
      a.t = t;
      a.bytes = ks.back().bytes;
      a.w = ks.back().w;
      a.w.data = a.bytes.data();
      a.label = std::string(model::to_string(t)) + " (AVX2 build)";
      a.avx2 = true;
      ks.push_back(std::move(a));
    }
    if (model::detail::packable(ks.back().w)) { // and in the layout the loader gives it where VNNI runs
      K p;
      p.t = t;
      p.bytes = ks.back().bytes;
      p.w = model::detail::pack_for_kernels(ks.back().w);
      p.label = std::string(model::to_string(t)) + (p.w.packed ? " packed" : " (no packed kernel here)");
      ks.push_back(std::move(p));
    }
  }
  std::vector<float> x(static_cast<std::size_t>(many * cols)), y(static_cast<std::size_t>(many * rows));
  for (auto& v : x)
    v = nd(rng) * 20;
  for (int ti = 0; ti < 2; ++ti) {
    model::set_num_threads(ti + 1);
    for (int rep = 0; rep < 40; ++rep)
      for (auto& k : ks)
        for (int mi = 0; mi < 2; ++mi) {
          model::detail::set_rows_isa_avx2(k.avx2);
          auto t0 = clk::now();
          model::detail::matmul_rows(k.w, x.data(), y.data(), rows, Ms[mi], false);
          if (rep >= 5)
            k.s[ti][mi].push_back(seconds_since(t0));
          model::detail::set_rows_isa_avx2(false);
        }
  }
  std::printf("\n## The product kernel alone: %ld x %ld matrix, 1 and %ld rows, median of 35 interleaved reps\n\n",
              static_cast<long>(rows), static_cast<long>(cols), static_cast<long>(many));
  std::printf("| type | MB | threads | 1 row us | GB/s | x f32 | %ld rows us | per row vs 1 row |\n"
              "|---|---|---|---|---|---|---|---|\n", static_cast<long>(many));
  for (int ti = 0; ti < 2; ++ti) {
    const double f32 = median(ks.front().s[ti][0]);
    for (auto& k : ks) {
      const double s1 = median(k.s[ti][0]), s8 = median(k.s[ti][1]);
      std::printf("| %s | %.2f | %d | %.0f | %.1f | %.2f | %.0f | %.2f |\n", k.label.c_str(),
                  static_cast<double>(k.bytes.size()) / 1e6, ti + 1, s1 * 1e6,
                  static_cast<double>(k.bytes.size()) / s1 / 1e9, f32 / s1, s8 * 1e6, s8 / static_cast<double>(many) / s1);
    }
  }
  // What the loader's packing costs: each packable matrix packed on one thread
  // (pack_rows) and as the loader packs it, on the math pool's threads
  // (pack_for_kernels), medians of 7 in turn.
  std::printf("\n## Packing at load: the same matrices, median of 7 in turn\n\n"
              "| type | MB | 1 thread ms | MB/s | as the loader packs (2 threads) ms | MB/s |\n|---|---|---|---|---|---|\n");
  model::set_num_threads(2);
  for (auto& k : ks) {
    if (!model::detail::packable(k.w) || k.avx2 || k.label.find(" ") != std::string::npos)
      continue;
    std::vector<double> one, pool;
    bool packs = true; // (pack_for_kernels keeps the plain layout where VNNI is missing)
    for (int rep = 0; rep < 7; ++rep) {
      auto t0 = clk::now();
      (void)model::detail::pack_rows(k.w);
      one.push_back(seconds_since(t0));
      t0 = clk::now();
      packs = model::detail::pack_for_kernels(k.w).packed;
      pool.push_back(seconds_since(t0));
    }
    const double mb = static_cast<double>(k.bytes.size()) / 1e6, a = median(one), b = median(pool);
    if (packs)
      std::printf("| %s | %.2f | %.2f | %.0f | %.2f | %.0f |\n", k.label.c_str(), mb, a * 1e3, mb / a, b * 1e3, mb / b);
    else
      std::printf("| %s | %.2f | %.2f | %.0f | - | - |\n", k.label.c_str(), mb, a * 1e3, mb / a);
  }
}

} // namespace

double bench_bandwidth(int threads) { // for bench_arch.cpp
  return measure_bandwidth(threads);
}

int arch_bench_main(int argc, char** argv);    // bench_arch.cpp
int types_bench_main(int argc, char** argv);   // bench_types.cpp
int kv_bench_main(int argc, char** argv);      // bench_kv.cpp
int attention_bench_main(int argc, char** argv); // bench_attention.cpp
int cluster_bench_main(int argc, char** argv); // bench_cluster.cpp
int batch_bench_main(int argc, char** argv);   // bench_batch.cpp
int prefix_bench_main(int argc, char** argv);  // bench_prefix.cpp
int wan_bench_main(int argc, char** argv);     // bench_wan.cpp
int grammar_bench_main(int argc, char** argv); // bench_grammar.cpp
int draft_bench_main(int argc, char** argv);   // bench_draft.cpp

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::string what = argc > 1 ? argv[1] : "model";
  if (what == "wan")
    return wan_bench_main(argc, argv);
  if (what == "grammar")
    return grammar_bench_main(argc, argv);
  if (what == "draft")
    return draft_bench_main(argc, argv);
  if (what == "arch")
    return arch_bench_main(argc, argv);
  if (what == "types")
    return types_bench_main(argc, argv);
  if (what == "kv")
    return kv_bench_main(argc, argv);
  if (what == "attention")
    return attention_bench_main(argc, argv);
  if (what == "kernels") {
    std::printf("# strata_bench kernels (%u hardware threads)\n", std::thread::hardware_concurrency());
    bench_kernels();
    return 0;
  }
  if (what == "batch")
    return batch_bench_main(argc, argv);
  if (what == "prefix")
    return prefix_bench_main(argc, argv);
  if (what == "chaos" || what == "throughput")
    return cluster_bench_main(argc, argv);
  if (what == "kernels") {
    bench_kernels();
    return 0;
  }
  if (what == "dtypes") {
    std::printf("# strata_bench dtypes (%u hardware threads)\n", std::thread::hardware_concurrency());
    const double bw1 = measure_bandwidth(1), bw2 = measure_bandwidth(2);
    std::printf("\nmeasured read bandwidth: %.1f GB/s (1 thread), %.1f GB/s (2 threads)\n", bw1, bw2);
    bench_dtypes(bw1, bw2);
    bench_kernels();
    return 0;
  }
  if (what != "model" && what != "stories" && what != "qwen") {
    std::fprintf(stderr, "usage: strata_bench model|stories|qwen|chaos [N [SEED]]|throughput [path/to/stories260K.bin]\n");
    return 2;
  }
  const std::string stories = argc > 2 ? argv[2] : "../shared/models/stories260K.bin";
  std::printf("# strata_bench model (%u hardware threads)\n", std::thread::hardware_concurrency());
  if (what != "qwen")
    bench_stories(stories);
  if (what == "stories")
    return 0;
  const double bw1 = measure_bandwidth(1), bw2 = measure_bandwidth(2);
  std::printf("\nmeasured read bandwidth: %.1f GB/s (1 thread), %.1f GB/s (2 threads)\n", bw1, bw2);
  bench_qwen_shape(bw1, bw2, what == "model");
  if (what == "model") { // the per-type tables too (scripts/bench dtypes runs only those)
    bench_dtypes(bw1, bw2);
    bench_kernels();
  }
  return 0;
}
