#include "server/auth.h"

#include <cstdio>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace flce {
namespace {

using ::testing::HasSubstr;
using Code = absl::StatusCode;

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(AuthenticatorTest, TokensNameTheirPrincipals) {
  auto auth = Authenticator::FromTokens({{"alice", "t-alice"}, {"bob", "t-bob"}});
  ASSERT_TRUE(auth.ok());
  EXPECT_EQ(*(*auth)->PrincipalForToken("t-alice"), "alice");
  EXPECT_EQ(*(*auth)->PrincipalForToken("t-bob"), "bob");
  EXPECT_THAT((*auth)->PrincipalForToken("t-alic"), StatusIs(Code::kUnauthenticated, ::testing::_));
  EXPECT_THAT((*auth)->PrincipalForToken(""), StatusIs(Code::kUnauthenticated, ::testing::_));
  EXPECT_TRUE((*auth)->uses_tokens());
}

TEST(AuthenticatorTest, RejectsEmptyAndDuplicateTokens) {
  EXPECT_THAT(Authenticator::FromTokens({{"alice", ""}}), StatusIs(Code::kInvalidArgument, ::testing::_));
  EXPECT_THAT(Authenticator::FromTokens({{"", "t"}}), StatusIs(Code::kInvalidArgument, ::testing::_));
  EXPECT_THAT(Authenticator::FromTokens({{"alice", "same"}, {"bob", "same"}}),
              StatusIs(Code::kInvalidArgument, HasSubstr("also the token of 'alice'")));
}

TEST(AuthenticatorTest, ReadsTheTokensFile) {
  const std::string path =
      WriteFile("tokens", "# principal token\n\nalice  t-alice\n\tbob\tt-bob  \n");
  auto auth = Authenticator::FromTokensFile(path);
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_EQ(*(*auth)->PrincipalForToken("t-bob"), "bob");

  const std::string bad = WriteFile("bad_tokens", "alice t-alice\nbob\n");
  EXPECT_THAT(Authenticator::FromTokensFile(bad),
              StatusIs(Code::kInvalidArgument, HasSubstr("line 2")));
  EXPECT_THAT(Authenticator::FromTokensFile(WriteFile("empty", "# nothing\n")),
              StatusIs(Code::kInvalidArgument, HasSubstr("no token")));
  EXPECT_THAT(Authenticator::FromTokensFile("/nonexistent/tokens"),
              StatusIs(Code::kNotFound, ::testing::_));
}

TEST(AuthenticatorTest, AnonymousUsesNoTokens) {
  EXPECT_FALSE(Authenticator::Anonymous()->uses_tokens());
}

}  // namespace
}  // namespace flce
