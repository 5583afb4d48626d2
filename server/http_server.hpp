#pragma once
// The OpenAI-compatible HTTP front door (Boost.Beast, HTTP/1.1, asynchronous).
// Each generation request becomes a session actor in the cluster, driven on its
// own thread by actors::run_generation; tokens are posted back to the connection.
//
//   GET  /                      the page for people (prompt box, live route, injections)
//   GET  /v1/models             the cluster's model
//   GET  /v1/models/{id}        that model, or 404 model_not_found
//   POST /tokenize, /detokenize llama-server's shapes: {"content"} -> {"tokens"}, {"tokens"} -> {"content"}
//   POST /v1/completions        text completion, optionally streamed (SSE)
//   POST /v1/chat/completions   chat in the model family's format, optionally streamed
//   GET  /health                200 when a complete route exists, 503 when not
//   GET  /metrics               Prometheus text format
//   GET  /v1/cluster            the route and shards as JSON (for the page)
//   POST /v1/cluster/inject     {"kind": kill|freeze|evict|epoch, "node": ID, ...}
//                               (only with --allow-inject; JSON only; the API key when set)
//
// A client that disconnects cancels its session, which releases its caches on
// every shard. SIGINT/SIGTERM stop accepting, let generations finish for the
// drain period, then end the rest with an error event.

#include "server/metrics.hpp"
#include "model/transformer/shard.hpp"

#include <caf/all.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace strata::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 8080;
  std::size_t max_body = 1 << 20;                  ///< bytes; larger bodies get 413
  std::chrono::seconds request_timeout{300};       ///< per generation
  std::chrono::seconds drain{10};                  ///< graceful shutdown
  std::chrono::milliseconds route_wait{10000};     ///< how long a lost coordinator may take to come back
  std::size_t max_in_flight = 64;                  ///< generations at once; more get 429
  std::size_t max_connections = 256;               ///< open connections; more get 503 and are closed
  std::chrono::milliseconds header_timeout{10000}; ///< a request (header + body) must arrive within this
  std::chrono::milliseconds idle_timeout{30000};   ///< an idle keep-alive connection is closed after this
  std::chrono::milliseconds write_timeout{30000};  ///< a client that takes no bytes for this long is closed
  std::size_t max_send_buffer = 1 << 20;           ///< bytes a connection may have waiting to be written
  std::string tokenizer;                           ///< tokenizer path ("" = the model's default)
  std::string api_key;                             ///< "" = no authentication
  bool allow_inject = false;                       ///< POST /v1/cluster/inject (--allow-inject)
  uint32_t speculate = 0;                          ///< proposals per step (--speculate; 0: off)
  /// The draft model that proposes them (--draft-model; loaded at start; null:
  /// prompt lookup). Its vocabulary must be the cluster's model's.
  std::shared_ptr<model::Shard> draft_model;
  /// More sessions drafting at once than this: they step without the draft
  /// model until fewer do (--draft-max-sessions; 0: no limit).
  std::size_t draft_max_sessions = 1;
  std::string cors_origin;                         ///< the one origin CORS allows ("" = none)
  std::string served_model_name;                   ///< the model's id in the API ("" = file or directory name)
  std::string chat_template;                       ///< a template file overriding the model's own ("" = the model's)
  bool control_tokens_in_messages = false;         ///< special-token text in message contents becomes control tokens
};

class Server {
public:
  /// `supervisor` returns the current route supervisor; `reconnect` (optional)
  /// returns a new one after the coordinator restarted.
  Server(caf::actor_system& sys, std::function<msg::supervisor_actor()> supervisor, std::function<msg::supervisor_actor()> reconnect,
         ServerOptions opts);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  /// Binds; returns the port (useful with port 0). Throws model::Error(io).
  uint16_t bind();
  /// Serves until SIGINT/SIGTERM (or shutdown()) and the drain have ended.
  void run();
  /// Starts a graceful shutdown from any thread.
  void shutdown();

  struct Impl;

private:
  std::shared_ptr<Impl> impl_;
};

/// `strata serve --cluster HOST:PORT --http HOST:PORT ...`
int run_serve(int argc, char** argv);

} // namespace strata::server
