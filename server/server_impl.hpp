#pragma once
// Internal to server/: what the whole HTTP server shares. Server::Impl owns the io
// loop, the acceptor, the cluster's model as the server knows it, the counters and
// the generations in flight; it is the RequestSink every connection hands its
// requests to, and hands them on to the router (router.cpp).

#include "server/http_server.hpp"
#include "server/openai.hpp"
#include "server/transport.hpp"

#include "actors/drafter.hpp"
#include "model/base/config.hpp"
#include "model/text/chat_template.hpp"
#include "model/text/token_mask.hpp"
#include "model/text/tokenizer.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>

namespace strata::server {

ApiError api_error(int status, std::string message, std::string type, std::string code = "");
/// A 400 naming `field`.
ApiError bad_field(const std::string& field, const std::string& message);
int64_t unix_now();

/// What the server knows of the cluster's model, loaded on first use.
/// The tokenizer's vocabulary for constrained decoding, built on first use
/// (a 150k-token vocabulary takes a moment) and shared by every session.
struct LazyVocabulary {
  std::shared_ptr<model::Tokenizer> tok;
  int64_t model_vocab = 0;
  std::shared_ptr<model::TokenVocabulary> get() {
    std::call_once(once_, [&] { v_ = std::make_shared<model::TokenVocabulary>(*tok, model_vocab); });
    return v_;
  }

private:
  std::once_flag once_;
  std::shared_ptr<model::TokenVocabulary> v_;
};

struct ModelState {
  bool loaded = false;
  std::string id;
  model::ModelConfig cfg;
  std::shared_ptr<model::Tokenizer> tok;
  std::string family;
  std::shared_ptr<const model::ChatTemplate> chat; ///< the model's own template (null: the family's format)
  actors::drafter_actor drafter;                   ///< --draft-model, spawned once the model is known
  std::shared_ptr<LazyVocabulary> vocabulary;      ///< null without a tokenizer
};

class Generation;

struct Server::Impl : RequestSink, std::enable_shared_from_this<Server::Impl> {
  caf::actor_system& sys;
  std::function<msg::supervisor_actor()> supervisor;
  std::function<msg::supervisor_actor()> reconnect;
  ServerOptions opts;
  net::io_context ioc{1};
  tcp::acceptor acceptor{ioc};
  net::signal_set signals{ioc, SIGINT, SIGTERM};
  net::steady_timer drain_timer{ioc};
  net::steady_timer accept_timer{ioc}; // backoff after an accept error (EMFILE, ENFILE, ...)
  std::chrono::milliseconds accept_backoff{0};
  TransportCounters transport;
  std::atomic<uint64_t> accept_errors{0};
  std::string last_accept_error;
  Metrics metrics;
  std::mutex model_mu;
  ModelState model;
  bool draining = false;                            // io thread only
  std::set<std::shared_ptr<Generation>> generating; // io thread only
  std::size_t writing = 0; // while draining: ended generations whose answers are still being written
  std::atomic<std::size_t> in_flight{0};            // places taken in --max-in-flight

  Impl(caf::actor_system& s, std::function<msg::supervisor_actor()> sup, std::function<msg::supervisor_actor()> rc,
       ServerOptions o);

  // RequestSink (router.cpp).
  void on_request(const ConnectionPtr& c, Request req) override;
  void on_unreadable(const ConnectionPtr& c, const ApiError& why) override;

  /// Loads the model's config and tokenizer the first time the cluster has one.
  std::optional<ApiError> ensure_model(ModelState& out);
  /// The model's state, or why there is none or it has no tokenizer.
  std::optional<ApiError> model_with_tokenizer(ModelState& m);
  ClusterSnapshot snapshot();
  /// The drafter's counts (serve --draft-model; /metrics only: it asks the drafter).
  ClusterSnapshot::Draft draft_snapshot();
  TransportLimits limits() const;

  void accept();
  void begin_shutdown();
  /// A generation has ended (it answered, or its client left): drops it from
  /// `generating`, and stops the loop when draining and it was the last.
  void generation_ended(const std::shared_ptr<Generation>& g);
  /// While draining: stops the loop once no generation runs and every ended
  /// one's answer is out (the drain timer bounds the wait).
  void stop_when_written();
};

} // namespace strata::server
