// RoPE scaling (linear, llama3, yarn) against an independent computation: a
// short Node script written from Hugging Face's modeling_rope_utils formulas
// computes the inverse frequencies and yarn's attention factor in double
// precision; strata's must agree. Config parsing of rope_scaling and
// sliding_window, and GGUF's per-frequency factors against linear scaling.

#include "model/base/config.hpp"
#include "model/base/error.hpp"
#include "model/transformer/shard.hpp"
#include "tests/model/gguf_writer.hpp"
#include "tests/support.hpp"

#include <cmath>
#include <cstdio>
#include <random>

namespace strata {
namespace {

using nlohmann::json;

const char* rope_js = R"JS(
const c = JSON.parse(process.argv[2]);
const dim = c.head_dim, base = c.rope_theta, rs = c.rope_scaling;
const half = dim / 2;
let inv = [];
for (let i = 0; i < half; i++) inv.push(1 / Math.pow(base, (2 * i) / dim));
let att = 1;
if (rs.type === "linear") inv = inv.map(f => f / rs.factor);
if (rs.type === "dynamic" && rs.seq_len > rs.original) { // HF _compute_dynamic_ntk_parameters
  const b = base * Math.pow((rs.factor * rs.seq_len) / rs.original - (rs.factor - 1), dim / (dim - 2));
  inv = inv.map((f, i) => 1 / Math.pow(b, (2 * i) / dim));
}
if (rs.type === "llama3") {
  const lowW = rs.original / rs.low, highW = rs.original / rs.high;
  inv = inv.map(f => {
    const w = 2 * Math.PI / f;
    if (w < highW) return f;
    if (w > lowW) return f / rs.factor;
    const s = (rs.original / w - rs.low) / (rs.high - rs.low);
    return (1 - s) * f / rs.factor + s * f;
  });
}
if (rs.type === "yarn") {
  const corr = r => (dim * Math.log(rs.original / (r * 2 * Math.PI))) / (2 * Math.log(base));
  let lo = Math.max(Math.floor(corr(rs.beta_fast)), 0), hi = Math.min(Math.ceil(corr(rs.beta_slow)), dim - 1);
  if (lo === hi) hi += 0.001;
  inv = inv.map((f, i) => {
    const ramp = Math.min(1, Math.max(0, (i - lo) / (hi - lo)));
    const extra = 1 - ramp;
    return (f / rs.factor) * (1 - extra) + f * extra;
  });
  const ms = (s, m) => (s <= 1 ? 1 : 0.1 * m * Math.log(s) + 1);
  att = rs.mscale ? ms(rs.factor, rs.mscale) / ms(rs.factor, rs.mscale_all_dim) : ms(rs.factor, 1);
}
console.log(JSON.stringify({inv, att}));
)JS";

json run_node(const json& params) {
  auto dir = test::scratch_dir("rope_js");
  test::write_file(dir / "rope.js", rope_js);
  const std::string cmd = "node " + (dir / "rope.js").string() + " '" + params.dump() + "'";
  FILE* p = ::popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0)
    out.append(buf, n);
  ::pclose(p);
  return json::parse(out);
}

void expect_matches_reference(const model::ModelConfig& c, const json& js_scaling) {
  const json ref = run_node({{"head_dim", c.head_dim}, {"rope_theta", c.rope_theta}, {"rope_scaling", js_scaling}});
  const auto inv = c.rope_inv_freq();
  ASSERT_EQ(ref["inv"].size(), inv.size());
  for (std::size_t i = 0; i < inv.size(); ++i) {
    const double want = ref["inv"][i].get<double>();
    // strata takes the unscaled frequencies in float (as the references do): a
    // few float ulps apart from this double computation.
    EXPECT_NEAR(inv[i], want, 5e-7 * std::fabs(want) + 1e-12) << c.rope_scaling.type << " frequency " << i;
  }
  EXPECT_NEAR(c.rope_attention_factor(), ref["att"].get<double>(), 1e-12);
}

bool have_node() {
  return std::system("command -v node > /dev/null 2>&1") == 0;
}

TEST(Rope, ScaledFrequenciesMatchAnIndependentComputation) {
  if (!have_node())
    GTEST_SKIP() << "node is not installed (scripts/setup --test installs it); skipping";
  model::ModelConfig c;
  c.head_dim = 128;
  c.rope_theta = 500000.0;
  c.rope_scaling.type = "linear";
  c.rope_scaling.factor = 4.0;
  expect_matches_reference(c, {{"type", "linear"}, {"factor", 4.0}});
  // Llama 3.1 8B's rope_scaling.
  c.rope_scaling = {};
  c.rope_scaling.type = "llama3";
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position = 8192;
  expect_matches_reference(c, {{"type", "llama3"}, {"factor", 8.0}, {"low", 1.0}, {"high", 4.0}, {"original", 8192}});
  // Qwen2.5 configured for long context (YaRN factor 4 over 32768).
  c.rope_theta = 1000000.0;
  c.rope_scaling = {};
  c.rope_scaling.type = "yarn";
  c.rope_scaling.factor = 4.0;
  c.rope_scaling.original_max_position = 32768;
  expect_matches_reference(c, {{"type", "yarn"}, {"factor", 4.0}, {"original", 32768}, {"beta_fast", 32.0},
                               {"beta_slow", 1.0}});
  // Dynamic NTK at the longest sequence strata allows (the original context):
  // the reference's formula leaves the frequencies unscaled there.
  c.rope_scaling = {};
  c.rope_scaling.type = "dynamic";
  c.rope_scaling.factor = 2.0;
  c.rope_scaling.original_max_position = 32768;
  expect_matches_reference(c, {{"type", "dynamic"}, {"factor", 2.0}, {"original", 32768}, {"seq_len", 32768}});
  c.rope_scaling.type = "yarn";
  // YaRN with mscale / mscale_all_dim (DeepSeek style), head_dim 64.
  c.head_dim = 64;
  c.rope_theta = 10000.0;
  c.rope_scaling.factor = 40.0;
  c.rope_scaling.original_max_position = 4096;
  c.rope_scaling.mscale = 1.0;
  c.rope_scaling.mscale_all_dim = 0.707;
  expect_matches_reference(c, {{"type", "yarn"}, {"factor", 40.0}, {"original", 4096}, {"beta_fast", 32.0},
                               {"beta_slow", 1.0}, {"mscale", 1.0}, {"mscale_all_dim", 0.707}});
}

std::string hf_dir_with(const std::string& name, const json& extra) {
  auto dir = test::scratch_dir("rope_" + name);
  json cfg = {{"model_type", "llama"},       {"hidden_size", 64},        {"intermediate_size", 128},
              {"num_hidden_layers", 1},      {"num_attention_heads", 4}, {"num_key_value_heads", 2},
              {"vocab_size", 300},           {"max_position_embeddings", 32768},
              {"rms_norm_eps", 1e-5},        {"rope_theta", 500000.0}};
  for (auto& [k, v] : extra.items())
    cfg[k] = v;
  test::write_file(dir / "config.json", cfg.dump());
  test::write_file(dir / "model.safetensors", std::string(8, '\0') + "{}"); // config is all read_config needs
  return dir.string();
}

TEST(Rope, ConfigFieldsAreReadOrRefusedByName) {
  auto c = model::read_config(hf_dir_with(
    "llama3", {{"rope_scaling",
                {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                 {"original_max_position_embeddings", 8192}}}}));
  EXPECT_EQ(c.rope_scaling.type, "llama3");
  EXPECT_EQ(c.rope_scaling.original_max_position, 8192);
  c = model::read_config(hf_dir_with("yarn", {{"rope_scaling", {{"type", "yarn"}, {"factor", 4.0}}}}));
  EXPECT_EQ(c.rope_scaling.type, "yarn");
  EXPECT_EQ(c.rope_scaling.original_max_position, 32768) << "defaults to max_position_embeddings";
  c = model::read_config(hf_dir_with("default", {{"rope_scaling", {{"rope_type", "default"}}}}));
  EXPECT_EQ(c.rope_scaling.type, "none");
  // Dynamic NTK: held to the original context, where it is the unscaled math.
  c = model::read_config(hf_dir_with("dynamic", {{"rope_scaling", {{"type", "dynamic"}, {"factor", 2.0}}},
                                                 {"max_position_embeddings", 4096}}));
  EXPECT_EQ(c.rope_scaling.type, "dynamic");
  EXPECT_EQ(c.max_seq_len, 4096);
  c = model::read_config(hf_dir_with("dynamic_orig", {{"rope_scaling", {{"type", "dynamic"}, {"factor", 4.0},
                                                     {"original_max_position_embeddings", 2048}}}}));
  EXPECT_EQ(c.max_seq_len, 2048);
  EXPECT_MODEL_ERROR(model::read_config(hf_dir_with("dynamic_nofactor", {{"rope_scaling", {{"type", "dynamic"}}}})),
                     model::errc::bad_config, "factor");
  EXPECT_MODEL_ERROR(model::read_config(hf_dir_with("longrope", {{"rope_scaling", {{"type", "longrope"}}}})),
                     model::errc::unsupported, "longrope");
  EXPECT_MODEL_ERROR(model::read_config(hf_dir_with("nofactor", {{"rope_scaling", {{"type", "linear"}}}})),
                     model::errc::bad_config, "factor");
  // Other fields that change the math are refused by name.
  EXPECT_MODEL_ERROR(model::read_config(hf_dir_with("gelu", {{"hidden_act", "gelu"}})), model::errc::unsupported,
                     "hidden_act");
  EXPECT_MODEL_ERROR(model::read_config(hf_dir_with("mlpbias", {{"mlp_bias", true}})), model::errc::unsupported,
                     "mlp_bias");
  EXPECT_MODEL_ERROR(model::read_config(hf_dir_with("partial", {{"partial_rotary_factor", 0.5}})),
                     model::errc::unsupported, "partial_rotary_factor");
  c = model::read_config(hf_dir_with("silu", {{"hidden_act", "silu"}, {"mlp_bias", false}}));
  EXPECT_EQ(c.dim, 64);
  // Mistral v0.1's window: windowed attention on every layer, at any length.
  c = model::read_config(hf_dir_with("window", {{"sliding_window", 4096}}));
  EXPECT_EQ(c.max_seq_len, 32768);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_TRUE(c.is_local(0));
  c = model::read_config(hf_dir_with("nowindow", {{"sliding_window", nullptr}}));
  EXPECT_EQ(c.max_seq_len, 32768);
  // Qwen2: the window applies only with use_sliding_window, to layers from
  // max_window_layers on; held to it when any layer uses it.
  const json qwen = {{"model_type", "qwen2"}, {"sliding_window", 4096}, {"num_hidden_layers", 4}};
  auto with = [&](const std::string& name, json extra) {
    for (auto& [k, v] : qwen.items())
      if (!extra.contains(k))
        extra[k] = v;
    return model::read_config(hf_dir_with(name, extra));
  };
  EXPECT_EQ(with("q_off", {{"use_sliding_window", false}}).max_seq_len, 32768) << "Qwen2.5's shipped configs";
  EXPECT_EQ(with("q_on", {{"use_sliding_window", true}, {"max_window_layers", 2}}).max_seq_len, 4096);
  EXPECT_EQ(with("q_none", {{"use_sliding_window", true}, {"max_window_layers", 4}}).max_seq_len, 32768)
    << "no layer reaches max_window_layers";
  EXPECT_MODEL_ERROR(with("q_nosize", {{"use_sliding_window", true}, {"max_window_layers", 0}, {"sliding_window", nullptr}}),
                     model::errc::bad_config, "sliding_window");
}

// GGUF: llama.cpp stores llama3 scaling as a factor per frequency
// (rope_freqs.weight). Factors of 2 everywhere are linear scaling by 2: the two
// files must give the same logits; a sliding window in the metadata makes
// every layer local (windowed attention) without shortening the context.
TEST(Rope, GgufFrequencyFactorsEqualLinearScaling) {
  constexpr int64_t D = 64, H = 128, V = 300, NH = 4, NKV = 2, HD = D / NH;
  auto write = [&](const std::string& name, bool freqs, bool linear) {
    test::GgufWriter w;
    w.kv_string("general.architecture", "llama");
    w.kv_u32("llama.embedding_length", D);
    w.kv_u32("llama.feed_forward_length", H);
    w.kv_u32("llama.block_count", 1);
    w.kv_u32("llama.attention.head_count", NH);
    w.kv_u32("llama.attention.head_count_kv", NKV);
    w.kv_u32("llama.context_length", 64);
    w.kv_u32("llama.attention.sliding_window", 32);
    if (linear) {
      w.kv_string("llama.rope.scaling.type", "linear");
      w.kv_f32("llama.rope.scaling.factor", 2.0f);
    }
    std::mt19937 rng(9);
    std::normal_distribution<float> nd(0.f, 0.2f);
    auto rnd = [&](std::size_t n, float center = 0.f) {
      std::vector<float> v(n);
      for (auto& x : v)
        x = center + nd(rng);
      return v;
    };
    w.tensor_f32("token_embd.weight", {D, V}, rnd(V * D));
    w.tensor_f32("blk.0.attn_norm.weight", {D}, rnd(D, 1.f));
    w.tensor_f32("blk.0.attn_q.weight", {D, D}, rnd(D * D));
    w.tensor_f32("blk.0.attn_k.weight", {D, NKV * HD}, rnd(NKV * HD * D));
    w.tensor_f32("blk.0.attn_v.weight", {D, NKV * HD}, rnd(NKV * HD * D));
    w.tensor_f32("blk.0.attn_output.weight", {D, D}, rnd(D * D));
    w.tensor_f32("blk.0.ffn_norm.weight", {D}, rnd(D, 1.f));
    w.tensor_f32("blk.0.ffn_gate.weight", {D, H}, rnd(H * D));
    w.tensor_f32("blk.0.ffn_up.weight", {D, H}, rnd(H * D));
    w.tensor_f32("blk.0.ffn_down.weight", {H, D}, rnd(D * H));
    w.tensor_f32("output_norm.weight", {D}, rnd(D, 1.f));
    if (freqs)
      w.tensor_f32("rope_freqs.weight", {HD / 2}, std::vector<float>(HD / 2, 2.0f));
    auto dir = test::scratch_dir("rope_gguf_" + name);
    test::write_file(dir / "m.gguf", w.bytes());
    return (dir / "m.gguf").string();
  };
  auto plain = model::Shard::load(write("plain", false, false));
  auto freqs = model::Shard::load(write("freqs", true, false));
  auto linear = model::Shard::load(write("linear", false, true));
  EXPECT_EQ(freqs->config().max_seq_len, 64) << "a window does not shorten the context";
  EXPECT_EQ(freqs->config().sliding_window, 32);
  EXPECT_TRUE(freqs->config().is_local(0));
  std::vector<int32_t> tok{1, 7, 9, 11, 200, 3};
  auto pos = model::consecutive_positions(0, 6);
  auto c1 = plain->new_cache(), c2 = freqs->new_cache(), c3 = linear->new_cache();
  const auto a = plain->forward(tok, pos, c1).logits;
  const auto b = freqs->forward(tok, pos, c2).logits;
  const auto l = linear->forward(tok, pos, c3).logits;
  EXPECT_EQ(b, l) << "factors of 2 per frequency == linear scaling by 2";
  EXPECT_NE(a, b) << "the scaling must change something";
  auto c4 = freqs->new_cache();
  std::vector<int32_t> many(65, 5);
  EXPECT_NO_THROW(freqs->forward(std::vector<int32_t>(many.begin(), many.begin() + 40),
                                 model::consecutive_positions(0, 40), c4))
      << "past the window, below the context";
  auto c5 = freqs->new_cache();
  EXPECT_MODEL_ERROR(freqs->forward(many, model::consecutive_positions(0, 65), c5), model::errc::context_overflow, "64");
}

} // namespace
} // namespace strata
