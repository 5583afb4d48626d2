// Grammars, JSON Schema compilation and token masks (model/text/grammar.hpp,
// json_schema.hpp, token_mask.hpp).
#include "model/base/error.hpp"
#include "model/text/grammar.hpp"
#include "model/text/json_schema.hpp"
#include "model/text/token_mask.hpp"
#include "model/text/tokenizer.hpp"
#include "tests/model/grammar_support.hpp"
#include "tests/support.hpp"

#include <nlohmann/json.hpp>

#include <random>
#include <regex>

namespace strata {
namespace {

using ojson = nlohmann::ordered_json;

std::string refusal(const std::function<void()>& f) {
  try {
    f();
  } catch (const model::Error& e) {
    return e.message();
  }
  return "(accepted)";
}

// Whether `text` is a complete sentence of the grammar.
bool complete(model::GrammarAutomaton& a, std::string_view text) {
  return a.accepting(a.next(a.start(), text));
}

using test::random_sentence;

TEST(Grammar, RefusesWhatItCannotMatchByName) {
  EXPECT_NE(refusal([] { model::Grammar::parse("root ::= foo"); }).find("unknown rule 'foo'"), std::string::npos);
  EXPECT_NE(refusal([] { model::Grammar::parse("root ::= a\na ::= a \"x\" | \"y\""); }).find("left-recursive"),
            std::string::npos);
  EXPECT_NE(refusal([] { model::Grammar::parse("root ::= ( \"x\"? )*"); }).find("can match nothing"), std::string::npos);
  EXPECT_NE(refusal([] { model::Grammar::parse("root ::= ( \"x\"? \"y\"? )+"); }).find("can match nothing"), std::string::npos);
  EXPECT_NE(refusal([] { model::Grammar::parse("root ::= \"abc"); }).find("unterminated literal"), std::string::npos);
  EXPECT_NE(refusal([] { model::Grammar::parse("root ::= [z-a]"); }).find("backwards"), std::string::npos);
  EXPECT_NE(refusal([] { model::Grammar::parse("root ::= \"a\"\nroot ::= \"b\""); }).find("defined twice"),
            std::string::npos);
  EXPECT_NE(refusal([] { model::Grammar::parse("root ::= \"a\"{3,2}"); }).find("below its minimum"), std::string::npos);
  EXPECT_NE(refusal([] { model::Grammar::parse("   "); }).find("no rules"), std::string::npos);
}

TEST(Grammar, FollowsBytesThroughRulesRepetitionsAndClasses) {
  auto g = model::Grammar::parse(R"(# a comment
root ::= greeting ( ", " name ){1,2} "!"?
greeting ::= "hi" | "hello"
name ::= [A-Z] [a-z]*
)");
  model::GrammarAutomaton a(g);
  EXPECT_TRUE(complete(a, "hi, Bob"));
  EXPECT_TRUE(complete(a, "hello, Al, Bo!"));
  EXPECT_FALSE(complete(a, "hi, Bob, Al, Cy")); // three names
  EXPECT_FALSE(complete(a, "hi"));              // at least one name
  EXPECT_EQ(a.next(a.start(), "hey"), model::GrammarAutomaton::dead);
  EXPECT_EQ(a.next(a.start(), "hi, bob"), model::GrammarAutomaton::dead);
  // Equal states are one state: the inside of a name after any number of letters.
  EXPECT_EQ(a.next(a.start(), "hi, Bo"), a.next(a.start(), "hi, Bobbbbb"));
  EXPECT_TRUE(a.can_continue(a.next(a.start(), "hi, Bo")));
  EXPECT_FALSE(a.can_continue(a.next(a.start(), "hi, Bo!")));
}

TEST(JsonGrammar, AnyObjectTakesJsonAndNothingElse) {
  model::GrammarAutomaton a(model::Grammar::parse(model::json_object_grammar()));
  for (const char* ok : {"{}", "{ }", R"({"a": [1, 2.5, -3e10, true, null, "x\u00e9\n"]})", "{\"k\":{\"n\":{}}}",
                         "{\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\": 0}"})
    EXPECT_TRUE(complete(a, ok)) << ok;
  for (const char* bad : {"[1]", "{a: 1}", "{\"a\": 01}", "{\"a\": 1,}", "{\"\xff\": 1}", "{\"\xc0\xaf\": 1}",
                          R"({"a": "\ud800"})", "{\"a\": \"\x01\"}", "{\"a\": 1.}", "{\"a\": tru}", " {}"})
    EXPECT_FALSE(complete(a, bad)) << bad;
}

TEST(JsonGrammar, EveryRandomSentenceOfASchemaParsesAndValidates) {
  const auto schema = ojson::parse(R"({
    "type": "object",
    "properties": {
      "name": {"type": "string", "minLength": 1, "maxLength": 8},
      "age": {"type": "integer", "minimum": 0, "maximum": 130},
      "tags": {"type": "array", "items": {"enum": ["a", "b", 3, null]}, "minItems": 1, "maxItems": 3},
      "when": {"type": "string", "format": "date"},
      "score": {"type": ["number", "null"]},
      "child": {"$ref": "#/$defs/node"}
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": false,
    "$defs": {"node": {"type": "object", "properties": {"v": {"type": "boolean"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v", "next"]}}
  })");
  model::GrammarAutomaton a(model::Grammar::parse(model::json_schema_grammar(schema, "schema")));
  std::mt19937 rng(7);
  int made = 0;
  for (int i = 0; i < 300; ++i) {
    const std::string s = random_sentence(a, rng, 0, 4000);
    if (s.empty())
      continue; // wandered too long (a deep chain of nodes)
    ++made;
    const auto v = nlohmann::json::parse(s, nullptr, false);
    ASSERT_FALSE(v.is_discarded()) << s;
    ASSERT_TRUE(v.is_object()) << s;
    for (auto& [k, x] : v.items())
      EXPECT_TRUE(k == "name" || k == "age" || k == "tags" || k == "when" || k == "score" || k == "child") << s;
    ASSERT_TRUE(v.contains("name") && v.contains("age") && v.contains("tags")) << s;
    const auto name = v["name"].get<std::string>();
    EXPECT_GE(name.size(), 1u) << s;
    ASSERT_TRUE(v["age"].is_number_integer()) << s;
    EXPECT_GE(v["age"].get<int64_t>(), 0);
    EXPECT_LE(v["age"].get<int64_t>(), 130);
    ASSERT_TRUE(v["tags"].is_array()) << s;
    EXPECT_GE(v["tags"].size(), 1u);
    EXPECT_LE(v["tags"].size(), 3u);
    for (auto& t : v["tags"])
      EXPECT_TRUE(t == "a" || t == "b" || t == 3 || t.is_null()) << s;
    if (v.contains("when")) {
      EXPECT_EQ(v["when"].get<std::string>().size(), 10u) << s;
    }
    if (v.contains("score")) {
      EXPECT_TRUE(v["score"].is_number() || v["score"].is_null()) << s;
    }
    for (const nlohmann::json* n = v.contains("child") ? &v["child"] : nullptr; n && !n->is_null(); n = &(*n)["next"]) {
      ASSERT_TRUE(n->is_object() && n->contains("v") && n->contains("next")) << s;
      EXPECT_TRUE((*n)["v"].is_boolean());
    }
  }
  EXPECT_GT(made, 200);
  // Properties come in the schema's order.
  EXPECT_TRUE(complete(a, R"({"name": "x", "age": 3, "tags": ["a"]})"));
  EXPECT_FALSE(complete(a, R"({"age": 3, "name": "x", "tags": ["a"]})"));
  EXPECT_FALSE(complete(a, R"({"name": "x", "age": 131, "tags": ["a"]})"));
  EXPECT_FALSE(complete(a, R"({"name": "", "age": 3, "tags": ["a"]})"));
  EXPECT_FALSE(complete(a, R"({"name": "x", "age": 3, "tags": []})"));
}

TEST(JsonGrammar, RefusesKeywordsItCannotHonourByName) {
  auto why = [](const char* schema) {
    return refusal([&] { model::json_schema_grammar(ojson::parse(schema), "response_format.json_schema.schema"); });
  };
  EXPECT_EQ(why(R"({"type": "string", "pattern": "^(?=a)b$"})"),
            "response_format.json_schema.schema: 'pattern' is not supported here: lookarounds and named groups");
  EXPECT_NE(why(R"({"type": "string", "pattern": "(a)\\1"})").find("escape '\\1'"), std::string::npos);
  EXPECT_NE(why(R"({"type": "string", "pattern": "a^b"})").find("anchors inside"), std::string::npos);
  EXPECT_NE(why(R"({"type": "string", "pattern": "[a-"})").find("without ']'"), std::string::npos);
  EXPECT_NE(why(R"({"type": "string", "pattern": "a", "maxLength": 3})").find("together with 'pattern'"), std::string::npos);
  EXPECT_NE(why(R"({"type": "object", "properties": {"x": {"type": "number", "minimum": 1.5}}})")
              .find("response_format.json_schema.schema.properties.x: 'minimum' is supported for integers only"),
            std::string::npos);
  EXPECT_NE(why(R"({"type": "array", "uniqueItems": true})").find("'uniqueItems'"), std::string::npos);
  EXPECT_NE(why(R"({"$ref": "https://example.com/s.json"})").find("$ref"), std::string::npos);
  EXPECT_NE(why(R"({"$ref": "#/$defs/missing"})").find("names no definition"), std::string::npos);
  EXPECT_NE(why(R"({"type": "strin"})").find("unknown type 'strin'"), std::string::npos);
  EXPECT_NE(why(R"({"type": "string", "format": "email"})").find("format 'email'"), std::string::npos);
  EXPECT_NE(why(R"({"type": "object", "properties": {}, "required": ["a"]})").find("'a'"), std::string::npos);
  EXPECT_NE(why(R"({"type": "integer", "minimum": -5000, "maximum": 5000})").find("integer"), std::string::npos);
  EXPECT_NE(why("false").find("allows no value"), std::string::npos);
  EXPECT_NE(why(R"({"not": {}})").find("'not' is not supported"), std::string::npos);
  // Annotations pass.
  EXPECT_EQ(why(R"({"title": "T", "description": "d", "type": "boolean", "default": true})"), "(accepted)");
}

// UTF-8 to code points.
std::wstring widen(const std::string& s) {
  std::wstring out;
  for (std::size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    const std::size_t n = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    uint32_t cp = n == 1 ? b : b & (0x7F >> n);
    for (std::size_t k = 1; k < n && i + k < s.size(); ++k)
      cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(static_cast<wchar_t>(cp));
    i += n;
  }
  return out;
}

// Every random string a pattern's grammar writes, decoded, matches the regex
// (std::regex, ECMAScript: the dialect JSON Schema names).
TEST(JsonGrammar, PatternStringsMatchTheirRegex) {
  std::mt19937 rng(11);
  for (const char* pattern : {"^[A-Z]{2}-\\d{3,4}$", "^(foo|bar)+baz?$", "^[^\"\\\\]{1,5}$", "^\\w+@\\w+\\.(com|org)$",
                              "^[a-c\\s]*x$", "^\\D\\S\\W$", "^(?:ab|cd){2}$", "\\d\\d", "^\\$[0-9]+(\\.[0-9]{2})?$",
                              "^[\\x20-\\x7e]{3}$"}) {
    const auto schema = ojson{{"type", "string"}, {"pattern", pattern}};
    model::GrammarAutomaton a(model::Grammar::parse(model::json_schema_grammar(schema, "s")));
    // (wide: the regex counts code points, as JavaScript's does for these)
    const std::wregex re(widen(pattern), std::regex::ECMAScript);
    int made = 0;
    for (int i = 0; i < 40; ++i) {
      const std::string s = random_sentence(a, rng, 0, 2000);
      if (s.empty())
        continue;
      ++made;
      const auto v = nlohmann::json::parse(s, nullptr, false);
      ASSERT_TRUE(v.is_string()) << pattern << ": " << s;
      EXPECT_TRUE(std::regex_search(widen(v.get<std::string>()), re)) << pattern << ": " << s;
    }
    EXPECT_GT(made, 20) << pattern;
  }
  // '.' is one character (code point), never a line end.
  model::GrammarAutomaton dot(model::Grammar::parse(model::json_schema_grammar(ojson{{"type", "string"}, {"pattern", "^a.b$"}}, "s")));
  EXPECT_TRUE(complete(dot, "\"a\xc3\xa9" "b\""));
  EXPECT_TRUE(complete(dot, "\"a\\\"b\""));
  EXPECT_FALSE(complete(dot, "\"a\\nb\""));
  EXPECT_FALSE(complete(dot, "\"ab\""));
  EXPECT_FALSE(complete(dot, "\"axyb\""));
}

// The mask equals asking the automaton token by token.
void expect_mask_is_brute_force(model::TokenVocabulary& vocab, const model::Tokenizer& tok, const std::string& grammar,
                                int walks, uint64_t seed) {
  auto c = vocab.constraint(grammar);
  std::mt19937 rng(static_cast<std::mt19937::result_type>(seed));
  for (int w = 0; w < walks; ++w) {
    model::ConstraintMatcher m(c);
    int32_t state = c->automaton().start();
    bool first = true;
    for (int step = 0; step < 40; ++step) {
      auto bits = m.allowed();
      std::vector<int32_t> allowed;
      for (int64_t id = 0; id < vocab.size(); ++id) {
        const bool in = ((*bits)[static_cast<std::size_t>(id) >> 6] >> (id & 63)) & 1;
        const bool expect = c->after(state, static_cast<int32_t>(id), first) != model::GrammarAutomaton::dead;
        ASSERT_EQ(in, expect) << "token " << id << " '" << vocab.bytes(static_cast<int32_t>(id), first) << "' at step "
                              << step;
        if (in)
          allowed.push_back(static_cast<int32_t>(id));
      }
      if (allowed.empty())
        break;
      const int32_t t = allowed[std::uniform_int_distribution<std::size_t>(0, allowed.size() - 1)(rng)];
      ASSERT_TRUE(m.accept(t));
      state = c->after(state, t, first);
      first = false;
    }
  }
  (void)tok;
}

TEST(TokenMask, EqualsTheAutomatonTokenByTokenOnTheByteVocabulary) {
  auto tok = model::Tokenizer::bytes();
  model::TokenVocabulary vocab(*tok, 300);
  EXPECT_EQ(vocab.size(), 300);
  const auto schema = ojson::parse(R"({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string", "maxLength": 3}}}, "required": ["a"]})");
  expect_mask_is_brute_force(vocab, *tok, model::json_schema_grammar(schema, "s"), 5, 1);
  // The same grammar text is one constraint; its masks are kept per state.
  auto c1 = vocab.constraint(model::json_object_grammar());
  auto c2 = vocab.constraint(model::json_object_grammar());
  EXPECT_EQ(c1.get(), c2.get());
  model::ConstraintMatcher m(c1);
  auto first = m.allowed();
  const auto walks = c1->walks();
  EXPECT_EQ(m.allowed().get(), first.get());
  EXPECT_EQ(c1->walks(), walks);
  // Only '{' (byte 0x7b = token 3 + 0x7b) may start an object.
  for (int64_t id = 0; id < vocab.size(); ++id)
    EXPECT_EQ(((*first)[static_cast<std::size_t>(id) >> 6] >> (id & 63)) & 1, id == 3 + '{' ? 1u : 0u) << id;
  EXPECT_FALSE(m.accept(3 + '['));
  EXPECT_FALSE(m.accept(2)); // </s> spells nothing
  EXPECT_FALSE(m.accept(299)); // past the tokenizer: never
  EXPECT_TRUE(m.accept(3 + '{'));
  EXPECT_TRUE(m.accept(3 + '}'));
  EXPECT_TRUE(m.complete());
  EXPECT_FALSE(m.can_continue());
}

TEST(TokenMask, EqualsTheAutomatonOnTheLlama2Vocabulary) {
  STRATA_REQUIRE_SHARED("models/llama2-tokenizer.bin");
  auto tok = model::Tokenizer::load(test::shared_path("models/llama2-tokenizer.bin"));
  model::TokenVocabulary vocab(*tok);
  const auto schema = ojson::parse(R"({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14}, "ok": {"type": "boolean"}}, "required": ["city", "days", "ok"]})");
  expect_mask_is_brute_force(vocab, *tok, model::json_schema_grammar(schema, "s"), 3, 2);
}

TEST(TokenMask, EqualsTheAutomatonOnTheQwenVocabulary) {
  STRATA_REQUIRE_SHARED("models/qwen-tokenizer.json");
  auto tok = model::Tokenizer::load(test::shared_path("models/qwen-tokenizer.json"));
  model::TokenVocabulary vocab(*tok, 151936);
  const auto schema = ojson::parse(R"({"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["x", "y"]}}, "n": {"type": "number"}}, "required": ["name", "tags", "n"]})");
  expect_mask_is_brute_force(vocab, *tok, model::json_schema_grammar(schema, "s"), 1, 3);
  // Control tokens stay out unless the grammar spells them; <tool_call> (not a
  // control token in Qwen's tokenizer) is an ordinary token.
  auto c = vocab.constraint("root ::= \"<tool_call>\" [a-z]+ \"<|im_end|>\"");
  model::ConstraintMatcher m(c);
  const auto im_end = tok->encode("<|im_end|>", false);
  const auto tool_call = tok->encode("<tool_call>", false);
  ASSERT_EQ(im_end.size(), 1u);
  ASSERT_EQ(tool_call.size(), 1u);
  EXPECT_TRUE(vocab.control(im_end[0]));
  EXPECT_FALSE(vocab.control(tool_call[0]));
  auto first = m.allowed();
  EXPECT_TRUE(((*first)[static_cast<std::size_t>(tool_call[0]) >> 6] >> (tool_call[0] & 63)) & 1);
  EXPECT_TRUE(m.accept(tool_call[0]));
  EXPECT_TRUE(m.accept(tok->encode("abc", false)[0]));
  EXPECT_TRUE(m.accept(im_end[0])) << "spelled by the grammar: allowed";
  EXPECT_TRUE(m.complete());
  auto free = vocab.constraint(model::json_object_grammar());
  model::ConstraintMatcher f(free);
  EXPECT_TRUE(f.accept(tok->encode("{\"", false)[0]));
  const auto in_string = f.allowed();
  EXPECT_FALSE(((*in_string)[static_cast<std::size_t>(im_end[0]) >> 6] >> (im_end[0] & 63)) & 1)
    << "a control token inside a JSON string: never";
}

} // namespace
} // namespace strata
