#include "model/base/error.hpp"
#include "runtime/generator.hpp"
#include "tests/support.hpp"

namespace strata {
namespace {

TEST(Generator, RejectsRequestsThatCannotRun) {
  runtime::LocalPipeline pipe("builtin:tiny");
  runtime::GenerateRequest req;
  EXPECT_MODEL_ERROR(runtime::generate(pipe, req), model::errc::bad_argument, "prompt is empty");
  req.prompt_ids = {1, 259};
  EXPECT_MODEL_ERROR(runtime::generate(pipe, req), model::errc::token_out_of_range, "index 1");
  req.prompt_ids.assign(513, 5);
  EXPECT_MODEL_ERROR(runtime::generate(pipe, req), model::errc::context_overflow, "513");
  req.prompt_ids = {1};
  req.sampling.top_p = 0;
  EXPECT_MODEL_ERROR(runtime::generate(pipe, req), model::errc::bad_argument, "top_p");
}

TEST(Generator, StopsAtContextEnd) {
  runtime::LocalPipeline pipe("builtin:tiny");
  runtime::GenerateRequest req;
  req.prompt_ids.assign(500, 40);
  req.max_tokens = 100;
  const auto res = runtime::generate(pipe, req);
  // Either a stop id came first, or generation ran to max_seq_len = 512.
  if (res.finish == runtime::FinishReason::context)
    EXPECT_EQ(res.ids.size(), 12u);
  else
    EXPECT_EQ(res.finish, runtime::FinishReason::stop);
}

TEST(Generator, SampledRunsRepeatWithTheSameSeed) {
  runtime::LocalPipeline pipe("builtin:tiny", model::parse_layer_ranges("0-2,3-4"));
  runtime::GenerateRequest req;
  req.prompt_ids = {1, 80, 90};
  req.max_tokens = 40;
  req.sampling = {0.9f, 40, 0.95f, 42};
  const auto a = runtime::generate(pipe, req);
  const auto b = runtime::generate(pipe, req);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.ids, runtime::generate_stateless(pipe, req).ids);
  req.sampling.seed = 43;
  EXPECT_NE(a.ids, runtime::generate(pipe, req).ids);
}

TEST(Generator, MaxTokensZeroGeneratesNothing) {
  runtime::LocalPipeline pipe("builtin:tiny");
  runtime::GenerateRequest req;
  req.prompt_ids = {1, 80};
  req.max_tokens = 0;
  const auto res = runtime::generate(pipe, req);
  EXPECT_TRUE(res.ids.empty());
  EXPECT_EQ(res.finish, runtime::FinishReason::length);
}

} // namespace
} // namespace strata
