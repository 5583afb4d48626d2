// Feeds runtime/frame_guard from the reads CAF 0.17 makes: recv() for plain
// TCP (policy::tcp::read_some) and SSL_read() for TLS (see ssl_errors.cpp, which
// interposes on SSL_read too and calls frame_guard_tls_read). Like ssl_errors.cpp,
// these definitions are in the executable, so the dynamic linker binds CAF's
// calls to them; they call the real functions.

#include "runtime/frame_guard.hpp"

#include <cerrno>
#include <dlfcn.h>
#include <sys/socket.h>
#include <sys/types.h>

namespace {

using recv_fn = ssize_t (*)(int, void*, size_t, int);
using close_fn = int (*)(int);

// An internet stream socket (not a pipe, a unix socket or a file).
bool internet_stream(uintptr_t key) {
  const int fd = static_cast<int>(key);
  int type = 0;
  socklen_t len = sizeof type;
  if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM)
    return false;
  sockaddr_storage addr{};
  socklen_t alen = sizeof addr;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &alen) != 0)
    return false;
  return addr.ss_family == AF_INET || addr.ss_family == AF_INET6;
}

} // namespace

using strata::runtime::frames::stream;

extern "C" {

ssize_t recv(int fd, void* buf, size_t len, int flags) {
  static auto real = reinterpret_cast<recv_fn>(::dlsym(RTLD_NEXT, "recv"));
  const ssize_t n = real(fd, buf, len, flags);
  if (n > 0 && !(flags & MSG_PEEK) &&
      !strata::runtime::frames::feed(stream::tcp, static_cast<uintptr_t>(fd), static_cast<const unsigned char*>(buf),
                                     static_cast<std::size_t>(n), internet_stream)) {
    errno = ECONNRESET;
    return -1;
  }
  return n;
}

int close(int fd) {
  static auto real = reinterpret_cast<close_fn>(::dlsym(RTLD_NEXT, "close"));
  strata::runtime::frames::forget(stream::tcp, static_cast<uintptr_t>(fd));
  return real(fd);
}

} // extern "C"
