#pragma once
// Internal to server/: one generation request (POST /v1/completions or
// /v1/chat/completions) from its parsed body to its last byte. It holds the
// request's places in --max-in-flight, renders and tokenizes the prompt off the
// io thread, runs one session per choice (`n`) on driver threads, and owns what
// the choices produce: decoded text, stop matching, log-probabilities, and the
// encoding of the answer as one JSON body or as Server-Sent Events.

#include "server/router.hpp"
#include "server/tool_calls.hpp"

#include "actors/cluster.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace strata::server {

/// The sessions of one request's choices, shared by its io thread and its
/// driver threads: cancelling reaches every session that has started.
struct Job {
  std::atomic<bool> cancelled{false};
  std::mutex mu;
  std::vector<msg::session_actor> sessions; // per choice, once started
  std::vector<bool> ended;                  // per choice: cancelled on its own (a stop string)
  void cancel();
  void cancel_choice(std::size_t i);
  void started(std::size_t i, msg::session_actor s);
};

/// What one choice has produced so far (io thread).
struct Choice {
  std::optional<model::StreamDecoder> dec;
  std::optional<StopMatcher> stop;
  std::string text;
  nlohmann::json logprobs = nlohmann::json::array(); // per token: {token, logprob, bytes, top_logprobs}
  nlohmann::json pending = nlohmann::json::array();  // the entries a stream has not sent yet
  std::vector<std::size_t> offsets;                  // completions' text_offset per token
  std::size_t bytes = 0;                             // token bytes so far
  int32_t prev = -1;
  const char* finish = nullptr; // set once the choice has ended
  std::optional<ToolCallParser> tools;               // when the request offers tools (tool_choice auto)
  nlohmann::json tool_calls = nlohmann::json::array(); // {id, type, function: {name, arguments}} found so far
  msg::generation_result scored;                     // echo: the prompt's log-probabilities (prompt_* fields)
  bool echoed = false;                               // a stream sent the prompt's chunk
};

class Generation : public std::enable_shared_from_this<Generation> {
public:
  enum class State : uint8_t {
    preparing, ///< the prompt is rendered and tokenized on a driver thread
    answering, ///< the sessions run; the answer (stream or body) is being produced
    finished,  ///< answered, or the client left; drivers may still be returning
  };

  Generation(std::shared_ptr<Server::Impl> srv, ConnectionPtr c, Exchange x, ApiRequest req, std::size_t places);
  /// Takes the request off the io thread (prepare, then the sessions).
  void start();
  /// Ends the generation early (drain deadline, request timeout): an error
  /// event and the end of the stream, or an error response.
  void abort(const ApiError& why);
  /// The connection the answer goes to.
  const ConnectionPtr& connection() const { return conn_; }

private:
  void prepare_and_run();  // driver thread
  void prepare_and_generate();
  void fail_from_driver(const std::string& why);
  void fail_before_start(const ApiError& e);
  void begin_response(const ModelState& m, int64_t prompt_tokens);
  void client_gone(bool write_failed);
  void on_token(std::size_t i, const msg::token_event& ev);
  void emit(std::size_t i, const std::string& piece);
  /// The reply's text after stop strings: through the tool-call parser when
  /// there is one (`end`: the reply is over), then out as content and calls.
  void deliver(std::size_t i, const std::string& text, bool end = false);
  void on_done(std::size_t i, const msg::generation_result& r, const std::string& error,
               std::optional<ApiError> why = std::nullopt);
  void end_choice(std::size_t i, const char* finish);
  void complete();
  void finish_stream();
  void end_job();
  void respond(Reply r, bool keep_alive);
  void log_line(int status);
  nlohmann::json usage() const;
  nlohmann::json logprobs_json(const nlohmann::json& entries, const Choice& c, std::size_t first) const;
  nlohmann::json echoed_logprobs(const Choice& c, const nlohmann::json& completion) const;
  std::string spell(int32_t id, int32_t prev) const;
  void send_echo(std::size_t i); // streamed echo: the prompt's chunk, once, before the completion's
  nlohmann::json chunk(std::size_t i, const std::string& piece, const char* finish, bool role = false,
                       const nlohmann::json* call = nullptr);
  nlohmann::json envelope(const char* object, nlohmann::json choices) const;
  bool streaming() const { return req_.stream && state_ == State::answering; }

  std::shared_ptr<Server::Impl> srv_;
  ConnectionPtr conn_;
  Exchange x_;
  ApiRequest req_;
  std::size_t places_; // places this request holds in --max-in-flight
  State state_ = State::preparing;
  std::atomic<bool> began_{false}; // the driver posted begin_response
  bool ended_ = false;             // end_job() ran
  std::shared_ptr<Job> job_ = std::make_shared<Job>();
  ModelState model_;
  std::string id_, created_model_;
  int64_t created_ = 0;
  int64_t prompt_tokens_ = 0, completion_tokens_ = 0;
  std::vector<int32_t> prompt_ids_; // echo: the prompt's tokens and text
  std::string echo_text_;
  std::vector<Choice> choices_;
  std::size_t choices_done_ = 0, drivers_left_ = 0;
  std::string finish_reason_; // for the request log
  std::chrono::steady_clock::time_point started_, last_token_;
  std::optional<net::steady_timer> timeout_;
};

} // namespace strata::server
