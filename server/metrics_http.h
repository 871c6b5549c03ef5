#ifndef FLCE_SERVER_METRICS_HTTP_H_
#define FLCE_SERVER_METRICS_HTTP_H_

// The Prometheus endpoint on a side port: GET /metrics answers the text a
// callback renders, any other path 404, any other method 405. Served by
// GNU libmicrohttpd (Debian's libmicrohttpd-dev): two event-driven threads,
// so one slow or stalled client never holds up a scrape; each connection
// is closed after 5 s without progress, at most 64 are open (16 from one
// address), a request's headers are bounded (16 KiB), and stopping closes
// every connection at once.
//
// Not civetweb (Debian packages it too): its worker threads are created
// with a fixed small stack, which this process's thread-local storage
// (OpenBLAS, cuBLAS) does not fit, so pthread_create fails. libmicrohttpd's
// threads take the system's default stack.

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

struct MHD_Daemon;

namespace flce {

class MetricsHttpServer {
 public:
  // Listens on `address` (ParseHttpListenAddress's forms, e.g.
  // "0.0.0.0:9090"). INVALID_ARGUMENT for a malformed address,
  // UNAVAILABLE if it cannot listen there.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, std::function<std::string()> render);
  ~MetricsHttpServer();  // closes every connection and stops the threads
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

  // For the library's callback.
  const std::function<std::string()>& render() const { return render_; }

 private:
  MetricsHttpServer() = default;

  std::function<std::string()> render_;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
};

}  // namespace flce

#endif  // FLCE_SERVER_METRICS_HTTP_H_
