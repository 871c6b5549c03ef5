#include "server/metrics_http.h"

#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/loopback_socket.h"

namespace flce {
namespace {

int Connect(int port) { return ConnectLoopback(port); }

std::string Get(int port, const std::string& request) {
  const int fd = Connect(port);
  if (fd < 0) return "";
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) < 0) {}
  std::string reply;
  char buffer[4096];
  ssize_t n;
  while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0) reply.append(buffer, n);
  close(fd);
  return reply;
}

std::unique_ptr<MetricsHttpServer> Serve() {
  auto server = MetricsHttpServer::Start("127.0.0.1:0", [] { return std::string("up 1\n"); });
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

TEST(MetricsHttpTest, AnswersMetricsAndRefusesTheRest) {
  auto server = Serve();
  ASSERT_NE(server, nullptr);
  const std::string ok =
      Get(server->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_TRUE(absl::StartsWith(ok, "HTTP/1.1 200")) << ok;
  EXPECT_TRUE(absl::EndsWith(ok, "up 1\n")) << ok;
  EXPECT_TRUE(absl::StartsWith(
      Get(server->port(), "GET /other HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
      "HTTP/1.1 404"));
  EXPECT_TRUE(absl::StartsWith(
      Get(server->port(), "POST /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                          "Content-Length: 0\r\n\r\n"),
      "HTTP/1.1 405"));
  EXPECT_FALSE(MetricsHttpServer::Start("nonsense", [] { return std::string(); }).ok());
}

// Clients that send a byte now and then (or nothing) hold up neither other
// scrapes nor the stop.
TEST(MetricsHttpTest, SlowClientsBlockNeitherScrapesNorStopping) {
  auto server = Serve();
  ASSERT_NE(server, nullptr);
  std::vector<int> slow;
  for (int i = 0; i < 8; ++i) {
    const int fd = Connect(server->port());
    ASSERT_GE(fd, 0);
    if (send(fd, "GET /met", 8, MSG_NOSIGNAL) < 0) {}
    slow.push_back(fd);
  }
  // (Get gives up after 10 s: a scrape queued behind the slow clients fails.)
  for (int i = 0; i < 5; ++i) {
    const std::string ok =
        Get(server->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    EXPECT_TRUE(absl::StartsWith(ok, "HTTP/1.1 200")) << ok;
    for (int fd : slow) {
      if (send(fd, "r", 1, MSG_NOSIGNAL) < 0) {}
    }
  }
  server.reset();  // returns although the slow clients are still connected
  for (int fd : slow) close(fd);
}

}  // namespace
}  // namespace flce
