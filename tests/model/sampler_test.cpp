#include "model/base/error.hpp"
#include "model/transformer/sampler.hpp"
#include "tests/support.hpp"

#include <cmath>
#include <limits>
#include <map>
#include <random>

namespace strata {
namespace {

TEST(Sampler, GreedyTakesTheFirstMaximum) {
  model::Sampler s({});
  std::vector<float> l = {0.1f, 3.0f, -1.0f, 3.0f};
  EXPECT_EQ(s.sample(l), 1);
}

// argmax passes over blocks of 16 that cannot hold a new maximum: it must
// still give the index the plain scan gives (the first one that exceeds all
// before it; never a NaN; index 0 when it is a NaN), at every length and with
// ties, NaNs and infinities anywhere, blocks straddled included.
TEST(Sampler, ArgmaxIsThePlainScansIndexWithTiesNaNsAndInfinities) {
  auto plain = [](const std::vector<float>& v) {
    int32_t best = 0;
    for (std::size_t i = 1; i < v.size(); ++i)
      if (v[i] > v[static_cast<std::size_t>(best)])
        best = static_cast<int32_t>(i);
    return best;
  };
  std::mt19937 rng(7);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (int trial = 0; trial < 3000; ++trial) {
    const std::size_t n = 1 + rng() % 200;
    std::vector<float> v(n);
    for (auto& x : v) // few distinct values: many ties
      x = static_cast<float>(static_cast<int>(rng() % 9) - 4);
    const int specials = static_cast<int>(rng() % 4);
    for (int k = 0; k < specials; ++k) {
      const float pick[] = {nan, inf, -inf, 100.0f};
      v[rng() % n] = pick[rng() % 4];
    }
    if (trial % 10 == 0)
      v[0] = nan;
    if (trial % 37 == 0)
      std::fill(v.begin(), v.end(), -inf);
    ASSERT_EQ(model::Sampler::argmax(v), plain(v)) << "trial " << trial << ", " << n << " logits";
  }
  EXPECT_EQ(model::Sampler::argmax(std::vector<float>(151936, 0.5f)), 0);
  std::vector<float> big(151936, 0.0f);
  big[151935] = 1.0f;
  EXPECT_EQ(model::Sampler::argmax(big), 151935);
}

TEST(Sampler, MinPDropsTokensLessLikelyThanItsShareOfTheBest) {
  // Relative probabilities 1 : 0.5 : 0.05 : 0.2 at temperature 1.
  const std::vector<float> l = {0.0f, std::log(0.5f), std::log(0.05f), std::log(0.2f)};
  auto counts = [&](float min_p, uint64_t seed) {
    model::SamplingParams p{1.0f, 0, 1.0f, seed, min_p};
    model::Sampler s(p);
    std::vector<int> n(l.size(), 0);
    for (int i = 0; i < 4000; ++i)
      ++n[static_cast<std::size_t>(s.sample(l))];
    return n;
  };
  const auto off = counts(0.0f, 5);
  EXPECT_GT(off[2], 0) << "without min_p the 0.05 token is drawn sometimes";
  const auto cut = counts(0.1f, 5);
  EXPECT_EQ(cut[2], 0) << "0.05 < 0.1 x 1: never drawn";
  EXPECT_GT(cut[1], 0);
  EXPECT_GT(cut[3], 0);
  // The kept tokens keep their relative weights: 1 : 0.5 : 0.2 of 1.7.
  EXPECT_NEAR(cut[0] / 4000.0, 1.0 / 1.7, 0.03);
  EXPECT_NEAR(cut[1] / 4000.0, 0.5 / 1.7, 0.03);
  const auto only = counts(0.6f, 5);
  EXPECT_EQ(only[0], 4000) << "only the best token is at least 0.6 x the best";
  EXPECT_EQ(counts(0.1f, 5), cut) << "reproducible with the seed";
  EXPECT_THROW(model::Sampler(model::SamplingParams{1.0f, 0, 1.0f, 0, 1.5f}), model::Error);
  EXPECT_THROW(model::Sampler(model::SamplingParams{1.0f, 0, 1.0f, 0, -0.1f}), model::Error);
}

TEST(Sampler, SameSeedSameIds) {
  std::vector<float> l(50);
  for (std::size_t i = 0; i < l.size(); ++i)
    l[i] = static_cast<float>(i % 7) * 0.3f;
  model::SamplingParams p{0.8f, 0, 1.0f, 1234};
  model::Sampler a(p), b(p);
  std::vector<int32_t> x, y;
  for (int i = 0; i < 100; ++i) {
    x.push_back(a.sample(l));
    y.push_back(b.sample(l));
  }
  EXPECT_EQ(x, y);
  p.seed = 99;
  model::Sampler c(p);
  std::vector<int32_t> z;
  for (int i = 0; i < 100; ++i)
    z.push_back(c.sample(l));
  EXPECT_NE(x, z);
}

TEST(Sampler, TopKAndTopPRestrictTheCandidates) {
  std::vector<float> l = {5.0f, 4.9f, 4.8f, 0.0f, -1.0f, 4.7f};
  model::Sampler k({1.0f, 2, 1.0f, 7});
  std::map<int32_t, int> seen;
  for (int i = 0; i < 500; ++i)
    ++seen[k.sample(l)];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen.count(0) && seen.count(1));
  // top_p small enough keeps only the most likely token.
  model::Sampler p({1.0f, 0, 0.01f, 7});
  for (int i = 0; i < 100; ++i)
    EXPECT_EQ(p.sample(l), 0);
  // With temperature and no cut, every token shows up eventually.
  model::Sampler all({5.0f, 0, 1.0f, 3});
  seen.clear();
  for (int i = 0; i < 5000; ++i)
    ++seen[all.sample(l)];
  EXPECT_EQ(seen.size(), l.size());
}

TEST(Sampler, RejectsBadSettings) {
  EXPECT_MODEL_ERROR(model::Sampler({-1.0f, 0, 1.0f, 0}), model::errc::bad_argument, "temperature");
  EXPECT_MODEL_ERROR(model::Sampler({1.0f, -3, 1.0f, 0}), model::errc::bad_argument, "top_k");
  EXPECT_MODEL_ERROR(model::Sampler({1.0f, 0, 0.0f, 0}), model::errc::bad_argument, "top_p");
  EXPECT_MODEL_ERROR(model::Sampler({1.0f, 0, 1.5f, 0}), model::errc::bad_argument, "top_p");
}

TEST(Sampler, PenaltiesFollowOpenAIAndTransformers) {
  std::vector<float> l = {2.0f, -1.0f, 0.5f, 3.0f};
  // id 0 generated twice, id 1 only in the prompt (count 0), id 3 generated once.
  const std::vector<int32_t> ids = {0, 1, 3}, counts = {2, 0, 1};
  model::apply_penalties(l, 0.5f, 0.25f, 2.0f, ids, counts);
  EXPECT_FLOAT_EQ(l[0], 2.0f / 2 - 0.5f - 0.25f * 2); // repetition divides a positive logit, then presence + frequency
  EXPECT_FLOAT_EQ(l[1], -1.0f * 2);                    // a negative one is multiplied; a prompt token gets no presence
  EXPECT_FLOAT_EQ(l[2], 0.5f);                         // untouched
  EXPECT_FLOAT_EQ(l[3], 3.0f / 2 - 0.5f - 0.25f);
  EXPECT_MODEL_ERROR(model::apply_penalties(l, 0, 0, 1, std::vector<int32_t>{9}, std::vector<int32_t>{1}),
                     model::errc::bad_argument, "outside the vocabulary");
  EXPECT_MODEL_ERROR(model::apply_penalties(l, 0, 0, 1, std::vector<int32_t>{1}, std::vector<int32_t>{}),
                     model::errc::bad_argument, "differ in length");
}

TEST(Sampler, LogprobsAreTheLogSoftmaxAndTheTopInOrder) {
  const std::vector<float> l = {1.0f, 3.0f, 3.0f, -2.0f};
  double z = 0;
  for (float x : l)
    z += std::exp(static_cast<double>(x));
  const auto lp = model::token_logprobs(l, 0, 3);
  EXPECT_NEAR(lp.logprob, 1.0 - std::log(z), 1e-6);
  EXPECT_EQ(lp.top_ids, (std::vector<int32_t>{1, 2, 0})); // ties: the lower id first
  EXPECT_NEAR(lp.top_logprobs[0], 3.0 - std::log(z), 1e-6);
  EXPECT_TRUE(model::token_logprobs(l, 3, 0).top_ids.empty());
  EXPECT_MODEL_ERROR(model::token_logprobs(l, 4, 1), model::errc::bad_argument, "outside the logits");
}

} // namespace
} // namespace strata
