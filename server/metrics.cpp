#include "server/metrics.hpp"

#include <cstdio>

namespace strata::server {

namespace {

std::string num(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.17g", v);
  return b;
}

std::string bound(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

std::string esc(const std::string& s) { // label values: backslash, quote, newline
  std::string o;
  for (char c : s) {
    if (c == '\\' || c == '"')
      o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    o += c;
  }
  return o;
}

void head(std::string& out, const std::string& name, const char* type, const std::string& help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

// A metric with one unlabelled sample.
template <class T>
void scalar(std::string& out, const std::string& name, const char* type, const std::string& help, T value) {
  head(out, name, type, help);
  out += name + " " + std::to_string(value) + "\n";
}

} // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  std::size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i])
    ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
  head(out, name, "histogram", help);
  uint64_t cum = 0;
  for (std::size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += name + "_bucket{le=\"" + bound(bounds_[i]) + "\"} " + std::to_string(cum) + "\n";
  }
  out += name + "_bucket{le=\"+Inf\"} " + std::to_string(count_) + "\n";
  out += name + "_sum " + num(sum_) + "\n" + name + "_count " + std::to_string(count_) + "\n";
}

Metrics::Metrics()
  : misses_(msg::miss_reason_count, 0),
    ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}),
    itl_({0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5}) {}

void Metrics::request(const std::string& endpoint, int status) {
  std::lock_guard<std::mutex> g(mu_);
  ++requests_[{endpoint, status}];
}

void Metrics::in_flight(int delta) {
  std::lock_guard<std::mutex> g(mu_);
  in_flight_ += delta;
}

void Metrics::prompt_tokens(uint64_t n) {
  std::lock_guard<std::mutex> g(mu_);
  prompt_tokens_ += n;
}

void Metrics::token(double since_previous_s, bool first) {
  std::lock_guard<std::mutex> g(mu_);
  ++tokens_;
  (first ? ttft_ : itl_).observe(since_previous_s);
}

void Metrics::generation(const msg::generation_result& r) {
  std::lock_guard<std::mutex> g(mu_);
  for (std::size_t i = 1; i < r.misses.size() && i < misses_.size(); ++i)
    misses_[i] += r.misses[i];
  reprefills_ += r.reprefills;
  route_changes_ += r.route_changes;
  retries_ += r.retries;
  recomputed_ += r.recomputed_tokens;
  recomputed_layers_ += r.recomputed_layer_tokens;
  full_layers_ += r.full_layer_tokens;
  proposed_ += r.proposed;
  accepted_ += r.accepted;
  declined_ += r.declined;
  trips_ += r.steps;
  generated_ += r.ids.size();
}

void Metrics::cancelled() {
  std::lock_guard<std::mutex> g(mu_);
  ++cancelled_;
}

std::string Metrics::render(const ClusterSnapshot& c) const {
  std::string out;
  {
    std::lock_guard<std::mutex> g(mu_);
    head(out, "strata_http_requests_total", "counter", "HTTP requests answered, by endpoint and status code.");
    for (auto& [k, v] : requests_)
      out += "strata_http_requests_total{endpoint=\"" + esc(k.first) + "\",status=\"" + std::to_string(k.second) +
             "\"} " + std::to_string(v) + "\n";
    scalar(out, "strata_http_requests_in_flight", "gauge", "Generations being served now.", in_flight_);
    scalar(out, "strata_prompt_tokens_total", "counter", "Prompt tokens of served generations.", prompt_tokens_);
    scalar(out, "strata_tokens_generated_total", "counter", "Tokens generated for HTTP clients.", tokens_);
    ttft_.render(out, "strata_time_to_first_token_seconds", "Time from request to first generated token.");
    itl_.render(out, "strata_inter_token_latency_seconds", "Time between consecutive generated tokens.");
    head(out, "strata_session_cache_misses_total", "counter",
         "Cache misses the cluster reported to this server's sessions, by reason.");
    for (std::size_t r = 1; r < misses_.size(); ++r)
      out += std::string("strata_session_cache_misses_total{reason=\"") + msg::to_string(static_cast<msg::miss_reason>(r)) +
             "\"} " + std::to_string(misses_[r]) + "\n";
    scalar(out, "strata_reprefills_total", "counter",
           "Recoveries: steps that rebuilt the caches of one or more hops after a miss or a route change.", reprefills_);
    scalar(out, "strata_recomputed_tokens_total", "counter", "Positions that recoveries had to rebuild.", recomputed_);
    scalar(out, "strata_recomputed_layer_tokens_total", "counter",
           "Layer-tokens the rebuilt hops computed again (layers x positions).", recomputed_layers_);
    scalar(out, "strata_full_reprefill_layer_tokens_total", "counter",
           "Layer-tokens a full re-prefill of every layer would have recomputed for the same recoveries.", full_layers_);
    scalar(out, "strata_route_changes_total", "counter",
           "Route changes pushed to this server's sessions.", route_changes_);
    scalar(out, "strata_session_retries_total", "counter", "Failed steps retried by this server's sessions.", retries_);
    scalar(out, "strata_speculative_proposed_tokens_total", "counter",
           "Speculative decoding: tokens proposed (serve --speculate).", proposed_);
    scalar(out, "strata_speculative_accepted_tokens_total", "counter",
           "Speculative decoding: proposed tokens the model took.", accepted_);
    scalar(out, "strata_speculative_declined_total", "counter",
           "Speculative decoding: draft model requests answered without proposals (more sessions drafting than "
           "--draft-max-sessions); those sessions then step without it for 32 steps.",
           declined_);
    scalar(out, "strata_session_trips_total", "counter",
           "Steps sessions sent through the pipeline (trips; divided by strata_session_tokens_total: trips per token).",
           trips_);
    scalar(out, "strata_session_tokens_total", "counter", "Tokens of ended sessions (stop tokens not counted).",
           generated_);
    scalar(out, "strata_cancelled_total", "counter",
           "Generations cancelled (client gone, stop string, timeout, shutdown).", cancelled_);
  }
  scalar(out, "strata_cluster_reachable", "gauge", "1 if the coordinator answered this scrape.", int{c.reachable});
  scalar(out, "strata_route_epoch", "gauge", "The route supervisor's current epoch.", c.epoch);
  scalar(out, "strata_route_complete", "gauge", "1 if registered shards cover every layer.", int{c.route_complete});
  if (c.draft.present) { // serve --draft-model, as its drafter counts now
    scalar(out, "strata_draft_proposals_total", "counter", "Requests the draft model answered with proposals.",
           c.draft.proposals);
    scalar(out, "strata_draft_positions_total", "counter", "Positions the draft model computed.", c.draft.positions);
    scalar(out, "strata_draft_passes_total", "counter",
           "Batched forward passes of the draft model (one a token for every request of a round).", c.draft.passes);
    scalar(out, "strata_draft_declined_total", "counter",
           "Draft requests declined because more sessions drafted than --draft-max-sessions.", c.draft.declined);
    scalar(out, "strata_draft_sessions", "gauge", "Sessions drafting now (they asked and have not ended).",
           c.draft.drafting);
    scalar(out, "strata_draft_max_sessions", "gauge", "--draft-max-sessions (0: no limit).", c.draft.max_sessions);
  }
  auto labels = [](const runtime::ShardView& v) {
    return "node=\"" + esc(caf::to_string(v.hop.shard.node())) + "\",layers=\"" + std::to_string(v.hop.first) + "-" +
           std::to_string(v.hop.last) + "\"";
  };
  head(out, "strata_shard_up", "gauge", "1 if the shard answered this scrape within 2 s, else 0.");
  for (auto& v : c.shards)
    out += "strata_shard_up{" + labels(v) + "} " + (v.answered ? "1" : "0") + "\n";
  // One sample per answering shard.
  auto per_shard = [&](const std::string& name, const char* type, const std::string& help, auto value) {
    head(out, name, type, help);
    for (auto& v : c.shards)
      if (v.answered)
        out += name + "{" + labels(v) + "} " + std::to_string(value(v.stats)) + "\n";
  };
  per_shard("strata_shard_cache_bytes", "gauge", "KV cache bytes held by the shard.",
            [](const msg::shard_stats& s) { return s.cache_bytes; });
  per_shard("strata_shard_kv_bytes_per_token", "gauge",
            "Bytes of keys and values one token position takes on the shard (all its layers, in its --kv-dtype).",
            [](const msg::shard_stats& s) { return s.kv_bytes_per_token; });
  per_shard("strata_shard_kept_bytes_per_token", "gauge",
            "Bytes of the output row the shard keeps per position to rebuild the next shard (0 on the tail).",
            [](const msg::shard_stats& s) { return s.kept_bytes_per_token; });
  per_shard("strata_shard_sessions", "gauge", "Sessions cached by the shard.",
            [](const msg::shard_stats& s) { return s.sessions; });
  per_shard("strata_shard_cache_hits_total", "counter", "Steps served from the shard's cache.",
            [](const msg::shard_stats& s) { return s.hits; });
  per_shard("strata_shard_evictions_total", "counter", "Sessions the shard evicted.",
            [](const msg::shard_stats& s) { return s.evictions; });
  per_shard("strata_shard_computed_layer_tokens_total", "counter", "Layer-tokens the shard computed (rows x its layers).",
            [](const msg::shard_stats& s) { return s.computed; });
  per_shard("strata_shard_recomputed_layer_tokens_total", "counter",
            "Layer-tokens the shard computed again to rebuild a lost cache.", [](const msg::shard_stats& s) { return s.recomputed; });
  per_shard("strata_shard_prefix_hit_tokens_total", "counter",
            "Positions the shard took from its prefix cache instead of computing them.",
            [](const msg::shard_stats& s) { return s.prefix_hit_tokens; });
  per_shard("strata_shard_prefix_blocks", "gauge", "Blocks published in the shard's prefix cache.",
            [](const msg::shard_stats& s) { return s.prefix_blocks; });
  per_shard("strata_shard_prefix_cached_blocks", "gauge",
            "Published blocks no session uses now (kept, reclaimed least recently used first).",
            [](const msg::shard_stats& s) { return s.prefix_cached; });
  head(out, "strata_shard_cache_misses_total", "counter", "Cache misses the shard answered, by reason.");
  for (auto& v : c.shards)
    if (v.answered)
      for (std::size_t r = 1; r < v.stats.misses.size() && r < msg::miss_reason_count; ++r)
        out += "strata_shard_cache_misses_total{" + labels(v) + ",reason=\"" +
               msg::to_string(static_cast<msg::miss_reason>(r)) + "\"} " + std::to_string(v.stats.misses[r]) + "\n";
  return out;
}

} // namespace strata::server
