// Sharding invariance: prefill + cached decode through shards in order emits
// the ids of the unsharded model, and the logits stay within 1e-4 of a
// stateless recomputation of the whole prefix at every step.

#include "model/transformer/sampler.hpp"
#include "model/transformer/shard.hpp"
#include "runtime/generator.hpp"
#include "tests/support.hpp"

#include <cmath>

namespace strata {
namespace {

struct SplitCase {
  std::string model; // "stories" or a builtin spec
  std::string split;
};

void PrintTo(const SplitCase& c, std::ostream* os) {
  *os << c.model << " split " << c.split;
}

std::string model_path(const std::string& m) {
  return m == "stories" ? test::shared_path("models/stories260K.bin") : m;
}

class ShardingInvariance : public ::testing::TestWithParam<SplitCase> {
protected:
  void SetUp() override {
    if (GetParam().model == "stories" && !test::have_shared("models/stories260K.bin"))
      GTEST_SKIP() << "test data " << test::shared_path("models/stories260K.bin") << " is absent; skipping";
    const auto path = model_path(GetParam().model);
    sharded = std::make_unique<runtime::LocalPipeline>(path, model::parse_layer_ranges(GetParam().split));
    whole = std::make_unique<runtime::LocalPipeline>(path);
  }
  std::unique_ptr<runtime::LocalPipeline> sharded, whole;
};

TEST_P(ShardingInvariance, CachedShardedEqualsStatelessWhole) {
  ASSERT_EQ(sharded->size(), model::parse_layer_ranges(GetParam().split).size());

  std::vector<int32_t> seq = {1, 200, 201, 202};
  auto caches = sharded->new_caches();
  std::vector<float> logits = sharded->step(seq, caches);
  double worst = 0;
  for (int step = 0; step < 48; ++step) {
    // Stateless reference: the whole prefix through the unsharded model.
    auto fresh = whole->new_caches();
    const std::vector<float> ref = whole->step(seq, fresh);
    ASSERT_EQ(logits.size(), ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::abs(logits[i] - ref[i])));
    const int32_t next = model::Sampler::argmax(logits);
    ASSERT_EQ(next, model::Sampler::argmax(ref)) << "step " << step;
    seq.push_back(next);
    for (auto& c : caches)
      ASSERT_EQ(c.seq_len(), static_cast<int64_t>(seq.size()) - 1);
    logits = sharded->step(std::span<const int32_t>(&seq.back(), 1), caches);
  }
  EXPECT_LE(worst, 1e-4) << "largest logit difference over 48 steps";
  RecordProperty("max_logit_diff", std::to_string(worst));
  std::printf("max |logit difference| over 48 steps: %.3g\n", worst);
}

TEST_P(ShardingInvariance, GreedyIdsEqualUnsharded) {
  runtime::GenerateRequest req;
  req.prompt_ids = {1, 100, 110, 120};
  req.max_tokens = 100;
  const auto a = runtime::generate(*sharded, req);
  const auto b = runtime::generate(*whole, req);
  const auto c = runtime::generate_stateless(*whole, req);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.ids, c.ids);
  EXPECT_FALSE(a.ids.empty());
}

INSTANTIATE_TEST_SUITE_P(Splits, ShardingInvariance,
                         ::testing::Values(SplitCase{"stories", "0-4"}, SplitCase{"stories", "0-1,2-3,4"},
                                           SplitCase{"stories", "0,1-4"}, SplitCase{"stories", "0,1,2,3,4"},
                                           SplitCase{"builtin:tiny", "0-4"}, SplitCase{"builtin:tiny", "0-1,2-3,4"},
                                           SplitCase{"builtin:tiny", "0,1-4"}, SplitCase{"builtin:tiny", "0-3,4"}),
                         [](const auto& info) {
                           std::string n = info.param.model == "stories" ? "Stories" : "Tiny";
                           for (char ch : info.param.split)
                             n += ch == '-' ? std::string("to") : ch == ',' ? std::string("_") : std::string(1, ch);
                           return n;
                         });

TEST(Sharding, MultiTokenAppendEqualsOneByOne) {
  // A multi-token step onto a non-empty cache (chunked prefill) gives the same
  // logits as feeding the same tokens one at a time.
  runtime::LocalPipeline a("builtin:tiny", model::parse_layer_ranges("0-1,2-4"));
  auto c1 = a.new_caches(), c2 = a.new_caches();
  std::vector<int32_t> first = {1, 10, 20}, rest = {30, 40, 50, 60};
  a.step(first, c1);
  const auto chunked = a.step(rest, c1);
  a.step(first, c2);
  std::vector<float> one;
  for (auto t : rest)
    one = a.step(std::span<const int32_t>(&t, 1), c2);
  ASSERT_EQ(chunked.size(), one.size());
  for (std::size_t i = 0; i < one.size(); ++i)
    EXPECT_NEAR(chunked[i], one[i], 1e-4);
}

} // namespace
} // namespace strata
