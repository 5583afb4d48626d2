#pragma once
// The `strata` command line. Exit codes: 0 ok, 1 runtime failure, 2 usage error.

namespace strata::runtime {

int run_cli(int argc, char** argv);

} // namespace strata::runtime
