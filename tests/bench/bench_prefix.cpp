// strata_bench prefix: the prefix cache on builtin:qwen2-0.5b. Not a test.
//
// 16 sessions whose prompts share a 512-token prefix (a system prompt or a
// shared document) and end in 16 tokens of their own arrive at once, after one
// earlier session with the same prefix (the system prompt served before). For
// each: time to first token (from the request to the first streamed token). Run
// with the prefix cache and without, in-process through two shard actors (layers
// 0-11 and 12-23: the second learns block ids from the step), alternating the
// two settings round by round in one run so that the machine's noise hits both.
// Also checks that the ids are identical with and without the cache.

#include "actors/cluster.hpp"
#include "messages/session_id.hpp"
#include "model/transformer/shard.hpp"
#include "tests/bench/measure.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>

using namespace strata;
using clk = std::chrono::steady_clock;

namespace {

const std::string kModel = "builtin:qwen2-0.5b";
constexpr int kSessions = 16;
constexpr int64_t kPrefix = 512, kOwn = 16, kTokens = 4;

std::vector<int32_t> prompt_of(int i) {
  std::vector<int32_t> p;
  for (int64_t j = 0; j < kPrefix; ++j)
    p.push_back(static_cast<int32_t>((1000 + 104729 * j) % 150000));
  for (int64_t j = 0; j < kOwn; ++j)
    p.push_back(static_cast<int32_t>((3000 + 7919 * (i + 1) + 31 * j) % 150000));
  return p;
}

struct Round {
  double first_ttft = 0;          // the earlier session
  std::vector<double> ttft;       // the 16
  double wall_ms = 0;             // the 16, all done
  std::vector<std::vector<int32_t>> ids;
  uint64_t hit_tokens = 0;        // positions taken from the prefix cache (all shards)
};

Round run_round(bool prefix_cache) {
  actors::actor_config cfg;
  caf::actor_system sys{cfg};
  actors::ClusterOptions opts;
  opts.limits.prefix_cache = prefix_cache;
  opts.session.step_timeout = std::chrono::seconds(600);
  actors::LocalCluster c(sys, kModel, model::parse_layer_ranges("0-11,12-23"), opts);
  auto one = [&](int i, double* ttft, std::vector<int32_t>* ids) {
    msg::generation_request r;
    r.session = msg::mint_session_id("bench");
    r.prompt = prompt_of(i);
    r.max_tokens = kTokens;
    const auto t0 = clk::now();
    bool first = true;
    auto out = c.generate(std::move(r), [&](const msg::token_event&) {
      if (first)
        *ttft = bench::ms_between(t0, clk::now());
      first = false;
    });
    if (!out.ok())
      std::fprintf(stderr, "prefix: a session failed: %s\n", sys.render(out.error).c_str());
    *ids = out.result.ids;
  };
  Round r;
  std::vector<int32_t> first_ids;
  one(-1, &r.first_ttft, &first_ids);
  r.ttft.assign(kSessions, 0);
  r.ids.assign(kSessions, {});
  const auto t0 = clk::now();
  std::vector<std::thread> threads;
  for (int i = 0; i < kSessions; ++i)
    threads.emplace_back([&, i] { one(i, &r.ttft[static_cast<std::size_t>(i)], &r.ids[static_cast<std::size_t>(i)]); });
  for (auto& t : threads)
    t.join();
  r.wall_ms = bench::ms_between(t0, clk::now());
  for (auto& s : c.stats())
    r.hit_tokens += s.prefix_hit_tokens;
  return r;
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v)
    s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

} // namespace

int prefix_bench_main(int argc, char** argv) {
  const int rounds = argc > 2 ? std::max(1, std::atoi(argv[2])) : 1;
  model::set_num_threads(2);
  std::printf("# strata_bench prefix (%s, 2 shard actors 0-11 / 12-23 in one process, %d sessions x (%lld shared + "
              "%lld own) prompt tokens, %lld tokens each, 2 threads)\n\n",
              kModel.c_str(), kSessions, static_cast<long long>(kPrefix), static_cast<long long>(kOwn),
              static_cast<long long>(kTokens));
  std::printf("| round | prefix cache | first session TTFT ms | 16 sessions: TTFT mean ms | p50 | max | all done ms | "
              "positions from the cache |\n|---|---|---|---|---|---|---|---|\n");
  std::vector<double> on_mean, off_mean;
  bool identical = true;
  for (int k = 0; k < rounds; ++k) {
    Round off = run_round(false), on = run_round(true);
    identical = identical && off.ids == on.ids;
    for (auto* r : {&off, &on}) {
      const bool is_on = r == &on;
      std::printf("| %d | %s | %.0f | %.0f | %.0f | %.0f | %.0f | %llu |\n", k + 1, is_on ? "on" : "off", r->first_ttft,
                  mean(r->ttft), bench::pct(r->ttft, 0.5), *std::max_element(r->ttft.begin(), r->ttft.end()),
                  r->wall_ms, static_cast<unsigned long long>(r->hit_tokens));
      (is_on ? on_mean : off_mean).push_back(mean(r->ttft));
    }
  }
  std::printf("\nMean TTFT of the 16 sessions, without / with the prefix cache: %.1fx. Ids identical with and "
              "without: %s.\n",
              mean(off_mean) / std::max(1e-9, mean(on_mean)), identical ? "yes" : "NO");
  return identical ? 0 : 1;
}
