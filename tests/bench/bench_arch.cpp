// strata_bench arch: decode and prefill speed of a Qwen3-MoE-shaped and a
// Gemma-3-shaped model (seeded random weights, written here as f32 GGUF and,
// when llama.cpp's tools are at hand, quantized by llama-quantize to Q4_K_M),
// next to llama.cpp's llama-bench on the very same files, interleaved (strata,
// then llama.cpp, per file). MoE decode is also set against the roofline of the
// bytes a token actually reads (the active experts, not all of them); Gemma 3
// decode at 8k of context against its speed at 512 (its windows keep long
// contexts cheap). A benchmark, not a test: it prints tables, asserts nothing.
//
// Usage: strata_bench arch [DIR [LLAMA_BIN]] (STRATA_BENCH_ROUNDS: rounds of
// strata then llama.cpp, default 3, medians): DIR holds the generated files
// (default build/bench-models), LLAMA_BIN the folder with llama-bench and
// llama-quantize (default: $LLAMA_CPP_BIN; none: strata alone, on f32).

#include "model/formats/gguf.hpp"
#include "model/transformer/shard.hpp"

#include <nlohmann/json.hpp>

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
#include <string>
#include <vector>

using namespace strata;
namespace fs = std::filesystem;
using clk = std::chrono::steady_clock;

double bench_bandwidth(int threads); // bench_model.cpp

namespace {

double since(clk::time_point t0) {
  return std::chrono::duration<double>(clk::now() - t0).count();
}
double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A streaming GGUF v3 writer of f32 tensors filled from a seeded generator.
struct Spec {
  std::string name;
  std::vector<uint64_t> dims; // innermost first
  float center = 0.f, scale = 0.02f;
};
struct Kv {
  std::string key;
  uint32_t type; // 4 u32, 6 f32, 8 string
  uint32_t u = 0;
  float f = 0;
  std::string s;
};

void write_gguf(const fs::path& path, const std::vector<Kv>& kvs, const std::vector<Spec>& ts, uint32_t seed) {
  std::ofstream o(path.string() + ".part", std::ios::binary);
  auto put = [&](const void* p, std::size_t n) { o.write(static_cast<const char*>(p), static_cast<std::streamsize>(n)); };
  auto u32 = [&](uint32_t v) { put(&v, 4); };
  auto u64 = [&](uint64_t v) { put(&v, 8); };
  auto str = [&](const std::string& s) {
    u64(s.size());
    put(s.data(), s.size());
  };
  put("GGUF", 4);
  u32(3);
  u64(ts.size());
  u64(kvs.size());
  for (auto& k : kvs) {
    str(k.key);
    u32(k.type);
    if (k.type == 4)
      u32(k.u);
    else if (k.type == 6)
      put(&k.f, 4);
    else
      str(k.s);
  }
  uint64_t off = 0;
  auto numel = [](const Spec& t) {
    uint64_t n = 1;
    for (auto d : t.dims)
      n *= d;
    return n;
  };
  for (auto& t : ts) {
    str(t.name);
    u32(static_cast<uint32_t>(t.dims.size()));
    for (auto d : t.dims)
      u64(d);
    u32(0);
    u64(off);
    off += (numel(t) * 4 + 31) / 32 * 32;
  }
  auto pad = [&] {
    const auto p = static_cast<uint64_t>(o.tellp());
    static const char zeros[32] = {};
    put(zeros, (32 - p % 32) % 32);
  };
  pad();
  std::mt19937 rng(seed);
  std::vector<float> buf;
  for (auto& t : ts) {
    std::uniform_real_distribution<float> u(-t.scale * std::sqrt(3.f), t.scale * std::sqrt(3.f)); // std = scale
    uint64_t left = numel(t);
    while (left > 0) {
      const auto n = static_cast<std::size_t>(std::min<uint64_t>(left, 1 << 20));
      buf.resize(n);
      for (auto& x : buf)
        x = t.center + u(rng);
      put(buf.data(), n * 4);
      left -= n;
    }
    pad();
  }
  o.close();
  fs::rename(path.string() + ".part", path);
}

struct Shape {
  std::string arch, file;
  uint32_t dim, layers, heads, kv_heads, head_dim, ffn, vocab, ctx;
  uint32_t experts = 0, used = 0, expert_ffn = 0;
  uint32_t window = 0, pattern = 0;
};

// Qwen3-30B-A3B (dim 2048, 48 layers, 128 experts of 768, 8 active, 32/4 heads x
// 128) scaled down: 48 experts of 512, 8 active, dim 1024, 12 layers, 8/2 heads x
// 128. Gemma-3-4B (dim 2560, 34 layers, 8/4 heads x 256, FFN 10240, window 1024,
// 5 local layers in 6) scaled down: dim 1024, 12 layers, 8/4 heads x 128, FFN
// 4096, window 1024, pattern 6. Widths are multiples of 256 (K-quants apply).
const Shape moe_shape{"qwen3moe", "qwen3moe-bench", 1024, 12, 8, 2, 128, 0, 32768, 16384, 48, 8, 512, 0, 0};
const Shape gemma_shape{"gemma3", "gemma3-bench", 1024, 12, 8, 4, 128, 4096, 32768, 16384, 0, 0, 0, 1024, 6};

void make_model(const Shape& s, const fs::path& path) {
  const std::string a = s.arch + ".";
  std::vector<Kv> kv = {{"general.architecture", 8, 0, 0, s.arch},
                        {"general.name", 8, 0, 0, s.file},
                        {"general.description", 8, 0, 0, "seeded random weights (strata_bench arch); not a trained model"},
                        {"general.file_type", 4, 0},
                        {a + "context_length", 4, s.ctx},
                        {a + "embedding_length", 4, s.dim},
                        {a + "block_count", 4, s.layers},
                        {a + "feed_forward_length", 4, s.ffn > 0 ? s.ffn : s.expert_ffn},
                        {a + "attention.head_count", 4, s.heads},
                        {a + "attention.head_count_kv", 4, s.kv_heads},
                        {a + "attention.key_length", 4, s.head_dim},
                        {a + "attention.value_length", 4, s.head_dim},
                        {a + "rope.dimension_count", 4, s.head_dim},
                        {a + "rope.freq_base", 6, 0, 1e6f},
                        {a + "attention.layer_norm_rms_epsilon", 6, 0, 1e-6f},
                        {a + "vocab_size", 4, s.vocab},
                        {"tokenizer.ggml.model", 8, 0, 0, "none"}};
  if (s.experts > 0) {
    kv.push_back({a + "expert_count", 4, s.experts});
    kv.push_back({a + "expert_used_count", 4, s.used});
    kv.push_back({a + "expert_feed_forward_length", 4, s.expert_ffn});
  }
  if (s.window > 0) {
    kv.push_back({a + "attention.sliding_window", 4, s.window});
    kv.push_back({a + "attention.sliding_window_pattern", 4, s.pattern});
    kv.push_back({a + "rope.freq_base_swa", 6, 0, 1e4f});
  }
  const uint64_t D = s.dim, Q = uint64_t{s.heads} * s.head_dim, KV = uint64_t{s.kv_heads} * s.head_dim;
  std::vector<Spec> ts = {{"token_embd.weight", {D, s.vocab}}, {"output_norm.weight", {D}, 1.f, 0.05f}};
  for (uint32_t l = 0; l < s.layers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    for (Spec t : std::vector<Spec>{{b + "attn_norm.weight", {D}, 1.f, 0.05f},
                                    {b + "attn_q.weight", {D, Q}},
                                    {b + "attn_k.weight", {D, KV}},
                                    {b + "attn_v.weight", {D, KV}},
                                    {b + "attn_output.weight", {Q, D}},
                                    {b + "attn_q_norm.weight", {s.head_dim}, 1.f, 0.05f},
                                    {b + "attn_k_norm.weight", {s.head_dim}, 1.f, 0.05f},
                                    {b + "ffn_norm.weight", {D}, 1.f, 0.05f}})
      ts.push_back(t);
    if (s.experts > 0) {
      ts.push_back({b + "ffn_gate_inp.weight", {D, s.experts}});
      ts.push_back({b + "ffn_gate_exps.weight", {D, s.expert_ffn, s.experts}});
      ts.push_back({b + "ffn_up_exps.weight", {D, s.expert_ffn, s.experts}});
      ts.push_back({b + "ffn_down_exps.weight", {s.expert_ffn, D, s.experts}});
    } else {
      ts.push_back({b + "post_attention_norm.weight", {D}, 1.f, 0.05f});
      ts.push_back({b + "post_ffw_norm.weight", {D}, 1.f, 0.05f});
      ts.push_back({b + "ffn_gate.weight", {D, s.ffn}});
      ts.push_back({b + "ffn_up.weight", {D, s.ffn}});
      ts.push_back({b + "ffn_down.weight", {s.ffn, D}});
    }
  }
  write_gguf(path, kv, ts, s.experts > 0 ? 48u : 3u);
}

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

struct Speeds {
  double prefill = 0, decode = 0;
};

// Prefill `prompt` tokens in one call; decode 24 tokens after a context of
// `depth` (median step).
Speeds strata_speed(model::Shard& shard, int threads, int64_t prompt, int64_t depth) {
  model::set_num_threads(threads);
  const auto V = shard.config().vocab_size;
  Speeds sp;
  if (prompt > 0) {
    std::vector<double> runs;
    for (int rep = 0; rep < 2; ++rep) {
      std::vector<int32_t> ids(static_cast<std::size_t>(prompt));
      for (int64_t i = 0; i < prompt; ++i)
        ids[static_cast<std::size_t>(i)] = static_cast<int32_t>((i * 7919 + rep) % V);
      auto c = shard.new_cache();
      const auto t0 = clk::now();
      shard.forward(ids, model::consecutive_positions(0, prompt), c);
      runs.push_back(static_cast<double>(prompt) / since(t0));
    }
    sp.prefill = *std::max_element(runs.begin(), runs.end());
  }
  auto c = shard.new_cache();
  {
    const int64_t first = std::max<int64_t>(depth, 1);
    std::vector<int32_t> ids(static_cast<std::size_t>(first));
    for (int64_t i = 0; i < first; ++i)
      ids[static_cast<std::size_t>(i)] = static_cast<int32_t>((i * 104729) % V);
    for (int64_t at = 0; at < first; at += 2048) { // in pieces, as the scheduler would
      const int64_t n = std::min<int64_t>(2048, first - at);
      shard.forward(std::span<const int32_t>(ids.data() + at, static_cast<std::size_t>(n)),
                    model::consecutive_positions(at, n), c);
    }
  }
  std::vector<double> steps;
  int32_t next = 7;
  for (int i = 0; i < 26; ++i) {
    const auto t0 = clk::now();
    auto out = shard.forward(std::span<const int32_t>(&next, 1), model::consecutive_positions(c.seq_len(), 1), c);
    steps.push_back(since(t0));
    next = static_cast<int32_t>(std::max_element(out.logits.begin(), out.logits.end()) - out.logits.begin());
  }
  steps.erase(steps.begin(), steps.begin() + 2);
  sp.decode = 1.0 / median_of(steps);
  return sp;
}

// llama-bench on the same file: prefill `prompt` and 24 decoded tokens at `depth`.
Speeds llama_speed(const std::string& bin, const std::string& file, int threads, int64_t prompt, int64_t depth) {
  const std::string cmd = bin + "/llama-bench -m '" + file + "' -t " + std::to_string(threads) + " -p " +
                          std::to_string(prompt) + " -n 24 -d " + std::to_string(depth) +
                          " -r 2 -o json 2>/dev/null";
  Speeds sp;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p)
    return sp;
  std::string out;
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p))
    out.append(buf, n);
  pclose(p);
  try {
    for (auto& r : nlohmann::json::parse(out)) {
      if (r.value("n_prompt", 0) > 0)
        sp.prefill = r.value("avg_ts", 0.0);
      if (r.value("n_gen", 0) > 0)
        sp.decode = r.value("avg_ts", 0.0);
    }
  } catch (const std::exception&) {
    std::fprintf(stderr, "llama-bench gave no JSON for %s: %s\n", file.c_str(), out.substr(0, 300).c_str());
  }
  return sp;
}

// Rounds of (strata, llama.cpp) in turn; the median of each figure. The VM is
// shared and noisy: one pass can be off by 2x either way.
std::pair<Speeds, Speeds> interleaved(model::Shard& shard, const std::string& llama, const std::string& file, int t,
                                      int64_t prompt, int64_t depth, bool peer, int rounds) {
  std::vector<double> ap, ad, bp, bd;
  for (int r = 0; r < rounds; ++r) {
    const auto a = strata_speed(shard, t, prompt, depth);
    ap.push_back(a.prefill);
    ad.push_back(a.decode);
    if (peer) {
      const auto b = llama_speed(llama, file, t, prompt, depth);
      bp.push_back(b.prefill);
      bd.push_back(b.decode);
    }
  }
  Speeds a{median_of(ap), median_of(ad)}, b;
  if (peer)
    b = {median_of(bp), median_of(bd)};
  return {a, b};
}

std::string fmt(double v) {
  if (v <= 0)
    return "-";
  char b[32];
  std::snprintf(b, sizeof b, v >= 100 ? "%.0f" : "%.1f", v);
  return b;
}
std::string ratio(double a, double b) {
  if (a <= 0 || b <= 0)
    return "-";
  char r[32];
  std::snprintf(r, sizeof r, "%.2f", a / b);
  return r;
}

} // namespace

int arch_bench_main(int argc, char** argv) {
  const fs::path dir = argc > 2 ? argv[2] : "build/bench-models";
  const char* env = std::getenv("LLAMA_CPP_BIN");
  const std::string llama = argc > 3 ? argv[3] : env ? env : "";
  const bool peer = !llama.empty() && fs::exists(fs::path(llama) / "llama-bench") &&
                    fs::exists(fs::path(llama) / "llama-quantize");
  fs::create_directories(dir);
  const char* rounds_env = std::getenv("STRATA_BENCH_ROUNDS");
  const int rounds = std::max(1, rounds_env ? std::atoi(rounds_env) : 3);
  std::printf("# strata_bench arch\n\nFiles in %s; peer: %s\n", dir.c_str(),
              peer ? (llama + " (llama-bench, llama-quantize)").c_str() : "none (set LLAMA_CPP_BIN): strata alone, f32");
  const double bw1 = bench_bandwidth(1), bw2 = bench_bandwidth(2);
  std::printf("read bandwidth: %.1f GB/s (1 thread), %.1f GB/s (2 threads); %d interleaved rounds "
              "(STRATA_BENCH_ROUNDS), medians\n",
              bw1, bw2, rounds);
  for (const Shape* s : {&moe_shape, &gemma_shape}) {
    const auto f32 = dir / (s->file + "-f32.gguf");
    if (!fs::exists(f32)) {
      const auto t0 = clk::now();
      make_model(*s, f32);
      std::printf("wrote %s in %.0f s\n", f32.c_str(), since(t0));
    }
    std::string file = f32.string();
    if (peer) {
      const auto q = dir / (s->file + "-q4_k_m.gguf");
      if (!fs::exists(q)) {
        const std::string cmd = llama + "/llama-quantize '" + f32.string() + "' '" + q.string() + "' Q4_K_M 2 > /dev/null 2>&1";
        if (std::system(cmd.c_str()) != 0) {
          std::printf("llama-quantize failed: %s\n", cmd.c_str());
          return 1;
        }
      }
      file = q.string();
    }
    auto shard = model::Shard::load(file);
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
    }
  }
  return 0;
}
