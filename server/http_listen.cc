#include "server/http_listen.h"

#include <arpa/inet.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace flce {

absl::StatusOr<HttpListenAddress> ParseHttpListenAddress(const std::string& address,
                                                         const char* flag, const char* example) {
  auto malformed = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": '", address, "' is not host:port with an IPv4 host, localhost or [IPv6] (e.g. ",
        example, ")"));
  };
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return malformed();
  }
  std::string host = address.substr(0, colon);
  HttpListenAddress out;
  out.port = port;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&out.address);
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(static_cast<uint16_t>(port));
    if (inet_pton(AF_INET6, host.substr(1, host.size() - 2).c_str(), &in6->sin6_addr) != 1) {
      return malformed();
    }
    out.ipv6 = true;
    return out;
  }
  if (host == "localhost") host = "127.0.0.1";
  auto* in = reinterpret_cast<sockaddr_in*>(&out.address);
  in->sin_family = AF_INET;
  in->sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &in->sin_addr) != 1) return malformed();
  return out;
}

}  // namespace flce
