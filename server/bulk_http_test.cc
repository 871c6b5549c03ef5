#include "server/bulk_http.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/loopback_socket.h"

namespace flce {
namespace {

int Connect(int port) { return ConnectLoopback(port, 20); }

void SendAll(int fd, const std::string& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

// One response read off `fd`: the head and a Content-Length body.
std::string ReadResponse(int fd) {
  std::string reply;
  char buffer[65536];
  size_t body_at = std::string::npos, want = 0;
  while (body_at == std::string::npos || reply.size() < body_at + want) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    reply.append(buffer, static_cast<size_t>(n));
    if (body_at == std::string::npos && (body_at = reply.find("\r\n\r\n")) != std::string::npos) {
      body_at += 4;
      const size_t length = reply.find("Content-Length: ");
      want = length < body_at ? std::stoul(reply.substr(length + 16)) : 0;
    }
  }
  return reply;
}

// `request` on a connection of its own; the response.
std::string Exchange(int port, const std::string& request) {
  const int fd = Connect(port);
  if (fd < 0) return "";
  SendAll(fd, request);
  std::string reply = ReadResponse(fd);
  close(fd);
  return reply;
}

std::string Body(const std::string& reply) {
  const size_t at = reply.find("\r\n\r\n");
  return at == std::string::npos ? "" : reply.substr(at + 4);
}

// True once the server has closed `fd` (recv sees the end).
bool ClosedByServer(int fd) {
  char byte;
  return recv(fd, &byte, 1, 0) <= 0;
}

class BulkHttpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<RegisteredRegion> region = regions_.RegisterServerMemory(1 << 20, "alice");
    ASSERT_TRUE(region.ok()) << region.status();
    region_ = *region;
    ASSERT_FALSE(region_.ticket.empty());
    ASSERT_NE(region_.ticket, region_.region_id);
    BulkHttpOptions options;
    options.address = "127.0.0.1:0";
    options.max_connections = 8;
    options.max_connections_per_address = 4;
    options.idle_timeout = absl::Seconds(1);
    absl::StatusOr<std::unique_ptr<BulkHttpServer>> server =
        BulkHttpServer::Start(options, &regions_, &metrics_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  std::string Put(int64_t offset, const std::string& body, const std::string& ticket) {
    return absl::StrCat("PUT /v1/regions/", region_.region_id, "?offset=", offset,
                        " HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ", ticket,
                        "\r\nContent-Length: ", body.size(), "\r\n\r\n", body);
  }
  std::string Get(int64_t offset, int64_t length, const std::string& ticket) {
    return absl::StrCat("GET /v1/regions/", region_.region_id, "?offset=", offset,
                        "&length=", length, " HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ",
                        ticket, "\r\n\r\n");
  }
  // Waits (up to 20 s) until the server holds no connection: one its client
  // closed is dropped by the server a moment later, and a test's next
  // connection from the same address must not meet the per-address bound.
  void AwaitNoConnections() {
    for (int i = 0; i < 2000 && server_->connections() > 0; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  int64_t Count(const std::string& rpc, const std::string& code) {
    const MetricsSnapshot snapshot = metrics_.Snapshot(Gauges());
    auto it = snapshot.requests.find({rpc, code});
    return it == snapshot.requests.end() ? 0 : it->second;
  }
  // Waits (up to 20 s) for `rpc` to have been counted with `code` `n` times.
  bool WaitForCount(const std::string& rpc, const std::string& code, int64_t n) {
    for (int i = 0; i < 2000 && Count(rpc, code) < n; ++i) absl::SleepFor(absl::Milliseconds(10));
    return Count(rpc, code) == n;
  }
  char* Memory() {
    return (*regions_.FindByTicket(region_.region_id, region_.ticket)).region->base();
  }

  SharedMemoryRegistry regions_;
  ServiceMetrics metrics_;
  RegisteredRegion region_;
  std::unique_ptr<BulkHttpServer> server_;
};

TEST_F(BulkHttpTest, WritesAndReadsARangeOnOneKeptConnection) {
  std::string data(5000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 3);
  const int fd = Connect(server_->port());
  ASSERT_GE(fd, 0);
  SendAll(fd, Put(4099, data, region_.ticket));
  const std::string put = ReadResponse(fd);
  EXPECT_TRUE(absl::StartsWith(put, "HTTP/1.1 200")) << put;
  EXPECT_TRUE(absl::StrContains(put, "Flce-Code: 0")) << put;
  EXPECT_EQ(std::memcmp(Memory() + 4099, data.data(), data.size()), 0);
  // The same connection serves the read (kept alive).
  SendAll(fd, Get(4099 + 10, 4000, region_.ticket));
  const std::string get = ReadResponse(fd);
  EXPECT_TRUE(absl::StartsWith(get, "HTTP/1.1 200")) << get.substr(0, 200);
  EXPECT_EQ(Body(get), data.substr(10, 4000));
  close(fd);
  EXPECT_TRUE(WaitForCount("BulkWrite", "OK", 1));
  EXPECT_TRUE(WaitForCount("BulkRead", "OK", 1));
  const MetricsSnapshot snapshot = metrics_.Snapshot(Gauges());
  EXPECT_EQ(snapshot.received_bytes.at("BulkWrite"), 5000);
  EXPECT_EQ(snapshot.sent_bytes.at("BulkRead"), 4000);
}

TEST_F(BulkHttpTest, RefusalsCarryTheCodeAndNameTheField) {
  absl::StatusOr<RegisteredRegion> other = regions_.RegisterServerMemory(4096, "bob");
  ASSERT_TRUE(other.ok());
  const std::string path = absl::StrCat("/v1/regions/", region_.region_id);
  struct Case {
    std::string request, status, code, says;
  };
  const std::vector<Case> cases = {
      {Put(0, "abc", "not-the-ticket"), "404", "5", "or a wrong ticket"},
      {Put(0, "abc", other->ticket), "404", "5", "or a wrong ticket"},
      {absl::StrCat("PUT ", path, " HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"), "401",
       "16", "authorization"},
      {Put((1 << 20) - 2, "abc", region_.ticket), "400", "3", "do not lie inside"},
      {absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ",
                    region_.ticket, "\r\n\r\n"),
       "400", "3", "length: required"},
      {Get(-1, 3, region_.ticket), "400", "3", "offset: '-1'"},
      {absl::StrCat("PUT ", path, " HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ",
                    region_.ticket, "\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"),
       "411", "3", "Content-Length"},
      {absl::StrCat("GET ", path, "?length=3 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ",
                    region_.ticket, "\r\nContent-Length: 3\r\n\r\nabc"),
       "400", "3", "a GET carries no body"},
      {absl::StrCat("DELETE ", path, " HTTP/1.1\r\nHost: x\r\n\r\n"), "405", "3", "method"},
      {"GET /v1/other?length=3 HTTP/1.1\r\nHost: x\r\n\r\n", "404", "5", "path"},
  };
  for (const Case& c : cases) {
    AwaitNoConnections();  // each case on a connection of its own, more than the bound
    const std::string reply = Exchange(server_->port(), c.request);
    EXPECT_TRUE(absl::StartsWith(reply, "HTTP/1.1 " + c.status)) << c.request << "\n" << reply;
    EXPECT_TRUE(absl::StrContains(reply, "Flce-Code: " + c.code + "\r\n")) << reply;
    EXPECT_TRUE(absl::StrContains(Body(reply), c.says)) << reply;
  }
  // Nothing was written by any of them; the server serves on.
  EXPECT_EQ(Memory()[0], 0);
  EXPECT_TRUE(absl::StartsWith(Exchange(server_->port(), Put(0, "ok", region_.ticket)),
                               "HTTP/1.1 200"));
}

TEST_F(BulkHttpTest, ConnectionsAreBoundedAndIdleOnesClosed) {
  std::vector<int> held;
  for (int i = 0; i < 4; ++i) {  // the limit from one address
    held.push_back(Connect(server_->port()));
    ASSERT_GE(held.back(), 0);
  }
  for (int i = 0; i < 2000 && server_->connections() < 4; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(server_->connections(), 4);
  const int refused = Connect(server_->port());
  if (refused >= 0) {
    EXPECT_TRUE(ClosedByServer(refused));  // accepted and closed at once
    close(refused);
  }
  // Idle past the timeout (1 s): closed by the server; room again after.
  for (int fd : held) {
    EXPECT_TRUE(ClosedByServer(fd));
    close(fd);
  }
  AwaitNoConnections();
  EXPECT_EQ(server_->connections(), 0);
  EXPECT_TRUE(absl::StartsWith(Exchange(server_->port(), Put(0, "ok", region_.ticket)),
                               "HTTP/1.1 200"));
}

TEST_F(BulkHttpTest, ATransferCutOrStalledIsCancelledAndTheServerServesOn) {
  // Cut: the client goes away after 10 of 100000 bytes.
  int fd = Connect(server_->port());
  ASSERT_GE(fd, 0);
  SendAll(fd, Put(0, std::string(100000, 'x'), region_.ticket).substr(0, 200));
  absl::SleepFor(absl::Milliseconds(100));
  close(fd);
  EXPECT_TRUE(WaitForCount("BulkWrite", "CANCELLED", 1));
  // Stalled: half a body, then nothing: closed after the idle timeout.
  fd = Connect(server_->port());
  ASSERT_GE(fd, 0);
  SendAll(fd, Put(0, std::string(2000, 'y'), region_.ticket).substr(0, 1500));
  EXPECT_TRUE(ClosedByServer(fd));
  close(fd);
  EXPECT_TRUE(WaitForCount("BulkWrite", "CANCELLED", 2));
  EXPECT_TRUE(absl::StartsWith(Exchange(server_->port(), Get(0, 4, region_.ticket)),
                               "HTTP/1.1 200"));
}

TEST_F(BulkHttpTest, OversizedHeadersAreRefusedAndStoppingDoesNotWaitForClients) {
  const std::string huge = absl::StrCat("GET /v1/regions/", region_.region_id,
                                        "?length=1 HTTP/1.1\r\nHost: x\r\nX-Pad: ",
                                        std::string(2 << 20, 'p'), "\r\n\r\n");
  const std::string reply = Exchange(server_->port(), huge);
  EXPECT_TRUE(reply.empty() || absl::StartsWith(reply, "HTTP/1.1 431")) << reply.substr(0, 100);
  EXPECT_TRUE(absl::StartsWith(Exchange(server_->port(), Get(0, 4, region_.ticket)),
                               "HTTP/1.1 200"));
  // A transfer in flight: stopping closes it and returns.
  const int fd = Connect(server_->port());
  ASSERT_GE(fd, 0);
  SendAll(fd, Put(0, std::string(1000, 'z'), region_.ticket).substr(0, 500));
  const absl::Time start = absl::Now();
  server_.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_TRUE(ClosedByServer(fd));
  close(fd);
}

TEST_F(BulkHttpTest, AGetAfterAMarkWaitsForItsPost) {
  MarkBoard* marks = (*regions_.FindByTicket(region_.region_id, region_.ticket)).region->marks();
  ASSERT_NE(marks, nullptr);
  auto marked = [&](const std::string& mark, const std::string& more) {
    return absl::StrCat("GET /v1/regions/", region_.region_id, "?offset=8&length=5&after_mark=",
                        mark, more, " HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ",
                        region_.ticket, "\r\n\r\n");
  };
  // Posted OK after the bytes are in: the answer carries them, even after
  // a wait longer than the idle timeout (1 s).
  int fd = Connect(server_->port());
  ASSERT_GE(fd, 0);
  SendAll(fd, marked("9", ""));
  pollfd readable{fd, POLLIN, 0};
  EXPECT_EQ(poll(&readable, 1, 1500), 0);  // nothing before the post
  std::memcpy(Memory() + 8, "hello", 5);
  marks->Post(9, absl::OkStatus());
  std::string reply = ReadResponse(fd);
  EXPECT_TRUE(absl::StartsWith(reply, "HTTP/1.1 200")) << reply;
  EXPECT_EQ(Body(reply), "hello");
  // A mark posted already answers at once, on the same kept connection.
  SendAll(fd, marked("9", ""));
  EXPECT_EQ(Body(ReadResponse(fd)), "hello");
  close(fd);
  // The writing call failed: ABORTED, and its message.
  fd = Connect(server_->port());
  ASSERT_GE(fd, 0);
  SendAll(fd, marked("10", ""));
  marks->Post(10, absl::AbortedError("the Forward failed"));
  reply = ReadResponse(fd);
  close(fd);
  EXPECT_TRUE(absl::StartsWith(reply, "HTTP/1.1 409")) << reply;
  EXPECT_TRUE(absl::StrContains(reply, "Flce-Code: 10\r\n")) << reply;
  EXPECT_TRUE(absl::StrContains(Body(reply), "the Forward failed")) << reply;
  // No post within wait_ms; wait_ms and after_mark out of bounds.
  struct Case {
    std::string request, status, code, says;
  };
  const std::vector<Case> cases = {
      {marked("11", "&wait_ms=30"), "504", "4", "mark 11 was not posted within wait_ms (30)"},
      {marked("11", "&wait_ms=600001"), "400", "3", "wait_ms: 600001"},
      {marked("-1", ""), "400", "3", "after_mark: '-1'"},
  };
  for (const Case& c : cases) {
    reply = Exchange(server_->port(), c.request);
    EXPECT_TRUE(absl::StartsWith(reply, "HTTP/1.1 " + c.status)) << c.request << "\n" << reply;
    EXPECT_TRUE(absl::StrContains(reply, "Flce-Code: " + c.code + "\r\n")) << reply;
    EXPECT_TRUE(absl::StrContains(Body(reply), c.says)) << reply;
  }
  // The client leaves while its read waits: CANCELLED, and the server
  // serves on.
  fd = Connect(server_->port());
  ASSERT_GE(fd, 0);
  SendAll(fd, marked("12", ""));
  absl::SleepFor(absl::Milliseconds(100));
  close(fd);
  EXPECT_TRUE(WaitForCount("BulkRead", "CANCELLED", 1));
  EXPECT_TRUE(absl::StartsWith(Exchange(server_->port(), Get(8, 5, region_.ticket)),
                               "HTTP/1.1 200"));
  // Stopping ends a wait: UNAVAILABLE, or the connection closed.
  fd = Connect(server_->port());
  ASSERT_GE(fd, 0);
  SendAll(fd, marked("13", ""));
  absl::SleepFor(absl::Milliseconds(100));
  server_.reset();
  reply = ReadResponse(fd);
  close(fd);
  EXPECT_TRUE(reply.empty() || absl::StartsWith(reply, "HTTP/1.1 503")) << reply;
}

TEST(BulkHttpStartTest, BadOptionsAreRefusedByName) {
  SharedMemoryRegistry regions;
  ServiceMetrics metrics;
  BulkHttpOptions options;
  options.address = "nonsense";
  EXPECT_EQ(BulkHttpServer::Start(options, &regions, &metrics).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.address = "127.0.0.1:0";
  options.tls_cert_pem = "-----BEGIN CERTIFICATE-----";
  EXPECT_EQ(BulkHttpServer::Start(options, &regions, &metrics).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.tls_cert_pem.clear();
  options.max_connections = 0;
  EXPECT_EQ(BulkHttpServer::Start(options, &regions, &metrics).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace flce
