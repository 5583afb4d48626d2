// The block pool and the batched forward pass: a sequence decoded in a batch
// with others gets bit-for-bit the logits it gets alone (through one shard and
// through three), a prompt fed in pieces fills the same cache as one prefill, a
// bad sequence fails alone, and the pool's blocks are counted and returned.

#include "model/base/error.hpp"
#include "model/kernels/attention.hpp"
#include "model/kernels/kernels.hpp"
#include "model/transformer/kv_cache.hpp"
#include "model/transformer/sampler.hpp"
#include "model/transformer/shard.hpp"
#include "tests/support.hpp"

#include <algorithm>
#include <cmath>
#include <set>

namespace strata {
namespace {

// A row of an f32 KV cache.
const float* f32(const uint8_t* p) {
  return reinterpret_cast<const float*>(p);
}

using model::KVCache;
using model::SeqStep;
using model::Shard;

std::string stories() {
  return test::shared_path("models/stories260K.bin");
}

int32_t argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

float max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float d = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

// A pipeline of shards that runs a batch of sequences hop by hop.
struct Pipeline {
  std::vector<std::unique_ptr<Shard>> shards;
  Pipeline(const std::string& model, const std::string& split, const model::LoadOptions& load = {}) {
    for (auto r : model::parse_layer_ranges(split))
      shards.push_back(Shard::load(model, r, load));
  }
  std::vector<KVCache> caches() const {
    std::vector<KVCache> c;
    for (auto& s : shards)
      c.push_back(s->new_cache());
    return c;
  }
  // inputs[i] are the token ids of sequence i; caches[i][hop]. Returns logits.
  std::vector<std::vector<float>> run(const std::vector<std::vector<int32_t>>& inputs,
                                      std::vector<std::vector<KVCache>*> caches) {
    const std::size_t n = inputs.size();
    std::vector<std::vector<int64_t>> pos(n);
    for (std::size_t i = 0; i < n; ++i)
      pos[i] = model::consecutive_positions((*caches[i])[0].seq_len(), static_cast<int64_t>(inputs[i].size()));
    std::vector<model::Activation> hidden(n);
    std::vector<std::vector<float>> logits(n);
    for (std::size_t h = 0; h < shards.size(); ++h) {
      std::vector<SeqStep> batch(n);
      for (std::size_t i = 0; i < n; ++i) {
        if (h == 0)
          batch[i].tokens = inputs[i];
        else {
          batch[i].hidden = hidden[i].data.data();
          batch[i].rows = hidden[i].rows;
        }
        batch[i].positions = pos[i];
        batch[i].cache = &(*caches[i])[h];
      }
      auto outs = shards[h]->forward(batch);
      for (std::size_t i = 0; i < n; ++i) {
        EXPECT_FALSE(outs[i].error) << outs[i].error->what();
        if (outs[i].out.has_logits())
          logits[i] = std::move(outs[i].out.logits);
        else
          hidden[i] = std::move(outs[i].out.hidden);
      }
    }
    return logits;
  }
};

std::vector<std::vector<int32_t>> prompts(int32_t vocab) {
  // Lengths around the small-row limit (16) and past it, so both kernels run.
  std::vector<std::vector<int32_t>> p;
  for (int i = 0; i < 8; ++i) {
    std::vector<int32_t> ids{1};
    const int len = 2 + 5 * i; // 3 .. 38 tokens
    for (int j = 0; j < len; ++j)
      ids.push_back(static_cast<int32_t>((7 + 13 * i + 31 * j) % (vocab - 3) + 3));
    p.push_back(ids);
  }
  return p;
}

// Each prompt alone through `p`: prefill, then greedy decode; the logits of
// every step.
std::vector<std::vector<std::vector<float>>> alone_logits(Pipeline& p, const std::vector<std::vector<int32_t>>& ps,
                                                          int steps) {
  std::vector<std::vector<std::vector<float>>> ref(ps.size());
  for (std::size_t i = 0; i < ps.size(); ++i) {
    auto c = p.caches();
    auto lg = p.run({ps[i]}, {&c})[0];
    ref[i].push_back(lg);
    for (int s = 1; s < steps; ++s) {
      lg = p.run({{argmax(lg)}}, {&c})[0];
      ref[i].push_back(lg);
    }
  }
  return ref;
}

// Sequences decoded greedily together in rounds: sequence i runs from round
// join(i) until it has taken `steps` steps; a joining one prefills its prompt
// into fresh caches, the others feed their last step's argmax.
struct Crowd {
  const std::vector<std::vector<int32_t>>& ps;
  int steps;
  std::vector<std::vector<KVCache>> caches = std::vector<std::vector<KVCache>>(ps.size());
  std::vector<int> done = std::vector<int>(ps.size(), 0);
  std::vector<std::vector<float>> last = std::vector<std::vector<float>>(ps.size());

  // One round through `p`: the sequences that ran, and each one's logits.
  template <class Join>
  std::pair<std::vector<std::size_t>, std::vector<std::vector<float>>> round(int r, Join join, Pipeline& p) {
    std::vector<std::size_t> who;
    std::vector<std::vector<int32_t>> inputs;
    std::vector<std::vector<KVCache>*> cs;
    for (std::size_t i = 0; i < ps.size(); ++i) {
      if (join(i) > r || done[i] == steps)
        continue;
      if (done[i] == 0) {
        caches[i] = p.caches();
        inputs.push_back(ps[i]);
      } else {
        inputs.push_back({argmax(last[i])});
      }
      cs.push_back(&caches[i]);
      who.push_back(i);
    }
    if (who.empty())
      return {};
    return {who, p.run(inputs, cs)};
  }
  // Sequence i took its step: `lg` is what it feeds next.
  void took(std::size_t i, std::vector<float> lg) {
    last[i] = std::move(lg);
    ++done[i];
  }
};

// Eight sequences joining at staggered rounds, decoded greedily together; each
// step's logits must equal those of the same sequence run alone. `crowd_on_avx2`:
// the crowd runs the AVX2 builds of the attention and the f32 product, the
// sequences alone the CPU's best (as an AVX2-only node and an AVX-512 one would).
void batched_equals_alone(const std::string& model, const std::string& split, const model::LoadOptions& load = {},
                          bool crowd_on_avx2 = false) {
  Pipeline batched(model, split, load), alone(model, split, load);
  struct Restore {
    ~Restore() {
      model::detail::set_attention_isa(model::detail::AttentionIsa::best);
      model::detail::set_rows_isa_avx2(false);
    }
  } restore;
  const auto vocab = static_cast<int32_t>(batched.shards.back()->config().vocab_size);
  const auto ps = prompts(vocab);
  const std::size_t n = ps.size();
  const int steps = 12;
  // Alone: prefill, then greedy decode; record the logits of every step.
  const auto ref = alone_logits(alone, ps, steps);
  if (crowd_on_avx2) {
    model::detail::set_attention_isa(model::detail::AttentionIsa::avx2);
    ASSERT_TRUE(model::detail::set_rows_isa_avx2(true));
  }
  // Together: sequence i prefills in round i, decodes in every later round.
  Crowd crowd{ps, steps};
  std::size_t max_batch = 0;
  for (int round = 0; round < static_cast<int>(n) + steps; ++round) {
    auto [who, lgs] = crowd.round(round, [](std::size_t i) { return static_cast<int>(i); }, batched);
    max_batch = std::max(max_batch, who.size());
    for (std::size_t k = 0; k < who.size(); ++k) {
      const auto i = who[k];
      const int d = crowd.done[i];
      const auto& want = ref[i][static_cast<std::size_t>(d)];
      EXPECT_LE(max_diff(lgs[k], want), 1e-4f) << "sequence " << i << " step " << d;
      EXPECT_EQ(lgs[k], want) << "sequence " << i << " step " << d << ": not bit-for-bit";
      EXPECT_EQ(argmax(lgs[k]), argmax(want));
      crowd.took(i, std::move(lgs[k]));
    }
  }
  EXPECT_EQ(max_batch, n) << "every sequence should have shared a batch with all the others";
}

// Sequences that end while others decode give their blocks back, and those
// that join later take them lowest first (BlockPool), so a newcomer's blocks lie
// among those of sequences still decoding: each step's logits still equal the
// same sequence's alone, bit for bit, through three shards. Prompts of 40
// tokens and 40 steps cross two block boundaries; sequence i joins at round
// 12 i, so up to four decode at once and the fifth and sixth join after the
// first two have ended.
TEST(Batch, SequencesEndingAndJoiningMidCrowdTakeFreedBlocksAndEqualAlone) {
  Pipeline batched("builtin:tiny", "0-1,2-3,4"), alone("builtin:tiny", "0-1,2-3,4");
  const auto vocab = static_cast<int32_t>(batched.shards.back()->config().vocab_size);
  const std::size_t n = 6;
  const int steps = 40, gap = 12;
  std::vector<std::vector<int32_t>> ps(n);
  for (std::size_t i = 0; i < n; ++i) {
    ps[i].push_back(1);
    for (int j = 0; j < 39; ++j)
      ps[i].push_back(static_cast<int32_t>((11 + 17 * static_cast<int>(i) + 29 * j) % (vocab - 3) + 3));
  }
  const auto ref = alone_logits(alone, ps, steps);
  Crowd crowd{ps, steps};
  std::set<const uint8_t*> freed;  // the first shard's blocks of ended sequences
  std::size_t max_batch = 0, reused = 0;
  for (int round = 0; round < gap * static_cast<int>(n - 1) + steps; ++round) {
    auto [who, lgs] = crowd.round(round, [&](std::size_t i) { return gap * static_cast<int>(i); }, batched);
    max_batch = std::max(max_batch, who.size());
    for (std::size_t k = 0; k < who.size(); ++k) {
      const auto i = who[k];
      const int d = crowd.done[i];
      EXPECT_EQ(lgs[k], ref[i][static_cast<std::size_t>(d)]) << "sequence " << i << " step " << d;
      const auto blocks = crowd.caches[i][0].view().blocks; // (view() is a value)
      if (d == 0)
        for (const uint8_t* b : blocks)
          reused += freed.count(b);
      crowd.took(i, std::move(lgs[k]));
      if (crowd.done[i] == steps) { // the sequence ends: its blocks go back now
        for (const uint8_t* b : blocks)
          freed.insert(b);
        crowd.caches[i].clear();
      }
    }
  }
  EXPECT_EQ(max_batch, 4u);
  EXPECT_GT(reused, 0u) << "a later sequence should have taken blocks an ended one gave back";
}

TEST(Batch, StaggeredSequencesEqualAloneOneShard) {
  batched_equals_alone("builtin:tiny", "0-4");
}

TEST(Batch, StaggeredSequencesEqualAloneThreeShards) {
  batched_equals_alone("builtin:tiny", "0-1,2-3,4");
}

// Multi-head attention (decode steps through attend_heads, one head a pass) in
// a crowd, for every KV type.
void multi_head_crowds_in_every_kv_type() {
  for (const char* kv : {"f32", "bf16", "f16", "q8_0"}) {
    SCOPED_TRACE(kv);
    model::LoadOptions o;
    o.dtype = "q8_0";
    o.kv_dtype = kv;
    batched_equals_alone("builtin:tiny-mha", "0,1-2", o);
  }
}

TEST(Batch, StaggeredMultiHeadSequencesEqualAloneInEveryKvType) {
  multi_head_crowds_in_every_kv_type();
}

// The value pass in runs of one block (value_run_bytes shortened from 128 KB,
// which these short sequences never cross): a crowd still gets, bit for bit,
// what each sequence gets alone, for every KV type.
TEST(Batch, StaggeredSequencesAcrossValueRunsEqualAloneInEveryKvType) {
  struct Restore {
    ~Restore() { model::detail::set_value_run_bytes(model::detail::value_run_bytes_default); }
  } restore;
  model::detail::set_value_run_bytes(1);
  multi_head_crowds_in_every_kv_type();
}

// A crowd on the AVX2 builds gets, bit for bit, what each sequence gets alone
// on this CPU's best ones (f32 weights: the f32 product's builds; every KV type:
// the attention's).
TEST(Batch, StaggeredSequencesOnTheAvx2BuildsEqualAloneOnTheBest) {
  if (!model::detail::attention_avx2_available())
    GTEST_SKIP() << "this CPU lacks AVX2 with FMA and F16C";
  for (const char* kv : {"f32", "bf16", "f16"}) {
    SCOPED_TRACE(kv);
    model::LoadOptions o;
    o.kv_dtype = kv;
    batched_equals_alone("builtin:tiny", "0-1,2-3,4", o, true);
  }
  model::LoadOptions o;
  o.dtype = "q8_0";
  o.kv_dtype = "q8_0";
  batched_equals_alone("builtin:tiny-mha", "0,1-2", o, true);
}

TEST(Batch, StaggeredSequencesEqualAloneStories) {
  STRATA_REQUIRE_SHARED("models/stories260K.bin");
  batched_equals_alone(stories(), "0-4");
  batched_equals_alone(stories(), "0-1,2-3,4");
}

// The fused kernels of quantized and bf16 weights keep the promise too: each
// sequence of a staggered crowd gets bit for bit what it gets alone.
TEST(Batch, StaggeredSequencesEqualAloneInEveryWeightType) {
  for (const char* dt : {"bf16", "q8_0", "q4_0", "q4_K"}) {
    SCOPED_TRACE(dt);
    model::LoadOptions o;
    o.dtype = dt;
    batched_equals_alone("builtin:tiny", "0-1,2-3,4", o);
  }
}

// Packed q8_0 rows of 896 and 4864 values (Qwen2.5-0.5B's widths: pairs of
// full groups, a full group paired with a partial one, a last group alone,
// which the 256-wide files never form): a staggered crowd through the first
// and the last layer of the model as two shards gets what each gets alone.
TEST(Batch, StaggeredSequencesEqualAloneOverPackedPairsOfGroups) {
  model::LoadOptions o;
  o.dtype = "q8_0";
  batched_equals_alone("builtin:qwen2-0.5b", "0,23", o);
}

TEST(Batch, StaggeredSequencesEqualAloneGgufQ4KM) {
  STRATA_REQUIRE_SHARED("models/gguf/rand256-q4_k_m.gguf");
  batched_equals_alone(test::shared_path("models/gguf/rand256-q4_k_m.gguf"), "0,1");
}

// The other packed layouts of llama.cpp-made files (iq4_nl, iq4_xs; Q2_K's mix,
// whose q | k | v stack q2_K with other K types; q5_0, q5_1 and q5_K, their 5th
// bits re-encoded beside their nibbles; q4_1 and q5_1 with their mins; q3_K,
// its 3rd bits re-laid beside its 2-bit values, alone and in Q3_K_M's mix; q6_K,
// its nibbles and high bits re-laid by groups of 16): a
// staggered crowd of sequences gets bit for bit what each gets alone.
TEST(Batch, StaggeredSequencesEqualAloneInThePackedGgufTypes) {
  for (const char* f : {"rand256-iq4_nl", "rand256-iq4_xs", "rand256-q2_k", "rand256-q5_0", "rand256-q4_1",
                        "rand256-q5_1", "rand256-q5_k", "rand256-q3_k", "rand256-q3_k_m", "rand256-q6_k"}) {
    const auto file = "models/gguf/" + std::string(f) + ".gguf";
    STRATA_REQUIRE_SHARED(file);
    SCOPED_TRACE(f);
    batched_equals_alone(test::shared_path(file), "0,1");
  }
}

// Mixtures of experts: each round's rows pick their experts (4 per layer, 2
// per row here), rows of a round share some experts and not others, and each
// expert's matrices are applied to its rows together; a row still gets bit for
// bit what it gets alone, in f32 and in the quantized kernels of the 3-D expert
// tensors. Sliding windows (gemma3, window 16; the sequences run past it, and
// their local blocks before the window go back to the pool) likewise.
TEST(Batch, ExpertsAndWindowsInABatchEqualAlone) {
  for (const char* f : {"qwen3moe-rand-f32", "qwen3moe-rand-q4_k_m", "mixtral-rand-f32", "mixtral-rand-q8_0",
                        "gemma3-rand-f32", "gemma2-rand-q8_0"}) {
    const auto file = "models/gguf/" + std::string(f) + ".gguf";
    STRATA_REQUIRE_SHARED(file);
    SCOPED_TRACE(f);
    const bool three = std::string(f).rfind("gemma3", 0) == 0;
    batched_equals_alone(test::shared_path(file), three ? "0-2" : "0-1");
    batched_equals_alone(test::shared_path(file), three ? "0,1,2" : "0,1");
  }
}

// Many few-row sequences in one round: an expert is chosen by far more than
// small_rows rows of the stacked group, and each row still gets what it gets
// alone (the group goes through the few-row kernel whatever its size).
TEST(Batch, AnExpertChosenByManyRowsOfOneRoundGivesEachRowItsLoneNumbers) {
  for (const char* f : {"qwen3moe-rand-f32", "mixtral-rand-q4_k_m"}) {
    const auto file = "models/gguf/" + std::string(f) + ".gguf";
    STRATA_REQUIRE_SHARED(file);
    SCOPED_TRACE(f);
    Pipeline batched(test::shared_path(file), "0-1"), alone(test::shared_path(file), "0-1");
    std::vector<std::vector<int32_t>> ps;
    for (int i = 0; i < 6; ++i) {
      std::vector<int32_t> p{1};
      for (int j = 0; j < 15; ++j) // 16 rows: each sequence is a few-row one
        p.push_back(static_cast<int32_t>((11 + 37 * i + 7 * j) % 500 + 3));
      ps.push_back(p);
    }
    std::vector<std::vector<KVCache>> bc(ps.size());
    std::vector<std::vector<KVCache>*> cs;
    for (auto& c : bc) {
      c = batched.caches();
      cs.push_back(&c);
    }
    const auto together = batched.run(ps, cs); // 96 rows in one stacked group
    for (std::size_t i = 0; i < ps.size(); ++i) {
      auto c = alone.caches();
      EXPECT_EQ(together[i], alone.run({ps[i]}, {&c})[0]) << "sequence " << i << ": not bit-for-bit";
    }
  }
}

// A prompt fed in pieces (as the shard scheduler does for long prompts) fills
// the same cache and gives the same logits as one prefill, within 1e-4.
TEST(Batch, ChunkedPrefillEqualsOnePrefill) {
  auto s = Shard::load("builtin:tiny");
  std::vector<int32_t> p;
  for (int j = 0; j < 100; ++j)
    p.push_back(static_cast<int32_t>((11 + 37 * j) % 250 + 3));
  auto whole = s->new_cache();
  auto ref = s->forward(p, model::consecutive_positions(0, 100), whole).logits;
  for (int64_t chunk : {7, 16, 32, 64}) {
    auto c = s->new_cache();
    std::vector<float> lg;
    for (int64_t b = 0; b < 100; b += chunk) {
      const int64_t e = std::min<int64_t>(100, b + chunk);
      std::span<const int32_t> piece(p.data() + b, static_cast<std::size_t>(e - b));
      lg = s->forward(piece, model::consecutive_positions(b, e - b), c).logits;
    }
    EXPECT_LE(max_diff(lg, ref), 1e-4f) << "chunk " << chunk;
    ASSERT_EQ(c.seq_len(), whole.seq_len());
    auto a = c.view(), w = whole.view();
    const int64_t heads = s->config().n_kv_heads, hd = s->config().head_dim;
    float d = 0;
    for (int64_t l = 0; l < s->range().count(); ++l)
      for (int64_t pos = 0; pos < 100; ++pos)
        for (int64_t g = 0; g < heads; ++g)
          for (int64_t i = 0; i < hd; ++i) {
            d = std::max(d, std::abs(a.key_value(l, pos, g, i) - w.key_value(l, pos, g, i)));
            d = std::max(d, std::abs(f32(a.v(l, pos, g))[i] - f32(w.v(l, pos, g))[i]));
          }
    EXPECT_LE(d, 1e-4f) << "cache after chunks of " << chunk;
    // And the next decode step agrees.
    const int32_t next = argmax(lg);
    auto l1 = s->forward(std::vector<int32_t>{next}, model::consecutive_positions(100, 1), c).logits;
    auto w2 = s->new_cache();
    s->forward(p, model::consecutive_positions(0, 100), w2);
    auto l2 = s->forward(std::vector<int32_t>{next}, model::consecutive_positions(100, 1), w2).logits;
    EXPECT_LE(max_diff(l1, l2), 1e-4f) << "decode after chunks of " << chunk;
  }
}

// `cached` (a decode step's logits after `tokens`) is bit for bit what a fresh
// cache's prefill of all of `tokens` gives.
void expect_stateless_bits(Shard& s, const std::vector<int32_t>& tokens, const std::vector<float>& cached, int step) {
  auto fresh = s.new_cache();
  const auto stateless =
    s.forward(tokens, model::consecutive_positions(0, static_cast<int64_t>(tokens.size())), fresh).logits;
  ASSERT_EQ(cached.size(), stateless.size());
  for (std::size_t v = 0; v < cached.size(); ++v)
    ASSERT_EQ(__builtin_bit_cast(uint32_t, cached[v]), __builtin_bit_cast(uint32_t, stateless[v]))
      << "step " << step << " logit " << v << ": " << cached[v] << " cached, " << stateless[v] << " stateless";
}

// `model` with q8_0 weights and a KV cache of type `kv`.
std::unique_ptr<Shard> load_q8_0(const std::string& model, const char* kv) {
  model::LoadOptions o;
  o.dtype = "q8_0";
  o.kv_dtype = kv;
  return Shard::load(model, o);
}

// A decode step equals the stateless recomputation of the same position bit
// for bit with multi-head attention (one kv head per query head, as in Llama 2
// and Phi-3-mini; GgufArchitecture.CachedEqualsStateless checks grouped heads),
// for every KV type: the products of q8_0 weights take the same kernel at every
// row count, and a decode step's attention adds every score's products in the
// order a prefill piece does.
// (Decode steps of multi-head models once took a one-query kernel that summed
// in another order: their recoveries, which rebuild caches by prefill, moved
// the logits by float rounding.) 40 steps, past 16 rows, where the stateless
// pass cuts the sequence into groups of 16 rows.
TEST(Batch, CachedDecodeEqualsStatelessBitForBitWithMultiHeadAttention) {
  for (const char* kv : {"f32", "bf16", "f16", "q8_0"}) {
    SCOPED_TRACE(std::string("KV ") + kv);
    auto s = load_q8_0("builtin:tiny-mha", kv);
    ASSERT_EQ(s->config().n_kv_heads, s->config().n_heads);
    std::vector<int32_t> tokens;
    for (int j = 0; j < 9; ++j)
      tokens.push_back(static_cast<int32_t>((5 + 29 * j) % 250 + 3));
    auto cache = s->new_cache();
    auto cached = s->forward(tokens, model::consecutive_positions(0, 9), cache).logits;
    for (int step = 0; step < 40; ++step) {
      ASSERT_NO_FATAL_FAILURE(expect_stateless_bits(*s, tokens, cached, step));
      tokens.push_back(argmax(cached));
      cached = s->forward(std::vector<int32_t>{tokens.back()},
                          model::consecutive_positions(static_cast<int64_t>(tokens.size()) - 1, 1), cache)
                 .logits;
    }
  }
}

// A decode step of a model with one kv head (Gemma 3 1B's multi-query
// attention) is one attention item a layer: past 512 cached rows a round
// spreads it over the threads (its keys' scores, then its output columns), and
// the step still equals the stateless recomputation of its position bit for
// bit, in every KV type, and the same step on one thread: a step's numbers do
// not depend on the threads. The spreads are counted, so the path is known to
// have run.
TEST(Batch, OneKvHeadDecodeSpreadOverThreadsEqualsStatelessBitForBit) {
  struct Restore {
    int threads = model::num_threads();
    ~Restore() { model::set_num_threads(threads); }
  } restore;
  for (const char* kv : {"f32", "bf16", "f16", "q8_0"}) {
    SCOPED_TRACE(std::string("KV ") + kv);
    auto s = load_q8_0("builtin:tiny-mqa", kv);
    ASSERT_EQ(s->config().n_kv_heads, 1);
    std::vector<int32_t> tokens;
    for (int j = 0; j < 700; ++j)
      tokens.push_back(static_cast<int32_t>((5 + 29 * j + j * j) % 250 + 3));
    model::set_num_threads(2);
    auto cache = s->new_cache();
    auto cached = s->forward(tokens, model::consecutive_positions(0, 700), cache).logits;
    auto one = s->new_cache(); // the same steps on one thread
    model::set_num_threads(1);
    auto cached_one = s->forward(tokens, model::consecutive_positions(0, 700), one).logits;
    const uint64_t spreads_before = model::attention_spreads();
    for (int step = 0; step < 12; ++step) {
      ASSERT_EQ(cached, cached_one) << "step " << step << ": two threads and one differ";
      if (step % 4 == 3) {
        ASSERT_NO_FATAL_FAILURE(expect_stateless_bits(*s, tokens, cached, step));
      }
      tokens.push_back(argmax(cached));
      const auto at = model::consecutive_positions(static_cast<int64_t>(tokens.size()) - 1, 1);
      model::set_num_threads(2);
      cached = s->forward(std::vector<int32_t>{tokens.back()}, at, cache).logits;
      model::set_num_threads(1);
      cached_one = s->forward(std::vector<int32_t>{tokens.back()}, at, one).logits;
    }
    // Two layers a step, each spread on two threads (one thread never spreads).
    EXPECT_EQ(model::attention_spreads() - spreads_before, 2u * 12u);
  }
}

// One bad sequence in a batch gets its own typed error and leaves its cache
// untouched; the others run and equal their lone runs.
TEST(Batch, ABadSequenceFailsAloneAndTheOthersRun) {
  auto s = Shard::load("builtin:tiny");
  std::vector<int32_t> good{1, 40, 50, 60}, bad{1, 9999}, late{1, 20};
  auto cg = s->new_cache(), cb = s->new_cache(), cl = s->new_cache();
  s->forward(std::vector<int32_t>{1, 5}, model::consecutive_positions(0, 2), cl);
  auto pg = model::consecutive_positions(0, 4), pb = model::consecutive_positions(0, 2),
       pl = model::consecutive_positions(5, 2); // does not continue cl (2 cached)
  std::vector<SeqStep> batch(3);
  batch[0].tokens = good, batch[0].positions = pg, batch[0].cache = &cg;
  batch[1].tokens = bad, batch[1].positions = pb, batch[1].cache = &cb;
  batch[2].tokens = late, batch[2].positions = pl, batch[2].cache = &cl;
  auto outs = s->forward(batch);
  ASSERT_FALSE(outs[0].error);
  ASSERT_TRUE(outs[1].error);
  EXPECT_EQ(outs[1].error->code(), model::errc::token_out_of_range);
  EXPECT_NE(std::string(outs[1].error->what()).find("9999"), std::string::npos);
  ASSERT_TRUE(outs[2].error);
  EXPECT_EQ(outs[2].error->code(), model::errc::bad_position);
  EXPECT_EQ(cb.seq_len(), 0);
  EXPECT_EQ(cb.blocks(), 0) << "a refused sequence takes no blocks";
  EXPECT_EQ(cl.seq_len(), 2);
  auto alone = s->new_cache();
  EXPECT_EQ(outs[0].out.logits, s->forward(good, pg, alone).logits);
}

TEST(BlockPool, CountsBlocksSharesThemAndTakesThemBack) {
  auto s = Shard::load("builtin:tiny");
  const auto shape = s->cache_shape();
  EXPECT_EQ(shape.n_layers, 5);
  EXPECT_EQ(shape.kv_dim, 16);
  auto pool = s->new_pool(4 * 5 * 2 * model::BlockPool::block_tokens * 16 * sizeof(float));
  EXPECT_EQ(pool->capacity(), 4);
  {
    KVCache a(pool), b(pool);
    EXPECT_TRUE(a.reserve(40)); // 2 blocks
    EXPECT_EQ(pool->in_use(), 2);
    EXPECT_FALSE(b.reserve(100)) << "4 blocks do not fit in the 2 left";
    EXPECT_EQ(b.blocks(), 0) << "all-or-nothing";
    EXPECT_TRUE(b.reserve(64));
    EXPECT_EQ(pool->available(), 0);
    // A forward that needs a block the pool lacks fails, typed, and commits nothing.
    std::vector<int32_t> t(70, 5);
    try {
      s->forward(t, model::consecutive_positions(0, 70), a);
      ADD_FAILURE() << "expected cache_full";
    } catch (const model::Error& e) {
      EXPECT_EQ(e.code(), model::errc::cache_full) << e.what();
    }
    EXPECT_EQ(a.seq_len(), 0);
    // Reference counts: a shared block is freed by its last holder only.
    const int32_t shared = a.table().front();
    pool->retain(shared);
    EXPECT_EQ(pool->refcount(shared), 2);
    a.truncate(0);
    EXPECT_EQ(pool->in_use(), 3);
    pool->release(shared);
    EXPECT_EQ(pool->in_use(), 2);
    b.truncate(33); // keeps 2 blocks
    EXPECT_EQ(b.blocks(), 2);
  }
  EXPECT_EQ(pool->in_use(), 0) << "dropping a cache hands its blocks back";
  EXPECT_LE(pool->allocated_bytes(), 4 * pool->block_bytes());
  // A cache of another shard's pool is refused.
  auto other = Shard::load("builtin:tiny", {0, 1});
  auto foreign = other->new_cache();
  EXPECT_MODEL_ERROR(s->forward(std::vector<int32_t>{1}, model::consecutive_positions(0, 1), foreign),
                     model::errc::bad_argument, "not created by this shard");
}

} // namespace
} // namespace strata
