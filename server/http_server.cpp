#include "server/http_server.hpp"

#include "actors/cluster.hpp"
#include "messages/session_id.hpp"
#include "model/base/error.hpp"
#include "model/transformer/sampler.hpp"
#include "runtime/args.hpp"
#include "runtime/cluster.hpp"
#include "runtime/log.hpp"
#include "runtime/peers.hpp"
#include "server/openai.hpp"
#include "server/page.hpp"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <atomic>
#include <csignal>
#include <cstring>
#include <cstdio>
#include <deque>
#include <iostream>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

namespace strata::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using nlohmann::json;
using clk = std::chrono::steady_clock;

namespace {

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// JSON text that never throws: invalid UTF-8 (a sampled model can produce
// any bytes) becomes U+FFFD.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

struct Reply {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers; ///< extra response headers
  static Reply json_body(int status, const json& j) { return {status, "application/json", dump(j)}; }
  static Reply error(const ApiError& e) { return json_body(e.status, e.body()); }
};

ApiError api_error(int status, std::string message, std::string type, std::string code = "") {
  ApiError e;
  e.status = status;
  e.message = std::move(message);
  e.type = std::move(type);
  e.code = std::move(code);
  return e;
}

// What the server knows of the cluster's model, loaded on first use.
struct ModelState {
  bool loaded = false;
  std::string id;
  model::ModelConfig cfg;
  std::shared_ptr<model::Tokenizer> tok;
  std::string family;
  std::shared_ptr<const model::ChatTemplate> chat; ///< the model's own template (null: the family's format)
};

} // namespace

class Connection;

// One request's generations (one per choice, `n`), shared by its connection
// (io thread) and its driver threads.
struct Job {
  std::atomic<bool> cancelled{false};
  std::mutex mu;
  std::vector<msg::session_actor> sessions; // per choice, once started
  std::vector<bool> ended;                  // per choice: cancelled on its own (a stop string)
  void cancel() {
    cancelled = true;
    std::lock_guard<std::mutex> g(mu);
    for (auto& s : sessions)
      if (s)
        caf::anon_send(s, atom::cancel_atom_v);
  }
  void cancel_choice(std::size_t i) {
    std::lock_guard<std::mutex> g(mu);
    if (i < ended.size())
      ended[i] = true;
    if (i < sessions.size() && sessions[i])
      caf::anon_send(sessions[i], atom::cancel_atom_v);
  }
  void started(std::size_t i, msg::session_actor s) {
    std::lock_guard<std::mutex> g(mu);
    if (i >= sessions.size())
      return;
    sessions[i] = s;
    if (cancelled || ended[i])
      caf::anon_send(s, atom::cancel_atom_v);
  }
};

// What one choice of a request has produced so far (io thread).
struct Choice {
  std::optional<model::StreamDecoder> dec;
  std::optional<StopMatcher> stop;
  std::string text;
  json logprobs = json::array(); // per token: {token, logprob, bytes, top_logprobs}
  json pending = json::array();  // the entries a stream has not sent yet
  std::vector<std::size_t> offsets; // completions' text_offset per token
  std::size_t bytes = 0;            // token bytes so far
  int32_t prev = -1;
  const char* finish = nullptr;  // set once the choice has ended
};

struct Server::Impl : std::enable_shared_from_this<Server::Impl> {
  caf::actor_system& sys;
  std::function<msg::supervisor_actor()> supervisor;
  std::function<msg::supervisor_actor()> reconnect;
  ServerOptions opts;
  net::io_context ioc{1};
  tcp::acceptor acceptor{ioc};
  net::signal_set signals{ioc, SIGINT, SIGTERM};
  net::steady_timer drain_timer{ioc};
  net::steady_timer accept_timer{ioc};      // backoff after an accept error (EMFILE, ENFILE, ...)
  std::chrono::milliseconds accept_backoff{0};
  std::atomic<std::size_t> connections{0};  // open connections (a driver thread may drop the last reference)
  std::atomic<uint64_t> accept_errors{0}, timed_out_connections{0};
  std::string last_accept_error;
  Metrics metrics;
  std::mutex model_mu;
  ModelState model;
  bool draining = false;
  std::set<std::shared_ptr<Connection>> generating; // io thread only
  std::atomic<std::size_t> in_flight{0};

  Impl(caf::actor_system& s, std::function<msg::supervisor_actor()> sup, std::function<msg::supervisor_actor()> rc, ServerOptions o)
    : sys(s), supervisor(std::move(sup)), reconnect(std::move(rc)), opts(std::move(o)) {}

  // Loads the model's config and tokenizer the first time the cluster has one.
  std::optional<ApiError> ensure_model(ModelState& out) {
    std::lock_guard<std::mutex> g(model_mu);
    if (!model.loaded) {
      // The model's facts come from the cluster (its shard nodes reported
      // them): this process needs no model files, only a tokenizer.
      msg::model_facts facts;
      try {
        facts = runtime::cluster_model(sys, supervisor());
      } catch (const model::Error& e) {
        return api_error(503, e.code() == model::errc::io ? std::string("the cluster is not reachable: ") + e.what()
                                                          : std::string(e.what()),
                         "server_error", "cluster_unavailable");
      }
      try {
        model.cfg = facts.to_config();
        model.tok = opts.tokenizer.empty() ? std::shared_ptr<model::Tokenizer>(model::default_tokenizer_for(model.cfg))
                                           : std::shared_ptr<model::Tokenizer>(model::Tokenizer::load(opts.tokenizer));
      } catch (const std::exception& e) {
        return api_error(500, std::string("cannot load the tokenizer: ") + e.what(), "server_error");
      }
      if (model.tok && model.tok->vocab_size() > model.cfg.vocab_size)
        return api_error(500, "the tokenizer has " + std::to_string(model.tok->vocab_size()) +
                                " tokens but the cluster's model has a vocabulary of " +
                                std::to_string(model.cfg.vocab_size),
                         "server_error");
      model.id = opts.served_model_name.empty() ? default_served_name(facts.model) : opts.served_model_name;
      model.family = chat_family(model.cfg);
      try {
        if (!opts.chat_template.empty())
          model.chat = std::make_shared<const model::ChatTemplate>(
            model::ChatTemplate::from_file(opts.chat_template, model.cfg, model.tok.get()));
        else if (auto t = model::ChatTemplate::for_model(model.cfg, model.tok.get(), opts.tokenizer))
          model.chat = std::make_shared<const model::ChatTemplate>(std::move(*t));
      } catch (const std::exception& e) {
        return api_error(500, std::string("cannot use the model's chat template: ") + e.what(), "server_error");
      }
      log::info(model.chat ? "chat template: " + model.chat->origin()
                           : "chat template: none found; chat uses the " + model.family + " format");
      model.loaded = true;
    }
    out = model;
    return std::nullopt;
  }

  ClusterSnapshot snapshot() {
    ClusterSnapshot c;
    msg::route_info all;
    try {
      c.shards = runtime::list_shards(sys, supervisor(), all);
      c.reachable = true;
      c.epoch = all.epoch;
      // Complete: the registered ranges cover every layer (the supervisor's own plan).
      caf::scoped_actor self{sys};
      self->request(supervisor(), std::chrono::seconds(5), atom::stats_atom_v)
        .receive([&](msg::route_info& r) { c.route_complete = !r.hops.empty(); }, [](caf::error&) {});
    } catch (const std::exception&) {
      c.reachable = false;
    }
    return c;
  }

  void accept();
  void begin_shutdown();
  void job_ended(const std::shared_ptr<Connection>& c);
};

// ---------------------------------------------------------------- connection

class Connection : public std::enable_shared_from_this<Connection> {
public:
  Connection(tcp::socket s, std::shared_ptr<Server::Impl> srv)
    : sock_(std::move(s)), srv_(std::move(srv)), read_timer_(sock_.get_executor()) {
    ++srv_->connections;
  }
  ~Connection() { --srv_->connections; }

  void start() { read(); }

  // Over the cap on open connections: a clear refusal, then close.
  void refuse() {
    endpoint_ = "other";
    respond(Reply::error(api_error(503,
                                   "too many open connections (limit " + std::to_string(srv_->opts.max_connections) +
                                     "); retry later",
                                   "server_error", "too_many_connections")),
            false);
  }

  // Ends a generation early (drain deadline, request timeout).
  void abort(const ApiError& why) {
    if (!job_ || finished_)
      return;
    job_->cancel();
    srv_->metrics.cancelled();
    if (streaming_) {
      send_event(dump(json{{"error", why.body()["error"]}}));
      finish_stream();
    } else {
      respond(Reply::error(why), false);
      finished_ = true;
    }
  }

private:
  tcp::socket sock_;
  std::shared_ptr<Server::Impl> srv_;
  beast::flat_buffer buf_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::string endpoint_;
  std::string origin_; // the request's Origin header ("" when none)
  bool keep_alive_ = true;
  // generation state (io thread)
  std::shared_ptr<Job> job_;
  ApiRequest req_;
  ModelState model_;
  std::string id_, created_model_;
  int64_t created_ = 0;
  int64_t prompt_tokens_ = 0, completion_tokens_ = 0;
  std::vector<Choice> choices_;
  std::size_t choices_done_ = 0, drivers_left_ = 0;
  std::size_t in_flight_places_ = 1; // places this request holds in --max-in-flight
  bool streaming_ = false, finished_ = false;
  std::atomic<bool> began_{false}; // the driver posted begin_response
  std::string finish_reason_;      // for the request log
  bool generation_pending_log_ = false; // the next logged response ends a generation request
  clk::time_point started_, last_token_;
  std::deque<std::string> out_;
  bool writing_ = false, close_after_write_ = false;
  std::optional<net::steady_timer> timeout_;
  char probe_[1];
  bool probing_ = false;         // the disconnect probe is outstanding
  bool read_after_probe_ = false; // read() waits for the probe to end first
  bool first_request_ = true;
  net::steady_timer read_timer_; // a request must arrive in time (slowloris), an idle keep-alive ends

  void read() {
    if (probing_) {
      // The generation's disconnect probe is still reading: end it first (it may
      // already hold the next request's first byte), then read from its handler.
      read_after_probe_ = true;
      beast::error_code ignored;
      sock_.cancel(ignored);
      return;
    }
    parser_.emplace();
    parser_->body_limit(srv_->opts.max_body);
    parser_->header_limit(16 * 1024);
    // The whole request (header and body) must arrive within the header timeout
    // on a new connection; a keep-alive connection may first idle for the idle timeout.
    read_timer_.expires_after(first_request_ ? srv_->opts.header_timeout : srv_->opts.idle_timeout);
    first_request_ = false;
    read_timer_.async_wait([weak = weak_from_this()](beast::error_code ec) {
      if (ec)
        return; // cancelled: the request arrived
      if (auto self = weak.lock()) {
        ++self->srv_->timed_out_connections;
        self->close();
      }
    });
    http::async_read(sock_, buf_, *parser_, [self = shared_from_this()](beast::error_code ec, std::size_t) {
      self->read_timer_.cancel();
      self->on_read(ec);
    });
  }

  void on_read(beast::error_code ec) {
    if (ec == net::error::operation_aborted)
      return close(); // the read deadline passed
    if (ec == http::error::end_of_stream || ec == net::error::eof || ec == net::error::connection_reset)
      return close();
    if (ec == http::error::body_limit) {
      endpoint_ = "other";
      return respond(Reply::error(api_error(413,
                                            "the request body is larger than the limit of " +
                                              std::to_string(srv_->opts.max_body) + " bytes",
                                            "invalid_request_error", "request_too_large")),
                     false);
    }
    if (ec) {
      endpoint_ = "other";
      return respond(Reply::error(api_error(400, "malformed HTTP request: " + ec.message(), "invalid_request_error")),
                     false);
    }
    auto req = parser_->release();
    keep_alive_ = req.keep_alive();
    origin_ = std::string(req[http::field::origin]);
    try {
      route(req);
    } catch (const std::exception& e) { // one request's failure is that request's 500, nothing more
      log::error("error handling " + endpoint_ + ": " + e.what());
      respond(Reply::error(api_error(500, std::string("internal error: ") + e.what(), "server_error")), false);
    }
  }

  bool authorized(const http::request<http::string_body>& req) {
    if (srv_->opts.api_key.empty())
      return true;
    return api_key_matches(std::string(req[http::field::authorization]), srv_->opts.api_key);
  }

  // CORS: only the configured origin gets the headers that let a page read answers.
  void add_cors(Reply& r) const {
    if (!origin_.empty() && origin_ == srv_->opts.cors_origin) {
      r.headers.emplace_back("Access-Control-Allow-Origin", origin_);
      r.headers.emplace_back("Vary", "Origin");
    }
  }

  void route(http::request<http::string_body>& req) {
    const std::string target(req.target());
    const std::string path = target.substr(0, target.find('?'));
    const auto method = req.method();
    endpoint_ = path;
    if (method == http::verb::options) { // CORS preflight
      Reply r{204, "text/plain", "", {}};
      if (!origin_.empty() && origin_ == srv_->opts.cors_origin) {
        r.headers.emplace_back("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
        r.headers.emplace_back("Access-Control-Allow-Headers", "Authorization, Content-Type");
        r.headers.emplace_back("Access-Control-Max-Age", "600");
      }
      return respond(r, keep_alive_);
    }
    if (path == "/" && method == http::verb::get)
      return respond({200, "text/html; charset=utf-8", page_html()}, keep_alive_);
    if (path == "/health" && method == http::verb::get)
      return offload([srv = srv_] {
        auto c = srv->snapshot();
        json j = {{"status", c.reachable && c.route_complete ? "ok" : "degraded"},
                  {"cluster_reachable", c.reachable},
                  {"route_complete", c.route_complete},
                  {"epoch", c.epoch},
                  {"shards", c.shards.size()},
                  {"connections", srv->connections.load()},
                  {"accept_errors", srv->accept_errors.load()},
                  {"timed_out_connections", srv->timed_out_connections.load()}};
        return Reply::json_body(c.reachable && c.route_complete ? 200 : 503, j);
      });
    if (path == "/metrics" && method == http::verb::get)
      return offload([srv = srv_] {
        return Reply{200, "text/plain; version=0.0.4; charset=utf-8", srv->metrics.render(srv->snapshot())};
      });
    const bool api = path.rfind("/v1/", 0) == 0 || path == "/tokenize" || path == "/detokenize" || path == "/apply-template";
    if (api && !authorized(req))
      return respond(Reply::error(api_error(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                                            "invalid_request_error", "invalid_api_key")),
                     keep_alive_);
    if (path == "/v1/models" && method == http::verb::get)
      return offload([srv = srv_] {
        ModelState m;
        if (auto e = srv->ensure_model(m))
          return Reply::error(*e);
        return Reply::json_body(200, json{{"object", "list"}, {"data", json::array({model_json(m)})}});
      });
    if (path.rfind("/v1/models/", 0) == 0 && method == http::verb::get)
      return offload([srv = srv_, id = path.substr(std::string("/v1/models/").size())] {
        ModelState m;
        if (auto e = srv->ensure_model(m))
          return Reply::error(*e);
        if (id != m.id)
          return Reply::error(model_not_found(id, m.id));
        return Reply::json_body(200, model_json(m));
      });
    if (path == "/v1/cluster" && method == http::verb::get)
      return offload([srv = srv_] { return cluster_json(*srv); });
    if (path == "/v1/cluster/inject" && method == http::verb::post) {
      if (!srv_->opts.allow_inject)
        return respond(Reply::error(api_error(403, "failure injection is disabled on this server (start it with "
                                                   "--allow-inject)",
                                              "invalid_request_error", "inject_disabled")),
                       keep_alive_);
      // JSON only: a form or text/plain body (what a foreign page can send
      // without a preflight) is refused.
      const std::string type(req[http::field::content_type]);
      if (type.substr(0, type.find(';')) != "application/json")
        return respond(Reply::error(api_error(415, "POST /v1/cluster/inject takes 'Content-Type: application/json'",
                                              "invalid_request_error", "unsupported_media_type")),
                       keep_alive_);
      return offload([srv = srv_, body = req.body()] { return inject(*srv, body); });
    }
    if ((path == "/tokenize" || path == "/detokenize") && method == http::verb::post)
      return offload([srv = srv_, body = req.body(), tokenize = path == "/tokenize"] {
        return tokenize ? tokenize_reply(*srv, body) : detokenize_reply(*srv, body);
      });
    if (path == "/apply-template" && method == http::verb::post)
      return offload([srv = srv_, body = req.body()] { return apply_template_reply(*srv, body); });
    if ((path == "/v1/completions" || path == "/v1/chat/completions") && method == http::verb::post)
      return start_generation(req.body(), path == "/v1/chat/completions");
    const bool known = path == "/" || path == "/health" || path == "/metrics" || path == "/v1/models" ||
                       path == "/v1/cluster" || path == "/v1/cluster/inject" || path == "/v1/completions" ||
                       path == "/v1/chat/completions" || path == "/tokenize" || path == "/detokenize" ||
                       path == "/apply-template";
    endpoint_ = known ? path : "other";
    if (known)
      return respond(Reply::error(api_error(405, "method " + std::string(req.method_string()) + " is not allowed on " + path,
                                            "invalid_request_error")),
                     keep_alive_);
    return respond(Reply::error(api_error(404, "no such endpoint: " + path, "invalid_request_error")), keep_alive_);
  }

  // The model's state, or why there is none or it has no tokenizer.
  static std::optional<ApiError> model_with_tokenizer(Server::Impl& srv, ModelState& m) {
    if (auto e = srv.ensure_model(m))
      return e;
    if (!m.tok)
      return api_error(500, "the server has no tokenizer for " + m.id + " (start it with --tokenizer)", "server_error");
    return std::nullopt;
  }

  // llama-server's shapes: {"content", "add_special", "with_pieces"} -> {"tokens"}.
  static Reply tokenize_reply(Server::Impl& srv, const std::string& body) {
    json j = json::parse(body, nullptr, false);
    if (!j.is_object() || !j.contains("content") || !j["content"].is_string())
      return Reply::error(bad_field("content", "'content' (a string) is required"));
    for (const char* flag : {"add_special", "with_pieces"})
      if (j.contains(flag) && !j[flag].is_boolean())
        return Reply::error(bad_field(flag, std::string("'") + flag + "' must be a boolean"));
    ModelState m;
    if (auto e = model_with_tokenizer(srv, m))
      return Reply::error(*e);
    const bool special = j.value("add_special", false) && m.cfg.bos_id >= 0 && m.tok->bos_id() == m.cfg.bos_id;
    std::vector<int32_t> ids;
    try {
      ids = m.tok->encode(j["content"].get<std::string>(), special);
    } catch (const std::exception& e) {
      return Reply::error(bad_field("content", std::string("cannot encode 'content': ") + e.what()));
    }
    json tokens = json::array();
    int32_t prev = -1;
    for (auto id : ids) {
      if (j.value("with_pieces", false))
        tokens.push_back({{"id", id}, {"piece", m.tok->token_bytes(id, prev)}});
      else
        tokens.push_back(id);
      prev = id;
    }
    return Reply::json_body(200, json{{"tokens", tokens}});
  }

  // llama-server's shape: a chat body ({"messages", ...}) -> {"prompt": the text
  // /v1/chat/completions would feed the model}.
  static Reply apply_template_reply(Server::Impl& srv, const std::string& body) {
    auto r = parse_request(body, true);
    if (auto* e = std::get_if<ApiError>(&r))
      return Reply::error(*e);
    const auto& req = std::get<ApiRequest>(r);
    ModelState m;
    if (auto e = model_with_tokenizer(srv, m))
      return Reply::error(*e);
    try {
      auto p = chat_prompt(req.messages, m.chat.get(), m.family, *m.tok, m.cfg, req.template_kwargs);
      if (auto* e = std::get_if<ApiError>(&p))
        return Reply::error(*e);
      return Reply::json_body(200, json{{"prompt", std::get<ChatPrompt>(p).text}});
    } catch (const std::exception& e) {
      return Reply::error(bad_field("messages", std::string("cannot render the chat: ") + e.what()));
    }
  }

  // {"tokens": [ids]} -> {"content"}.
  static Reply detokenize_reply(Server::Impl& srv, const std::string& body) {
    json j = json::parse(body, nullptr, false);
    if (!j.is_object() || !j.contains("tokens") || !j["tokens"].is_array())
      return Reply::error(bad_field("tokens", "'tokens' (an array of token ids) is required"));
    ModelState m;
    if (auto e = model_with_tokenizer(srv, m))
      return Reply::error(*e);
    std::vector<int32_t> ids;
    for (auto& x : j["tokens"]) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= m.tok->vocab_size())
        return Reply::error(bad_field("tokens", "'tokens' must hold ids in [0, " + std::to_string(m.tok->vocab_size()) +
                                                  "), not " + x.dump()));
      ids.push_back(static_cast<int32_t>(x.get<int64_t>()));
    }
    return Reply::json_body(200, json{{"content", m.tok->decode(ids)}});
  }

  static ApiError bad_field(const std::string& field, const std::string& message) {
    auto e = api_error(400, message, "invalid_request_error");
    e.param = field;
    return e;
  }

  static json model_json(const ModelState& m) {
    return {{"id", m.id}, {"object", "model"}, {"created", 0}, {"owned_by", "strata"},
            {"context_length", m.cfg.max_seq_len}};
  }

  static ApiError model_not_found(const std::string& asked, const std::string& served) {
    auto e = api_error(404, "The model '" + asked + "' does not exist; this server serves '" + served + "'",
                       "invalid_request_error", "model_not_found");
    e.param = "model";
    return e;
  }

  static Reply cluster_json(Server::Impl& srv) {
    auto c = srv.snapshot();
    json shards = json::array();
    for (std::size_t i = 0; i < c.shards.size(); ++i) {
      auto& v = c.shards[i];
      json misses = json::object();
      uint64_t total = 0;
      for (std::size_t r = 1; r < v.stats.misses.size() && r < msg::miss_reason_count; ++r) {
        misses[msg::to_string(static_cast<msg::miss_reason>(r))] = v.stats.misses[r];
        total += v.stats.misses[r];
      }
      shards.push_back({{"index", i},
                        {"node", caf::to_string(v.hop.shard.node())},
                        {"first", v.hop.first},
                        {"last", v.hop.last},
                        {"up", v.answered},
                        {"cache_bytes", v.stats.cache_bytes},
                        {"sessions", v.stats.sessions},
                        {"hits", v.stats.hits},
                        {"misses", misses},
                        {"recoveries", total}});
    }
    return Reply::json_body(200, json{{"reachable", c.reachable},
                                      {"epoch", c.epoch},
                                      {"route_complete", c.route_complete},
                                      {"inject", srv.opts.allow_inject},
                                      {"shards", shards}});
  }

  static Reply inject(Server::Impl& srv, const std::string& body) {
    json j = json::parse(body, nullptr, false);
    if (j.is_discarded() || !j.is_object())
      return Reply::error(api_error(400, "the request body must be a JSON object", "invalid_request_error"));
    if (!j.contains("kind") || !j["kind"].is_string())
      return Reply::error(api_error(400, "'kind' (kill, freeze, evict or epoch) is required", "invalid_request_error"));
    const std::string kind = j["kind"].get<std::string>();
    std::string node;
    if (j.contains("node")) {
      if (j["node"].is_number_integer())
        node = std::to_string(j["node"].get<int64_t>());
      else if (j["node"].is_string())
        node = j["node"].get<std::string>();
      else
        return Reply::error(api_error(400, "'node' must be an index or a node id", "invalid_request_error"));
    } else if (kind != "epoch") {
      return Reply::error(api_error(400, "'" + kind + "' needs 'node'", "invalid_request_error"));
    }
    const std::string session = j.contains("session") && j["session"].is_string() ? j["session"].get<std::string>() : "";
    const int64_t seconds = j.contains("seconds") && j["seconds"].is_number_integer() ? j["seconds"].get<int64_t>() : 3;
    try {
      return Reply::json_body(200, json{{"done", runtime::inject_node(srv.sys, srv.supervisor(), kind, node, session, seconds)}});
    } catch (const model::Error& e) {
      return Reply::error(api_error(e.code() == model::errc::bad_argument ? 400 : 502, e.what(), "invalid_request_error"));
    }
  }

  // Runs `fn` (which may block on the cluster) off the io thread; answers with its reply.
  template <class F>
  void offload(F fn) {
    std::thread([self = shared_from_this(), fn = std::move(fn)]() mutable {
      Reply r;
      try {
        r = fn();
      } catch (const std::exception& e) {
        r = Reply::error(api_error(500, e.what(), "server_error"));
      } catch (...) {
        r = Reply::error(api_error(500, "internal error", "server_error"));
      }
      net::post(self->sock_.get_executor(), [self, r = std::move(r)] { self->respond(r, self->keep_alive_); });
    }).detach();
  }

  // One line per request: id, endpoint, status, tokens, time, finish reason.
  void log_request(int status) {
    if (!log::enabled(log::level::info))
      return;
    const bool generation = generation_pending_log_;
    generation_pending_log_ = false;
    const double ms =
      generation ? std::chrono::duration<double, std::milli>(clk::now() - started_).count() : 0.0;
    char t[32];
    std::snprintf(t, sizeof t, "%.1f", ms);
    log::info("request " + (id_.empty() ? std::string("-") : id_) + " " + endpoint_ + " " + std::to_string(status) +
              (generation ? " prompt_tokens=" + std::to_string(prompt_tokens_) + " generated_tokens=" +
                              std::to_string(completion_tokens_) + " ms=" + t + " finish=" +
                              (finish_reason_.empty() ? "-" : finish_reason_)
                          : ""));
  }

  void respond(Reply r, bool keep_alive) {
    srv_->metrics.request(endpoint_, r.status);
    log_request(r.status);
    add_cors(r);
    auto res = std::make_shared<http::response<http::string_body>>(static_cast<http::status>(r.status), 11);
    res->set(http::field::server, "strata");
    res->set(http::field::content_type, r.content_type);
    for (auto& [k, v] : r.headers)
      res->set(k, v);
    res->keep_alive(keep_alive && !srv_->draining);
    res->body() = r.body;
    res->prepare_payload();
    http::async_write(sock_, *res, [self = shared_from_this(), res](beast::error_code ec, std::size_t) {
      if (ec || !res->keep_alive())
        return self->close();
      self->read();
    });
  }

  void close() {
    beast::error_code ec;
    sock_.shutdown(tcp::socket::shutdown_send, ec);
    sock_.close(ec);
  }

  // ------------------------------------------------------------ generation

  void start_generation(const std::string& body, bool chat) {
    auto parsed = parse_request(body, chat);
    if (auto* e = std::get_if<ApiError>(&parsed))
      return respond(Reply::error(*e), keep_alive_);
    req_ = std::get<ApiRequest>(std::move(parsed));
    if (srv_->draining)
      return respond(Reply::error(api_error(503, "the server is shutting down", "server_error")), false);
    // Each choice is a generation: a request with n choices takes n places.
    const auto places = static_cast<std::size_t>(req_.n);
    if (places > srv_->opts.max_in_flight) {
      auto e = api_error(400, "'n' = " + std::to_string(places) + " is more than the server's --max-in-flight of " +
                                std::to_string(srv_->opts.max_in_flight), "invalid_request_error");
      e.param = "n";
      return respond(Reply::error(e), keep_alive_);
    }
    if (srv_->in_flight.load() + places > srv_->opts.max_in_flight)
      return respond(Reply::error(api_error(429,
                                            "too many generations in flight (limit " +
                                              std::to_string(srv_->opts.max_in_flight) + "); retry later",
                                            "rate_limit_exceeded")),
                     keep_alive_);
    srv_->in_flight += places;
    in_flight_places_ = places;
    srv_->metrics.in_flight(static_cast<int>(places));
    // A keep-alive connection carries one generation after another: start clean.
    finished_ = streaming_ = close_after_write_ = false;
    began_ = false;
    finish_reason_.clear();
    id_.clear();
    generation_pending_log_ = true;
    choices_.clear();
    choices_done_ = drivers_left_ = 0;
    prompt_tokens_ = completion_tokens_ = 0;
    timeout_.reset();
    job_ = std::make_shared<Job>();
    srv_->generating.insert(shared_from_this());
    started_ = clk::now();
    // Tokenizing and the context check need the model: off the io thread.
    std::thread([self = shared_from_this()] { self->prepare_and_run(); }).detach();
  }

  // Driver thread: nothing may escape it (an exception here would end the process).
  void prepare_and_run() {
    try {
      prepare_and_generate();
    } catch (const std::exception& e) {
      fail_from_driver(std::string("internal error: ") + e.what());
    } catch (...) {
      fail_from_driver("internal error");
    }
  }

  void fail_from_driver(const std::string& why) {
    log::error("generation failed: " + why);
    net::post(sock_.get_executor(), [self = shared_from_this(), why, began = began_.load()] {
      if (began)
        self->on_done(0, {}, why);
      else
        self->fail_before_start(api_error(500, why, "server_error"));
    });
  }

  void prepare_and_generate() {
    ModelState m;
    std::vector<int32_t> prompt;
    std::optional<ApiError> err = srv_->ensure_model(m);
    int64_t max_tokens = 0;
    if (!err && !req_.model.empty() && req_.model != m.id)
      err = model_not_found(req_.model, m.id);
    if (!err && !m.tok && !(req_.prompt_is_ids && !req_.chat))
      err = api_error(500, "the server has no tokenizer for " + m.id + " (start it with --tokenizer)", "server_error");
    if (!err) {
      try {
        if (req_.chat) {
          auto p = chat_prompt(req_.messages, m.chat.get(), m.family, *m.tok, m.cfg, req_.template_kwargs);
          if (auto* e = std::get_if<ApiError>(&p))
            err = *e;
          else
            prompt = std::move(std::get<ChatPrompt>(p).ids);
        } else if (req_.prompt_is_ids)
          prompt = req_.prompt_ids;
        else
          prompt = m.tok->encode(req_.prompt, m.cfg.bos_id >= 0 && m.tok->bos_id() == m.cfg.bos_id);
      } catch (const std::exception& e) {
        err = api_error(400, std::string("cannot encode the prompt: ") + e.what(), "invalid_request_error");
      }
    }
    if (!err && prompt.empty())
      err = api_error(400, "the prompt encodes to no tokens", "invalid_request_error");
    if (!err)
      for (auto id : prompt)
        if (id < 0 || id >= m.cfg.vocab_size) {
          err = api_error(400, "prompt token id " + std::to_string(id) + " is outside the vocabulary of " +
                                 std::to_string(m.cfg.vocab_size),
                          "invalid_request_error");
          break;
        }
    if (!err) {
      const auto n = static_cast<int64_t>(prompt.size());
      max_tokens = req_.max_tokens ? *req_.max_tokens : (req_.chat ? std::max<int64_t>(m.cfg.max_seq_len - n, 0) : 16);
      err = check_context(n, max_tokens, m.cfg.max_seq_len);
      if (!err && max_tokens < 1)
        err = check_context(n, 1, m.cfg.max_seq_len);
    }
    if (err) {
      net::post(sock_.get_executor(), [self = shared_from_this(), e = *err] { self->fail_before_start(e); });
      return;
    }
    msg::generation_request g;
    g.session = msg::mint_session_id("http");
    g.prompt = prompt;
    g.max_tokens = max_tokens;
    g.stop_ids = req_.chat && m.tok ? chat_stop_ids(m.family, *m.tok, m.cfg, m.chat.get()) : m.cfg.eos_ids;
    model::SamplingParams sp;
    sp.temperature = req_.temperature;
    sp.top_p = req_.top_p;
    sp.top_k = req_.top_k;
    sp.min_p = req_.min_p;
    const uint64_t seed = req_.seed ? *req_.seed : std::random_device{}();
    actors::SessionOptions so;
    so.max_context = m.cfg.max_seq_len;
    const auto n = static_cast<std::size_t>(req_.n);
    {
      std::lock_guard<std::mutex> lk(job_->mu);
      job_->sessions.assign(n, {});
      job_->ended.assign(n, false);
    }
    began_ = true;
    net::post(sock_.get_executor(), [self = shared_from_this(), m, np = static_cast<int64_t>(prompt.size())] {
      self->begin_response(m, np);
    });
    // One session per choice, each on its own thread (they block on the
    // cluster); choice i samples with seed + i, so a seeded request repeats.
    const auto run_choice = [&](std::size_t i) {
      std::string error;
      msg::generation_result result;
      bool no_route = false;
      try {
        msg::generation_request gi = g;
        gi.session = i == 0 ? g.session : msg::mint_session_id("http");
        model::SamplingParams spi = sp;
        spi.seed = seed + i;
        gi.sampling = {sp.temperature, sp.top_k, sp.top_p, model::Sampler(spi).state(), sp.min_p};
        gi.sampling.presence_penalty = req_.presence_penalty;
        gi.sampling.frequency_penalty = req_.frequency_penalty;
        gi.sampling.repetition_penalty = req_.repetition_penalty;
        gi.sampling.logprobs = req_.logprobs;
        auto job = job_;
        auto out = actors::run_generation(
          srv_->sys, srv_->supervisor(), gi, so, {}, {},
          [self = shared_from_this(), i](const msg::token_event& ev) {
            net::post(self->sock_.get_executor(), [self, i, ev] { self->on_token(i, ev); });
          },
          srv_->reconnect, [job, i](msg::session_actor s) { job->started(i, s); });
        no_route = out.error == ec::no_route;
        if (!out.ok())
          error = srv_->sys.render(out.error);
        else
          srv_->metrics.generation(out.result);
        result = std::move(out.result);
      } catch (const std::exception& e) {
        error = std::string("internal error: ") + e.what();
      } catch (...) {
        error = "internal error";
      }
      net::post(sock_.get_executor(), [self = shared_from_this(), i, r = std::move(result), error, no_route] {
        if (no_route) // no complete route within the coordinator's --route-wait-ms: the cluster is unavailable
          self->on_done(i, r, error,
                        api_error(503, "no complete route covers the model's layers: " + error, "server_error",
                                  "no_route"));
        else
          self->on_done(i, r, error);
      });
    };
    std::vector<std::thread> others;
    for (std::size_t i = 1; i < n; ++i)
      others.emplace_back(run_choice, i);
    run_choice(0);
    for (auto& t : others)
      t.join();
  }

  // The client went away mid-generation: end its session (which frees its caches).
  void client_gone() {
    job_->cancel();
    srv_->metrics.cancelled();
    finished_ = true;
  }

  void fail_before_start(const ApiError& e) {
    end_job();
    respond(Reply::error(e), keep_alive_);
  }

  void end_job() {
    if (!job_)
      return;
    srv_->in_flight -= in_flight_places_;
    srv_->metrics.in_flight(-static_cast<int>(in_flight_places_));
    srv_->job_ended(shared_from_this());
  }

  json usage() const {
    return {{"prompt_tokens", prompt_tokens_},
            {"completion_tokens", completion_tokens_},
            {"total_tokens", prompt_tokens_ + completion_tokens_}};
  }

  // OpenAI's logprobs object for `entries` (chat: {content}; completions: the
  // legacy parallel lists).
  json logprobs_json(const json& entries, const Choice& c, std::size_t first) const {
    if (req_.chat)
      return {{"content", entries}, {"refusal", nullptr}};
    json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
    for (std::size_t k = 0; k < entries.size(); ++k) {
      const auto& e = entries[k];
      tokens.push_back(e["token"]);
      lps.push_back(e["logprob"]);
      json top = json::object();
      for (auto& t : e["top_logprobs"])
        top[t["token"].get<std::string>()] = t["logprob"];
      tops.push_back(top);
      offsets.push_back(first + k < c.offsets.size() ? c.offsets[first + k] : 0);
    }
    return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
  }

  json chunk(std::size_t i, const std::string& piece, const char* finish, bool role = false) {
    auto& c = choices_[i];
    json choice = {{"index", i}, {"finish_reason", finish ? json(finish) : json(nullptr)}};
    json lp = nullptr;
    if (req_.logprobs >= 0 && (!c.pending.empty() || finish)) {
      lp = logprobs_json(c.pending, c, c.logprobs.size() - c.pending.size());
      c.pending = json::array();
    }
    if (req_.chat) {
      json delta = json::object();
      if (role)
        delta["role"] = "assistant";
      if (!piece.empty() || role)
        delta["content"] = piece;
      choice["delta"] = delta;
    } else {
      choice["text"] = piece;
    }
    choice["logprobs"] = lp;
    return envelope(req_.chat ? "chat.completion.chunk" : "text_completion", json::array({choice}));
  }

  // What every response and stream event carries around its choices.
  json envelope(const char* object, json choices) const {
    return {{"id", id_}, {"object", object}, {"created", created_}, {"model", created_model_}, {"choices", choices}};
  }

  void begin_response(const ModelState& m, int64_t prompt_tokens) {
    model_ = m;
    prompt_tokens_ = prompt_tokens;
    srv_->metrics.prompt_tokens(static_cast<uint64_t>(prompt_tokens));
    id_ = make_id(req_.chat ? "chatcmpl-" : "cmpl-");
    created_ = unix_now();
    created_model_ = m.id; // the served name, never whatever the client sent
    choices_.clear();
    choices_.resize(static_cast<std::size_t>(req_.n));
    for (auto& c : choices_) {
      if (m.tok)
        c.dec.emplace(*m.tok);
      c.stop.emplace(req_.stop);
    }
    drivers_left_ = choices_.size();
    last_token_ = started_;
    timeout_.emplace(sock_.get_executor());
    timeout_->expires_after(srv_->opts.request_timeout);
    timeout_->async_wait([self = shared_from_this()](beast::error_code ec) {
      if (!ec)
        self->abort(api_error(504, "the generation did not finish within the request timeout of " +
                                     std::to_string(self->srv_->opts.request_timeout.count()) + " s",
                              "server_error", "timeout"));
    });
    // A client that goes away cancels its session (it sends nothing more on this request).
    probing_ = true;
    sock_.async_read_some(net::buffer(probe_), [self = shared_from_this()](beast::error_code ec, std::size_t n) {
      self->probing_ = false;
      if (!ec && n == 1) { // the client's next request began: keep its first byte for the parser
        auto b = self->buf_.prepare(1);
        std::memcpy(b.data(), self->probe_, 1);
        self->buf_.commit(1);
      }
      if (self->read_after_probe_) { // the response is out: read the next request
        self->read_after_probe_ = false;
        return self->read();
      }
      if (ec && ec != net::error::operation_aborted && !self->finished_) {
        self->client_gone();
        self->srv_->metrics.request(self->endpoint_, 499);
      }
    });
    if (req_.stream) {
      streaming_ = true;
      srv_->metrics.request(endpoint_, 200);
      Reply head;
      add_cors(head);
      std::string extra;
      for (auto& [k, v] : head.headers)
        extra += k + ": " + v + "\r\n";
      out_.push_back("HTTP/1.1 200 OK\r\nServer: strata\r\nContent-Type: text/event-stream\r\nCache-Control: "
                     "no-cache\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n" +
                     extra + "\r\n");
      flush();
      if (req_.chat)
        for (std::size_t i = 0; i < choices_.size(); ++i)
          send_event(dump(chunk(i, "", nullptr, true)));
    }
  }

  void on_token(std::size_t i, const msg::token_event& ev) {
    if (finished_ || i >= choices_.size() || choices_[i].finish)
      return;
    auto& c = choices_[i];
    const auto now = clk::now();
    srv_->metrics.token(std::chrono::duration<double>(now - last_token_).count(), completion_tokens_ == 0);
    last_token_ = now;
    ++completion_tokens_;
    if (req_.logprobs >= 0 && model_.tok) {
      const auto entry = [&](int32_t id, float lp) {
        std::string t;
        try {
          t = model_.tok->token_bytes(id, c.prev);
        } catch (const std::exception&) {
        }
        json bytes = json::array();
        for (unsigned char b : t)
          bytes.push_back(b);
        return json{{"token", t}, {"logprob", lp}, {"bytes", bytes}};
      };
      json e = entry(ev.token, ev.logprob);
      json top = json::array();
      for (std::size_t k = 0; k < ev.top_ids.size() && k < ev.top_logprobs.size(); ++k)
        top.push_back(entry(ev.top_ids[k], ev.top_logprobs[k]));
      e["top_logprobs"] = top;
      c.offsets.push_back(c.bytes);
      c.bytes += e["bytes"].size();
      c.logprobs.push_back(e);
      c.pending.push_back(std::move(e));
    }
    c.prev = ev.token;
    std::string piece = c.dec ? c.dec->push(ev.token) : std::to_string(ev.token) + " ";
    piece = c.stop->push(piece);
    emit(i, piece);
    if (c.stop->stopped()) {
      job_->cancel_choice(i); // frees the caches now; on_done then sees the cancel
      end_choice(i, "stop");
    }
  }

  void emit(std::size_t i, const std::string& piece) {
    if (piece.empty())
      return; // (logprobs of held-back text go out with the next piece)
    choices_[i].text += piece;
    if (streaming_)
      send_event(dump(chunk(i, piece, nullptr)));
  }

  void on_done(std::size_t i, const msg::generation_result& r, const std::string& error,
               std::optional<ApiError> why = std::nullopt) {
    const bool last = drivers_left_ > 0 && --drivers_left_ == 0;
    if (finished_) {
      if (last)
        end_job();
      return;
    }
    if (!error.empty()) {
      job_->cancel(); // the other choices end too
      if (last)
        end_job();
      const auto e =
        why ? *why : api_error(502, "the generation failed in the cluster: " + error, "server_error", "cluster_error");
      if (streaming_) {
        send_event(dump(json{{"error", e.body()["error"]}}));
        return finish_stream();
      }
      finished_ = true;
      return respond(Reply::error(e), false);
    }
    if (last)
      end_job();
    if (i >= choices_.size() || choices_[i].finish)
      return;
    auto& c = choices_[i];
    if (c.dec)
      emit(i, c.stop->push(c.dec->finish()));
    if (!c.stop->stopped())
      emit(i, c.stop->flush());
    end_choice(i, c.stop->stopped() || r.finish == "stop" ? "stop" : "length");
  }

  // One choice has ended; the response completes when all have.
  void end_choice(std::size_t i, const char* finish) {
    auto& c = choices_[i];
    if (c.finish || finished_)
      return;
    c.finish = finish;
    if (streaming_)
      send_event(dump(chunk(i, "", finish)));
    if (++choices_done_ == choices_.size())
      complete();
  }

  void complete() {
    if (finished_)
      return;
    finish_reason_ = choices_.empty() || !choices_[0].finish ? "stop" : choices_[0].finish;
    if (timeout_)
      timeout_->cancel();
    if (streaming_) {
      if (req_.include_usage) {
        json u = envelope(req_.chat ? "chat.completion.chunk" : "text_completion", json::array());
        u["usage"] = usage();
        send_event(dump(u));
      }
      return finish_stream();
    }
    finished_ = true;
    json list = json::array();
    for (std::size_t i = 0; i < choices_.size(); ++i) {
      const auto& c = choices_[i];
      json choice = {{"index", i}, {"finish_reason", c.finish ? c.finish : "stop"}};
      const json lp = req_.logprobs >= 0 ? logprobs_json(c.logprobs, c, 0) : json(nullptr);
      if (req_.chat)
        choice["message"] = {{"role", "assistant"}, {"content", c.text}};
      else
        choice["text"] = c.text;
      choice["logprobs"] = lp;
      list.push_back(std::move(choice));
    }
    json body = envelope(req_.chat ? "chat.completion" : "text_completion", std::move(list));
    body["usage"] = usage();
    respond(Reply::json_body(200, body), keep_alive_);
  }

  void send_event(const std::string& data) {
    std::string ev = "data: " + data + "\n\n";
    char len[32];
    std::snprintf(len, sizeof len, "%zx\r\n", ev.size());
    out_.push_back(len + ev + "\r\n");
    flush();
  }

  void finish_stream() {
    if (finished_ && !streaming_)
      return;
    if (finish_reason_.empty())
      finish_reason_ = "error";
    log_request(200);
    if (timeout_)
      timeout_->cancel();
    send_event("[DONE]");
    out_.push_back("0\r\n\r\n");
    finished_ = true;
    streaming_ = false;
    close_after_write_ = true;
    flush();
  }

  void flush() {
    if (writing_ || out_.empty())
      return;
    writing_ = true;
    net::async_write(sock_, net::buffer(out_.front()), [self = shared_from_this()](beast::error_code ec, std::size_t) {
      self->writing_ = false;
      self->out_.pop_front();
      if (ec) {
        self->out_.clear();
        if (!self->finished_)
          self->client_gone();
        return self->close();
      }
      if (!self->out_.empty())
        return self->flush();
      if (self->close_after_write_)
        self->close();
    });
  }

  friend struct Server::Impl;
};

void Server::Impl::accept() {
  acceptor.async_accept([self = shared_from_this()](beast::error_code ec, tcp::socket s) {
    if (ec == net::error::operation_aborted || !self->acceptor.is_open())
      return; // closed for shutdown
    if (ec) {
      // Out of file descriptors (EMFILE, ENFILE) or another transient failure:
      // say so once, back off (doubling up to 1 s), and accept again.
      self->accept_backoff = std::min(std::max(self->accept_backoff * 2, std::chrono::milliseconds(10)),
                                      std::chrono::milliseconds(1000));
      if (ec.message() != self->last_accept_error)
        log::warn("accept failed: " + ec.message() + " (retrying in " + std::to_string(self->accept_backoff.count()) +
                  " ms)");
      self->last_accept_error = ec.message();
      ++self->accept_errors;
      self->accept_timer.expires_after(self->accept_backoff);
      self->accept_timer.async_wait([self](beast::error_code e) {
        if (!e)
          self->accept();
      });
      return;
    }
    self->accept_backoff = std::chrono::milliseconds(0);
    self->last_accept_error.clear();
    auto c = std::make_shared<Connection>(std::move(s), self);
    if (self->connections > self->opts.max_connections)
      c->refuse();
    else
      c->start();
    self->accept();
  });
}

void Server::Impl::job_ended(const std::shared_ptr<Connection>& c) {
  generating.erase(c);
  if (draining && generating.empty()) {
    drain_timer.cancel();
    // Let the last writes go out, then stop.
    net::post(ioc, [self = shared_from_this()] { self->ioc.stop(); });
  }
}

void Server::Impl::begin_shutdown() {
  if (draining)
    return;
  draining = true;
  beast::error_code ec;
  acceptor.close(ec);
  accept_timer.cancel();
  log::info("shutting down: " + std::to_string(generating.size()) + " generation(s) in flight, waiting up to " +
            std::to_string(opts.drain.count()) + " s");
  if (generating.empty()) {
    net::post(ioc, [self = shared_from_this()] { self->ioc.stop(); });
    return;
  }
  drain_timer.expires_after(opts.drain);
  drain_timer.async_wait([self = shared_from_this()](beast::error_code ec) {
    if (ec)
      return;
    auto left = self->generating; // abort() ends jobs, which edits the set
    for (auto& c : left)
      c->abort(api_error(503, "the server is shutting down", "server_error", "shutting_down"));
    // Give the final events a moment to leave, bounded by the io loop itself.
    net::post(self->ioc, [self] { self->ioc.stop(); });
  });
}

Server::Server(caf::actor_system& sys, std::function<msg::supervisor_actor()> supervisor, std::function<msg::supervisor_actor()> reconnect,
               ServerOptions opts)
  : impl_(std::make_shared<Impl>(sys, std::move(supervisor), std::move(reconnect), std::move(opts))) {}

Server::~Server() = default;

uint16_t Server::bind() {
  beast::error_code ec;
  const auto addr = net::ip::make_address(impl_->opts.host, ec);
  if (ec)
    throw model::Error(model::errc::bad_argument, "--http: '" + impl_->opts.host + "' is not an IP address");
  tcp::endpoint ep{addr, impl_->opts.port};
  impl_->acceptor.open(ep.protocol(), ec);
  if (!ec)
    impl_->acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec)
    impl_->acceptor.bind(ep, ec);
  if (!ec)
    impl_->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec)
    throw model::Error(model::errc::io, "cannot listen on " + impl_->opts.host + ":" +
                                          std::to_string(impl_->opts.port) + ": " + ec.message());
  return impl_->acceptor.local_endpoint().port();
}

void Server::run() {
  impl_->signals.async_wait([impl = impl_](beast::error_code ec, int) {
    if (!ec)
      impl->begin_shutdown();
  });
  impl_->accept();
  while (true) {
    try {
      impl_->ioc.run(); // returns when stopped
      return;
    } catch (const std::exception& e) { // one request's bug must not take the server down
      log::error(std::string("error in a handler (serving goes on): ") + e.what());
    }
  }
}

void Server::shutdown() {
  net::post(impl_->ioc, [impl = impl_] { impl->begin_shutdown(); });
}

// ---------------------------------------------------------------- strata serve

int run_serve(int argc, char** argv) {
  runtime::Args a;
  a.option("cluster", "HOST:PORT", "the coordinator")
    .option("http", "HOST:PORT", "address for HTTP (default 127.0.0.1:8080; port 0 picks one)")
    .option("tokenizer", "PATH", "tokenizer for the cluster's model (default: the model's own)")
    .option("max-body", "BYTES", "largest request body (default 1048576)")
    .option("request-timeout", "S", "seconds one generation may take (default 300)")
    .option("drain", "S", "seconds in-flight generations get at shutdown (default 10)")
    .option("max-in-flight", "N", "generations at once; more get 429 (default 64)")
    .option("max-connections", "N", "open HTTP connections; more get 503 and are closed (default 256)")
    .option("header-timeout-ms", "MS", "a request's header and body must arrive within this (default 10000)")
    .option("idle-timeout-ms", "MS", "an idle keep-alive connection is closed after this (default 30000)")
    .option("api-key", "KEY", "require 'Authorization: Bearer KEY' on /v1/* (or env STRATA_API_KEY)")
    .option("allow-inject", "", "enable POST /v1/cluster/inject (kill/freeze/evict nodes; off by default)")
    .option("served-model-name", "NAME", "the model's id in the API (default: its file or directory name)")
    .option("chat-template", "FILE", "a Jinja chat template (or a tokenizer_config.json) overriding the model's own")
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
  o.max_in_flight = static_cast<std::size_t>(a.integer("max-in-flight", 64, 1, 100000));
  o.max_connections = static_cast<std::size_t>(a.integer("max-connections", 256, 1, 1000000));
  o.header_timeout = std::chrono::milliseconds(a.integer("header-timeout-ms", 10000, 10, 3600000));
  o.idle_timeout = std::chrono::milliseconds(a.integer("idle-timeout-ms", 30000, 10, 3600000));
  const char* env_key = std::getenv("STRATA_API_KEY");
  if (a.has("api-key") && a.str("api-key").empty())
    throw runtime::UsageError("--api-key is empty: give a key, or leave the option out to serve without one");
  if (!a.has("api-key") && env_key && *env_key == '\0')
    throw runtime::UsageError("STRATA_API_KEY is set but empty: give a key, or unset it to serve without one");
  o.api_key = a.has("api-key") ? a.str("api-key") : (env_key ? env_key : "");
  o.allow_inject = a.has("allow-inject");
  o.cors_origin = a.str("cors-origin");
  o.served_model_name = a.str("served-model-name");
  o.chat_template = a.str("chat-template");
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
  auto reconnect = [&sys, sup, sup_mu, cluster_ep]() -> msg::supervisor_actor {
    auto fresh = runtime::reconnect_coordinator(sys, cluster_ep);
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
  return 0;
}

} // namespace strata::server
