#pragma once
// Benchmarks only: elapsed milliseconds, percentiles, and the models a bench runs.

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
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

/// The models named after the bench's name (argv[2] on); none named: `builtin`,
/// then `shared` where that file exists (../shared is not in a user's clone).
inline std::vector<std::string> models_or(int argc, char** argv, const std::string& builtin, const std::string& shared) {
  std::vector<std::string> models(argv + std::min(argc, 2), argv + argc);
  if (models.empty()) {
    models.push_back(builtin);
    if (std::filesystem::exists(shared))
      models.push_back(shared);
  }
  return models;
}

} // namespace strata::bench
