// `strata serve` in front of a real cluster of processes on loopback, driven by
// curl, the official openai npm client and headless Chromium.

#include "tests/cluster/process.hpp"
#include "tests/server/serve_support.hpp"
#include "tests/support.hpp"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <regex>
#include <fstream>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sstream>

namespace strata {
namespace {

using test::Process;
using nlohmann::json;
using namespace servetest;

struct Served {
  std::unique_ptr<Process> coordinator, server;
  std::vector<std::unique_ptr<Process>> nodes;
  std::string cluster, base;
  Served() {
    coordinator = std::make_unique<Process>(
      std::vector<std::string>{exe, "node", "--coordinator", "--listen", "127.0.0.1:0", "--route-wait-ms", "15000"});
    cluster = coordinator->wait_line("ready coordinator ").substr(18);
    // One after the other: tests inject by the coordinator's node index (node 1
    // is the first "2-3", which has a replica), so the order they join is fixed.
    for (auto layers : {"0-1", "2-3", "2-3", "4"}) {
      nodes.push_back(std::make_unique<Process>(std::vector<std::string>{
        exe, "node", "--listen", "127.0.0.1:0", "--join", cluster, "--model", "builtin:tiny", "--layers", layers,
        "--threads", "1"}));
      nodes.back()->wait_line("ready node ");
    }
    server = std::make_unique<Process>(std::vector<std::string>{exe, "serve", "--cluster", cluster, "--http", "127.0.0.1:0",
                                                                "--max-body", "65536", "--allow-inject"});
    const auto line = server->wait_line("ready http ");
    base = line.empty() ? "" : "http://" + line.substr(11);
  }
  Http call(const std::string& path, const std::string& body = "", const std::string& extra = "") const {
    const std::string data = body.empty() ? "" : " --data-binary " + quote(body);
    const auto out = sh("curl -s -m 60 " + extra + " -w '\\n%{http_code}' " + data + " " + base + path);
    const auto nl = out.rfind('\n');
    return {nl == std::string::npos ? 0 : std::atoi(out.c_str() + nl + 1), nl == std::string::npos ? out : out.substr(0, nl)};
  }
};

Served* cluster_ = nullptr;

class Server : public ::testing::Test {
protected:
  static void SetUpTestSuite() {
    if (!have("curl"))
      return;
    cluster_ = new Served();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  void SetUp() override {
    if (!cluster_)
      GTEST_SKIP() << "curl is not installed (scripts/test installs it)";
    ASSERT_FALSE(cluster_->base.empty()) << "strata serve did not start";
  }
  const Served& c() const { return *cluster_; }
};

TEST_F(Server, CompletionsWithCurlEqualTheSingleProcessRun) {
  const std::string prompt = "Once upon a time";
  const auto expected = local_text(prompt, 40);
  auto r = c().call("/v1/completions", completion_body(prompt, 40, false));
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], expected);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], 40);
  EXPECT_EQ(j["usage"]["total_tokens"], j["usage"]["prompt_tokens"].get<int>() + 40);
  // Streamed (curl -N): the same text, a finish reason, usage on request, [DONE].
  auto s = c().call("/v1/completions",
                    completion_body(prompt, 40, true, R"("stream_options":{"include_usage":true},)"), "-N");
  ASSERT_EQ(s.status, 200);
  std::string finish;
  bool done = false;
  json usage;
  EXPECT_EQ(sse_text(s.body, &finish, &done, &usage), expected) << s.body;
  EXPECT_EQ(finish, "length");
  EXPECT_TRUE(done);
  EXPECT_EQ(usage["completion_tokens"], 40);
  // Chat (builtin: plain concatenation of the contents).
  auto ch = c().call("/v1/chat/completions",
                     R"({"messages":[{"role":"user","content":"Once upon a time"}],"max_tokens":40,"temperature":0})");
  ASSERT_EQ(ch.status, 200) << ch.body;
  EXPECT_EQ(json::parse(ch.body)["choices"][0]["message"]["content"], expected);
  auto cs = c().call("/v1/chat/completions",
                     R"({"messages":[{"role":"user","content":"Once upon a time"}],"max_tokens":40,"temperature":0,"stream":true})",
                     "-N");
  EXPECT_EQ(sse_text(cs.body), expected);
  // Models and health.
  auto m = c().call("/v1/models");
  EXPECT_EQ(json::parse(m.body)["data"][0]["id"], "builtin:tiny");
  auto h = c().call("/health");
  EXPECT_EQ(h.status, 200) << h.body;
  EXPECT_EQ(json::parse(h.body)["route_complete"], true);
}

TEST_F(Server, SamplingStopStringsAndSeeds) {
  const std::string prompt = "The cat";
  const auto expected = local_text(prompt, 40);
  const std::string stop = expected.substr(10, 3);
  auto r = c().call("/v1/completions", completion_body(prompt, 40, false, R"("stop":)" + json(stop).dump() + ","));
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["choices"][0]["text"], expected.substr(0, expected.find(stop)));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  const std::string sampled = R"({"prompt":"The cat","max_tokens":30,"temperature":0.9,"top_p":0.95,"top_k":40,"seed":42})";
  auto a = json::parse(c().call("/v1/completions", sampled).body);
  auto b = json::parse(c().call("/v1/completions", sampled).body);
  EXPECT_EQ(a["choices"][0]["text"], b["choices"][0]["text"]);
}

TEST_F(Server, BadRequestsGetClearErrors) {
  auto expect = [&](const std::string& path, const std::string& body, int status, const std::string& words) {
    auto r = c().call(path, body);
    EXPECT_EQ(r.status, status) << body << " -> " << r.body;
    auto j = json::parse(r.body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r.body;
    EXPECT_NE(j["error"]["message"].get<std::string>().find(words), std::string::npos) << r.body;
  };
  expect("/v1/completions", R"({"prompt":"Once upon a time","max_tokens":600})", 400,
         "maximum context length is 512 tokens. However, you requested 617 tokens (17 in the prompt, 600");
  expect("/v1/completions", "{not json", 400, "not valid JSON");
  expect("/v1/completions", R"({"prompt":"x","max_tokens":"ten"})", 400, "'max_tokens' must be an integer");
  expect("/v1/completions", R"({"prompt":"x","temperature":9})", 400, "'temperature' must be between 0 and 2");
  expect("/v1/completions", R"({"prompt":"x","top_p":-1})", 400, "'top_p' must be greater than 0");
  expect("/v1/completions", R"({"prompt":"x","top_k":-3})", 400, "'top_k' must be between 0");
  expect("/v1/completions", R"({"prompt":"x","n":30})", 400, "'n' must be between 1 and 16");
  expect("/v1/completions", R"({"prompt":"x","logprobs":99})", 400, "'logprobs' must be between 0 and 20");
  expect("/v1/completions", R"({"prompt":"x","echo":"yes"})", 400, "'echo' must be a boolean");
  expect("/v1/completions", R"({"prompt":"x","best_of":3})", 400, "not supported");
  expect("/v1/chat/completions", R"({"messages":"hi"})", 400, "'messages' must be a non-empty array");
  expect("/v1/completions", R"({"prompt":"x","pad":")" + std::string(70000, 'a') + "\"}", 413, "larger than the limit");
  expect("/v1/nothing", "", 404, "no such endpoint");
  expect("/v1/completions", "", 405, "not allowed");
  // The server is still serving.
  EXPECT_EQ(c().call("/v1/completions", completion_body("Once", 5, false)).status, 200);
}

TEST_F(Server, ThirtyTwoConcurrentStreamsEqualEachServedAlone) {
  std::vector<std::string> prompts;
  for (int i = 0; i < 32; ++i)
    prompts.push_back("Story " + std::to_string(i) + ":");
  std::vector<std::unique_ptr<Process>> running;
  for (auto& p : prompts)
    running.push_back(std::make_unique<Process>(std::vector<std::string>{
      "/bin/sh", "-c",
      "curl -sN -m 120 --data-binary " + quote(completion_body(p, 24, true)) + " " + c().base + "/v1/completions"}));
  std::vector<std::string> together;
  for (auto& r : running)
    together.push_back(sse_text(r->drain()));
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const auto alone = sse_text(c().call("/v1/completions", completion_body(prompts[i], 24, true), "-N").body);
    EXPECT_FALSE(alone.empty());
    EXPECT_EQ(together[i], alone) << prompts[i];
  }
}

// /metrics as {"name{labels}": value}; fails the test on a line that is not
// valid Prometheus text exposition.
std::map<std::string, double> scrape(const std::string& base) {
  const auto raw = sh("curl -s -m 60 -w '\\n%{http_code}' " + base + "/metrics");
  const auto nl = raw.rfind('\n');
  Http r{nl == std::string::npos ? 0 : std::atoi(raw.c_str() + nl + 1), nl == std::string::npos ? raw : raw.substr(0, nl)};
  EXPECT_EQ(r.status, 200);
  static const std::regex sample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? (-?[0-9.e+-]+|\+Inf|NaN)$)");
  static const std::regex meta(R"(^# (HELP [a-zA-Z_:][a-zA-Z0-9_:]* .*|TYPE [a-zA-Z_:][a-zA-Z0-9_:]* (counter|gauge|histogram|summary|untyped))$)");
  std::map<std::string, double> out;
  std::istringstream is(r.body);
  std::string line;
  while (std::getline(is, line)) {
    if (line.empty())
      continue;
    if (line[0] == '#') {
      EXPECT_TRUE(std::regex_match(line, meta)) << line;
      continue;
    }
    EXPECT_TRUE(std::regex_match(line, sample)) << line;
    const auto sp = line.rfind(' ');
    out[line.substr(0, sp)] = std::stod(line.substr(sp + 1));
  }
  return out;
}

TEST_F(Server, MetricsParseAndMoveWithRequestsAndAnEviction) {
  auto before = scrape(c().base);
  ASSERT_TRUE(before.count("strata_route_epoch"));
  EXPECT_EQ(before["strata_route_complete"], 1);
  const std::string ok = R"(strata_http_requests_total{endpoint="/v1/completions",status="200"})";
  const std::string bad = R"(strata_http_requests_total{endpoint="/v1/completions",status="400"})";
  const std::string lru = R"(strata_session_cache_misses_total{reason="evicted_lru"})";
  ASSERT_EQ(c().call("/v1/completions", completion_body("Once", 10, false)).status, 200);
  ASSERT_EQ(c().call("/v1/completions", completion_body("Twice", 10, false)).status, 200);
  ASSERT_EQ(c().call("/v1/completions", R"({"prompt":"x","n":0})").status, 400);
  // A long stream; once it runs, every shard drops all its sessions.
  const std::string prompt = "Once upon a time";
  const auto expected = local_text(prompt, 480);
  Process stream({"/bin/sh", "-c",
                  "curl -sN -m 120 --data-binary " + quote(completion_body(prompt, 480, true)) + " " + c().base +
                    "/v1/completions"});
  const auto first = stream.wait_line("data: ");
  ASSERT_FALSE(first.empty());
  for (int node = 0; node < 4; ++node)
    EXPECT_EQ(c().call("/v1/cluster/inject", R"({"kind":"evict","node":)" + std::to_string(node) + "}",
                     "-H 'Content-Type: application/json'").status,
              200);
  EXPECT_EQ(sse_text(stream.drain()), expected); // drain() includes the lines already read
  auto after = scrape(c().base);
  EXPECT_EQ(after[ok] - before[ok], 3);
  EXPECT_EQ(after[bad] - before[bad], 1);
  EXPECT_GE(after["strata_tokens_generated_total"] - before["strata_tokens_generated_total"], 500);
  EXPECT_GE(after[lru] - before[lru], 1);
  EXPECT_GE(after["strata_reprefills_total"] - before["strata_reprefills_total"], 1);
  // Every hop lost the session: each rebuilt, from the prefix cache where the
  // evicted session's full blocks were still cached, never more than a full re-prefill.
  const double full = after["strata_full_reprefill_layer_tokens_total"] - before["strata_full_reprefill_layer_tokens_total"];
  EXPECT_GE(full, 1);
  EXPECT_LE(after["strata_recomputed_layer_tokens_total"] - before["strata_recomputed_layer_tokens_total"], full);
  EXPECT_GE(after["strata_time_to_first_token_seconds_count"] - before["strata_time_to_first_token_seconds_count"], 3);
}

// serve --speculate (prompt lookup) and serve --draft-model (builtin:tiny as
// its own draft): 8 requests at once (streamed and not) to a speculating server
// answer exactly what the plain server answers, and /metrics counts the
// proposals and the trips.
TEST_F(Server, SpeculatingServeAnswersAsThePlainOneAndCountsProposals) {
  for (const std::vector<std::string>& how :
       {std::vector<std::string>{"--speculate", "6"},
        std::vector<std::string>{"--draft-model", "builtin:tiny", "--draft-max-sessions", "0"},
        std::vector<std::string>{"--draft-model", "builtin:tiny"}}) { // (the default: one session drafts at a time)
    const bool limited = how[0] == "--draft-model" && how.size() == 2;
    SCOPED_TRACE(how[0] + (limited ? " (at most one drafting)" : ""));
    std::vector<std::string> args{exe, "serve", "--cluster", c().cluster, "--http", "127.0.0.1:0"};
    args.insert(args.end(), how.begin(), how.end());
    Process spec(args);
    const auto line = spec.wait_line("ready http ");
    ASSERT_FALSE(line.empty());
    const std::string sbase = "http://" + line.substr(11);
    std::vector<std::string> prompts;
    for (int i = 0; i < 8; ++i)
      prompts.push_back("a b c " + std::to_string(i) + " a b c " + std::to_string(i) + " a b c");
    std::vector<std::unique_ptr<Process>> running;
    for (std::size_t i = 0; i < prompts.size(); ++i)
      running.push_back(std::make_unique<Process>(std::vector<std::string>{
        "/bin/sh", "-c",
        "curl -sN -m 120 --data-binary " + quote(completion_body(prompts[i], 48, i % 2 == 0)) + " " + sbase +
          "/v1/completions"}));
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      const auto body = running[i]->drain();
      const std::string got = i % 2 == 0 ? sse_text(body) : json::parse(body)["choices"][0]["text"].get<std::string>();
      const auto plain = json::parse(c().call("/v1/completions", completion_body(prompts[i], 48, false)).body);
      EXPECT_EQ(got, plain["choices"][0]["text"].get<std::string>()) << prompts[i];
    }
    auto m = scrape(sbase);
    if (how[0] == "--draft-model") { // the drafter's own counts
      EXPECT_EQ(m["strata_draft_max_sessions"], limited ? 1 : 0);
      EXPECT_EQ(m["strata_draft_declined_total"], m["strata_speculative_declined_total"])
        << "every empty answer the sessions counted was a decline";
      EXPECT_LE(m["strata_draft_sessions"], 8);
      EXPECT_GE(m["strata_draft_positions_total"], m["strata_draft_passes_total"]);
    } else {
      EXPECT_EQ(m.count("strata_draft_passes_total"), 0u) << "no draft model, no draft metrics";
    }
    if (limited) { // requests at once: some are declined, every answer as plain (above)
      EXPECT_GT(m["strata_draft_declined_total"] + m["strata_draft_proposals_total"], 0) << "the draft model was asked";
      continue;
    }
    EXPECT_EQ(m["strata_speculative_declined_total"], 0) << "no limit: never declined";
    EXPECT_GT(m["strata_speculative_proposed_tokens_total"], 0);
    EXPECT_LE(m["strata_speculative_accepted_tokens_total"], m["strata_speculative_proposed_tokens_total"]);
    if (how[0] == "--draft-model") {
      EXPECT_EQ(m["strata_speculative_accepted_tokens_total"], m["strata_speculative_proposed_tokens_total"])
        << "the model as its own draft: every proposal taken";
      EXPECT_GT(m["strata_draft_passes_total"], 0);
      EXPECT_EQ(m["strata_draft_declined_total"], 0);
    }
    EXPECT_GT(m["strata_session_trips_total"], 0);
    EXPECT_LT(m["strata_session_trips_total"], m["strata_session_tokens_total"]);
    std::printf("speculating serve (%s): %.0f proposed, %.0f accepted, %.0f trips for %.0f tokens\n", how[0].c_str(),
                m["strata_speculative_proposed_tokens_total"], m["strata_speculative_accepted_tokens_total"],
                m["strata_session_trips_total"], m["strata_session_tokens_total"]);
  }
}

// A draft model under its default crowd limit, 8 long streams at once, and
// every node evicting every session while they run: each answer is the plain
// server's answer to the same request alone, and the sessions recovered.
TEST_F(Server, DraftingCrowdThroughAnEvictionAnswersAsAlone) {
  Process spec({exe, "serve", "--cluster", c().cluster, "--http", "127.0.0.1:0", "--draft-model", "builtin:tiny"});
  const auto line = spec.wait_line("ready http ");
  ASSERT_FALSE(line.empty());
  const std::string sbase = "http://" + line.substr(11);
  const std::string lru = R"(strata_session_cache_misses_total{reason="evicted_lru"})";
  std::vector<std::string> prompts;
  std::vector<std::unique_ptr<Process>> running;
  for (int i = 0; i < 8; ++i) {
    prompts.push_back("Once upon a time " + std::to_string(i));
    running.push_back(std::make_unique<Process>(std::vector<std::string>{
      "/bin/sh", "-c",
      "curl -sN -m 120 --data-binary " + quote(completion_body(prompts.back(), 480, true)) + " " + sbase +
        "/v1/completions"}));
  }
  ASSERT_FALSE(running.back()->wait_line("data: ").empty()); // the last one started: all are generating
  for (int node = 0; node < 4; ++node) // (through the shared server: the one started with --allow-inject)
    EXPECT_EQ(c().call("/v1/cluster/inject", R"({"kind":"evict","node":)" + std::to_string(node) + "}",
                       "-H 'Content-Type: application/json'").status,
              200);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const auto got = sse_text(running[i]->drain());
    const auto alone = json::parse(c().call("/v1/completions", completion_body(prompts[i], 480, false)).body);
    EXPECT_EQ(got, alone["choices"][0]["text"].get<std::string>()) << prompts[i];
  }
  auto m = scrape(sbase);
  EXPECT_GE(m[lru], 1) << "the eviction reached sessions that were running";
  EXPECT_GE(m["strata_reprefills_total"], 1);
  EXPECT_GT(m["strata_draft_declined_total"], 0) << "8 at once against a limit of 1";
  EXPECT_EQ(m["strata_draft_declined_total"], m["strata_speculative_declined_total"]);
}

TEST_F(Server, ClientThatDisconnectsCancelsAndFreesCaches) {
  auto before = scrape(c().base);
  // head closes the pipe after the first bytes; curl then drops the connection.
  sh("curl -sN -m 60 --data-binary " + quote(completion_body("Once upon a time", 480, true)) + " " + c().base +
     "/v1/completions | head -c 100 >/dev/null");
  std::map<std::string, double> after;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  do
    after = scrape(c().base);
  while (after["strata_cancelled_total"] == before["strata_cancelled_total"] &&
         std::chrono::steady_clock::now() < deadline);
  EXPECT_EQ(after["strata_cancelled_total"] - before["strata_cancelled_total"], 1);
  EXPECT_LT(after["strata_tokens_generated_total"] - before["strata_tokens_generated_total"], 480);
  // Every shard let go of the session.
  do {
    after = scrape(c().base);
    double sessions = 0;
    for (auto& [k, v] : after)
      if (k.rfind("strata_shard_sessions{", 0) == 0)
        sessions += v;
    if (sessions == 0)
      break;
  } while (std::chrono::steady_clock::now() < deadline);
  for (auto& [k, v] : after)
    if (k.rfind("strata_shard_sessions{", 0) == 0) {
      EXPECT_EQ(v, 0) << k;
    }
}

TEST_F(Server, OfficialOpenAINpmClient) {
  const std::filesystem::path npm = std::filesystem::path(STRATA_BINARY_DIR) / "npm";
  if (!have("node") || !std::filesystem::exists(npm / "node_modules" / "openai"))
    GTEST_SKIP() << "the openai npm client is not installed in " << npm << " (scripts/test installs it)";
  std::filesystem::copy_file(STRATA_OPENAI_SCRIPT, npm / "openai_client.mjs",
                             std::filesystem::copy_options::overwrite_existing);
  const std::string prompt = "Once upon a time";
  const auto expected = local_text(prompt, 30);
  const auto out = sh("node " + (npm / "openai_client.mjs").string() + " " + c().base + "/v1 " + quote(prompt) + " 30");
  auto j = json::parse(out.substr(out.find('{')), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  EXPECT_EQ(j["completion"], expected);
  EXPECT_EQ(j["completion_finish"], "length");
  EXPECT_EQ(j["completion_tokens"], 30);
  EXPECT_EQ(j["completion_stream"], expected);
  EXPECT_EQ(j["completion_stream_finish"], "length");
  EXPECT_EQ(j["chat"], expected);
  EXPECT_EQ(j["chat_role"], "assistant");
  EXPECT_EQ(j["chat_stream"], expected);
  EXPECT_NE(j["too_long"].get<std::string>().find("400"), std::string::npos) << j["too_long"];
  EXPECT_EQ(j["retrieved"], "builtin:tiny"); // models.retrieve()
  EXPECT_EQ(j["missing"], "404 model_not_found");
  EXPECT_EQ(j["wrong_model"], "404 model_not_found");
  // n, logprobs and penalties through the official client.
  EXPECT_EQ(j["n_indices"], json::array({0, 1}));
  ASSERT_EQ(j["n_texts"].size(), 2u);
  EXPECT_EQ(j["completion_logprobs"]["tokens"].size(), 30u) << j["completion_logprobs"];
  EXPECT_EQ(j["completion_logprobs"]["top_logprobs"][0].size(), 2u);
  std::string spelled;
  for (auto& e : j["chat_logprobs"]) {
    spelled += e["token"].get<std::string>();
    EXPECT_EQ(e["top_logprobs"].size(), 3u);
  }
  EXPECT_EQ(spelled, j["chat_text"]);
  EXPECT_EQ(j["penalized"][0], j["penalized"][1]) << "seeded: the same text twice";
  EXPECT_EQ(j["chat_stream_logprobs"], 30);
}

TEST_F(Server, MinPIsReproducibleWithASeedAndEqualsTheSingleProcessRun) {
  const std::string body = R"({"prompt":"Once upon a time","max_tokens":40,"temperature":1.0,"min_p":0.2,"seed":11})";
  auto a = c().call("/v1/completions", body);
  auto b = c().call("/v1/completions", body);
  ASSERT_EQ(a.status, 200) << a.body;
  const auto text = json::parse(a.body)["choices"][0]["text"];
  EXPECT_EQ(json::parse(b.body)["choices"][0]["text"], text);
  const auto local = sh(exe + " generate --model builtin:tiny --prompt 'Once upon a time' --max-tokens 40 "
                              "--temperature 1 --min-p 0.2 --seed 11 2>/dev/null");
  const auto expected = json::parse(json(local.substr(16, local.size() - 17)).dump(-1, ' ', false,
                                                                                    json::error_handler_t::replace));
  EXPECT_EQ(text, expected);
  // A different min_p changes the draw; one out of range is a 400 naming it.
  auto other = c().call("/v1/completions", R"({"prompt":"Once upon a time","max_tokens":40,"temperature":1.0,"seed":11})");
  EXPECT_NE(json::parse(other.body)["choices"][0]["text"], text);
  auto bad = c().call("/v1/completions", R"({"prompt":"x","min_p":1.5})");
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(json::parse(bad.body)["error"]["param"], "min_p");
}

TEST_F(Server, TokenizeAndDetokenizeInLlamaServerShapes) {
  const std::string text = "Once upon a time, \u00e9t\u00e9!";
  auto t = c().call("/tokenize", json{{"content", text}, {"add_special", true}}.dump());
  ASSERT_EQ(t.status, 200) << t.body;
  const auto ids = json::parse(t.body)["tokens"].get<std::vector<int32_t>>();
  // The same ids as the command line's tokenizer (the model's own: builtin:bytes, BOS first).
  std::string cli = sh(exe + " tokenize --tokenizer builtin:bytes --bos --text " + quote(text));
  std::vector<int32_t> expected;
  std::istringstream is(cli);
  for (int32_t id; is >> id;)
    expected.push_back(id);
  EXPECT_EQ(ids, expected);
  auto d = c().call("/detokenize", json{{"tokens", std::vector<int32_t>(ids.begin() + 1, ids.end())}}.dump());
  ASSERT_EQ(d.status, 200) << d.body;
  EXPECT_EQ(json::parse(d.body)["content"], text);
  auto pieces = json::parse(c().call("/tokenize", json{{"content", "Hi"}, {"with_pieces", true}}.dump()).body);
  ASSERT_EQ(pieces["tokens"].size(), 2u) << pieces;
  EXPECT_EQ(pieces["tokens"][0]["piece"], "H");
  auto bad = c().call("/detokenize", R"({"tokens":[1,99999]})");
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(json::parse(bad.body)["error"]["param"], "tokens");
  EXPECT_EQ(c().call("/tokenize", R"({"text":"x"})").status, 400);
}

TEST_F(Server, ModelsByIdServedNameAndModelNotFound) {
  auto list = json::parse(c().call("/v1/models").body);
  EXPECT_EQ(list["data"][0]["id"], "builtin:tiny");
  EXPECT_EQ(list["data"][0]["architecture"], "llama");
  EXPECT_FALSE(list["data"][0].contains("experts")) << "a dense model";
  auto one = c().call("/v1/models/builtin:tiny");
  EXPECT_EQ(one.status, 200) << one.body;
  EXPECT_EQ(json::parse(one.body)["id"], "builtin:tiny");
  auto none = c().call("/v1/models/gpt-4");
  EXPECT_EQ(none.status, 404);
  EXPECT_EQ(json::parse(none.body)["error"]["code"], "model_not_found");
  auto wrong = c().call("/v1/completions", R"({"model":"gpt-4","prompt":"Once","max_tokens":3})");
  EXPECT_EQ(wrong.status, 404) << wrong.body;
  EXPECT_EQ(json::parse(wrong.body)["error"]["param"], "model");
  auto right = c().call("/v1/completions", R"({"model":"builtin:tiny","prompt":"Once","max_tokens":3,"temperature":0})");
  EXPECT_EQ(right.status, 200) << right.body;
  EXPECT_EQ(json::parse(right.body)["model"], "builtin:tiny");
  // --served-model-name: the id clients use and the one answers carry.
  Process named({exe, "serve", "--cluster", c().cluster, "--http", "127.0.0.1:0", "--served-model-name", "tiny-story"});
  const auto line = named.wait_line("ready http ");
  ASSERT_FALSE(line.empty());
  const std::string base = "http://" + line.substr(11);
  EXPECT_NE(sh("curl -s " + base + "/v1/models").find("\"id\":\"tiny-story\""), std::string::npos);
  auto r = json::parse(sh("curl -s --data-binary " +
                          quote(R"({"model":"tiny-story","prompt":"Once","max_tokens":3,"temperature":0})") + " " + base +
                          "/v1/completions"),
                       nullptr, false);
  ASSERT_TRUE(r.is_object());
  EXPECT_EQ(r["model"], "tiny-story") << r;
  EXPECT_EQ(r["choices"][0]["text"], json::parse(right.body)["choices"][0]["text"]);
}

TEST_F(Server, ChatTemplateFileRendersTheChatAndApplyTemplateShowsIt) {
  // A Zephyr-style template (TinyLlama-Chat ships this shape) given with
  // --chat-template: /apply-template returns the prompt, a chat equals the
  // completion of that prompt, a refusal by the template is a 400 naming it.
  const auto dir = std::filesystem::temp_directory_path() / ("strata-tpl-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto file = dir / "chat.jinja";
  std::ofstream(file) << "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('start with a user turn') }}{% endif %}\n"
                         "{% for message in messages %}\n"
                         "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim }}\n"
                         "{% endfor %}\n"
                         "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}\n"
                         "{% if greeting is defined %}{{ greeting }}{% endif %}\n";
  Process served({exe, "serve", "--cluster", c().cluster, "--http", "127.0.0.1:0", "--chat-template", file.string()});
  const auto line = served.wait_line("ready http ");
  ASSERT_FALSE(line.empty());
  const std::string base = "http://" + line.substr(11);
  const auto post = [&](const std::string& path, const json& body) {
    const auto out = sh("curl -s -w '\\n%{http_code}' --data-binary " + quote(body.dump()) + " " + base + path);
    const auto nl = out.rfind('\n');
    return Http{std::atoi(out.c_str() + nl + 1), out.substr(0, nl)};
  };
  const json messages = json::array({{{"role", "system"}, {"content", "Be brief. "}},
                                     {{"role", "user"}, {"content", "  Once upon"}}});
  auto applied = post("/apply-template", {{"messages", messages}});
  ASSERT_EQ(applied.status, 200) << applied.body;
  const std::string prompt = json::parse(applied.body)["prompt"];
  // (The newline after each {{ }} stays: trim_blocks only eats one after a block tag.)
  EXPECT_EQ(prompt, "<|system|>\nBe brief.\n<|user|>\nOnce upon\n<|assistant|>\n");
  auto kw = post("/apply-template", {{"messages", messages}, {"chat_template_kwargs", {{"greeting", "Hi!"}}}});
  EXPECT_EQ(json::parse(kw.body)["prompt"], prompt + "Hi!") << kw.body;
  // add_generation_prompt is the request's; tools this template never mentions are a 400, not dropped.
  auto closed = post("/apply-template", {{"messages", messages}, {"add_generation_prompt", false}});
  EXPECT_EQ(json::parse(closed.body)["prompt"], "<|system|>\nBe brief.\n<|user|>\nOnce upon\n") << closed.body;
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "f"}}])");
  auto no_tools = post("/v1/chat/completions", {{"messages", messages}, {"tools", tools}});
  EXPECT_EQ(no_tools.status, 400) << no_tools.body;
  EXPECT_EQ(json::parse(no_tools.body)["error"]["param"], "tools") << no_tools.body;
  auto chat = post("/v1/chat/completions", {{"messages", messages}, {"max_tokens", 8}, {"temperature", 0}});
  ASSERT_EQ(chat.status, 200) << chat.body;
  // The template decides about BOS (this one has none): the same ids as a completion.
  auto ids = json::parse(post("/tokenize", {{"content", prompt}}).body)["tokens"];
  auto completion = post("/v1/completions", {{"prompt", ids}, {"max_tokens", 8}, {"temperature", 0}});
  ASSERT_EQ(completion.status, 200) << completion.body;
  EXPECT_EQ(json::parse(chat.body)["choices"][0]["message"]["content"], json::parse(completion.body)["choices"][0]["text"]);
  EXPECT_EQ(json::parse(chat.body)["usage"]["prompt_tokens"], json::parse(completion.body)["usage"]["prompt_tokens"]);
  auto refused = post("/v1/chat/completions", {{"messages", json::array({{{"role", "assistant"}, {"content", "x"}}})}});
  EXPECT_EQ(refused.status, 400) << refused.body;
  EXPECT_NE(refused.body.find("start with a user turn"), std::string::npos) << refused.body;
  // A template the engine cannot run stops serve at start, naming the line.
  std::ofstream(dir / "bad.jinja") << "ok\n{% include 'other.jinja' %}";
  const auto err = sh(exe + " serve --cluster " + c().cluster + " --http 127.0.0.1:0 --chat-template " +
                      quote((dir / "bad.jinja").string()) + " 2>&1; echo exit=$?");
  EXPECT_NE(err.find("exit=1"), std::string::npos) << err;
  EXPECT_NE(err.find("line 2"), std::string::npos) << err;
  EXPECT_NE(err.find("unsupported statement 'include'"), std::string::npos) << err;
  std::filesystem::remove_all(dir);
}

// A serve with a Hermes-style template (tools, <tool_call> syntax) on the shared cluster.
struct HermesServe {
  std::filesystem::path dir;
  std::unique_ptr<Process> served;
  std::string base;
  explicit HermesServe(const std::string& cluster) {
    dir = std::filesystem::temp_directory_path() / ("strata-structured-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "hermes.jinja")
      << "{% if tools %}<tools>{% for t in tools %}{{ t.function | tojson }}{% endfor %}</tools>\n{% endif %}"
         "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
         "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}";
    served = std::make_unique<Process>(std::vector<std::string>{exe, "serve", "--cluster", cluster, "--http", "127.0.0.1:0",
                                                                "--allow-inject", "--chat-template",
                                                                (dir / "hermes.jinja").string()});
    const auto line = served->wait_line("ready http ");
    base = line.empty() ? "" : "http://" + line.substr(11);
  }
  ~HermesServe() { std::filesystem::remove_all(dir); }
  std::string call(const std::string& path, const json& b, const std::string& extra = "") const {
    return sh("curl -s -m 120 " + extra + " --data-binary " + quote(b.dump()) + " " + base + path);
  }
};

TEST_F(Server, AToolRoundThroughAHermesTemplateAnswersWithTheModelsText) {
  // A template that takes tools and writes Hermes calls: a tool round renders,
  // and the reply goes through the tool-call parser. The random model writes no
  // call, so its text comes back whole: streamed equals not streamed, no
  // tool_calls, an ordinary finish_reason.
  HermesServe h(c().cluster);
  ASSERT_FALSE(h.base.empty());
  const std::string& base = h.base;
  const json body = json::parse(R"({"messages": [
      {"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "-3"},
      {"role": "user", "content": "So?"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "max_tokens": 12, "temperature": 0})");
  const auto call = [&](const std::string& path, json b, const std::string& extra = "") {
    return sh("curl -s " + extra + " --data-binary " + quote(b.dump()) + " " + base + path);
  };
  const auto applied = json::parse(call("/apply-template", body), nullptr, false);
  ASSERT_TRUE(applied.contains("prompt")) << applied;
  const auto prompt = applied["prompt"].get<std::string>();
  // (trim_blocks eats the newline after each {% endfor %}.)
  EXPECT_EQ(prompt, "<tools>{\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}</tools>\n"
                    "<|user|>Weather?<|assistant|><tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                    "\"Oslo\"}}</tool_call><|tool|>-3<|user|>So?<|assistant|>");
  const auto whole = json::parse(call("/v1/chat/completions", body), nullptr, false);
  ASSERT_TRUE(whole.is_object());
  const auto& choice = whole["choices"][0];
  EXPECT_FALSE(choice["message"].contains("tool_calls")) << whole;
  EXPECT_EQ(choice["finish_reason"], "length") << whole;
  json streamed_body = body;
  streamed_body["stream"] = true;
  std::string finish;
  EXPECT_EQ(sse_text(call("/v1/chat/completions", streamed_body, "-N"), &finish), choice["message"]["content"]);
  EXPECT_EQ(finish, "length");
  // A crowd: 8 tool rounds with other questions at once, streamed and not, while
  // a cache is evicted and the route epoch bumped; each equals its answer alone.
  std::vector<json> bodies;
  std::vector<std::string> alone;
  for (int k = 0; k < 8; ++k) {
    json b = body;
    b["messages"][3]["content"] = "So? (" + std::to_string(k) + ")";
    b["max_tokens"] = 24;
    b["stream"] = k % 2 == 1;
    bodies.push_back(b);
    json whole_b = b;
    whole_b["stream"] = false;
    alone.push_back(json::parse(call("/v1/chat/completions", whole_b))["choices"][0]["message"]["content"]);
  }
  std::vector<std::unique_ptr<Process>> crowd;
  for (auto& b : bodies)
    crowd.push_back(std::make_unique<Process>(std::vector<std::string>{
      "/bin/sh", "-c", "curl -sN -m 60 --data-binary " + quote(b.dump()) + " " + base + "/v1/chat/completions"}));
  const std::string json_type = "-H 'Content-Type: application/json'";
  EXPECT_EQ(call("/v1/cluster/inject", {{"kind", "evict"}, {"node", 0}}, json_type).find("error"), std::string::npos);
  EXPECT_EQ(call("/v1/cluster/inject", {{"kind", "epoch"}}, json_type).find("error"), std::string::npos);
  for (std::size_t k = 0; k < crowd.size(); ++k) {
    const auto out = crowd[k]->drain();
    const auto text = bodies[k]["stream"] ? sse_text(out)
                                          : json::parse(out)["choices"][0]["message"]["content"].get<std::string>();
    EXPECT_EQ(text, alone[k]) << "request " << k << ": " << out;
  }
}

TEST_F(Server, StructuredOutputsAndForcedToolCallsThroughTheOfficialClientValidate) {
  const std::filesystem::path npm = std::filesystem::path(STRATA_BINARY_DIR) / "npm";
  for (const char* p : {"openai", "ajv", "ajv-formats", "zod"})
    if (!have("node") || !std::filesystem::exists(npm / "node_modules" / p))
      GTEST_SKIP() << "the npm package " << p << " is not installed in " << npm << " (scripts/test installs it)";
  HermesServe h(c().cluster);
  ASSERT_FALSE(h.base.empty());
  std::filesystem::copy_file(STRATA_STRUCTURED_SCRIPT, npm / "structured_client.mjs",
                             std::filesystem::copy_options::overwrite_existing);
  const auto out = sh("node " + (npm / "structured_client.mjs").string() + " " + h.base + "/v1");
  auto j = json::parse(out.substr(std::min(out.find('{'), out.size())), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  // 100 seeded generations over 10 schemas, 8 at a time: all finish and validate (ajv).
  EXPECT_EQ(j["schema_runs"], 100);
  EXPECT_EQ(j["schema_valid"], 100) << j["schema_failures"].dump(1);
  EXPECT_GT(j["distinct_texts"].get<int>(), 50) << "seeded sampling, not one canned reply";
  EXPECT_EQ(j["zod_ok"], true) << j["zod_parsed"];
  if (j["json_object_finish"] == "stop") {
    EXPECT_TRUE(json::parse(j["json_object_text"].get<std::string>(), nullptr, false).is_object()) << j["json_object_text"];
  }
  // tool_choice required: one call (parallel_tool_calls false) of an offered tool, arguments valid.
  EXPECT_EQ(j["required_finish"], "tool_calls");
  ASSERT_EQ(j["required_calls"].size(), 1u) << j;
  EXPECT_EQ(j["required_calls"][0]["valid"], true) << j["required_calls"];
  EXPECT_TRUE(j["required_content"].is_null()) << j["required_content"];
  ASSERT_EQ(j["named_calls"].size(), 1u) << j;
  EXPECT_EQ(j["named_calls"][0]["name"], "time");
  EXPECT_EQ(j["named_calls"][0]["valid"], true);
  // Streamed deltas assemble into the same call as the whole reply (same seed).
  ASSERT_EQ(j["stream_calls"].size(), 1u) << j;
  EXPECT_EQ(j["stream_calls"][0]["name"], j["required_calls"][0]["name"]);
  EXPECT_EQ(j["stream_calls"][0]["arguments"], j["required_calls"][0]["arguments"]);
  EXPECT_EQ(j["stream_finish"], "tool_calls");
  EXPECT_EQ(j["answer_is_text"], true);
  EXPECT_NE(j["bad_schema"].get<std::string>().find("400"), std::string::npos) << j["bad_schema"];
  EXPECT_NE(j["bad_schema"].get<std::string>().find("'multipleOf' is not supported"), std::string::npos) << j["bad_schema"];
}

TEST_F(Server, ConstrainedAndFreeRequestsInACrowdWithFaultsEqualEachAlone) {
  HermesServe h(c().cluster);
  ASSERT_FALSE(h.base.empty());
  const json schema = json::parse(R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}, "required": ["name", "n", "tags"]})");
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "lookup",
      "parameters": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 6}}, "required": ["q"]}}}])");
  std::vector<json> bodies;
  for (int k = 0; k < 8; ++k) {
    json b = {{"messages", {{{"role", "user"}, {"content", "Question " + std::to_string(k)}}}},
              {"max_tokens", 200}, {"temperature", 0.8}, {"seed", 40 + k}, {"stream", k % 2 == 1}};
    if (k < 4)
      b["response_format"] = {{"type", "json_schema"}, {"json_schema", {{"name", "r"}, {"schema", schema}}}};
    else if (k < 6)
      b["tools"] = tools, b["tool_choice"] = "required";
    bodies.push_back(b);
  }
  // What each request gives alone (not streamed): content, or its calls.
  auto answer = [](const json& reply) {
    const auto& m = reply["choices"][0]["message"];
    return m.contains("tool_calls") ? m["tool_calls"][0]["function"].dump() : m["content"].dump();
  };
  auto streamed_answer = [](const std::string& sse) {
    std::string content, name, args;
    std::istringstream in(sse);
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("data: {", 0) != 0)
        continue;
      const auto d = json::parse(line.substr(6))["choices"][0]["delta"];
      if (d.contains("content") && d["content"].is_string())
        content += d["content"].get<std::string>();
      for (const auto& tc : d.value("tool_calls", json::array())) {
        name += tc["function"].value("name", "");
        args += tc["function"].value("arguments", "");
      }
    }
    return name.empty() ? json(content).dump() : json({{"name", name}, {"arguments", args}}).dump();
  };
  std::vector<std::string> alone;
  for (auto b : bodies) {
    b["stream"] = false;
    const auto r = json::parse(h.call("/v1/chat/completions", b), nullptr, false);
    ASSERT_TRUE(r.contains("choices")) << r;
    alone.push_back(answer(r));
    if (b.contains("response_format")) {
      const auto v = json::parse(r["choices"][0]["message"]["content"].get<std::string>(), nullptr, false);
      ASSERT_TRUE(v.is_object() && v.contains("name") && v.contains("n") && v.contains("tags")) << r;
      EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
    }
  }
  std::vector<std::unique_ptr<Process>> crowd;
  for (auto& b : bodies)
    crowd.push_back(std::make_unique<Process>(std::vector<std::string>{
      "/bin/sh", "-c", "curl -sN -m 120 --data-binary " + quote(b.dump()) + " " + h.base + "/v1/chat/completions"}));
  const std::string json_type = "-H 'Content-Type: application/json'";
  EXPECT_EQ(h.call("/v1/cluster/inject", {{"kind", "evict"}, {"node", 0}}, json_type).find("error"), std::string::npos);
  EXPECT_EQ(h.call("/v1/cluster/inject", {{"kind", "epoch"}}, json_type).find("error"), std::string::npos);
  for (std::size_t k = 0; k < crowd.size(); ++k) {
    const auto out = crowd[k]->drain();
    const auto got = bodies[k]["stream"] ? streamed_answer(out) : answer(json::parse(out));
    EXPECT_EQ(got, alone[k]) << "request " << k << ": " << out;
  }
  // Bad schemas and tool choices: a 400 naming the field.
  const json ask = {{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"max_tokens", 4}};
  auto status_of = [&](json b) {
    const auto out = sh("curl -s -m 60 -o /dev/null -w '%{http_code}' --data-binary " + quote(b.dump()) + " " + h.base +
                        "/v1/chat/completions");
    const auto body = h.call("/v1/chat/completions", b);
    return out + " " + body;
  };
  json b1 = ask;
  b1["response_format"] = json::parse(R"({"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object",
      "properties": {"a": {"type": "number", "multipleOf": 3}}}}})");
  const auto r1 = status_of(b1);
  EXPECT_EQ(r1.substr(0, 3), "400") << r1;
  EXPECT_NE(r1.find("response_format.json_schema.schema.properties.a: 'multipleOf' is not supported"), std::string::npos) << r1;
  json b2 = ask;
  b2["response_format"] = {{"type", "json_schema"}, {"json_schema", {{"schema", schema}}}};
  EXPECT_NE(status_of(b2).find("response_format.json_schema.name"), std::string::npos);
  json b3 = ask;
  b3["response_format"] = {{"type", "yaml"}};
  EXPECT_NE(status_of(b3).find("response_format.type"), std::string::npos);
  json b4 = ask;
  b4["tools"] = tools;
  b4["tool_choice"] = {{"type", "function"}, {"function", {{"name", "nope"}}}};
  EXPECT_NE(status_of(b4).find("tool_choice.function.name"), std::string::npos);
  json b5 = ask;
  b5["tools"] = json::parse(R"J([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"s": {"type": "string", "pattern": "(?!x)"}}}}}])J");
  b5["tool_choice"] = "required";
  const auto r5 = status_of(b5);
  EXPECT_EQ(r5.substr(0, 3), "400") << r5;
  EXPECT_NE(r5.find("tools[0].function.parameters.properties.s: 'pattern' is not supported here: lookarounds"), std::string::npos) << r5;
}

// echo with logprobs (what log-likelihood evaluation sends): the prompt comes
// back scored; scoring a prompt that ends in a generated text gives that text's
// tokens the log-probabilities they had when they were generated.
TEST_F(Server, EchoScoresThePromptAsTheGenerationDid) {
  const std::string prompt = "Once upon a time";
  auto gen = c().call("/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 2})");
  ASSERT_EQ(gen.status, 200) << gen.body;
  const auto g = json::parse(gen.body)["choices"][0];
  const auto text = g["text"].get<std::string>();
  const auto& glp = g["logprobs"];
  ASSERT_EQ(glp["token_logprobs"].size(), 6u);
  const json body = {{"prompt", prompt + text}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 2}, {"temperature", 0}};
  auto e = c().call("/v1/completions", body.dump());
  ASSERT_EQ(e.status, 200) << e.body;
  const auto j = json::parse(e.body);
  const auto& ch = j["choices"][0];
  EXPECT_EQ(ch["text"], prompt + text);
  EXPECT_EQ(ch["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], 0);
  const auto& lp = ch["logprobs"];
  const auto n = lp["tokens"].size();
  ASSERT_EQ(n, j["usage"]["prompt_tokens"].get<std::size_t>());
  ASSERT_EQ(lp["token_logprobs"].size(), n);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  std::string spelled;
  for (std::size_t k = 0; k < n; ++k) {
    EXPECT_EQ(lp["text_offset"][k], spelled.size());
    spelled += lp["tokens"][k].get<std::string>();
  }
  EXPECT_EQ(spelled.substr(spelled.size() - (prompt + text).size()), prompt + text);
  for (std::size_t k = 0; k < 6; ++k) {
    EXPECT_NEAR(lp["token_logprobs"][n - 6 + k].get<double>(), glp["token_logprobs"][k].get<double>(), 1e-4) << k;
    EXPECT_EQ(lp["top_logprobs"][n - 6 + k].size(), 2u);
    EXPECT_EQ(lp["tokens"][n - 6 + k], glp["tokens"][k]);
  }
  // echo while generating: the prompt, then the completion and its tokens after the prompt's.
  auto both = c().call("/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": true})");
  ASSERT_EQ(both.status, 200) << both.body;
  const auto b = json::parse(both.body)["choices"][0];
  EXPECT_EQ(b["text"], prompt + text);
  const auto m = b["logprobs"]["tokens"].size();
  ASSERT_GE(m, 6u);
  for (std::size_t k = 0; k < 6; ++k)
    EXPECT_EQ(b["logprobs"]["token_logprobs"][m - 6 + k], glp["token_logprobs"][k]);
  // A crowd: 4 echo requests at once (scoring alone and generating, streamed and
  // not) while node 0's caches are evicted and the route epoch bumped: each
  // gives the text and scores it gives alone.
  std::vector<json> crowd_bodies;
  std::vector<json> alone_scores;
  for (int k = 0; k < 4; ++k) {
    json b = {{"prompt", prompt + " " + std::to_string(k)}, {"max_tokens", k % 2 == 0 ? 0 : 8}, {"echo", true},
              {"logprobs", 1}, {"temperature", 0}};
    const auto a = json::parse(c().call("/v1/completions", b.dump()).body)["choices"][0];
    alone_scores.push_back(json{{"text", a["text"]}, {"lp", a["logprobs"]["token_logprobs"]}});
    b["stream"] = k >= 2;
    crowd_bodies.push_back(b);
  }
  std::vector<std::unique_ptr<Process>> crowd;
  for (auto& b : crowd_bodies)
    crowd.push_back(std::make_unique<Process>(std::vector<std::string>{
      "/bin/sh", "-c", "curl -sN -m 60 --data-binary " + quote(b.dump()) + " " + c().base + "/v1/completions"}));
  EXPECT_EQ(c().call("/v1/cluster/inject", R"({"kind": "evict", "node": 0})", "-H 'Content-Type: application/json'").status, 200);
  EXPECT_EQ(c().call("/v1/cluster/inject", R"({"kind": "epoch"})", "-H 'Content-Type: application/json'").status, 200);
  for (std::size_t k = 0; k < crowd.size(); ++k) {
    const auto out = crowd[k]->drain();
    std::string got_text;
    json got_lp = json::array();
    if (crowd_bodies[k]["stream"]) {
      std::istringstream events(out);
      for (std::string line; std::getline(events, line);)
        if (line.rfind("data: {", 0) == 0) {
          const auto ev = json::parse(line.substr(6));
          if (ev["choices"].empty())
            continue;
          got_text += ev["choices"][0]["text"].get<std::string>();
          if (ev["choices"][0]["logprobs"].is_object())
            for (auto& x : ev["choices"][0]["logprobs"]["token_logprobs"])
              got_lp.push_back(x);
        }
    } else {
      const auto ch = json::parse(out)["choices"][0];
      got_text = ch["text"];
      got_lp = ch["logprobs"]["token_logprobs"];
    }
    EXPECT_EQ(got_text, alone_scores[k]["text"]) << "request " << k << ": " << out;
    ASSERT_EQ(got_lp.size(), alone_scores[k]["lp"].size()) << "request " << k;
    for (std::size_t t = 1; t < got_lp.size(); ++t)
      EXPECT_NEAR(got_lp[t].get<double>(), alone_scores[k]["lp"][t].get<double>(), 1e-4) << "request " << k << " token " << t;
  }
  // Where echo has no meaning: a 400 naming the field.
  // Streamed: the prompt's chunk (with its scores) first, then the completion's.
  auto streamed = c().call(
    "/v1/completions",
    R"({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": true, "stream": true})", "-N");
  std::string finish;
  EXPECT_EQ(sse_text(streamed.body, &finish), prompt + text) << streamed.body;
  EXPECT_EQ(finish, "length");
  json scored_body = body;
  scored_body["stream"] = true;
  auto scored = c().call("/v1/completions", scored_body.dump(), "-N");
  EXPECT_EQ(sse_text(scored.body), prompt + text) << scored.body;
  std::size_t streamed_scores = 0;
  std::istringstream events(scored.body);
  for (std::string line; std::getline(events, line);)
    if (line.rfind("data: {", 0) == 0) {
      const auto ev = json::parse(line.substr(6));
      if (!ev["choices"].empty() && ev["choices"][0]["logprobs"].is_object())
        streamed_scores += ev["choices"][0]["logprobs"]["token_logprobs"].size();
    }
  EXPECT_EQ(streamed_scores, n) << "every prompt token scored in the stream too";
  EXPECT_NE(c().call("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "echo": true})").body.find("\"echo\""),
            std::string::npos);
  const auto zero = c().call("/v1/completions", R"({"prompt": "x", "max_tokens": 0})");
  EXPECT_EQ(zero.status, 400);
  EXPECT_NE(zero.body.find("\"max_tokens\""), std::string::npos) << zero.body;
}

TEST_F(Server, LogprobsChoicesAndPenalties) {
  // Completions' logprobs: greedy takes the most likely token, every token has
  // its entry, the tokens spell the text.
  auto r = c().call("/v1/completions", R"({"prompt":"Once upon","max_tokens":6,"temperature":0,"logprobs":3})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  const auto& lp = j["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), j["usage"]["completion_tokens"].get<size_t>()) << lp;
  std::string spelled;
  for (std::size_t k = 0; k < lp["tokens"].size(); ++k) {
    spelled += lp["tokens"][k].get<std::string>();
    const auto& top = lp["top_logprobs"][k];
    ASSERT_FALSE(top.empty());
    EXPECT_LE(top.size(), 3u);
    double best = -1e30, total = 0;
    for (auto& [tok, v] : top.items()) {
      best = std::max(best, v.get<double>());
      total += std::exp(v.get<double>());
    }
    EXPECT_NEAR(lp["token_logprobs"][k].get<double>(), best, 1e-6) << "greedy picks the most likely";
    EXPECT_LE(total, 1.0 + 1e-5);
    EXPECT_LE(lp["token_logprobs"][k].get<double>(), 0.0);
  }
  EXPECT_EQ(spelled, j["choices"][0]["text"]);
  // Chat: logprobs.content, streamed the same as not streamed.
  const json chat = {{"messages", json::array({{{"role", "user"}, {"content", "Once upon"}}})}, {"max_tokens", 5},
                     {"temperature", 0}, {"logprobs", true}, {"top_logprobs", 2}};
  auto whole = json::parse(c().call("/v1/chat/completions", chat.dump()).body);
  const auto content = whole["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), whole["usage"]["completion_tokens"].get<size_t>()) << whole;
  EXPECT_EQ(content[0]["top_logprobs"].size(), 2u);
  EXPECT_TRUE(content[0]["bytes"].is_array());
  json streamed = chat;
  streamed["stream"] = true;
  const auto body = c().call("/v1/chat/completions", streamed.dump()).body;
  json got = json::array();
  std::istringstream is(body);
  for (std::string line; std::getline(is, line);)
    if (line.rfind("data: {", 0) == 0) {
      auto ev = json::parse(line.substr(6));
      for (auto& ch : ev["choices"])
        if (ch.contains("logprobs") && ch["logprobs"].is_object())
          for (auto& e : ch["logprobs"]["content"])
            got.push_back(e);
    }
  EXPECT_EQ(got, content);
  // n choices: choice i is what a request alone with seed + i gives.
  auto three = json::parse(c().call("/v1/completions", R"({"prompt":"Once","max_tokens":8,"temperature":1,"seed":40,"n":3})").body);
  ASSERT_EQ(three["choices"].size(), 3u) << three;
  int64_t completion = 0;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(three["choices"][i]["index"], i);
    auto alone = json::parse(c().call("/v1/completions", json{{"prompt", "Once"}, {"max_tokens", 8}, {"temperature", 1},
                                                              {"seed", 40 + i}}.dump()).body);
    EXPECT_EQ(three["choices"][i]["text"], alone["choices"][0]["text"]) << "choice " << i;
    completion += alone["usage"]["completion_tokens"].get<int64_t>();
  }
  EXPECT_EQ(three["usage"]["completion_tokens"], completion);
  // Streamed choices carry their index; each ends with its own finish_reason.
  const auto sbody = c().call("/v1/completions", R"({"prompt":"Once","max_tokens":4,"temperature":1,"seed":40,"n":2,"stream":true})").body;
  std::map<int, std::string> texts;
  std::map<int, int> finishes;
  std::istringstream ss(sbody);
  for (std::string line; std::getline(ss, line);)
    if (line.rfind("data: {", 0) == 0) {
      const json ev = json::parse(line.substr(6));
      for (auto& ch : ev["choices"]) {
        texts[ch["index"].get<int>()] += ch["text"].get<std::string>();
        finishes[ch["index"].get<int>()] += ch["finish_reason"].is_null() ? 0 : 1;
      }
    }
  ASSERT_EQ(texts.size(), 2u) << sbody;
  EXPECT_EQ(finishes[0], 1);
  EXPECT_EQ(finishes[1], 1);
  EXPECT_EQ(texts[0], json::parse(c().call("/v1/completions", R"({"prompt":"Once","max_tokens":4,"temperature":1,"seed":40})").body)["choices"][0]["text"]);
  // Penalties: reproducible with a seed, and they change what is sampled.
  const std::string pen = R"({"prompt":"Once upon a time","max_tokens":24,"temperature":0,"frequency_penalty":2,"presence_penalty":1,"repetition_penalty":1.5})";
  auto p1 = json::parse(c().call("/v1/completions", pen).body);
  auto p2 = json::parse(c().call("/v1/completions", pen).body);
  ASSERT_TRUE(p1.contains("choices")) << p1;
  EXPECT_EQ(p1["choices"][0]["text"], p2["choices"][0]["text"]);
  auto plain = json::parse(c().call("/v1/completions", R"({"prompt":"Once upon a time","max_tokens":24,"temperature":0})").body);
  EXPECT_NE(p1["choices"][0]["text"], plain["choices"][0]["text"]);
  // With a strong frequency penalty a greedy run repeats tokens less.
  const auto repeats = [](const std::string& t) {
    std::map<char, int> n;
    int rep = 0;
    for (char ch : t)
      rep += n[ch]++ > 0;
    return rep;
  };
  EXPECT_LE(repeats(p1["choices"][0]["text"]), repeats(plain["choices"][0]["text"]));
}

// The new fields the way users send them: many clients at once (chats through
// the model's template with logprobs, n choices, penalties), every shard's
// sessions evicted while they stream; each answer must equal the same request
// served alone afterwards.
TEST_F(Server, TemplateChatsLogprobsChoicesAndPenaltiesInACrowdWithAnEvictionEqualEachAlone) {
  const auto dir = std::filesystem::temp_directory_path() / ("strata-crowd-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "chat.jinja") << "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}\n{% endfor %}"
                                       "{% if add_generation_prompt %}<|assistant|>{% endif %}";
  Process served({exe, "serve", "--cluster", c().cluster, "--http", "127.0.0.1:0", "--chat-template",
                  (dir / "chat.jinja").string()});
  const auto line = served.wait_line("ready http ");
  ASSERT_FALSE(line.empty());
  const std::string base = "http://" + line.substr(11);
  struct Req {
    std::string path;
    json body;
  };
  std::vector<Req> reqs;
  for (int i = 0; i < 12; ++i) {
    const std::string who = "Client " + std::to_string(i);
    switch (i % 4) {
      case 0: // a streamed chat with logprobs
        reqs.push_back({"/v1/chat/completions",
                        {{"messages", json::array({{{"role", "system"}, {"content", "Tell a story."}},
                                                   {{"role", "user"}, {"content", who}}})},
                         {"max_tokens", 96}, {"temperature", 0}, {"stream", true}, {"logprobs", true},
                         {"top_logprobs", 2}}});
        break;
      case 1: // two seeded choices
        reqs.push_back({"/v1/completions",
                        {{"prompt", who}, {"max_tokens", 96}, {"temperature", 1}, {"seed", i}, {"n", 2}}});
        break;
      case 2: // penalties, sampled with a seed
        reqs.push_back({"/v1/completions",
                        {{"prompt", who}, {"max_tokens", 96}, {"temperature", 0.8}, {"seed", i},
                         {"presence_penalty", 0.5}, {"frequency_penalty", 1.0}, {"repetition_penalty", 1.2}}});
        break;
      default: // a chat with completions' logprobs shape
        reqs.push_back({"/v1/completions", {{"prompt", who}, {"max_tokens", 96}, {"temperature", 0}, {"logprobs", 3}}});
    }
  }
  // What a response says: per choice, the text and [token, logprob] pairs.
  const auto summary = [](const std::string& body) {
    json out = json::array();
    if (body.rfind("data: ", 0) == 0 || body.find("\ndata: ") != std::string::npos) {
      std::string text;
      json lps = json::array();
      std::istringstream is(body);
      for (std::string l; std::getline(is, l);)
        if (l.rfind("data: {", 0) == 0) {
          const json ev = json::parse(l.substr(6));
          for (auto& ch : ev["choices"]) {
            text += ch["delta"].value("content", "");
            if (ch["logprobs"].is_object())
              for (auto& e : ch["logprobs"]["content"])
                lps.push_back({e["token"], e["logprob"]});
          }
        }
      out.push_back({text, lps});
      return out;
    }
    const json j = json::parse(body, nullptr, false);
    if (!j.is_object() || !j.contains("choices"))
      return json(body);
    for (auto& ch : j["choices"]) {
      json lps = json::array();
      if (ch["logprobs"].is_object())
        for (std::size_t k = 0; k < ch["logprobs"]["tokens"].size(); ++k)
          lps.push_back({ch["logprobs"]["tokens"][k], ch["logprobs"]["token_logprobs"][k]});
      out.push_back({ch.contains("message") ? ch["message"]["content"] : ch["text"], lps});
    }
    return out;
  };
  const auto metric = [&](const std::string& name) {
    std::istringstream is(sh("curl -s " + base + "/metrics"));
    for (std::string l; std::getline(is, l);)
      if (l.rfind(name + " ", 0) == 0)
        return std::stod(l.substr(name.size() + 1));
    return 0.0;
  };
  const double reprefills_before = metric("strata_reprefills_total");
  std::vector<std::unique_ptr<Process>> running;
  for (auto& r : reqs)
    running.push_back(std::make_unique<Process>(std::vector<std::string>{
      "/bin/sh", "-c", "curl -sN -m 120 --data-binary " + quote(r.body.dump()) + " " + base + r.path}));
  // Once the first stream runs, every shard drops all its sessions.
  ASSERT_FALSE(running[0]->wait_line("data: ").empty());
  for (int node = 0; node < 4; ++node)
    EXPECT_EQ(c().call("/v1/cluster/inject", R"({"kind":"evict","node":)" + std::to_string(node) + "}",
                       "-H 'Content-Type: application/json'").status,
              200);
  std::vector<json> crowd;
  double max_diff = 0;
  for (auto& r : running)
    crowd.push_back(summary(r->drain()));
  EXPECT_GE(metric("strata_reprefills_total") - reprefills_before, 1) << "the eviction hit generations in flight";
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    const auto alone = sh("curl -sN -m 120 --data-binary " + quote(reqs[i].body.dump()) + " " + base + reqs[i].path);
    SCOPED_TRACE(reqs[i].body.dump());
    const json one = summary(alone);
    ASSERT_TRUE(crowd[i].is_array()) << crowd[i];
    ASSERT_EQ(crowd[i].size(), one.size()) << one;
    EXPECT_EQ(crowd[i].size(), reqs[i].body.value("n", 1));
    for (std::size_t k = 0; k < one.size(); ++k) {
      EXPECT_EQ(crowd[i][k][0], one[k][0]) << "the same text";
      ASSERT_EQ(crowd[i][k][1].size(), one[k][1].size());
      for (std::size_t t = 0; t < one[k][1].size(); ++t) {
        EXPECT_EQ(crowd[i][k][1][t][0], one[k][1][t][0]) << "the same tokens";
        // (A rebuilt cache computes the same positions in other groupings: the
        // log-probabilities agree to float rounding, the tokens exactly.)
        const double d = std::fabs(crowd[i][k][1][t][1].get<double>() - one[k][1][t][1].get<double>());
        max_diff = std::max(max_diff, d);
        EXPECT_LE(d, 1e-4);
      }
    }
  }
  std::printf("%zu requests in a crowd with an eviction equal each alone; largest logprob difference %.2e\n",
              reqs.size(), max_diff);
  std::filesystem::remove_all(dir);
}

TEST_F(Server, ShutdownEndsInFlightStreamsCleanly) {
  // A second server on the same cluster, with no drain time: SIGTERM while a
  // stream runs ends it with an error event and [DONE], and the server exits 0.
  Process second({exe, "serve", "--cluster", c().cluster, "--http", "127.0.0.1:0", "--drain", "0"});
  const auto line = second.wait_line("ready http ");
  ASSERT_FALSE(line.empty());
  Process stream({"/bin/sh", "-c",
                  "curl -sN -m 60 --data-binary " + quote(completion_body("Once upon a time", 480, true)) +
                    " http://" + line.substr(11) + "/v1/completions"});
  ASSERT_FALSE(stream.wait_line("data: ").empty());
  second.signal(SIGTERM);
  const int code = second.wait_exit(std::chrono::seconds(20));
  EXPECT_EQ(code, 0) << "serve's output:\n" << second.drain();
  const auto body = stream.drain();
  bool done = false;
  sse_text(body, nullptr, &done);
  EXPECT_TRUE(done) << body;
  EXPECT_NE(body.find("shutting down"), std::string::npos) << body;
}


TEST_F(Server, DenormalSamplingValuesAre400AndTheServerLivesOn) {
  // 1e-320 passes 0 < p as a double but is 0 as the float the sampler uses.
  for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
    const std::string body = std::string(path) == "/v1/completions"
                               ? R"({"prompt":"Once","max_tokens":3,"top_p":1e-320})"
                               : R"({"messages":[{"role":"user","content":"Hi"}],"max_tokens":3,"top_p":1e-320})";
    auto r = c().call(path, body);
    EXPECT_EQ(r.status, 400) << path << ": " << r.body;
    auto j = json::parse(r.body, nullptr, false);
    ASSERT_TRUE(j.is_object()) << r.body;
    EXPECT_EQ(j["error"]["param"], "top_p") << r.body;
  }
  auto t = c().call("/v1/completions", R"({"prompt":"Once","max_tokens":3,"temperature":1e-320})");
  EXPECT_EQ(t.status, 200) << t.body; // 0 as a float: greedy, a valid setting
  EXPECT_EQ(c().call("/health").status, 200) << "the server is still serving";
}

TEST_F(Server, InjectionNeedsAllowInjectJsonAndTheKey) {
  const std::string body = R"({"kind":"epoch"})";
  const std::string json_type = "-H 'Content-Type: application/json'";
  // The shared server runs with --allow-inject: JSON only.
  EXPECT_EQ(c().call("/v1/cluster/inject", body).status, 415); // curl's default form type
  EXPECT_EQ(c().call("/v1/cluster/inject", body, "-H 'Content-Type: text/plain'").status, 415);
  EXPECT_EQ(c().call("/v1/cluster/inject", body, json_type).status, 200);
  // Without --allow-inject: refused whatever is sent.
  Process plain({exe, "serve", "--cluster", c().cluster, "--http", "127.0.0.1:0"});
  const auto line = plain.wait_line("ready http ");
  ASSERT_FALSE(line.empty());
  const auto base = "http://" + line.substr(11);
  auto code = [&](const std::string& url, const std::string& extra) {
    return sh("curl -s -o /dev/null -w '%{http_code}' " + extra + " --data-binary " + quote(body) + " " + url +
              "/v1/cluster/inject");
  };
  EXPECT_EQ(code(base, json_type), "403");
  // With a key: refused without it, even with --allow-inject.
  Process keyed({exe, "serve", "--cluster", c().cluster, "--http", "127.0.0.1:0", "--allow-inject", "--api-key", "k1"});
  const auto kline = keyed.wait_line("ready http ");
  ASSERT_FALSE(kline.empty());
  const auto kbase = "http://" + kline.substr(11);
  EXPECT_EQ(code(kbase, json_type), "401");
  EXPECT_EQ(code(kbase, json_type + " -H 'Authorization: Bearer k1'"), "200");
}

TEST_F(Server, CorsOnlyForTheConfiguredOriginAndOptionsAnswered) {
  // Default: no CORS headers for any origin; OPTIONS is answered (204) without them.
  auto headers = [&](const std::string& base, const std::string& method, const std::string& origin) {
    return sh("curl -s -o /dev/null -D - -X " + method + " -H 'Origin: " + origin + "' " + base + "/v1/models");
  };
  auto plain = headers(c().base, "OPTIONS", "https://evil.example");
  EXPECT_NE(plain.find(" 204"), std::string::npos) << plain;
  EXPECT_EQ(plain.find("Access-Control-Allow-Origin"), std::string::npos) << plain;
  Process cors({exe, "serve", "--cluster", c().cluster, "--http", "127.0.0.1:0", "--cors-origin", "https://app.example"});
  const auto line = cors.wait_line("ready http ");
  ASSERT_FALSE(line.empty());
  const auto base = "http://" + line.substr(11);
  auto pre = headers(base, "OPTIONS", "https://app.example");
  EXPECT_NE(pre.find("Access-Control-Allow-Origin: https://app.example"), std::string::npos) << pre;
  EXPECT_NE(pre.find("Access-Control-Allow-Headers: Authorization, Content-Type"), std::string::npos) << pre;
  auto get = headers(base, "GET", "https://app.example");
  EXPECT_NE(get.find("Access-Control-Allow-Origin: https://app.example"), std::string::npos) << get;
  auto other = headers(base, "GET", "https://evil.example");
  EXPECT_EQ(other.find("Access-Control-Allow-Origin"), std::string::npos) << other;
}

TEST_F(Server, ApiKeyRules) {
  // An empty key is refused at start, never taken as "no authentication".
  const auto out = sh(exe + " serve --cluster " + c().cluster + " --http 127.0.0.1:0 --api-key '' 2>&1; echo rc=$?");
  EXPECT_NE(out.find("--api-key is empty"), std::string::npos) << out;
  EXPECT_NE(out.find("rc=2"), std::string::npos) << out;
  const auto env = sh("STRATA_API_KEY= " + exe + " serve --cluster " + c().cluster + " --http 127.0.0.1:0 2>&1; echo rc=$?");
  EXPECT_NE(env.find("STRATA_API_KEY is set but empty"), std::string::npos) << env;
  // The scheme is case-insensitive (RFC 7235).
  Process keyed({exe, "serve", "--cluster", c().cluster, "--http", "127.0.0.1:0", "--api-key", "sesame"});
  const auto line = keyed.wait_line("ready http ");
  ASSERT_FALSE(line.empty());
  auto code = [&](const std::string& auth) {
    return sh("curl -s -o /dev/null -w '%{http_code}' -H " + quote("Authorization: " + auth) + " http://" +
              line.substr(11) + "/v1/models");
  };
  EXPECT_EQ(code("bearer sesame"), "200");
  EXPECT_EQ(code("BEARER sesame"), "200");
  EXPECT_EQ(code("Bearer sesam"), "401");
  EXPECT_EQ(code("Bearer sesame2"), "401");
  EXPECT_EQ(code("Basic sesame"), "401");
}

TEST_F(Server, ApiKeyIsRequiredWhenConfigured) {
  Process keyed({exe, "serve", "--cluster", c().cluster, "--http", "127.0.0.1:0", "--api-key", "sesame"});
  const auto line = keyed.wait_line("ready http ");
  ASSERT_FALSE(line.empty());
  const std::string base = "http://" + line.substr(11);
  const std::string body = " --data-binary " + quote(completion_body("Once", 3, false)) + " ";
  auto code = [&](const std::string& extra) {
    return sh("curl -s -o /dev/null -w '%{http_code}' " + extra + body + base + "/v1/completions");
  };
  EXPECT_EQ(code(""), "401");
  EXPECT_EQ(code("-H 'Authorization: Bearer wrong'"), "401");
  EXPECT_EQ(code("-H 'Authorization: Bearer sesame'"), "200");
  EXPECT_EQ(sh("curl -s -o /dev/null -w '%{http_code}' " + base + "/health"), "200"); // probes stay open
}


// Writes a small random llama2.c checkpoint (vocabulary 259, the byte
// tokenizer's) at `path`.
void write_llama2c(const std::string& path) {
  const int32_t D = 32, H = 64, L = 2, heads = 4, kv_heads = 2, V = 259, S = 256;
  const int64_t hd = D / heads, KV = kv_heads * hd;
  const int64_t floats = V * D + L * (D + D * D + 2 * KV * D + D * D + D + 3 * H * D) + D + S * hd;
  std::mt19937 rng(20261130);
  std::uniform_real_distribution<float> u(-0.3f, 0.3f);
  std::vector<float> w(static_cast<std::size_t>(floats));
  for (auto& x : w)
    x = u(rng);
  std::ofstream out(path, std::ios::binary);
  const int32_t header[7] = {D, H, L, heads, kv_heads, V, S};
  out.write(reinterpret_cast<const char*>(header), sizeof header);
  out.write(reinterpret_cast<const char*>(w.data()), static_cast<std::streamsize>(w.size() * sizeof(float)));
}

TEST(ServeWithoutModelFiles, LearnsTheModelFromTheCluster) {
  if (!have("curl"))
    GTEST_SKIP() << "curl is not installed (scripts/test installs it)";
  // The checkpoint exists only in the nodes' directory, under a relative path:
  // `serve` (in another directory) cannot open it and must not need to.
  const auto dir = std::filesystem::temp_directory_path() / ("strata-nodes-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  write_llama2c((dir / "private.bin").string());
  Process coordinator({exe, "node", "--coordinator", "--listen", "127.0.0.1:0"});
  const auto cluster = coordinator.wait_line("ready coordinator ").substr(18);
  std::vector<std::unique_ptr<Process>> nodes;
  for (auto layers : {"0", "1"}) {
    nodes.push_back(std::make_unique<Process>(std::vector<std::string>{
      "/bin/sh", "-c",
      "cd " + quote(dir.string()) + " && exec " + exe + " node --listen 127.0.0.1:0 --join " + cluster +
        " --model private.bin --threads 1 --layers " + layers}));
    ASSERT_FALSE(nodes.back()->wait_line("ready node ").empty());
  }
  ASSERT_FALSE(std::filesystem::exists("private.bin"));
  Process server({exe, "serve", "--cluster", cluster, "--http", "127.0.0.1:0", "--tokenizer", "builtin:bytes"});
  const auto line = server.wait_line("ready http ");
  ASSERT_FALSE(line.empty());
  const std::string prompt = "Hello";
  const auto r = sh("curl -s -m 60 --data-binary " + quote(completion_body(prompt, 30, false)) + " http://" +
                    line.substr(11) + "/v1/completions");
  auto j = json::parse(r, nullptr, false);
  ASSERT_TRUE(j.is_object() && j.contains("choices")) << r;
  // The same model in one process, from its file.
  const auto local = sh(exe + " generate --model " + quote((dir / "private.bin").string()) +
                        " --tokenizer builtin:bytes --prompt " + quote(prompt) + " --max-tokens 30 2>/dev/null");
  ASSERT_EQ(local.rfind(prompt, 0), 0u) << local;
  // (Random weights emit any bytes: invalid UTF-8 is replaced like the server's JSON does.)
  const json local_text = json::parse(
    json(local.substr(prompt.size(), local.size() - prompt.size() - 1)).dump(-1, ' ', false, json::error_handler_t::replace));
  EXPECT_EQ(j["choices"][0]["text"], local_text);
  EXPECT_EQ(j["model"], "private.bin");
  // A tokenizer whose vocabulary does not fit the model is refused at start.
  if (test::have_shared("models/llama2-tokenizer.bin")) {
    const auto out = sh(exe + " generate --cluster " + cluster + " --tokenizer " +
                        quote(test::shared_path("models/llama2-tokenizer.bin")) + " --prompt Hi 2>&1");
    EXPECT_NE(out.find("vocabulary is 259"), std::string::npos) << out;
  }
  std::filesystem::remove_all(dir);
}


TEST(ServeConnections, SlowlorisSocketsAreClosedAndKeepAliveWorks) {
  if (!have("curl"))
    GTEST_SKIP() << "curl is not installed (scripts/test installs it)";
  OneNode c;
  ASSERT_TRUE(c.ready);
  const auto& cluster = c.cluster;
  Process server({exe, "serve", "--cluster", cluster, "--http", "127.0.0.1:0", "--header-timeout-ms", "1000",
                  "--idle-timeout-ms", "2000", "--max-connections", "30"});
  const auto line = server.wait_line("ready http ");
  ASSERT_FALSE(line.empty());
  const auto port = port_of(line);
  // 20 slowloris sockets: a header that never ends, and one that never starts.
  std::vector<int> slow;
  for (int i = 0; i < 20; ++i) {
    const int fd = connect_to(port);
    ASSERT_GE(fd, 0);
    if (i % 2 == 0) {
      const std::string partial = "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ";
      ASSERT_EQ(::write(fd, partial.data(), partial.size()), static_cast<ssize_t>(partial.size()));
    }
    slow.push_back(fd);
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int fd : slow) {
    EXPECT_TRUE(closed_by_peer(fd, std::chrono::seconds(5))) << "a half-sent request is closed by the header timeout";
    ::close(fd);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(4));
  // Keep-alive: two requests on one connection (curl reuses it and says so),
  // and two generations one after the other on one connection.
  const auto two = sh("curl -sv http://" + line.substr(11) + "/health http://" + line.substr(11) + "/v1/models 2>&1");
  EXPECT_NE(two.find("Re-using existing connection"), std::string::npos) << two;
  const auto body = quote(completion_body("Once upon a time", 12, false));
  const auto gens = sh("curl -sv -m 20 --data-binary " + body + " http://" + line.substr(11) + "/v1/completions --next -m 20 "
                       "--data-binary " + body + " http://" + line.substr(11) + "/v1/completions 2>&1");
  EXPECT_NE(gens.find("Re-using existing connection"), std::string::npos) << gens;
  const auto expected = json(local_text("Once upon a time", 12)).dump(-1, ' ', false, json::error_handler_t::replace);
  std::size_t found = 0;
  for (auto at = gens.find(expected); at != std::string::npos; at = gens.find(expected, at + 1))
    ++found;
  EXPECT_EQ(found, 2u) << gens;
  // An idle keep-alive connection is closed after the idle timeout.
  const int idle = connect_to(port);
  const std::string get = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(::write(idle, get.data(), get.size()), static_cast<ssize_t>(get.size()));
  EXPECT_TRUE(closed_by_peer(idle, std::chrono::seconds(6)));
  ::close(idle);
  // Over the connection cap: a clear 503, not a hang.
  std::vector<int> many;
  for (int i = 0; i < 30; ++i)
    many.push_back(connect_to(port));
  const auto over = sh("curl -s -m 10 -w '\n%{http_code}' http://" + line.substr(11) + "/health");
  EXPECT_NE(over.find("too_many_connections"), std::string::npos) << over;
  EXPECT_NE(over.find("\n503"), std::string::npos) << over;
  for (int fd : many)
    ::close(fd);
  EXPECT_EQ(sh("curl -s -o /dev/null -w '%{http_code}' -m 10 http://" + line.substr(11) + "/health"), "200");
}

TEST(ServeConnections, AcceptSurvivesRunningOutOfFileDescriptors) {
  if (!have("curl") || !have("prlimit"))
    GTEST_SKIP() << "curl or prlimit is not installed";
  OneNode c;
  ASSERT_TRUE(c.ready);
  const auto& cluster = c.cluster;
  // serve with room for only a few connections beyond its own files.
  Process server({"/bin/sh", "-c", "exec prlimit --nofile=64:64 " + exe + " serve --cluster " + cluster +
                                     " --http 127.0.0.1:0 2>&1"});
  const auto line = server.wait_line("ready http ");
  ASSERT_FALSE(line.empty());
  const auto port = port_of(line);
  std::vector<int> hold;
  for (int i = 0; i < 100; ++i) // more than its descriptors: accept fails with EMFILE
    hold.push_back(connect_to(port));
  EXPECT_FALSE(server.wait_containing("serve: accept failed: Too many open files", std::chrono::seconds(10)).empty());
  for (int fd : hold)
    if (fd >= 0)
      ::close(fd);
  // The accept loop backed off and goes on: /health answers again.
  std::string code;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (code != "200" && std::chrono::steady_clock::now() < deadline)
    code = sh("curl -s -o /dev/null -w '%{http_code}' -m 5 http://" + line.substr(11) + "/health");
  EXPECT_EQ(code, "200");
}

TEST(ServeStartOrder, ServeWaitsForTheCoordinator) {
  if (!have("curl"))
    GTEST_SKIP() << "curl is not installed (scripts/test installs it)";
  const auto port = free_port();
  ASSERT_GT(port, 0);
  const std::string cluster = "127.0.0.1:" + std::to_string(port);
  Process server({"/bin/sh", "-c", "exec " + exe + " serve --cluster " + cluster + " --http 127.0.0.1:0 2>&1"});
  EXPECT_FALSE(server.wait_containing("serve: waiting for the coordinator", std::chrono::seconds(10)).empty());
  Process coordinator({exe, "node", "--coordinator", "--listen", cluster});
  ASSERT_FALSE(coordinator.wait_line("ready coordinator ").empty());
  Process node({exe, "node", "--listen", "127.0.0.1:0", "--join", cluster, "--model", "builtin:tiny", "--layers", "0-4",
                "--threads", "1"});
  ASSERT_FALSE(node.wait_line("ready node ").empty());
  const auto line = server.wait_line("ready http ", std::chrono::seconds(20));
  ASSERT_FALSE(line.empty());
  const auto r = sh("curl -s -m 60 --data-binary " + quote(completion_body("Once upon a time", 20, false)) + " http://" +
                    line.substr(11) + "/v1/completions");
  auto j = json::parse(r, nullptr, false);
  ASSERT_TRUE(j.is_object() && j.contains("choices")) << r;
  EXPECT_EQ(j["choices"][0]["text"], local_text("Once upon a time", 20));
}

TEST(ServeStartOrder, NoCompleteRouteFailsFastOverHttpAndCli) {
  if (!have("curl"))
    GTEST_SKIP() << "curl is not installed (scripts/test installs it)";
  Process coordinator({exe, "node", "--coordinator", "--listen", "127.0.0.1:0", "--route-wait-ms", "2000"});
  const auto cluster = coordinator.wait_line("ready coordinator ").substr(18);
  Process node({exe, "node", "--listen", "127.0.0.1:0", "--join", cluster, "--model", "builtin:tiny", "--layers", "0-2",
                "--threads", "1"}); // layers 3-4 are served by nobody
  ASSERT_FALSE(node.wait_line("ready node ").empty());
  Process server({exe, "serve", "--cluster", cluster, "--http", "127.0.0.1:0"});
  const auto line = server.wait_line("ready http ");
  ASSERT_FALSE(line.empty());
  auto t0 = std::chrono::steady_clock::now();
  const auto out = sh("curl -s -m 60 -w '\n%{http_code}' --data-binary " + quote(completion_body("Once", 5, false)) +
                      " http://" + line.substr(11) + "/v1/completions");
  auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_NE(out.find("\n503"), std::string::npos) << out;
  EXPECT_NE(out.find("no_route"), std::string::npos) << out;
  EXPECT_LT(took, std::chrono::milliseconds(2000 + 2000)) << "within --route-wait-ms + 2 s";
  t0 = std::chrono::steady_clock::now();
  const auto cli = sh(exe + " generate --cluster " + cluster + " --prompt-ids 1,2 --max-tokens 3 2>&1; echo rc=$?");
  took = std::chrono::steady_clock::now() - t0;
  EXPECT_NE(cli.find("no_route"), std::string::npos) << cli;
  EXPECT_NE(cli.find("rc=1"), std::string::npos) << cli;
  EXPECT_LT(took, std::chrono::milliseconds(2000 + 2000)) << "within --route-wait-ms + 2 s";
}


// The listening sockets of process `pid`, as "ADDRESS:PORT" (from ss).
std::vector<std::string> listeners_of(pid_t pid) {
  std::istringstream is(sh("ss -ltnpH 2>/dev/null"));
  std::vector<std::string> out;
  for (std::string line; std::getline(is, line);)
    if (line.find("pid=" + std::to_string(pid) + ",") != std::string::npos) {
      std::istringstream ls(line);
      std::string state, recvq, sendq, local;
      ls >> state >> recvq >> sendq >> local;
      out.push_back(local);
    }
  return out;
}

TEST(Listeners, EveryProcessListensOnlyWhereConfigured) {
  if (!have("ss") || !have("curl"))
    GTEST_SKIP() << "ss (iproute2) or curl is not installed (scripts/test installs them)";
  Process coordinator({exe, "node", "--coordinator", "--listen", "127.0.0.1:0"});
  const auto cluster = coordinator.wait_line("ready coordinator ").substr(18);
  std::vector<std::unique_ptr<Process>> nodes;
  for (auto layers : {"0-2", "3-4"}) {
    nodes.push_back(std::make_unique<Process>(std::vector<std::string>{
      exe, "node", "--listen", "127.0.0.1:0", "--join", cluster, "--model", "builtin:tiny", "--layers", layers,
      "--threads", "1"}));
    ASSERT_FALSE(nodes.back()->wait_line("ready node ").empty());
  }
  Process server({exe, "serve", "--cluster", cluster, "--http", "127.0.0.1:0"});
  const auto http = server.wait_line("ready http ");
  ASSERT_FALSE(http.empty());
  // A client in the middle of a generation (stopped there, so it cannot finish first).
  Process client({exe, "generate", "--cluster", cluster, "--prompt", "Once upon a time", "--max-tokens", "480"});
  ASSERT_TRUE(client.wait_bytes(std::string("Once upon a time").size() + 20)); // the prompt and 20 tokens
  client.signal(SIGSTOP);
  EXPECT_EQ(listeners_of(coordinator.pid()), std::vector<std::string>{cluster});
  for (auto& n : nodes) {
    const auto l = listeners_of(n->pid());
    ASSERT_EQ(l.size(), 1u) << "a node listens on its --listen address only";
    EXPECT_EQ(l[0].rfind("127.0.0.1:", 0), 0u) << l[0];
  }
  EXPECT_EQ(listeners_of(server.pid()), std::vector<std::string>{http.substr(11)});
  EXPECT_TRUE(listeners_of(client.pid()).empty()) << "a client listens nowhere";
  client.signal(SIGKILL);
}

// Last: it kills a node (its range has a replica).
TEST_F(Server, ChatPageInChromiumStreamsSurvivesAKillAndStops) {
  const std::filesystem::path npm = std::filesystem::path(STRATA_BINARY_DIR) / "npm";
  if (!have("chromium") || !have("node") || !std::filesystem::exists(npm / "node_modules" / "playwright-core"))
    GTEST_SKIP() << "chromium or playwright-core is not installed (scripts/test installs them)";
  const std::string message = "Once upon a time";
  // What the API answers to the same chat (greedy), asked before the page runs.
  auto api = c().call("/v1/chat/completions",
                      json{{"messages", json::array({{{"role", "user"}, {"content", message}}})}, {"max_tokens", 480},
                           {"temperature", 0}}.dump());
  ASSERT_EQ(api.status, 200) << api.body;
  const std::string expected = json::parse(api.body)["choices"][0]["message"]["content"];
  auto page = c().call("/");
  EXPECT_EQ(page.status, 200);
  EXPECT_NE(page.body.find("<textarea id=\"message\""), std::string::npos);
  EXPECT_NE(page.body.find("/v1/chat/completions"), std::string::npos);
  EXPECT_EQ(page.body.find("URLSearchParams"), std::string::npos) << "the page never acts on URL parameters";
  EXPECT_EQ(page.body.find("innerHTML"), std::string::npos) << "model text is never parsed as HTML";
  // The page in Chromium, driven by typing and clicks: Send, then "kill" on node
  // 1 (layers 2-3, which has a replica) once 20 tokens have streamed; then a
  // second turn stopped with the Stop button.
  std::filesystem::copy_file(STRATA_PAGE_SCRIPT, npm / "page_client.mjs", std::filesystem::copy_options::overwrite_existing);
  const auto shot = std::filesystem::path(STRATA_BINARY_DIR) / "chat-page.png";
  const auto out = sh("STRATA_SCREENSHOT=" + quote(shot.string()) + " node " + (npm / "page_client.mjs").string() + " " +
                      c().base + " " + quote(message) + " 480 2>&1");
  auto j = json::parse(out.substr(std::min(out.find('{'), out.size())), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  EXPECT_EQ(j["text"], expected);
  EXPECT_EQ(j["finish"], "length");
  EXPECT_NE(j["status"].get<std::string>().find("kill sent to node"), std::string::npos) << out;
  EXPECT_EQ(j["second"]["finish"], "stopped") << out;
  EXPECT_EQ(j["second"]["bubbles"], 4) << "a new chat: two user messages and two answers";
  EXPECT_EQ(j["second"]["send_enabled"], true);
  EXPECT_EQ(cluster_->nodes[1]->wait_exit(std::chrono::seconds(10)), 137);
}

} // namespace
} // namespace strata
