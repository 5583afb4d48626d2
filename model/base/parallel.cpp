// The math threads: one OpenMP team per calling thread, sized once per change
// of the process's setting (parallel.hpp).

#include "model/base/parallel.hpp"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <utility>

namespace strata::model::detail {

namespace {

std::atomic<int> wanted{0};        // 0: the default
std::atomic<int> generation{1};    // bumped by every set_team_size

// Physical cores among the CPUs this process may run on: a core's hardware
// threads share its vector units, which the kernels keep busy.
int physical_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) {
    const unsigned n = std::thread::hardware_concurrency();
    return n > 0 ? static_cast<int>(n) : 1;
  }
  std::set<std::pair<std::string, std::string>> cores;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (!CPU_ISSET(c, &set))
      continue;
    const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
    std::ifstream pkg(dir + "physical_package_id"), core(dir + "core_id");
    std::string p, k;
    if (!(pkg >> p) || !(core >> k))
      return CPU_COUNT(&set); // no topology: every CPU counts
    cores.emplace(p, k);
  }
  return std::max<int>(1, static_cast<int>(cores.size()));
}

int compute_default() {
  if (const char* env = std::getenv("OMP_NUM_THREADS"); env && *env) {
    const int n = std::atoi(env);
    if (n > 0)
      return n;
  }
  return physical_cores();
}

// Applies the process's setting to the calling thread when it changed since
// this thread last looked.
inline void apply() {
  thread_local int seen = 0;
  const int g = generation.load(std::memory_order_acquire);
  if (g == seen)
    return;
  const int n = wanted.load(std::memory_order_relaxed);
  omp_set_num_threads(n > 0 ? n : default_team_size());
  seen = g;
}

} // namespace

int default_team_size() {
  static const int n = compute_default();
  return n;
}

void set_team_size(int n) {
  wanted.store(n > 0 ? n : 0, std::memory_order_relaxed);
  generation.fetch_add(1, std::memory_order_acq_rel);
}

int team_size() {
  apply();
  return omp_get_max_threads();
}

bool in_parallel_region() { return omp_in_parallel() != 0; }

void parallel_for_impl(int64_t begin, int64_t end, int64_t grain, RangeFn fn, const void* ctx) {
  if (begin >= end)
    return;
  const int64_t n = end - begin;
  if (n <= std::max<int64_t>(grain, 1) || omp_in_parallel() || team_size() <= 1) {
    fn(ctx, begin, end);
    return;
  }
  std::exception_ptr error;
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
  // The whole team starts (a num_threads clause that changes from region to
  // region makes libgomp rebuild its team); threads beyond the pieces idle.
#pragma omp parallel
  {
    int64_t threads = omp_get_num_threads();
    if (grain > 0)
      threads = std::min<int64_t>(threads, (n + grain - 1) / grain);
    const int64_t chunk = (n + threads - 1) / threads;
    const int64_t b = begin + omp_get_thread_num() * chunk;
    if (b < end) {
      try {
        fn(ctx, b, std::min(end, b + chunk));
      } catch (...) {
        if (!failed.test_and_set())
          error = std::current_exception();
      }
    }
  }
  if (error)
    std::rethrow_exception(error);
}

} // namespace strata::model::detail
