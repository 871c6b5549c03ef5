#ifndef FLCE_SERVER_METRICS_HTTP_H_
#define FLCE_SERVER_METRICS_HTTP_H_

// A small HTTP/1.1 server on a side port for Prometheus: GET /metrics
// answers the text a callback renders, anything else 404 (405 for other
// methods). One thread serves one connection at a time, which is what a
// scraper needs; each connection gets 5 s to send its request line and
// headers (at most 8 KiB) and is closed after the reply.
//
// Not civetweb (Debian packages it): its worker threads are created with a
// fixed small stack, which this process's thread-local storage (OpenBLAS,
// cuBLAS) does not fit, so pthread_create fails.

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace flce {

class MetricsHttpServer {
 public:
  // Listens on `address` ("host:port"; an IPv4 host or "0.0.0.0"; port 0
  // picks a free one). INVALID_ARGUMENT for a malformed address,
  // UNAVAILABLE if it cannot listen there.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, std::function<std::string()> render);
  ~MetricsHttpServer();  // stops the thread and closes the socket
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  void Serve();
  void Answer(int connection);

  std::function<std::string()> render_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace flce

#endif  // FLCE_SERVER_METRICS_HTTP_H_
