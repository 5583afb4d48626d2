// The math threads' parallel_for (model/base/parallel.hpp): what ATen's did for
// us before strata dropped libtorch, checked on its own.

#include "model/base/parallel.hpp"
#include "model/transformer/shard.hpp"

#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

namespace strata {
namespace {

using model::detail::parallel_for;
using model::detail::team_size;

// Restores the process's team size when a test ends.
struct KeepTeamSize {
  int before = model::num_threads();
  ~KeepTeamSize() { model::set_num_threads(before); }
};

struct Piece {
  int64_t begin, end;
  int thread;
};

std::vector<Piece> pieces_of(int64_t begin, int64_t end, int64_t grain) {
  std::mutex m;
  std::vector<Piece> out;
  parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    std::lock_guard<std::mutex> lock(m);
    out.push_back({b, e, omp_get_thread_num()});
  });
  std::sort(out.begin(), out.end(), [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  return out;
}

TEST(ParallelFor, PiecesCoverTheRangeInOrderOnePerThread) {
  const KeepTeamSize keep;
  model::set_num_threads(3);
  ASSERT_EQ(team_size(), 3);
  for (const auto& [n, grain] : std::vector<std::pair<int64_t, int64_t>>{
         {1, 0}, {2, 0}, {3, 1}, {7, 1}, {10, 0}, {10, 4}, {10, 9}, {10, 10}, {100, 16}, {1000, 1}}) {
    SCOPED_TRACE("n " + std::to_string(n) + " grain " + std::to_string(grain));
    const auto p = pieces_of(5, 5 + n, grain);
    // As many pieces as threads, at most one per `grain` items; serial when one piece.
    const int64_t want = n <= std::max<int64_t>(grain, 1) ? 1
                         : grain > 0 ? std::min<int64_t>(3, (n + grain - 1) / grain) : std::min<int64_t>(3, n);
    const int64_t chunk = (n + want - 1) / want;
    int64_t at = 5;
    std::set<int> threads;
    for (const auto& piece : p) {
      EXPECT_EQ(piece.begin, at);
      EXPECT_EQ(piece.end, std::min<int64_t>(5 + n, at + chunk));
      at = piece.end;
      threads.insert(piece.thread);
    }
    EXPECT_EQ(at, 5 + n);
    EXPECT_EQ(threads.size(), p.size()); // each piece on a thread of its own
    EXPECT_LE(static_cast<int64_t>(p.size()), want);
    EXPECT_GE(static_cast<int64_t>(p.size()), want - 1); // (equal pieces: the last may be empty)
  }
  EXPECT_TRUE(pieces_of(4, 4, 0).empty());
  EXPECT_TRUE(pieces_of(4, 2, 0).empty());
}

TEST(ParallelFor, OneThreadOrANestedCallRunsInPlace) {
  const KeepTeamSize keep;
  model::set_num_threads(1);
  auto p = pieces_of(0, 100, 1);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].begin, 0);
  EXPECT_EQ(p[0].end, 100);
  model::set_num_threads(2);
  std::atomic<int> inner_pieces{0}, nested{0};
  parallel_for(0, 2, 1, [&](int64_t, int64_t) {
    EXPECT_TRUE(model::detail::in_parallel_region());
    parallel_for(0, 50, 1, [&](int64_t b, int64_t e) {
      ++inner_pieces;
      nested += static_cast<int>(e - b);
    });
  });
  EXPECT_EQ(inner_pieces.load(), 2); // one whole piece per outer piece
  EXPECT_EQ(nested.load(), 100);
  EXPECT_FALSE(model::detail::in_parallel_region());
}

TEST(ParallelFor, TheFirstExceptionIsThrownAfterEveryPieceFinished) {
  const KeepTeamSize keep;
  model::set_num_threads(2);
  std::atomic<int> finished{0};
  try {
    parallel_for(0, 2, 1, [&](int64_t b, int64_t) {
      if (b == 0)
        throw std::runtime_error("piece 0 failed");
      finished = 1;
    });
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "piece 0 failed");
  }
  EXPECT_EQ(finished.load(), 1);
  // And the team still works afterwards.
  EXPECT_EQ(pieces_of(0, 10, 1).size(), 2u);
}

TEST(ParallelFor, ASettingReachesThreadsThatStartedBeforeIt) {
  const KeepTeamSize keep;
  model::set_num_threads(2);
  int seen_before = 0, seen_after = 0;
  std::atomic<int> step{0};
  std::thread t([&] {
    seen_before = team_size();
    step = 1;
    while (step.load() != 2)
      std::this_thread::yield();
    seen_after = team_size();
  });
  while (step.load() != 1)
    std::this_thread::yield();
  model::set_num_threads(3);
  step = 2;
  t.join();
  EXPECT_EQ(seen_before, 2);
  EXPECT_EQ(seen_after, 3);
  EXPECT_GE(model::detail::default_team_size(), 1);
}

} // namespace
} // namespace strata
