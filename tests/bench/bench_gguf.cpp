// Shared helpers of the GGUF benchmarks (bench_gguf.hpp).

#include "tests/bench/bench_gguf.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>

namespace strata::benchgguf {

namespace fs = std::filesystem;
using clk = std::chrono::steady_clock;

double since(clk::time_point t0) {
  return std::chrono::duration<double>(clk::now() - t0).count();
}
double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

namespace {

// A streaming GGUF v3 writer of f32 tensors filled from a seeded generator.
struct Spec {
  std::string name;
  std::vector<uint64_t> dims; // innermost first
  float center = 0.f, scale = 0.02f;
};
struct Kv {
  std::string key;
  uint32_t type; // 4 u32, 6 f32, 8 string, 9 array (of `u`: 8 strs, 6 floats, 5 ints)
  uint32_t u = 0;
  float f = 0;
  std::string s = {};
  std::vector<std::string> strs = {};
  std::vector<float> floats = {};
  std::vector<int32_t> ints = {};
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
    else if (k.type == 9) {
      u32(k.u);
      if (k.u == 8) {
        u64(k.strs.size());
        for (auto& e : k.strs)
          str(e);
      } else if (k.u == 6) {
        u64(k.floats.size());
        put(k.floats.data(), k.floats.size() * 4);
      } else {
        u64(k.ints.size());
        put(k.ints.data(), k.ints.size() * 4);
      }
    } else
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

} // namespace

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
                        {a + "vocab_size", 4, s.vocab}};
  if (s.vocab_tokens && s.vocab > 259) {
    // A SentencePiece-style vocabulary of made-up pieces (what llama-server
    // needs to detokenize): <unk> <s> </s>, the 256 byte tokens, then "▁tN".
    Kv tokens{"tokenizer.ggml.tokens", 9, 8}, scores{"tokenizer.ggml.scores", 9, 6},
      types{"tokenizer.ggml.token_type", 9, 5};
    for (uint32_t i = 0; i < s.vocab; ++i) {
      char byte[8];
      std::snprintf(byte, sizeof byte, "<0x%02X>", i >= 3 ? (i - 3) & 0xff : 0);
      tokens.strs.push_back(i == 0 ? "<unk>" : i == 1 ? "<s>" : i == 2 ? "</s>" : i < 259 ? byte : "\u2581t" + std::to_string(i));
      scores.floats.push_back(-static_cast<float>(i));
      types.ints.push_back(i == 0 ? 2 : i < 3 ? 3 : i < 259 ? 6 : 1);
    }
    kv.push_back({"tokenizer.ggml.model", 8, 0, 0, "llama"});
    kv.push_back(std::move(tokens));
    kv.push_back(std::move(scores));
    kv.push_back(std::move(types));
    kv.push_back({"tokenizer.ggml.unknown_token_id", 4, 0});
    kv.push_back({"tokenizer.ggml.bos_token_id", 4, 1});
    kv.push_back({"tokenizer.ggml.eos_token_id", 4, 2});
  } else {
    kv.push_back({"tokenizer.ggml.model", 8, 0, 0, "none"});
  }
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
                                    {b + "attn_output.weight", {Q, D}}})
      ts.push_back(t);
    if (s.qk_norm) {
      ts.push_back({b + "attn_q_norm.weight", {s.head_dim}, 1.f, 0.05f});
      ts.push_back({b + "attn_k_norm.weight", {s.head_dim}, 1.f, 0.05f});
    }
    if (s.qkv_bias) {
      ts.push_back({b + "attn_q.bias", {Q}});
      ts.push_back({b + "attn_k.bias", {KV}});
      ts.push_back({b + "attn_v.bias", {KV}});
    }
    ts.push_back({b + "ffn_norm.weight", {D}, 1.f, 0.05f});
    if (s.experts > 0) {
      ts.push_back({b + "ffn_gate_inp.weight", {D, s.experts}});
      ts.push_back({b + "ffn_gate_exps.weight", {D, s.expert_ffn, s.experts}});
      ts.push_back({b + "ffn_up_exps.weight", {D, s.expert_ffn, s.experts}});
      ts.push_back({b + "ffn_down_exps.weight", {s.expert_ffn, D, s.experts}});
    } else {
      if (s.post_norms) {
        ts.push_back({b + "post_attention_norm.weight", {D}, 1.f, 0.05f});
        ts.push_back({b + "post_ffw_norm.weight", {D}, 1.f, 0.05f});
      }
      ts.push_back({b + "ffn_gate.weight", {D, s.ffn}});
      ts.push_back({b + "ffn_up.weight", {D, s.ffn}});
      ts.push_back({b + "ffn_down.weight", {s.ffn, D}});
    }
  }
  write_gguf(path, kv, ts, s.experts > 0 ? 48u : s.qkv_bias ? 5u : 3u);
}


bool quantize_file(const std::string& llama_bin, const fs::path& src, const fs::path& dst, const std::string& type,
                   const std::string& extra) {
  if (fs::exists(dst))
    return true;
  const std::string part = dst.string() + ".part";
  const std::string cmd = llama_bin + "/llama-quantize " + extra + " '" + src.string() + "' '" + part + "' " + type +
                          " 2 > /dev/null 2>&1";
  if (std::system(cmd.c_str()) != 0) {
    std::printf("llama-quantize failed: %s\n", cmd.c_str());
    return false;
  }
  fs::rename(part, dst);
  return true;
}

model::KVCache filled_cache(model::Shard& shard, int64_t n) {
  const auto V = shard.config().vocab_size;
  auto c = shard.new_cache();
  std::vector<int32_t> ids(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    ids[static_cast<std::size_t>(i)] = static_cast<int32_t>((i * 104729) % V);
  for (int64_t at = 0; at < n; at += 2048) { // in pieces, as the scheduler would
    const int64_t k = std::min<int64_t>(2048, n - at);
    shard.forward(std::span<const int32_t>(ids.data() + at, static_cast<std::size_t>(k)),
                  model::consecutive_positions(at, k), c);
  }
  return c;
}

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
  auto c = filled_cache(shard, std::max<int64_t>(depth, 1));
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

// The VM is shared and noisy: one pass can be off by 2x either way.
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

} // namespace strata::benchgguf
