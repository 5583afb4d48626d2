#pragma once
// `strata certs init|issue`: a cluster CA and node/client certificates for
// mutual TLS, made with Debian's `openssl` command (RSA 2048, SHA-256).

namespace strata::runtime {

int run_certs(int argc, char** argv);

} // namespace strata::runtime
