// Hostile chat templates (from an operator's file or a downloaded model's
// metadata, fed with client data): every parse and render is bounded, each
// bound is a typed error naming it, and nothing crashes, hangs or keeps memory.

#include "model/base/error.hpp"
#include "model/text/chat_template.hpp"
#include "model/text/jinja/jinja.hpp"
#include "tests/model/gguf_writer.hpp"
#include "tests/support.hpp"

#include <atomic>
#include <chrono>
#include <ctime>
#include <limits>
#include <string>
#include <sys/resource.h>
#include <thread>

namespace strata {
namespace {

using model::jinja::Object;
using model::jinja::RenderLimits;
using model::jinja::Template;
using model::jinja::TemplateError;
using model::jinja::Value;
using Limit = TemplateError::Limit;
using clk = std::chrono::steady_clock;

// The error a template gives at parse or render (limit none when it renders).
TemplateError outcome(const std::string& text, const RenderLimits& limits = {}, const Object& globals = {}) {
  try {
    Template::parse(text).render(globals, limits);
  } catch (const TemplateError& e) {
    return e;
  }
  return TemplateError("rendered", 0);
}

double cpu_seconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

long max_rss_kb() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

TEST(JinjaLimits, DeepNestingIsATypedErrorNamingTheLineNotACrash) {
  // 10,000 nested parentheses (20 KB): SIGSEGV before the parser counted its depth.
  const std::string parens = "line one\n{{ " + std::string(10000, '(') + "1" + std::string(10000, ')') + " }}";
  auto e = outcome(parens);
  EXPECT_EQ(e.limit(), Limit::nesting) << e.what();
  EXPECT_EQ(e.line(), 2) << e.what();
  EXPECT_NE(std::string(e.what()).find("nested deeper than"), std::string::npos) << e.what();
  // The other ways down: not, unary minus, a long operator chain, lists, calls,
  // blocks inside blocks.
  std::string nots, minus, chain = "{{ 1", lists = "{{ " + std::string(5000, '['), calls = "{{ ", blocks;
  for (int i = 0; i < 10000; ++i) {
    nots += "not ";
    minus += "- ";
    chain += " ~ 1";
  }
  for (int i = 0; i < 5000; ++i) {
    calls += "range(";
    blocks += "{% if true %}";
  }
  for (const auto& t : {"{{ " + nots + "1 }}", "{{ " + minus + "1 }}", chain + " }}",
                        lists + std::string(5000, ']') + " }}", calls + "1" + std::string(5000, ')') + " }}", blocks}) {
    auto r = outcome(t);
    EXPECT_EQ(r.limit(), Limit::nesting) << r.what();
  }
  // What real templates nest stays far below the bound.
  EXPECT_EQ(outcome("{{ ((((1 + 2)))) ~ 'a' ~ 'b' ~ [[1], [2]] | length }}").limit(), Limit::none);
}

// The loops below build their inner range(1000000) again at every outer
// iteration, and the byte budget counts every value a render creates: a fast
// CPU reaches the default 256 MiB before a deadline of a few hundred ms or a
// cancel flag. The tests that are about the deadline or the flag lift it.
constexpr std::size_t no_byte_budget = std::size_t{1} << 40;

TEST(JinjaLimits, ALongLoopStopsAtTheDeadlineOrTheStepBound) {
  const std::string loop = "{% for i in range(1000000) %}{% for j in range(1000000) %}{{ '' }}{% endfor %}{% endfor %}";
  RenderLimits timed;
  timed.deadline = clk::now() + std::chrono::milliseconds(300);
  timed.max_bytes = no_byte_budget;
  const auto t0 = clk::now();
  auto e = outcome(loop, timed);
  const auto took = clk::now() - t0;
  EXPECT_EQ(e.limit(), Limit::time) << e.what();
  EXPECT_LT(took, std::chrono::seconds(3)) << "the deadline is read at least every 1024 steps";
  RenderLimits steps;
  steps.max_steps = 200000;
  e = outcome(loop, steps);
  EXPECT_EQ(e.limit(), Limit::steps) << e.what();
  EXPECT_NE(std::string(e.what()).find("200000 steps"), std::string::npos) << e.what();
}

TEST(JinjaLimits, ARenderIsCancelledFromAnotherThread) {
  std::atomic<bool> cancel{false};
  RenderLimits l;
  l.cancel = &cancel;
  l.max_bytes = no_byte_budget;
  std::thread stop([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    cancel = true;
  });
  const auto t0 = clk::now();
  auto e = outcome("{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}", l);
  stop.join();
  EXPECT_EQ(e.limit(), Limit::cancelled) << e.what();
  EXPECT_LT(clk::now() - t0, std::chrono::seconds(3));
}

TEST(JinjaLimits, ValuesTheTemplateCreatesAreBoundedInBytes) {
  const long before = max_rss_kb();
  // A string that doubles, a list that grows by copying, a dict that grows: each
  // was +2 to +3.5 GiB before the render counted what it created.
  const std::vector<std::string> growers = {
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
    "{% set ns = namespace(l=[]) %}{% for i in range(1000000) %}{% set ns.l = ns.l + [i, i, i] %}{% endfor %}",
    "{% set ns = namespace(s='') %}{% for i in range(1000000) %}{% set ns.s = ns.s ~ ('y' * 1000) %}{% endfor %}",
    "{{ ('x' * 60000000) ~ ('x' * 60000000) ~ ('x' * 60000000) ~ ('x' * 60000000) ~ ('x' * 60000000) }}"};
  for (const auto& t : growers) {
    auto e = outcome(t);
    EXPECT_TRUE(e.limit() == Limit::memory || e.limit() == Limit::steps || e.limit() == Limit::output) << e.what();
  }
  const long after = max_rss_kb();
  std::printf("max RSS %ld kB before, %ld kB after the growing templates\n", before, after);
  EXPECT_LT(after - before, 1024 * 1024) << "a render holds at most its 256 MiB budget (a few copies in flight)";
  // A smaller budget is honoured and named.
  RenderLimits small;
  small.max_bytes = 1 << 20;
  auto e = outcome("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", small);
  EXPECT_EQ(e.limit(), Limit::memory) << e.what();
  EXPECT_NE(std::string(e.what()).find("1 MiB"), std::string::npos) << e.what();
}

TEST(JinjaLimits, NestedValuesAndANamespaceInsideItselfAreErrorsNotCrashes) {
  // Lists inside lists, 100,000 deep: their destructors alone would overflow the stack.
  auto e = outcome("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}{% endfor %}{{ ns.l }}");
  EXPECT_EQ(e.limit(), Limit::nesting) << e.what();
  // A namespace that holds itself (the one way to a cycle): printing it as JSON
  // or comparing it recurses; both stop, and the cycle is broken when the render ends.
  for (const auto& t : {"{% set ns = namespace() %}{% set ns.me = ns %}{{ ns | tojson }}",
                        "{% set a = namespace() %}{% set b = namespace() %}{% set a.x = b %}{% set b.x = a %}"
                        "{{ a == b }}"}) {
    auto r = outcome(t);
    EXPECT_EQ(r.limit(), Limit::nesting) << r.what();
  }
  // Macros calling themselves.
  e = outcome("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
  EXPECT_EQ(e.limit(), Limit::recursion) << e.what();
}

TEST(JinjaLimits, WorkInsideFiltersIsLinearOrCounted) {
  // Substring search on a worst case (|s| x |sub| steps with a naive search).
  const auto t0 = clk::now();
  auto e = outcome("{{ ('a' * 200000 ~ 'b') in ('a' * 20000000) }}{{ ('a' * 20000000).count('a' * 100000 ~ 'b') }}"
                   "{{ ('a' * 20000000).split('a' * 100000 ~ 'b') | length }}"
                   "{{ ('a' * 10000000) | replace('a' * 100000 ~ 'b', 'c') | length }}");
  EXPECT_EQ(e.limit(), Limit::none) << e.what();
  // Linear: about a second on an idle machine; a naive search would take hours.
  // The bound leaves room for a loaded CI machine without losing that difference.
  EXPECT_LT(clk::now() - t0, std::chrono::seconds(60));
  // unique compares every pair: counted as steps.
  RenderLimits l;
  l.max_steps = 1000000;
  e = outcome("{{ range(100000) | unique | list | length }}", l);
  EXPECT_EQ(e.limit(), Limit::steps) << e.what();
}

TEST(JinjaLimits, ManyTemplateVariablesCostLinearTime) {
  // chat_template_kwargs with many keys: 10k / 40k / 80k keys took 0.78 / 5.55 /
  // 21.4 s of CPU when every variable was set by a linear search.
  const model::ChatTemplate tpl("{{ messages[0]['content'] }}{{ k79999 | default('') }}", "test", "", "");
  nlohmann::ordered_json messages = nlohmann::ordered_json::array({{{"role", "user"}, {"content", "hi"}}});
  const auto cost = [&](int keys) {
    nlohmann::json extra = nlohmann::json::object();
    for (int i = 0; i < keys; ++i)
      extra["k" + std::to_string(i)] = i;
    const double c0 = cpu_seconds();
    const auto out = tpl.render(messages, true, extra);
    EXPECT_EQ(out.rfind("hi", 0), 0u);
    return cpu_seconds() - c0;
  };
  const double t10 = cost(10000), t80 = cost(80000);
  std::printf("render with 10k variables %.3f s CPU, with 80k %.3f s CPU\n", t10, t80);
  EXPECT_LT(t80, 2.0);
  EXPECT_LT(t80, 32 * std::max(t10, 0.005)) << "8x the keys: linear is 8x, quadratic 64x";
}

TEST(JinjaLimits, AGgufTemplateIsCheckedWithTheSameRulesWhenItIsRead) {
  // A downloaded model's own template (GGUF tokenizer.chat_template): deep
  // nesting is a typed error naming the file and line when it is read (it
  // crashed serve at the first chat request), a long loop stops at the deadline.
  const auto dir = test::scratch_dir("gguf-templates");
  const auto write = [&](const std::string& name, const std::string& tpl) {
    test::GgufWriter w;
    w.kv_string("general.architecture", "llama");
    w.kv_string("tokenizer.chat_template", tpl);
    w.kv_strings("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "a"});
    const auto file = (dir / name).string();
    test::write_file(file, w.bytes());
    model::ModelConfig cfg;
    cfg.identity = file;
    return cfg;
  };
  const auto deep = write("deep.gguf", "hi\n{{ " + std::string(10000, '(') + "1" + std::string(10000, ')') + " }}");
  try {
    (void)model::ChatTemplate::for_model(deep, nullptr);
    FAIL() << "a template nested 10,000 deep was accepted";
  } catch (const model::Error& e) {
    EXPECT_NE(std::string(e.what()).find("nested deeper than"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("line 2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("deep.gguf"), std::string::npos) << e.what();
  }
  const auto loop = model::ChatTemplate::for_model(
    write("loop.gguf", "{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}"), nullptr);
  ASSERT_TRUE(loop.has_value());
  RenderLimits l;
  l.deadline = clk::now() + std::chrono::milliseconds(200);
  l.max_bytes = no_byte_budget;
  // (no step bound: on a quiet machine 20 million steps took less than the
  // 200 ms, and the step bound stopped the loop first)
  l.max_steps = std::numeric_limits<uint64_t>::max() / 2;
  try {
    (void)loop->render(nlohmann::ordered_json::array(), true, nlohmann::json::object(), l);
    FAIL() << "the loop rendered";
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.limit(), Limit::time) << e.what();
  }
}

} // namespace
} // namespace strata
