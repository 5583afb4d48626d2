// The endpoints other than generations: health, metrics, models, the cluster
// view and injections, tokenize / detokenize, apply-template. Each may block on
// the cluster, so the router runs each on its own thread (offload).

#include "server/router.hpp"

#include "model/base/error.hpp"
#include "runtime/cluster.hpp"

namespace strata::server {

using nlohmann::json;

namespace {

json model_json(const ModelState& m) {
  json j = {{"id", m.id}, {"object", "model"}, {"created", 0}, {"owned_by", "strata"},
            {"context_length", m.cfg.max_seq_len}, {"architecture", m.cfg.architecture}};
  if (m.cfg.moe())
    j["experts"] = {{"total", m.cfg.n_experts}, {"active", m.cfg.n_experts_used}};
  if (m.cfg.sliding_window > 0)
    j["sliding_window"] = {{"size", m.cfg.sliding_window}, {"layers", m.cfg.local_layers()},
                           {"of_layers", m.cfg.n_layers}};
  return j;
}

} // namespace

ApiError model_not_found(const std::string& asked, const std::string& served) {
  auto e = api_error(404, "The model '" + asked + "' does not exist; this server serves '" + served + "'",
                     "invalid_request_error", "model_not_found");
  e.param = "model";
  return e;
}

Reply health_reply(Server::Impl& srv) {
  auto c = srv.snapshot();
  json j = {{"status", c.reachable && c.route_complete ? "ok" : "degraded"},
            {"cluster_reachable", c.reachable},
            {"route_complete", c.route_complete},
            {"epoch", c.epoch},
            {"shards", c.shards.size()},
            {"connections", srv.transport.open.load()},
            {"accept_errors", srv.accept_errors.load()},
            {"timed_out_connections", srv.transport.timed_out.load()},
            {"write_timeouts", srv.transport.write_timeouts.load()},
            {"send_buffer_overflows", srv.transport.send_overflows.load()}};
  return Reply::json_body(c.reachable && c.route_complete ? 200 : 503, j);
}

Reply metrics_reply(Server::Impl& srv) {
  auto c = srv.snapshot();
  c.draft = srv.draft_snapshot();
  return Reply{200, "text/plain; version=0.0.4; charset=utf-8", srv.metrics.render(c), {}};
}

Reply models_reply(Server::Impl& srv) {
  ModelState m;
  if (auto e = srv.ensure_model(m))
    return Reply::error(*e);
  return Reply::json_body(200, json{{"object", "list"}, {"data", json::array({model_json(m)})}});
}

Reply model_reply(Server::Impl& srv, const std::string& id) {
  ModelState m;
  if (auto e = srv.ensure_model(m))
    return Reply::error(*e);
  if (id != m.id)
    return Reply::error(model_not_found(id, m.id));
  return Reply::json_body(200, model_json(m));
}

Reply cluster_reply(Server::Impl& srv) {
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

Reply inject_reply(Server::Impl& srv, const std::string& body) {
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
    return Reply::json_body(200,
                            json{{"done", runtime::inject_node(srv.sys, srv.supervisor(), kind, node, session, seconds)}});
  } catch (const model::Error& e) {
    return Reply::error(api_error(e.code() == model::errc::bad_argument ? 400 : 502, e.what(), "invalid_request_error"));
  }
}

// llama-server's shapes: {"content", "add_special", "parse_special", "with_pieces"} -> {"tokens"}.
// parse_special (default true, as llama-server): special tokens written in the
// content become their ids; false: they are encoded as the text they spell.
Reply tokenize_reply(Server::Impl& srv, const std::string& body) {
  json j = json::parse(body, nullptr, false);
  if (!j.is_object() || !j.contains("content") || !j["content"].is_string())
    return Reply::error(bad_field("content", "'content' (a string) is required"));
  for (const char* flag : {"add_special", "parse_special", "with_pieces"})
    if (j.contains(flag) && !j[flag].is_boolean())
      return Reply::error(bad_field(flag, std::string("'") + flag + "' must be a boolean"));
  ModelState m;
  if (auto e = srv.model_with_tokenizer(m))
    return Reply::error(*e);
  const bool special = j.value("add_special", false) && m.cfg.bos_id >= 0 && m.tok->bos_id() == m.cfg.bos_id;
  std::vector<int32_t> ids;
  try {
    model::SpecialText how;
    how.parse = j.value("parse_special", true);
    ids = m.tok->encode_with(j["content"].get<std::string>(), special, how);
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

// {"tokens": [ids]} -> {"content"}.
Reply detokenize_reply(Server::Impl& srv, const std::string& body) {
  json j = json::parse(body, nullptr, false);
  if (!j.is_object() || !j.contains("tokens") || !j["tokens"].is_array())
    return Reply::error(bad_field("tokens", "'tokens' (an array of token ids) is required"));
  ModelState m;
  if (auto e = srv.model_with_tokenizer(m))
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

// llama-server's shape: a chat body ({"messages", ...}) -> {"prompt": the text
// /v1/chat/completions would feed the model}.
Reply apply_template_reply(Server::Impl& srv, const std::string& body, const std::atomic<bool>& gone,
                           std::chrono::steady_clock::time_point started) {
  auto r = parse_request(body, true);
  if (auto* e = std::get_if<ApiError>(&r))
    return Reply::error(*e);
  const auto& req = std::get<ApiRequest>(r);
  ModelState m;
  if (auto e = srv.model_with_tokenizer(m))
    return Reply::error(*e);
  try {
    auto p = chat_prompt(req.messages, m.chat.get(), m.family, *m.tok, m.cfg, prompt_options(srv, m, req, started, &gone));
    if (auto* e = std::get_if<ApiError>(&p))
      return Reply::error(*e);
    return Reply::json_body(200, json{{"prompt", std::get<ChatPrompt>(p).text}});
  } catch (const std::exception& e) {
    return Reply::error(bad_field("messages", std::string("cannot render the chat: ") + e.what()));
  }
}

} // namespace strata::server
