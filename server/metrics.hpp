#pragma once
// Prometheus metrics for the HTTP front door: request counters, token counts,
// latency histograms and what sessions saw (misses by reason, re-prefills),
// plus, at scrape time, each shard's cache figures and the route epoch.
// Thread-safe; render() writes the text exposition format (version 0.0.4).

#include "messages/messages.hpp"
#include "runtime/cluster.hpp"

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace strata::server {

class Histogram {
public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  void render(std::string& out, const std::string& name, const std::string& help) const;

private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_; // per bucket, not cumulative
  double sum_ = 0;
  uint64_t count_ = 0;
};

/// The cluster as seen at scrape time.
struct ClusterSnapshot {
  bool reachable = false;
  int64_t epoch = 0;
  bool route_complete = false;
  std::vector<runtime::ShardView> shards;
  /// The draft model (serve --draft-model), as its drafter counts (filled for /metrics only).
  struct Draft {
    bool present = false; ///< a draft model answered
    uint64_t proposals = 0, positions = 0, passes = 0, declined = 0, drafting = 0;
    std::size_t max_sessions = 0; ///< --draft-max-sessions (0: no limit)
  } draft;
};

class Metrics {
public:
  Metrics();
  void request(const std::string& endpoint, int status);
  void in_flight(int delta);
  void prompt_tokens(uint64_t n);
  void token(double since_previous_s, bool first);
  void generation(const msg::generation_result& r);
  void cancelled();
  std::string render(const ClusterSnapshot& c) const;

private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  int64_t in_flight_ = 0;
  uint64_t prompt_tokens_ = 0, tokens_ = 0, reprefills_ = 0, proposed_ = 0, accepted_ = 0, declined_ = 0, trips_ = 0, generated_ = 0, recomputed_layers_ = 0, full_layers_ = 0, route_changes_ = 0, retries_ = 0, cancelled_ = 0,
           recomputed_ = 0;
  std::vector<uint64_t> misses_;
  Histogram ttft_, itl_;
};

} // namespace strata::server
