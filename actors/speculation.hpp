#pragma once
// Speculative decoding, the session's side: what to propose and how much.
//
// A session that speculates sends its newest token and k proposed tokens as one
// step of k + 1 rows; every hop runs them, the tail verifies the proposals
// (msg::step_reply::accepted) and every hop cuts the rejected rows back at the
// next step (msg::step_request::draft). One trip through the pipeline then
// yields up to k + 1 tokens, which is what pays across a network.
//
// * lookup_proposal: prompt lookup (no second model): the earlier places where
//   the sequence's last n tokens occurred (the longest n from max_ngram down to
//   min_ngram that occurs), and, token by token, the continuation most of them
//   share (a tie goes to the latest). Voting beats "the latest match" on
//   stories260K's greedy text: 0.68 instead of 0.79 trips per token (k = 8,
//   simulated over 5 generations of 500 tokens).
// * DraftControl: how many to propose next. It follows the acceptance: all
//   taken grows k by one (up to the request's maximum), some refused sets k to
//   what was taken plus one, none taken halves it; after `patience` steps in a
//   row that took nothing it stops proposing for a while (2, 4, ... 64 steps),
//   so a text that does not repeat costs the pipeline almost nothing extra.
//   It also weighs the trip time: from the steps' durations it learns what a
//   step without proposals takes (t, the trip) and what each proposed row adds
//   (c; with a draft model, its time to propose counts in), and from the refusals the chance a ≥ 0 that a proposal is taken; k is
//   then at most the k maximizing the expected tokens per millisecond,
//   (1 + a + ... + a^k) / (t + k c); and where speculative steps have in fact
//   cost more per token than a plain trip, none. Until a plain trip is timed
//   it proposes for two steps, then steps once without. Where proposals do not pay
//   (a short trip, costly rows or drafts, little taken) it proposes nothing,
//   trying again every 32 steps; one step in 16 goes without proposals to keep
//   t current. Long trips make every proposal worth it.

#include <cstdint>
#include <span>
#include <vector>

namespace strata::actors {

/// Up to `k` tokens that most earlier occurrences of `seq`'s last n tokens
/// continued with (the longest n in [min_ngram, max_ngram] that occurs); empty
/// when none does.
std::vector<int32_t> lookup_proposal(std::span<const int32_t> seq, std::size_t k, std::size_t max_ngram = 4,
                                     std::size_t min_ngram = 1);

class DraftControl {
public:
  /// `start`: the first steps' k (at most max; with a draft model each
  /// proposal costs a pass of it, so it starts small and grows as they are taken).
  explicit DraftControl(uint32_t max = 0, int patience = 3, uint32_t start = UINT32_MAX);
  /// Tokens to propose at the next step (0: step without proposals now).
  uint32_t next() const;
  /// A step that proposed `proposed` tokens took `accepted` of them; `ms`: how
  /// long the step took (< 0: unknown).
  void observe(uint32_t proposed, uint32_t accepted, double ms = -1);
  /// A step went without proposals (none found, cooling down, or not paying).
  void plain_step(double ms = -1);
  /// The proposer declined (a draft model busy with a crowd): no asking for
  /// the next `steps` steps.
  void declined(int steps = 32);
  uint32_t max() const { return max_; }
  /// What it learnt (negative: not yet): a step's time without proposals, the
  /// time one proposed row adds, the chance a proposal is taken.
  double trip_ms() const { return trip_ms_; }
  double row_ms() const { return row_ms_; }
  double acceptance() const;
  /// The k in [0, max] with the most expected tokens per millisecond (max
  /// while the times are not known).
  uint32_t paying() const;

private:
  uint32_t max_ = 0;
  uint32_t k_ = 0;
  int patience_ = 3;
  int refused_in_row_ = 0;
  int cooldown_ = 0;
  int pause_ = 1; // the next cooldown's length / 2
  double trip_ms_ = -1, row_ms_ = -1;
  double taken_ = 0, refusals_ = 0; // decaying counts: proposals taken, steps that refused one
  int unpaid_ = 0;                  // steps in a row that `paying` said 0 (every 32nd probes)
  int spec_steps_ = 0;              // speculative steps since the last plain one
  double spec_ms_per_token_ = -1;   // what speculative steps cost per token they yielded
};

} // namespace strata::actors
