#pragma once
// The process's one math thread: every shard actor's (and the draft model's)
// forward passes run there, one after another, so one OpenMP team of
// set_num_threads() threads serves all of a process's math. Where each caller
// ran its math on its own thread, every such thread kept a team: on 2 vCPUs
// with two shard actors, libgomp then managed more threads than CPUs and put
// every team's threads to sleep at each parallel region (woken through the
// kernel at the next one), and shard actors that computed at once fought for
// the same cores.
//
// The caller waits for its work (a detached actor's thread: nothing else
// waits on it). Work is done in the order it was handed in.

#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <type_traits>
#include <utility>

namespace strata::model {

namespace detail {
/// Queues `task` for the math thread (started on first use).
void post_math(std::function<void()> task);
} // namespace detail

/// Whether the calling thread is the math thread.
bool on_math_thread();

/// How many pieces of work the math thread has taken up (for tests).
uint64_t math_tasks_run();

/// Runs f() on the math thread and returns what it returns; an exception f
/// throws is thrown here. Called on the math thread itself, f runs in place.
template <class F>
std::invoke_result_t<F&> run_math(F&& f) {
  using R = std::invoke_result_t<F&>;
  if (on_math_thread())
    return f();
  std::packaged_task<R()> task([&f]() -> R { return f(); });
  auto done = task.get_future();
  detail::post_math([&task] { task(); });
  return done.get();
}

} // namespace strata::model
