// Clears OpenSSL's per-thread error queue before every TLS read, write and
// handshake that CAF 0.17's OpenSSL module makes.
//
// CAF 0.17 does not clear the queue after a failed TLS operation. When one
// peer goes away without a TLS close (a client that exits, a node killed with
// -9), the error left in the queue of the I/O thread made the next operation
// on another, healthy connection look failed, and CAF closed it: every node
// connected to a coordinator was dropped when one TLS client exited (measured
// here: 3 of 3 nodes, every time). OpenSSL documents that the queue must be
// empty before SSL_get_error() is used. These definitions interpose on
// libssl's (the executable's symbols win in the dynamic linker's lookup) and
// call the real functions after clearing the queue.

#include "runtime/frame_guard.hpp"

#include <cstdint>
#include <dlfcn.h>

namespace {

using clear_fn = void (*)();
using io_fn = int (*)(void*, void*, int);
using hs_fn = int (*)(void*);

clear_fn clear_errors() {
  static auto f = reinterpret_cast<clear_fn>(::dlsym(RTLD_DEFAULT, "ERR_clear_error"));
  return f;
}

template <class F>
F next(const char* name) {
  return reinterpret_cast<F>(::dlsym(RTLD_NEXT, name));
}

void clear() {
  if (auto f = clear_errors())
    f();
}

} // namespace

extern "C" {

int SSL_read(void* ssl, void* buf, int num) {
  static auto real = next<io_fn>("SSL_read");
  using strata::runtime::frames::stream;
  clear();
  const int n = real(ssl, buf, num);
  // A frame that announces too much fails the read (runtime/frame_guard), and
  // every later read of that connection too.
  if (n > 0 && !strata::runtime::frames::feed(stream::tls, reinterpret_cast<uintptr_t>(ssl),
                                              static_cast<const unsigned char*>(buf), static_cast<std::size_t>(n)))
    return -1;
  return n;
}

void SSL_free(void* ssl) {
  static auto real = next<void (*)(void*)>("SSL_free");
  strata::runtime::frames::forget(strata::runtime::frames::stream::tls, reinterpret_cast<uintptr_t>(ssl));
  real(ssl);
}

int SSL_write(void* ssl, const void* buf, int num) {
  static auto real = next<io_fn>("SSL_write");
  clear();
  return real(ssl, const_cast<void*>(buf), num);
}

int SSL_accept(void* ssl) {
  static auto real = next<hs_fn>("SSL_accept");
  clear();
  return real(ssl);
}

int SSL_connect(void* ssl) {
  static auto real = next<hs_fn>("SSL_connect");
  clear();
  return real(ssl);
}

} // extern "C"
