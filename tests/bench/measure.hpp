#pragma once
// Benchmarks only: elapsed milliseconds and percentiles.

#include <algorithm>
#include <chrono>
#include <vector>

namespace strata::bench {

inline double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

/// The q-quantile (0..1) of v; 0 for an empty v.
inline double pct(std::vector<double> v, double q) {
  if (v.empty())
    return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))];
}

} // namespace strata::bench
