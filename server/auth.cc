#include "server/auth.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace flce {
namespace {

std::array<unsigned char, 32> Digest(absl::string_view token) {
  std::array<unsigned char, 32> digest;
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), digest.data());
  return digest;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromTokens(
    const std::vector<std::pair<std::string, std::string>>& tokens) {
  std::unique_ptr<Authenticator> auth(new Authenticator());
  for (const auto& [principal, token] : tokens) {
    if (principal.empty() || token.empty()) {
      return absl::InvalidArgumentError("auth tokens: a principal and its token must not be empty");
    }
    Entry entry{Digest(token), principal};
    for (const Entry& other : auth->entries_) {
      if (other.digest == entry.digest) {
        return absl::InvalidArgumentError(absl::StrCat(
            "auth tokens: the token of '", principal, "' is also the token of '",
            other.principal, "'"));
      }
    }
    auth->entries_.push_back(std::move(entry));
  }
  return auth;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromTokensFile(
    const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--auth_tokens_file: cannot read ", path));
  std::vector<std::pair<std::string, std::string>> tokens;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    const absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || absl::StartsWith(text, "#")) continue;
    std::vector<std::string> fields = absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--auth_tokens_file: ", path, " line ", number,
          ": expected '<principal> <token>'"));  // the line itself may hold a secret
    }
    tokens.emplace_back(std::move(fields[0]), std::move(fields[1]));
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_tokens_file: ", path, " holds no token"));
  }
  return FromTokens(tokens);
}

std::unique_ptr<Authenticator> Authenticator::Anonymous() {
  return std::unique_ptr<Authenticator>(new Authenticator());
}

absl::StatusOr<std::string> Authenticator::PrincipalForToken(absl::string_view token) const {
  const std::array<unsigned char, 32> digest = Digest(token);
  const Entry* match = nullptr;
  for (const Entry& entry : entries_) {  // every entry, no early exit
    const bool equal = CRYPTO_memcmp(entry.digest.data(), digest.data(), digest.size()) == 0;
    if (equal) match = &entry;
  }
  if (match == nullptr) return absl::UnauthenticatedError("unknown bearer token");
  return match->principal;
}

absl::StatusOr<std::string> Authenticator::Authenticate(
    const grpc::ServerContextBase& context) const {
  if (!entries_.empty()) {
    const auto& metadata = context.client_metadata();
    auto it = metadata.find("authorization");
    if (it == metadata.end()) {
      return absl::UnauthenticatedError(
          "missing 'authorization: Bearer <token>' metadata; this server requires a token");
    }
    const absl::string_view value(it->second.data(), it->second.size());
    constexpr absl::string_view kBearer = "Bearer ";
    if (!absl::StartsWithIgnoreCase(value, kBearer)) {
      return absl::UnauthenticatedError("authorization metadata: expected 'Bearer <token>'");
    }
    return PrincipalForToken(value.substr(kBearer.size()));
  }
  if (use_client_certificates_) {
    const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
    if (auth != nullptr) {
      for (const grpc::string_ref& name : auth->FindPropertyValues("x509_common_name")) {
        return absl::StrCat("cert:", absl::string_view(name.data(), name.size()));
      }
    }
    return absl::UnauthenticatedError("no verified client certificate");
  }
  return std::string();
}

}  // namespace flce
