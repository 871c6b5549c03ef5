// Transport security and authentication end to end: TLS and mutual-TLS
// handshakes accepted and refused, bearer tokens, per-principal ownership of
// sessions, weights and shared-memory regions, and per-principal limits.
// Certificates: tests/testdata/tls (a test CA, a server certificate for
// localhost/127.0.0.1, a client certificate it signs, and a client
// certificate of another CA).

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "client/loss_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/reference/random_problem.h"
#include "proto/codec.h"
#include "server/loss_server.h"
#include "tests/status_matchers.h"

namespace flce {
namespace {

using ::testing::HasSubstr;
using Code = absl::StatusCode;

constexpr char kCerts[] = "tests/testdata/tls/";

std::string Read(const std::string& name) {
  std::ifstream in(kCerts + name);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string TokensFile() {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/tokens";
  std::ofstream(path) << "# principal token\nalice secret-alice\nbob secret-bob\n";
  return path;
}

ServerOptions Options() {
  ServerOptions o;
  o.listen_address = "127.0.0.1:0";
  o.backend = "cpu";
  return o;
}

std::unique_ptr<LossServer> StartOrDie(const ServerOptions& o) {
  auto server = LossServer::Start(o);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

std::unique_ptr<LossClient> Client(const LossServer& server, ClientOptions o = {}) {
  o.timeout = absl::Seconds(20);
  return LossClient::Create("127.0.0.1:" + std::to_string(server.port()), o);
}

ClientOptions Tls(const std::string& ca = "ca.crt") {
  ClientOptions o;
  o.tls = true;
  o.tls_root_certs = Read(ca);
  return o;
}

ClientOptions WithToken(const std::string& token) {
  ClientOptions o;
  o.token = token;
  return o;
}

OwnedProblem Problem() {
  RandomProblemSpec spec;
  spec.rows = 6;
  spec.hidden = 5;
  spec.vocab = 11;
  spec.dtype = DType::kFloat32;
  return MakeRandomProblem(spec);
}

ForwardArgs Args(const OwnedProblem& p) {
  ForwardArgs args;
  args.problem = p.view();
  args.need_backward = true;
  return args;
}

TEST(SecurityTest, StartRefusesPlaintextUnlessAskedAndBadTlsOptions) {
  ServerOptions o = Options();
  EXPECT_THAT(LossServer::Start(o), StatusIs(Code::kInvalidArgument, HasSubstr("--insecure")));
  o.security.tls_cert_file = std::string(kCerts) + "server.crt";
  EXPECT_THAT(LossServer::Start(o),
              StatusIs(Code::kInvalidArgument, HasSubstr("--tls_key_file")));
  o.security.tls_key_file = std::string(kCerts) + "missing.key";
  EXPECT_THAT(LossServer::Start(o), StatusIs(Code::kNotFound, HasSubstr("missing.key")));
  ServerOptions ca_only = Options();
  ca_only.security.insecure = true;
  ca_only.security.tls_client_ca_file = std::string(kCerts) + "ca.crt";
  EXPECT_THAT(LossServer::Start(ca_only),
              StatusIs(Code::kInvalidArgument, HasSubstr("--tls_client_ca_file needs TLS")));
  ServerOptions no_tokens = Options();
  no_tokens.security.insecure = true;
  no_tokens.security.auth_tokens_file = "/nonexistent/tokens";
  EXPECT_THAT(LossServer::Start(no_tokens), StatusIs(Code::kNotFound, HasSubstr("tokens")));
}

TEST(SecurityTest, TlsServesClientsThatTrustItsCa) {
  ServerOptions o = Options();
  o.security.tls_cert_file = std::string(kCerts) + "server.crt";
  o.security.tls_key_file = std::string(kCerts) + "server.key";
  auto server = StartOrDie(o);
  ASSERT_NE(server, nullptr);
  auto trusting = Client(*server, Tls());
  ASSERT_TRUE(trusting->GetServerInfo().ok());
  const OwnedProblem p = Problem();
  auto fwd = trusting->Forward(Args(p));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  BackwardArgs back;
  back.session_id = fwd->session_id;
  EXPECT_TRUE(trusting->Backward(back).ok());
  // Plaintext, and TLS trusting another CA, do not get through the handshake.
  EXPECT_THAT(Client(*server)->GetServerInfo().status(), StatusIs(Code::kUnavailable, ::testing::_));
  EXPECT_THAT(Client(*server, Tls("other_ca.crt"))->GetServerInfo().status(),
              StatusIs(Code::kUnavailable, ::testing::_));
}

TEST(SecurityTest, PlaintextHealthPortServesOnlyHealth) {
  ServerOptions o = Options();
  o.security.tls_cert_file = std::string(kCerts) + "server.crt";
  o.security.tls_key_file = std::string(kCerts) + "server.key";
  o.health_address = "127.0.0.1:0";
  auto server = StartOrDie(o);
  ASSERT_NE(server, nullptr);
  ASSERT_GT(server->health_port(), 0);
  auto probe = LossClient::Create("127.0.0.1:" + std::to_string(server->health_port()));
  auto health = probe->CheckHealth("flce.v1.LossService");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
  // The loss service is not there in plaintext.
  EXPECT_THAT(probe->GetServerInfo().status(), StatusIs(Code::kUnimplemented, ::testing::_));
  server->Drain(absl::ZeroDuration());
  EXPECT_EQ(*probe->CheckHealth("flce.v1.LossService"),
            grpc::health::v1::HealthCheckResponse::NOT_SERVING);
}

TEST(SecurityTest, MutualTlsNeedsACertificateTheServerTrusts) {
  ServerOptions o = Options();
  o.security.tls_cert_file = std::string(kCerts) + "server.crt";
  o.security.tls_key_file = std::string(kCerts) + "server.key";
  o.security.tls_client_ca_file = std::string(kCerts) + "ca.crt";
  auto server = StartOrDie(o);
  ASSERT_NE(server, nullptr);
  ClientOptions good = Tls();
  good.tls_client_cert = Read("client.crt");
  good.tls_client_key = Read("client.key");
  auto client = Client(*server, good);
  const OwnedProblem p = Problem();
  auto fwd = client->Forward(Args(p));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_FALSE(fwd->session_id.empty());

  EXPECT_THAT(Client(*server, Tls())->GetServerInfo().status(),
              StatusIs(Code::kUnavailable, ::testing::_));
  ClientOptions untrusted = Tls();
  untrusted.tls_client_cert = Read("untrusted_client.crt");
  untrusted.tls_client_key = Read("untrusted_client.key");
  EXPECT_THAT(Client(*server, untrusted)->GetServerInfo().status(),
              StatusIs(Code::kUnavailable, ::testing::_));
}

// The bulk port speaks TLS with the server's certificate (checked against
// the server name the client gives), and its ticket is the credential: with
// mutual TLS and tokens on the gRPC port, a weight and its gradient still
// move over it.
TEST(SecurityTest, TheBulkPortSpeaksTlsAndNeedsOnlyTheRegionsTicket) {
  ServerOptions o = Options();
  o.security.tls_cert_file = std::string(kCerts) + "service_server.crt";
  o.security.tls_key_file = std::string(kCerts) + "service_server.key";
  o.security.tls_client_ca_file = std::string(kCerts) + "ca.crt";
  o.security.auth_tokens_file = TokensFile();
  auto server = StartOrDie(o);
  ASSERT_NE(server, nullptr);
  ASSERT_GT(server->bulk_port(), 0);
  ClientOptions c = Tls("service_ca.crt");
  c.tls_server_name = "flce.ml.svc";
  c.tls_client_cert = Read("client.crt");
  c.tls_client_key = Read("client.key");
  c.token = "secret-alice";
  c.bulk_threshold_bytes = 1 << 16;
  auto client = Client(*server, c);
  HostTensor w(DType::kFloat32, {300, 128});
  for (int64_t i = 0; i < w.num_elements(); ++i) {
    w.mutable_data<float>()[i] = 0.001f * static_cast<float>(i % 101);
  }
  auto info = client->PutWeight("w", w.view(), std::nullopt);
  ASSERT_TRUE(info.ok()) << info.status();
  HostTensor x(DType::kFloat32, {2, 128}), t(DType::kInt64, {2});
  for (int64_t i = 0; i < 256; ++i) x.mutable_data<float>()[i] = 0.01f * static_cast<float>(i % 7);
  t.mutable_data<int64_t>()[0] = 3;
  t.mutable_data<int64_t>()[1] = 299;
  ForwardArgs args;
  args.problem.hidden = x.view();
  args.problem.target = t.view();
  args.weight_name = "w";
  args.need_backward = true;
  auto fwd = client->Forward(args);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  BackwardArgs back;
  back.session_id = fwd->session_id;
  back.accumulate_weight_grad = true;
  ASSERT_TRUE(client->Backward(back).ok());
  auto grad = client->TakeWeightGrad("w");
  ASSERT_TRUE(grad.ok()) << grad.status();
  EXPECT_EQ(grad->grad_weight.num_elements(), 300 * 128);
  // (Counted once the server is done with the request: maybe a moment later.)
  auto ok = [&](const char* rpc) {
    for (int i = 0; i < 500; ++i) {
      const MetricsSnapshot m = server->Metrics();
      auto it = m.requests.find({rpc, "OK"});
      if (it != m.requests.end() && it->second > 0) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  };
  EXPECT_TRUE(ok("BulkWrite"));
  EXPECT_TRUE(ok("BulkRead"));
}

class TokenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions o = Options();
    o.security.insecure = true;
    o.security.auth_tokens_file = TokensFile();
    o.enable_shared_memory = true;
    o.sessions.max_sessions_per_principal = 2;
    server_ = StartOrDie(o);
    ASSERT_NE(server_, nullptr);
    alice_ = Client(*server_, WithToken("secret-alice"));
    bob_ = Client(*server_, WithToken("secret-bob"));
  }

  std::unique_ptr<LossServer> server_;
  std::unique_ptr<LossClient> alice_, bob_;
};

TEST_F(TokenTest, MissingOrWrongTokenIsUnauthenticatedOnEveryRpc) {
  const OwnedProblem p = Problem();
  for (const ClientOptions& o : {ClientOptions(), WithToken("secret-alic"),
                                 WithToken("secret-alice-")}) {
    auto stranger = Client(*server_, o);
    EXPECT_THAT(stranger->GetServerInfo().status(), StatusIs(Code::kUnauthenticated, ::testing::_));
    EXPECT_THAT(stranger->Forward(Args(p)).status(),
                StatusIs(Code::kUnauthenticated, ::testing::_));
    BackwardArgs back;
    back.session_id = std::string(32, '0');
    EXPECT_THAT(stranger->Backward(back).status(), StatusIs(Code::kUnauthenticated, ::testing::_));
    EXPECT_THAT(stranger->ReleaseSession(std::string(32, '0')).status(),
                StatusIs(Code::kUnauthenticated, ::testing::_));
    EXPECT_THAT(stranger->PutWeight("w", p.weight.view(), std::nullopt).status(),
                StatusIs(Code::kUnauthenticated, ::testing::_));
    EXPECT_THAT(stranger->ListWeights().status(), StatusIs(Code::kUnauthenticated, ::testing::_));
    EXPECT_THAT(stranger->DeleteWeight("w").status(), StatusIs(Code::kUnauthenticated, ::testing::_));
    EXPECT_THAT(stranger->TakeWeightGrad("w").status(),
                StatusIs(Code::kUnauthenticated, ::testing::_));
    EXPECT_THAT(stranger->CreateSharedMemory(4096).status(),
                StatusIs(Code::kUnauthenticated, ::testing::_));
    // Streaming is refused before a byte of the tensors is read.
    ClientOptions streaming = o;
    streaming.stream_above_bytes = 1;
    EXPECT_THAT(Client(*server_, streaming)->Forward(Args(p)).status(),
                StatusIs(Code::kUnauthenticated, ::testing::_));
    // Health stays open, for probes.
    auto health = stranger->CheckHealth();
    ASSERT_TRUE(health.ok()) << health.status();
    EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
  }
  EXPECT_TRUE(alice_->GetServerInfo().ok());
}

TEST_F(TokenTest, PrincipalsCannotReachEachOthersSessionsWeightsOrRegions) {
  const OwnedProblem p = Problem();
  auto fwd = alice_->Forward(Args(p));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  BackwardArgs back;
  back.session_id = fwd->session_id;
  EXPECT_THAT(bob_->Backward(back).status(), StatusIs(Code::kNotFound, ::testing::_));
  EXPECT_FALSE(*bob_->ReleaseSession(fwd->session_id));
  EXPECT_TRUE(alice_->Backward(back).ok());  // still Alice's, untouched

  ASSERT_TRUE(alice_->PutWeight("head", p.weight.view(), std::nullopt).ok());
  EXPECT_EQ(bob_->ListWeights()->size(), 0u);
  EXPECT_EQ(alice_->ListWeights()->size(), 1u);
  ForwardArgs by_ref = Args(p);
  by_ref.weight_name = "head";
  EXPECT_THAT(bob_->Forward(by_ref).status(), StatusIs(Code::kNotFound, ::testing::_));
  EXPECT_THAT(bob_->TakeWeightGrad("head").status(), StatusIs(Code::kNotFound, ::testing::_));
  EXPECT_FALSE(*bob_->DeleteWeight("head"));
  EXPECT_TRUE(alice_->Forward(by_ref).ok());

  auto region = alice_->CreateSharedMemory(4096);
  ASSERT_TRUE(region.ok()) << region.status();
  v1::ForwardRequest raw = BuildForwardRequest(Args(p));
  raw.mutable_hidden()->clear_data();
  raw.mutable_hidden()->mutable_shm()->set_region_id((*region)->region_id());
  std::memcpy((*region)->base(), p.hidden.data.data(), p.hidden.data.size());
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(server_->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::LossService::NewStub(channel);
  auto forward_as = [&](const std::string& token) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer " + token);
    v1::ForwardResponse response;
    return FromGrpcStatus(stub->Forward(&context, raw, &response));
  };
  EXPECT_THAT(forward_as("secret-bob"), StatusIs(Code::kNotFound, HasSubstr("unknown region")));
  EXPECT_TRUE(forward_as("secret-alice").ok());
}

TEST_F(TokenTest, PerPrincipalSessionLimitLeavesOthersServed) {
  const OwnedProblem p = Problem();
  ASSERT_TRUE(alice_->Forward(Args(p)).ok());
  ASSERT_TRUE(alice_->Forward(Args(p)).ok());
  EXPECT_THAT(alice_->Forward(Args(p)).status(),
              StatusIs(Code::kResourceExhausted, HasSubstr("per principal")));
  EXPECT_TRUE(bob_->Forward(Args(p)).ok());
}

}  // namespace
}  // namespace flce
