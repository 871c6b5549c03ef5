#ifndef FLCE_SERVER_AUTH_H_
#define FLCE_SERVER_AUTH_H_

// Who a call acts for. Sessions, registered weights and shared-memory
// regions belong to the principal that made them; other principals see
// NOT_FOUND.
//
// - With bearer tokens (--auth_tokens_file), every call of the loss service
//   must carry "authorization: Bearer <token>"; the principal is the name
//   the file gives that token. A missing or unknown token is UNAUTHENTICATED.
//   Tokens are compared as SHA-256 digests, against every entry, in
//   constant time, so neither the time nor the order of the file tells an
//   attacker how close a guess was.
// - Without tokens but with verified client certificates (mutual TLS), the
//   principal is "cert:" + the certificate's common name.
// - Otherwise every caller is the anonymous principal "".

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace flce {

class Authenticator {
 public:
  // (principal, token) pairs. INVALID_ARGUMENT for an empty principal or
  // token, or a token given twice.
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromTokens(
      const std::vector<std::pair<std::string, std::string>>& tokens);

  // A file of "<principal> <token>" lines; blank lines and lines starting
  // with '#' are skipped. INVALID_ARGUMENT naming the line for a malformed
  // one, NOT_FOUND if the file cannot be read.
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromTokensFile(const std::string& path);

  // With neither tokens nor client certificates: everyone is "".
  static std::unique_ptr<Authenticator> Anonymous();

  // Principals from client certificates (mutual TLS), unless tokens are set.
  void set_use_client_certificates(bool on) { use_client_certificates_ = on; }
  bool uses_tokens() const { return !entries_.empty(); }

  // The principal of a call (see the file comment); UNAUTHENTICATED when
  // tokens are required and the call has none or an unknown one.
  absl::StatusOr<std::string> Authenticate(const grpc::ServerContextBase& context) const;

  // The principal a token names, or UNAUTHENTICATED.
  absl::StatusOr<std::string> PrincipalForToken(absl::string_view token) const;

 private:
  struct Entry {
    std::array<unsigned char, 32> digest;
    std::string principal;
  };
  Authenticator() = default;

  std::vector<Entry> entries_;
  bool use_client_certificates_ = false;
};

}  // namespace flce

#endif  // FLCE_SERVER_AUTH_H_
