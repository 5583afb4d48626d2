#include "runtime/generator.hpp"

#include "model/base/error.hpp"

#include <algorithm>
#include <chrono>

namespace strata::runtime {

using model::Error;
using model::errc;

const char* to_string(FinishReason r) {
  switch (r) {
    case FinishReason::stop: return "stop";
    case FinishReason::length: return "length";
    case FinishReason::context: return "context";
  }
  return "?";
}

GenerationRules GenerationRules::make(const model::ModelConfig& cfg, const GenerateRequest& req) {
  if (req.prompt_ids.empty())
    throw Error(errc::bad_argument, "the prompt is empty: it needs at least one token");
  if (req.max_tokens < 0)
    throw Error(errc::bad_argument, "max_tokens must be >= 0 (got " + std::to_string(req.max_tokens) + ")");
  for (std::size_t i = 0; i < req.prompt_ids.size(); ++i) {
    const auto id = req.prompt_ids[i];
    if (id < 0 || id >= cfg.vocab_size)
      throw Error(errc::token_out_of_range, "prompt token " + std::to_string(id) + " at index " + std::to_string(i) +
                                              " is outside the vocabulary of " + std::to_string(cfg.vocab_size));
  }
  if (static_cast<int64_t>(req.prompt_ids.size()) > cfg.max_seq_len)
    throw Error(errc::context_overflow, "the prompt has " + std::to_string(req.prompt_ids.size()) +
                                          " tokens, more than max_seq_len " + std::to_string(cfg.max_seq_len));
  req.sampling.validate();
  GenerationRules r;
  r.stop_ids = cfg.eos_ids;
  r.max_tokens = req.max_tokens;
  r.max_seq_len = cfg.max_seq_len;
  return r;
}

bool GenerationRules::is_stop(int32_t id) const {
  return std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end();
}

LocalPipeline::LocalPipeline(const std::string& model, const std::vector<model::LayerRange>& ranges,
                             const model::LoadOptions& load) {
  for (auto& r : ranges)
    shards_.push_back(model::Shard::load(model, r, load));
  if (shards_.empty())
    throw Error(errc::bad_argument, "a pipeline needs at least one shard");
  model::check_route_covers(ranges, shards_.front()->config().n_layers);
}

LocalPipeline::LocalPipeline(const std::string& model, const model::LoadOptions& load) {
  shards_.push_back(model::Shard::load(model, load));
}

std::vector<model::KVCache> LocalPipeline::new_caches() const {
  std::vector<model::KVCache> c;
  for (auto& s : shards_)
    c.push_back(s->new_cache());
  return c;
}

std::vector<float> LocalPipeline::step(std::span<const int32_t> tokens, std::vector<model::KVCache>& caches) {
  const auto positions = model::consecutive_positions(caches.front().seq_len(), static_cast<int64_t>(tokens.size()));
  model::ShardOutput out = shards_.front()->forward(tokens, positions, caches.front());
  for (std::size_t i = 1; i < shards_.size(); ++i)
    out = shards_[i]->forward(out.hidden, positions, caches[i]);
  return std::move(out.logits);
}

namespace {

using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

// The shared loop: `forward(tokens_so_far, new_tokens)` returns logits.
template <class Forward>
GenerateResult run_loop(const model::ModelConfig& cfg, const GenerateRequest& req, Forward&& forward,
                        const std::function<void(int32_t)>& on_token) {
  const auto rules = GenerationRules::make(cfg, req);
  model::Sampler sampler(req.sampling);
  GenerateResult res;
  std::vector<int32_t> seq = req.prompt_ids;
  auto t0 = clock_type::now();
  std::vector<float> logits = forward(seq, std::span<const int32_t>(seq));
  res.prefill_ms = ms_since(t0);
  t0 = clock_type::now();
  while (true) {
    if (static_cast<int64_t>(res.ids.size()) >= rules.max_tokens) {
      res.finish = FinishReason::length;
      break;
    }
    const int32_t next = sampler.sample(logits);
    if (rules.is_stop(next)) {
      res.finish = FinishReason::stop;
      break;
    }
    res.ids.push_back(next);
    seq.push_back(next);
    if (on_token)
      on_token(next);
    if (static_cast<int64_t>(res.ids.size()) >= rules.max_tokens) {
      res.finish = FinishReason::length;
      break;
    }
    if (static_cast<int64_t>(seq.size()) >= rules.max_seq_len) {
      res.finish = FinishReason::context;
      break;
    }
    logits = forward(seq, std::span<const int32_t>(&seq.back(), 1));
  }
  res.decode_ms = ms_since(t0);
  return res;
}

} // namespace

GenerateResult generate(LocalPipeline& pipe, const GenerateRequest& req, const std::function<void(int32_t)>& on_token) {
  auto caches = pipe.new_caches();
  return run_loop(
    pipe.config(), req,
    [&](const std::vector<int32_t>&, std::span<const int32_t> fresh) { return pipe.step(fresh, caches); }, on_token);
}

GenerateResult generate_stateless(LocalPipeline& pipe, const GenerateRequest& req) {
  return run_loop(
    pipe.config(), req,
    [&](const std::vector<int32_t>& all, std::span<const int32_t>) {
      auto caches = pipe.new_caches();
      return pipe.step(all, caches);
    },
    {});
}

} // namespace strata::runtime
