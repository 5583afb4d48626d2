// Request parsing, validation, chat formats and stop strings, without a network.

#include "server/openai.hpp"
#include "tests/support.hpp"

#include <gtest/gtest.h>

namespace strata::server {
namespace {

ApiError err(const std::string& body, bool chat = false) {
  auto r = parse_request(body, chat);
  EXPECT_TRUE(std::holds_alternative<ApiError>(r)) << body;
  return std::holds_alternative<ApiError>(r) ? std::get<ApiError>(r) : ApiError{};
}

TEST(OpenAI, ParsesACompletionRequest) {
  auto r = parse_request(R"({"model":"m","prompt":"hi","max_tokens":5,"temperature":0.5,"top_p":0.9,"top_k":3,
                             "seed":7,"stop":["a","bc"],"stream":true,"stream_options":{"include_usage":true},"n":1})",
                         false);
  ASSERT_TRUE(std::holds_alternative<ApiRequest>(r));
  auto& q = std::get<ApiRequest>(r);
  EXPECT_EQ(q.prompt, "hi");
  EXPECT_EQ(*q.max_tokens, 5);
  EXPECT_FLOAT_EQ(q.temperature, 0.5f);
  EXPECT_FLOAT_EQ(q.top_p, 0.9f);
  EXPECT_EQ(q.top_k, 3);
  EXPECT_EQ(*q.seed, 7u);
  EXPECT_EQ(q.stop, (std::vector<std::string>{"a", "bc"}));
  EXPECT_TRUE(q.stream);
  EXPECT_TRUE(q.include_usage);
  auto ids = parse_request(R"({"prompt":[1,2,3]})", false);
  ASSERT_TRUE(std::holds_alternative<ApiRequest>(ids));
  EXPECT_EQ(std::get<ApiRequest>(ids).prompt_ids, (std::vector<int32_t>{1, 2, 3}));
}

TEST(OpenAI, EveryRuleNamesTheField) {
  EXPECT_EQ(err("{nope").message, "the request body is not valid JSON");
  EXPECT_NE(err("[1]").message.find("JSON object"), std::string::npos);
  EXPECT_EQ(err("{}").param, "prompt");
  EXPECT_EQ(err(R"({"prompt":""})").param, "prompt");
  EXPECT_EQ(err(R"({"prompt":["a","b"]})").param, "prompt");
  EXPECT_EQ(err(R"({"prompt":"x","max_tokens":0})").param, "max_tokens");
  EXPECT_EQ(err(R"({"prompt":"x","max_tokens":"5"})").message, "'max_tokens' must be an integer, not a string");
  EXPECT_EQ(err(R"({"prompt":"x","temperature":2.5})").message, "'temperature' must be between 0 and 2, not 2.5");
  EXPECT_EQ(err(R"({"prompt":"x","temperature":"hot"})").param, "temperature");
  EXPECT_EQ(err(R"({"prompt":"x","top_p":0})").message, "'top_p' must be greater than 0 and at most 1, not 0");
  // Positive as a double, 0 as the float the sampler uses.
  EXPECT_EQ(err(R"({"prompt":"x","top_p":1e-320})").param, "top_p");
  EXPECT_EQ(err(R"({"prompt":"x","top_p":1.5})").param, "top_p");
  EXPECT_EQ(err(R"({"prompt":"x","top_k":-1})").param, "top_k");
  EXPECT_EQ(err(R"({"prompt":"x","seed":1.5})").param, "seed");
  EXPECT_EQ(err(R"({"prompt":"x","stop":["a","b","c","d","e"]})").param, "stop");
  EXPECT_EQ(err(R"({"prompt":"x","stop":[""]})").param, "stop");
  EXPECT_EQ(err(R"({"prompt":"x","stream":"yes"})").param, "stream");
  EXPECT_EQ(err(R"({"prompt":"x","n":0})").param, "n");
  EXPECT_EQ(err(R"({"prompt":"x","n":17})").param, "n");
  EXPECT_EQ(err(R"({"prompt":"x","logprobs":21})").param, "logprobs");
  EXPECT_EQ(err(R"({"prompt":"x","logprobs":true})").param, "logprobs");
  EXPECT_EQ(err(R"({"messages":[{"role":"user","content":"x"}],"logprobs":3})", true).param, "logprobs");
  EXPECT_EQ(err(R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":3})", true).param, "top_logprobs");
  EXPECT_EQ(err(R"({"prompt":"x","presence_penalty":2.5})").param, "presence_penalty");
  EXPECT_EQ(err(R"({"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"messages":[]}})", true).param,
            "chat_template_kwargs");
  EXPECT_EQ(err(R"({"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":[1]})", true).param,
            "chat_template_kwargs");
  EXPECT_EQ(err(std::string(R"({"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"a":)") +
                  std::string(100000, '[') + std::string(100000, ']') + "}}",
                true)
              .message,
            "'chat_template_kwargs' is nested deeper than 32 levels");
  EXPECT_EQ(err(R"({"prompt":"x","frequency_penalty":-3})").param, "frequency_penalty");
  EXPECT_EQ(err(R"({"prompt":"x","repetition_penalty":0})").param, "repetition_penalty");
  {
    auto r = std::get<ApiRequest>(parse_request(
      R"({"prompt":"x","n":3,"logprobs":2,"presence_penalty":0.5,"frequency_penalty":-0.5,"repetition_penalty":1.3})",
      false));
    EXPECT_EQ(r.n, 3);
    EXPECT_EQ(r.logprobs, 2);
    EXPECT_FLOAT_EQ(r.presence_penalty, 0.5f);
    EXPECT_FLOAT_EQ(r.frequency_penalty, -0.5f);
    EXPECT_FLOAT_EQ(r.repetition_penalty, 1.3f);
    auto c = std::get<ApiRequest>(
      parse_request(R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":4})", true));
    EXPECT_EQ(c.logprobs, 4);
    c = std::get<ApiRequest>(parse_request(R"({"messages":[{"role":"user","content":"x"}],"logprobs":false})", true));
    EXPECT_EQ(c.logprobs, -1);
  }
  // Sampling extensions of other servers: refused, never silently ignored; their
  // neutral values pass.
  EXPECT_EQ(err(R"({"prompt":"x","typical_p":0.9})").param, "typical_p");
  EXPECT_EQ(err(R"({"prompt":"x","ignore_eos":true})").param, "ignore_eos");
  EXPECT_EQ(err(R"({"prompt":"x","mirostat":2})").param, "mirostat");
  EXPECT_TRUE(std::holds_alternative<ApiRequest>(
    parse_request(R"({"prompt":"x","repetition_penalty":1.0,"typical_p":1,"ignore_eos":false,"mirostat":0})", false)));
  EXPECT_EQ(err(R"({"prompt":"x","response_format":{"type":"yaml"}})").param, "response_format.type");
  EXPECT_EQ(err(R"({"prompt":"x","response_format":"json"})").param, "response_format");
  EXPECT_EQ(err(R"({"prompt":"x","response_format":{"type":"json_schema"}})").param, "response_format.json_schema");
  EXPECT_EQ(err(R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"schema":{}}}})").param,
            "response_format.json_schema.name");
  EXPECT_EQ(err(R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"n","strict":1}}})").param,
            "response_format.json_schema.strict");
  EXPECT_EQ(err(R"J({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"type":"string","pattern":"(?=a)"}}}})J")
              .message,
            "response_format.json_schema.schema: 'pattern' is not supported here: lookarounds and named groups");
  for (const char* ok : {R"({"prompt":"x","response_format":{"type":"json_object"}})",
                         R"({"prompt":"x","response_format":{"type":"text"}})",
                         R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"type":"object"},"strict":true}}})"})
    EXPECT_TRUE(std::holds_alternative<ApiRequest>(parse_request(ok, false))) << ok;
  EXPECT_EQ(err(R"({"prompt":"x","model":3})").param, "model");
  EXPECT_EQ(err(R"({})", true).param, "messages");
  EXPECT_EQ(err(R"({"messages":[]})", true).param, "messages");
  EXPECT_EQ(err(R"({"messages":[{"role":"robot","content":"x"}]})", true).param, "messages[0].role");
  EXPECT_EQ(err(R"({"messages":[{"role":"user"}]})", true).param, "messages[0].content");
  EXPECT_EQ(err(R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})", true).param,
            "messages[0].content");
  for (auto& e : {err("{nope"), err(R"({"prompt":"x","n":0})")})
    EXPECT_EQ(e.body()["error"]["type"], "invalid_request_error");
}

TEST(OpenAI, ContextCheckNamesBothNumbers) {
  EXPECT_FALSE(check_context(10, 502, 512));
  auto e = check_context(10, 503, 512);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code, "context_length_exceeded");
  EXPECT_NE(e->message.find("maximum context length is 512 tokens"), std::string::npos);
  EXPECT_NE(e->message.find("513 tokens (10 in the prompt, 503 for the completion)"), std::string::npos);
}

TEST(OpenAI, StopStringsHoldBackPossiblePrefixes) {
  StopMatcher m({"STOP", "xy"});
  EXPECT_EQ(m.push("abc S"), "abc ");
  EXPECT_EQ(m.push("T"), "");
  EXPECT_EQ(m.push("ay"), "STay"); // not a stop after all
  EXPECT_EQ(m.push("x"), "");
  EXPECT_EQ(m.push("yz"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.push("more"), "");
  StopMatcher n({"END"});
  EXPECT_EQ(n.push("the E"), "the ");
  EXPECT_EQ(n.flush(), "E");
  StopMatcher none({});
  EXPECT_EQ(none.push("all of it"), "all of it");
}

TEST(OpenAI, ChatFormatsPerFamily) {
  auto bytes = model::Tokenizer::bytes();
  model::ModelConfig cfg;
  cfg.identity = "builtin:tiny";
  cfg.bos_id = bytes->bos_id();
  EXPECT_EQ(chat_family(cfg), "plain");
  std::vector<ChatMessage> chat = {{"system", "Be brief."}, {"user", "Hi"}};
  EXPECT_EQ(bytes->decode(encode_chat(chat, "plain", *bytes, cfg)), "Be brief.\nHi");
  EXPECT_EQ(bytes->decode(encode_chat(chat, "chatml", *bytes, cfg)),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(bytes->decode(encode_chat(chat, "llama2", *bytes, cfg)), "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]");
  cfg.identity = "/m/qwen";
  cfg.architecture = "qwen2";
  EXPECT_EQ(chat_family(cfg), "chatml");
  cfg.architecture = "llama";
  EXPECT_EQ(chat_family(cfg), "llama2");
}

// A chat stops at ChatML's <|im_end|> when the tokenizer has it as one token,
// besides the model's own stop ids; a tokenizer without it adds nothing.
TEST(OpenAI, ChatStopsAtTheEndOfTurnToken) {
  model::ModelConfig cfg;
  cfg.eos_ids = {2};
  auto bytes = model::Tokenizer::bytes();
  EXPECT_EQ(chat_stop_ids("chatml", *bytes, cfg), (std::vector<int32_t>{2})) << "<|im_end|> is many bytes";
  STRATA_REQUIRE_SHARED("models/qwen-tokenizer.json");
  auto qwen = model::Tokenizer::load(test::shared_path("models/qwen-tokenizer.json"));
  cfg.eos_ids = {151643}; // Qwen2.5 base: <|endoftext|> only
  EXPECT_EQ(chat_stop_ids("chatml", *qwen, cfg), (std::vector<int32_t>{151643, 151645}));
  cfg.eos_ids = {151645, 151643}; // Instruct: already there
  EXPECT_EQ(chat_stop_ids("chatml", *qwen, cfg), (std::vector<int32_t>{151645, 151643}));
  EXPECT_EQ(chat_stop_ids("llama2", *qwen, cfg), cfg.eos_ids);
}

TEST(OpenAI, DefaultServedNameIsTheFileOrDirectoryName) {
  EXPECT_EQ(default_served_name("builtin:qwen2-0.5b"), "builtin:qwen2-0.5b");
  EXPECT_EQ(default_served_name("/models/Qwen2.5-0.5B-Instruct/"), "Qwen2.5-0.5B-Instruct");
  EXPECT_EQ(default_served_name("/models/stories260K.bin"), "stories260K.bin");
  EXPECT_EQ(default_served_name("stories260K.bin"), "stories260K.bin");
}

TEST(OpenAI, ApiKeySchemeIsCaseInsensitiveAndTheKeyExact) {
  EXPECT_TRUE(api_key_matches("Bearer k-1", "k-1"));
  EXPECT_TRUE(api_key_matches("bearer k-1", "k-1"));
  EXPECT_TRUE(api_key_matches("BEARER   k-1", "k-1"));
  EXPECT_FALSE(api_key_matches("Bearer k-12", "k-1"));
  EXPECT_FALSE(api_key_matches("Bearer k-", "k-1"));
  EXPECT_FALSE(api_key_matches("Bearer", "k-1"));
  EXPECT_FALSE(api_key_matches("Basic k-1", "k-1"));
  EXPECT_FALSE(api_key_matches("Bearerk-1", "k-1"));
  EXPECT_FALSE(api_key_matches("Bearer ", ""));
}

} // namespace
} // namespace strata::server
