// strata_bench wan: a 3-hop cluster across a simulated network. Not a test.
//
// A coordinator and 3 node processes (--assume-remote: they behave as on
// separate machines); every node advertises a delay proxy (runtime/
// delay_proxy.hpp) in front of its real port, so every connection to a node,
// from the client or from the hop before it, crosses the delay both ways: one
// token's trip is client -> head -> middle -> tail -> client, 4 one-way delays.
// For one-way delays of 0, 5, 25 and 50 ms and 1, 8 and 32 concurrent sessions,
// plain and with prompt-lookup speculation: total tok/s, median time to first
// token, trips per token, acceptance, and the rows per round each hop ran.
//
// Usage: strata_bench wan [MODEL ...] (default: builtin:qwen2-0.5b as q8_0, then
// stories260K when ../shared has it); STRATA_WAN_DELAYS=0,25 runs only those delays;
// STRATA_WAN_PAIRS=K adds K interleaved rounds of 32 sessions (STRATA_WAN_SESSIONS=2,8:
// those crowds) plain / with lookup (/ with the draft model, where there is one:
// with serve's default crowd limit and with none) per delay (STRATA_WAN_TABLE=0
// skips the table before them).

#include "actors/cluster.hpp"
#include "actors/drafter.hpp"
#include "messages/session_id.hpp"
#include "model/transformer/shard.hpp"
#include "runtime/cluster.hpp"
#include "runtime/delay_proxy.hpp"
#include "tests/bench/measure.hpp"
#include "tests/bench/process_cluster.hpp"

#include <utility> // (before asio, see delay_proxy.cpp)

#include <boost/asio.hpp>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <mutex>
#include <thread>

using namespace strata;
using clk = std::chrono::steady_clock;

namespace {

// Three layer ranges that give each hop about a third of a token's
// multiply-adds, the tail's counting the classifier (vocab x dim: for
// Qwen2.5-0.5B as much as 9 of its 24 layers), as a user splits a pipeline
// whose stages should take turns at the same pace: 0-10, 11-21, 22-23 there,
// where even thirds of the layers left the tail hop twice the others' work.
std::vector<std::string> balanced_thirds(const model::ModelConfig& c) {
  const int64_t L = c.n_layers;
  const int64_t ffn = c.n_experts > 0 ? c.expert_hidden_dim * c.n_experts_used : c.hidden_dim;
  const double layer = static_cast<double>(c.dim * (c.q_dim() + 2 * c.kv_dim()) + c.q_dim() * c.dim + 3 * c.dim * ffn);
  const double head = static_cast<double>(c.vocab_size * c.dim);
  int64_t best_a = L / 3, best_b = 2 * L / 3;
  double best = 1e300;
  for (int64_t a = 1; a + 2 <= L; ++a) // head [0, a), middle [a, b), tail [b, L) and the classifier
    for (int64_t b = a + 1; b + 1 <= L; ++b) {
      const double worst = std::max({layer * static_cast<double>(a), layer * static_cast<double>(b - a),
                                     layer * static_cast<double>(L - b) + head});
      if (worst < best) {
        best = worst;
        best_a = a;
        best_b = b;
      }
    }
  return {"0-" + std::to_string(best_a - 1), std::to_string(best_a) + "-" + std::to_string(best_b - 1),
          std::to_string(best_b) + "-" + std::to_string(L - 1)};
}

} // namespace

namespace {

using bench::ms_between;
using bench::pct;

uint16_t free_port() {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor a(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
  return a.local_endpoint().port();
}

struct Run {
  double tok_s = 0, ttft_ms = 0, trips_per_token = 0, acceptance = -1;
  std::string rows_per_round;
  int failed = 0;
};


} // namespace

int wan_bench_main(int argc, char** argv) {
  const std::string exe = (std::filesystem::path(argv[0]).parent_path() / "strata").string();
  const auto models = bench::models_or(argc, argv, "builtin:qwen2-0.5b", "../shared/models/stories260K.bin");
  const auto env_list = [](const char* name, std::vector<double> fallback) { // e.g. "0,25"
    const char* env = std::getenv(name);
    if (!env)
      return fallback;
    std::vector<double> out;
    for (std::string d; const char c : std::string(env) + ",")
      if (c == ',') {
        if (!d.empty())
          out.push_back(std::stod(d));
        d.clear();
      } else {
        d += c;
      }
    return out;
  };
  const std::vector<double> delays = env_list("STRATA_WAN_DELAYS", {0, 5, 25, 50});
  std::vector<int> pair_crowds;
  for (double n : env_list("STRATA_WAN_SESSIONS", {32}))
    pair_crowds.push_back(std::max(1, static_cast<int>(n)));
  const std::vector<int> crowd{1, 8, 32};
  const int64_t tokens = 64;
  std::printf("# strata_bench wan: 3 node processes, each behind a delay proxy (one-way delay per link, both "
              "ways); %lld tokens per session, greedy; speculation: at most 8 proposals per step, by prompt lookup, "
              "or by a draft model in the client's process (stories260K: its q4_0 file)\n\n",
              static_cast<long long>(tokens));
  for (const auto& model : models) {
    const bool builtin = model.rfind("builtin:", 0) == 0;
    const auto cfg = model::read_config(model);
    const std::vector<std::string> layers = balanced_thirds(cfg);
    bench::ProcessCluster pc(exe, model);
    pc.threads = "1";
    std::vector<std::unique_ptr<runtime::DelayProxy>> proxies;
    for (auto& r : layers) {
      const auto port = free_port();
      runtime::DelayProxyOptions po;
      po.target_port = port;
      proxies.push_back(std::make_unique<runtime::DelayProxy>(po));
      pc.node_flags = {"--assume-remote", "--advertise", "127.0.0.1:" + std::to_string(proxies.back()->port())};
      if (builtin)
        pc.node_flags.insert(pc.node_flags.end(), {"--dtype", "q8_0"});
      // ProcessCluster::start listens on port 0; this node must listen where its proxy forwards.
      std::vector<std::string> argv2{exe, "node", "--listen", "127.0.0.1:" + std::to_string(port), "--join", pc.address,
                                     "--model", model, "--layers", r, "--threads", pc.threads};
      argv2.insert(argv2.end(), pc.node_flags.begin(), pc.node_flags.end());
      bench::ProcessCluster::Node n;
      n.layers = r;
      n.proc = std::make_unique<bench::Process>(argv2);
      pc.nodes.push_back(std::move(n));
      pc.identify(pc.nodes.back());
    }
    runtime::cluster_config ccfg;
    caf::actor_system sys{ccfg};
    auto sup = runtime::connect_coordinator(sys, runtime::parse_endpoint(pc.address, "cluster"));
    actors::SessionOptions so;
    so.max_context = cfg.max_seq_len;
    auto stats = [&] { return bench::cluster_stats(sys, sup); };
    // Prompts that repeat a phrase (so lookup has something to find, as in chat
    // histories and code), different per session.
    std::function<std::vector<int32_t>(int)> prompt_of = [&](int i) {
      std::vector<int32_t> p;
      if (cfg.bos_id >= 0)
        p.push_back(cfg.bos_id);
      for (int rep = 0; rep < 2; ++rep)
        for (int j = 0; j < 8; ++j)
          p.push_back(static_cast<int32_t>((1000 + 7919 * i + 104729 * j) % (cfg.vocab_size - 10) + 5));
      return p;
    };
    if (model.find("stories260K") != std::string::npos) // a story's first words (ids of stories260K's vocabulary)
      prompt_of = [](int i) { return std::vector<int32_t>{1, 403, 407, static_cast<int32_t>(31 + 7 * i % 200), 263}; };
    actors::drafter_actor drafter, unlimited; // the crowd limit as serve's default, and none
    const std::string draft_file = "../shared/models/gguf/stories260K-q4_0.gguf";
    if (model.find("stories260K") != std::string::npos && std::filesystem::exists(draft_file)) {
      // One math thread for the draft in this process: the nodes share this
      // machine's two cores, and idle math threads spinning here would take
      // them (on separate machines the client has its own).
      model::set_num_threads(1);
      drafter = actors::spawn_drafter(sys, draft_file, cfg.vocab_size);
      actors::DrafterLimits free;
      free.max_crowd = 0;
      unlimited = actors::spawn_drafter(sys, draft_file, cfg.vocab_size, {}, free);
    }
    // with_draft: 0 none, 1 the drafter with the default crowd limit, 2 the one without.
    auto run = [&](int n, uint32_t speculate, int with_draft) {
      auto so_run = so;
      if (with_draft)
        so_run.drafter = with_draft == 1 ? drafter : unlimited;
      const auto before = stats();
      std::atomic<int64_t> got{0};
      std::atomic<uint64_t> trips{0}, proposed{0}, accepted{0};
      std::atomic<int> failed{0};
      std::vector<double> ttft(static_cast<std::size_t>(n), 0);
      const auto t0 = clk::now();
      std::vector<std::thread> threads;
      for (int i = 0; i < n; ++i)
        threads.emplace_back([&, i] {
          msg::generation_request r;
          r.session = msg::mint_session_id("wan");
          r.prompt = prompt_of(i);
          r.max_tokens = tokens;
          r.speculate = speculate;
          const auto s0 = clk::now();
          bool first = true;
          auto out = actors::run_generation(sys, sup, std::move(r), so_run, {}, {}, [&](const msg::token_event&) {
            if (first)
              ttft[static_cast<std::size_t>(i)] = ms_between(s0, clk::now());
            first = false;
            ++got;
          });
          if (!out.ok()) {
            ++failed;
            return;
          }
          trips += out.result.steps;
          proposed += out.result.proposed;
          accepted += out.result.accepted;
        });
      for (auto& t : threads)
        t.join();
      Run res;
      res.tok_s = static_cast<double>(got.load()) * 1000.0 / ms_between(t0, clk::now());
      res.ttft_ms = pct(ttft, 0.5);
      res.trips_per_token = got > 0 ? static_cast<double>(trips.load()) / static_cast<double>(got.load()) : 0;
      if (proposed > 0)
        res.acceptance = static_cast<double>(accepted.load()) / static_cast<double>(proposed.load());
      res.failed = failed;
      res.rows_per_round = bench::rows_per_round(before, stats());
      return res;
    };
    run(1, 0, 0); // warm-up: every connection made
    if (drafter) { // ... and the draft models' first use (their pools, their threads)
      run(1, 8, 1);
      run(1, 8, 2);
    }
    std::printf("## %s (%s; hops: layers %s, %s, %s and the classifier: each about a third of the "
                "multiply-adds)\n\n| one-way delay ms | sessions | speculation | total tok/s | vs 1 session | median "
                "TTFT ms | trips per token | accepted | rows per round (per hop) | failed |\n"
                "|---|---|---|---|---|---|---|---|---|---|\n",
                model.c_str(), builtin ? (cfg.summary() + ", q8_0").c_str() : cfg.summary().c_str(), layers[0].c_str(),
                layers[1].c_str(), layers[2].c_str());
    const bool table = !std::getenv("STRATA_WAN_TABLE") || std::string(std::getenv("STRATA_WAN_TABLE")) != "0";
    for (double d : table ? delays : std::vector<double>{}) {
      for (auto& p : proxies)
        p->set_delay(std::chrono::microseconds(static_cast<int64_t>(d * 1000)));
      for (int mode = 0; mode < (drafter ? 4 : 2); ++mode) {
        const uint32_t spec = mode == 0 ? 0u : 8u;
        double one = 0;
        for (int n : crowd) {
          const auto r = run(n, spec, mode >= 2 ? mode - 1 : 0);
          if (n == 1)
            one = r.tok_s;
          char acc[32] = "-";
          if (r.acceptance >= 0)
            std::snprintf(acc, sizeof acc, "%.0f%%", 100 * r.acceptance);
          std::printf("| %.0f | %d | %s | %.1f | %.2fx | %.0f | %.2f | %s | %s | %d |\n", d, n,
                      mode == 0 ? "off" : mode == 1 ? "lookup" : mode == 2 ? "draft" : "draft, no limit", r.tok_s, one > 0 ? r.tok_s / one : 0.0, r.ttft_ms, r.trips_per_token, acc,
                      r.rows_per_round.c_str(), r.failed);
          std::fflush(stdout);
        }
      }
    }
    if (const char* env = std::getenv("STRATA_WAN_PAIRS")) {
      // Speculation against plain in a crowd, interleaved: K rounds of (plain,
      // lookup[, draft, draft with no crowd limit]) with the same sessions at
      // each delay; the ratio per round and the median ratio (this VM's
      // run-to-run noise is larger than the difference).
      const int pairs = std::max(1, std::atoi(env));
      std::printf("\n### %s: plain / lookup%s in turn (%d rounds per delay and crowd)\n\n"
                  "| one-way delay ms | sessions | plain tok/s per round | lookup tok/s per round | median lookup / plain |%s\n"
                  "|---|---|---|---|---|%s\n",
                  model.c_str(), drafter ? " / draft / draft with no crowd limit" : "", pairs,
                  drafter ? " draft tok/s per round | median draft / plain | no limit: tok/s per round | median / plain |" : "",
                  drafter ? "---|---|---|---|" : "");
      for (auto& p : proxies)
        p->set_delay(std::chrono::microseconds(0));
      run(*std::max_element(pair_crowds.begin(), pair_crowds.end()), 8, 0); // warm-up: the shards' first big rounds
      for (double d : delays) {
        for (auto& p : proxies)
          p->set_delay(std::chrono::microseconds(static_cast<int64_t>(d * 1000)));
        for (int n : pair_crowds) {
          std::vector<double> ratios[3];
          std::string per_round[4];
          const auto add = [](std::string& to, int k, double v) {
            char buf[64];
            std::snprintf(buf, sizeof buf, "%s%.1f", k ? " / " : "", v);
            to += buf;
          };
          for (int k = 0; k < pairs; ++k) {
            const auto a = run(n, 0, 0);
            add(per_round[0], k, a.tok_s);
            for (int m = 1; m < (drafter ? 4 : 2); ++m) {
              const auto b = run(n, 8, m - 1);
              ratios[m - 1].push_back(a.tok_s > 0 ? b.tok_s / a.tok_s : 0);
              add(per_round[m], k, b.tok_s);
            }
          }
          std::printf("| %.0f | %d | %s | %s | %.2fx |", d, n, per_round[0].c_str(), per_round[1].c_str(),
                      pct(ratios[0], 0.5));
          if (drafter)
            std::printf(" %s | %.2fx | %s | %.2fx |", per_round[2].c_str(), pct(ratios[1], 0.5), per_round[3].c_str(),
                        pct(ratios[2], 0.5));
          std::printf("\n");
          std::fflush(stdout);
        }
      }
    }
    if (drafter) {
      caf::anon_send_exit(drafter, caf::exit_reason::user_shutdown);
      caf::anon_send_exit(unlimited, caf::exit_reason::user_shutdown);
    }
    std::printf("\n");
  }
  return 0;
}
