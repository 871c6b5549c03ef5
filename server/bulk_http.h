#ifndef FLCE_SERVER_BULK_HTTP_H_
#define FLCE_SERVER_BULK_HTTP_H_

// The bulk port: the bytes of regions of server memory (RegisterSharedMemory
// with server_memory) over plain HTTP/1.1, for remote clients that move
// large tensors. gRPC's streams carry 1-3 GB/s from a Python client even
// over several connections; a request here is the body's bytes straight off
// the socket, 8-18 GB/s over 4-8 connections on the H200 host's loopback
// (bench/RESULTS.md). gRPC stays the control plane: the calls that use the
// bytes name slices of the region as before.
//
//   PUT /v1/regions/<region_id>?offset=<n>             the body, at byte n
//   GET /v1/regions/<region_id>?offset=<n>&length=<m>  m bytes from byte n
//       [&after_mark=<k>[&wait_ms=<t>]]   ... once mark k is posted
//
// A GET with after_mark waits until a call that writes into the region
// posts mark k (ForwardRequest.backward.written_mark, server/region_marks.h)
// and then answers the bytes; where the call ended without writing them it
// answers ABORTED (409), where no post came within wait_ms (at most and by
// default ten minutes) DEADLINE_EXCEEDED (504), and where the server stops
// meanwhile UNAVAILABLE (503); where the client closes the connection, the
// wait ends (checked every 50 ms). Such a GET holds its connection's thread
// while it waits, within the connection bounds below.
//
// Every request carries "Authorization: Bearer <ticket>", the ticket
// RegisterSharedMemory answered for that region beside bulk_port. A ticket
// is the region's capability, like a presigned URL: whoever registered the
// region over an authenticated gRPC call holds it, so this port needs
// neither the tokens nor client certificates; it speaks TLS whenever the
// server does (the same certificate). A PUT needs Content-Length (no
// chunked bodies) and a range inside the region; clients may send "Expect:
// 100-continue" to learn of an error before sending the body. Answers are
// 200; an error has the HTTP status nearest its gRPC code, the code itself
// in the "Flce-Code" header and a one-line message as its body (an
// unknown region and a wrong ticket alike are 404 / NOT_FOUND). A request
// is logged and counted like an RPC (rpc=BulkWrite / BulkRead via=http).
//
// Bounds (libmicrohttpd): a thread per connection, at most
// `max_connections` (`max_connections_per_address` from one address), each
// closed after `idle_timeout` (in whole seconds, at least one) without
// progress, with 1 MiB for a request's
// headers and buffers; the bytes go straight into the region, which the
// region budget already bounds.

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/metrics.h"
#include "server/shared_memory.h"

struct MHD_Daemon;

namespace flce {

struct BulkHttpOptions {
  // host:port (ParseHttpListenAddress's forms); port 0 picks a free one.
  std::string address;
  // PEM certificate chain and key: TLS. Both or neither.
  std::string tls_cert_pem, tls_key_pem;
  int max_connections = 512;
  int max_connections_per_address = 128;
  absl::Duration idle_timeout = absl::Seconds(30);
};

class BulkHttpServer {
 public:
  // Serves `regions` (which must outlive the server) on options.address.
  // INVALID_ARGUMENT for bad options, UNIMPLEMENTED for TLS where
  // libmicrohttpd was built without it, UNAVAILABLE if it cannot listen.
  static absl::StatusOr<std::unique_ptr<BulkHttpServer>> Start(const BulkHttpOptions& options,
                                                               const SharedMemoryRegistry* regions,
                                                               ServiceMetrics* metrics);
  // Ends the reads waiting for a mark, closes every connection (transfers
  // in flight fail) and stops.
  ~BulkHttpServer();
  BulkHttpServer(const BulkHttpServer&) = delete;
  BulkHttpServer& operator=(const BulkHttpServer&) = delete;

  int port() const { return port_; }
  bool tls() const { return tls_; }
  // Connections open now.
  int connections() const;

  // For the library's callbacks.
  const SharedMemoryRegistry* regions() const { return regions_; }
  ServiceMetrics* metrics() const { return metrics_; }
  bool stopping() const { return stopping_.load(std::memory_order_relaxed); }

 private:
  BulkHttpServer() = default;

  const SharedMemoryRegistry* regions_ = nullptr;
  ServiceMetrics* metrics_ = nullptr;
  // libmicrohttpd keeps pointers to the PEM text.
  std::string cert_pem_, key_pem_;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
  bool tls_ = false;
  std::atomic<bool> stopping_{false};
};

}  // namespace flce

#endif  // FLCE_SERVER_BULK_HTTP_H_
