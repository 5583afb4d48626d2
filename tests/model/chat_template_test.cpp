// The chat template engine against @huggingface/jinja (the renderer of
// transformers.js): real templates from tests/data/chat_templates and
// feature templates, rendered by both over the same conversations, must give
// the same text (or both refuse). The reference runs in Node from the npm
// package scripts/test installs; without it these tests skip and say why.

#include "model/text/chat_template.hpp"
#include "model/base/error.hpp"
#include "model/text/jinja/jinja.hpp"
#include "tests/model/gguf_writer.hpp"
#include "tests/support.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;
using strata::model::jinja::Object;
using strata::model::jinja::Template;
using strata::model::jinja::TemplateError;
using strata::model::jinja::Value;

const fs::path data_dir = fs::path(STRATA_SOURCE_DIR) / "tests" / "data" / "chat_templates";
const fs::path npm_dir = fs::path(STRATA_BINARY_DIR) / "npm";

std::string slurp(const fs::path& p) { return strata::test::read_file(p); }

std::string run(const std::string& cmd) { return strata::test::command_output(cmd); }

std::string reference_missing() { return strata::test::npm_missing("@huggingface/jinja"); }

// Renders every case with @huggingface/jinja.
ojson reference(const ojson& cases) {
  fs::copy_file(fs::path(STRATA_SOURCE_DIR) / "tests" / "model" / "render_templates.mjs",
                npm_dir / "render_templates.mjs", fs::copy_options::overwrite_existing);
  const fs::path in = npm_dir / ("template_cases_" + std::to_string(::getpid()) + ".json");
  std::ofstream(in) << cases.dump();
  const std::string out = run("node " + (npm_dir / "render_templates.mjs").string() + " " + in.string());
  fs::remove(in);
  return ojson::parse(out);
}

struct Outcome {
  bool ok = false;
  std::string text;
};

Outcome ours(const std::string& tpl, const ojson& context) {
  try {
    const Template t = Template::parse(tpl);
    Object g;
    for (auto& [k, v] : context.items())
      g.set(k, Value::from_json(v));
    return {true, t.render(g)};
  } catch (const TemplateError& e) {
    return {false, e.message()};
  }
}

ojson conversations() {
  return ojson::parse(R"([
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Hello!"},
     {"role": "assistant", "content": "Hi there. How can I help?"},
     {"role": "user", "content": "Tell me a joke about \"quotes\" & <tags>\n  twice. "}],
    [{"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "  4  "},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": "Ünïcödé ✓ and emoji 🙂"}],
    [{"role": "system", "content": "Use tools."},
     {"role": "user", "content": "Weather in Oslo?"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "call_1",
       "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
     {"role": "tool", "content": "{\"temp\": -3.5}", "tool_call_id": "call_1"},
     {"role": "user", "content": "Thanks"}]
  ])");
}

ojson tools() {
  return ojson::parse(R"([{"type": "function", "function": {"name": "get_weather",
    "description": "Weather for a city", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}])");
}

void compare(const ojson& cases, const std::vector<std::string>& names) {
  const ojson ref = reference(cases);
  ASSERT_EQ(ref.size(), cases.size());
  int agreed_text = 0, agreed_refusal = 0;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const Outcome o = ours(cases[i]["template"], cases[i]["context"]);
    const bool ref_ok = ref[i]["ok"];
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(o.ok, ref_ok) << "strata: " << o.text << "\nreference: " << ref[i].dump();
    if (o.ok != ref_ok)
      continue;
    if (o.ok) {
      EXPECT_EQ(o.text, ref[i]["text"].get<std::string>());
      ++agreed_text;
    } else {
      ++agreed_refusal;
    }
  }
  std::printf("%d renderings equal, %d refused by both\n", agreed_text, agreed_refusal);
}

TEST(ChatTemplate, RealTemplatesRenderAsTheReferenceDoes) {
  if (auto why = reference_missing(); !why.empty())
    GTEST_SKIP() << why;
  ojson cases = ojson::array();
  std::vector<std::string> names;
  int templates = 0;
  for (auto& entry : fs::directory_iterator(data_dir)) {
    if (entry.path().extension() != ".json")
      continue;
    ++templates;
    const ojson t = ojson::parse(slurp(entry.path()));
    int conv = 0;
    for (auto& messages : conversations()) {
      for (bool gen : {true, false}) {
        ojson ctx = {{"messages", messages}, {"bos_token", t["bos_token"]}, {"eos_token", t["eos_token"]},
                     {"add_generation_prompt", gen}, {"date_string", "26 Jul 2024"}};
        if (conv == 3)
          ctx["tools"] = tools();
        cases.push_back({{"template", t["template"]}, {"context", ctx}});
        names.push_back(t["name"].get<std::string>() + " conversation " + std::to_string(conv) +
                        (gen ? " +generation prompt" : ""));
      }
      ++conv;
    }
  }
  ASSERT_GE(templates, 10);
  compare(cases, names);
}

TEST(ChatTemplate, FeaturesRenderAsTheReferenceDoes) {
  if (auto why = reference_missing(); !why.empty())
    GTEST_SKIP() << why;
  const ojson ctx = ojson::parse(R"({
    "messages": [{"role": "system", "content": "  S  "}, {"role": "user", "content": "a,b,,c"},
                 {"role": "assistant", "content": "x"}],
    "items": [{"n": "b", "v": 2}, {"n": "A", "v": 1}, {"n": "c", "v": 3}],
    "d": {"z": 1, "a": [1, 2, {"k": "v"}], "m": {"q": "é\"\\\n"}},
    "s": "Hello World", "n": 7, "f": 2.5, "empty": [], "t": true})");
  const std::vector<std::string> templates = {
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }}:{{ loop.index0 }}{{ loop.revindex }}{{ 'F' if loop.first }}{{ 'L' if loop.last }}{{ loop.previtem.role if loop.previtem is defined }}|{% endfor %}",
    "{% for m in messages if m.role != 'system' %}{{ loop.index }}={{ m.role }}{% else %}none{% endfor %}",
    "{% for m in empty %}x{% else %}empty{% endfor %}",
    "{% for k, v in d.items() %}{{ k }}:{{ v | tojson }};{% endfor %}",
    "{{ d | tojson }}\n{{ d | tojson(indent=2) }}\n{{ items | tojson(indent=4) }}",
    "{{ messages[0].content | trim }}|{{ messages[0]['content'].strip() }}|{{ s.upper() }}{{ s.lower() }}{{ s | title }}",
    "{{ messages[1].content.split(',') | join('-') }}|{{ s.split() | length }}|{{ s.replace('o', '0') }}",
    "{{ s[::-1] }}|{{ s[1:4] }}|{{ messages[1:] | length }}|{{ messages[-1].role }}|{{ s[-3:] }}",
    "{% set ns = namespace(c=0, last='') %}{% for m in messages %}{% set ns.c = ns.c + 1 %}{% set ns.last = m.role %}{% endfor %}{{ ns.c }}{{ ns.last }}",
    "{% set x = 1 %}{% for m in messages %}{% set x = x + 1 %}{% endfor %}{{ x }}",
    "{% macro greet(name, p='Hi') %}{{ p }} {{ name }}!{% endmacro %}{{ greet('a') }} {{ greet('b', p='Yo') }}",
    "{{ items | selectattr('n', 'equalto', 'b') | map(attribute='v') | join(',') }}|{{ messages | rejectattr('role', 'equalto', 'system') | map(attribute='role') | join(',') }}|{{ items | rejectattr('n', 'equalto', 'A') | list | length }}",
    "{{ items | sort(attribute='n') | map(attribute='n') | join }}|{{ [3, 1, 2] | sort | join }}|{{ [3, 1, 2] | last }}{{ [3, 1, 2] | first }}",
    "{{ undefined_var | default('dflt') }}|{{ '' | default('e', true) }}|{{ 1 if undefined_var is defined else 0 }}{{ 1 if n is odd else 0 }}{{ 1 if n is number and s is string and d is mapping and items is iterable else 0 }}",
    "{{ 1 if 'b' in s else 0 }}{{ 1 if 'W' in s else 0 }}{{ 1 if 'z' in d else 0 }}{{ 1 if 2 in [1, 2] else 0 }}{{ 1 if 'x' not in s else 0 }}|{{ 1 if n > 3 and f < 3 else 0 }}|{{ not t or n }}",
    "{{ n + 1 }} {{ n * 2 }} {{ n // 2 }} {{ n % 3 }} {{ n / 2 }} {{ f * 2 }} {{ 2 ** 10 }} {{ 'ab' ~ n }}",
    "{{ 'yes' if t else 'no' }}|{{ 'a' if n > 10 else 'b' if n > 5 else 'c' }}",
    "  {%- if t -%}  trimmed  {%- endif -%}  |\n  {% if t %}\n    kept\n  {% endif %}\nend",
    "{# comment #}\n{% for i in range(3) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}|{% for i in range(5) %}{% if i is even %}{% continue %}{% endif %}{{ i }}{% endfor %}",
    "{{ d.a[2].k }}|{{ d['m']['q'] | length }}|{{ 1 if d.missing is defined else 0 }}|{{ (d.a | first) + (d.a[1]) }}|{{ d.a | last | tojson }}",
    "{{ 1 if s.startswith('Hell') else 0 }}{{ 1 if s.endswith('ld') else 0 }}{{ s.rstrip() }}|{{ '  x ' | trim }}|{{ s | lower | capitalize }}",
    "{% set content %}block {{ n }}{% endset %}{{ content | upper }}|{{ 'a\\nb' | indent(2, first=true) }}|{{ 3.7 | int }}{{ '12' | int + 1 }}{{ 2 | float }}",
    "{%- for m in messages -%}\n  {%- if loop.first and m.role == 'system' %}[S:{{ m.content }}]\n  {%- elif m.role == 'user' %}[U:{{ m.content }}]\n  {%- else %}[A:{{ m.content }}]\n  {%- endif %}\n{%- endfor %}\n",
    "{{ raise_exception('stop here: ' ~ n) }}",
    "{{ d | dictsort | length }}|{{ items | map(attribute='n') | unique | list | length }}",
    "{{ [1, 2] + [3] }}|{{ {'k': [1]} | tojson }}|{{ ('a', 'b') | join }}",
  };
  ojson cases = ojson::array();
  std::vector<std::string> names;
  for (std::size_t i = 0; i < templates.size(); ++i) {
    cases.push_back({{"template", templates[i]}, {"context", ctx}});
    names.push_back("feature template " + std::to_string(i) + ": " + templates[i]);
  }
  compare(cases, names);
}

TEST(ChatTemplate, UnsupportedConstructsAreRefusedAtParseNamingTheLine) {
  const std::vector<std::pair<std::string, std::string>> bad = {
    {"{{ x | frobnicate }}", "unsupported filter 'frobnicate'"},
    {"{% include 'other.jinja' %}", "unsupported statement 'include'"},
    {"a\n{% if x is prime %}{% endif %}", "line 2"},
    {"{% for x in y %}", "'endfor'"},
    {"{{ x ", "unclosed"},
    {"{% if %}{% endif %}", "expected an expression"},
  };
  for (auto& [tpl, want] : bad) {
    try {
      Template::parse(tpl);
      ADD_FAILURE() << "parsed: " << tpl;
    } catch (const TemplateError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
  // Through ChatTemplate: a typed error naming where the template came from.
  try {
    strata::model::ChatTemplate("{% import 'x' as y %}", "the chat_template of 'test'", "<s>", "</s>");
    ADD_FAILURE();
  } catch (const strata::model::Error& e) {
    EXPECT_EQ(e.code(), strata::model::errc::unsupported);
    EXPECT_NE(std::string(e.what()).find("the chat_template of 'test'"), std::string::npos) << e.what();
  }
}

TEST(ChatTemplate, RaiseExceptionAndRuntimeErrorsAreTyped) {
  const Template t = Template::parse("{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok");
  Object g;
  g.set("messages", Value::from_json(ojson::parse(R"([{"role": "system", "content": "x"}])")));
  try {
    t.render(g);
    ADD_FAILURE();
  } catch (const TemplateError& e) {
    EXPECT_TRUE(e.raised());
    EXPECT_EQ(e.message(), "System role not supported");
  }
  // Reading a field of something undefined is an error, not silence.
  try {
    Template::parse("{{ nothing.field }}").render({});
    ADD_FAILURE();
  } catch (const TemplateError& e) {
    EXPECT_FALSE(e.raised());
    EXPECT_NE(e.message().find("'nothing' is undefined"), std::string::npos) << e.message();
  }
  // A runaway template is stopped.
  EXPECT_THROW(Template::parse("{% for i in range(2000000) %}x{% endfor %}").render({}), TemplateError);
}

TEST(ChatTemplate, PrintsValuesAsPythonJinjaDoes) {
  // Where @huggingface/jinja differs from Python's Jinja (which transformers
  // renders with), strata follows Python: True / None / reprs, floor modulo.
  Object g;
  g.set("l", Value::from_json(ojson::parse(R"([1, "a", null, true, 2.5])")));
  g.set("d", Value::from_json(ojson::parse(R"({"k": "v"})")));
  EXPECT_EQ(Template::parse("{{ true }} {{ none }} {{ l }} {{ d }} {{ -7 % 3 }} {{ 1e20 }} {{ 0.1 + 0.2 }} {{ [1, 2.5] | sum }}").render(g),
            "True None [1, 'a', None, True, 2.5] {'k': 'v'} 2 1e+20 0.30000000000000004 3.5");
  EXPECT_EQ(Template::parse("{% for i in range(3) %}{{ i }}{% if i == 1 %}{% break %}{% endif %}{% endfor %}|"
                            "{{ 'x' * 3 }}|{{ 'Hello'.lstrip('H') }}|{{ 12 is divisibleby 4 }}|{{ [3, 1, 2] | max }}"
                            "|{{ {'b': 1, 'a': 2} | dictsort | map('first') | join }}|{{ 'ab'.endswith(('x', 'b')) }}|{{ dict(a=1, b='x') | tojson }}").render({}),
            "01|xxx|ello|True|3|ab|True|{\"a\": 1, \"b\": \"x\"}");
}

TEST(ChatTemplate, IntegerDictKeysAsInPython) {
  // {0: 0, 512: 128} is a valid dict in Python's Jinja: integer keys look up,
  // iterate and print as integers, stay apart from the strings of their digits,
  // and become strings in JSON. (What Python's Jinja2 prints for each.)
  const auto t = Template::parse(
    "{% set d = {0: 0, 512: 128, '512': 's'} %}{{ d[512] }}|{{ d['512'] }}|{{ d }}|{{ 512 in d }}|{{ 7 in d }}|"
    "{% for k in d %}{{ k ~ ':' ~ (k is number) }},{% endfor %}|{{ d | tojson }}|{{ d.get(0) }}|{{ d.get(1, 'no') }}|"
    "{{ d.keys() | list }}|{% for k, v in d.items() %}{{ k * 2 }}={{ v }};{% endfor %}|{{ {-1: 'm'}[-1] }}");
  EXPECT_EQ(t.render({}), "128|s|{0: 0, 512: 128, '512': 's'}|True|False|0:True,512:True,512:False,|"
                          "{\"0\": 0, \"512\": 128, \"512\": \"s\"}|0|no|[0, 512, '512']|0=0;1024=128;512512=s;|m");
  // A string key that starts with NUL stays that string (the stored form cannot collide).
  Object g;
  g.set("j", Value::from_json(ojson::parse(R"({"\u0000i5": 1})")));
  EXPECT_EQ(Template::parse("{{ 5 in j }}|{{ j | length }}|{% for k in j %}{{ k | length }}{% endfor %}").render(g), "False|1|3");
  EXPECT_THROW(Template::parse("{{ {1.5: 1} }}").render({}), TemplateError) << "float keys: refused, named";
}

TEST(ChatTemplate, FoundInTheModelDirectoryBesideTheTokenizerOrAsAFile) {
  const fs::path dir = fs::temp_directory_path() / ("strata-chat-" + std::to_string(::getpid()));
  fs::create_directories(dir / "tok");
  strata::model::ModelConfig cfg;
  cfg.identity = dir.string();
  cfg.bos_id = 1;
  cfg.eos_ids = {2};
  EXPECT_FALSE(strata::model::ChatTemplate::for_model(cfg, nullptr).has_value());
  // A named list: the "default" one; bos/eos as {"content": ...} objects.
  std::ofstream(dir / "tokenizer_config.json") << R"({"bos_token": {"content": "<s>"}, "eos_token": "</s>",
    "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D{{ eos_token }}"}]})";
  auto t = strata::model::ChatTemplate::for_model(cfg, nullptr);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->render(ojson::array(), true), "<s>D</s>");
  // chat_template.jinja beside it wins (as transformers reads it).
  std::ofstream(dir / "chat_template.jinja") << "J{{ messages | length }}\n";
  EXPECT_EQ(strata::model::ChatTemplate::for_model(cfg, nullptr)->render(ojson::array({1, 2}), true), "J2");
  // Beside a tokenizer given on its own.
  std::ofstream(dir / "tok" / "tokenizer_config.json") << R"({"chat_template": "K"})";
  cfg.identity = "builtin:tiny";
  auto k = strata::model::ChatTemplate::for_model(cfg, nullptr, (dir / "tok" / "tokenizer.json").string());
  std::ofstream(dir / "tok" / "tokenizer.json") << "{}";
  k = strata::model::ChatTemplate::for_model(cfg, nullptr, (dir / "tok" / "tokenizer.json").string());
  ASSERT_TRUE(k.has_value());
  EXPECT_EQ(k->render(ojson::array(), false), "K");
  // --chat-template: a bare template or a tokenizer_config.json.
  EXPECT_EQ(strata::model::ChatTemplate::from_file((dir / "chat_template.jinja").string(), cfg, nullptr).render(ojson::array(), true), "J0");
  EXPECT_EQ(strata::model::ChatTemplate::from_file((dir / "tok" / "tokenizer_config.json").string(), cfg, nullptr).render(ojson::array(), true), "K");
  // A list without "default" is an error naming the file.
  std::ofstream(dir / "tok" / "tokenizer_config.json") << R"({"chat_template": [{"name": "rag", "template": "R"}]})";
  EXPECT_THROW(strata::model::ChatTemplate::for_model(cfg, nullptr, (dir / "tok" / "tokenizer.json").string()),
               strata::model::Error);
  fs::remove_all(dir);
}

TEST(ChatTemplate, FromGgufMetadataWithItsTokenNames) {
  strata::test::GgufWriter w;
  w.kv_string("general.architecture", "llama");
  w.kv_string("tokenizer.chat_template",
              "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}");
  w.kv_strings("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "a"});
  w.kv_u32("tokenizer.ggml.bos_token_id", 1);
  w.kv_u32("tokenizer.ggml.eos_token_id", 2);
  const fs::path file = fs::temp_directory_path() / ("strata-chat-" + std::to_string(::getpid()) + ".gguf");
  std::ofstream(file, std::ios::binary) << w.bytes();
  strata::model::ModelConfig cfg;
  cfg.identity = file.string();
  auto t = strata::model::ChatTemplate::for_model(cfg, nullptr);
  ASSERT_TRUE(t.has_value());
  EXPECT_NE(t->origin().find("tokenizer.chat_template"), std::string::npos) << t->origin();
  EXPECT_EQ(t->render(ojson::parse(R"([{"role": "user", "content": "hi"}])"), true), "<s>[user] hi</s>");
  fs::remove(file);
}

TEST(ChatTemplate, EncodeMapsSpecialTokenTextsToTheirIds) {
  // The byte tokenizer does not know "<s>" as a token: the template's BOS text
  // still becomes the model's BOS id.
  auto tok = strata::model::Tokenizer::bytes();
  strata::model::ModelConfig cfg;
  cfg.bos_id = 1;
  cfg.eos_ids = {2};
  const strata::model::ChatTemplate t("{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
                                      "test", "<s>", "</s>");
  const std::string text = t.render(ojson::parse(R"([{"role": "user", "content": "hi"}])"), true);
  EXPECT_EQ(text, "<s>hi</s>");
  const auto ids = t.encode(text, *tok, cfg);
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 3 + 'h', 3 + 'i', 2}));
}

} // namespace
