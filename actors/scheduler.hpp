#pragma once
// StepScheduler: the queue of a shard actor and the choice of what runs in the
// next round (one batched forward pass). A plain class; the shard actor owns one.
//
// Rules:
// * bounded: a step that finds `max_queue` steps waiting is refused by the
//   caller with ec::overloaded;
// * a round takes every waiting decode step first (oldest first), then pieces of
//   waiting prefills and rebuilds, within `max_batch_tokens` rows; a round always takes at
//   least one piece, so a step larger than the budget still runs;
// * a long input is cut into pieces at fixed multiples of `prefill_chunk` rows
//   (counted from the step's first row), whatever else is queued, so a sequence
//   gets the same pieces, and so the same numbers, in a crowd as alone (the
//   last piece takes the rows of a speculative step's proposals whole); decodes
//   keep flowing between the pieces of a long prefill;
// * one piece per session per round, and never a session's later step before
//   its earlier one finished (a retried or duplicated step waits for the first,
//   then is answered as a duplicate).

#include "messages/messages.hpp"

#include <caf/typed_response_promise.hpp>

#include <chrono>
#include <cstdint>
#include <list>
#include <vector>

namespace strata::actors {

struct SchedulerLimits {
  int64_t max_batch_tokens = 256; ///< rows in one round (--max-batch-tokens)
  int64_t prefill_chunk = 128;    ///< rows per piece of a long input
  std::size_t max_queue = 512;    ///< steps waiting before new ones are refused
  /// How long a round waits for sessions answered in the last round that are not
  /// back yet (the rest of a batch arriving as a burst of messages); 0: never.
  std::chrono::microseconds gather{2000};
  /// Whether a head whose whole route runs on this machine waits for its
  /// batch to come back (lockstep, see shard_state::schedule_round). false:
  /// every route is treated as spanning machines (node --assume-remote).
  bool detect_colocation = true;
};

/// A step waiting in (or running through) the shard's queue.
struct QueuedStep {
  msg::step_request req;
  caf::typed_response_promise<msg::step_reply> promise;
  caf::strong_actor_ptr owner; ///< the sender (a prefill's opener is monitored)
  int64_t rows = 0;           ///< input rows of the whole step
  int64_t done = 0;           ///< rows already run (earlier pieces, or taken from the prefix cache)
  int64_t from = 0;           ///< position of the first input row (0: this hop rebuilds; else past_len)
  bool rebuilt = false;       ///< this hop opens a fresh cache (a prefill, or a rebuild)
  uint64_t recomputed = 0;    ///< layer-tokens this hop recomputed for positions before past_len
  std::vector<float> hidden;  ///< non-head: the input rows (rows, dim)
  /// The tail, prompt log-probabilities: row i's target (token i + 1; -1 for
  /// the last row), and what the pieces so far scored.
  std::vector<int32_t> row_targets;
  std::vector<float> prompt_logprobs;
  std::vector<int32_t> prompt_top_ids;
  std::vector<float> prompt_top_logprobs;
};

class StepScheduler {
public:
  using queue_type = std::list<QueuedStep>;
  using iterator = queue_type::iterator;

  /// A piece of a queued step: rows [begin, end) run in this round.
  struct Piece {
    iterator step;
    int64_t begin = 0;
    int64_t end = 0;
    bool last() const { return end == step->rows; }
  };

  explicit StepScheduler(SchedulerLimits limits);

  const SchedulerLimits& limits() const { return limits_; }
  bool full() const { return queue_.size() >= limits_.max_queue; }
  std::size_t queued() const { return queue_.size(); }
  bool empty() const { return queue_.empty(); }

  /// Appends a step (the caller checked full()).
  void push(QueuedStep step);
  /// The pieces of the next round (empty when nothing waits).
  std::vector<Piece> pick();
  /// Where the piece of `s` starting at row `begin` ends.
  int64_t piece_end(const QueuedStep& s, int64_t begin) const;
  /// Removes a step (answered, or failed).
  void erase(iterator it) { queue_.erase(it); }

private:
  SchedulerLimits limits_;
  queue_type queue_;
};

} // namespace strata::actors
