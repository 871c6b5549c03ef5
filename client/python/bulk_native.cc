// libflce_bulk.so: the Python client's bulk-port transfers in native code
// (client/bulk_http_client.h behind a C ABI, loaded with ctypes by
// flce/bulk_http.py).
//
// Why: a Python process that writes one row piece's X while it reads the
// last piece's dX moves each at half its speed or less, because every
// socket call of every transfer thread takes the interpreter lock back;
// the same transfers from two processes barely slow each other
// (bench/RESULTS.md, "the bulk port's transfers without the interpreter
// lock"). ctypes releases the lock for a whole call, and a call here moves
// all of a transfer's ranges on threads of its own.
//
// Every function is thread-safe except flce_bulk_free, which the caller
// makes once, after its last call on the handle. Codes are absl's (=
// gRPC's), plus kUnreachable: the port could not be connected to at all
// (the caller moves the bytes over gRPC instead).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/bulk_http_client.h"

namespace {

constexpr int kUnreachable = -1;

// The status's code (kUnreachable where it never connected); its message
// into `message` (NUL-terminated, cut to `message_bytes`).
int Answer(const absl::Status& status, char* message, int64_t message_bytes) {
  if (message != nullptr && message_bytes > 0) {
    const size_t n = std::min<size_t>(status.message().size(),
                                      static_cast<size_t>(message_bytes - 1));
    std::memcpy(message, status.message().data(), n);
    message[n] = '\0';
  }
  if (flce::BulkHttpClient::IsUnreachable(status)) return kUnreachable;
  return static_cast<int>(status.code());
}

}  // namespace

extern "C" {

// The ABI's version: the Python side refuses a library of another.
int flce_bulk_abi_version() { return 1; }

// A client of the bulk port at host:port (the host the gRPC channel dials),
// TLS when `tls` (with `root_certs_pem`, or the system's CAs when empty,
// and the certificate checked against `server_name`, or host when empty);
// each request may take `timeout_s` seconds. Null on failure.
void* flce_bulk_open(const char* host, int port, int tls, const char* root_certs_pem,
                     const char* server_name, double timeout_s) {
  flce::BulkHttpEndpoint endpoint;
  endpoint.host = host;
  endpoint.port = port;
  endpoint.tls = tls != 0;
  endpoint.tls_root_certs = root_certs_pem != nullptr ? root_certs_pem : "";
  endpoint.tls_server_name = server_name != nullptr ? server_name : "";
  return new (std::nothrow)
      flce::BulkHttpClient(std::move(endpoint), absl::Seconds(std::max(timeout_s, 0.001)));
}

// BulkHttpClient::Move: writes (put) or reads `bytes` at `offset` of the
// region, in up to `ranges` ranges at once.
int flce_bulk_move(void* client, int put, const char* region, const char* ticket, int64_t offset,
                   void* buffer, int64_t bytes, int ranges, char* message, int64_t message_bytes) {
  auto* http = static_cast<flce::BulkHttpClient*>(client);
  return Answer(http->Move(put != 0, region, ticket, offset, static_cast<char*>(buffer), bytes,
                           std::max(ranges, 1)),
                message, message_bytes);
}

// BulkHttpClient::Pin.
int flce_bulk_pin(void* client, const char* region, const char* ticket, char* message,
                  int64_t message_bytes) {
  auto* http = static_cast<flce::BulkHttpClient*>(client);
  return Answer(http->Pin(region, ticket), message, message_bytes);
}

void flce_bulk_free(void* client) { delete static_cast<flce::BulkHttpClient*>(client); }

}  // extern "C"
