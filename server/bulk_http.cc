#include "server/bulk_http.h"

#include <microhttpd.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/status_macros.h"
#include "server/http_listen.h"
#include "server/rpc_call.h"
#include "spdlog/spdlog.h"

namespace flce {
namespace {

// A request's headers and libmicrohttpd's buffers: 1 MiB moved 8-18 GB/s on
// the H200 host; 256 KiB and 4 MiB did no better on the 2-core VM.
constexpr size_t kConnectionMemory = size_t{1} << 20;
constexpr char kPath[] = "/v1/regions/";
// A read's longest wait for its mark (wait_ms).
constexpr int64_t kMaxWaitMs = 10 * 60 * 1000;

// The HTTP status nearest a gRPC code.
unsigned HttpStatus(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk: return MHD_HTTP_OK;
    case absl::StatusCode::kInvalidArgument: return MHD_HTTP_BAD_REQUEST;
    case absl::StatusCode::kOutOfRange: return MHD_HTTP_BAD_REQUEST;
    case absl::StatusCode::kUnauthenticated: return MHD_HTTP_UNAUTHORIZED;
    case absl::StatusCode::kPermissionDenied: return MHD_HTTP_FORBIDDEN;
    case absl::StatusCode::kNotFound: return MHD_HTTP_NOT_FOUND;
    case absl::StatusCode::kAborted: return MHD_HTTP_CONFLICT;
    case absl::StatusCode::kFailedPrecondition: return MHD_HTTP_PRECONDITION_FAILED;
    case absl::StatusCode::kResourceExhausted: return MHD_HTTP_TOO_MANY_REQUESTS;
    case absl::StatusCode::kUnimplemented: return MHD_HTTP_NOT_IMPLEMENTED;
    case absl::StatusCode::kUnavailable: return MHD_HTTP_SERVICE_UNAVAILABLE;
    case absl::StatusCode::kDeadlineExceeded: return MHD_HTTP_GATEWAY_TIMEOUT;
    default: return MHD_HTTP_INTERNAL_SERVER_ERROR;
  }
}

// One request: its access line and, for a PUT, where its body goes.
struct Transfer {
  Transfer(ServiceMetrics* metrics, const char* rpc) : record(metrics, rpc) {}
  CallRecord record;
  std::shared_ptr<SharedRegion> region;  // held until the request is over
  char* to = nullptr;                    // a PUT's next byte's place
  int64_t length = 0;                    // the range's bytes
  int64_t moved = 0;                     // of them, received or sent
  bool write = false;
  unsigned refusal_http_status = 0;  // where a refusal's is not HttpStatus(code)
  uint64_t after_mark = 0;           // a GET's: sent once the region's mark is posted
  absl::Duration wait;               // how long it waits for the mark at most
};

MHD_Result Answer(MHD_Connection* connection, Transfer* transfer, const absl::Status& status,
                  std::string body, unsigned http_status = 0) {
  transfer->record.SetAnswer(status);
  if (!status.ok()) body = absl::StrCat(status.message(), "\n");
  MHD_Response* response =
      MHD_create_response_from_buffer(body.size(), body.data(), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, "text/plain; charset=utf-8");
  MHD_add_response_header(response, "Flce-Code",
                          absl::StrCat(static_cast<int>(status.code())).c_str());
  if (http_status == MHD_HTTP_METHOD_NOT_ALLOWED) {
    MHD_add_response_header(response, MHD_HTTP_HEADER_ALLOW, "GET, PUT");
  }
  const MHD_Result queued = MHD_queue_response(
      connection, http_status != 0 ? http_status : HttpStatus(status.code()), response);
  MHD_destroy_response(response);
  return queued;
}

// A query argument as an int64 >= 0: `fallback` when absent.
absl::StatusOr<int64_t> Argument(MHD_Connection* connection, const char* name,
                                 std::optional<int64_t> fallback) {
  const char* text = MHD_lookup_connection_value(connection, MHD_GET_ARGUMENT_KIND, name);
  if (text == nullptr) {
    if (fallback) return *fallback;
    return absl::InvalidArgumentError(absl::StrCat(name, ": required"));
  }
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": '", LogSafe(text, 32), "' is not an integer >= 0"));
  }
  return value;
}

// The region and range a request names, checked; the access line's detail.
absl::Status Admit(const BulkHttpServer& server, MHD_Connection* connection, const char* url,
                   Transfer* transfer) {
  if (!absl::StartsWith(url, kPath) || std::strchr(url + sizeof(kPath) - 1, '/') != nullptr ||
      url[sizeof(kPath) - 1] == '\0') {
    return absl::NotFoundError(
        absl::StrCat("path: '", LogSafe(url, 80), "'; expected ", kPath, "<region_id>"));
  }
  const std::string region_id = url + sizeof(kPath) - 1;
  transfer->record.SetDetail(absl::StrCat("region=", LogSafe(region_id, 8), " "));
  const char* authorization =
      MHD_lookup_connection_value(connection, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
  if (authorization == nullptr || !absl::StartsWith(authorization, "Bearer ")) {
    return absl::UnauthenticatedError(
        "authorization: expected 'Bearer <ticket>' with the region's bulk_ticket "
        "(RegisterSharedMemory)");
  }
  FLCE_ASSIGN_OR_RETURN(TicketedRegion found,
                        server.regions()->FindByTicket(region_id, authorization + 7));
  FLCE_ASSIGN_OR_RETURN(const int64_t offset, Argument(connection, "offset", 0));
  const char* chunked =
      MHD_lookup_connection_value(connection, MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING);
  const char* content_length =
      MHD_lookup_connection_value(connection, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
  int64_t length = 0;
  if (transfer->write) {
    if (chunked != nullptr || content_length == nullptr ||
        !absl::SimpleAtoi(content_length, &length) || length < 0) {
      transfer->refusal_http_status = MHD_HTTP_LENGTH_REQUIRED;
      return absl::InvalidArgumentError(
          "Content-Length: required (a PUT's body is its length in bytes, not chunked)");
    }
  } else {
    if (chunked != nullptr || (content_length != nullptr && std::strcmp(content_length, "0"))) {
      return absl::InvalidArgumentError("a GET carries no body");
    }
    FLCE_ASSIGN_OR_RETURN(length, Argument(connection, "length", std::nullopt));
    FLCE_ASSIGN_OR_RETURN(const int64_t mark, Argument(connection, "after_mark", 0));
    FLCE_ASSIGN_OR_RETURN(const int64_t wait_ms, Argument(connection, "wait_ms", kMaxWaitMs));
    if (wait_ms > kMaxWaitMs) {
      return absl::InvalidArgumentError(
          absl::StrCat("wait_ms: ", wait_ms, "; at most ", kMaxWaitMs, " (ten minutes)"));
    }
    transfer->after_mark = static_cast<uint64_t>(mark);
    transfer->wait = absl::Milliseconds(wait_ms);
    if (mark != 0) {
      transfer->record.PrependDetail(absl::StrCat("after_mark=", mark, " "));
    }
  }
  const int64_t bytes = found.region->bytes();
  if (offset > bytes || length > bytes - offset) {
    return absl::InvalidArgumentError(absl::StrCat("offset: ", length, " bytes at offset ",
                                                   offset, " do not lie inside the region's ",
                                                   bytes, " bytes"));
  }
  transfer->record.PrependDetail(absl::StrCat("bytes=", length, " "));
  transfer->to = found.region->base() + offset;
  transfer->length = length;
  transfer->region = std::move(found.region);
  return absl::OkStatus();
}

// Whether the client closed its end of `connection` (or it broke): a read
// waiting for its mark ends then.
bool ClientGone(MHD_Connection* connection) {
  const MHD_ConnectionInfo* info =
      MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
  if (info == nullptr) return true;
  pollfd fd{info->connect_fd, POLLIN | POLLRDHUP, 0};
  if (poll(&fd, 1, 0) <= 0) return false;
  if (fd.revents & (POLLHUP | POLLERR | POLLRDHUP | POLLNVAL)) return true;
  char byte;
  return recv(info->connect_fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

// A read that names a mark: OK once it is posted OK or its range is written
// (MarkBoard::Progress); the failure posted, or why the wait ended without
// a post (nullopt: the client left).
std::optional<absl::Status> AwaitMark(const BulkHttpServer& server, MHD_Connection* connection,
                                      Transfer* transfer) {
  transfer->record.Stamp("waiting");
  bool stopping = false, left = false;
  std::optional<absl::Status> posted = transfer->region->marks()->Await(
      transfer->after_mark, absl::Now() + transfer->wait,
      [&] { return (stopping = server.stopping()) || (left = ClientGone(connection)); },
      absl::Milliseconds(50), transfer->to - transfer->region->base(), transfer->length);
  transfer->record.Stamp("posted");
  if (posted) return posted;
  if (stopping) return absl::UnavailableError("the server is stopping");
  if (left) return std::nullopt;
  return absl::DeadlineExceededError(absl::StrCat("after_mark: mark ", transfer->after_mark,
                                                  " was not posted within wait_ms (",
                                                  absl::ToInt64Milliseconds(transfer->wait), ")"));
}

void ReleaseHold(void* hold) { delete static_cast<std::shared_ptr<SharedRegion>*>(hold); }

MHD_Result Handle(void* cls, MHD_Connection* connection, const char* url, const char* method,
                  const char* /*version*/, const char* upload_data, size_t* upload_data_size,
                  void** request) {
  const auto* server = static_cast<const BulkHttpServer*>(cls);
  auto* transfer = static_cast<Transfer*>(*request);
  if (transfer == nullptr) {  // the headers are in
    const bool write = std::strcmp(method, MHD_HTTP_METHOD_PUT) == 0;
    transfer = new Transfer(server->metrics(), write ? "BulkWrite" : "BulkRead");
    transfer->record.SetVia("http");
    transfer->write = write;
    *request = transfer;
    if (!write && std::strcmp(method, MHD_HTTP_METHOD_GET) != 0) {
      return Answer(connection, transfer,
                    absl::InvalidArgumentError(
                        absl::StrCat("method: ", LogSafe(method, 16), "; expected GET or PUT")),
                    "", MHD_HTTP_METHOD_NOT_ALLOWED);
    }
    if (absl::Status admitted = Admit(*server, connection, url, transfer); !admitted.ok()) {
      // Before the body: the connection closes after this answer.
      return Answer(connection, transfer, admitted, "", transfer->refusal_http_status);
    }
    // Answered in the next call, once the whole request is in: an answer
    // queued earlier makes libmicrohttpd close the connection after it.
    return MHD_YES;
  }
  if (!transfer->write) {
    if (transfer->after_mark != 0) {
      std::optional<absl::Status> posted = AwaitMark(*server, connection, transfer);
      if (!posted) return MHD_NO;  // the client left: Completed records it
      if (!posted->ok()) return Answer(connection, transfer, *posted, "");
    }
    // The bytes go out straight from the region, which the response holds.
    auto* hold = new std::shared_ptr<SharedRegion>(transfer->region);
    MHD_Response* response = MHD_create_response_from_buffer_with_free_callback_cls(
        static_cast<size_t>(transfer->length), transfer->to, &ReleaseHold, hold);
    if (response == nullptr) {
      ReleaseHold(hold);
      return MHD_NO;
    }
    MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, "application/octet-stream");
    MHD_add_response_header(response, "Flce-Code", "0");
    transfer->record.SetAnswer(absl::OkStatus());
    const MHD_Result queued = MHD_queue_response(connection, MHD_HTTP_OK, response);
    MHD_destroy_response(response);
    return queued;
  }
  if (*upload_data_size > 0) {  // a PUT's next bytes (never past Content-Length)
    std::memcpy(transfer->to + transfer->moved, upload_data, *upload_data_size);
    transfer->moved += static_cast<int64_t>(*upload_data_size);
    *upload_data_size = 0;
    return MHD_YES;
  }
  transfer->record.AddBytes(transfer->moved, 0);
  return Answer(connection, transfer, absl::OkStatus(),
                absl::StrCat("wrote ", transfer->moved, " bytes\n"));
}

// The request is over: its access line and metrics, with what the client
// got (a transfer cut short is CANCELLED, whatever was answered).
void Completed(void* /*cls*/, MHD_Connection* /*connection*/, void** request,
               MHD_RequestTerminationCode how) {
  auto* transfer = static_cast<Transfer*>(*request);
  if (transfer == nullptr) return;
  *request = nullptr;
  if (how == MHD_REQUEST_TERMINATED_COMPLETED_OK) {
    if (!transfer->write && transfer->region != nullptr) {
      transfer->record.AddBytes(0, transfer->length);
    }
  } else {
    const char* why = how == MHD_REQUEST_TERMINATED_TIMEOUT_REACHED ? "idle past the timeout"
                      : how == MHD_REQUEST_TERMINATED_DAEMON_SHUTDOWN ? "the server stopped"
                                                                      : "the connection broke";
    transfer->record.SetAnswer(absl::CancelledError(
        transfer->write ? absl::StrCat(why, " after ", transfer->moved, " of ", transfer->length,
                                       " bytes (the range holds what arrived)")
                        : absl::StrCat(why, " before the ", transfer->length,
                                       " bytes were sent")));
    if (transfer->write) transfer->record.AddBytes(transfer->moved, 0);
  }
  transfer->record.Over(nullptr);
  delete transfer;
}

void Log(void* /*cls*/, const char* format, va_list args) {
  char line[512];
  std::vsnprintf(line, sizeof(line), format, args);
  line[strcspn(line, "\n")] = '\0';
  SPDLOG_DEBUG("bulk http: {}", line);
}

}  // namespace

absl::StatusOr<std::unique_ptr<BulkHttpServer>> BulkHttpServer::Start(
    const BulkHttpOptions& options, const SharedMemoryRegistry* regions,
    ServiceMetrics* metrics) {
  FLCE_ASSIGN_OR_RETURN(const HttpListenAddress listen,
                        ParseHttpListenAddress(options.address, "--bulk_address",
                                               "0.0.0.0:50052"));
  if (options.tls_cert_pem.empty() != options.tls_key_pem.empty()) {
    return absl::InvalidArgumentError("bulk port: a TLS certificate and key go together");
  }
  if (options.max_connections < 1 || options.max_connections_per_address < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_bulk_connections (", options.max_connections,
        ") and --max_bulk_connections_per_address (", options.max_connections_per_address,
        ") must be >= 1"));
  }
  std::unique_ptr<BulkHttpServer> server(new BulkHttpServer());
  server->regions_ = regions;
  server->metrics_ = metrics;
  server->tls_ = !options.tls_cert_pem.empty();
  if (server->tls_ && MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES) {
    return absl::UnimplementedError(
        "--bulk_address: this libmicrohttpd has no TLS; serve the bulk port off (--bulk_address=) "
        "or install one built with GnuTLS");
  }
  server->cert_pem_ = options.tls_cert_pem;
  server->key_pem_ = options.tls_key_pem;
  unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                   MHD_USE_ERROR_LOG;
  if (listen.ipv6) flags |= MHD_USE_IPv6;
  if (server->tls_) flags |= MHD_USE_TLS;
  // libmicrohttpd counts whole seconds: at least one.
  const unsigned timeout_s = static_cast<unsigned>(std::max<int64_t>(
      1, absl::ToInt64Seconds(absl::Ceil(options.idle_timeout, absl::Seconds(1)))));
  // The TLS options last: libmicrohttpd refuses them on a plaintext daemon.
  server->daemon_ = MHD_start_daemon(
      flags, static_cast<uint16_t>(listen.port), nullptr, nullptr, &Handle, server.get(),
      MHD_OPTION_SOCK_ADDR, listen.sockaddr_ptr(), MHD_OPTION_CONNECTION_LIMIT,
      static_cast<unsigned>(options.max_connections), MHD_OPTION_PER_IP_CONNECTION_LIMIT,
      static_cast<unsigned>(options.max_connections_per_address), MHD_OPTION_CONNECTION_TIMEOUT,
      timeout_s, MHD_OPTION_CONNECTION_MEMORY_LIMIT, kConnectionMemory,
      MHD_OPTION_NOTIFY_COMPLETED, &Completed, nullptr, MHD_OPTION_EXTERNAL_LOGGER, &Log,
      nullptr, server->tls_ ? MHD_OPTION_HTTPS_MEM_CERT : MHD_OPTION_END,
      server->cert_pem_.c_str(), MHD_OPTION_HTTPS_MEM_KEY, server->key_pem_.c_str(),
      MHD_OPTION_END);
  if (server->daemon_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "--bulk_address: cannot listen on ", options.address, ": ", std::strerror(errno),
        server->tls_ ? " (or the TLS certificate and key were refused; --log_level=debug says)"
                     : ""));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(server->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  server->port_ = info != nullptr ? info->port : listen.port;
  return server;
}

int BulkHttpServer::connections() const {
  const MHD_DaemonInfo* info =
      MHD_get_daemon_info(daemon_, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
  return info != nullptr ? static_cast<int>(info->num_connections) : 0;
}

BulkHttpServer::~BulkHttpServer() {
  stopping_.store(true, std::memory_order_relaxed);
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
}

}  // namespace flce
