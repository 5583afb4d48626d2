// Tool calls read out of replies in each family's syntax: what is a call becomes
// one, everything else stays the model's text byte for byte, and a reply split
// into pieces (as it streams, at every possible cut) gives the same content and
// calls as the whole reply.

#include "server/tool_calls.hpp"
#include "server/tool_grammar.hpp"
#include "tests/model/grammar_support.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <random>
#include <regex>

namespace strata::server {
namespace {

struct Parsed {
  std::string content;
  std::vector<ToolCallOut> calls;
};

Parsed whole(ToolSyntax s, const std::string& text, std::vector<std::string> names = {"get_weather", "search"}) {
  ToolCallParser p(s, std::move(names));
  auto a = p.push(text);
  auto b = p.finish();
  Parsed r{a.content + b.content, a.calls};
  r.calls.insert(r.calls.end(), b.calls.begin(), b.calls.end());
  return r;
}

// The same reply pushed in pieces cut at random places (one byte at a time too).
Parsed pieces(ToolSyntax s, const std::string& text, uint32_t seed) {
  ToolCallParser p(s, {"get_weather", "search"});
  std::mt19937 rng(seed);
  Parsed r;
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t n = seed == 0 ? 1 : 1 + rng() % 7;
    auto o = p.push(text.substr(at, n));
    r.content += o.content;
    r.calls.insert(r.calls.end(), o.calls.begin(), o.calls.end());
    at += n;
  }
  auto o = p.finish();
  r.content += o.content;
  r.calls.insert(r.calls.end(), o.calls.begin(), o.calls.end());
  return r;
}

void expect_same_in_pieces(ToolSyntax s, const std::string& text) {
  const auto w = whole(s, text);
  for (uint32_t seed = 0; seed < 20; ++seed) {
    const auto p = pieces(s, text, seed);
    EXPECT_EQ(p.content, w.content) << to_string(s) << " seed " << seed;
    ASSERT_EQ(p.calls.size(), w.calls.size()) << to_string(s) << " seed " << seed;
    for (std::size_t k = 0; k < w.calls.size(); ++k) {
      EXPECT_EQ(p.calls[k].name, w.calls[k].name);
      EXPECT_EQ(p.calls[k].arguments, w.calls[k].arguments);
    }
  }
}

TEST(ToolCalls, TheSyntaxComesFromTheTemplatesOwnMarkup) {
  EXPECT_EQ(tool_syntax_of("... <tool_call>\\n{\"name\": ... </tool_call> ..."), ToolSyntax::hermes);
  EXPECT_EQ(tool_syntax_of("{{- '[TOOL_CALLS][' }}"), ToolSyntax::mistral);
  EXPECT_EQ(tool_syntax_of("{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"), ToolSyntax::llama3);
  EXPECT_EQ(tool_syntax_of("{{- '<|python_tag|>' }}"), ToolSyntax::llama3);
  EXPECT_EQ(tool_syntax_of("{% for m in messages %}{{ m.content }}{% endfor %}"), ToolSyntax::hermes) << "the fallback";
}

TEST(ToolCalls, HermesCallsBetweenTextAndSeveralInARow) {
  const std::string reply = "Let me check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"units\": \"metric\", "
                            "\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                            "{\"city\": \"Bergen\"}}\n</tool_call>";
  const auto r = whole(ToolSyntax::hermes, reply);
  EXPECT_EQ(r.content, "Let me check both.\n\n");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0].name, "get_weather");
  EXPECT_EQ(r.calls[0].arguments, R"({"units":"metric","city":"Oslo"})") << "keys in the model's order";
  EXPECT_EQ(r.calls[1].arguments, R"({"city":"Bergen"})");
  EXPECT_EQ(r.calls[0].id.rfind("call_", 0), 0u);
  EXPECT_NE(r.calls[0].id, r.calls[1].id);
  expect_same_in_pieces(ToolSyntax::hermes, reply);
  // Qwen3 thinks first: the thinking is content.
  const auto t = whole(ToolSyntax::hermes, "<think>\nOslo.\n</think>\n\n<tool_call>\n{\"name\": \"search\", \"arguments\": {}}\n</tool_call>");
  EXPECT_EQ(t.content, "<think>\nOslo.\n</think>\n\n");
  ASSERT_EQ(t.calls.size(), 1u);
  EXPECT_EQ(t.calls[0].arguments, "{}");
  // A reply that stops right after the object (no closing tag) still made the call.
  EXPECT_EQ(whole(ToolSyntax::hermes, "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"x\"}}").calls.size(), 1u);
}

TEST(ToolCalls, WhatIsNotAWellFormedCallOfAnOfferedToolStaysText) {
  for (const std::string& reply : {
         std::string("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call> then text"),
         std::string("<tool_call>{\"name\": \"launch_rockets\", \"arguments\": {}}</tool_call>"), // not offered
         std::string("<tool_call>{\"arguments\": {}}</tool_call>"),
         std::string("<tool_call>{\"name\": \"search\", \"arguments\": [1]}</tool_call>"),
         std::string("a <tool_cal and more"),
         std::string("unfinished <tool_call>{\"name\": \"search\", \"argum"),
         std::string("ends with a partial tag <tool_"),
       }) {
    const auto r = whole(ToolSyntax::hermes, reply);
    EXPECT_TRUE(r.calls.empty()) << reply;
    EXPECT_EQ(r.content, reply) << "byte for byte";
    expect_same_in_pieces(ToolSyntax::hermes, reply);
  }
  const std::string plain = "Once upon a time { \"name\": 1 } [TOOL_CALLS] <|python_tag|>";
  EXPECT_EQ(whole(ToolSyntax::hermes, plain).content, plain);
  EXPECT_EQ(whole(ToolSyntax::llama3, plain).content, plain);
}

TEST(ToolCalls, Llama3JsonRepliesWithOrWithoutThePythonTag) {
  const auto a = whole(ToolSyntax::llama3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\", \"days\": 2}}");
  EXPECT_EQ(a.content, "");
  ASSERT_EQ(a.calls.size(), 1u);
  EXPECT_EQ(a.calls[0].arguments, R"({"city":"Oslo","days":2})");
  const auto b = whole(ToolSyntax::llama3, "<|python_tag|>{\"name\": \"search\", \"parameters\": {\"q\": \"a;b\"}}");
  ASSERT_EQ(b.calls.size(), 1u);
  EXPECT_EQ(b.calls[0].arguments, R"({"q":"a;b"})");
  // Llama 3.2 writes several calls separated by ';'.
  const std::string two = " {\"name\": \"search\", \"parameters\": {\"q\": \"x\"}}; {\"name\": \"get_weather\", \"parameters\": {}}";
  const auto c = whole(ToolSyntax::llama3, two);
  ASSERT_EQ(c.calls.size(), 2u);
  EXPECT_EQ(c.calls[1].name, "get_weather");
  expect_same_in_pieces(ToolSyntax::llama3, two);
  // An answer in words streams as it comes; a JSON-looking answer that is no call stays text.
  EXPECT_EQ(whole(ToolSyntax::llama3, "The weather is fine.").content, "The weather is fine.");
  EXPECT_EQ(whole(ToolSyntax::llama3, "{\"answer\": 42}").content, "{\"answer\": 42}");
  ToolCallParser p(ToolSyntax::llama3, {"search"});
  EXPECT_EQ(p.push("  The ").content, "  The ") << "not held back once it is not a call";
  EXPECT_EQ(p.push("{\"name\"").content, "{\"name\"");
}

TEST(ToolCalls, MistralCallsAfterTheMarker) {
  const std::string reply =
    "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}, {\"name\": \"search\", \"arguments\": "
    "{\"q\": \"x\"}, \"id\": \"abcdefghi\"}]";
  const auto r = whole(ToolSyntax::mistral, reply);
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0].id.size(), 9u) << "Mistral's template takes 9-character ids back";
  EXPECT_EQ(r.calls[1].arguments, R"({"q":"x"})");
  expect_same_in_pieces(ToolSyntax::mistral, reply);
  const std::string broken = "Sure. [TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": ";
  EXPECT_EQ(whole(ToolSyntax::mistral, broken).content, broken);
  expect_same_in_pieces(ToolSyntax::mistral, broken);
}

// A forced call (tool_choice required / named) is decoded under a grammar in
// the template's syntax: every sentence of it reads back as calls of the
// offered tools, with arguments valid under their schemas, and no content.
TEST(ToolGrammar, EverySentenceReadsBackAsValidCallsInEachSyntax) {
  const auto tools = nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
      "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object",
      "properties": {"q": {"type": "string", "pattern": "^[a-z ]{1,12}$"}}, "required": ["q"]}}},
    {"type": "function", "function": {"name": "ping"}}])");
  std::mt19937 rng(5);
  for (auto syntax : {ToolSyntax::hermes, ToolSyntax::llama3, ToolSyntax::mistral})
    for (const char* only : {"", "search"})
      for (bool parallel : {false, true}) {
        model::GrammarAutomaton a(model::Grammar::parse(tool_call_grammar(syntax, tools, only, parallel)));
        int made = 0;
        for (int i = 0; i < 30; ++i) {
          const std::string reply = test::random_sentence(a, rng, 0, 3000);
          if (reply.empty())
            continue;
          ++made;
          const auto got = whole(syntax, reply, {"get_weather", "search", "ping"});
          EXPECT_EQ(got.content, "") << to_string(syntax) << ": " << reply;
          ASSERT_GE(got.calls.size(), 1u) << to_string(syntax) << ": " << reply;
          if (!parallel) {
            EXPECT_EQ(got.calls.size(), 1u) << reply;
          }
          for (const auto& c : got.calls) {
            if (*only) {
              EXPECT_EQ(c.name, only);
            }
            const auto args = nlohmann::json::parse(c.arguments, nullptr, false);
            ASSERT_TRUE(args.is_object()) << c.arguments;
            if (c.name == "get_weather") {
              ASSERT_TRUE(args.contains("city")) << c.arguments;
              EXPECT_LE(args["city"].get<std::string>().size(), 32u);
              if (args.contains("days")) {
                EXPECT_TRUE(args["days"] >= 1 && args["days"] <= 7) << c.arguments;
              }
            } else if (c.name == "search") {
              ASSERT_TRUE(args.contains("q")) << c.arguments;
              EXPECT_TRUE(std::regex_match(args["q"].get<std::string>(), std::regex("[a-z ]{1,12}"))) << c.arguments;
            } else {
              EXPECT_EQ(c.name, "ping");
            }
          }
        }
        EXPECT_GT(made, 10) << to_string(syntax);
      }
}

} // namespace
} // namespace strata::server
