#include "actors/scheduler.hpp"

#include <algorithm>
#include <set>

namespace strata::actors {

StepScheduler::StepScheduler(SchedulerLimits limits) : limits_(limits) {
  limits_.max_batch_tokens = std::max<int64_t>(1, limits_.max_batch_tokens);
  limits_.prefill_chunk = std::clamp<int64_t>(limits_.prefill_chunk, 1, limits_.max_batch_tokens);
  limits_.max_queue = std::max<std::size_t>(1, limits_.max_queue);
}

void StepScheduler::push(QueuedStep step) {
  queue_.push_back(std::move(step));
}

int64_t StepScheduler::piece_end(const QueuedStep& s, int64_t begin) const {
  const int64_t c = limits_.prefill_chunk;
  const int64_t end = std::min(s.rows, (begin / c + 1) * c);
  // A speculative step's proposals and the row before them end up in one piece
  // (the tail verifies them all from the last piece's logits).
  return s.rows - end <= static_cast<int64_t>(s.req.draft) ? s.rows : end;
}

std::vector<StepScheduler::Piece> StepScheduler::pick() {
  std::vector<Piece> round;
  std::set<std::string> sessions; // seen in queue order: only each session's oldest step may run
  std::vector<iterator> decodes, prefills;
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    if (!sessions.insert(it->req.session).second)
      continue;
    (it->req.mode == static_cast<uint8_t>(msg::step_mode::decode) && !it->rebuilt && it->done == 0 ? decodes : prefills).push_back(it);
  }
  int64_t budget = limits_.max_batch_tokens;
  auto take = [&](iterator it) {
    const int64_t end = piece_end(*it, it->done);
    const int64_t n = end - it->done;
    if (n > budget && !round.empty())
      return;
    round.push_back(Piece{it, it->done, end});
    budget -= n;
  };
  for (auto it : decodes)
    take(it);
  for (auto it : prefills)
    take(it);
  return round;
}

} // namespace strata::actors
