// Agents' messages as OpenAI clients send them: tool definitions, assistant
// tool calls (content null, arguments as JSON strings), tool results, and the
// chat-template switches (add_generation_prompt, continue_final_message,
// chat_template_kwargs with their key order). Parsed without a network, and
// rendered through real templates equal to @huggingface/jinja rendering the
// context transformers would build from the same request.

#include "model/text/chat_template.hpp"
#include "server/openai.hpp"
#include "server/ordered_json.hpp"
#include "tests/support.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <unistd.h>

namespace strata::server {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

ApiError err(const std::string& body, bool chat = true) {
  auto r = parse_request(body, chat);
  EXPECT_TRUE(std::holds_alternative<ApiError>(r)) << body;
  return std::holds_alternative<ApiError>(r) ? std::get<ApiError>(r) : ApiError{};
}

ApiRequest ok(const std::string& body) {
  auto r = parse_request(body, true);
  EXPECT_TRUE(std::holds_alternative<ApiRequest>(r)) << (std::holds_alternative<ApiError>(r)
                                                            ? std::get<ApiError>(r).message
                                                            : std::string());
  return std::holds_alternative<ApiRequest>(r) ? std::get<ApiRequest>(r) : ApiRequest{};
}

// A tool round as the openai client sends it: the assistant's call with
// content null and its arguments as a string (keys not in alphabetical order:
// they must reach the template as written), the tools' results, the answer,
// the user again.
const ojson tool_round = ojson::parse(R"([
  {"role": "system", "content": "You can look up the weather."},
  {"role": "user", "content": "Weather in Oslo and Bergen?"},
  {"role": "assistant", "content": null, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"units\": \"metric\", \"city\": \"Oslo\", \"days\": 2}"}},
    {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"units\": \"metric\", \"city\": \"Bergen\"}"}}]},
  {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": -3.5}"},
  {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "{\"temp\": 4}"}]},
  {"role": "assistant", "content": "Oslo has -3.5 degrees, Bergen 4."},
  {"role": "user", "content": "Thanks. Which is warmer?"}
])");

const ojson tools = ojson::parse(R"([{"type": "function", "function": {"name": "get_weather",
  "description": "Weather for a city", "parameters": {"type": "object",
  "properties": {"units": {"type": "string", "enum": ["metric", "imperial"]}, "city": {"type": "string"},
                 "days": {"type": "integer"}}, "required": ["city"]}}}])");

ojson body_with(const ojson& messages, const ojson& extra = ojson::object()) {
  ojson b = {{"messages", messages}, {"tools", tools}};
  for (auto& [k, v] : extra.items())
    b[k] = v;
  return b;
}

TEST(Tools, OrderedParsingKeepsKeysAsWrittenAndTheLastOfARepeatedOne) {
  // As Python's json.loads: a repeated key keeps its first place and its last value.
  EXPECT_EQ(parse_ordered(R"({"b": 1, "a": [true, null, {"z": 1.5, "y": "s"}], "b": 3})").dump(),
            R"({"b":3,"a":[true,null,{"z":1.5,"y":"s"}]})");
  EXPECT_EQ(parse_ordered("[1, -2, 18446744073709551615, \"\\u00e9\"]").dump(), "[1,-2,18446744073709551615,\"\u00e9\"]");
  for (const char* bad : {"{", "{\"a\" 1}", "[1,]", "1 2", ""})
    EXPECT_TRUE(parse_ordered(bad).is_discarded()) << bad;
}

TEST(Tools, AToolRoundIsParsedAsClientsSendIt) {
  const auto r = ok(body_with(tool_round).dump());
  ASSERT_EQ(r.messages.size(), 7u);
  const auto& a = r.messages[2];
  EXPECT_TRUE(a.content_null);
  ASSERT_EQ(a.tool_calls.size(), 2u);
  // Arguments parsed into objects, their keys in the order the model wrote them.
  EXPECT_EQ(a.tool_calls[0]["function"]["arguments"].dump(), R"({"units":"metric","city":"Oslo","days":2})");
  EXPECT_EQ(a.tool_calls[1]["id"], "call_2");
  EXPECT_EQ(r.messages[3].role, "tool");
  EXPECT_EQ(r.messages[3].tool_call_id, "call_1");
  EXPECT_EQ(r.messages[4].content, R"({"temp": 4})");
  EXPECT_EQ(r.tools.dump(), tools.dump()) << "tools as sent, key order kept";
  EXPECT_TRUE(r.add_generation_prompt);
  // chat_template_kwargs keep their order too (templates print them).
  const auto k = ok(R"({"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"zeta":1,"alpha":{"b":2,"a":1}}})");
  EXPECT_EQ(k.template_kwargs.dump(), R"({"zeta":1,"alpha":{"b":2,"a":1}})");
  // add_generation_prompt is honoured; tool_choice auto and none pass.
  EXPECT_FALSE(ok(R"({"messages":[{"role":"user","content":"x"}],"add_generation_prompt":false})").add_generation_prompt);
  for (const char* choice : {"auto", "none"})
    ok(body_with(tool_round, {{"tool_choice", choice}, {"parallel_tool_calls", false}}).dump());
}

TEST(Tools, EveryToolRuleNamesTheField) {
  auto with_messages = [](const std::string& messages) { return R"({"messages":)" + messages + "}"; };
  // A tool result must answer a call made earlier.
  EXPECT_EQ(err(with_messages(R"([{"role":"user","content":"x"},{"role":"tool","tool_call_id":"c9","content":"1"}])")).param,
            "messages[1].tool_call_id");
  EXPECT_EQ(err(with_messages(R"([{"role":"user","content":"x"},{"role":"tool","content":"1"}])")).param,
            "messages[1].tool_call_id");
  // content null only for an assistant that calls tools; tool_calls only from the assistant.
  EXPECT_EQ(err(with_messages(R"([{"role":"user","content":null}])")).param, "messages[0].content");
  EXPECT_EQ(err(with_messages(R"([{"role":"assistant","content":null}])")).param, "messages[0].content");
  EXPECT_EQ(err(with_messages(R"([{"role":"user","content":"x","tool_calls":[]}])")).param, "messages[0].tool_calls");
  const std::string call = R"([{"role":"assistant","content":null,"tool_calls":[CALL]}])";
  auto with_call = [&](const std::string& c) {
    std::string m = call;
    m.replace(m.find("CALL"), 4, c);
    return with_messages(m);
  };
  EXPECT_EQ(err(with_call(R"({"type":"function","function":{"name":"f","arguments":"{}"}})")).param,
            "messages[0].tool_calls[0].id");
  EXPECT_EQ(err(with_call(R"({"id":"c","type":"retrieval","function":{"name":"f","arguments":"{}"}})")).param,
            "messages[0].tool_calls[0].type");
  EXPECT_EQ(err(with_call(R"({"id":"c","type":"function","function":{"arguments":"{}"}})")).param,
            "messages[0].tool_calls[0].function.name");
  EXPECT_EQ(err(with_call(R"({"id":"c","type":"function","function":{"name":"f","arguments":"{not json"}})")).param,
            "messages[0].tool_calls[0].function.arguments");
  EXPECT_EQ(err(with_call(R"({"id":"c","type":"function","function":{"name":"f","arguments":"[1]"}})")).param,
            "messages[0].tool_calls[0].function.arguments");
  // Nesting is bounded where the template engine would walk it.
  const std::string deep = std::string(1000, '[') + std::string(1000, ']');
  EXPECT_EQ(err(with_call(R"({"id":"c","type":"function","function":{"name":"f","arguments":"{\"a\":)" + deep + "}\"}}"))
              .message,
            "'messages[0].tool_calls[0].function.arguments' is nested deeper than 32 levels");
  EXPECT_EQ(err(std::string(R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"a":)") +
                deep + "}}}]}")
              .message,
            "'tools' is nested deeper than 32 levels");
  // Tool definitions.
  const std::string user = R"({"messages":[{"role":"user","content":"x"}],)";
  EXPECT_EQ(err(user + R"("tools":{"type":"function"}})").param, "tools");
  EXPECT_EQ(err(user + R"("tools":[{"type":"code_interpreter"}]})").param, "tools[0]");
  EXPECT_EQ(err(user + R"("tools":[{"type":"function","function":{"name":"has space"}}]})").param, "tools[0].function.name");
  EXPECT_EQ(err(user + R"("tools":[{"type":"function","function":{"name":"f"}},{"type":"function","function":{"name":"f"}}]})").param,
            "tools[1].function.name");
  EXPECT_EQ(err(user + R"("tools":[{"type":"function","function":{"name":"f","parameters":"object"}}]})").param,
            "tools[0].function.parameters");
  // A forced call: of an offered tool, in a known form, under parameters the grammar can honour.
  EXPECT_EQ(err(body_with(tool_round, {{"tool_choice", {{"type", "function"}, {"function", {{"name", "get_time"}}}}}}).dump())
              .param,
            "tool_choice.function.name");
  EXPECT_EQ(err(body_with(tool_round, {{"tool_choice", "always"}}).dump()).param, "tool_choice");
  EXPECT_EQ(err(body_with(tool_round, {{"tool_choice", {{"type", "function"}}}}).dump()).param, "tool_choice");
  for (const auto& choice : {ojson("required"), ojson{{"type", "function"}, {"function", {{"name", "get_weather"}}}}}) {
    auto r = parse_request(body_with(tool_round, {{"tool_choice", choice}}).dump(), true);
    ASSERT_TRUE(std::holds_alternative<ApiRequest>(r)) << choice;
    EXPECT_EQ(std::get<ApiRequest>(r).tool_choice, choice.is_string() ? "required" : "named");
  }
  EXPECT_EQ(err(user + R"("tool_choice":"auto"})").param, "tool_choice") << "tool_choice without tools";
  EXPECT_EQ(err(user + R"("tools":[],"chat_template_kwargs":{"tools":[]},"parallel_tool_calls":"yes"})").param,
            "parallel_tool_calls");
  EXPECT_EQ(err(body_with(tool_round, {{"chat_template_kwargs", {{"tools", ojson::array()}}}}).dump()).param,
            "chat_template_kwargs");
  // The template switches.
  EXPECT_EQ(err(user + R"("add_generation_prompt":"no"})").param, "add_generation_prompt");
  EXPECT_EQ(err(R"({"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"Once"}],"continue_final_message":true})")
              .param,
            "continue_final_message")
    << "needs add_generation_prompt false";
  EXPECT_EQ(err(user + R"("continue_final_message":true,"add_generation_prompt":false})").param, "continue_final_message")
    << "the final message is the user's";
  // Chat fields on /v1/completions are refused, not ignored.
  EXPECT_EQ(err(R"({"prompt":"x","tools":[{"type":"function","function":{"name":"f"}}]})", false).param, "tools");
  EXPECT_EQ(err(R"({"prompt":"x","add_generation_prompt":false})", false).param, "add_generation_prompt");
}

// The template files tests/data/chat_templates holds, as the models ship them.
struct Shipped {
  std::string name;
  model::ChatTemplate tpl;
  ojson json;
};
Shipped shipped(const std::string& file) {
  const auto j = ojson::parse(test::read_file(fs::path(STRATA_SOURCE_DIR) / "tests" / "data" / "chat_templates" / file));
  return {j["name"], model::ChatTemplate(j["template"], file, j["bos_token"], j["eos_token"]), j};
}

// What our prompt path renders for an API body.
std::variant<ChatPrompt, ApiError> prompt_for(const ojson& body, const model::ChatTemplate* tpl,
                                              const std::string& family = "chatml") {
  auto bytes = model::Tokenizer::bytes();
  model::ModelConfig cfg;
  const auto r = ok(body.dump());
  PromptOptions o;
  o.kwargs = r.template_kwargs;
  o.tools = r.tools;
  o.add_generation_prompt = r.add_generation_prompt;
  o.continue_final_message = r.continue_final_message;
  return chat_prompt(r.messages, tpl, family, *bytes, cfg, o);
}

// The context transformers builds for the same request (arguments as objects;
// content null as "", which vLLM passes and shipped templates expect), rendered
// by @huggingface/jinja.
std::vector<std::string> reference(const ojson& cases) {
  const fs::path npm = fs::path(STRATA_BINARY_DIR) / "npm";
  fs::copy_file(fs::path(STRATA_SOURCE_DIR) / "tests" / "model" / "render_templates.mjs", npm / "render_templates.mjs",
                fs::copy_options::overwrite_existing);
  const fs::path in = npm / ("tool_cases_" + std::to_string(::getpid()) + ".json");
  std::ofstream(in) << cases.dump();
  const auto out = ojson::parse(test::command_output("node " + (npm / "render_templates.mjs").string() + " " + in.string()));
  fs::remove(in);
  std::vector<std::string> texts;
  for (auto& o : out)
    texts.push_back(o["ok"].get<bool>() ? o["text"].get<std::string>() : "refused: " + o["error"].get<std::string>());
  return texts;
}

ojson transformers_messages(const ojson& api) {
  ojson out = ojson::array();
  for (auto m : api) {
    if (m.contains("tool_calls"))
      for (auto& c : m["tool_calls"])
        c["function"]["arguments"] = ojson::parse(c["function"]["arguments"].get<std::string>());
    if (m["content"].is_null())
      m["content"] = "";
    if (m["content"].is_array()) {
      std::string text;
      for (auto& part : m["content"])
        text += part["text"].get<std::string>();
      m["content"] = text;
    }
    out.push_back(m);
  }
  return out;
}

TEST(Tools, RealTemplatesRenderToolRoundsAsTheReferenceDoes) {
  if (auto why = test::npm_missing("@huggingface/jinja"); !why.empty())
    GTEST_SKIP() << why;
  // Qwen3 and Qwen2.5 (Hermes <tool_call>), Llama 3.2 (JSON calls, ipython
  // results), Mistral Nemo ([TOOL_CALLS], [TOOL_RESULTS]; its call ids are 9
  // characters, as Mistral's template demands).
  ojson mistral_round = tool_round;
  mistral_round[2]["tool_calls"][0]["id"] = "call00001";
  mistral_round[2]["tool_calls"][1]["id"] = "call00002";
  mistral_round[3]["tool_call_id"] = "call00001";
  mistral_round[4]["tool_call_id"] = "call00002";
  // Llama 3.2's template takes one call per turn.
  ojson llama_round = ojson::array({tool_round[0], tool_round[1], tool_round[2], tool_round[3], tool_round[5], tool_round[6]});
  llama_round[2]["tool_calls"].erase(1);
  ojson cases = ojson::array();
  std::vector<std::string> ours, names;
  for (const char* file : {"qwen3.json", "qwen2_5.json", "llama3_2.json", "mistral_nemo.json"}) {
    const auto t = shipped(file);
    const std::string f = file;
    const ojson& round = f == "mistral_nemo.json" ? mistral_round : f == "llama3_2.json" ? llama_round : tool_round;
    // Today's date would differ between the renderers (Llama 3.2 prints it).
    const ojson date = {{"chat_template_kwargs", {{"date_string", "26 Jul 2024"}}}};
    auto with = [&](ojson extra) {
      extra.update(date);
      return extra;
    };
    // A whole tool round, a request that only offers tools, and the same
    // without the generation prompt (as a conversation is stored).
    const std::vector<std::pair<ojson, bool>> bodies = {
      {body_with(round, date), true},
      {body_with(ojson::array({round[0], round[1]}), date), true},
      {body_with(round, with({{"add_generation_prompt", false}})), false},
    };
    for (auto& [body, gen] : bodies) {
      auto p = prompt_for(body, &t.tpl);
      ASSERT_TRUE(std::holds_alternative<ChatPrompt>(p)) << t.name << ": " << std::get<ApiError>(p).message;
      ours.push_back(std::get<ChatPrompt>(p).text);
      names.push_back(t.name + (gen ? "" : " without the generation prompt") + ", " +
                      std::to_string(body["messages"].size()) + " messages");
      ojson ctx = {{"messages", transformers_messages(body["messages"])}, {"tools", tools},
                   {"add_generation_prompt", gen}, {"bos_token", t.json["bos_token"]},
                   {"eos_token", t.json["eos_token"]}, {"date_string", "26 Jul 2024"}};
      cases.push_back({{"template", t.json["template"]}, {"context", ctx}});
    }
  }
  const auto ref = reference(cases);
  ASSERT_EQ(ref.size(), ours.size());
  for (std::size_t i = 0; i < ours.size(); ++i) {
    EXPECT_EQ(ours[i], ref[i]) << names[i];
    // The arguments' keys as the model wrote them, not re-sorted.
    if (names[i].find(" messages") != std::string::npos && names[i].find(", 2 messages") == std::string::npos) {
      EXPECT_NE(ours[i].find(R"("units": "metric", "city": "Oslo")"), std::string::npos) << names[i] << ":\n" << ours[i];
    }
  }
  std::printf("%zu tool renderings equal @huggingface/jinja's\n", ours.size());
}

TEST(Tools, WhatATemplateCannotPrintIsRefusedNotDropped) {
  const auto llama3 = shipped("llama3.json"); // Llama 3 (8B Instruct): no tools in its template
  auto p = prompt_for(body_with(tool_round), &llama3.tpl);
  ASSERT_TRUE(std::holds_alternative<ApiError>(p));
  EXPECT_EQ(std::get<ApiError>(p).param, "tools");
  ojson no_tools = {{"messages", tool_round}};
  p = prompt_for(no_tools, &llama3.tpl);
  ASSERT_TRUE(std::holds_alternative<ApiError>(p));
  EXPECT_EQ(std::get<ApiError>(p).param, "messages[2].tool_calls");
  // Without a template the built-in formats cannot write tools or tool turns.
  for (const char* family : {"chatml", "llama2", "plain"}) {
    p = prompt_for(body_with(tool_round), nullptr, family);
    ASSERT_TRUE(std::holds_alternative<ApiError>(p)) << family;
    EXPECT_EQ(std::get<ApiError>(p).param, "tools") << family;
    p = prompt_for(no_tools, nullptr, family);
    ASSERT_TRUE(std::holds_alternative<ApiError>(p)) << family;
    EXPECT_EQ(std::get<ApiError>(p).param, "messages[2]") << family;
  }
  // ChatML without the generation prompt ends after the last turn.
  const ojson plain = {{"messages", ojson::array({{{"role", "user"}, {"content", "Hi"}}})}, {"add_generation_prompt", false}};
  p = prompt_for(plain, nullptr, "chatml");
  ASSERT_TRUE(std::holds_alternative<ChatPrompt>(p));
  EXPECT_EQ(std::get<ChatPrompt>(p).text, "<|im_start|>user\nHi<|im_end|>\n");
  EXPECT_TRUE(std::holds_alternative<ApiError>(prompt_for(plain, nullptr, "llama2")));
}

TEST(Tools, ContinueFinalMessageEndsInsideTheAssistantsText) {
  const auto qwen = shipped("qwen2_5.json");
  const ojson body = {{"messages", ojson::array({{{"role", "user"}, {"content", "Count to five."}},
                                                 {{"role", "assistant"}, {"content", "One, two, "}}})},
                      {"add_generation_prompt", false},
                      {"continue_final_message", true}};
  auto p = prompt_for(body, &qwen.tpl);
  ASSERT_TRUE(std::holds_alternative<ChatPrompt>(p)) << std::get<ApiError>(p).message;
  const auto text = std::get<ChatPrompt>(p).text;
  // The rendered conversation up to the final content without its trailing space.
  ojson closed = body;
  closed.erase("continue_final_message");
  const auto whole = std::get<ChatPrompt>(prompt_for(closed, &qwen.tpl)).text;
  EXPECT_EQ(text, whole.substr(0, whole.rfind("One, two,") + 9));
  EXPECT_EQ(text.substr(text.size() - 31), "<|im_start|>assistant\nOne, two,");
}

} // namespace
} // namespace strata::server
