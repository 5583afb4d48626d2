#pragma once
// The `strata` command line. Exit codes: 0 ok, 1 runtime failure, 2 usage error.

#include <functional>
#include <map>
#include <string>

namespace strata::runtime {

/// A subcommand: (argc, argv) of the whole command line -> exit code.
using Command = std::function<int(int, char**)>;

/// Runs `strata ARGS...`. `extra` adds subcommands from libraries above this
/// one (e.g. `serve` from strata_server), with the same error handling.
int run_cli(int argc, char** argv, const std::map<std::string, Command>& extra = {});

} // namespace strata::runtime
