// GGUF files written by the test (no ../shared data): a small llama model in
// f32 and q8_0 that loads and runs, its metadata, the gpt2 tokenizer path, and
// every kind of lying or unsupported file as a typed error naming what is wrong.

#include "model/base/error.hpp"
#include "model/formats/gguf.hpp"
#include "model/formats/quant.hpp"
#include "model/transformer/shard.hpp"
#include "model/text/tokenizer.hpp"
#include "tests/model/gguf_writer.hpp"
#include "tests/support.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

namespace strata {
namespace {

using model::errc;

constexpr int64_t D = 64, H = 128, V = 300, L = 2, NH = 4, NKV = 2, HD = D / NH;

std::vector<float> rnd(std::size_t n, uint32_t seed, float scale, float center = 0.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(center, scale);
  std::vector<float> v(n);
  for (auto& x : v)
    x = d(rng);
  return v;
}

std::string as_bytes(const std::vector<float>& v, model::WType t) {
  std::string b(model::row_bytes(t, static_cast<int64_t>(v.size())), '\0');
  model::quantize(t, v.data(), reinterpret_cast<uint8_t*>(b.data()), static_cast<int64_t>(v.size()));
  return b;
}

uint32_t ggml_id(model::WType t) {
  return t == model::WType::f32 ? 0 : t == model::WType::f16 ? 1 : t == model::WType::q8_0 ? 8 : 2;
}

struct Lies {
  std::string arch = "llama";
  uint32_t version = 3;
  uint32_t wq_type = 99; // 99: the file's type
  int64_t offset_lie = 0;
  bool drop_norm = false;
  uint64_t wrong_rows = 0;
};

test::GgufWriter model_writer(model::WType t, const Lies& lies = {}) {
  test::GgufWriter w;
  w.version = lies.version;
  w.kv_string("general.architecture", lies.arch);
  const std::string a = lies.arch + ".";
  w.kv_u32(a + "embedding_length", D);
  w.kv_u32(a + "feed_forward_length", H);
  w.kv_u32(a + "block_count", L);
  w.kv_u32(a + "attention.head_count", NH);
  w.kv_u32(a + "attention.head_count_kv", NKV);
  w.kv_u32(a + "context_length", 64);
  w.kv_f32(a + "attention.layer_norm_rms_epsilon", 1e-5f);
  w.kv_u32("general.file_type", t == model::WType::f32 ? 0 : 7);
  w.kv_u32("tokenizer.ggml.bos_token_id", 1);
  w.kv_u32("tokenizer.ggml.eos_token_id", 2);
  auto mat = [&](const std::string& name, uint64_t rows, uint64_t cols, uint32_t seed, int64_t lie = 0,
                 uint32_t type_override = 99) {
    auto v = rnd(rows * cols, seed, 1.0f / std::sqrt(static_cast<float>(cols)));
    const uint32_t id = type_override == 99 ? ggml_id(t) : type_override;
    // An unknown type id keeps the file's bytes: only the type is the lie.
    w.tensor(name, {cols, rows}, id, as_bytes(v, t), lie);
  };
  w.tensor_f32("token_embd.weight", {D, V}, rnd(V * D, 1, 1.f));
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    w.tensor_f32(p + "attn_norm.weight", {D}, rnd(D, 10 + l, 0.1f, 1.f));
    mat(p + "attn_q.weight", D, D, 20 + l, 0, l == 1 ? lies.wq_type : 99);
    mat(p + "attn_k.weight", NKV * HD + (l == 1 ? lies.wrong_rows : 0), D, 30 + l);
    mat(p + "attn_v.weight", NKV * HD, D, 40 + l);
    mat(p + "attn_output.weight", D, D, 50 + l);
    w.tensor_f32(p + "ffn_norm.weight", {D}, rnd(D, 60 + l, 0.1f, 1.f));
    mat(p + "ffn_gate.weight", H, D, 70 + l);
    mat(p + "ffn_up.weight", H, D, 80 + l);
    mat(p + "ffn_down.weight", D, H, 90 + l);
  }
  if (!lies.drop_norm)
    w.tensor_f32("output_norm.weight", {D}, rnd(D, 100, 0.1f, 1.f));
  mat("output.weight", V, D, 101, lies.offset_lie);
  return w;
}

std::string write_model(const std::string& name, model::WType t, const Lies& lies = {}) {
  auto dir = test::scratch_dir("gguf_" + name);
  const auto path = (dir / (name + ".gguf")).string();
  test::write_file(path, model_writer(t, lies).bytes());
  return path;
}

std::vector<int32_t> greedy(model::Shard& s, int n) {
  auto cache = s.new_cache();
  std::vector<int32_t> tok{1, 17, 42};
  auto out = s.forward(tok, model::consecutive_positions(0, 3), cache);
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) {
    ids.push_back(static_cast<int32_t>(std::max_element(out.logits.begin(), out.logits.end()) - out.logits.begin()));
    const std::vector<int32_t> one{ids.back()};
    out = s.forward(one, model::consecutive_positions(cache.seq_len(), 1), cache);
  }
  return ids;
}

TEST(Gguf, SmallModelLoadsInItsTypesAndRunsSharded) {
  for (auto t : {model::WType::f32, model::WType::q8_0}) {
    const auto path = write_model(std::string("small_") + model::to_string(t), t);
    auto whole = model::Shard::load(path);
    const auto& c = whole->config();
    EXPECT_EQ(c.dim, D);
    EXPECT_EQ(c.n_kv_heads, NKV);
    EXPECT_EQ(c.vocab_size, V);
    EXPECT_FALSE(c.tied_embeddings);
    EXPECT_EQ(c.dtype, t == model::WType::f32 ? "gguf:f32" : "gguf:q8_0");
    EXPECT_EQ(c.eos_ids, std::vector<int32_t>{2});
    // A route of two shards gives the whole model's ids.
    auto head = model::Shard::load(path, {0, 0});
    auto tail = model::Shard::load(path, {1, 1});
    auto hc = head->new_cache(), tc = tail->new_cache();
    std::vector<int32_t> tok{1, 17, 42};
    auto pos = model::consecutive_positions(0, 3);
    auto h = head->forward(tok, pos, hc);
    auto out = tail->forward(h.hidden, pos, tc);
    auto wc = whole->new_cache();
    EXPECT_EQ(out.logits, whole->forward(tok, pos, wc).logits);
    EXPECT_LT(head->weight_bytes() + tail->weight_bytes(), whole->weight_bytes() + 2 * V * D * 4);
    // --dtype cannot convert a GGUF file.
    model::LoadOptions o;
    o.dtype = "q4_0";
    EXPECT_MODEL_ERROR(model::Shard::load(path, o), errc::bad_argument, "GGUF");
  }
  // q8_0 weights stay close to f32's: the first greedy ids agree.
  auto f = model::Shard::load(write_model("small_f32", model::WType::f32));
  auto q = model::Shard::load(write_model("small_q8_0", model::WType::q8_0));
  EXPECT_LT(q->weight_bytes(), f->weight_bytes());
}

TEST(Gguf, LyingAndUnsupportedFilesAreTypedErrors) {
  using model::WType;
  const auto good = model_writer(WType::f32).bytes();
  auto dir = test::scratch_dir("gguf_bad");
  auto file = [&](const std::string& name, const std::string& bytes) {
    const auto p = (dir / name).string();
    test::write_file(p, bytes);
    return p;
  };
  // A model file with one lie.
  auto lied = [](const std::string& name, auto set) {
    Lies l;
    set(l);
    return write_model(name, WType::f32, l);
  };
  // Truncated: inside the tensor directory, inside the data.
  EXPECT_MODEL_ERROR(model::Shard::load(file("cut1.gguf", good.substr(0, 2000))), errc::corrupt, "cut1.gguf");
  EXPECT_MODEL_ERROR(model::Shard::load(file("cut2.gguf", good.substr(0, good.size() - 4096))), errc::corrupt,
                     "beyond the end of the file");
  // Lying offset of the last tensor (past the end; misaligned).
  EXPECT_MODEL_ERROR(model::Shard::load(lied("far", [](Lies& l) { l.offset_lie = 1 << 20; })), errc::corrupt, "output.weight");
  EXPECT_MODEL_ERROR(model::Shard::load(lied("odd", [](Lies& l) { l.offset_lie = 4; })), errc::corrupt, "not aligned");
  // A tensor of a type strata does not implement (q5_K), and an unknown id.
  EXPECT_MODEL_ERROR(model::Shard::load(lied("q5k", [](Lies& l) { l.wq_type = 13; })), errc::corrupt, "blk.1.attn_q.weight");
  // q8_1 (llama.cpp's activation type, never a weight): 32-value blocks of 36
  // bytes; our f32 bytes are more than enough.
  EXPECT_MODEL_ERROR(model::Shard::load(lied("q81", [](Lies& l) { l.wq_type = 9; })), errc::unsupported, "q8_1");
  EXPECT_MODEL_ERROR(model::Shard::load(lied("t77", [](Lies& l) { l.wq_type = 77; })), errc::unsupported, "type 77");
  // A tensor whose shape does not fit the model; a missing one.
  EXPECT_MODEL_ERROR(model::Shard::load(lied("rows", [](Lies& l) { l.wrong_rows = 16; })), errc::corrupt, "blk.1.attn_k.weight");
  EXPECT_MODEL_ERROR(model::Shard::load(lied("nonorm", [](Lies& l) { l.drop_norm = true; })), errc::missing_tensor,
                     "output_norm.weight");
  // Architecture and version.
  EXPECT_MODEL_ERROR(model::Shard::load(lied("arch", [](Lies& l) { l.arch = "gptneox"; })), errc::unsupported, "gptneox");
  EXPECT_MODEL_ERROR(model::Shard::load(lied("v1", [](Lies& l) { l.version = 1; })), errc::unsupported, "version 1");
  // Lying string length and array count in the metadata (raw little-endian key/value bytes).
  auto le = [](auto v) { return std::string(reinterpret_cast<const char*>(&v), sizeof v); };
  auto lying_meta = [&](const std::string& name, const std::string& key, const std::string& rest) {
    test::GgufWriter w;
    w.raw_meta(le(uint64_t{key.size()}) + key + rest, 1);
    return file(name, w.bytes());
  };
  EXPECT_MODEL_ERROR(model::Shard::load(lying_meta("strlen.gguf", "general.name",
                                                   le(uint32_t{8}) + le(uint64_t{1} << 40) + "short")),
                     errc::corrupt, "general.name");
  EXPECT_MODEL_ERROR(model::Shard::load(lying_meta("count.gguf", "tokenizer.ggml.scores",
                                                   le(uint32_t{9}) + le(uint32_t{6}) + le(uint64_t{1} << 50))),
                     errc::corrupt, "tokenizer.ggml.scores");
  // Wrong metadata types and missing keys name the key.
  {
    test::GgufWriter w;
    w.kv_u32("general.architecture", 5);
    EXPECT_MODEL_ERROR(model::Shard::load(file("archtype.gguf", w.bytes())), errc::bad_config, "general.architecture");
  }
  // A .gguf file without the magic is never read as a llama2.c checkpoint.
  EXPECT_MODEL_ERROR(model::Shard::load(file("plain.gguf", std::string(4096, '\x01'))), errc::bad_format, "GGUF");
  // A file with no tokenizer says so when asked for one.
  EXPECT_MODEL_ERROR(model::Tokenizer::load(write_model("notok", WType::f32)), errc::bad_config, "tokenizer.ggml.model");
}

TEST(Gguf, Gpt2TokenizerFromMetadata) {
  // A byte-level BPE vocabulary: the 256 byte characters, two merges, a control token.
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  auto byte_char = [](int b) {
    int n = 0;
    for (int x = 0; x < b; ++x)
      if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF)))
        ++n;
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n);
    std::string s;
    if (cp < 0x80)
      s += static_cast<char>(cp);
    else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    return s;
  };
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(byte_char(b));
    types.push_back(1);
  }
  tokens.push_back("he");
  types.push_back(1);
  tokens.push_back("hel");
  types.push_back(1);
  tokens.push_back("<|end|>");
  types.push_back(3);
  test::GgufWriter w;
  w.kv_string("tokenizer.ggml.model", "gpt2");
  w.kv_string("tokenizer.ggml.pre", "qwen2");
  w.kv_strings("tokenizer.ggml.tokens", tokens);
  w.kv_i32s("tokenizer.ggml.token_type", types);
  w.kv_strings("tokenizer.ggml.merges", {"h e", "he l"});
  auto dir = test::scratch_dir("gguf_gpt2");
  const auto path = (dir / "tok.gguf").string();
  test::write_file(path, w.bytes());
  auto tok = model::Tokenizer::load(path);
  EXPECT_EQ(tok->kind(), "hf-bpe");
  const auto ids = tok->encode("hello<|end|>", false);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 257); // "hel"
  EXPECT_EQ(ids.back(), 258);  // the control token, whole
  EXPECT_EQ(tok->decode(ids).substr(0, 5), "hello");
  // An unknown pre-tokenizer is refused by name.
  test::GgufWriter w2;
  w2.kv_string("tokenizer.ggml.model", "gpt2");
  w2.kv_string("tokenizer.ggml.pre", "made-up");
  w2.kv_strings("tokenizer.ggml.tokens", tokens);
  w2.kv_strings("tokenizer.ggml.merges", {"h e"});
  test::write_file(dir / "tok2.gguf", w2.bytes());
  EXPECT_MODEL_ERROR(model::Tokenizer::load((dir / "tok2.gguf").string()), errc::unsupported, "made-up");
}

} // namespace
} // namespace strata

namespace strata {
namespace {

// --dtype converts llama2.c / HF / builtin weights at load: memory shrinks by
// the type's size, the recipe names it, and the model still says the same
// first tokens (builtin:tiny: 64 columns become q8_0 / q4_0 blocks, the 176
// columns of w2 stay f16).
TEST(Dtype, ConversionAtLoadShrinksWeightsAndKeepsTheTokens) {
  auto f32 = model::Shard::load("builtin:tiny");
  EXPECT_EQ(f32->config().dtype, "f32");
  const auto ref = greedy(*f32, 4);
  double prev = static_cast<double>(f32->weight_bytes());
  for (const char* dt : {"bf16", "q8_0", "q4_0"}) {
    model::LoadOptions o;
    o.dtype = dt;
    auto s = model::Shard::load("builtin:tiny", o);
    EXPECT_EQ(s->config().dtype, dt);
    EXPECT_LT(static_cast<double>(s->weight_bytes()), prev) << dt;
    prev = static_cast<double>(s->weight_bytes());
    const auto ids = greedy(*s, 4);
    EXPECT_EQ(ids[0], ref[0]) << dt;
    // A shard of a converted model equals the whole converted model.
    auto head = model::Shard::load("builtin:tiny", {0, 1}, o);
    auto tail = model::Shard::load("builtin:tiny", {2, 4}, o);
    auto hc = head->new_cache(), tc = tail->new_cache(), wc = s->new_cache();
    std::vector<int32_t> tok{1, 50, 60};
    auto pos = model::consecutive_positions(0, 3);
    auto h = head->forward(tok, pos, hc);
    EXPECT_EQ(tail->forward(h.hidden, pos, tc).logits, s->forward(tok, pos, wc).logits) << dt;
  }
  EXPECT_LT(prev, static_cast<double>(f32->weight_bytes()) / 4);
  // q4_K: tiny's 64 / 176 columns are no multiple of 256: q8_0 / f16 stand in.
  model::LoadOptions k;
  k.dtype = "q4_k";
  auto s = model::Shard::load("builtin:tiny", k);
  EXPECT_EQ(s->config().dtype, "q4_K");
  EXPECT_EQ(greedy(*s, 1)[0], ref[0]);
  model::LoadOptions bad;
  bad.dtype = "q5_K";
  EXPECT_MODEL_ERROR(model::Shard::load("builtin:tiny", bad), errc::bad_argument, "q5_K");
}

} // namespace
} // namespace strata

namespace strata {
namespace {

// Bytes of `path` this process has mapped (from /proc/self/maps).
std::size_t mapped_bytes_of(const std::string& path) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  std::size_t total = 0;
  while (std::getline(maps, line)) {
    if (line.size() < path.size() || line.compare(line.size() - path.size(), path.size(), path) != 0)
      continue;
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) == 2)
      total += hi - lo;
  }
  return total;
}

// A shard maps its own tensors only: the head's maps stay well below the file,
// the whole model's come close to it, and nothing stays mapped afterwards.
TEST(Gguf, AShardMapsOnlyItsOwnTensors) {
  const auto path = std::filesystem::canonical(write_model("maps", model::WType::f32)).string();
  const auto file = std::filesystem::file_size(path);
  {
    auto head = model::Shard::load(path, {0, 0});
    const auto head_bytes = mapped_bytes_of(path);
    EXPECT_GT(head_bytes, 0u);
    // The head holds the embedding and layer 0: not layer 1, the norm or the classifier.
    EXPECT_LT(head_bytes, file * 6 / 10) << head_bytes << " of " << file;
    auto whole = model::Shard::load(path);
    EXPECT_GT(mapped_bytes_of(path), file * 9 / 10);
  }
  EXPECT_EQ(mapped_bytes_of(path), 0u);
}

} // namespace
} // namespace strata
