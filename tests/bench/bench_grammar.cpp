// strata_bench grammar: the cost of constrained decoding at the Qwen
// vocabulary (151,936 logits; the tokenizer in ../shared/models). Not a test.
//
// 1. The mask alone: building the vocabulary's trie once, then per token the
//    session's work (the allowed set for the grammar's state, then taking the
//    token) along seeded random walks through a nested schema: the first walk
//    finds states new (cold), later walks meet states the constraint has kept
//    (warm). Plus the tail's share: masking 151,936 logits.
// 2. End to end: builtin:qwen2-0.5b in-process (one shard actor), one session of
//    64 tokens, free and constrained alternately, 3 rounds: ms per token.
// 3. The same in a crowd: 4 sessions at once, free and constrained alternately
//    (total tok/s), each constrained session checked against it alone.

#include "actors/cluster.hpp"
#include "messages/session_id.hpp"
#include "model/text/json_schema.hpp"
#include "model/text/token_mask.hpp"
#include "model/transformer/sampler.hpp"
#include "tests/bench/measure.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <thread>

using namespace strata;
using clk = std::chrono::steady_clock;

namespace {

const char* kSchema = R"({
  "type": "object",
  "properties": {
    "id": {"type": "string", "format": "uuid"},
    "customer": {"type": "object", "properties": {
      "name": {"type": "string"}, "email": {"type": "string", "maxLength": 40},
      "tier": {"enum": ["free", "pro", "enterprise"]}}, "required": ["name", "tier"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {
      "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"},
      "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["sku", "qty", "price"]}},
    "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "paid": {"type": "boolean"}
  },
  "required": ["id", "customer", "items", "paid"]
})";

double pct(std::vector<double> v, double p) {
  if (v.empty())
    return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

} // namespace

int grammar_bench_main(int argc, char** argv) {
  const std::string tok_path = argc > 2 ? argv[2] : "../shared/models/qwen-tokenizer.json";
  if (!std::filesystem::exists(tok_path)) {
    std::fprintf(stderr, "grammar: %s is missing (the Qwen tokenizer in ../shared/models)\n", tok_path.c_str());
    return 2;
  }
  std::printf("# strata_bench grammar (%u hardware threads)\n\n", std::thread::hardware_concurrency());
  auto tok = model::Tokenizer::load(tok_path);
  const int64_t V = 151936; // Qwen2.5's logits (the tokenizer has fewer ids; the rest are never allowed)
  auto t0 = clk::now();
  auto vocab = std::make_shared<model::TokenVocabulary>(*tok, V);
  const double build_ms = bench::ms_between(t0, clk::now());
  const std::string grammar = model::json_schema_grammar(nlohmann::ordered_json::parse(kSchema), "schema");
  t0 = clk::now();
  auto c = vocab->constraint(grammar);
  const double compile_ms = bench::ms_between(t0, clk::now());
  std::printf("vocabulary %lld tokens: trie built in %.0f ms; nested schema compiled in %.1f ms (%zu grammar bytes)\n\n",
              static_cast<long long>(V), build_ms, compile_ms, grammar.size());

  // 1. Random walks: per token, allowed() + accept().
  std::printf("| walk | tokens | mean ms/token | p50 | p99 | max | new states | masks computed |\n|---|---|---|---|---|---|---|---|\n");
  std::mt19937 rng(42);
  for (int w = 0; w < 6; ++w) {
    model::ConstraintMatcher m(c);
    std::vector<double> ms;
    const auto states0 = c->automaton().state_count();
    const auto walks0 = c->walks();
    for (int step = 0; step < 300; ++step) {
      const auto s0 = clk::now();
      auto bits = m.allowed();
      std::vector<int32_t> ids;
      for (std::size_t i = 0; i < bits->size(); ++i)
        for (uint64_t b = (*bits)[i]; b; b &= b - 1)
          ids.push_back(static_cast<int32_t>(i * 64 + static_cast<std::size_t>(__builtin_ctzll(b))));
      if (ids.empty())
        break;
      const int32_t t = ids[std::uniform_int_distribution<std::size_t>(0, ids.size() - 1)(rng)];
      m.accept(t);
      ms.push_back(bench::ms_between(s0, clk::now()));
      if (m.complete() && !m.can_continue())
        break;
    }
    double sum = 0;
    for (double x : ms)
      sum += x;
    std::printf("| %d%s | %zu | %.3f | %.3f | %.3f | %.3f | %zu | %llu |\n", w + 1, w == 0 ? " (cold)" : "", ms.size(),
                ms.empty() ? 0 : sum / static_cast<double>(ms.size()), pct(ms, 0.5), pct(ms, 0.99), pct(ms, 1.0),
                c->automaton().state_count() - states0, static_cast<unsigned long long>(c->walks() - walks0));
  }
  // The tail's share: masking the logits with bits.
  {
    std::vector<float> logits(static_cast<std::size_t>(V), 0.5f);
    model::ConstraintMatcher m(c);
    auto bits = m.allowed();
    const int reps = 200;
    const auto s0 = clk::now();
    for (int i = 0; i < reps; ++i)
      model::apply_allowed(logits, {}, *bits);
    std::printf("\ntail: masking %lld logits with bits: %.3f ms\n", static_cast<long long>(V),
                bench::ms_between(s0, clk::now()) / reps);
  }

  // 2. End to end through a shard actor: free vs constrained, alternating.
  actors::actor_config cfg;
  caf::actor_system sys{cfg};
  actors::ClusterOptions opts;
  opts.session.step_timeout = std::chrono::seconds(600);
  opts.session.vocabulary = vocab;
  actors::LocalCluster cl(sys, "builtin:qwen2-0.5b", model::parse_layer_ranges("0-23"), opts);
  auto run = [&](bool constrained) {
    msg::generation_request r;
    r.session = msg::mint_session_id("bench");
    r.prompt = tok->encode("Write the order as JSON:", false);
    r.max_tokens = 64;
    if (constrained)
      r.grammar = grammar;
    clk::time_point first{};
    auto out = cl.generate(std::move(r), [&](const msg::token_event& ev) {
      if (ev.index == 0)
        first = clk::now();
    });
    if (!out.ok()) {
      std::fprintf(stderr, "grammar: a session failed: %s\n", sys.render(out.error).c_str());
      return std::pair<double, std::size_t>{0, 0};
    }
    const auto n = out.result.ids.size();
    return std::pair<double, std::size_t>{n > 1 ? bench::ms_between(first, clk::now()) / static_cast<double>(n - 1) : 0, n};
  };
  std::printf("\n| round | free ms/token (tokens) | constrained ms/token (tokens) | constrained / free |\n|---|---|---|---|\n");
  run(false); // warm-up
  run(true);
  double free_sum = 0, con_sum = 0;
  for (int round = 0; round < 3; ++round) {
    const auto [f, fn] = run(false);
    const auto [g, gn] = run(true);
    free_sum += f;
    con_sum += g;
    std::printf("| %d | %.2f (%zu) | %.2f (%zu) | %.3f |\n", round + 1, f, fn, g, gn, f > 0 ? g / f : 0);
  }
  std::printf("\nconstrained / free, ms per token: %.3f (means of 3 alternating rounds)\n",
              free_sum > 0 ? con_sum / free_sum : 0);

  // 3. A crowd: 4 sessions at once (different prompts, greedy), free and
  // constrained alternately; total tokens per second, and whether each
  // constrained session's tokens equal the same request alone.
  constexpr int crowd = 4;
  auto request = [&](int i, bool constrained) {
    msg::generation_request r;
    r.session = msg::mint_session_id("bench");
    r.prompt = tok->encode("Write order " + std::to_string(i) + " as JSON:", false);
    r.max_tokens = 48;
    if (constrained)
      r.grammar = grammar;
    return r;
  };
  std::vector<std::vector<int32_t>> alone(crowd);
  for (int i = 0; i < crowd; ++i)
    alone[static_cast<std::size_t>(i)] = cl.generate(request(i, true)).result.ids;
  auto run_crowd = [&](bool constrained, bool* same) {
    std::vector<std::vector<int32_t>> ids(crowd);
    const auto t0 = clk::now();
    std::vector<std::thread> threads;
    for (int i = 0; i < crowd; ++i)
      threads.emplace_back([&, i] { ids[static_cast<std::size_t>(i)] = cl.generate(request(i, constrained)).result.ids; });
    for (auto& t : threads)
      t.join();
    const double ms = bench::ms_between(t0, clk::now());
    std::size_t n = 0;
    for (int i = 0; i < crowd; ++i) {
      n += ids[static_cast<std::size_t>(i)].size();
      if (same && ids[static_cast<std::size_t>(i)] != alone[static_cast<std::size_t>(i)])
        *same = false;
    }
    return std::pair<double, std::size_t>{ms > 0 ? 1000.0 * static_cast<double>(n) / ms : 0, n};
  };
  std::printf("\n| round | %d sessions free tok/s (tokens) | constrained tok/s (tokens) | constrained / free |\n|---|---|---|---|\n",
              crowd);
  bool same = true;
  for (int round = 0; round < 2; ++round) {
    const auto [f, fn] = run_crowd(false, nullptr);
    const auto [g, gn] = run_crowd(true, &same);
    std::printf("| %d | %.1f (%zu) | %.1f (%zu) | %.3f |\n", round + 1, f, fn, g, gn, f > 0 ? g / f : 0);
  }
  std::printf("\nconstrained sessions in the crowd = the same request alone: %s\n", same ? "yes" : "NO");
  return same ? 0 : 1;
}
