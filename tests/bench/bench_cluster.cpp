// strata_bench chaos | throughput: benchmarks against real multi-process
// clusters on loopback (separate `strata node` processes). Not tests.

#include "messages/session_id.hpp"
#include "model/transformer/sampler.hpp"
#include "runtime/cluster.hpp"
#include "runtime/generator.hpp"
#include "tests/bench/measure.hpp"
#include "tests/bench/process_cluster.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <fstream>
#include <random>
#include <sstream>

using namespace strata;
using clk = std::chrono::steady_clock;
using test::Process;
using bench::ProcessCluster;

namespace {

using bench::ms_between;
using bench::pct;

// ---------------------------------------------------------------- chaos

int chaos(const std::string& exe, int generations, uint64_t seed) {
  const std::string model = "builtin:tiny";
  ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  ProcessCluster pc(exe, model);
  for (int r = 0; r < 2; ++r) // two replicas of every range
    for (auto layers : {"0-1", "2-3", "4"})
      pc.start(layers);
  runtime::cluster_config cfg;
  caf::actor_system sys{cfg};
  auto sup = runtime::connect_coordinator(sys, runtime::parse_endpoint(pc.address, "cluster"));
  const auto mcfg = model::read_config(model);
  runtime::LocalPipeline reference(model);
  std::mt19937_64 rng(seed);
  const int64_t max_tokens = 32;

  int faults = 0, wrong_tokens = 0, wrong_generations = 0, lost = 0, kills = 0, freezes = 0, evicts = 0, epochs = 0;
  uint64_t recomputed = 0, generated = 0, layer_tokens = 0, full_layer_tokens = 0;
  std::vector<double> recovery_ms;
  const auto t_start = clk::now();
  for (int g = 0; g < generations; ++g) {
    // A prompt of 2-6 random bytes after BOS, and its golden continuation.
    std::vector<int32_t> prompt = {1};
    const int len = 2 + static_cast<int>(rng() % 5);
    for (int i = 0; i < len; ++i)
      prompt.push_back(3 + 'a' + static_cast<int32_t>(rng() % 26));
    runtime::GenerateRequest golden_req;
    golden_req.prompt_ids = prompt;
    golden_req.max_tokens = max_tokens;
    const auto golden = runtime::generate_stateless(reference, golden_req).ids;

    actors::Injection inj{};
    const int kind = static_cast<int>(rng() % 4);
    inj.kind = kind == 0 ? actors::Injection::kill
               : kind == 1 ? actors::Injection::freeze
               : kind == 2 ? actors::Injection::evict
                           : actors::Injection::epoch;
    inj.shard = static_cast<int64_t>(rng() % 3);
    inj.at_token = 1 + static_cast<int64_t>(rng() % (max_tokens - 2));
    inj.reason = msg::miss_reason::evicted_lru;
    clk::time_point injected_at{};
    bool measuring = false;
    msg::generation_request req;
    req.session = msg::mint_session_id("chaos");
    req.prompt = prompt;
    req.max_tokens = max_tokens;
    req.stop_ids = mcfg.eos_ids;
    req.sampling.rng_state = model::Sampler(model::SamplingParams{}).state();
    actors::SessionOptions opts;
    opts.max_context = mcfg.max_seq_len;
    opts.step_timeout = std::chrono::seconds(5);
    auto out = actors::run_generation(
      sys, sup, req, opts, {inj},
      [&](const actors::Injection& i, const std::string& session) {
        ++faults;
        std::string victim_id;
        if (i.kind == actors::Injection::kill || i.kind == actors::Injection::freeze) {
          // Which process serves hop I right now?
          caf::scoped_actor self{sys};
          self->request(sup, std::chrono::seconds(5), atom::stats_atom_v)
            .receive(
              [&](msg::route_info& r) {
                if (i.shard < static_cast<int64_t>(r.hops.size()))
                  victim_id = caf::to_string(r.hops[static_cast<std::size_t>(i.shard)].shard.node());
              },
              [](caf::error&) {});
        }
        injected_at = clk::now();
        measuring = true;
        runtime::apply_remote_injection(sys, sup, i, session);
        switch (i.kind) {
          case actors::Injection::kill: {
            ++kills;
            auto* n = pc.by_id(victim_id);
            if (!n)
              std::fprintf(stderr, "chaos: killed node %s is not one this benchmark started\n", victim_id.c_str());
            if (n) {
              n->proc->wait_exit(std::chrono::seconds(10));
              const std::string layers = n->layers;
              n->id = "dead";
              pc.start(layers, false); // restarts in the background; the replica serves meanwhile
            }
            break;
          }
          case actors::Injection::freeze: ++freezes; break;
          case actors::Injection::evict: ++evicts; break;
          default: ++epochs; break;
        }
      },
      [&](const msg::token_event&) {
        if (measuring) {
          recovery_ms.push_back(ms_between(injected_at, clk::now()));
          measuring = false;
        }
      },
      {});
    // Identify restarted nodes as they come up (non-blocking for the rest).
    for (auto& n : pc.nodes)
      if (n.id.empty())
        pc.identify(n);
    if (!out.ok()) {
      ++lost;
      const char* kinds[] = {"evict", "kill", "epoch", "desync", "dup", "freeze"};
      std::fprintf(stderr, "generation %d failed (%s of hop %lld at token %lld): %s\n", g, kinds[inj.kind],
                   static_cast<long long>(inj.shard), static_cast<long long>(inj.at_token),
                   sys.render(out.error).c_str());
      continue;
    }
    generated += out.result.ids.size();
    recomputed += out.result.recomputed_tokens;
    layer_tokens += out.result.recomputed_layer_tokens;
    full_layer_tokens += out.result.full_layer_tokens;
    int diff = 0;
    for (std::size_t i = 0; i < std::max(golden.size(), out.result.ids.size()); ++i)
      if (i >= golden.size() || i >= out.result.ids.size() || golden[i] != out.result.ids[i])
        ++diff;
    wrong_tokens += diff;
    wrong_generations += diff > 0;
  }
  const double secs = ms_between(t_start, clk::now()) / 1000.0;
  std::printf("# strata_bench chaos (builtin:tiny, 3 ranges x 2 replicas = 6 node processes + coordinator, seed %llu)\n\n",
              static_cast<unsigned long long>(seed));
  std::printf("| generations | injected faults (kill / freeze / evict / epoch) | tokens generated | tokens differing "
              "from golden | generations differing | lost or hung | recovery p50 ms | recovery p99 ms | positions "
              "rebuilt | layer-tokens recomputed | full re-prefill would recompute | ratio | wall s |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::printf("| %d | %d (%d / %d / %d / %d) | %llu | %d | %d | %d | %.1f | %.1f | %llu | %llu | %llu | %.3f | %.0f |\n",
              generations, faults, kills, freezes, evicts, epochs, static_cast<unsigned long long>(generated),
              wrong_tokens, wrong_generations, lost, pct(recovery_ms, 0.5), pct(recovery_ms, 0.99),
              static_cast<unsigned long long>(recomputed), static_cast<unsigned long long>(layer_tokens),
              static_cast<unsigned long long>(full_layer_tokens),
              full_layer_tokens ? static_cast<double>(layer_tokens) / static_cast<double>(full_layer_tokens) : 0.0, secs);
  std::printf("\nRatio: layer-tokens the rebuilt hops computed again over what today's full re-prefill of every layer "
              "would have (goal: at most 1/3 + 10 %% with 3 ranges). Positions rebuilt: each recovered step's past "
              "length.\n");
  return wrong_tokens == 0 && lost == 0 ? 0 : 1;
}

// ---------------------------------------------------------------- throughput

void throughput(const std::string& exe, const std::string& model, const std::vector<std::string>& ranges,
                int64_t tokens, const std::string& threads) {
  ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  const auto mcfg = model::read_config(model);
  std::vector<int32_t> prompt = {1, 40, 50, 60};
  // One process.
  model::set_num_threads(std::stoi(threads));
  double local_tps = 0;
  {
    runtime::LocalPipeline pipe(model);
    runtime::GenerateRequest req;
    req.prompt_ids = prompt;
    req.max_tokens = tokens;
    runtime::generate(pipe, req); // warm-up
    const auto res = runtime::generate(pipe, req);
    local_tps = static_cast<double>(res.ids.size() - 1) * 1000.0 / res.decode_ms;
  }
  // Three processes.
  ProcessCluster pc(exe, model);
  pc.threads = threads;
  for (auto& r : ranges)
    pc.start(r);
  runtime::cluster_config cfg;
  caf::actor_system sys{cfg};
  auto sup = runtime::connect_coordinator(sys, runtime::parse_endpoint(pc.address, "cluster"));
  double cluster_tps = 0;
  for (int rep = 0; rep < 2; ++rep) { // the first run warms up connections
    msg::generation_request req;
    req.session = msg::mint_session_id("tp");
    req.prompt = prompt;
    req.max_tokens = tokens;
    req.stop_ids = {}; // measure a fixed number of tokens
    actors::SessionOptions opts;
    opts.max_context = mcfg.max_seq_len;
    opts.step_timeout = std::chrono::seconds(60);
    auto out = actors::run_generation(sys, sup, req, opts, {}, {}, {}, {});
    if (!out.ok()) {
      std::printf("cluster generation failed: %s\n", sys.render(out.error).c_str());
      return;
    }
    cluster_tps = static_cast<double>(out.result.ids.size() - 1) * 1000.0 / (out.result.total_ms - out.result.prefill_ms);
  }
  std::string split;
  for (auto& r : ranges)
    split += (split.empty() ? "" : ",") + r;
  std::printf("| %s | %s | %s | %lld | %.2f | %.2f | %.2f |\n", model.c_str(), split.c_str(), threads.c_str(),
              static_cast<long long>(tokens), local_tps, cluster_tps, cluster_tps / local_tps);
}

} // namespace

int cluster_bench_main(int argc, char** argv) {
  const std::string what = argv[1];
  const std::string exe = std::getenv("STRATA_EXE") ? std::getenv("STRATA_EXE") : "build/strata";
  if (what == "chaos") {
    const int n = argc > 2 ? std::atoi(argv[2]) : 200;
    const uint64_t seed = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 20261130;
    return chaos(exe, n, seed);
  }
  // throughput
  std::printf("# strata_bench throughput: one session's decode tok/s, 3 node processes vs one process\n\n");
  std::printf("| model | node ranges | threads per process | tokens | one process tok/s | 3 processes tok/s | "
              "ratio |\n|---|---|---|---|---|---|---|\n");
  const std::string stories = argc > 2 ? argv[2] : "../shared/models/stories260K.bin";
  if (std::ifstream(stories).good())
    throughput(exe, stories, {"0-1", "2-3", "4"}, 200, "1");
  throughput(exe, "builtin:qwen2-0.5b", {"0-7", "8-15", "16-23"}, 24, "2");
  return 0;
}
