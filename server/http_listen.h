#ifndef FLCE_SERVER_HTTP_LISTEN_H_
#define FLCE_SERVER_HTTP_LISTEN_H_

// Where an HTTP side port of the server (metrics, bulk) listens, in the form
// libmicrohttpd takes it.

#include <netinet/in.h>
#include <sys/socket.h>

#include <string>

#include "absl/status/statusor.h"

namespace flce {

struct HttpListenAddress {
  sockaddr_storage address{};  // a sockaddr_in, or a sockaddr_in6 when ipv6
  bool ipv6 = false;
  int port = 0;

  const sockaddr* sockaddr_ptr() const { return reinterpret_cast<const sockaddr*>(&address); }
};

// "host:port" with an IPv4 host, "localhost" or a bracketed IPv6 host
// ("[::]:9090"); port 0 picks a free one. INVALID_ARGUMENT naming `flag`
// (and `example`) for anything else.
absl::StatusOr<HttpListenAddress> ParseHttpListenAddress(const std::string& address,
                                                         const char* flag, const char* example);

}  // namespace flce

#endif  // FLCE_SERVER_HTTP_LISTEN_H_
