#include "runtime/cli.hpp"

int main(int argc, char** argv) {
  return strata::runtime::run_cli(argc, argv);
}
