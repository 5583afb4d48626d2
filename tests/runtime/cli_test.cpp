// The command line is a contract: other checks drive strata through it.

#include "tests/support.hpp"

#include <array>
#include <cstdio>
#include <sys/wait.h>

namespace strata {
namespace {

struct Run {
  int code;
  std::string out;
};

// Runs the strata executable with `args` (shell-quoted by the caller); stderr
// goes to stdout when `merge` is set.
Run strata(const std::string& args, bool merge = false, const std::string& stdin_text = {}) {
  std::string cmd = std::string(STRATA_EXE) + " " + args + (merge ? " 2>&1" : " 2>/dev/null");
  if (!stdin_text.empty()) {
    auto dir = test::scratch_dir("cli_stdin");
    test::write_file(dir / "in.txt", stdin_text);
    cmd += " < " + (dir / "in.txt").string();
  } else {
    cmd += " < /dev/null";
  }
  FILE* p = ::popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf{};
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0)
    out.append(buf.data(), n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

int lines(const std::string& s) {
  return static_cast<int>(std::count(s.begin(), s.end(), '\n'));
}

TEST(Cli, HelpForEverySubcommand) {
  for (std::string sub : {"generate", "tokenize", "detokenize"}) {
    auto r = strata(sub + " --help");
    EXPECT_EQ(r.code, 0) << sub;
    EXPECT_NE(r.out.find("usage: strata " + sub), std::string::npos) << r.out;
  }
  EXPECT_EQ(strata("--help").code, 0);
}

TEST(Cli, BadArgumentsGiveOneLineAndExitTwo) {
  const std::vector<std::string> bad = {
    "",
    "frobnicate",
    "generate --prompt hi",                                           // no --model
    "generate --model builtin:tiny",                                  // no prompt
    "generate --model builtin:tiny --prompt a --prompt-ids 1",        // both
    "generate --model builtin:tiny --prompt-ids 1 --max-tokens x",    // not a number
    "generate --model builtin:tiny --prompt-ids 1 --temperature -1",  // out of range
    "generate --model builtin:tiny --prompt-ids 1 --top-p 2",
    "generate --model builtin:tiny --prompt-ids 1,,2",
    "generate --model builtin:tiny --prompt-ids 1 --output xml",
    "generate --model builtin:tiny --prompt-ids 1 --bogus",
    "generate --model builtin:tiny --prompt-ids 1 --max-tokens",      // missing value
    "generate --model builtin:nope --prompt-ids 1",
    "tokenize",
    "tokenize --tokenizer builtin:bytes --text a --text b",
    "detokenize --tokenizer builtin:bytes 1 x",
    "serve --cluster 127.0.0.1:1 --draft-max-sessions 2",                            // no --draft-model
    "serve --cluster 127.0.0.1:1 --draft-model builtin:tiny --draft-max-sessions x", // not a number
  };
  for (auto& args : bad) {
    auto r = strata(args, true);
    EXPECT_EQ(r.code, 2) << args << " -> " << r.out;
    EXPECT_LE(lines(r.out), 1) << args << " -> " << r.out;
    EXPECT_NE(r.out.find("error"), std::string::npos) << args << " -> " << r.out;
  }
}

TEST(Cli, RuntimeFailuresExitOne) {
  auto r = strata("generate --model /nonexistent.bin --prompt-ids 1", true);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("/nonexistent.bin"), std::string::npos);
  EXPECT_EQ(lines(r.out), 1) << r.out;
  r = strata("generate --model builtin:tiny --prompt-ids 1,300", true);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("token_out_of_range"), std::string::npos) << r.out;
}

TEST(Cli, GenerateIdsMatchesTextOutput) {
  auto ids = strata("generate --model builtin:tiny --prompt 'Once upon' --max-tokens 12 --output ids");
  ASSERT_EQ(ids.code, 0);
  auto text = strata("generate --model builtin:tiny --prompt 'Once upon' --max-tokens 12");
  ASSERT_EQ(text.code, 0);
  // Text = prompt + decode(ids) + newline.
  std::string expected = "Once upon";
  std::istringstream is(ids.out);
  int id, count = 0;
  while (is >> id) {
    if (id >= 3)
      expected += static_cast<char>(id - 3);
    ++count;
  }
  EXPECT_EQ(count, 12);
  EXPECT_EQ(text.out, expected + "\n");
}

TEST(Cli, GenerateMatchesStoriesReference) {
  STRATA_REQUIRE_SHARED("models/stories260K.bin");
  const auto ref = test::read_json(test::shared_path("models/stories260K.greedy.json"));
  const auto& c = ref["cases"][1];
  std::string prompt, expect;
  for (auto& v : c["prompt_ids"])
    prompt += (prompt.empty() ? "" : ",") + std::to_string(v.get<int>());
  for (auto& v : c["expected_generated_ids"])
    expect += (expect.empty() ? "" : " ") + std::to_string(v.get<int>());
  const auto steps = c["steps"].get<int>() - static_cast<int>(c["prompt_ids"].size()) + 1;
  auto r = strata("generate --model " + test::shared_path("models/stories260K.bin") + " --prompt-ids " + prompt +
                  " --max-tokens " + std::to_string(steps) + " --output ids --threads 1");
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, expect + "\n");
}

// One .gguf file is a whole model: llama.cpp's greedy ids from the command
// line, sharded through actors with failures injected, a text prompt through
// the file's own tokenizer, and --dtype refused for it.
TEST(Cli, GgufFileGeneratesLlamaCppIds) {
  STRATA_REQUIRE_SHARED("models/gguf/rand256-f32.gguf");
  const auto ref = test::read_json(test::shared_path("models/gguf/rand256.gguf-ref.json"));
  const auto& c = ref["files"]["rand256-f32.gguf"][0];
  std::string prompt, expect;
  for (auto& v : c["prompt_ids"])
    prompt += (prompt.empty() ? "" : ",") + std::to_string(v.get<int>());
  for (auto& v : c["generated_ids"])
    expect += (expect.empty() ? "" : " ") + std::to_string(v.get<int>());
  const std::string model = test::shared_path("models/gguf/rand256-f32.gguf");
  const std::string base = "generate --model " + model + " --prompt-ids " + prompt + " --max-tokens " +
                           std::to_string(c["generated_ids"].size()) + " --output ids";
  auto r = strata(base);
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, expect + "\n");
  auto sharded = strata(base + " --shards 0,1 --inject evict:1@5,kill:0@10", true);
  EXPECT_EQ(sharded.code, 0) << sharded.out;
  EXPECT_NE(sharded.out.find(expect + "\n"), std::string::npos) << sharded.out;
  auto text = strata("generate --model " + model + " --prompt 'Once upon a time' --max-tokens 8", true);
  EXPECT_EQ(text.code, 0) << text.out;
  EXPECT_NE(text.out.find("Once upon a time"), std::string::npos) << text.out;
  auto q8 = strata("generate --model " + model + " --prompt-ids 1 --dtype q8_0", true);
  EXPECT_EQ(q8.code, 2) << q8.out;
  EXPECT_NE(q8.out.find("GGUF"), std::string::npos) << q8.out;
  // The KV cache in f16 through shards with faults: the same ids as an f16 cache alone.
  auto f16 = strata(base + " --kv-dtype f16");
  EXPECT_EQ(f16.code, 0) << f16.out;
  EXPECT_FALSE(f16.out.empty());
  auto f16_sharded = strata(base + " --kv-dtype f16 --shards 0,1 --inject evict:1@5,kill:0@10", true);
  EXPECT_EQ(f16_sharded.code, 0) << f16_sharded.out;
  EXPECT_NE(f16_sharded.out.find(f16.out), std::string::npos) << f16_sharded.out;
  auto bad_kv = strata("generate --model " + model + " --prompt-ids 1 --kv-dtype q4_0", true);
  EXPECT_EQ(bad_kv.code, 2) << bad_kv.out;
  EXPECT_NE(bad_kv.out.find("q4_0"), std::string::npos) << bad_kv.out;
}

// Loading draws a progress line when stderr is a terminal (run under script(1)
// for a pseudo-terminal), and stays silent when it is not.
TEST(Cli, LoadingShowsProgressOnATerminalOnly) {
  if (std::system("command -v script > /dev/null 2>&1") != 0)
    GTEST_SKIP() << "script(1) is not installed; skipping";
  const std::string gen = std::string(STRATA_EXE) + " generate --model builtin:tiny --prompt-ids 1 --max-tokens 2 --output ids";
  FILE* p = ::popen(("script -q -e -c '" + gen + "' /dev/null 2>&1").c_str(), "r");
  std::string out;
  std::array<char, 4096> buf{};
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0)
    out.append(buf.data(), n);
  EXPECT_EQ(::pclose(p), 0) << out;
  EXPECT_NE(out.find("loading builtin:tiny layers 0-4 as f32"), std::string::npos) << out;
  EXPECT_NE(out.find("MB/s, ETA"), std::string::npos) << out;
  auto piped = strata("generate --model builtin:tiny --prompt-ids 1 --max-tokens 2 --output ids", true);
  EXPECT_EQ(piped.out.find("MB/s"), std::string::npos) << piped.out;
}

TEST(Cli, ShardActorsAndInjectedFailuresPrintTheSame) {
  const std::string base = "generate --model builtin:tiny --prompt 'Once upon a time' --max-tokens 40 --output ids";
  auto plain = strata(base);
  ASSERT_EQ(plain.code, 0);
  auto sharded = strata(base + " --shards 0-1,2-3,4");
  EXPECT_EQ(sharded.code, 0);
  EXPECT_EQ(sharded.out, plain.out);
  auto faulty = strata(base + " --shards 0-1,2-3,4 --inject evict:1@5,kill:0@10,epoch@15,desync:2@20,dup:1@25", true);
  EXPECT_EQ(faulty.code, 0) << faulty.out;
  EXPECT_NE(faulty.out.find(plain.out.substr(0, plain.out.size() - 1)), std::string::npos) << faulty.out;
  EXPECT_NE(faulty.out.find("evicted_lru=1"), std::string::npos) << faulty.out;
  EXPECT_NE(faulty.out.find("seq_mismatch=1"), std::string::npos) << faulty.out;
  // Text output through actors equals the single-process text.
  auto text = strata("generate --model builtin:tiny --prompt 'Once upon a time' --max-tokens 40");
  auto text_actors = strata("generate --model builtin:tiny --prompt 'Once upon a time' --max-tokens 40 --inject kill:0@7");
  EXPECT_EQ(text.out, text_actors.out);
}

TEST(Cli, BadShardsAndInjectionsExitTwo) {
  for (std::string args : {"--shards 0-1,3-4", "--shards 0-9", "--shards 0-1,2-4 --inject kill:5@3",
                           "--inject boom@3", "--inject evict:0", "--inject evict:x@1"}) {
    auto r = strata("generate --model builtin:tiny --prompt-ids 1 " + args, true);
    EXPECT_EQ(r.code, 2) << args << " -> " << r.out;
    EXPECT_EQ(lines(r.out), 1) << args << " -> " << r.out;
  }
}

TEST(Cli, OptionsFromAConfigFile) {
  auto dir = test::scratch_dir("cli_config");
  test::write_file(dir / "gen.ini", "# generation settings\n[generate]\nmodel = \"builtin:tiny\"\nmax-tokens = 7\n"
                                    "output = ids\n");
  auto r = strata("generate --config " + (dir / "gen.ini").string() + " --prompt-ids 1,2");
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), ' '), 6) << r.out; // 7 ids
  // The command line wins over the file.
  r = strata("generate --config " + (dir / "gen.ini").string() + " --prompt-ids 1,2 --max-tokens 3");
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), ' '), 2) << r.out;
  test::write_file(dir / "bad.ini", "model = builtin:tiny\nbogus = 1\n");
  r = strata("generate --config " + (dir / "bad.ini").string() + " --prompt-ids 1", true);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("bad.ini:2"), std::string::npos) << r.out;
}

TEST(Cli, TokenizeAndDetokenize) {
  STRATA_REQUIRE_SHARED("models/llama2-tokenizer.bin");
  const auto tok = test::shared_path("models/llama2-tokenizer.bin");
  auto r = strata("tokenize --tokenizer " + tok + " --bos --text 'I believe the meaning of life is'");
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, "1 306 4658 278 6593 310 2834 338\n");
  r = strata("tokenize --tokenizer " + tok + " --bos", false, "I believe the meaning of life is");
  EXPECT_EQ(r.out, "1 306 4658 278 6593 310 2834 338\n");
  r = strata("detokenize --tokenizer " + tok + " 1 306 4658 278 6593 310 2834 338");
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, "I believe the meaning of life is");
  r = strata("detokenize --tokenizer " + tok + " 99999", true);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("99999"), std::string::npos);
}

TEST(Cli, QwenTokenizeMatchesReference) {
  STRATA_REQUIRE_SHARED("models/qwen-tokenizer.json");
  auto r = strata("tokenize --tokenizer " + test::shared_path("models/qwen-tokenizer.json") + " --text 'Hello, world!'");
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, "9707 11 1879 0\n");
}

} // namespace
} // namespace strata
