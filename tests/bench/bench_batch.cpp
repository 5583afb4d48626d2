// strata_bench batch: continuous batching on builtin:qwen2-0.5b. Not a test.
//
// For 1/2/4/8/16 concurrent sessions of 32 tokens each: total decode tok/s and
// p50/p99 inter-token latency, in one process (one shard actor, --shards 0-23)
// and across 3 node processes, and through `strata serve` (1 and 8 requests);
// the time to first token of a 512-token prompt that arrives while 8 sessions
// decode; and prefill GFLOP/s against this machine's peak. `batch file PATH`:
// 1/4/8/16 sessions through one shard over a GGUF file (how its weight types
// batch; STRATA_BENCH_SESSIONS=8: 8 sessions, 8 times over). `batch serve TYPE|PATH [LLAMA_BIN]`: 1/4/8/16 concurrent requests
// through `strata serve` over one node, next to llama-server on the same file
// (TYPE: llama-quantize's type of the Qwen2.5-0.5B-shaped model of `types`),
// interleaved. Requests to a server go from this process's threads
// (http_post.hpp; STRATA_BENCH_CLIENT=curl: a curl process each).

#include "actors/cluster.hpp"
#include "messages/session_id.hpp"
#include "model/transformer/shard.hpp"
#include "runtime/cluster.hpp"
#include "tests/bench/bench_gguf.hpp"
#include "tests/bench/http_post.hpp"
#include "tests/bench/measure.hpp"
#include "tests/bench/process_cluster.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

using namespace strata;
using clk = std::chrono::steady_clock;

const strata::benchgguf::Shape& w896_bench_shape(); // bench_types.cpp

namespace {

const std::string kModel = "builtin:qwen2-0.5b";
constexpr int64_t kTokens = 32;
int64_t g_vocab = 150000; // prompts draw ids below this (the file's vocabulary in `batch file`)

using bench::ms_between;
using bench::pct;

std::vector<int32_t> prompt_of(int i, int64_t len = 8) {
  std::vector<int32_t> p;
  for (int64_t j = 0; j < len; ++j)
    p.push_back(static_cast<int32_t>((1000 + 7919 * i + 104729 * j) % g_vocab));
  return p;
}

msg::generation_request request(std::vector<int32_t> prompt, int64_t n) {
  msg::generation_request r;
  r.session = msg::mint_session_id("bench");
  r.prompt = std::move(prompt);
  r.max_tokens = n;
  r.stop_ids = {}; // a fixed number of tokens
  return r;
}

// Runs one generation; calls on_token for every token; returns false on error.
using generate_fn = std::function<bool(msg::generation_request, const std::function<void(const msg::token_event&)>&)>;

struct Load {
  double tok_s = 0;
  double itl_p50 = 0, itl_p99 = 0;
  int failed = 0;
  std::string rows_per_round; // per hop: input rows / rounds during the run
};

using stats_fn = std::function<std::vector<msg::shard_stats>()>;


Load concurrent(int n, const generate_fn& gen, const stats_fn& stats) {
  const auto before = stats();
  std::vector<std::vector<double>> gaps(static_cast<std::size_t>(n));
  std::atomic<int64_t> tokens{0};
  std::atomic<int> failed{0};
  const auto t0 = clk::now();
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      clk::time_point last{};
      auto& g = gaps[static_cast<std::size_t>(i)];
      const bool ok = gen(request(prompt_of(i), kTokens), [&](const msg::token_event&) {
        const auto now = clk::now();
        if (last != clk::time_point{})
          g.push_back(ms_between(last, now));
        last = now;
        ++tokens;
      });
      if (!ok)
        ++failed;
    });
  for (auto& t : threads)
    t.join();
  Load l;
  l.tok_s = static_cast<double>(tokens.load()) * 1000.0 / ms_between(t0, clk::now());
  std::vector<double> all;
  for (auto& g : gaps)
    all.insert(all.end(), g.begin(), g.end());
  l.itl_p50 = pct(all, 0.5);
  l.itl_p99 = pct(all, 0.99);
  l.failed = failed;
  l.rows_per_round = bench::rows_per_round(before, stats());
  return l;
}

// Time to first token of a 512-token prompt: alone, then while 8 sessions decode.
std::pair<double, double> ttft_512(const generate_fn& gen) {
  // Two different prompts: the second run must not find the first's blocks in
  // the prefix cache.
  auto first_token_ms = [&](int which) {
    const auto t0 = clk::now();
    double ms = -1;
    gen(request(prompt_of(which, 512), 1), [&](const msg::token_event&) { ms = ms_between(t0, clk::now()); });
    return ms;
  };
  const double alone = first_token_ms(99);
  std::atomic<int> started{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&, i] {
      int seen = 0;
      gen(request(prompt_of(i), 64), [&](const msg::token_event&) {
        if (++seen == 4)
          ++started;
      });
    });
  while (started.load() < 8)
    std::this_thread::sleep_for(std::chrono::milliseconds(5)); // a benchmark's poll, not a test
  const double crowded = first_token_ms(98);
  for (auto& t : threads)
    t.join();
  return {alone, crowded};
}

struct Table {
  std::string where;
  std::vector<std::pair<int, Load>> rows;
};

void print(const Table& t) {
  const double one = t.rows.front().second.tok_s, itl1 = t.rows.front().second.itl_p50;
  for (auto& [n, l] : t.rows)
    std::printf("| %s | %d | %.2f | %.2fx | %.0f | %.0f | %.2fx | %s | %d |\n", t.where.c_str(), n, l.tok_s,
                l.tok_s / one, l.itl_p50, l.itl_p99, l.itl_p50 / itl1, l.rows_per_round.c_str(), l.failed);
  std::fflush(stdout);
}

std::string sh(const std::string& cmd) {
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[4096];
    while (std::size_t n = std::fread(buf, 1, sizeof buf, p))
      out.append(buf, n);
    ::pclose(p);
  }
  return out;
}

// N concurrent non-streamed completions through an OpenAI-compatible server:
// total tok/s. The requests go from this process's threads (http_post.hpp);
// STRATA_BENCH_CLIENT=curl: a curl process per request instead (how this bench
// measured until session 15: their start-up competes with the server for
// the cores as a crowd arrives).
double serve_load(const std::string& base, int n) {
  static const bool curl = std::getenv("STRATA_BENCH_CLIENT") && std::string(std::getenv("STRATA_BENCH_CLIENT")) == "curl";
  std::atomic<int64_t> tokens{0};
  const auto t0 = clk::now();
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      nlohmann::json body = {{"prompt", prompt_of(i)}, {"max_tokens", kTokens}, {"temperature", 0}};
      const auto out = curl ? sh("curl -s -m 600 -H 'Content-Type: application/json' --data-binary '" + body.dump() +
                                 "' " + base + "/v1/completions")
                            : bench::http_post(base, "/v1/completions", body.dump());
      try {
        tokens += nlohmann::json::parse(out)["usage"]["completion_tokens"].get<int64_t>();
      } catch (const std::exception&) {
        std::fprintf(stderr, "serve request failed: %s\n", out.c_str());
      }
    });
  for (auto& t : threads)
    t.join();
  return static_cast<double>(tokens.load()) * 1000.0 / ms_between(t0, clk::now());
}

void prefill_flops(int threads) {
  auto shard = model::Shard::load(kModel);
  const auto& c = shard->config();
  // Multiply-adds per token in the layers (the classifier runs for the last row only).
  const double per_token = static_cast<double>(c.n_layers) *
                           static_cast<double>(c.dim * (c.q_dim() + 2 * c.kv_dim()) + c.q_dim() * c.dim +
                                               3 * c.dim * c.hidden_dim);
  std::vector<int32_t> ids = prompt_of(7, 512);
  for (int64_t chunk : {int64_t{128}, int64_t{512}}) {
    double best = 1e30;
    for (int rep = 0; rep < 2; ++rep) {
      auto cache = shard->new_cache();
      const auto t0 = clk::now();
      for (int64_t b = 0; b < 512; b += chunk)
        shard->forward(std::span<const int32_t>(ids.data() + b, static_cast<std::size_t>(chunk)),
                       model::consecutive_positions(b, chunk), cache);
      best = std::min(best, ms_between(t0, clk::now()));
    }
    const double gflops = 2.0 * per_token * 512 / (best / 1000.0) / 1e9;
    const double peak = 2.0 * model::fma_rate_per_thread(0.3) * threads / 1e9;
    std::printf("| 512 tokens in pieces of %lld | %d | %.0f | %.0f | %.0f | %.0f %% |\n", static_cast<long long>(chunk),
                threads, best, 512.0 / (best / 1000.0), gflops, 100.0 * gflops / peak);
  }
  std::printf("\nPeak: %d threads x 2 FLOP x the multiply-adds per second one thread sustains in a register-only "
              "loop of independent FMAs on the widest vectors (model::fma_rate_per_thread), measured in the same run. "
              "GFLOP/s counts the layers' matrix products (2 x multiply-adds), not attention.\n",
              threads);
}

} // namespace

int batch_bench_main(int argc, char** argv) {
  const std::string exe = std::getenv("STRATA_EXE") ? std::getenv("STRATA_EXE") : "build/strata";
  // STRATA_BENCH_THREADS: another thread count (e.g. 1, to tell the kernels' cost from the threads' hand-offs)
  const char* threads_env = std::getenv("STRATA_BENCH_THREADS");
  const int threads = threads_env ? std::max(1, std::atoi(threads_env)) : 2;
  const std::string part = argc > 2 ? argv[2] : "all";
  model::set_num_threads(threads);
  std::printf("# strata_bench batch (%s, %lld tokens per session, %d threads per process)\n\n", kModel.c_str(),
              static_cast<long long>(kTokens), threads);
  const std::vector<int> sizes = {1, 2, 4, 8, 16};
  std::vector<Table> tables;
  std::vector<std::pair<std::string, std::pair<double, double>>> ttft;
  if (part == "all" || part == "local") {
    actors::actor_config cfg;
    caf::actor_system sys{cfg};
    actors::LocalCluster c(sys, kModel, model::parse_layer_ranges("0-23"));
    generate_fn gen = [&](msg::generation_request r, const std::function<void(const msg::token_event&)>& on) {
      return c.generate(std::move(r), on).ok();
    };
    gen(request(prompt_of(0), 4), {}); // warm-up
    Table t{"one process", {}};
    stats_fn stats = [&] { return c.stats(); };
    for (int n : sizes)
      t.rows.emplace_back(n, concurrent(n, gen, stats));
    tables.push_back(t);
    ttft.emplace_back("one process", ttft_512(gen));
  }
  if (part == "all" || part == "cluster") {
    bench::ProcessCluster pc(exe, kModel);
    pc.threads = std::to_string(threads);
    for (auto r : {"0-7", "8-15", "16-23"})
      pc.start(r);
    runtime::cluster_config cfg;
    caf::actor_system sys{cfg};
    auto sup = runtime::connect_coordinator(sys, runtime::parse_endpoint(pc.address, "cluster"));
    actors::SessionOptions so;
    so.max_context = 32768;
    generate_fn gen = [&](msg::generation_request r, const std::function<void(const msg::token_event&)>& on) {
      return actors::run_generation(sys, sup, std::move(r), so, {}, {}, on).ok();
    };
    gen(request(prompt_of(0), 4), {}); // warm-up: connections
    Table t{"3 node processes", {}};
    stats_fn stats = [&] { return bench::cluster_stats(sys, sup); };
    for (int n : sizes)
      t.rows.emplace_back(n, concurrent(n, gen, stats));
    tables.push_back(t);
    ttft.emplace_back("3 node processes", ttft_512(gen));
    // The same cluster through the HTTP front door.
    bench::Process serve({exe, "serve", "--cluster", pc.address, "--http", "127.0.0.1:0"});
    const auto line = serve.wait_line("ready http ");
    const std::string base = "http://" + line.substr(std::string("ready http ").size());
    serve_load(base, 1); // warm-up
    const double s1 = serve_load(base, 1), s8 = serve_load(base, 8);
    std::printf("## through strata serve (3 node processes)\n\n| requests | total tok/s | vs 1 |\n|---|---|---|\n"
                "| 1 | %.2f | 1.00x |\n| 8 | %.2f | %.2fx |\n\n",
                s1, s8, s8 / s1);
  }
  if (part == "file") { // one shard over a GGUF file (argv[3]): how its weight types batch
    if (argc < 4) {
      std::fprintf(stderr, "usage: strata_bench batch file PATH.gguf\n");
      return 2;
    }
    const std::string file = argv[3];
    actors::actor_config cfg;
    caf::actor_system sys{cfg};
    actors::LocalCluster c(sys, file, {model::LayerRange{0, model::read_config(file).n_layers - 1}});
    g_vocab = c.config().vocab_size;
    generate_fn gen = [&](msg::generation_request r, const std::function<void(const msg::token_event&)>& on) {
      return c.generate(std::move(r), on).ok();
    };
    gen(request(prompt_of(0), 4), {}); // warm-up
    Table t{file.substr(file.find_last_of('/') + 1), {}};
    stats_fn stats = [&] { return c.stats(); };
    std::vector<int> crowds{1, 4, 8, 16};
    if (const char* env = std::getenv("STRATA_BENCH_SESSIONS")) // e.g. "8": only that crowd, 8 times (for a profiler)
      crowds.assign(8, std::max(1, std::atoi(env)));
    for (int n : crowds)
      t.rows.emplace_back(n, concurrent(n, gen, stats));
    std::printf("## one shard over %s (%s)\n\n| where | sessions | total tok/s | vs 1 session | p50 inter-token ms | p99 "
                "inter-token ms | p50 vs 1 session | rows per round | failed |\n|---|---|---|---|---|---|---|---|---|\n",
                file.c_str(), c.config().summary().c_str());
    print(t);
    return 0;
  }
  if (part == "serve") { // one node over a GGUF file through `strata serve`, next to llama-server on the same file
    if (argc < 4) {
      std::fprintf(stderr, "usage: strata_bench batch serve TYPE|PATH.gguf [LLAMA_BIN]\n");
      return 2;
    }
    std::string file = argv[3];
    const char* env = std::getenv("LLAMA_CPP_BIN");
    const std::string llama_bin = argc > 4 ? argv[4] : env ? env : "";
    const std::string llama = llama_bin.empty() ? "" : llama_bin + "/llama-server";
    if (file.size() < 5 || file.substr(file.size() - 5) != ".gguf") {
      // A llama-quantize type: the Qwen2.5-0.5B-shaped seeded model of `types`
      // (vocab 32k) with a made-up vocabulary that llama-server can
      // detokenize, written once and quantized by llama-quantize.
      if (llama_bin.empty()) {
        std::fprintf(stderr, "batch serve TYPE needs llama.cpp's binaries (LLAMA_BIN or LLAMA_CPP_BIN)\n");
        return 2;
      }
      const std::filesystem::path dir =
        std::filesystem::path(std::getenv("STRATA_BUILD_DIR") ? std::getenv("STRATA_BUILD_DIR") : "build") / "bench-models";
      std::filesystem::create_directories(dir);
      auto shape = w896_bench_shape();
      shape.vocab_tokens = true;
      const auto f32 = dir / "qwen2-w896-serve-f32.gguf";
      if (!std::filesystem::exists(f32))
        benchgguf::make_model(shape, f32);
      std::string lower = file;
      std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char ch) { return std::tolower(ch); });
      const auto q = dir / ("qwen2-w896-serve-" + lower + ".gguf");
      if (!benchgguf::quantize_file(llama_bin, f32, q, file))
        return 1;
      file = q.string();
    }
    const auto cfg_file = model::read_config(file);
    g_vocab = cfg_file.vocab_size;
    bench::ProcessCluster pc(exe, file);
    pc.threads = std::to_string(threads);
    pc.start("0-" + std::to_string(cfg_file.n_layers - 1));
    bench::Process serve({exe, "serve", "--cluster", pc.address, "--http", "127.0.0.1:0"});
    const auto line = serve.wait_line("ready http ");
    if (line.empty()) {
      std::fprintf(stderr, "strata serve did not start\n");
      return 1;
    }
    std::vector<std::pair<std::string, std::string>> servers = {
      {"strata serve", "http://" + line.substr(std::string("ready http ").size())}};
    std::unique_ptr<bench::Process> peer;
    if (!llama.empty()) {
      // Its own parallel slots (-np 16: the largest crowd below), each with room
      // for a prompt and its tokens; continuous batching is its default.
      const std::string port = std::to_string(18000 + ::getpid() % 2000);
      peer = std::make_unique<bench::Process>(std::vector<std::string>{
        "/bin/sh", "-c",
        "exec '" + llama + "' -m '" + file + "' -np 16 -c 4096 -t " + std::to_string(threads) +
          " --host 127.0.0.1 --port " + port + " 2>&1"});
      if (peer->wait_containing("listening on http", std::chrono::seconds(120)).empty()) {
        std::fprintf(stderr, "llama-server did not start\n");
        return 1;
      }
      servers.emplace_back("llama-server -np 16", "http://127.0.0.1:" + port);
    }
    for (auto& [name, base] : servers)
      serve_load(base, 2); // warm-up
    const int rounds = std::getenv("STRATA_BENCH_ROUNDS") ? std::atoi(std::getenv("STRATA_BENCH_ROUNDS")) : 3;
    const std::vector<int> ns = {1, 4, 8, 16};
    std::vector<std::vector<std::vector<double>>> tok(servers.size(), std::vector<std::vector<double>>(ns.size()));
    for (int rd = 0; rd < rounds; ++rd)
      for (std::size_t k = 0; k < ns.size(); ++k)
        for (std::size_t which = 0; which < servers.size(); ++which) { // the order alternates by round
          const std::size_t w = (rd % 2 == 0) ? which : servers.size() - 1 - which;
          tok[w][k].push_back(serve_load(servers[w].second, ns[k]));
        }
    std::printf("## one node over %s (%s), %d threads, %lld tokens per request, %d interleaved rounds, medians of "
                "total tok/s\n\n| sessions |",
                file.c_str(), cfg_file.summary().c_str(), threads, static_cast<long long>(kTokens), rounds);
    for (auto& s : servers)
      std::printf(" %s | vs 1 |", s.first.c_str());
    if (servers.size() == 2)
      std::printf(" strata / llama-server |");
    std::printf("\n|---|");
    for (std::size_t i = 0; i < servers.size(); ++i)
      std::printf("---|---|");
    std::printf(servers.size() == 2 ? "---|\n" : "\n");
    for (std::size_t k = 0; k < ns.size(); ++k) {
      std::printf("| %d |", ns[k]);
      for (std::size_t w = 0; w < servers.size(); ++w)
        std::printf(" %.1f | %.2fx |", pct(tok[w][k], 0.5), pct(tok[w][k], 0.5) / pct(tok[w][0], 0.5));
      if (servers.size() == 2)
        std::printf(" %.2f |", pct(tok[0][k], 0.5) / pct(tok[1][k], 0.5));
      std::printf("\n");
    }
    return 0;
  }
  if (part == "packed") { // the same weights plain and packed (STRATA_PACKED_WEIGHTS=0), interleaved
    const std::string model = argc > 3 ? argv[3] : kModel;
    const std::string dtype = argc > 4 ? argv[4] : "q8_0";
    actors::actor_config cfg;
    caf::actor_system sys{cfg};
    const int64_t layers = model::read_config(model).n_layers;
    auto load = [&](bool packed) {
      ::setenv("STRATA_PACKED_WEIGHTS", packed ? "1" : "0", 1);
      actors::ClusterOptions o;
      o.load.dtype = dtype;
      return std::make_unique<actors::LocalCluster>(sys, model, std::vector<model::LayerRange>{{0, layers - 1}}, o);
    };
    auto plain = load(false), packed = load(true);
    ::unsetenv("STRATA_PACKED_WEIGHTS");
    g_vocab = plain->config().vocab_size;
    const int rounds = std::getenv("STRATA_BENCH_ROUNDS") ? std::atoi(std::getenv("STRATA_BENCH_ROUNDS")) : 3;
    const std::vector<int> ns = {1, 4, 8, 16};
    std::vector<std::vector<double>> tok[2];
    tok[0].resize(ns.size());
    tok[1].resize(ns.size());
    for (int rd = 0; rd < rounds; ++rd)
      for (std::size_t k = 0; k < ns.size(); ++k)
        for (int which = 0; which < 2; ++which) { // plain, packed; the order alternates by round
          const int w = (rd % 2 == 0) ? which : 1 - which;
          auto& c = w == 0 ? *plain : *packed;
          generate_fn gen = [&](msg::generation_request r, const std::function<void(const msg::token_event&)>& on) {
            return c.generate(std::move(r), on).ok();
          };
          if (rd == 0 && k == 0)
            gen(request(prompt_of(0), 4), {}); // warm-up
          stats_fn stats = [&] { return c.stats(); };
          const Load l = concurrent(ns[k], gen, stats);
          tok[w][k].push_back(l.failed == 0 ? l.tok_s : 0.0);
        }
    std::printf("## plain vs packed weights, one shard over %s as %s (%s), %d interleaved rounds, medians\n\n"
                "| sessions | plain tok/s | vs 1 | packed tok/s | vs 1 | packed / plain |\n|---|---|---|---|---|---|\n",
                model.c_str(), dtype.c_str(), plain->config().summary().c_str(), rounds);
    const double p1 = pct(tok[0][0], 0.5), q1 = pct(tok[1][0], 0.5);
    for (std::size_t k = 0; k < ns.size(); ++k) {
      const double p = pct(tok[0][k], 0.5), q = pct(tok[1][k], 0.5);
      std::printf("| %d | %.1f | %.2fx | %.1f | %.2fx | %.2f |\n", ns[k], p, p / p1, q, q / q1, q / p);
    }
    return 0;
  }
  if (!tables.empty()) {
    std::printf("## concurrent sessions\n\n| where | sessions | total tok/s | vs 1 session | p50 inter-token ms | p99 "
                "inter-token ms | p50 vs 1 session | rows per round (per hop) | failed |\n|---|---|---|---|---|---|---|---|---|\n");
    for (auto& t : tables)
      print(t);
    if (tables.size() == 2) {
      std::printf("\n| sessions | 3 processes / one process (total tok/s) |\n|---|---|\n");
      for (std::size_t i = 0; i < sizes.size(); ++i)
        std::printf("| %d | %.2f |\n", sizes[i], tables[1].rows[i].second.tok_s / tables[0].rows[i].second.tok_s);
    }
    std::printf("\n## time to first token, 512-token prompt\n\n| where | alone ms | while 8 sessions decode ms |\n"
                "|---|---|---|\n");
    for (auto& [w, v] : ttft)
      std::printf("| %s | %.0f | %.0f |\n", w.c_str(), v.first, v.second);
  }
  if (part == "all" || part == "prefill") {
    std::printf("\n## prefill\n\n| what | threads | ms | tok/s | GFLOP/s | of peak |\n|---|---|---|---|---|---|\n");
    prefill_flops(threads);
  }
  return 0;
}
