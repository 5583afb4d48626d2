#include "runtime/cli.hpp"

#include "actors/cluster.hpp"
#include "runtime/certs.hpp"
#include "runtime/delay_proxy.hpp"
#include "runtime/cluster.hpp"
#include "messages/session_id.hpp"
#include "model/base/error.hpp"
#include "model/text/tokenizer.hpp"
#include "runtime/args.hpp"
#include "runtime/generator.hpp"
#include "runtime/log.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <iterator>

namespace strata::runtime {

namespace {

constexpr const char* top_usage =
  "usage: strata <command> [options]\n"
  "\n"
  "commands:\n"
  "  generate     generate text (in this process, through shard actors, or on a cluster)\n"
  "  node         start a cluster node (coordinator or shard)\n"
  "  status       print a cluster's nodes, route and caches\n"
  "  inject       inject a failure into a cluster (kill, freeze, evict, epoch)\n"
  "  serve        serve a cluster over an OpenAI-compatible HTTP API\n"
  "  certs        create a cluster CA and certificates for mutual TLS\n"
  "  tokenize     print the token ids of a text\n"
  "  detokenize   print the text of token ids\n"
  "  info         print a model's configuration\n"
  "  delay-proxy  forward TCP connections with a one-way delay (a simulated network link)\n"
  "\n"
  "Run 'strata <command> --help' for the options of a command.\n";

int cmd_generate(int argc, char** argv) {
  Args a;
  a.option("model", "PATH|builtin:NAME", "llama2.c .bin, GGUF file, Hugging Face directory, or builtin:tiny / builtin:qwen2-0.5b")
    .option("cluster", "HOST:PORT", "generate on a running cluster (its coordinator)")
    .option("tokenizer", "PATH", "tokenizer.bin or tokenizer.json (builtin models bring their own)")
    .option("prompt", "TEXT", "prompt text (needs a tokenizer)")
    .option("prompt-ids", "1,2,3", "prompt as token ids")
    .option("max-tokens", "N", "most tokens to generate (default 128)")
    .option("temperature", "T", "0 = greedy (default 0)")
    .option("top-k", "K", "keep the K most likely tokens (0 = off)")
    .option("top-p", "P", "nucleus sampling mass in (0, 1] (default 1)")
    .option("min-p", "P", "drop tokens less likely than P times the most likely one, in [0, 1] (default 0)")
    .option("seed", "S", "random seed for sampling (default 0)")
    .option("threads", "N", "threads for tensor math (default: all cores)")
    .option("dtype", "auto|f32|bf16|q8_0|q4_0|q4_K", "how weights are kept in memory (default auto: GGUF types as stored, others f32)")
    .option("kv-dtype", "f32|bf16|f16|q8_0", "how the KV cache keeps keys and values (default f32)")
    .option("output", "text|ids", "print text (default) or the generated ids")
    .option("shards", "A-B,C-D,...", "run through in-process shard actors with these layer ranges")
    .option("inject", "SPEC[,SPEC]", "failures at decode steps: evict:I@S kill:I@S epoch@S desync:I@S dup:I@S"
                                     " (freeze:I@S with --cluster)")
    .option("speculate", "K", "speculative decoding by prompt lookup: propose up to K (1-15) tokens per step "
                              "from the text so far; the output is the same (runs through shard actors)")
    .option("draft-model", "PATH", "speculative decoding with this small model of the same tokenizer proposing "
                                   "the tokens (loaded here; --speculate K: at most K per step, default 4)")
    .option("route-wait-ms", "MS", "with --cluster: how long to wait for a coordinator that went away to come back "
                                   "before failing with cluster_lost (default 10000)");
  add_network_options(a); // with --cluster
  a.parse(argc, argv, 2);
  log::configure_from(a, "client");
  if (a.help_requested()) {
    std::cout << "usage: strata generate --model PATH|builtin:NAME (--prompt TEXT | --prompt-ids 1,2,3) [options]\n\n"
              << "Runs the whole model in this process, prefill then cached decode.\n"
              << "Stops at --max-tokens, at the model's stop ids, or at the context length.\n"
              << "With --shards (or --inject) the generation runs through shard actors, a session\n"
              << "actor and a route supervisor; injected failures must not change the output.\n\noptions:\n"
              << a.help_text();
    return 0;
  }
  const bool on_cluster = a.has("cluster");
  if (on_cluster && a.has("shards"))
    throw UsageError("--shards describes an in-process run; a cluster's nodes choose their own layers");
  std::string model_spec = on_cluster ? a.str("model") : a.required("model");
  if (a.has("prompt") == a.has("prompt-ids"))
    throw UsageError("give exactly one of --prompt and --prompt-ids");
  const std::string output = a.str("output", "text");
  if (output != "text" && output != "ids")
    throw UsageError("--output must be 'text' or 'ids', got '" + output + "'");
  GenerateRequest req;
  req.max_tokens = a.integer("max-tokens", 128, 0, int64_t{1} << 24);
  req.sampling.temperature = static_cast<float>(a.number("temperature", 0.0, 0.0, 100.0));
  req.sampling.top_k = static_cast<int32_t>(a.integer("top-k", 0, 0, int64_t{1} << 30));
  req.sampling.top_p = static_cast<float>(a.number("top-p", 1.0, 1e-9, 1.0));
  req.sampling.min_p = static_cast<float>(a.number("min-p", 0.0, 0.0, 1.0));
  req.sampling.seed = static_cast<uint64_t>(a.integer("seed", 0, 0, INT64_MAX));
  const int threads = static_cast<int>(a.integer("threads", 0, 0, 1024));
  std::vector<int32_t> prompt_ids;
  if (a.has("prompt-ids")) {
    prompt_ids = parse_id_list(a.str("prompt-ids"), "--prompt-ids");
    if (prompt_ids.empty())
      throw UsageError("--prompt-ids is empty");
  }
  model::set_num_threads(threads);
  auto speculate = static_cast<uint32_t>(a.integer("speculate", 0, 0, msg::max_draft));
  if (a.has("draft-model") && !a.has("speculate"))
    speculate = 4;
  if (a.has("draft-model") && speculate == 0)
    throw UsageError("--draft-model with --speculate 0 would never use it");
  const bool actors_mode = a.has("shards") || a.has("inject") || on_cluster || speculate > 0;
  caf::actor_system* csys = nullptr;
  msg::supervisor_actor coordinator;
  int64_t cluster_hops = 0;
  model::ModelConfig cfg;
  if (on_cluster) {
    // Everything about the model comes from the cluster: no model files here.
    csys = &client_system(liveness_from(a), tls_from(a));
    coordinator = connect_coordinator(*csys, parse_endpoint(a.str("cluster"), "cluster"));
    // The coordinator answers no_route after its own route wait (at most 60 s);
    // the request fails sooner when the coordinator goes away meanwhile.
    log::debug("connected to the coordinator; asking it for a route");
    auto plan = ask_watched<msg::route_info>(*csys, coordinator, std::chrono::seconds(75), atom::route_atom_v,
                                             std::vector<msg::shard_actor>{});
    if (!plan)
      throw model::Error(model::errc::io, "the cluster has no route: " + csys->render(plan.error()));
    cluster_hops = static_cast<int64_t>(plan->hops.size());
    const auto facts = cluster_model(*csys, coordinator);
    if (!model_spec.empty() && model_spec != facts.model)
      throw UsageError("--model '" + model_spec + "' is not the cluster's model '" + facts.model +
                       "' (omit --model with --cluster)");
    model_spec = facts.model;
    cfg = facts.to_config();
  } else {
    cfg = model::read_config(model_spec);
  }

  std::unique_ptr<LocalPipeline> pipe;
  if (!actors_mode)
    pipe = std::make_unique<LocalPipeline>(model_spec, load_options_from(a));
  std::vector<model::LayerRange> ranges = {model::LayerRange{0, cfg.n_layers - 1}};
  if (a.has("shards")) {
    ranges = model::parse_layer_ranges(a.str("shards"));
    model::check_route_covers(ranges, cfg.n_layers);
  }
  const int64_t n_hops = on_cluster ? cluster_hops : static_cast<int64_t>(ranges.size());
  if (a.has("inject"))
    actors::parse_injections(a.str("inject"), n_hops, on_cluster); // validate before running
  std::unique_ptr<model::Tokenizer> tok =
    a.has("tokenizer") ? model::Tokenizer::load(a.str("tokenizer")) : model::default_tokenizer_for(cfg);
  if (tok && tok->vocab_size() > cfg.vocab_size)
    throw model::Error(model::errc::bad_argument, "tokenizer has " + std::to_string(tok->vocab_size()) +
                                                    " tokens but the model's vocabulary is " + std::to_string(cfg.vocab_size));
  if (a.has("prompt")) {
    if (!tok)
      throw UsageError("--prompt needs --tokenizer for this model (or use --prompt-ids)");
    prompt_ids = tok->encode(a.str("prompt"), cfg.bos_id >= 0 && tok->bos_id() == cfg.bos_id);
    if (prompt_ids.empty())
      throw UsageError("the prompt encodes to no tokens");
  }
  if (output == "text" && !tok)
    throw UsageError("text output needs --tokenizer for this model (or use --output ids)");
  req.prompt_ids = prompt_ids;

  std::optional<model::StreamDecoder> dec;
  if (output == "text") {
    dec.emplace(*tok);
    std::string head;
    for (auto id : prompt_ids)
      head += dec->push(id);
    std::fwrite(head.data(), 1, head.size(), stdout);
    std::fflush(stdout);
  }
  std::vector<double> token_ms; // arrival time of each generated token since the start
  const auto gen_start = std::chrono::steady_clock::now();
  auto emit = [&](int32_t id) {
    token_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - gen_start).count());
    if (dec) {
      const std::string piece = dec->push(id);
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    }
  };
  GenerateResult res;
  if (actors_mode) {
    const auto rules = GenerationRules::make(cfg, req);
    std::unique_ptr<actors::actor_config> acfg;
    std::unique_ptr<caf::actor_system> lsys;
    std::unique_ptr<actors::LocalCluster> local;
    actors::drafter_actor drafter;
    if (!on_cluster) {
      acfg = std::make_unique<actors::actor_config>();
      lsys = std::make_unique<caf::actor_system>(*acfg);
      actors::ClusterOptions copts;
      copts.load = load_options_from(a);
      if (a.has("draft-model"))
        copts.session.drafter = drafter = actors::spawn_drafter(*lsys, a.str("draft-model"), cfg.vocab_size);
      local = std::make_unique<actors::LocalCluster>(*lsys, model_spec, ranges, copts);
    } else if (a.has("draft-model")) {
      drafter = actors::spawn_drafter(*csys, a.str("draft-model"), cfg.vocab_size);
    }
    caf::actor_system& sys = on_cluster ? *csys : *lsys;
    auto stop_drafter = caf::detail::make_scope_guard([&] {
      if (drafter)
        caf::anon_send_exit(drafter, caf::exit_reason::user_shutdown);
    });
    const auto inject = actors::parse_injections(a.str("inject"), n_hops, on_cluster);
    msg::generation_request greq;
    greq.session = msg::mint_session_id("cli");
    greq.prompt = req.prompt_ids;
    greq.max_tokens = req.max_tokens;
    greq.sampling = msg::sampling_state{};
    greq.sampling.temperature = req.sampling.temperature;
    greq.sampling.top_k = req.sampling.top_k;
    greq.sampling.top_p = req.sampling.top_p;
    greq.sampling.rng_state = model::Sampler(req.sampling).state();
    greq.sampling.min_p = req.sampling.min_p;
    greq.stop_ids = rules.stop_ids;
    greq.speculate = speculate;
    actors::SessionOptions sopts;
    sopts.max_context = cfg.max_seq_len;
    sopts.cluster_wait = std::chrono::milliseconds(a.integer("route-wait-ms", 10000, 1, 600000));
    sopts.drafter = drafter;
    auto out = on_cluster
                 ? actors::run_generation(
                     sys, coordinator, greq, sopts, inject,
                     [&](const actors::Injection& inj, const std::string& session) {
                       apply_remote_injection(sys, coordinator, inj, session);
                       // When it happened, for people (and tests) watching the recovery;
                       // not while text streams to stdout (a terminal would mix the two).
                       static constexpr const char* kinds[] = {"evict", "kill", "epoch", "desync", "dup", "freeze"};
                       if (!dec)
                         std::fprintf(stderr, "[strata] injected %s on hop %lld at token %lld\n", kinds[inj.kind],
                                      static_cast<long long>(inj.shard), static_cast<long long>(inj.at_token));
                     },
                     [&](const msg::token_event& ev) { emit(ev.token); },
                     [&]() -> msg::supervisor_actor { // the coordinator restarted
                       auto fresh = reconnect_coordinator(sys, parse_endpoint(a.str("cluster"), "cluster"),
                                                          sopts.cluster_wait);
                       if (fresh)
                         coordinator = fresh;
                       return fresh; // invalid when it did not come back
                     })
                 : local->generate(greq, inject, [&](const msg::token_event& ev) { emit(ev.token); });
    if (!out.ok())
      throw model::Error(model::errc::io, "generation failed: " + sys.render(out.error));
    res.ids = out.result.ids;
    res.finish = out.result.finish == "stop" ? FinishReason::stop
                 : out.result.finish == "context" ? FinishReason::context : FinishReason::length;
    res.prefill_ms = out.result.prefill_ms;
    res.decode_ms = out.result.total_ms - out.result.prefill_ms;
    std::string misses;
    uint64_t total_misses = 0;
    for (std::size_t r = 1; r < out.result.misses.size(); ++r)
      if (out.result.misses[r] > 0) {
        misses += std::string(misses.empty() ? "" : ", ") + msg::to_string(static_cast<msg::miss_reason>(r)) + "=" +
                  std::to_string(out.result.misses[r]);
        total_misses += out.result.misses[r];
      }
    std::fprintf(stderr, "[strata] %lld shard actors, %zu injected failures; cache misses %llu (%s), recoveries %llu, "
                         "recomputed %llu layer-tokens (full re-prefill: %llu), route changes %llu, retries %llu\n",
                 static_cast<long long>(n_hops), inject.size(), static_cast<unsigned long long>(total_misses),
                 misses.empty() ? "none" : misses.c_str(), static_cast<unsigned long long>(out.result.reprefills),
                 static_cast<unsigned long long>(out.result.recomputed_layer_tokens),
                 static_cast<unsigned long long>(out.result.full_layer_tokens),
                 static_cast<unsigned long long>(out.result.route_changes),
                 static_cast<unsigned long long>(out.result.retries));
    if (speculate > 0)
      std::fprintf(stderr, "[strata] speculation (%s): %llu proposed, %llu accepted (%.0f%%), %llu trips for %zu tokens "
                           "(%.2f trips per token)\n",
                   a.has("draft-model") ? "draft model" : "prompt lookup", static_cast<unsigned long long>(out.result.proposed),
                   static_cast<unsigned long long>(out.result.accepted),
                   out.result.proposed ? 100.0 * static_cast<double>(out.result.accepted) / static_cast<double>(out.result.proposed) : 0.0,
                   static_cast<unsigned long long>(out.result.steps), out.result.ids.size(),
                   out.result.ids.empty() ? 0.0 : static_cast<double>(out.result.steps) / static_cast<double>(out.result.ids.size()));
  } else {
    res = generate(*pipe, req, emit);
  }
  if (dec) {
    const std::string rest = dec->finish();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    std::fputc('\n', stdout);
  } else {
    for (std::size_t i = 0; i < res.ids.size(); ++i)
      std::printf("%s%d", i ? " " : "", res.ids[i]);
    std::printf("\n");
  }
  std::fflush(stdout);
  const double tps = res.decode_ms > 0 && res.ids.size() > 1 ? (res.ids.size() - 1) * 1000.0 / res.decode_ms : 0.0;
  std::fprintf(stderr, "[strata] %zu prompt tokens, %zu generated, finish=%s, prefill %.1f ms, decode %.1f tok/s\n",
               prompt_ids.size(), res.ids.size(), to_string(res.finish), res.prefill_ms, tps);
  if (token_ms.size() >= 2) {
    std::vector<double> gaps;
    for (std::size_t i = 1; i < token_ms.size(); ++i)
      gaps.push_back(token_ms[i] - token_ms[i - 1]);
    std::sort(gaps.begin(), gaps.end());
    auto pct = [&](double q) { return gaps[std::min(gaps.size() - 1, static_cast<std::size_t>(q * gaps.size()))]; };
    std::fprintf(stderr, "[strata] time to first token %.1f ms; inter-token p50 %.2f ms, p99 %.2f ms, max %.2f ms\n",
                 token_ms.front(), pct(0.5), pct(0.99), gaps.back());
  }
  return 0;
}

std::string read_stdin() {
  std::string s((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  return s;
}

int cmd_tokenize(int argc, char** argv) {
  Args a;
  a.option("tokenizer", "PATH", "tokenizer.bin, tokenizer.json, or builtin:bytes")
    .option("bos", "", "prepend the BOS id (tokenizers that have one)")
    .option("text", "TEXT", "text to encode (default: all of standard input)");
  a.parse(argc, argv, 2);
  if (a.help_requested()) {
    std::cout << "usage: strata tokenize --tokenizer PATH [--bos] [--text TEXT]\n\n"
              << "Prints the token ids space-separated on one line.\n\noptions:\n"
              << a.help_text();
    return 0;
  }
  auto tok = model::Tokenizer::load(a.required("tokenizer"));
  const std::string text = a.has("text") ? a.str("text") : read_stdin();
  const auto ids = tok->encode(text, a.has("bos"));
  for (std::size_t i = 0; i < ids.size(); ++i)
    std::printf("%s%d", i ? " " : "", ids[i]);
  std::printf("\n");
  return 0;
}

int cmd_info(int argc, char** argv) {
  Args a;
  a.option("model", "PATH|builtin:NAME", "the model");
  a.parse(argc, argv, 2);
  if (a.help_requested()) {
    std::cout << "usage: strata info --model PATH|builtin:NAME\n\nPrints the model's configuration, one 'key value' "
                 "per line, without loading its weights.\n\noptions:\n"
              << a.help_text();
    return 0;
  }
  const auto c = model::read_config(a.required("model"));
  std::printf("architecture %s\nlayers %lld\ndim %lld\nhidden_dim %lld\nheads %lld\nkv_heads %lld\nhead_dim %lld\n"
              "vocab %lld\nmax_seq_len %lld\nsummary %s\n",
              c.architecture.c_str(), static_cast<long long>(c.n_layers), static_cast<long long>(c.dim),
              static_cast<long long>(c.hidden_dim), static_cast<long long>(c.n_heads),
              static_cast<long long>(c.n_kv_heads), static_cast<long long>(c.head_dim),
              static_cast<long long>(c.vocab_size), static_cast<long long>(c.max_seq_len), c.summary().c_str());
  return 0;
}

int cmd_detokenize(int argc, char** argv) {
  Args a;
  a.option("tokenizer", "PATH", "tokenizer.bin, tokenizer.json, or builtin:bytes");
  a.parse(argc, argv, 2, "IDS");
  if (a.help_requested()) {
    std::cout << "usage: strata detokenize --tokenizer PATH IDS...\n\n"
              << "Prints the text of the ids (space- or comma-separated), with no newline added.\n\noptions:\n"
              << a.help_text();
    return 0;
  }
  auto tok = model::Tokenizer::load(a.required("tokenizer"));
  std::vector<int32_t> ids;
  for (auto& p : a.positionals()) {
    auto part = parse_id_list(p, "token ids");
    ids.insert(ids.end(), part.begin(), part.end());
  }
  const std::string text = tok->decode(ids);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

} // namespace

int run_cli(int argc, char** argv, const std::map<std::string, Command>& extra) {
  if (argc < 2) {
    std::fputs("strata: error: no command given (try 'strata --help')\n", stderr);
    return 2;
  }
  const std::string cmd = argv[1];
  try {
    if (cmd == "--help" || cmd == "-h" || cmd == "help") {
      std::fputs(top_usage, stdout);
      return 0;
    }
    if (auto it = extra.find(cmd); it != extra.end())
      return it->second(argc, argv);
    if (cmd == "generate")
      return cmd_generate(argc, argv);
    if (cmd == "tokenize")
      return cmd_tokenize(argc, argv);
    if (cmd == "detokenize")
      return cmd_detokenize(argc, argv);
    if (cmd == "info")
      return cmd_info(argc, argv);
    if (cmd == "node")
      return run_node(argc, argv);
    if (cmd == "certs")
      return run_certs(argc, argv);
    if (cmd == "status")
      return run_status(argc, argv);
    if (cmd == "inject")
      return run_inject(argc, argv);
    if (cmd == "delay-proxy")
      return cmd_delay_proxy(argc, argv);
    std::fprintf(stderr, "strata: error: unknown command '%s' (try 'strata --help')\n", cmd.c_str());
    return 2;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "strata %s: error: %s\n", cmd.c_str(), e.what());
    return 2;
  } catch (const model::Error& e) {
    std::fprintf(stderr, "strata %s: error: %s\n", cmd.c_str(), e.what());
    return e.code() == model::errc::bad_argument ? 2 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata %s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
}

} // namespace strata::runtime
