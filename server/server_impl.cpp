// Server::Impl: the io loop, the acceptor, the model as the server knows it,
// graceful shutdown; and the Server facade over it.

#include "server/generation.hpp"
#include "server/server_impl.hpp"

#include "model/base/error.hpp"
#include "runtime/cluster.hpp"
#include "runtime/log.hpp"

namespace strata::server {

using nlohmann::json;

ApiError api_error(int status, std::string message, std::string type, std::string code) {
  ApiError e;
  e.status = status;
  e.message = std::move(message);
  e.type = std::move(type);
  e.code = std::move(code);
  return e;
}

ApiError bad_field(const std::string& field, const std::string& message) {
  auto e = api_error(400, message, "invalid_request_error");
  e.param = field;
  return e;
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

Server::Impl::Impl(caf::actor_system& s, std::function<msg::supervisor_actor()> sup,
                   std::function<msg::supervisor_actor()> rc, ServerOptions o)
  : sys(s), supervisor(std::move(sup)), reconnect(std::move(rc)), opts(std::move(o)) {}

TransportLimits Server::Impl::limits() const {
  TransportLimits l;
  l.max_body = opts.max_body;
  l.header_timeout = opts.header_timeout;
  l.idle_timeout = opts.idle_timeout;
  l.write_timeout = opts.write_timeout;
  l.max_send_buffer = opts.max_send_buffer;
  return l;
}

std::optional<ApiError> Server::Impl::ensure_model(ModelState& out) {
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
    if (model.tok) {
      model.vocabulary = std::make_shared<LazyVocabulary>();
      model.vocabulary->tok = model.tok;
      model.vocabulary->model_vocab = model.cfg.vocab_size;
    }
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
    if (opts.draft_model) {
      try {
        actors::DrafterLimits dl;
        dl.max_crowd = opts.draft_max_sessions;
        model.drafter = actors::spawn_drafter(sys, opts.draft_model, model.cfg.vocab_size, dl);
      } catch (const std::exception& e) {
        return api_error(500, std::string("cannot use the draft model: ") + e.what(), "server_error");
      }
      log::info("speculative decoding: up to " + std::to_string(opts.speculate) + " proposals per step from the draft model " +
                opts.draft_model->config().identity +
                (opts.draft_max_sessions == 1   ? ", while one session drafts at a time (--draft-max-sessions)"
                 : opts.draft_max_sessions > 1 ? ", while at most " + std::to_string(opts.draft_max_sessions) +
                                                   " sessions draft at once (--draft-max-sessions)"
                                               : ""));
    }
    model.loaded = true;
  }
  out = model;
  return std::nullopt;
}

ClusterSnapshot Server::Impl::snapshot() {
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

ClusterSnapshot::Draft Server::Impl::draft_snapshot() {
  ClusterSnapshot::Draft d;
  actors::drafter_actor drafter;
  {
    std::unique_lock<std::mutex> g(model_mu, std::try_to_lock); // (a model being loaded: this scrape goes without)
    if (g.owns_lock())
      drafter = model.drafter;
  }
  if (!drafter)
    return d;
  caf::scoped_actor self{sys};
  self->request(drafter, std::chrono::seconds(2), atom::stats_atom_v)
    .receive(
      [&](uint64_t proposals, uint64_t positions, uint64_t passes, uint64_t declined, uint64_t drafting) {
        d = {true, proposals, positions, passes, declined, drafting, opts.draft_max_sessions};
      },
      [](caf::error&) {}); // busy past 2 s or gone: the scrape goes without it
  return d;
}

std::optional<ApiError> Server::Impl::model_with_tokenizer(ModelState& m) {
  if (auto e = ensure_model(m))
    return e;
  if (!m.tok)
    return api_error(500, "the server has no tokenizer for " + m.id + " (start it with --tokenizer)", "server_error");
  return std::nullopt;
}

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
    auto c = std::make_shared<HttpConnection>(std::move(s), self->limits(), self, self->transport);
    if (self->transport.open > self->opts.max_connections) {
      // Over the cap on open connections: a clear refusal, then close.
      answer(*self, c, Exchange{"other", "", false},
             Reply::error(api_error(503,
                                    "too many open connections (limit " +
                                      std::to_string(self->opts.max_connections) + "); retry later",
                                    "server_error", "too_many_connections")),
             false);
    } else {
      c->start();
    }
    self->accept();
  });
}

void Server::Impl::generation_ended(const std::shared_ptr<Generation>& g) {
  generating.erase(g);
  if (!draining)
    return;
  if (const auto& c = g->connection()) { // its last events (an error, [DONE]) must reach the client
    ++writing;
    c->when_answered([self = shared_from_this()] {
      --self->writing;
      self->stop_when_written();
    });
  }
  stop_when_written();
}

void Server::Impl::stop_when_written() {
  if (!draining || !generating.empty() || writing > 0)
    return;
  drain_timer.cancel();
  net::post(ioc, [self = shared_from_this()] { self->ioc.stop(); });
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
    auto left = self->generating; // abort() ends generations, which edits the set
    for (auto& g : left)
      g->abort(api_error(503, "the server is shutting down", "server_error", "shutting_down"));
    // The aborted answers go out (stop_when_written stops then); a client that
    // does not take them holds the stop at most this long.
    self->drain_timer.expires_after(std::chrono::seconds(2));
    self->drain_timer.async_wait([self](beast::error_code ec) {
      if (!ec)
        self->ioc.stop();
    });
    self->stop_when_written();
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

} // namespace strata::server
