#include "model/transformer/math_thread.hpp"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace strata::model {

namespace {

// The queue and its thread. Never destroyed: the thread waits for work until
// the process ends (joining it from a static destructor would race with
// libgomp's own teardown of the thread's team).
struct MathThread {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  std::atomic<uint64_t> ran{0};
  std::thread::id id;

  MathThread() {
    std::thread t([this] { loop(); });
    id = t.get_id();
    t.detach();
  }

  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(m);
        cv.wait(lock, [&] { return !queue.empty(); });
        task = std::move(queue.front());
        queue.pop_front();
      }
      ran.fetch_add(1, std::memory_order_relaxed); // (before: counted when its caller wakes)
      task(); // a packaged_task: whatever it throws goes to its caller
    }
  }
};

MathThread& math_thread() {
  static MathThread* t = new MathThread;
  return *t;
}

} // namespace

void detail::post_math(std::function<void()> task) {
  auto& t = math_thread();
  {
    std::lock_guard lock(t.m);
    t.queue.push_back(std::move(task));
  }
  t.cv.notify_one();
}

bool on_math_thread() {
  return std::this_thread::get_id() == math_thread().id;
}

uint64_t math_tasks_run() {
  return math_thread().ran.load(std::memory_order_relaxed);
}

} // namespace strata::model
