#include "client/bulk_http_client.h"

#include <arpa/inet.h>
#include <curl/curl.h>
#include <netdb.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace flce {
namespace {

constexpr char kUnreachable[] = "flce.dev/bulk-unreachable";
constexpr long kConnectTimeoutMs = 5000;

void GlobalInit() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// "[::1]" for an IPv6 host in a URL, the host itself otherwise.
std::string UrlHost(const std::string& host) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]") : host;
}

}  // namespace

// One request's state, seen by libcurl's callbacks.
struct BulkHttpClient::Exchange {
  bool put = false;
  char* buffer = nullptr;  // the body (PUT) or where it lands (GET)
  int64_t bytes = 0, moved = 0;
  long status = 0;         // the final status line's (not 100 Continue)
  int flce_code = -1;      // the Flce-Code header's
  std::string error_body;  // a refusal's message

  static size_t Header(char* data, size_t size, size_t n, void* self) {
    auto* e = static_cast<Exchange*>(self);
    absl::string_view line(data, size * n);
    if (absl::ConsumePrefix(&line, "HTTP/")) {
      const size_t space = line.find(' ');
      long code = 0;
      if (space != absl::string_view::npos &&
          absl::SimpleAtoi(line.substr(space + 1, 3), &code) && code != 100) {
        e->status = code;
      }
    } else if (absl::StartsWithIgnoreCase(line, "Flce-Code:")) {
      int code = -1;
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(10)), &code)) {
        e->flce_code = code;
      }
    }
    return size * n;
  }
  static size_t Read(char* out, size_t size, size_t n, void* self) {
    auto* e = static_cast<Exchange*>(self);
    const size_t take = std::min<size_t>(size * n, static_cast<size_t>(e->bytes - e->moved));
    std::memcpy(out, e->buffer + e->moved, take);
    e->moved += static_cast<int64_t>(take);
    return take;
  }
  static size_t Write(char* data, size_t size, size_t n, void* self) {
    auto* e = static_cast<Exchange*>(self);
    const size_t got = size * n;
    if (e->put || e->status != 200) {
      if (e->error_body.size() < 4096) e->error_body.append(data, std::min<size_t>(got, 4096));
      return got;
    }
    if (static_cast<int64_t>(got) > e->bytes - e->moved) return 0;  // more than asked: abort
    std::memcpy(e->buffer + e->moved, data, got);
    e->moved += static_cast<int64_t>(got);
    return got;
  }
};

BulkHttpClient::BulkHttpClient(BulkHttpEndpoint endpoint, absl::Duration timeout)
    : endpoint_(std::move(endpoint)),
      timeout_(timeout),
      // The URL (and so the certificate check and the Host header) names
      // the server name, or the host; CURLOPT_CONNECT_TO dials the address.
      url_host_(UrlHost(endpoint_.tls_server_name.empty() ? endpoint_.host
                                                          : endpoint_.tls_server_name)),
      base_url_(absl::StrCat(endpoint_.tls ? "https://" : "http://", url_host_, ":",
                             endpoint_.port, "/v1/regions/")),
      pinned_(endpoint_.host) {
  GlobalInit();
}

absl::Status BulkHttpClient::Pin(const std::string& region, const std::string& ticket) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int error = getaddrinfo(endpoint_.host.c_str(), nullptr, &hints, &found);
  std::vector<std::string> addresses;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = "";
    const void* in = a->ai_family == AF_INET6
                         ? static_cast<const void*>(
                               &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr)
                         : &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr;
    if (inet_ntop(a->ai_family, in, text, sizeof(text)) != nullptr &&
        std::find(addresses.begin(), addresses.end(), text) == addresses.end()) {
      addresses.push_back(text);
    }
  }
  if (found != nullptr) freeaddrinfo(found);
  if (error != 0 || addresses.empty()) {
    absl::Status status = absl::UnavailableError(
        absl::StrCat("bulk: cannot resolve ", endpoint_.host, ": ", gai_strerror(error)));
    status.SetPayload(kUnreachable, absl::Cord("1"));
    return status;
  }
  std::string holder = addresses.size() == 1 ? addresses[0] : "";
  for (size_t i = 0; holder.empty() && i < addresses.size(); ++i) {
    if (Run(false, region, ticket, 0, nullptr, 0, addresses[i]).ok()) holder = addresses[i];
  }
  if (holder.empty()) {
    absl::Status status = absl::UnavailableError(absl::StrCat(
        "bulk: none of ", endpoint_.host, "'s ", addresses.size(),
        " addresses holds the region on port ", endpoint_.port));
    status.SetPayload(kUnreachable, absl::Cord("1"));
    return status;
  }
  absl::MutexLock lock(&mu_);
  if (holder != pinned_) {
    for (void* handle : idle_) curl_easy_cleanup(static_cast<CURL*>(handle));
    idle_.clear();  // their connections go elsewhere
    pinned_ = holder;
  }
  return absl::OkStatus();
}

BulkHttpClient::~BulkHttpClient() {
  absl::MutexLock lock(&mu_);
  for (void* handle : idle_) curl_easy_cleanup(static_cast<CURL*>(handle));
}

void* BulkHttpClient::TakeHandle() {
  {
    absl::MutexLock lock(&mu_);
    if (!idle_.empty()) {
      void* handle = idle_.back();
      idle_.pop_back();
      return handle;
    }
  }
  return curl_easy_init();
}

void BulkHttpClient::GiveBack(void* handle) {
  absl::MutexLock lock(&mu_);
  idle_.push_back(handle);
}

bool BulkHttpClient::IsUnreachable(const absl::Status& status) {
  return status.GetPayload(kUnreachable).has_value();
}

absl::Status BulkHttpClient::Put(const std::string& region, const std::string& ticket,
                                 int64_t offset, const char* data, int64_t bytes) {
  return Run(true, region, ticket, offset, const_cast<char*>(data), bytes);
}

absl::Status BulkHttpClient::Get(const std::string& region, const std::string& ticket,
                                 int64_t offset, char* out, int64_t bytes) {
  return Run(false, region, ticket, offset, out, bytes);
}

absl::Status BulkHttpClient::Run(bool put, const std::string& region, const std::string& ticket,
                                 int64_t offset, char* buffer, int64_t bytes,
                                 const std::string& address) {
  CURL* curl = static_cast<CURL*>(TakeHandle());
  if (curl == nullptr) return absl::ResourceExhaustedError("bulk: curl_easy_init failed");
  Exchange e;
  e.put = put;
  e.buffer = buffer;
  e.bytes = bytes;
  const std::string url =
      absl::StrCat(base_url_, region, "?offset=", offset, put ? "" : absl::StrCat("&length=", bytes));
  const std::string authorization = absl::StrCat("Authorization: Bearer ", ticket);
  curl_slist* headers = curl_slist_append(nullptr, authorization.c_str());
  std::string to = address;
  if (to.empty()) {
    absl::MutexLock lock(&mu_);
    to = pinned_;
  }
  const std::string connect_to =
      absl::StrCat(url_host_, ":", endpoint_.port, ":", UrlHost(to), ":", endpoint_.port);
  curl_slist* connect_list = curl_slist_append(nullptr, connect_to.c_str());
  curl_easy_reset(curl);  // keeps the connection, forgets the last request
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, kConnectTimeoutMs);
  curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, static_cast<long>(absl::ToInt64Milliseconds(timeout_)));
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, &Exchange::Header);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &e);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, &Exchange::Write);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &e);
  curl_easy_setopt(curl, CURLOPT_BUFFERSIZE, 512L << 10);
  curl_easy_setopt(curl, CURLOPT_CONNECT_TO, connect_list);
  if (endpoint_.tls && !endpoint_.tls_root_certs.empty()) {
    curl_blob ca{const_cast<char*>(endpoint_.tls_root_certs.data()),
                 endpoint_.tls_root_certs.size(), CURL_BLOB_COPY};
    curl_easy_setopt(curl, CURLOPT_CAINFO_BLOB, &ca);
  }
  if (put) {
    curl_easy_setopt(curl, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(curl, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(bytes));
    curl_easy_setopt(curl, CURLOPT_READFUNCTION, &Exchange::Read);
    curl_easy_setopt(curl, CURLOPT_READDATA, &e);
    curl_easy_setopt(curl, CURLOPT_UPLOAD_BUFFERSIZE, 2L << 20);
  }
  const CURLcode result = curl_easy_perform(curl);
  curl_slist_free_all(headers);
  curl_slist_free_all(connect_list);
  const char* what = put ? "bulk PUT" : "bulk GET";
  absl::Status status;
  if (result != CURLE_OK && e.status == 0) {
    // Never connected, or a new connection closed without a word (a server
    // at its connection limit): the caller may go over gRPC instead.
    curl_off_t pretransfer = 0;
    long connects = 0;
    curl_easy_getinfo(curl, CURLINFO_PRETRANSFER_TIME_T, &pretransfer);
    curl_easy_getinfo(curl, CURLINFO_NUM_CONNECTS, &connects);
    const bool never_connected = result == CURLE_COULDNT_CONNECT ||
                                 result == CURLE_COULDNT_RESOLVE_HOST ||
                                 result == CURLE_SSL_CONNECT_ERROR ||
                                 (result == CURLE_OPERATION_TIMEDOUT && pretransfer == 0) ||
                                 (result == CURLE_GOT_NOTHING && connects > 0);
    status = absl::UnavailableError(absl::StrCat(what, ": ", curl_easy_strerror(result), " (",
                                                 endpoint_.host, ":", endpoint_.port, ")"));
    if (never_connected) status.SetPayload(kUnreachable, absl::Cord("1"));
  } else if (e.status != 200) {
    const absl::StatusCode code = e.flce_code > 0 && e.flce_code <= 16
                                      ? static_cast<absl::StatusCode>(e.flce_code)
                                      : absl::StatusCode::kUnknown;
    status = absl::Status(code, absl::StrCat(what, ": ", absl::StripAsciiWhitespace(e.error_body),
                                             " (HTTP ", e.status, ")"));
  } else if (result != CURLE_OK || e.moved != bytes) {
    status = absl::UnavailableError(absl::StrCat(what, ": ", e.moved, " of ", bytes,
                                                 " bytes moved: ", curl_easy_strerror(result)));
  }
  if (status.ok()) {
    GiveBack(curl);
  } else {
    curl_easy_cleanup(curl);  // the connection's state is unknown
  }
  return status;
}

}  // namespace flce
