#include "server/generation.hpp"
#include "server/tool_grammar.hpp"

#include "messages/session_id.hpp"
#include "model/transformer/sampler.hpp"
#include "runtime/log.hpp"

#include <algorithm>
#include <cstdio>
#include <random>
#include <thread>

namespace strata::server {

using nlohmann::json;
using clk = std::chrono::steady_clock;

// ---------------------------------------------------------------- Job

void Job::cancel() {
  cancelled = true;
  std::lock_guard<std::mutex> g(mu);
  for (auto& s : sessions)
    if (s)
      caf::anon_send(s, atom::cancel_atom_v);
}

void Job::cancel_choice(std::size_t i) {
  std::lock_guard<std::mutex> g(mu);
  if (i < ended.size())
    ended[i] = true;
  if (i < sessions.size() && sessions[i])
    caf::anon_send(sessions[i], atom::cancel_atom_v);
}

void Job::started(std::size_t i, msg::session_actor s) {
  std::lock_guard<std::mutex> g(mu);
  if (i >= sessions.size())
    return;
  sessions[i] = s;
  if (cancelled || ended[i])
    caf::anon_send(s, atom::cancel_atom_v);
}

// ---------------------------------------------------------------- start

model::jinja::RenderLimits render_limits(const Server::Impl& srv, const ModelState& m,
                                         std::chrono::steady_clock::time_point started,
                                         const std::atomic<bool>* cancel) {
  model::jinja::RenderLimits l;
  l.deadline = started + srv.opts.request_timeout;
  l.cancel = cancel;
  // A prompt longer than this could not fit the context whatever its tokens
  // (no vocabulary has tokens of 256 bytes on average), so nothing longer is rendered.
  const auto fits = static_cast<std::size_t>(std::max<int64_t>(m.cfg.max_seq_len, 1)) * 256;
  l.max_output = std::clamp<std::size_t>(fits, std::size_t{1} << 20, l.max_output);
  return l;
}

PromptOptions prompt_options(const Server::Impl& srv, const ModelState& m, const ApiRequest& req,
                             std::chrono::steady_clock::time_point started, const std::atomic<bool>* cancel) {
  PromptOptions o;
  o.kwargs = req.template_kwargs;
  o.tools = req.tools;
  o.add_generation_prompt = req.add_generation_prompt;
  o.continue_final_message = req.continue_final_message;
  o.limits = render_limits(srv, m, started, cancel);
  o.plain_content = !srv.opts.control_tokens_in_messages;
  return o;
}

void start_generation(Server::Impl& srv, const ConnectionPtr& c, Exchange x, const std::string& body, bool chat) {
  auto parsed = parse_request(body, chat);
  if (auto* e = std::get_if<ApiError>(&parsed))
    return answer(srv, c, x, Reply::error(*e), x.keep_alive);
  auto req = std::get<ApiRequest>(std::move(parsed));
  if (srv.draining)
    return answer(srv, c, x, Reply::error(api_error(503, "the server is shutting down", "server_error")), false);
  // Each choice is a generation: a request with n choices takes n places.
  const auto places = static_cast<std::size_t>(req.n);
  if (places > srv.opts.max_in_flight) {
    auto e = api_error(400, "'n' = " + std::to_string(places) + " is more than the server's --max-in-flight of " +
                              std::to_string(srv.opts.max_in_flight),
                       "invalid_request_error");
    e.param = "n";
    return answer(srv, c, x, Reply::error(e), x.keep_alive);
  }
  if (srv.in_flight.load() + places > srv.opts.max_in_flight)
    return answer(srv, c, x,
                  Reply::error(api_error(429,
                                         "too many generations in flight (limit " +
                                           std::to_string(srv.opts.max_in_flight) + "); retry later",
                                         "rate_limit_exceeded")),
                  x.keep_alive);
  auto g = std::make_shared<Generation>(srv.shared_from_this(), c, std::move(x), std::move(req), places);
  srv.generating.insert(g);
  g->start();
}

Generation::Generation(std::shared_ptr<Server::Impl> srv, ConnectionPtr c, Exchange x, ApiRequest req,
                       std::size_t places)
  : srv_(std::move(srv)), conn_(std::move(c)), x_(std::move(x)), req_(std::move(req)), places_(places) {
  srv_->in_flight += places_;
  srv_->metrics.in_flight(static_cast<int>(places_));
  started_ = clk::now();
}

void Generation::start() {
  // The request timeout covers everything from here: rendering the chat
  // template and tokenizing as well as the generation. A client that goes away
  // cancels whatever runs (the render stops at its next check; the sessions end).
  timeout_.emplace(conn_->executor());
  timeout_->expires_after(srv_->opts.request_timeout);
  timeout_->async_wait([weak = weak_from_this()](beast::error_code ec) {
    auto self = weak.lock();
    if (!ec && self)
      self->abort(api_error(504,
                            "the generation did not finish within the request timeout of " +
                              std::to_string(self->srv_->opts.request_timeout.count()) + " s",
                            "server_error", "timeout"));
  });
  conn_->watch_disconnect([weak = weak_from_this()](bool write_failed) {
    if (auto self = weak.lock())
      self->client_gone(write_failed);
  });
  // Tokenizing and the context check need the model: off the io thread.
  std::thread([self = shared_from_this()] { self->prepare_and_run(); }).detach();
}

// Driver thread: nothing may escape it (an exception here would end the process).
void Generation::prepare_and_run() {
  try {
    prepare_and_generate();
  } catch (const std::exception& e) {
    fail_from_driver(std::string("internal error: ") + e.what());
  } catch (...) {
    fail_from_driver("internal error");
  }
}

void Generation::fail_from_driver(const std::string& why) {
  log::error("generation failed: " + why);
  net::post(conn_->executor(), [self = shared_from_this(), why, began = began_.load()] {
    if (began)
      self->on_done(0, {}, why);
    else
      self->fail_before_start(api_error(500, why, "server_error"));
  });
}

void Generation::prepare_and_generate() {
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
        auto p = chat_prompt(req_.messages, m.chat.get(), m.family, *m.tok, m.cfg,
                             prompt_options(*srv_, m, req_, started_, &job_->cancelled));
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
  // Constrained decoding: a forced tool call in the template's syntax, or the response_format's grammar.
  std::string grammar = req_.grammar;
  if (!err && req_.chat && (req_.tool_choice == "required" || req_.tool_choice == "named")) {
    if (!m.chat)
      err = bad_field("tool_choice", "'tool_choice' = " + req_.tool_choice + " needs the model's chat template (it has none)");
    else
      try {
        grammar = tool_call_grammar(tool_syntax_of(m.chat->text()), req_.tools,
                                    req_.tool_choice == "named" ? req_.tool_choice_name : "", req_.parallel_tool_calls);
      } catch (const model::Error& e) {
        err = bad_field("tools", e.message());
      }
  }
  if (!err && !grammar.empty() && !m.vocabulary)
    err = bad_field("response_format", "structured output needs the model's tokenizer (start serve with --tokenizer)");
  if (err) {
    net::post(conn_->executor(), [self = shared_from_this(), e = *err] { self->fail_before_start(e); });
    return;
  }
  msg::generation_request g;
  g.grammar = grammar;
  if (req_.echo) {
    prompt_ids_ = prompt;
    echo_text_ = req_.prompt_is_ids ? (m.tok ? m.tok->decode(prompt) : std::string()) : req_.prompt;
    if (req_.logprobs >= 0)
      g.prompt_logprobs = req_.logprobs;
  }
  g.session = msg::mint_session_id("http");
  g.prompt = prompt;
  g.max_tokens = max_tokens;
  g.stop_ids = req_.chat && m.tok ? chat_stop_ids(m.family, *m.tok, m.cfg, m.chat.get()) : m.cfg.eos_ids;
  g.speculate = srv_->opts.speculate;
  model::SamplingParams sp;
  sp.temperature = req_.temperature;
  sp.top_p = req_.top_p;
  sp.top_k = req_.top_k;
  sp.min_p = req_.min_p;
  const uint64_t seed = req_.seed ? *req_.seed : std::random_device{}();
  actors::SessionOptions so;
  so.max_context = m.cfg.max_seq_len;
  so.cluster_wait = srv_->opts.route_wait;
  so.drafter = m.drafter;
  if (!grammar.empty())
    so.vocabulary = m.vocabulary->get();
  const auto n = static_cast<std::size_t>(req_.n);
  {
    std::lock_guard<std::mutex> lk(job_->mu);
    job_->sessions.assign(n, {});
    job_->ended.assign(n, false);
  }
  began_ = true;
  net::post(conn_->executor(), [self = shared_from_this(), m, np = static_cast<int64_t>(prompt.size())] {
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
      gi.sampling = msg::sampling_state{};
      gi.sampling.temperature = sp.temperature;
      gi.sampling.top_k = sp.top_k;
      gi.sampling.top_p = sp.top_p;
      gi.sampling.rng_state = model::Sampler(spi).state();
      gi.sampling.min_p = sp.min_p;
      gi.sampling.presence_penalty = req_.presence_penalty;
      gi.sampling.frequency_penalty = req_.frequency_penalty;
      gi.sampling.repetition_penalty = req_.repetition_penalty;
      gi.sampling.logprobs = req_.logprobs;
      auto job = job_;
      auto out = actors::run_generation(
        srv_->sys, srv_->supervisor(), gi, so, {}, {},
        [self = shared_from_this(), i](const msg::token_event& ev) {
          net::post(self->conn_->executor(), [self, i, ev] { self->on_token(i, ev); });
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
    net::post(conn_->executor(), [self = shared_from_this(), i, r = std::move(result), error, no_route] {
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

// ---------------------------------------------------------------- io thread

void Generation::abort(const ApiError& why) {
  if (state_ == State::finished)
    return;
  job_->cancel();
  srv_->metrics.cancelled();
  if (streaming()) {
    conn_->send_event(dump(json{{"error", why.body()["error"]}}));
    finish_stream();
  } else {
    respond(Reply::error(why), false);
    state_ = State::finished;
  }
}

// The client went away mid-generation: end its sessions (which frees their caches).
void Generation::client_gone(bool write_failed) {
  if (state_ == State::finished)
    return;
  job_->cancel();
  srv_->metrics.cancelled();
  state_ = State::finished;
  if (!write_failed)
    srv_->metrics.request(x_.endpoint, 499);
}

void Generation::fail_before_start(const ApiError& e) {
  end_job();
  respond(Reply::error(e), x_.keep_alive);
  state_ = State::finished;
}

void Generation::end_job() {
  if (ended_)
    return;
  ended_ = true;
  srv_->in_flight -= places_;
  srv_->metrics.in_flight(-static_cast<int>(places_));
  srv_->generation_ended(shared_from_this());
}

// One line per generation request: id, endpoint, status, tokens, time, finish reason.
void Generation::log_line(int status) {
  if (!log::enabled(log::level::info))
    return;
  const double ms = std::chrono::duration<double, std::milli>(clk::now() - started_).count();
  char t[32];
  std::snprintf(t, sizeof t, "%.1f", ms);
  log::info("request " + (id_.empty() ? std::string("-") : id_) + " " + x_.endpoint + " " + std::to_string(status) +
            " prompt_tokens=" + std::to_string(prompt_tokens_) + " generated_tokens=" +
            std::to_string(completion_tokens_) + " ms=" + t + " finish=" +
            (finish_reason_.empty() ? "-" : finish_reason_));
}

void Generation::respond(Reply r, bool keep_alive) {
  if (state_ == State::finished)
    return;
  srv_->metrics.request(x_.endpoint, r.status);
  log_line(r.status);
  add_cors(*srv_, x_.origin, r);
  conn_->respond(r, keep_alive && !srv_->draining);
}

json Generation::usage() const {
  return {{"prompt_tokens", prompt_tokens_},
          {"completion_tokens", completion_tokens_},
          {"total_tokens", prompt_tokens_ + completion_tokens_}};
}

// OpenAI's logprobs object for `entries` (chat: {content}; completions: the
// legacy parallel lists).
json Generation::logprobs_json(const json& entries, const Choice& c, std::size_t first) const {
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
    offsets.push_back((first + k < c.offsets.size() ? c.offsets[first + k] : 0) + (req_.echo ? echo_text_.size() : 0));
  }
  return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

// A token's text after `prev` (logprobs entries); "" for an id the tokenizer lacks.
std::string Generation::spell(int32_t id, int32_t prev) const {
  try {
    return model_.tok ? model_.tok->token_bytes(id, prev) : std::to_string(id);
  } catch (const std::exception&) {
    return {};
  }
}

// echo: the prompt's tokens before the completion's in the legacy lists; the
// first prompt token has no log-probability (null), as OpenAI returns it.
json Generation::echoed_logprobs(const Choice& c, const json& completion) const {
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  const auto k = static_cast<std::size_t>(std::max(req_.logprobs, 0));
  std::size_t at = 0;
  int32_t prev = -1;
  for (std::size_t j = 0; j < prompt_ids_.size(); ++j) {
    const std::string t = spell(prompt_ids_[j], prev);
    tokens.push_back(t);
    offsets.push_back(at);
    at += t.size();
    if (j == 0 || j - 1 >= c.scored.prompt_logprobs.size()) {
      lps.push_back(nullptr);
      tops.push_back(nullptr);
    } else {
      lps.push_back(c.scored.prompt_logprobs[j - 1]);
      json top = json::object();
      for (std::size_t q = 0; q < k; ++q) {
        const auto idx = (j - 1) * k + q;
        if (idx < c.scored.prompt_top_ids.size() && c.scored.prompt_top_ids[idx] >= 0)
          top[spell(c.scored.prompt_top_ids[idx], prev)] = c.scored.prompt_top_logprobs[idx];
      }
      tops.push_back(top);
    }
    prev = prompt_ids_[j];
  }
  for (std::size_t j = 0; completion.is_object() && j < completion["tokens"].size(); ++j) {
    tokens.push_back(completion["tokens"][j]);
    lps.push_back(completion["token_logprobs"][j]);
    tops.push_back(completion["top_logprobs"][j]);
    offsets.push_back(completion["text_offset"][j]); // (already after the prompt's text)
  }
  return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

void Generation::send_echo(std::size_t i) {
  auto& c = choices_[i];
  if (!streaming() || c.echoed)
    return;
  c.echoed = true;
  json choice = {{"index", i},
                 {"text", echo_text_},
                 {"finish_reason", nullptr},
                 {"logprobs", req_.logprobs >= 0 ? echoed_logprobs(c, json(nullptr)) : json(nullptr)}};
  conn_->send_event(dump(envelope("text_completion", json::array({choice}))));
}

json Generation::chunk(std::size_t i, const std::string& piece, const char* finish, bool role, const json* call) {
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
    if (call) { // a whole call in one delta: its index, id, name and all its arguments
      json c = *call;
      c["index"] = choices_[i].tool_calls.size() - 1;
      delta["tool_calls"] = json::array({c});
    }
    choice["delta"] = delta;
  } else {
    choice["text"] = piece;
  }
  choice["logprobs"] = lp;
  return envelope(req_.chat ? "chat.completion.chunk" : "text_completion", json::array({choice}));
}

// What every response and stream event carries around its choices.
json Generation::envelope(const char* object, json choices) const {
  return {{"id", id_}, {"object", object}, {"created", created_}, {"model", created_model_}, {"choices", choices}};
}

void Generation::begin_response(const ModelState& m, int64_t prompt_tokens) {
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
    if (req_.chat && !req_.tools.is_null() && req_.tool_choice != "none" && m.chat) {
      std::vector<std::string> names;
      for (auto& t : req_.tools)
        names.push_back(t["function"]["name"].get<std::string>());
      c.tools.emplace(tool_syntax_of(m.chat->text()), std::move(names));
    }
  }
  drivers_left_ = choices_.size(); // (even when already finished: the drivers still report)
  last_token_ = started_;
  if (state_ == State::finished)
    return; // aborted or left while preparing
  state_ = State::answering;
  if (req_.stream) {
    srv_->metrics.request(x_.endpoint, 200);
    Reply head;
    add_cors(*srv_, x_.origin, head);
    conn_->begin_stream(head.headers);
    if (req_.chat)
      for (std::size_t i = 0; i < choices_.size(); ++i)
        conn_->send_event(dump(chunk(i, "", nullptr, true)));
  }
}

void Generation::on_token(std::size_t i, const msg::token_event& ev) {
  if (state_ != State::answering || i >= choices_.size() || choices_[i].finish)
    return;
  auto& c = choices_[i];
  if (req_.echo && !c.echoed) {
    c.scored.prompt_logprobs = ev.prompt_logprobs;
    c.scored.prompt_top_ids = ev.prompt_top_ids;
    c.scored.prompt_top_logprobs = ev.prompt_top_logprobs;
    send_echo(i);
  }
  const auto now = clk::now();
  srv_->metrics.token(std::chrono::duration<double>(now - last_token_).count(), completion_tokens_ == 0);
  last_token_ = now;
  ++completion_tokens_;
  if (req_.logprobs >= 0 && model_.tok) {
    const auto entry = [&](int32_t id, float lp) {
      const std::string t = spell(id, c.prev);
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
  deliver(i, c.stop->push(piece));
  if (c.stop->stopped()) {
    job_->cancel_choice(i); // frees the caches now; on_done then sees the cancel
    end_choice(i, "stop");
  }
}

void Generation::deliver(std::size_t i, const std::string& text, bool end) {
  auto& c = choices_[i];
  if (!c.tools)
    return emit(i, text);
  auto out = c.tools->push(text);
  if (end) {
    auto rest = c.tools->finish();
    out.content += rest.content;
    for (auto& call : rest.calls)
      out.calls.push_back(std::move(call));
  }
  emit(i, out.content);
  for (auto& call : out.calls) {
    c.tool_calls.push_back({{"id", call.id},
                            {"type", "function"},
                            {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
    if (streaming())
      conn_->send_event(dump(chunk(i, "", nullptr, false, &c.tool_calls.back())));
  }
}

void Generation::emit(std::size_t i, const std::string& piece) {
  if (piece.empty())
    return; // (logprobs of held-back text go out with the next piece)
  choices_[i].text += piece;
  if (streaming())
    conn_->send_event(dump(chunk(i, piece, nullptr)));
}

void Generation::on_done(std::size_t i, const msg::generation_result& r, const std::string& error,
                         std::optional<ApiError> why) {
  const bool last = drivers_left_ > 0 && --drivers_left_ == 0;
  if (state_ == State::finished) {
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
    if (streaming()) {
      conn_->send_event(dump(json{{"error", e.body()["error"]}}));
      return finish_stream();
    }
    respond(Reply::error(e), false);
    state_ = State::finished;
    return;
  }
  if (last)
    end_job();
  if (i >= choices_.size() || choices_[i].finish)
    return;
  auto& c = choices_[i];
  c.scored.prompt_logprobs = r.prompt_logprobs;
  c.scored.prompt_top_ids = r.prompt_top_ids;
  c.scored.prompt_top_logprobs = r.prompt_top_logprobs;
  if (req_.echo)
    send_echo(i); // (max_tokens 0: no token came)
  if (c.dec)
    deliver(i, c.stop->push(c.dec->finish()));
  if (!c.stop->stopped())
    deliver(i, c.stop->flush());
  end_choice(i, c.stop->stopped() || r.finish == "stop" ? "stop" : "length");
}

// One choice has ended; the response completes when all have.
void Generation::end_choice(std::size_t i, const char* finish) {
  auto& c = choices_[i];
  if (c.finish || state_ == State::finished)
    return;
  if (c.tools)
    deliver(i, "", true); // what the parser held back: content or calls
  // A reply that ended with calls asks for them (a cut-off reply stays "length").
  if (!c.tool_calls.empty() && std::string_view(finish) == "stop")
    finish = "tool_calls";
  c.finish = finish;
  if (streaming())
    conn_->send_event(dump(chunk(i, "", finish)));
  if (++choices_done_ == choices_.size())
    complete();
}

void Generation::complete() {
  if (state_ == State::finished)
    return;
  finish_reason_ = choices_.empty() || !choices_[0].finish ? "stop" : choices_[0].finish;
  if (timeout_)
    timeout_->cancel();
  if (streaming()) {
    if (req_.include_usage) {
      json u = envelope(req_.chat ? "chat.completion.chunk" : "text_completion", json::array());
      u["usage"] = usage();
      conn_->send_event(dump(u));
    }
    return finish_stream();
  }
  json list = json::array();
  for (std::size_t i = 0; i < choices_.size(); ++i) {
    const auto& c = choices_[i];
    json choice = {{"index", i}, {"finish_reason", c.finish ? c.finish : "stop"}};
    json lp = req_.logprobs >= 0 ? logprobs_json(c.logprobs, c, 0) : json(nullptr);
    if (req_.echo && !req_.chat && req_.logprobs >= 0)
      lp = echoed_logprobs(c, lp);
    if (req_.chat) {
      choice["message"] = {{"role", "assistant"},
                           {"content", c.text.empty() && !c.tool_calls.empty() ? json(nullptr) : json(c.text)}};
      if (!c.tool_calls.empty())
        choice["message"]["tool_calls"] = c.tool_calls;
    }
    else
      choice["text"] = req_.echo ? echo_text_ + c.text : c.text;
    choice["logprobs"] = lp;
    list.push_back(std::move(choice));
  }
  json body = envelope(req_.chat ? "chat.completion" : "text_completion", std::move(list));
  body["usage"] = usage();
  respond(Reply::json_body(200, body), x_.keep_alive);
  state_ = State::finished;
}

void Generation::finish_stream() {
  if (!streaming())
    return;
  if (finish_reason_.empty())
    finish_reason_ = "error";
  log_line(200);
  if (timeout_)
    timeout_->cancel();
  conn_->send_event("[DONE]");
  conn_->end_stream();
  state_ = State::finished;
}

} // namespace strata::server
