#pragma once
// Bounds the frames a peer may announce on a BASP connection (plain or TLS).
//
// CAF 0.17 reads a 32-byte BASP header and then resizes its read buffer to the
// payload length the header claims, up to 4 GiB, before a single payload byte
// arrives: one forged header made a node zero-fill gigabytes, stall past its
// liveness bound and be declared dead. The guard follows every BASP stream
// (frame by frame, as the bytes are read) and refuses a connection whose next
// frame claims more than the limit before CAF sees that header. The hooks that
// feed it live in the `strata` executable (frame_guard_hooks.cpp: recv and close
// for plain TCP, SSL_read and SSL_free for TLS).

#include <cstddef>
#include <cstdint>

namespace strata::runtime::frames {

/// Largest payload one BASP frame may announce (default 65 MiB).
void set_limit(uint64_t bytes);
uint64_t limit();

/// Kinds of streams the guard follows.
enum class stream : uint8_t { tcp, tls };

/// Whether the bytes of a TCP connection are BASP (the first byte of a BASP
/// frame is its message type, a small number; an HTTP request starts with a
/// letter). Streams that are not are never looked at again.
bool is_basp_start(unsigned char first_byte);

/// Feeds `n` bytes just read from connection `key` (a file descriptor for tcp,
/// an SSL* for tls). `classify` is called for a tcp key seen for the first time
/// (it says whether the socket is an internet stream socket). Returns false when
/// a frame announces more than the limit: the caller must fail the read, and
/// every later read of that key fails too.
bool feed(stream kind, uintptr_t key, const unsigned char* data, std::size_t n, bool (*classify)(uintptr_t) = nullptr);
/// The connection is gone (close, SSL_free): forget its state.
void forget(stream kind, uintptr_t key);
/// Connections refused so far.
uint64_t refused_count();

} // namespace strata::runtime::frames
