// stories260K through strata equals the llama2.c reference outputs.

#include "model/transformer/shard.hpp"
#include "runtime/generator.hpp"
#include "tests/support.hpp"

namespace strata {
namespace {

TEST(Stories260K, GreedyIdsEqualLlama2cReference) {
  STRATA_REQUIRE_SHARED("models/stories260K.bin");
  const auto ref = test::read_json(test::shared_path("models/stories260K.greedy.json"));
  runtime::LocalPipeline pipe(test::shared_path("models/stories260K.bin"));
  ASSERT_GE(ref["cases"].size(), 1u);
  for (const auto& c : ref["cases"]) {
    runtime::GenerateRequest req;
    req.prompt_ids = c["prompt_ids"].get<std::vector<int32_t>>();
    const int64_t steps = c["steps"].get<int64_t>();
    // run.c runs positions 0..steps-1: at most steps - len(prompt) + 1 new tokens.
    req.max_tokens = steps - static_cast<int64_t>(req.prompt_ids.size()) + 1;
    const auto expected = c["expected_generated_ids"].get<std::vector<int32_t>>();
    const auto res = runtime::generate(pipe, req);
    EXPECT_EQ(res.ids, expected) << "prompt of " << req.prompt_ids.size() << " tokens, steps " << steps;
    if (static_cast<int64_t>(expected.size()) < req.max_tokens) {
      EXPECT_EQ(res.finish, runtime::FinishReason::stop) << "the reference stopped on BOS";
    }
  }
}

TEST(Stories260K, ConfigFromHeader) {
  STRATA_REQUIRE_SHARED("models/stories260K.bin");
  auto shard = model::Shard::load(test::shared_path("models/stories260K.bin"));
  const auto& c = shard->config();
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_seq_len, 512);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_EQ(c.rotary, model::RotaryLayout::interleaved);
}

TEST(Stories260K, ShardLoadsOnlyItsLayers) {
  STRATA_REQUIRE_SHARED("models/stories260K.bin");
  const auto path = test::shared_path("models/stories260K.bin");
  auto whole = model::Shard::load(path);
  auto head = model::Shard::load(path, {0, 0});
  auto middle = model::Shard::load(path, {1, 3});
  auto tail = model::Shard::load(path, {4, 4});
  const auto& c = whole->config();
  const std::size_t layer = 4 * (2 * c.dim + c.dim * (c.q_dim() + 2 * c.kv_dim()) + c.dim * c.q_dim() + 3 * c.dim * c.hidden_dim);
  const std::size_t emb = 4 * c.vocab_size * c.dim;
  EXPECT_EQ(head->weight_bytes(), emb + layer);
  EXPECT_EQ(middle->weight_bytes(), 3 * layer);
  EXPECT_EQ(tail->weight_bytes(), layer + 4 * c.dim + emb);
  EXPECT_EQ(whole->weight_bytes(), emb + 5 * layer + 4 * c.dim); // tied: classifier shares the embedding
}

} // namespace
} // namespace strata
