// The process's one math thread (run_math): every caller's work runs there,
// one OpenMP team serving them all. And the math threads of a thread that
// loaded a model are let go when the load returns (release_math_threads): the
// shard's math runs on the math thread, and libgomp, while it manages more
// threads than there are CPUs, stops its threads spinning between parallel
// regions (each region then woke them through the kernel: a node decoded
// 1.5-2x slower on 2 vCPUs).

#include "model/base/error.hpp"
#include "model/transformer/math_thread.hpp"
#include "model/transformer/shard.hpp"

#include <gtest/gtest.h>

#include <omp.h>

#include <chrono>
#include <filesystem>
#include <latch>
#include <set>
#include <thread>
#include <vector>

namespace strata {
namespace {

std::size_t threads_now() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task"))
    ++n;
  return n;
}

// Waits (up to 10 s) until the process has `want` threads: a released team's
// threads leave on their own after they are told to.
std::size_t settle_at(std::size_t want) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  std::size_t n = threads_now();
  while (n != want && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
    n = threads_now();
  }
  return n;
}

// A parallel region of 3 threads on the calling thread: its team (2 more threads) stays.
void start_team() {
  int ran = 0;
#pragma omp parallel num_threads(3) reduction(+ : ran)
  ran += 1;
  ASSERT_EQ(ran, 3);
}

TEST(MathThreads, ReleaseLetsTheCallingThreadsTeamGo) {
  // On a thread of its own: it starts with no team, and stays while counted.
  std::size_t base = 0, with_team = 0, after = 0, again = 0;
  std::thread t([&] {
    base = threads_now();
    start_team();
    with_team = threads_now();
    model::release_math_threads();
    after = settle_at(base);
    start_team(); // math on this thread again gets a new team
    again = threads_now();
    model::release_math_threads();
  });
  t.join();
  EXPECT_EQ(with_team, base + 2);
  EXPECT_EQ(after, base);
  EXPECT_EQ(again, base + 2);
}

TEST(MathThreads, LoadingLetsTheLoadingThreadsTeamGo) {
  std::size_t base = 0, with_team = 0, after = 0;
  int64_t layers = 0;
  std::thread t([&] {
    base = threads_now();
    start_team();
    with_team = threads_now();
    auto shard = model::Shard::load("builtin:tiny");
    layers = shard->config().n_layers;
    after = settle_at(base);
  });
  t.join();
  EXPECT_GT(layers, 0);
  EXPECT_EQ(with_team, base + 2);
  EXPECT_EQ(after, base) << "the loading thread's math threads are still there";
}

TEST(MathThreads, AFailedLoadLetsTheTeamGoToo) {
  std::size_t base = 0, after = 0;
  bool threw = false;
  std::thread t([&] {
    base = threads_now();
    start_team();
    try {
      model::Shard::load("builtin:no-such-model");
    } catch (const std::exception&) {
      threw = true;
    }
    after = settle_at(base);
  });
  t.join();
  EXPECT_TRUE(threw);
  EXPECT_EQ(after, base);
}

TEST(MathThreads, RunMathRunsEveryCallersWorkOnOneThread) {
  constexpr int callers = 4, calls = 50;
  std::vector<std::vector<std::thread::id>> seen(callers);
  std::vector<std::thread::id> caller_ids(callers);
  std::vector<int> sums(callers, 0);
  std::vector<std::thread> ts;
  for (int c = 0; c < callers; ++c)
    ts.emplace_back([&, c] {
      caller_ids[static_cast<std::size_t>(c)] = std::this_thread::get_id();
      EXPECT_FALSE(model::on_math_thread());
      for (int i = 0; i < calls; ++i)
        sums[static_cast<std::size_t>(c)] += model::run_math([&] {
          EXPECT_TRUE(model::on_math_thread());
          seen[static_cast<std::size_t>(c)].push_back(std::this_thread::get_id());
          return c * 1000 + i;
        });
    });
  for (auto& t : ts)
    t.join();
  std::set<std::thread::id> ids;
  for (int c = 0; c < callers; ++c) {
    EXPECT_EQ(sums[static_cast<std::size_t>(c)], calls * c * 1000 + calls * (calls - 1) / 2) << "caller " << c;
    ASSERT_EQ(seen[static_cast<std::size_t>(c)].size(), static_cast<std::size_t>(calls));
    ids.insert(seen[static_cast<std::size_t>(c)].begin(), seen[static_cast<std::size_t>(c)].end());
  }
  ASSERT_EQ(ids.size(), 1u) << "work ran on more than one thread";
  for (const auto& id : caller_ids)
    EXPECT_NE(*ids.begin(), id);
}

TEST(MathThreads, RunMathHandsAnExceptionToItsCaller) {
  try {
    model::run_math([]() -> int { throw model::Error(model::errc::bad_argument, "no such tensor"); });
    ADD_FAILURE() << "no exception";
  } catch (const model::Error& e) {
    EXPECT_EQ(e.code(), model::errc::bad_argument);
    EXPECT_NE(std::string(e.what()).find("no such tensor"), std::string::npos);
  }
  EXPECT_EQ(model::run_math([] { return 7; }), 7) << "the math thread goes on after a throw";
}

TEST(MathThreads, RunMathOnTheMathThreadRunsInPlace) {
  const auto id = model::run_math([] { return std::this_thread::get_id(); });
  EXPECT_EQ(model::run_math([] { return model::run_math([] { return std::this_thread::get_id(); }); }), id);
}

TEST(MathThreads, OneTeamServesEveryCaller) {
  // A parallel region through run_math starts the math thread's team; two more
  // callers' regions through it then reuse that team. Counted while the
  // callers still live: only the callers themselves are added (a region run on
  // each caller's own thread would add a team of 2 more threads each).
  model::run_math([] {
    start_team();
    return 0;
  });
  const std::size_t with_team = threads_now();
  std::latch ran(2), counted(1);
  std::vector<std::thread> ts;
  for (int c = 0; c < 2; ++c)
    ts.emplace_back([&] {
      model::run_math([] {
        start_team();
        return 0;
      });
      ran.count_down();
      counted.wait();
    });
  ran.wait();
  EXPECT_EQ(threads_now(), with_team + 2);
  counted.count_down();
  for (auto& t : ts)
    t.join();
}

} // namespace
} // namespace strata
