#include "server/metrics_http.h"

#include <microhttpd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/http_listen.h"

namespace flce {
namespace {

constexpr unsigned kTimeoutSeconds = 5;
constexpr unsigned kThreads = 2;
constexpr unsigned kMaxConnections = 64;
constexpr unsigned kMaxConnectionsPerAddress = 16;
constexpr size_t kConnectionMemory = 16 << 10;

MHD_Result Send(MHD_Connection* connection, unsigned code, std::string body,
                const char* type) {
  MHD_Response* response =
      MHD_create_response_from_buffer(body.size(), body.data(), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  const MHD_Result queued = MHD_queue_response(connection, code, response);
  MHD_destroy_response(response);
  return queued;
}

MHD_Result Answer(void* cls, MHD_Connection* connection, const char* url, const char* method,
                  const char* /*version*/, const char* /*upload_data*/,
                  size_t* upload_data_size, void** /*request*/) {
  const auto* server = static_cast<const MetricsHttpServer*>(cls);
  if (*upload_data_size != 0) {
    *upload_data_size = 0;  // a body is ignored
    return MHD_YES;
  }
  if (std::strcmp(method, MHD_HTTP_METHOD_GET) != 0) {
    return Send(connection, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET /metrics\n",
                "text/plain; charset=utf-8");
  }
  if (std::strcmp(url, "/metrics") != 0) {
    return Send(connection, MHD_HTTP_NOT_FOUND, "only GET /metrics\n",
                "text/plain; charset=utf-8");
  }
  return Send(connection, MHD_HTTP_OK, server->render()(),
              "text/plain; version=0.0.4; charset=utf-8");
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, std::function<std::string()> render) {
  FLCE_ASSIGN_OR_RETURN(const HttpListenAddress listen,
                        ParseHttpListenAddress(address, "--metrics_address", "0.0.0.0:9090"));
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->render_ = std::move(render);
  server->daemon_ = MHD_start_daemon(
      MHD_USE_AUTO_INTERNAL_THREAD | (listen.ipv6 ? MHD_USE_IPv6 : 0),
      static_cast<uint16_t>(listen.port), nullptr, nullptr, &Answer, server.get(),
      MHD_OPTION_SOCK_ADDR, listen.sockaddr_ptr(),
      MHD_OPTION_THREAD_POOL_SIZE, kThreads, MHD_OPTION_CONNECTION_TIMEOUT, kTimeoutSeconds,
      MHD_OPTION_CONNECTION_LIMIT, kMaxConnections, MHD_OPTION_PER_IP_CONNECTION_LIMIT,
      kMaxConnectionsPerAddress, MHD_OPTION_CONNECTION_MEMORY_LIMIT, kConnectionMemory,
      MHD_OPTION_END);
  if (server->daemon_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("--metrics_address: cannot listen on ", address,
                                               ": ", std::strerror(errno)));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(server->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  server->port_ = info != nullptr ? info->port : listen.port;
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
}

}  // namespace flce
