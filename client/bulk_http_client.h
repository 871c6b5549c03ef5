#ifndef FLCE_CLIENT_BULK_HTTP_CLIENT_H_
#define FLCE_CLIENT_BULK_HTTP_CLIENT_H_

// The server's bulk port from C++ (the protocol: server/bulk_http.h): a
// region of server memory's bytes written with PUT and read with GET over
// kept-alive HTTP/1.1 connections (libcurl, Debian's libcurl4-openssl-dev),
// TLS like the gRPC channel. Thread-safe: each call takes an idle
// connection or opens one. A host name that resolves to several servers (a
// headless Service's) is pinned to the one holding the region (Pin).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace flce {

struct BulkHttpEndpoint {
  std::string host;  // what the gRPC channel dials ("10.0.0.7", "::1", "flce.svc")
  int port = 0;
  bool tls = false;
  std::string tls_root_certs;  // PEM; empty: the system's
  std::string tls_server_name;  // the name the certificate carries; empty: host
};

class BulkHttpClient {
 public:
  BulkHttpClient(BulkHttpEndpoint endpoint, absl::Duration timeout);
  ~BulkHttpClient();
  BulkHttpClient(const BulkHttpClient&) = delete;
  BulkHttpClient& operator=(const BulkHttpClient&) = delete;

  const BulkHttpEndpoint& endpoint() const { return endpoint_; }

  // Writes `bytes` from `data` at `offset` of `region`, whose ticket is
  // `ticket`; the server's code and message on a refusal, UNAVAILABLE when
  // the connection breaks (then IsUnreachable tells whether it never
  // connected).
  absl::Status Put(const std::string& region, const std::string& ticket, int64_t offset,
                   const char* data, int64_t bytes);
  // Reads `bytes` at `offset` of `region` into `out`.
  absl::Status Get(const std::string& region, const std::string& ticket, int64_t offset,
                   char* out, int64_t bytes);

  // Connects from now on to the address of the host that holds `region`:
  // where the name resolves to one address, that one; else the first whose
  // port answers for the ticket. Unreachable (IsUnreachable) where none does.
  absl::Status Pin(const std::string& region, const std::string& ticket);

  // True for a status of a call that could not connect to the port at all
  // (a firewall, a port not forwarded): its bytes may go over gRPC instead.
  static bool IsUnreachable(const absl::Status& status);

 private:
  struct Exchange;
  // `address`: where to connect for this call (empty: the pinned one).
  absl::Status Run(bool put, const std::string& region, const std::string& ticket,
                   int64_t offset, char* buffer, int64_t bytes, const std::string& address = "");
  void* TakeHandle();  // an idle CURL easy handle, or a new one
  void GiveBack(void* handle);

  const BulkHttpEndpoint endpoint_;
  const absl::Duration timeout_;
  const std::string url_host_, base_url_;
  absl::Mutex mu_;
  std::vector<void*> idle_ ABSL_GUARDED_BY(mu_);
  std::string pinned_ ABSL_GUARDED_BY(mu_);  // the address connections go to
};

}  // namespace flce

#endif  // FLCE_CLIENT_BULK_HTTP_CLIENT_H_
