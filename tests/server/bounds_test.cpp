// What `strata serve` does before and around a generation is bounded: hostile
// chat templates, huge template variables and clients that stop reading cost a
// bounded time and memory, free their places and caches, and never disturb the
// other clients, which are served exactly as alone (each test runs in a crowd).

#include "tests/server/serve_support.hpp"

#include <atomic>
#include <fstream>
#include <future>
#include <thread>

namespace strata {
namespace {

using namespace servetest;
using clk = std::chrono::steady_clock;

// A coordinator, one node, and a serve with `flags`; the port of its HTTP side.
struct Serve {
  OneNode c;
  std::unique_ptr<Process> server;
  std::string base; // http://127.0.0.1:PORT
  uint16_t port = 0;
  std::string refused; // what serve printed when it refused to start
  explicit Serve(const std::vector<std::string>& flags) {
    std::string cmd = "exec " + exe + " serve --cluster " + c.cluster + " --http 127.0.0.1:0";
    for (auto& f : flags)
      cmd += " " + quote(f);
    server = std::make_unique<Process>(std::vector<std::string>{"/bin/sh", "-c", cmd + " 2>&1"});
    const auto line = server->wait_line("ready http ", std::chrono::seconds(30));
    if (line.empty()) {
      refused = server->drain();
      return;
    }
    base = "http://" + line.substr(11);
    port = port_of(line);
  }
  Http post(const std::string& path, const std::string& body, int max_s = 60) const {
    const auto file = test::scratch_dir("body-" + std::to_string(::getpid()) + "-" + std::to_string(next_file()));
    std::ofstream(file / "b") << body;
    const auto out = sh("curl -s -m " + std::to_string(max_s) + " -w '\\n%{http_code}' --data-binary @" +
                        (file / "b").string() + " " + base + path);
    const auto nl = out.rfind('\n');
    return {nl == std::string::npos ? 0 : std::atoi(out.c_str() + nl + 1), nl == std::string::npos ? out : out.substr(0, nl)};
  }
  json get(const std::string& path) const { return json::parse(sh("curl -s -m 20 " + base + path), nullptr, false); }
  // A metric's value from /metrics (-1 when absent).
  double metric(const std::string& name) const {
    std::istringstream is(sh("curl -s -m 20 " + base + "/metrics"));
    for (std::string line; std::getline(is, line);)
      if (line.rfind(name + " ", 0) == 0)
        return std::atof(line.c_str() + name.size() + 1);
    return -1;
  }
  static int next_file() {
    static std::atomic<int> n{0};
    return n++;
  }
};

std::string chat_body(const std::string& content, const std::string& more = "") {
  return json{{"messages", json::array({{{"role", "user"}, {"content", content}}})}, {"max_tokens", 8}, {"temperature", 0}}
    .dump()
    .insert(1, more);
}

// CPU seconds a process has used so far (utime + stime).
double cpu_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::istringstream is(stat.substr(stat.rfind(')') + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; is >> field; ++i)
    if (i == 14 || i == 15)
      ticks += std::atof(field.c_str());
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

long rss_kb(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0)
      return std::atol(line.c_str() + 6);
  return -1;
}

// The crowd: completions (no template involved) running while a test's
// hostile requests are in flight; each must equal the same request alone.
class Crowd {
public:
  Crowd(const Serve& s, int clients) {
    for (int i = 0; i < clients; ++i)
      runs_.push_back(std::async(std::launch::async, [&s, i] {
        const std::string prompt = "Once upon a time " + std::string(1, static_cast<char>('A' + i));
        const auto r = s.post("/v1/completions", completion_body(prompt, 24, i % 2 == 0));
        const std::string text = i % 2 == 0 ? sse_text(r.body) : json::parse(r.body, nullptr, false)["choices"][0]["text"].get<std::string>();
        return std::make_pair(prompt, text);
      }));
  }
  void expect_each_as_alone() {
    for (auto& f : runs_) {
      auto [prompt, text] = f.get();
      EXPECT_EQ(text, local_text(prompt, 24)) << prompt;
    }
  }

private:
  std::vector<std::future<std::pair<std::string, std::string>>> runs_;
};

// Loops over one list: nothing new is created, so the render runs into the
// request timeout (or its step bound, whichever comes first on this machine).
const std::string loop_template =
  "{% set l = range(1000) %}{% for i in l %}{% for j in l %}{% for k in l %}{% endfor %}{% endfor %}{% endfor %}"
  "{{ messages[0].content }}";

// The answer to a request whose render ran away: the timeout, or a named bound.
void expect_bounded(const Http& r) {
  EXPECT_TRUE((r.status == 504 && r.body.find("timeout") != std::string::npos) ||
              (r.status == 400 && r.body.find("chat_template_limit") != std::string::npos))
    << r.status << " " << r.body;
}

TEST(ServeBounds, ALongLoopingTemplateEndsAtTheRequestTimeoutAndFreesItsPlaces) {
  if (!have("curl"))
    GTEST_SKIP() << "curl is not installed (scripts/test installs it)";
  const auto dir = test::scratch_dir("loop-template");
  std::ofstream(dir / "loop.jinja") << loop_template;
  // Four chats with n=4 took all 16 places, and before the render was bounded
  // every later generation got 429 for good while serve stayed at 200% CPU.
  Serve s({"--chat-template", (dir / "loop.jinja").string(), "--request-timeout", "1", "--max-in-flight", "20"});
  ASSERT_FALSE(s.base.empty()) << s.refused;
  Crowd crowd(s, 3);
  const auto t0 = clk::now();
  std::vector<std::future<Http>> chats;
  for (int i = 0; i < 4; ++i)
    chats.push_back(std::async(std::launch::async, [&] { return s.post("/v1/chat/completions", chat_body("hi", "\"n\":4,"), 30); }));
  auto apply = std::async(std::launch::async, [&] { return s.post("/apply-template", chat_body("hi"), 30); });
  for (auto& f : chats)
    expect_bounded(f.get());
  expect_bounded(apply.get());
  const auto took = clk::now() - t0;
  EXPECT_LT(took, std::chrono::seconds(6)) << "the request timeout (1 s) covers the render";
  crowd.expect_each_as_alone();
  // The places are free and the CPU is given back.
  EXPECT_EQ(s.metric("strata_http_requests_in_flight"), 0);
  const double c0 = cpu_of(s.server->pid());
  std::this_thread::sleep_for(std::chrono::seconds(1));
  EXPECT_LT(cpu_of(s.server->pid()) - c0, 0.3) << "serve is idle again";
  const auto after = s.post("/v1/completions", completion_body("Once upon a time", 12, false));
  EXPECT_EQ(after.status, 200) << after.body;
}

TEST(ServeBounds, AClientThatLeavesWhileTheTemplateRendersFreesItsPlaceAtOnce) {
  if (!have("curl"))
    GTEST_SKIP() << "curl is not installed (scripts/test installs it)";
  const auto dir = test::scratch_dir("loop-template-leave");
  std::ofstream(dir / "loop.jinja") << loop_template;
  Serve s({"--chat-template", (dir / "loop.jinja").string(), "--request-timeout", "60", "--max-in-flight", "2"});
  ASSERT_FALSE(s.base.empty()) << s.refused;
  // Two clients give up after 1 s; the render stops when they leave, not at 60 s.
  for (int i = 0; i < 2; ++i)
    (void)s.post("/v1/chat/completions", chat_body("hi"), 1);
  const auto deadline = clk::now() + std::chrono::seconds(5);
  while (s.metric("strata_http_requests_in_flight") != 0 && clk::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(s.metric("strata_http_requests_in_flight"), 0);
  Crowd crowd(s, 2);
  crowd.expect_each_as_alone();
}

TEST(ServeBounds, TemplatesThatGrowOrRecurseAre400NamingTheBound) {
  if (!have("curl"))
    GTEST_SKIP() << "curl is not installed (scripts/test installs it)";
  const auto dir = test::scratch_dir("growing-templates");
  std::ofstream(dir / "grow.jinja")
    << "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}";
  std::ofstream(dir / "recurse.jinja") << "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
  for (auto [file, bound] : {std::pair{"grow.jinja", "memory"}, std::pair{"recurse.jinja", "recursion"}}) {
    Serve s({"--chat-template", (dir / file).string(), "--request-timeout", "20"});
    ASSERT_FALSE(s.base.empty()) << s.refused;
    const long before = rss_kb(s.server->pid());
    Crowd crowd(s, 2);
    const auto r = s.post("/v1/chat/completions", chat_body("hi"));
    EXPECT_EQ(r.status, 400) << r.body;
    EXPECT_NE(r.body.find("chat_template_limit"), std::string::npos) << r.body;
    EXPECT_NE(r.body.find(std::string(bound) + " limit"), std::string::npos) << r.body;
    crowd.expect_each_as_alone();
    std::printf("%s: serve RSS %ld kB before, %ld kB after\n", file, before, rss_kb(s.server->pid()));
  }
}

TEST(ServeBounds, ADeeplyNestedTemplateStopsServeAtStartNamingTheLine) {
  const auto dir = test::scratch_dir("deep-template");
  std::ofstream(dir / "deep.jinja") << "hello\n{{ " << std::string(10000, '(') << "1" << std::string(10000, ')') << " }}";
  Serve s({"--chat-template", (dir / "deep.jinja").string()});
  EXPECT_TRUE(s.base.empty());
  EXPECT_NE(s.refused.find("nested deeper than"), std::string::npos) << s.refused;
  EXPECT_NE(s.refused.find("line 2"), std::string::npos) << s.refused;
  EXPECT_EQ(s.server->wait_exit(), 1) << "an error exit, not a crash (SIGSEGV before)";
}

TEST(ServeBounds, EightyThousandTemplateVariablesAnswerWithinTheTimeout) {
  if (!have("curl"))
    GTEST_SKIP() << "curl is not installed (scripts/test installs it)";
  const auto dir = test::scratch_dir("kwargs-template");
  std::ofstream(dir / "t.jinja") << "{{ messages[0].content }}{{ k79999 }}";
  Serve s({"--chat-template", (dir / "t.jinja").string(), "--request-timeout", "5", "--max-body", "4194304"});
  ASSERT_FALSE(s.base.empty()) << s.refused;
  json kwargs = json::object();
  for (int i = 0; i < 80000; ++i)
    kwargs["k" + std::to_string(i)] = i;
  const std::string body = chat_body("hi", "\"chat_template_kwargs\":" + kwargs.dump() + ",");
  Crowd crowd(s, 2);
  const auto t0 = clk::now();
  const auto r = s.post("/apply-template", body);
  const auto took = std::chrono::duration<double>(clk::now() - t0).count();
  EXPECT_EQ(r.status, 200) << r.body.substr(0, 300);
  EXPECT_EQ(json::parse(r.body, nullptr, false)["prompt"], "hi79999");
  std::printf("80,000 template variables: %.2f s (21.4 s of CPU before)\n", took);
  EXPECT_LT(took, 5.0);
  const auto g = s.post("/v1/chat/completions", body);
  EXPECT_EQ(g.status, 200) << g.body.substr(0, 300);
  crowd.expect_each_as_alone();
}

// A streaming request from a client that never reads: a tiny receive window,
// so that serve's writes stall after a few kilobytes.
int stalled_stream(uint16_t port) {
  const int fd = connect_to(port, 4096);
  if (fd < 0)
    return -1;
  const auto body = json{{"prompt", "Once upon a time"}, {"max_tokens", 480}, {"temperature", 0},
                         {"stream", true}, {"logprobs", 20}}.dump();
  const std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                          std::to_string(body.size()) + "\r\n\r\n" + body;
  (void)!::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  return fd;
}

TEST(ServeBounds, ClientsThatStopReadingAreClosedAtTheWriteTimeoutAndTheirCachesFreed) {
  if (!have("curl"))
    GTEST_SKIP() << "curl is not installed (scripts/test installs it)";
  Serve s({"--write-timeout-ms", "1500", "--max-in-flight", "32"});
  ASSERT_FALSE(s.base.empty()) << s.refused;
  (void)s.post("/v1/completions", completion_body("warm", 4, false)); // the model is loaded, the route known
  const long rss_start = rss_kb(s.server->pid());
  const auto baseline = s.get("/health")["connections"].get<int>();
  std::vector<int> stalled;
  for (int i = 0; i < 8; ++i)
    stalled.push_back(stalled_stream(s.port));
  Crowd crowd(s, 4); // served normally meanwhile
  // Each stalled connection is closed within the write timeout of its stall
  // (before: held after their generations ended, and serve grew 161 -> 311 MiB).
  const auto deadline = clk::now() + std::chrono::seconds(20);
  json health;
  while (clk::now() < deadline) {
    health = s.get("/health");
    if (health["write_timeouts"].get<int>() + health["send_buffer_overflows"].get<int>() >= 8)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_GE(health["write_timeouts"].get<int>() + health["send_buffer_overflows"].get<int>(), 8) << health.dump();
  crowd.expect_each_as_alone();
  const long rss_end = rss_kb(s.server->pid());
  std::printf("serve RSS %ld kB at start, %ld kB with 8 stalled streams closed; %s\n", rss_start, rss_end,
              health.dump().c_str());
  EXPECT_LT(rss_end - rss_start, 64 * 1024);
  for (int fd : stalled) {
    EXPECT_TRUE(closed_by_peer(fd, std::chrono::seconds(10))) << "serve closed the connection";
    ::close(fd);
  }
  // Their sessions were cancelled: every shard's cache is empty again.
  const auto sessions_left = [&] {
    long n = 0;
    for (auto& sh : s.get("/v1/cluster")["shards"])
      n += sh["sessions"].get<long>();
    return n;
  };
  const auto until = clk::now() + std::chrono::seconds(10);
  while (sessions_left() != 0 && clk::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(sessions_left(), 0);
  EXPECT_EQ(s.get("/health")["connections"].get<int>(), baseline);
}

} // namespace
} // namespace strata
