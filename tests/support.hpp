#pragma once
// Helpers shared by the tests: where ../shared is, skipping when it is absent,
// scratch directories, reading the reference JSON files.

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <cstdint>
#include <cstdio>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

namespace strata::test {

/// A free TCP port on loopback (bound once, then released; 0 on failure).
inline uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  uint16_t port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

/// A TCP connection to 127.0.0.1:port (-1 on failure); `receive_buffer` > 0 sets
/// SO_RCVBUF first (a client that reads slowly, or not at all).
inline int connect_to(uint16_t port, int receive_buffer = 0) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (receive_buffer > 0)
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

inline std::string shared_path(const std::string& rel) {
  return std::string(STRATA_SHARED_DIR) + "/" + rel;
}

inline bool have_shared(const std::string& rel) {
  return std::filesystem::exists(shared_path(rel));
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

/// A fresh, empty directory under the build tree for one test.
inline std::filesystem::path scratch_dir(const std::string& name) {
  auto p = std::filesystem::path(STRATA_BINARY_DIR) / "test-scratch" / name;
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p;
}

inline void write_file(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

/// What a shell command prints on stdout.
inline std::string command_output(const std::string& cmd) {
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
  std::string out;
  char buf[65536];
  std::size_t n;
  while (p && (n = fread(buf, 1, sizeof buf, p.get())) > 0)
    out.append(buf, n);
  return out;
}

/// Why a reference in Node cannot run ("" when node and `package` are installed
/// under the build tree's npm/ folder, where scripts/test puts them).
inline std::string npm_missing(const std::string& package) {
  if (command_output("command -v node").empty())
    return "node is not installed (scripts/test installs it)";
  const auto dir = std::filesystem::path(STRATA_BINARY_DIR) / "npm";
  if (!std::filesystem::exists(dir / "node_modules" / package))
    return package + " is not installed in " + dir.string() + " (scripts/test installs it)";
  return {};
}

} // namespace strata::test

/// Skips the test, saying why, when a file of ../shared is missing.
#define STRATA_REQUIRE_SHARED(rel)                                                                     \
  do {                                                                                                 \
    if (!::strata::test::have_shared(rel))                                                             \
      GTEST_SKIP() << "test data " << ::strata::test::shared_path(rel)                                \
                   << " is absent (../shared is not next to this checkout); skipping";                \
  } while (0)

/// Expects `stmt` to throw strata::model::Error with code `code` and a message containing `needle`.
#define EXPECT_MODEL_ERROR(stmt, expected_code, needle)                                                         \
  do {                                                                                                 \
    try {                                                                                              \
      stmt;                                                                                            \
      ADD_FAILURE() << "expected " #expected_code " from: " #stmt;                                              \
    } catch (const ::strata::model::Error& e_) {                                                       \
      EXPECT_EQ(e_.code(), expected_code) << e_.what();                                                         \
      EXPECT_NE(std::string(e_.what()).find(needle), std::string::npos)                                \
        << "message '" << e_.what() << "' lacks '" << needle << "'";                                  \
    }                                                                                                  \
  } while (0)
