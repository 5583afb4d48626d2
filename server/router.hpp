#pragma once
// Internal to server/: the router maps method + path to a handler (router.cpp),
// after authentication and CORS; the endpoints other than generations answer in
// endpoints.cpp, generations in generation.cpp. Every answer goes out through
// answer(), which counts it, logs it and adds the CORS headers.

#include "server/server_impl.hpp"

#include <string>

namespace strata::server {

/// What the router learnt of a request that its answer needs.
struct Exchange {
  std::string endpoint; ///< the path when it is an endpoint, else "other" (metrics, the request log)
  std::string origin;   ///< the request's Origin header
  bool keep_alive = true;
};

/// CORS: only the configured origin gets the headers that let a page read answers.
void add_cors(const Server::Impl& srv, const std::string& origin, Reply& r);
/// Counts `r` in the metrics, logs the request line, adds CORS and writes it
/// (keep-alive unless `keep_alive` is false or the server is draining).
void answer(Server::Impl& srv, const ConnectionPtr& c, const Exchange& x, Reply r, bool keep_alive);

/// Runs `fn` (which may block on the cluster) on its own thread and answers with
/// its reply on the connection's io thread; an exception is a 500. `fn` is given
/// a flag that becomes true when the client goes away, and the time the request
/// arrived.
using Offloaded = std::function<Reply(const std::atomic<bool>& gone, std::chrono::steady_clock::time_point started)>;
void offload(Server::Impl& srv, const ConnectionPtr& c, Exchange x, Offloaded fn);

// Endpoints (endpoints.cpp); each may block on the cluster, so each runs offloaded.
Reply health_reply(Server::Impl& srv);
Reply metrics_reply(Server::Impl& srv);
Reply models_reply(Server::Impl& srv);
Reply model_reply(Server::Impl& srv, const std::string& id);
Reply cluster_reply(Server::Impl& srv);
Reply inject_reply(Server::Impl& srv, const std::string& body);
Reply tokenize_reply(Server::Impl& srv, const std::string& body);
Reply detokenize_reply(Server::Impl& srv, const std::string& body);
/// Bounded like a generation's render: the request timeout from `started`, and `gone`.
Reply apply_template_reply(Server::Impl& srv, const std::string& body, const std::atomic<bool>& gone,
                           std::chrono::steady_clock::time_point started);
/// 404 model_not_found naming both ids.
ApiError model_not_found(const std::string& asked, const std::string& served);

/// The bounds of a chat template's render for a request that began at
/// `started`: its deadline is the request timeout's, `cancel` ends it early.
model::jinja::RenderLimits render_limits(const Server::Impl& srv, const ModelState& m,
                                         std::chrono::steady_clock::time_point started,
                                         const std::atomic<bool>* cancel);
/// How `req`'s chat becomes a prompt on this server (kwargs, render bounds, plain content).
PromptOptions prompt_options(const Server::Impl& srv, const ModelState& m, const ApiRequest& req,
                             std::chrono::steady_clock::time_point started, const std::atomic<bool>* cancel);

/// POST /v1/completions and /v1/chat/completions (generation.cpp).
void start_generation(Server::Impl& srv, const ConnectionPtr& c, Exchange x, const std::string& body, bool chat);

} // namespace strata::server
