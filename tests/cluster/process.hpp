#pragma once
// Test helper: runs `strata` subcommands as real child processes and reads
// their standard output line by line, with deadlines.

#include <chrono>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <poll.h>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

namespace strata::test {

class Process {
public:
  explicit Process(const std::vector<std::string>& args) {
    int out[2];
    if (::pipe(out) != 0)
      return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(out[1], STDOUT_FILENO);
      ::close(out[0]);
      ::close(out[1]);
      std::vector<char*> argv;
      for (auto& a : args)
        argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(out[1]);
    fd_ = out[0];
  }
  ~Process() {
    stop(SIGTERM);
    if (fd_ >= 0)
      ::close(fd_);
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }

  /// Reads output until a line starting with `prefix`; returns it, or "" at the deadline or EOF.
  std::string wait_line(const std::string& prefix, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      for (std::string line; next_line(line);)
        if (line.rfind(prefix, 0) == 0)
          return line;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0 || !read_some(static_cast<int>(left.count())))
        return {};
    }
  }
  /// Reads output until a line containing `text` (log lines start with a timestamp).
  std::string wait_containing(const std::string& text, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      for (std::string line; next_line(line);)
        if (line.find(text) != std::string::npos)
          return line;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0 || !read_some(static_cast<int>(left.count())))
        return {};
    }
  }
  /// Reads output until at least `n` bytes were printed in all (complete lines
  /// or not: streamed text has no newline until its end); false at the deadline or EOF.
  bool wait_bytes(std::size_t n, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (all_.size() + buf_.size() < n) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0 || !read_some(static_cast<int>(left.count())))
        return false;
    }
    return true;
  }
  /// The last line starting with `prefix` among what was printed so far, without
  /// waiting for more ("" if none).
  std::string last_line(const std::string& prefix) {
    while (read_some(0)) {
    }
    std::string last;
    for (std::string line; next_line(line);)
      if (line.rfind(prefix, 0) == 0)
        last = line;
    return last;
  }
  /// Everything printed so far (after waiting for the process to end).
  std::string drain() {
    wait_line("\x01never", std::chrono::seconds(60));
    return all_ + buf_;
  }
  void signal(int sig) {
    if (pid_ > 0)
      ::kill(pid_, sig);
  }
  /// Waits for the exit code (-1 when killed or still running at the deadline).
  int wait_exit(std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (pid_ > 0) {
      int status = 0;
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        exit_ = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        return exit_;
      }
      if (std::chrono::steady_clock::now() > deadline)
        return -1;
      read_some(20); // wait on output (or its end) instead of sleeping blindly
    }
    return exit_;
  }
  void stop(int sig) {
    if (pid_ <= 0)
      return;
    ::kill(pid_, SIGCONT);
    ::kill(pid_, sig);
    if (wait_exit(std::chrono::seconds(5)) == -1 && pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }

private:
  // Reads what is there within `timeout_ms`; false on timeout or end of output.
  bool read_some(int timeout_ms) {
    pollfd p{fd_, POLLIN, 0};
    if (fd_ < 0 || ::poll(&p, 1, timeout_ms) <= 0)
      return false;
    char tmp[4096];
    const auto n = ::read(fd_, tmp, sizeof tmp);
    if (n <= 0)
      return false;
    buf_.append(tmp, static_cast<std::size_t>(n));
    return true;
  }
  // Takes one complete line from what was read (kept for drain()).
  bool next_line(std::string& line) {
    const auto nl = buf_.find('\n');
    if (nl == std::string::npos)
      return false;
    line = buf_.substr(0, nl);
    buf_.erase(0, nl + 1);
    all_ += line + "\n";
    return true;
  }

  pid_t pid_ = -1;
  int fd_ = -1;
  int exit_ = -1;
  std::string buf_, all_;
};

} // namespace strata::test
