#ifndef FLCE_TESTS_LOOPBACK_SOCKET_H_
#define FLCE_TESTS_LOOPBACK_SOCKET_H_

// A test's TCP connection to a port on 127.0.0.1, for speaking raw HTTP to
// the server's side ports (metrics, bulk) the way any client could.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace flce {

// A connected socket (reads give up after `recv_timeout_s`), or -1.
inline int ConnectLoopback(int port, int recv_timeout_s = 10) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)) != 0) {
    close(fd);
    return -1;
  }
  timeval timeout{recv_timeout_s, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  return fd;
}

}  // namespace flce

#endif  // FLCE_TESTS_LOOPBACK_SOCKET_H_
