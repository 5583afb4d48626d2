// The math threads of a thread that loaded a model are let go when the load
// returns (release_math_threads): the shard's math runs on another thread, and
// libgomp, while it manages more threads than there are CPUs, stops its threads
// spinning between parallel regions (each region then woke them through the
// kernel: a node decoded 1.5-2x slower on 2 vCPUs).

#include "model/transformer/shard.hpp"

#include <gtest/gtest.h>

#include <omp.h>

#include <chrono>
#include <filesystem>
#include <thread>

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

} // namespace
} // namespace strata
