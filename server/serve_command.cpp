// `strata serve`: its options, the connection to the coordinator, then the server.

#include "server/http_server.hpp"

#include "model/base/config.hpp"
#include "model/text/chat_template.hpp"
#include "runtime/args.hpp"
#include "runtime/cluster.hpp"
#include "runtime/log.hpp"
#include "runtime/peers.hpp"

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <mutex>

namespace strata::server {

int run_serve(int argc, char** argv) {
  runtime::Args a;
  a.option("cluster", "HOST:PORT", "the coordinator")
    .option("http", "HOST:PORT", "address for HTTP (default 127.0.0.1:8080; port 0 picks one)")
    .option("tokenizer", "PATH", "tokenizer for the cluster's model (default: the model's own)")
    .option("max-body", "BYTES", "largest request body (default 1048576)")
    .option("request-timeout", "S", "seconds one generation may take (default 300)")
    .option("drain", "S", "seconds in-flight generations get at shutdown (default 10)")
    .option("route-wait-ms", "MS", "how long to wait for a coordinator that went away to come back before "
                                   "generations fail with cluster_lost (default 10000)")
    .option("max-in-flight", "N", "generations at once; more get 429 (default 64)")
    .option("max-connections", "N", "open HTTP connections; more get 503 and are closed (default 256)")
    .option("header-timeout-ms", "MS", "a request's header and body must arrive within this (default 10000)")
    .option("idle-timeout-ms", "MS", "an idle keep-alive connection is closed after this (default 30000)")
    .option("write-timeout-ms", "MS", "a client that takes no bytes of its answer for this long is closed, and its "
                                      "generation ended (default 30000)")
    .option("max-send-buffer", "BYTES", "answer bytes a connection may have waiting for a slow client; past it the "
                                        "client is closed and its generation ended (default 1048576)")
    .option("api-key", "KEY", "require 'Authorization: Bearer KEY' on /v1/* (or env STRATA_API_KEY)")
    .option("allow-inject", "", "enable POST /v1/cluster/inject (kill/freeze/evict nodes; off by default)")
    .option("speculate", "K", "speculative decoding: each step proposes up to K (1-15) tokens, verified in one trip "
                              "through the pipeline; the output is unchanged (default 0: off; 4 with --draft-model; "
                              "requests with penalties or logprobs step one token at a time)")
    .option("draft-model", "PATH", "a small model of the same tokenizer that proposes the tokens (loaded in this "
                                   "process; without it proposals come from prompt lookup)")
    .option("draft-max-sessions", "N", "with --draft-model: while more sessions than N draft at once, they step "
                                       "without it (on one machine a crowd already fills the rounds; raise it "
                                       "across a network; 0: no limit; default 1)")
    .option("served-model-name", "NAME", "the model's id in the API (default: its file or directory name)")
    .option("chat-template", "FILE", "a Jinja chat template (or a tokenizer_config.json) overriding the model's own")
    .option("allow-control-tokens-in-messages", "",
            "let special-token text in chat message contents (e.g. <|im_end|>) become control tokens, as "
            "transformers does; by default it stays text, so a user cannot forge another turn")
    .option("cors-origin", "ORIGIN", "let pages from ORIGIN (e.g. https://app.example) call the API (default: none)")
    .option("insecure", "", "allow a non-loopback HTTP address without authentication");
  runtime::add_network_options(a);
  a.parse(argc, argv, 2);
  if (a.help_requested()) {
    std::cout << "usage: strata serve --cluster HOST:PORT [--http HOST:PORT] [options]\n\n"
              << "Serves the cluster over an OpenAI-compatible HTTP API (/v1/completions,\n"
              << "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /apply-template), with\n"
              << "/health, /metrics (Prometheus) and a chat page at /. Chat prompts are rendered with\n"
              << "the model's own chat template (tokenizer_config.json, chat_template.jinja, GGUF\n"
              << "metadata) or --chat-template.\n"
              << "Stops gracefully on SIGINT/SIGTERM.\n\noptions:\n"
              << a.help_text();
    return 0;
  }
  log::configure_from(a, "serve");
  ServerOptions o;
  const auto http_ep = runtime::parse_endpoint(a.has("http") ? a.str("http") : "127.0.0.1:8080", "http");
  o.host = http_ep.host == "localhost" ? "127.0.0.1" : http_ep.host;
  o.port = http_ep.port;
  o.tokenizer = a.str("tokenizer");
  o.max_body = static_cast<std::size_t>(a.integer("max-body", 1 << 20, 64, int64_t{1} << 30));
  o.request_timeout = std::chrono::seconds(a.integer("request-timeout", 300, 1, 86400));
  o.drain = std::chrono::seconds(a.integer("drain", 10, 0, 3600));
  o.route_wait = std::chrono::milliseconds(a.integer("route-wait-ms", 10000, 1, 600000));
  o.max_in_flight = static_cast<std::size_t>(a.integer("max-in-flight", 64, 1, 100000));
  o.max_connections = static_cast<std::size_t>(a.integer("max-connections", 256, 1, 1000000));
  o.header_timeout = std::chrono::milliseconds(a.integer("header-timeout-ms", 10000, 10, 3600000));
  o.idle_timeout = std::chrono::milliseconds(a.integer("idle-timeout-ms", 30000, 10, 3600000));
  o.write_timeout = std::chrono::milliseconds(a.integer("write-timeout-ms", 30000, 10, 3600000));
  o.max_send_buffer = static_cast<std::size_t>(a.integer("max-send-buffer", 1 << 20, 4096, int64_t{1} << 30));
  const char* env_key = std::getenv("STRATA_API_KEY");
  if (a.has("api-key") && a.str("api-key").empty())
    throw runtime::UsageError("--api-key is empty: give a key, or leave the option out to serve without one");
  if (!a.has("api-key") && env_key && *env_key == '\0')
    throw runtime::UsageError("STRATA_API_KEY is set but empty: give a key, or unset it to serve without one");
  o.api_key = a.has("api-key") ? a.str("api-key") : (env_key ? env_key : "");
  o.allow_inject = a.has("allow-inject");
  o.speculate = static_cast<uint32_t>(a.integer("speculate", a.has("draft-model") ? 4 : 0, 0, msg::max_draft));
  if (a.has("draft-model")) {
    if (o.speculate == 0)
      throw runtime::UsageError("--draft-model with --speculate 0 would never use it");
    o.draft_model = std::shared_ptr<model::Shard>(model::Shard::load(a.str("draft-model")));
  }
  if (a.has("draft-max-sessions") && !a.has("draft-model"))
    throw runtime::UsageError("--draft-max-sessions limits the draft model: give --draft-model too");
  o.draft_max_sessions = static_cast<std::size_t>(a.integer("draft-max-sessions", 1, 0, 1000000));
  o.cors_origin = a.str("cors-origin");
  o.served_model_name = a.str("served-model-name");
  o.chat_template = a.str("chat-template");
  o.control_tokens_in_messages = a.has("allow-control-tokens-in-messages");
  if (a.has("chat-template")) {
    // Checked now: a template the engine cannot run stops serve at start
    // (the model's token names come later, with the model).
    (void)model::ChatTemplate::from_file(o.chat_template, model::ModelConfig{}, nullptr);
  }
  if (!runtime::is_loopback(o.host) && o.api_key.empty() && !a.has("insecure"))
    throw runtime::UsageError("serving HTTP on non-loopback address '" + o.host +
                              "' needs --api-key (and a TLS proxy in front) or an explicit --insecure");
  const auto cluster_ep = runtime::parse_endpoint(a.required("cluster"), "cluster");
  auto& sys = runtime::client_system(runtime::liveness_from(a), runtime::tls_from(a));
  // Like a node, serve waits for its coordinator (start order does not matter).
  msg::supervisor_actor first;
  for (std::string last_error;;) {
    auto c = runtime::try_connect(sys, cluster_ep);
    if (c) {
      first = *c;
      break;
    }
    auto why = sys.render(c.error());
    if (why != last_error)
      log::warn("waiting for the coordinator at " + cluster_ep.host + ":" + std::to_string(cluster_ep.port) + ": " +
                why + " (retrying)");
    last_error = std::move(why);
    caf::scoped_actor pause{sys};
    pause->receive(caf::after(std::chrono::milliseconds(500)) >> [] {});
  }
  runtime::spawn_peer_connector(sys, first); // direct connections to the shard nodes
  auto sup = std::make_shared<msg::supervisor_actor>(first);
  auto sup_mu = std::make_shared<std::mutex>();
  auto current = [sup, sup_mu] {
    std::lock_guard<std::mutex> g(*sup_mu);
    return *sup;
  };
  auto reconnect = [&sys, sup, sup_mu, cluster_ep, wait = o.route_wait]() -> msg::supervisor_actor {
    auto fresh = runtime::reconnect_coordinator(sys, cluster_ep, wait);
    if (fresh) {
      std::lock_guard<std::mutex> g(*sup_mu);
      *sup = fresh;
    }
    return fresh;
  };
  Server server(sys, current, reconnect, o);
  const auto port = server.bind();
  std::printf("ready http %s:%u\n", o.host.c_str(), port);
  std::fflush(stdout);
  server.run();
  log::info("stopped");
  // The drain ended every stream; late replies from the cluster may still be on
  // their way to the server's objects, so they are not torn down: the process ends.
  runtime::end_process(0);
}

} // namespace strata::server
