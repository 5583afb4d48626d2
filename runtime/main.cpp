#include "runtime/cli.hpp"
#include "runtime/cluster.hpp"
#include "server/http_server.hpp"

int main(int argc, char** argv) {
  // Without destructors: a client's actor system is never torn down (see client_system).
  strata::runtime::end_process(strata::runtime::run_cli(argc, argv, {{"serve", strata::server::run_serve}}));
}
