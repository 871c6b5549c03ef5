#include "server/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace flce {
namespace {

constexpr size_t kMaxRequestBytes = 8 << 10;

void WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return;  // the scraper went away
    done += static_cast<size_t>(n);
  }
}

std::string Reply(const char* status, const std::string& body,
                  const char* type = "text/plain; charset=utf-8") {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, std::function<std::string()> render) {
  const size_t colon = address.rfind(':');
  int port = -1;
  sockaddr_in bind_to{};
  bind_to.sin_family = AF_INET;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535 ||
      inet_pton(AF_INET, address.substr(0, colon).c_str(), &bind_to.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_address: '", address, "' is not IPv4-host:port (e.g. 0.0.0.0:9090)"));
  }
  bind_to.sin_port = htons(static_cast<uint16_t>(port));
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->render_ = std::move(render);
  server->listener_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int on = 1;
  setsockopt(server->listener_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  socklen_t length = sizeof(bind_to);
  if (server->listener_ < 0 ||
      bind(server->listener_, reinterpret_cast<sockaddr*>(&bind_to), sizeof(bind_to)) != 0 ||
      listen(server->listener_, 16) != 0 ||
      getsockname(server->listener_, reinterpret_cast<sockaddr*>(&bind_to), &length) != 0) {
    return absl::UnavailableError(absl::StrCat("--metrics_address: cannot listen on ", address,
                                               ": ", std::strerror(errno)));
  }
  server->port_ = ntohs(bind_to.sin_port);
  server->thread_ = std::thread([raw = server.get()] { raw->Serve(); });
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (listener_ >= 0) close(listener_);
}

void MetricsHttpServer::Serve() {
  while (!stop_) {
    pollfd ready{listener_, POLLIN, 0};
    if (poll(&ready, 1, 200) <= 0) continue;  // wake up to see stop_
    const int connection = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (connection < 0) continue;
    Answer(connection);
    close(connection);
  }
}

void MetricsHttpServer::Answer(int connection) {
  timeval timeout{5, 0};
  setsockopt(connection, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(connection, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  std::string request;
  char buffer[1024];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequestBytes) {
    const ssize_t n = recv(connection, buffer, sizeof(buffer), 0);
    if (n <= 0) return;
    request.append(buffer, static_cast<size_t>(n));
  }
  const std::string line = request.substr(0, request.find("\r\n"));
  if (!absl::StartsWith(line, "GET ")) {
    WriteAll(connection, Reply("405 Method Not Allowed", "only GET /metrics\n"));
    return;
  }
  const std::string path = line.substr(4, line.find(' ', 4) - 4);
  if (path != "/metrics") {
    WriteAll(connection, Reply("404 Not Found", "only GET /metrics\n"));
    return;
  }
  WriteAll(connection, Reply("200 OK", render_(), "text/plain; version=0.0.4; charset=utf-8"));
}

}  // namespace flce
