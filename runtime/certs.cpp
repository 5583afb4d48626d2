#include "runtime/certs.hpp"

#include "model/base/error.hpp"
#include "runtime/args.hpp"

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <unistd.h>
#include <iostream>
#include <fcntl.h>
#include <spawn.h>
#include <string>
#include <sys/stat.h>
#include <sys/wait.h>
#include <vector>

extern char** environ;

namespace strata::runtime {

namespace {

namespace fs = std::filesystem;

// Runs `openssl ARGS...`; throws with its exit status when it fails.
void openssl(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  std::string prog = "openssl";
  argv.push_back(prog.data());
  std::vector<std::string> copy = args;
  for (auto& a : copy)
    argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  // Its chatter goes to a log that is shown only when it fails.
  char log[] = "/tmp/strata-certs-XXXXXX";
  const int log_fd = ::mkstemp(log);
  if (log_fd >= 0)
    posix_spawn_file_actions_adddup2(&fa, log_fd, STDERR_FILENO);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, "openssl", &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  std::string chatter;
  auto read_log = [&] {
    if (log_fd < 0)
      return;
    std::ifstream in(log);
    chatter.assign(std::istreambuf_iterator<char>(in), {});
    ::close(log_fd);
    ::unlink(log);
  };
  if (rc != 0)
    read_log();
  if (rc != 0)
    throw model::Error(model::errc::io, "cannot run 'openssl' (install Debian's openssl package)");
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  read_log();
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw model::Error(model::errc::io, "'openssl " + args.front() + "' failed (exit status " +
                                          std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) + "): " + chatter);
}

void check_name(const std::string& name) {
  if (name.empty() || name.size() > 64 ||
      name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") != std::string::npos ||
      name[0] == '.' || name == "ca")
    throw UsageError("--name: '" + name + "' must be 1-64 letters, digits, '.', '_' or '-', not start with '.', "
                     "and not be 'ca'");
}

} // namespace

int run_certs(int argc, char** argv) {
  Args a;
  a.option("dir", "DIR", "where the CA and certificates live (default: certs)")
    .option("name", "NAME", "issue: the certificate's name (file NAME.pem / NAME.key, CN=NAME)")
    .option("days", "N", "validity in days (default: CA 3650, certificates 825)");
  a.parse(argc, argv, 2, "init|issue");
  if (a.help_requested()) {
    std::cout << "usage: strata certs init [--dir DIR] | strata certs issue --name NAME [--dir DIR] [--days N]\n\n"
              << "init: creates the cluster CA (DIR/ca.pem, DIR/ca.key). issue: creates DIR/NAME.pem and\n"
              << "DIR/NAME.key signed by it. Give each node and client --tls-cert DIR/NAME.pem --tls-key\n"
              << "DIR/NAME.key --tls-ca DIR/ca.pem. Keep ca.key off the nodes.\n\noptions:\n"
              << a.help_text();
    return 0;
  }
  if (a.positionals().size() != 1 || (a.positionals()[0] != "init" && a.positionals()[0] != "issue"))
    throw UsageError("give exactly one of: init, issue");
  const bool init = a.positionals()[0] == "init";
  const fs::path dir = a.has("dir") ? a.str("dir") : "certs";
  const fs::path ca_pem = dir / "ca.pem", ca_key = dir / "ca.key";
  const mode_t old_mask = ::umask(077); // keys readable by their owner only
  if (init) {
    if (fs::exists(ca_key))
      throw UsageError("'" + ca_key.string() + "' exists already; refusing to replace the cluster's CA");
    fs::create_directories(dir);
    const auto days = std::to_string(a.integer("days", 3650, 1, 36500));
    openssl({"req", "-x509", "-newkey", "rsa:2048", "-sha256", "-nodes", "-keyout", ca_key.string(), "-out",
             ca_pem.string(), "-days", days, "-subj", "/CN=strata cluster CA", "-addext",
             "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"});
    ::umask(old_mask);
    std::cout << "created " << ca_pem.string() << " and " << ca_key.string() << "\n";
    return 0;
  }
  const std::string name = a.required("name");
  check_name(name);
  if (!fs::exists(ca_pem) || !fs::exists(ca_key))
    throw UsageError("no CA in '" + dir.string() + "' (run 'strata certs init --dir " + dir.string() + "' first)");
  const fs::path pem = dir / (name + ".pem"), key = dir / (name + ".key"), csr = dir / (name + ".csr");
  const auto days = std::to_string(a.integer("days", 825, 0, 36500)); // 0: expired at once (for tests)
  openssl({"req", "-newkey", "rsa:2048", "-sha256", "-nodes", "-keyout", key.string(), "-out", csr.string(), "-subj",
           "/CN=" + name});
  openssl({"x509", "-req", "-sha256", "-in", csr.string(), "-CA", ca_pem.string(), "-CAkey", ca_key.string(),
           "-CAcreateserial", "-out", pem.string(), "-days", days});
  fs::remove(csr);
  ::umask(old_mask);
  std::cout << "created " << pem.string() << " and " << key.string() << " (CN=" << name << ", " << days
            << " days)\n";
  return 0;
}

} // namespace strata::runtime
