#include "server/router.hpp"

#include "runtime/log.hpp"
#include "server/page.hpp"

#include <array>
#include <thread>

namespace strata::server {

namespace {

// Every path the server answers; anything else is a 404, another method a 405.
constexpr std::array<const char*, 11> known_paths = {"/",
                                                     "/health",
                                                     "/metrics",
                                                     "/v1/models",
                                                     "/v1/cluster",
                                                     "/v1/cluster/inject",
                                                     "/v1/completions",
                                                     "/v1/chat/completions",
                                                     "/tokenize",
                                                     "/detokenize",
                                                     "/apply-template"};

bool known(const std::string& path) {
  for (const char* p : known_paths)
    if (path == p)
      return true;
  return false;
}

bool authorized(const Server::Impl& srv, const Request& req) {
  if (srv.opts.api_key.empty())
    return true;
  return api_key_matches(std::string(req.msg[http::field::authorization]), srv.opts.api_key);
}

void route(Server::Impl& srv, const ConnectionPtr& c, Request& req) {
  const std::string& path = req.path;
  const auto method = req.msg.method();
  Exchange x{path, req.origin, req.keep_alive};
  const auto reply = [&](Reply r) { answer(srv, c, x, std::move(r), x.keep_alive); };
  const auto later = [&](std::function<Reply()> fn) {
    offload(srv, c, x, [fn = std::move(fn)](const std::atomic<bool>&, std::chrono::steady_clock::time_point) {
      return fn();
    });
  };
  auto* s = &srv;

  if (method == http::verb::options) { // CORS preflight
    Reply r{204, "text/plain", "", {}};
    if (!req.origin.empty() && req.origin == srv.opts.cors_origin) {
      r.headers.emplace_back("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
      r.headers.emplace_back("Access-Control-Allow-Headers", "Authorization, Content-Type");
      r.headers.emplace_back("Access-Control-Max-Age", "600");
    }
    return reply(std::move(r));
  }
  if (path == "/" && method == http::verb::get)
    return reply({200, "text/html; charset=utf-8", page_html(), {}});
  if (path == "/health" && method == http::verb::get)
    return later([s] { return health_reply(*s); });
  if (path == "/metrics" && method == http::verb::get)
    return later([s] { return metrics_reply(*s); });
  const bool api =
    path.rfind("/v1/", 0) == 0 || path == "/tokenize" || path == "/detokenize" || path == "/apply-template";
  if (api && !authorized(srv, req))
    return reply(Reply::error(api_error(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                                        "invalid_request_error", "invalid_api_key")));
  if (path == "/v1/models" && method == http::verb::get)
    return later([s] { return models_reply(*s); });
  if (path.rfind("/v1/models/", 0) == 0 && method == http::verb::get)
    return later([s, id = path.substr(std::string("/v1/models/").size())] { return model_reply(*s, id); });
  if (path == "/v1/cluster" && method == http::verb::get)
    return later([s] { return cluster_reply(*s); });
  if (path == "/v1/cluster/inject" && method == http::verb::post) {
    if (!srv.opts.allow_inject)
      return reply(Reply::error(api_error(403,
                                          "failure injection is disabled on this server (start it with "
                                          "--allow-inject)",
                                          "invalid_request_error", "inject_disabled")));
    // JSON only: a form or text/plain body (what a foreign page can send
    // without a preflight) is refused.
    const std::string type(req.msg[http::field::content_type]);
    if (type.substr(0, type.find(';')) != "application/json")
      return reply(Reply::error(api_error(415, "POST /v1/cluster/inject takes 'Content-Type: application/json'",
                                          "invalid_request_error", "unsupported_media_type")));
    return later([s, body = req.msg.body()] { return inject_reply(*s, body); });
  }
  if (path == "/tokenize" && method == http::verb::post)
    return later([s, body = req.msg.body()] { return tokenize_reply(*s, body); });
  if (path == "/detokenize" && method == http::verb::post)
    return later([s, body = req.msg.body()] { return detokenize_reply(*s, body); });
  if (path == "/apply-template" && method == http::verb::post)
    return offload(srv, c, x, [s, body = req.msg.body()](const std::atomic<bool>& gone, auto started) {
      return apply_template_reply(*s, body, gone, started);
    });
  if ((path == "/v1/completions" || path == "/v1/chat/completions") && method == http::verb::post)
    return start_generation(srv, c, x, req.msg.body(), path == "/v1/chat/completions");
  if (known(path))
    return reply(Reply::error(api_error(
      405, "method " + std::string(req.msg.method_string()) + " is not allowed on " + path, "invalid_request_error")));
  x.endpoint = "other";
  return reply(Reply::error(api_error(404, "no such endpoint: " + path, "invalid_request_error")));
}

} // namespace

void add_cors(const Server::Impl& srv, const std::string& origin, Reply& r) {
  if (!origin.empty() && origin == srv.opts.cors_origin) {
    r.headers.emplace_back("Access-Control-Allow-Origin", origin);
    r.headers.emplace_back("Vary", "Origin");
  }
}

void answer(Server::Impl& srv, const ConnectionPtr& c, const Exchange& x, Reply r, bool keep_alive) {
  srv.metrics.request(x.endpoint, r.status);
  if (log::enabled(log::level::info))
    log::info("request - " + x.endpoint + " " + std::to_string(r.status));
  add_cors(srv, x.origin, r);
  c->respond(r, keep_alive && !srv.draining);
}

void offload(Server::Impl& srv, const ConnectionPtr& c, Exchange x, Offloaded fn) {
  auto gone = std::make_shared<std::atomic<bool>>(false);
  c->watch_disconnect([gone](bool) { *gone = true; });
  std::thread([srv = srv.shared_from_this(), c, x = std::move(x), fn = std::move(fn), gone,
               started = std::chrono::steady_clock::now()]() mutable {
    Reply r;
    try {
      r = fn(*gone, started);
    } catch (const std::exception& e) {
      r = Reply::error(api_error(500, e.what(), "server_error"));
    } catch (...) {
      r = Reply::error(api_error(500, "internal error", "server_error"));
    }
    net::post(c->executor(), [srv, c, x = std::move(x), r = std::move(r)] { answer(*srv, c, x, r, x.keep_alive); });
  }).detach();
}

void Server::Impl::on_request(const ConnectionPtr& c, Request req) {
  try {
    route(*this, c, req);
  } catch (const std::exception& e) { // one request's failure is that request's 500, nothing more
    log::error("error handling " + req.path + ": " + e.what());
    answer(*this, c, Exchange{req.path, req.origin, false},
           Reply::error(api_error(500, std::string("internal error: ") + e.what(), "server_error")), false);
  }
}

void Server::Impl::on_unreadable(const ConnectionPtr& c, const ApiError& why) {
  answer(*this, c, Exchange{"other", "", false}, Reply::error(why), false);
}

} // namespace strata::server
