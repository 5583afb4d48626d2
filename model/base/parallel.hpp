#pragma once
// Internal to model/: the process's math threads. One OpenMP team (libgomp)
// serves our kernels and oneDNN's sgemm alike; parallel_for splits a range of
// independent pieces of work over it.
//
// OpenMP keeps its thread count per calling thread (a count set on one thread
// does not reach another), so the count set_team_size() sets is applied to a
// thread the first time it calls parallel_for or team_size() after a change.

#include <cstdint>

namespace strata::model::detail {

/// Sets the team's size for every thread of the process (n > 0); n <= 0 goes
/// back to the default: OMP_NUM_THREADS where it is set, else the physical
/// cores this process may run on.
void set_team_size(int n);

/// The calling thread's team size (after applying the process's setting).
int team_size();

/// The default set_team_size(0) stands for.
int default_team_size();

/// Whether the caller runs inside a parallel region (a team's thread).
bool in_parallel_region();

using RangeFn = void (*)(const void* ctx, int64_t begin, int64_t end);
void parallel_for_impl(int64_t begin, int64_t end, int64_t grain, RangeFn fn, const void* ctx);

/// Calls f(b, e) on consecutive pieces covering [begin, end), one piece per
/// team thread: as many threads as pieces of at least `grain` items (or 1),
/// the range split into equal pieces in order. Runs f(begin, end) on the
/// calling thread when that is one piece, the team has one thread, or the
/// caller is itself a team thread. The first exception f throws is thrown here
/// once every piece has finished.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  parallel_for_impl(begin, end, grain,
                    [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &f);
}

} // namespace strata::model::detail
