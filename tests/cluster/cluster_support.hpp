#pragma once
// What the multi-process tests share: running the strata executable, a plain
// cluster and a TLS cluster of `strata node` processes on loopback, certificates,
// ids lines, RSS.

#include "tests/cluster/process.hpp"
#include "tests/support.hpp"

#include <arpa/inet.h>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <netinet/in.h>
#include <sstream>
#include <string>
#include <sys/socket.h>
#include <unistd.h>
#include <vector>

namespace strata::clustertest {

using test::Process;

inline const std::string exe = STRATA_EXE;

struct Cluster {
  std::unique_ptr<Process> coordinator;
  std::vector<std::unique_ptr<Process>> nodes;
  std::string address; // HOST:PORT of the coordinator

  explicit Cluster(std::string listen = "127.0.0.1:0") { start_coordinator(listen); }
  void start_coordinator(const std::string& listen) {
    coordinator = std::make_unique<Process>(
      std::vector<std::string>{exe, "node", "--coordinator", "--listen", listen, "--route-wait-ms", "15000"});
    const auto line = coordinator->wait_line("ready coordinator ");
    address = line.empty() ? "" : line.substr(std::string("ready coordinator ").size());
  }
  Process& add(const std::string& layers, const std::string& model = "builtin:tiny") {
    nodes.push_back(std::make_unique<Process>(std::vector<std::string>{
      exe, "node", "--listen", "127.0.0.1:0", "--join", address, "--model", model, "--layers", layers, "--threads", "1"}));
    return *nodes.back();
  }
  bool add_ready(const std::string& layers) { return !add(layers).wait_line("ready node ").empty(); }
};

inline std::string run(const std::string& args) {
  Process p({"/bin/sh", "-c", exe + " " + args + " 2>&1"});
  return p.drain();
}

inline std::string ids_line(const std::string& out) {
  // The ids line is the one made only of digits and spaces.
  std::istringstream is(out);
  std::string line;
  while (std::getline(is, line))
    if (!line.empty() && line.find_first_not_of("0123456789 ") == std::string::npos)
      return line;
  return "";
}

inline const std::string prompt = "--prompt 'Once upon a time' --max-tokens 40 --output ids";

inline std::string local_ids() {
  return ids_line(run("generate --model builtin:tiny " + prompt));
}


// ---------------------------------------------------------------- TLS

inline bool have_openssl() { return run("certs --help").find("usage: strata certs") != std::string::npos &&
                             std::system("command -v openssl >/dev/null") == 0; }

// A CA with certificates for the coordinator, nodes and a client; a rogue CA
// with one certificate; and an expired certificate from the right CA. Making
// them takes seconds (RSA keys), so they are made once per build tree and shared,
// read-only, by the TLS tests; again when 30 days old.
inline std::string make_certs() {
  namespace fs = std::filesystem;
  const fs::path cache = fs::path(STRATA_BINARY_DIR) / "test-certs";
  std::error_code ec;
  const auto made = fs::last_write_time(cache / "complete", ec);
  if (!ec && made > fs::file_time_type::clock::now() - std::chrono::hours(24 * 30))
    return cache.string();
  const auto dir = test::scratch_dir("tls-" + std::to_string(::getpid())).string();
  run("certs init --dir " + dir + "/ca");
  for (auto n : {"coord", "n0", "n1", "n2", "client"})
    run("certs issue --dir " + dir + "/ca --name " + n);
  run("certs issue --dir " + dir + "/ca --name expired --days 0");
  run("certs init --dir " + dir + "/rogue");
  run("certs issue --dir " + dir + "/rogue --name rogue");
  std::ofstream(dir + "/complete") << "made by make_certs\n";
  fs::remove_all(cache, ec);
  fs::rename(dir, cache, ec); // a test that made them at the same time may have won: then ours serve us
  return ec ? dir : cache.string();
}

inline std::vector<std::string> tls_args(const std::string& dir, const std::string& name, const std::string& ca = "ca") {
  const std::string d = dir + "/" + (name == "rogue" ? "rogue" : "ca");
  return {"--tls-cert", d + "/" + name + ".pem", "--tls-key", d + "/" + name + ".key", "--tls-ca", dir + "/" + ca + "/ca.pem"};
}

inline std::string flat(const std::vector<std::string>& v) {
  std::string s;
  for (auto& x : v)
    s += " " + x;
  return s;
}

using test::free_port;

inline long rss_kb(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0)
      return std::atol(line.c_str() + 6);
  return -1;
}

struct TlsCluster {
  std::string dir = make_certs();
  std::unique_ptr<Process> coordinator;
  std::vector<std::unique_ptr<Process>> nodes;
  std::vector<uint16_t> ports;
  std::string address;
  TlsCluster() {
    auto args = std::vector<std::string>{exe, "node", "--coordinator", "--listen", "127.0.0.1:0"};
    for (auto& x : tls_args(dir, "coord"))
      args.push_back(x);
    coordinator = std::make_unique<Process>(args);
    const auto line = coordinator->wait_line("ready coordinator ");
    address = line.empty() ? "" : line.substr(std::string("ready coordinator ").size());
    int i = 0;
    for (auto layers : {"0-1", "2-3", "4"}) {
      ports.push_back(free_port());
      auto a = std::vector<std::string>{exe, "node", "--listen", "127.0.0.1:" + std::to_string(ports.back()), "--join",
                                        address, "--model", "builtin:tiny", "--layers", layers, "--threads", "1"};
      for (auto& x : tls_args(dir, "n" + std::to_string(i++)))
        a.push_back(x);
      nodes.push_back(std::make_unique<Process>(a));
      nodes.back()->wait_line("ready node ");
    }
  }
};


// The node id in the "ready node ID layers ..." line.
inline std::string node_id(const std::string& ready) {
  const auto a = std::string("ready node ").size();
  return ready.substr(a, ready.find(' ', a) - a);
}

} // namespace strata::clustertest
