// A real flce server on localhost:0, driven by the real client: results
// against the fp64 reference, every row of the error table that this build
// can produce, sessions, concurrency, deadlines and shutdown.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <future>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "client/loss_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/reference/accuracy.h"
#include "kernels/reference/random_problem.h"
#include "kernels/reference/reference_loss.h"
#include "proto/codec.h"
#include "proto/crc32c.h"
#include "server/engine_factory.h"
#include "server/loss_server.h"
#include "tests/loopback_socket.h"
#include "tests/shm_object.h"
#include "tests/status_matchers.h"

namespace flce {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using Code = absl::StatusCode;

// The backend under test: FLCE_TEST_BACKEND (the `gpu`-tagged variant of
// this test sets "cuda"), else "cpu".
std::string Backend() {
  const char* backend = std::getenv("FLCE_TEST_BACKEND");
  return backend != nullptr ? backend : "cpu";
}

bool RequireGpu() {
  const char* v = std::getenv("REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

ServerOptions TestOptions() {
  ServerOptions o;
  o.listen_address = "127.0.0.1:0";
  o.security.insecure = true;
  o.backend = Backend();
  // FLCE_TEST_VOCAB_SHARDS: the whole suite on a server that computes every
  // problem in that many vocabulary shards (--vocab_shards).
  if (const char* shards = std::getenv("FLCE_TEST_VOCAB_SHARDS")) {
    o.engine.vocab_shards = std::atoi(shards);
  }
  // FLCE_TEST_CUDA_DEVICES ("0,0", "0,1"): the suite on a server over an
  // engine per listed device (--cuda_devices), FLCE_TEST_CUDA_DEVICES_MODE
  // sharding or spreading.
  if (const char* devices = std::getenv("FLCE_TEST_CUDA_DEVICES")) {
    for (absl::string_view d : absl::StrSplit(devices, ',')) {
      int ordinal = 0;
      if (absl::SimpleAtoi(d, &ordinal)) o.engine.cuda_devices.push_back(ordinal);
    }
  }
  if (const char* mode = std::getenv("FLCE_TEST_CUDA_DEVICES_MODE")) {
    o.engine.cuda_devices_mode = mode;
  }
  o.workers = 2;
  o.reap_interval = absl::Milliseconds(50);
  return o;
}

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer(TestOptions()); }

  void StartServer(ServerOptions options) {
    auto server = LossServer::Start(options);
    if (!server.ok() && Backend() == "cuda" && !RequireGpu()) {
      GTEST_SKIP() << "CUDA backend unavailable: " << server.status();
    }
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    address_ = "127.0.0.1:" + std::to_string(server_->port());
    client_ = LossClient::Create(address_);
    channel_ = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    stub_ = v1::LossService::NewStub(channel_);
  }

  static OwnedProblem Problem(int64_t n, int64_t h, int64_t v, DType dtype = DType::kFloat32,
                              Reduction reduction = Reduction::kMean) {
    RandomProblemSpec spec;
    spec.rows = n;
    spec.hidden = h;
    spec.vocab = v;
    spec.dtype = dtype;
    spec.options.reduction = reduction;
    spec.ignore_fraction = 0.1;
    spec.seed = static_cast<uint64_t>(n * 7 + v);
    return MakeRandomProblem(spec);
  }

  static ForwardArgs Args(const OwnedProblem& p, bool need_backward = true,
                          BackwardMode mode = BackwardMode::kAuto) {
    ForwardArgs a;
    a.problem = p.view();
    a.need_backward = need_backward;
    a.mode = mode;
    return a;
  }

  // A raw Forward, for requests the client library would never build.
  absl::Status RawForward(const v1::ForwardRequest& request,
                          absl::Duration timeout = absl::Seconds(30)) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
    v1::ForwardResponse response;
    return FromGrpcStatus(stub_->Forward(&context, request, &response));
  }

  // Waits until the server runs `n` engine calls.
  void WaitUntilRunning(int64_t n) {
    for (int i = 0; i < 2000; ++i) {
      auto info = client_->GetServerInfo();
      if (info.ok() && info->running_requests() >= n) return;
      absl::SleepFor(absl::Milliseconds(2));
    }
    FAIL() << "the server never ran " << n << " request(s)";
  }

  // The server still answers a good request correctly.
  void ExpectStillServing() {
    OwnedProblem p = Problem(3, 4, 5);
    auto fwd = client_->Forward(Args(p, /*need_backward=*/false));
    EXPECT_TRUE(fwd.ok()) << fwd.status();
  }

  std::unique_ptr<LossServer> server_;
  std::string address_;
  std::unique_ptr<LossClient> client_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::LossService::Stub> stub_;
};

// Tests whose problems are sized to keep the CPU engine busy for a while
// (deadlines, cancellation, a full queue, shutdown with work in flight).
// The GPU variant of this binary leaves them out: a GPU finishes too soon.
class ServerTimingTest : public ServerTest {};

// --- results -------------------------------------------------------------

void ExpectMatchesReference(LossClient& client, const OwnedProblem& p, BackwardMode mode,
                            bool keep_session = false) {
  ForwardArgs args;
  args.problem = p.view();
  args.need_backward = true;
  args.mode = mode;
  args.want_lse = true;
  auto fwd = client.Forward(args);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  ASSERT_FALSE(fwd->session_id.empty());
  std::vector<double> g;
  HostTensor g_tensor(DType::kFloat32, p.options.reduction == Reduction::kNone
                                           ? std::vector<int64_t>{p.hidden.shape[0]}
                                           : std::vector<int64_t>{});
  for (int64_t i = 0; i < g_tensor.num_elements(); ++i) {
    g_tensor.mutable_data<float>()[i] = 0.5f + 0.25f * static_cast<float>(i % 5);
    g.push_back(g_tensor.data_as<float>()[i]);
  }
  BackwardArgs b;
  b.session_id = fwd->session_id;
  b.grad_output = g_tensor.view();
  b.keep_session = keep_session;
  auto grads = client.Backward(b);
  ASSERT_TRUE(grads.ok()) << grads.status();
  const EngineOutputs out = CollectOutputs(*fwd, &*grads);
  const AccuracyReport report = CheckAccuracy(p.view(), g, out);
  EXPECT_TRUE(report.ok()) << report.ToString();
}

TEST_F(ServerTest, ForwardBackwardMatchesReferenceForEveryDTypeAndMode) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
      for (BackwardMode m : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
        if (r == Reduction::kNone && m == BackwardMode::kStoreGrads) continue;
        SCOPED_TRACE(std::string(DTypeName(dtype)) + " " + ReductionName(r) + " " +
                     BackwardModeName(m));
        RandomProblemSpec spec;
        spec.rows = 23;
        spec.hidden = 17;
        spec.vocab = 301;
        spec.dtype = dtype;
        spec.bias = true;
        spec.class_weight = true;
        spec.ignore_fraction = 0.2;
        spec.options.reduction = r;
        spec.options.label_smoothing = 0.1f;
        spec.options.logit_softcap = 20.0f;
        spec.options.z_loss_scale = 1e-3f;
        ExpectMatchesReference(*client_, MakeRandomProblem(spec), m);
      }
    }
  }
  EXPECT_EQ(server_->engine().backend(), Backend());
}

TEST_F(ServerTest, AutoModeResolvesPerReduction) {
  OwnedProblem mean = Problem(5, 4, 9);
  auto fwd = client_->Forward(Args(mean));
  ASSERT_TRUE(fwd.ok());
  EXPECT_EQ(fwd->mode, BackwardMode::kStoreGrads);
  OwnedProblem none = Problem(5, 4, 9, DType::kFloat32, Reduction::kNone);
  fwd = client_->Forward(Args(none));
  ASSERT_TRUE(fwd.ok());
  EXPECT_EQ(fwd->mode, BackwardMode::kRecompute);
  EXPECT_EQ(fwd->loss.shape, std::vector<int64_t>({5}));
}

TEST_F(ServerTest, MeanOverNoValidRowsIsNaNAndNoRowsIsServed) {
  RandomProblemSpec spec;
  spec.rows = 4;
  spec.ignore_fraction = 1.0;
  OwnedProblem all_ignored = MakeRandomProblem(spec);
  auto fwd = client_->Forward(Args(all_ignored, false));
  ASSERT_TRUE(fwd.ok());
  EXPECT_TRUE(std::isnan(fwd->loss.data_as<float>()[0]));
  EXPECT_EQ(fwd->num_valid, 0);

  OwnedProblem empty = Problem(0, 4, 9, DType::kFloat32, Reduction::kSum);
  fwd = client_->Forward(Args(empty));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(fwd->loss.data_as<float>()[0], 0.0f);
  BackwardArgs b;
  b.session_id = fwd->session_id;
  auto grads = client_->Backward(b);
  ASSERT_TRUE(grads.ok()) << grads.status();
  EXPECT_EQ(grads->grad_hidden.shape, std::vector<int64_t>({0, 4}));
  for (float w : TensorToFloats(grads->grad_weight->view())) EXPECT_EQ(w, 0.0f);
}

// --- the error table -----------------------------------------------------

TEST_F(ServerTest, InvalidArgumentForMalformedTensorsAndOptions) {
  OwnedProblem p = Problem(4, 3, 6, DType::kBFloat16);
  const v1::ForwardRequest valid = BuildForwardRequest(Args(p));
  v1::ForwardRequest r = valid;
  r.mutable_hidden()->mutable_data()->pop_back();
  EXPECT_THAT(RawForward(r), StatusIs(Code::kInvalidArgument,
                                      HasSubstr("hidden: expected 4×3 bf16 = 24 bytes, got 23")));
  r = valid;
  r.mutable_weight()->set_shape(1, 4);
  EXPECT_THAT(RawForward(r), StatusIs(Code::kInvalidArgument, HasSubstr("weight:")));
  r = valid;
  r.mutable_options()->set_label_smoothing(-1.0f);
  EXPECT_THAT(RawForward(r),
              StatusIs(Code::kInvalidArgument, HasSubstr("options.label_smoothing")));
  r = valid;
  r.mutable_hidden()->set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_THAT(RawForward(r), StatusIs(Code::kInvalidArgument, HasSubstr("hidden: unknown dtype")));
  ExpectStillServing();
}

TEST_F(ServerTest, OutOfRangeTargetNamesRowAndValue) {
  OwnedProblem p = Problem(4, 3, 6);
  p.target.mutable_data<int64_t>()[2] = 6;
  p.target.mutable_data<int64_t>()[3] = 60;
  auto fwd = client_->Forward(Args(p));
  EXPECT_THAT(fwd, StatusIs(Code::kOutOfRange, HasSubstr("target[2] = 6 is outside [0, 6)")));
  ExpectStillServing();
}

TEST_F(ServerTest, UnknownSessionIsNotFound) {
  BackwardArgs b;
  b.session_id = "0123456789abcdef0123456789abcdef";
  EXPECT_THAT(client_->Backward(b), StatusIs(Code::kNotFound, HasSubstr("unknown session")));
}

TEST_F(ServerTest, SecondBackwardIsFailedPreconditionUnlessKept) {
  OwnedProblem p = Problem(6, 5, 11);
  auto fwd = client_->Forward(Args(p));
  ASSERT_TRUE(fwd.ok());
  BackwardArgs b;
  b.session_id = fwd->session_id;
  b.keep_session = true;
  auto first = client_->Backward(b);
  ASSERT_TRUE(first.ok()) << first.status();
  b.keep_session = false;
  auto second = client_->Backward(b);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(first->grad_weight->data, second->grad_weight->data);
  EXPECT_THAT(client_->Backward(b),
              StatusIs(Code::kFailedPrecondition, HasSubstr("already consumed")));
  ExpectStillServing();
}

TEST_F(ServerTest, ReleaseSessionIsIdempotent) {
  OwnedProblem p = Problem(6, 5, 11);
  auto fwd = client_->Forward(Args(p));
  ASSERT_TRUE(fwd.ok());
  EXPECT_EQ(*client_->ReleaseSession(fwd->session_id), true);
  EXPECT_EQ(*client_->ReleaseSession(fwd->session_id), false);
  EXPECT_EQ(*client_->ReleaseSession("never-issued"), false);
  BackwardArgs b;
  b.session_id = fwd->session_id;
  EXPECT_THAT(client_->Backward(b), StatusIs(Code::kFailedPrecondition, HasSubstr("released")));
  EXPECT_EQ(client_->GetServerInfo()->live_sessions(), 0);
}

TEST_F(ServerTest, GradOutputOfTheWrongShapeIsInvalidArgument) {
  OwnedProblem p = Problem(6, 5, 11, DType::kFloat32, Reduction::kNone);
  auto fwd = client_->Forward(Args(p));
  ASSERT_TRUE(fwd.ok());
  HostTensor g(DType::kFloat32, {5});
  BackwardArgs b;
  b.session_id = fwd->session_id;
  b.grad_output = g.view();
  EXPECT_THAT(client_->Backward(b),
              StatusIs(Code::kInvalidArgument, HasSubstr("grad_output: expected shape [N] = 6")));
  // The session survives a rejected Backward.
  b.grad_output.reset();
  EXPECT_TRUE(client_->Backward(b).ok());
}

TEST_F(ServerTest, SessionLimitIsResourceExhaustedAndNothingIsEvicted) {
  server_.reset();
  ServerOptions o = TestOptions();
  o.sessions.max_sessions = 1;
  StartServer(o);
  OwnedProblem p = Problem(4, 3, 7);
  auto first = client_->Forward(Args(p));
  ASSERT_TRUE(first.ok());
  EXPECT_THAT(client_->Forward(Args(p)),
              StatusIs(Code::kResourceExhausted, HasSubstr("1 live of at most 1")));
  BackwardArgs b;
  b.session_id = first->session_id;
  EXPECT_TRUE(client_->Backward(b).ok());
  EXPECT_TRUE(client_->Forward(Args(p)).ok());
}

TEST_F(ServerTest, MemoryBudgetIsResourceExhaustedWithTheNumbers) {
  server_.reset();
  ServerOptions o = TestOptions();
  o.sessions.memory_budget_bytes = 1000;
  StartServer(o);
  OwnedProblem p = Problem(40, 30, 70);
  EXPECT_THAT(client_->Forward(Args(p)),
              StatusIs(Code::kResourceExhausted, HasSubstr("budget of 1000 bytes")));
  ExpectStillServing();  // evaluation needs no session memory
}

TEST_F(ServerTest, OversizedMessageIsResourceExhausted) {
  server_.reset();
  ServerOptions o = TestOptions();
  o.max_message_bytes = 64 << 10;
  StartServer(o);
  OwnedProblem p = Problem(100, 100, 200);  // ~120 KB of tensors
  EXPECT_THAT(client_->Forward(Args(p)), StatusIs(Code::kResourceExhausted, HasSubstr("")));
  ExpectStillServing();
}

TEST_F(ServerTest, ExpiredSessionIsNotFound) {
  server_.reset();
  ServerOptions o = TestOptions();
  o.sessions.ttl = absl::Milliseconds(100);
  StartServer(o);
  OwnedProblem p = Problem(4, 3, 7);
  auto fwd = client_->Forward(Args(p));
  ASSERT_TRUE(fwd.ok());
  absl::SleepFor(absl::Milliseconds(400));
  EXPECT_EQ(client_->GetServerInfo()->live_sessions(), 0);
  BackwardArgs b;
  b.session_id = fwd->session_id;
  EXPECT_THAT(client_->Backward(b), StatusIs(Code::kNotFound, HasSubstr("expired")));
}

TEST_F(ServerTimingTest, DeadlineExceededLeavesNoSessionBehind) {
  ClientOptions quick;
  quick.timeout = absl::Milliseconds(30);
  auto impatient = LossClient::Create(address_, quick);
  // About a second of CPU work: far past the deadline.
  OwnedProblem p = Problem(512, 256, 20000);
  EXPECT_THAT(impatient->Forward(Args(p)), StatusIs(Code::kDeadlineExceeded, HasSubstr("")));
  // The server notices between chunks, stops and keeps nothing.
  for (int i = 0; i < 100 && client_->GetServerInfo()->session_memory_bytes() > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(client_->GetServerInfo()->live_sessions(), 0);
  EXPECT_EQ(client_->GetServerInfo()->session_memory_bytes(), 0);
  ExpectStillServing();
}

TEST_F(ServerTimingTest, ClientCancellationStopsTheWorkAndLeavesNothing) {
  OwnedProblem big = Problem(1024, 256, 20000);  // seconds of work
  const v1::ForwardRequest request = BuildForwardRequest(Args(big));
  grpc::ClientContext context;
  absl::Status result;
  std::thread call([&] {
    v1::ForwardResponse response;
    result = FromGrpcStatus(stub_->Forward(&context, request, &response));
  });
  WaitUntilRunning(1);
  context.TryCancel();
  call.join();
  EXPECT_THAT(result, StatusIs(Code::kCancelled, HasSubstr("")));
  // The engine stops at the next chunk and the reservation is returned.
  for (int i = 0; i < 200; ++i) {
    auto info = client_->GetServerInfo();
    if (info.ok() && info->running_requests() == 0 && info->session_memory_bytes() == 0) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  auto info = client_->GetServerInfo();
  EXPECT_EQ(info->running_requests(), 0);
  EXPECT_EQ(info->live_sessions(), 0);
  EXPECT_EQ(info->session_memory_bytes(), 0);
  ExpectStillServing();
}

TEST_F(ServerTimingTest, FullWorkQueueIsResourceExhausted) {
  server_.reset();
  ServerOptions o = TestOptions();
  o.workers = 1;
  o.max_queued_requests = 0;
  StartServer(o);
  OwnedProblem big = Problem(512, 256, 20000);
  std::thread slow([&] { EXPECT_TRUE(client_->Forward(Args(big, false)).ok()); });
  WaitUntilRunning(1);
  OwnedProblem p = Problem(3, 4, 5);
  const absl::Status status = client_->Forward(Args(p, false)).status();
  EXPECT_THAT(status, StatusIs(Code::kResourceExhausted, HasSubstr("work queue")));
  slow.join();
}

TEST_F(ServerTest, ConcurrentClientsAllGetCorrectResults) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      auto client = LossClient::Create(address_);
      for (int i = 0; i < 4; ++i) {
        RandomProblemSpec spec;
        spec.rows = 9 + t;
        spec.hidden = 7 + i;
        spec.vocab = 97;
        spec.seed = static_cast<uint64_t>(100 * t + i);
        spec.options.reduction = i % 2 ? Reduction::kSum : Reduction::kMean;
        const OwnedProblem p = MakeRandomProblem(spec);
        ExpectMatchesReference(*client, p,
                               i % 3 ? BackwardMode::kStoreGrads : BackwardMode::kRecompute);
        if (::testing::Test::HasFailure()) ++failures;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(client_->GetServerInfo()->live_sessions(), 0);
}

TEST_F(ServerTimingTest, ShutdownLetsARequestInFlightFinish) {
  OwnedProblem big = Problem(256, 256, 20000);
  absl::Status result;
  std::thread request([&] { result = client_->Forward(Args(big, false)).status(); });
  WaitUntilRunning(1);
  server_->Shutdown(absl::Seconds(30));
  request.join();
  EXPECT_TRUE(result.ok()) << result;
  // New calls are refused once the server is down.
  OwnedProblem p = Problem(3, 4, 5);
  EXPECT_THAT(client_->Forward(Args(p, false)), StatusIs(Code::kUnavailable, HasSubstr("")));
}

TEST_F(ServerTimingTest, ShutdownPastItsGraceCancelsWorkInFlight) {
  OwnedProblem big = Problem(1024, 256, 20000);  // several seconds of work
  absl::Status result;
  std::thread request([&] { result = client_->Forward(Args(big)).status(); });
  WaitUntilRunning(1);
  const absl::Time start = absl::Now();
  server_->Shutdown(absl::Milliseconds(50));
  request.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_THAT(result, StatusIs(AnyOf(Code::kCancelled, Code::kUnavailable), HasSubstr("")));
}

TEST_F(ServerTest, InfoAndHealth) {
  auto info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->backend(), Backend());
  EXPECT_FALSE(info->version().empty());
  EXPECT_EQ(info->limits().max_sessions(), 1024);
  // One device, or one per engine of a --cuda_devices server.
  EXPECT_EQ(info->devices_size(), std::max<size_t>(1, TestOptions().engine.cuda_devices.size()));
  auto health = client_->CheckHealth("flce.v1.LossService");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
}

// --- registered weights --------------------------------------------------

// A client whose PutWeight streams small chunks, so a weight spans several.
std::unique_ptr<LossClient> SmallChunkClient(const std::string& address) {
  ClientOptions options;
  options.stream_chunk_bytes = 1000;
  return LossClient::Create(address, options);
}

TEST_F(ServerTest, ForwardByWeightRefMatchesForwardWithTheTensor) {
  RandomProblemSpec spec;
  spec.rows = 19;
  spec.hidden = 13;
  spec.vocab = 211;  // 211×13×4 bytes: 11 chunks of 1000
  spec.bias = true;
  spec.options.reduction = Reduction::kSum;
  const OwnedProblem p = MakeRandomProblem(spec);
  auto client = SmallChunkClient(address_);
  auto info = client->PutWeight("lm_head", p.weight.view(), p.bias->view());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->version(), 1);
  EXPECT_EQ(info->bytes(), (211 * 13 + 211) * 4);
  ForwardArgs inline_args = Args(p, /*need_backward=*/true, BackwardMode::kRecompute);
  ForwardArgs ref_args = inline_args;
  ref_args.weight_name = "lm_head";
  auto a = client->Forward(inline_args);
  auto b = client->Forward(ref_args);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_EQ(a->loss.data, b->loss.data);
  BackwardArgs ba, bb;
  ba.session_id = a->session_id;
  bb.session_id = b->session_id;
  auto ga = client->Backward(ba);
  auto gb = client->Backward(bb);
  ASSERT_TRUE(ga.ok() && gb.ok());
  EXPECT_EQ(ga->grad_weight->data, gb->grad_weight->data);
  EXPECT_EQ(ga->grad_bias->data, gb->grad_bias->data);
  auto listed = client->ListWeights();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].name(), "lm_head");
  EXPECT_EQ(client->GetServerInfo()->weight_memory_bytes(), info->bytes());
}

TEST_F(ServerTest, ANewVersionNeverDisturbsSessionsOfTheOldOne) {
  RandomProblemSpec spec;
  spec.rows = 7;
  spec.hidden = 5;
  spec.vocab = 31;
  const OwnedProblem p1 = MakeRandomProblem(spec);
  spec.seed = 2;
  const OwnedProblem p2 = MakeRandomProblem(spec);
  for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
    ASSERT_TRUE(client_->PutWeight("w", p1.weight.view(), std::nullopt).ok());
    ForwardArgs args = Args(p1, true, mode);
    args.weight_name = "w";
    auto fwd = client_->Forward(args);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    auto v2 = client_->PutWeight("w", p2.weight.view(), std::nullopt);  // optimizer step
    ASSERT_TRUE(v2.ok());
    // The session still computes with the version it was made from.
    BackwardArgs b;
    b.session_id = fwd->session_id;
    auto grads = client_->Backward(b);
    ASSERT_TRUE(grads.ok()) << grads.status();
    ForwardArgs reference = Args(p1, true, mode);
    auto fwd_inline = client_->Forward(reference);
    BackwardArgs bi;
    bi.session_id = fwd_inline->session_id;
    EXPECT_EQ(client_->Backward(bi)->grad_weight->data, grads->grad_weight->data);
    // The old version can no longer be named.
    args.weight_version = v2->version() - 1;
    EXPECT_THAT(client_->Forward(args), StatusIs(Code::kNotFound, HasSubstr("is not registered")));
  }
}

// K micro-batches accumulated on the server (on the GPU with
// --backend=cuda) equal one concatenated batch, for both backward modes,
// with an upstream gradient, and again after a take reset the sum.
TEST_F(ServerTest, AccumulatingMicroBatchesEqualsOneConcatenatedBatch) {
  RandomProblemSpec spec;
  spec.rows = 24;
  spec.hidden = 9;
  spec.vocab = 97;
  spec.bias = true;
  spec.ignore_fraction = 0.1;
  spec.options.reduction = Reduction::kSum;
  const OwnedProblem whole = MakeRandomProblem(spec);
  HostTensor half(DType::kFloat32, {});
  half.mutable_data<float>()[0] = 0.5f;
  for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
    SCOPED_TRACE(BackwardModeName(mode));
    const std::string name = std::string("head_") + BackwardModeName(mode);
    ASSERT_TRUE(client_->PutWeight(name, whole.weight.view(), whole.bias->view()).ok());
    for (int round = 0; round < 2; ++round) {
      // Three micro-batches of 8 rows each, as views into the whole batch.
      for (int k = 0; k < 3; ++k) {
        ForwardArgs args = Args(whole);
        args.weight_name = name;
        args.mode = mode;
        args.problem.hidden.shape = {8, 9};
        args.problem.hidden.data = whole.hidden.data_as<char>() + k * 8 * 9 * 4;
        args.problem.target.shape = {8};
        args.problem.target.data = whole.target.data_as<char>() + k * 8 * 8;
        auto fwd = client_->Forward(args);
        ASSERT_TRUE(fwd.ok()) << fwd.status();
        BackwardArgs b;
        b.session_id = fwd->session_id;
        b.accumulate_weight_grad = true;
        b.grad_output = half.view();
        auto grads = client_->Backward(b);
        ASSERT_TRUE(grads.ok()) << grads.status();
        EXPECT_FALSE(grads->grad_weight.has_value());
        EXPECT_EQ(grads->grad_hidden.shape, std::vector<int64_t>({8, 9}));
      }
      auto acc = SmallChunkClient(address_)->TakeWeightGrad(name);
      ASSERT_TRUE(acc.ok()) << acc.status();
      EXPECT_EQ(acc->accumulated_backwards, 3);
      // A server whose engine keeps weights in device memory (CUDA: on one
      // device, or in parts on several) keeps W and the sum on the GPUs;
      // the others cannot.
      grpc::ClientContext context;
      v1::GetStatsResponse stats;
      ASSERT_TRUE(stub_->GetStats(&context, v1::GetStatsRequest(), &stats).ok());
      const std::vector<WeightPart> parts = server_->engine().WeightParts(97);
      if (std::all_of(parts.begin(), parts.end(),
                      [](const WeightPart& part) { return part.memory != nullptr; })) {
        EXPECT_GT(stats.weight_device_memory_bytes(), 0);
      } else {
        EXPECT_EQ(stats.weight_device_memory_bytes(), 0);
      }
      ForwardArgs args = Args(whole);
      args.mode = mode;
      auto fwd = client_->Forward(args);
      BackwardArgs b;
      b.session_id = fwd->session_id;
      b.grad_dtype = DType::kFloat32;
      b.grad_output = half.view();
      auto one = client_->Backward(b);
      ASSERT_TRUE(one.ok());
      const std::vector<float> expected_w = TensorToFloats(one->grad_weight->view());
      EXPECT_LT(RelativeL2Error(TensorToFloats(acc->grad_weight.view()),
                                std::vector<double>(expected_w.begin(), expected_w.end())),
                1e-6);
      const std::vector<float> expected_b = TensorToFloats(one->grad_bias->view());
      EXPECT_LT(RelativeL2Error(TensorToFloats(acc->grad_bias->view()),
                                std::vector<double>(expected_b.begin(), expected_b.end())),
                1e-6);
      // Taking resets the accumulator.
      EXPECT_THAT(client_->TakeWeightGrad(name),
                  StatusIs(Code::kFailedPrecondition, HasSubstr("no gradient accumulated")));
    }
  }
}

// dX first (GRADIENTS_HIDDEN, the session kept), then the weight's part
// (GRADIENTS_WEIGHT, returned or accumulated) equal one Backward bit for
// bit, for both backward modes; the misuses are INVALID_ARGUMENT.
TEST_F(ServerTest, HiddenThenWeightGradientsEqualOneBackward) {
  RandomProblemSpec spec;
  spec.rows = 13;
  spec.hidden = 9;
  spec.vocab = 97;
  spec.bias = true;
  spec.ignore_fraction = 0.1;
  spec.options.reduction = Reduction::kSum;
  const OwnedProblem p = MakeRandomProblem(spec);
  HostTensor g(DType::kFloat32, {});
  g.mutable_data<float>()[0] = 0.25f;
  for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
    SCOPED_TRACE(BackwardModeName(mode));
    const std::string name = std::string("split_") + BackwardModeName(mode);
    ASSERT_TRUE(client_->PutWeight(name, p.weight.view(), p.bias->view()).ok());
    for (bool accumulate : {false, true}) {
      SCOPED_TRACE(accumulate ? "accumulated" : "returned");
      auto forward = [&] {
        ForwardArgs args = Args(p);
        args.weight_name = name;
        args.mode = mode;
        auto fwd = client_->Forward(args);
        EXPECT_TRUE(fwd.ok()) << fwd.status();
        return fwd.ok() ? fwd->session_id : std::string();
      };
      BackwardArgs whole;
      whole.session_id = forward();
      whole.grad_output = g.view();
      whole.accumulate_weight_grad = accumulate;
      auto one = client_->Backward(whole);
      ASSERT_TRUE(one.ok()) << one.status();
      std::optional<WeightGrad> one_sum;
      if (accumulate) {
        auto taken = client_->TakeWeightGrad(name);
        ASSERT_TRUE(taken.ok()) << taken.status();
        one_sum = *std::move(taken);
      }

      BackwardArgs hidden;
      hidden.session_id = forward();
      hidden.grad_output = g.view();
      hidden.gradients = v1::GRADIENTS_HIDDEN;
      hidden.keep_session = true;
      auto dx = client_->Backward(hidden);
      ASSERT_TRUE(dx.ok()) << dx.status();
      EXPECT_EQ(dx->grad_hidden.data, one->grad_hidden.data);
      EXPECT_FALSE(dx->grad_weight.has_value());
      EXPECT_FALSE(dx->grad_bias.has_value());
      BackwardArgs weight = hidden;
      weight.gradients = v1::GRADIENTS_WEIGHT;
      weight.keep_session = false;
      weight.accumulate_weight_grad = accumulate;
      auto dw = client_->Backward(weight);
      ASSERT_TRUE(dw.ok()) << dw.status();
      EXPECT_TRUE(dw->grad_hidden.data.empty());
      EXPECT_TRUE(dw->grad_hidden.shape.empty());
      if (accumulate) {
        EXPECT_FALSE(dw->grad_weight.has_value());
        auto taken = client_->TakeWeightGrad(name);
        ASSERT_TRUE(taken.ok()) << taken.status();
        EXPECT_EQ(taken->accumulated_backwards, 1);
        EXPECT_EQ(taken->grad_weight.data, one_sum->grad_weight.data);
        EXPECT_EQ(taken->grad_bias->data, one_sum->grad_bias->data);
      } else {
        ASSERT_TRUE(dw->grad_weight.has_value() && dw->grad_bias.has_value());
        EXPECT_EQ(dw->grad_weight->data, one->grad_weight->data);
        EXPECT_EQ(dw->grad_bias->data, one->grad_bias->data);
      }
      // The weight's part consumed the session.
      EXPECT_THAT(client_->Backward(weight),
                  StatusIs(Code::kFailedPrecondition, HasSubstr("already consumed")));
    }
  }

  // Misuses, each before any compute (the session stays usable).
  ForwardArgs args = Args(p);
  args.weight_name = "split_store_grads";
  auto fwd = client_->Forward(args);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  auto backward = [&](v1::GradientSet set, bool keep, bool accumulate) {
    BackwardArgs b;
    b.session_id = fwd->session_id;
    b.gradients = set;
    b.keep_session = keep;
    b.accumulate_weight_grad = accumulate;
    return client_->Backward(b).status();
  };
  EXPECT_THAT(backward(v1::GRADIENTS_HIDDEN, false, false),
              StatusIs(Code::kInvalidArgument, HasSubstr("set keep_session")));
  EXPECT_THAT(backward(v1::GRADIENTS_HIDDEN, true, true),
              StatusIs(Code::kInvalidArgument, HasSubstr("not with accumulate_weight_grad")));
  EXPECT_THAT(backward(static_cast<v1::GradientSet>(7), false, false),
              StatusIs(Code::kInvalidArgument, HasSubstr("gradients: unknown value 7")));
  EXPECT_TRUE(backward(v1::GRADIENTS_WEIGHT, false, false).ok());
  ExpectStillServing();
}

// Vocabulary shards over the wire: a shard's statistics and its Backward with
// the global lse; every misuse refused with its code before any compute; an
// engine without shards says UNIMPLEMENTED. (The math against the whole
// vocabulary: kernels' RunShardConformanceCase and tests/vocab_parallel_test.)
TEST_F(ServerTest, VocabularyShardsAndTheirRefusals) {
  OwnedProblem p = Problem(6, 8, 40);
  v1::ForwardRequest request = BuildForwardRequest(Args(p));
  // Rows [10, 40) of W: a shard of a 64-id vocabulary.
  v1::Tensor* w = request.mutable_weight();
  w->set_data(w->data().substr(10 * 8 * 4));
  w->set_shape(0, 30);
  request.mutable_vocab_shard()->set_first(10);
  request.mutable_vocab_shard()->set_full_vocab(64);
  grpc::ClientContext context;
  v1::ForwardResponse response;
  absl::Status status = FromGrpcStatus(stub_->Forward(&context, request, &response));
  if (!server_->engine().supports_vocab_shards()) {
    EXPECT_THAT(status, StatusIs(Code::kUnimplemented, HasSubstr("vocab_shard")));
    ExpectStillServing();
    return;
  }
  ASSERT_TRUE(status.ok()) << status;
  ASSERT_TRUE(response.has_shard_stats());
  EXPECT_FALSE(response.has_loss());
  EXPECT_EQ(response.shard_stats().max().shape(0), 6);
  EXPECT_EQ(response.shard_stats().argmax().dtype(), v1::DTYPE_INT64);
  for (int64_t i = 0; i < 6; ++i) {
    const int64_t id =
        reinterpret_cast<const int64_t*>(response.shard_stats().argmax().data().data())[i];
    EXPECT_TRUE(id >= 10 && id < 40) << id;
  }

  auto refused = [&](v1::ForwardRequest bad, Code code, const char* says) {
    EXPECT_THAT(RawForward(bad), StatusIs(code, HasSubstr(says))) << says;
  };
  v1::ForwardRequest outside = request;
  outside.mutable_vocab_shard()->set_first(40);
  refused(outside, Code::kInvalidArgument, "vocab_shard");
  v1::ForwardRequest lse = request;
  lse.mutable_outputs()->set_lse(true);
  refused(lse, Code::kInvalidArgument, "vocab_shard");
  v1::ForwardRequest shard_weights = request;  // class weights of the shard, not the whole
  HostTensor cw(DType::kFloat32, {30});
  for (int i = 0; i < 30; ++i) cw.mutable_data<float>()[i] = 1.0f;
  CopyToProto(cw.view(), shard_weights.mutable_options()->mutable_class_weight());
  refused(shard_weights, Code::kInvalidArgument, "[vocab_shard.full_vocab]");
  v1::ForwardRequest far_target = request;
  HostTensor t(DType::kInt64, {6});
  for (int i = 0; i < 6; ++i) t.mutable_data<int64_t>()[i] = i == 3 ? 64 : 50;
  CopyToProto(t.view(), far_target.mutable_target());
  refused(far_target, Code::kOutOfRange, "target");

  // The session's Backward needs the global lse, [N]; others refuse it.
  auto backward = [&](const std::string& session, const HostTensor* global_lse) {
    grpc::ClientContext c;
    v1::BackwardRequest r;
    r.set_session_id(session);
    r.set_keep_session(true);
    if (global_lse != nullptr) CopyToProto(global_lse->view(), r.mutable_global_lse());
    v1::BackwardResponse out;
    return FromGrpcStatus(stub_->Backward(&c, r, &out));
  };
  HostTensor global(DType::kFloat32, {6}), wrong(DType::kFloat32, {5});
  for (int i = 0; i < 6; ++i) global.mutable_data<float>()[i] = 5.0f;
  EXPECT_THAT(backward(response.session_id(), nullptr),
              StatusIs(Code::kInvalidArgument, HasSubstr("global_lse: required")));
  EXPECT_THAT(backward(response.session_id(), &wrong),
              StatusIs(Code::kInvalidArgument, HasSubstr("global_lse: expected fp32 [N] = 6")));
  EXPECT_TRUE(backward(response.session_id(), &global).ok());
  auto plain = client_->Forward(Args(p));
  ASSERT_TRUE(plain.ok());
  EXPECT_THAT(backward(plain->session_id, &global),
              StatusIs(Code::kInvalidArgument, HasSubstr("only a vocabulary shard's session")));
  ExpectStillServing();
}

TEST_F(ServerTest, WeightErrorsHaveTheirCodes) {
  OwnedProblem p = Problem(4, 3, 6);
  // Accumulating needs a registered weight.
  auto fwd = client_->Forward(Args(p));
  BackwardArgs b;
  b.session_id = fwd->session_id;
  b.accumulate_weight_grad = true;
  EXPECT_THAT(client_->Backward(b),
              StatusIs(Code::kFailedPrecondition, HasSubstr("not a weight_ref")));
  // Unknown names.
  ForwardArgs args = Args(p);
  args.weight_name = "nope";
  EXPECT_THAT(client_->Forward(args), StatusIs(Code::kNotFound, HasSubstr("no weight named")));
  EXPECT_THAT(client_->TakeWeightGrad("nope"), StatusIs(Code::kNotFound, HasSubstr("nope")));
  EXPECT_EQ(*client_->DeleteWeight("nope"), false);
  EXPECT_THAT(client_->PutWeight("has space", p.weight.view(), std::nullopt),
              StatusIs(Code::kInvalidArgument, HasSubstr("header.name")));

  // Broken streams, sent by hand.
  auto put = [&](std::vector<v1::PutWeightChunk> chunks) {
    grpc::ClientContext context;
    v1::PutWeightResponse response;
    auto writer = stub_->PutWeight(&context, &response);
    for (const auto& c : chunks) writer->Write(c);
    writer->WritesDone();
    return FromGrpcStatus(writer->Finish());
  };
  v1::PutWeightChunk first;
  first.mutable_header()->set_name("w");
  first.mutable_header()->set_dtype(v1::DTYPE_FLOAT32);
  first.mutable_header()->add_shape(6);
  first.mutable_header()->add_shape(3);
  const std::string bytes(p.weight.data);
  first.mutable_header()->set_crc32c(Crc32c(0, bytes.data(), bytes.size()));
  first.set_data(bytes.substr(0, 40));
  v1::PutWeightChunk rest;
  rest.set_data(bytes.substr(40));
  EXPECT_TRUE(put({first, rest}).ok());
  v1::PutWeightChunk corrupt = rest;
  (*corrupt.mutable_data())[3] ^= 1;
  EXPECT_THAT(put({first, corrupt}), StatusIs(Code::kInvalidArgument, HasSubstr("header.crc32c")));
  // zlib's CRC-32 instead (header.crc32): checked in its place.
  v1::PutWeightChunk ieee = first;
  ieee.mutable_header()->set_crc32c(0);
  ieee.mutable_header()->set_crc32(static_cast<uint32_t>(
      crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size()))));
  EXPECT_TRUE(put({ieee, rest}).ok());
  EXPECT_THAT(put({ieee, corrupt}),
              StatusIs(Code::kInvalidArgument, HasSubstr("header.crc32: the bytes received have "
                                                         "CRC-32")));
  EXPECT_THAT(put({first}),
              StatusIs(Code::kInvalidArgument, HasSubstr("received 40 of the header's 72 bytes")));
  EXPECT_THAT(put({first, rest, rest}),
              StatusIs(Code::kInvalidArgument, HasSubstr("more bytes than the header's 72")));
  EXPECT_THAT(put({rest}), StatusIs(Code::kInvalidArgument, HasSubstr("header: required")));
  EXPECT_THAT(put({}), StatusIs(Code::kInvalidArgument, HasSubstr("no chunk")));
  v1::PutWeightChunk bad_shape = first;
  bad_shape.mutable_header()->set_shape(0, 0);
  EXPECT_THAT(put({bad_shape}), StatusIs(Code::kInvalidArgument, HasSubstr("header.shape")));
  v1::PutWeightChunk bad_dtype = first;
  bad_dtype.mutable_header()->set_dtype(v1::DTYPE_INT64);
  EXPECT_THAT(put({bad_dtype}), StatusIs(Code::kInvalidArgument, HasSubstr("header.dtype")));
  // The registry holds only the good uploads (crc32c's, then crc32's).
  auto listed = client_->ListWeights();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].version(), 2);
  ExpectStillServing();
}

TEST_F(ServerTest, WeightMemoryBudgetIsResourceExhausted) {
  server_.reset();
  ServerOptions o = TestOptions();
  o.weight_memory_bytes = 100;
  StartServer(o);
  OwnedProblem p = Problem(4, 3, 60);  // 720 bytes
  EXPECT_THAT(client_->PutWeight("big", p.weight.view(), std::nullopt),
              StatusIs(Code::kResourceExhausted, HasSubstr("budget of 100 bytes")));
}

// --- streaming RPCs ------------------------------------------------------

TEST_F(ServerTest, StreamedForwardAndBackwardEqualUnary) {
  ClientOptions streaming;
  streaming.stream_above_bytes = 0;  // always stream
  streaming.stream_chunk_bytes = 999;
  auto streamer = LossClient::Create(address_, streaming);
  RandomProblemSpec spec;
  spec.rows = 33;
  spec.hidden = 21;
  spec.vocab = 157;
  spec.dtype = DType::kBFloat16;
  spec.bias = true;
  spec.class_weight = true;
  spec.options.reduction = Reduction::kNone;
  const OwnedProblem p = MakeRandomProblem(spec);
  ForwardArgs args = Args(p, true, BackwardMode::kRecompute);
  args.want_lse = true;
  auto a = client_->Forward(args);
  auto b = streamer->Forward(args);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->loss.data, b->loss.data);
  EXPECT_EQ(a->lse->data, b->lse->data);
  BackwardArgs ba, bb;
  ba.session_id = a->session_id;
  bb.session_id = b->session_id;
  auto ga = client_->Backward(ba);
  auto gb = streamer->Backward(bb);
  ASSERT_TRUE(ga.ok()) << ga.status();
  ASSERT_TRUE(gb.ok()) << gb.status();
  EXPECT_EQ(ga->grad_hidden.data, gb->grad_hidden.data);
  EXPECT_EQ(ga->grad_weight->data, gb->grad_weight->data);
  EXPECT_EQ(ga->grad_bias->data, gb->grad_bias->data);
  EXPECT_EQ(gb->grad_hidden.dtype, DType::kBFloat16);
  // The streamed Backward consumed its session like the unary one.
  EXPECT_THAT(streamer->Backward(bb), StatusIs(Code::kFailedPrecondition, HasSubstr("consumed")));
}

TEST_F(ServerTest, BrokenForwardStreamsHaveTheirCodes) {
  OwnedProblem p = Problem(4, 3, 6);
  v1::ForwardRequest header = BuildForwardRequest(Args(p), /*with_data=*/false);
  auto stream = [&](std::vector<v1::ForwardRequestChunk> messages) {
    grpc::ClientContext context;
    v1::ForwardResponse response;
    auto writer = stub_->ForwardStream(&context, &response);
    for (const auto& m : messages) writer->Write(m);
    writer->WritesDone();
    return FromGrpcStatus(writer->Finish());
  };
  v1::ForwardRequestChunk first;
  *first.mutable_request() = header;
  auto chunk = [](v1::TensorField field, const std::string& data) {
    v1::ForwardRequestChunk m;
    m.mutable_chunk()->set_field(field);
    m.mutable_chunk()->set_data(data);
    return m;
  };
  const auto hidden = chunk(v1::TENSOR_FIELD_HIDDEN, p.hidden.data);
  const auto weight = chunk(v1::TENSOR_FIELD_WEIGHT, p.weight.data);
  const auto target = chunk(v1::TENSOR_FIELD_TARGET, p.target.data);
  EXPECT_TRUE(stream({first, hidden, weight, target}).ok());
  EXPECT_THAT(stream({first, hidden, weight}),
              StatusIs(Code::kInvalidArgument, HasSubstr("target: received 0 of 32 bytes")));
  EXPECT_THAT(stream({first, hidden, hidden, weight, target}),
              StatusIs(Code::kInvalidArgument, HasSubstr("hidden: more bytes than its 48")));
  EXPECT_THAT(stream({first, chunk(v1::TENSOR_FIELD_BIAS, "xxxx")}),
              StatusIs(Code::kInvalidArgument, HasSubstr("is not a tensor the request announced")));
  EXPECT_THAT(stream({hidden}), StatusIs(Code::kInvalidArgument, HasSubstr("request: required")));
  EXPECT_THAT(stream({}), StatusIs(Code::kInvalidArgument, HasSubstr("no message")));
  // The assembled request goes through the same validation as Forward.
  OwnedProblem bad = Problem(4, 3, 6);
  bad.target.mutable_data<int64_t>()[1] = 99;
  EXPECT_THAT(stream({first, hidden, weight, chunk(v1::TENSOR_FIELD_TARGET, bad.target.data)}),
              StatusIs(Code::kOutOfRange, HasSubstr("target[1] = 99")));
  ExpectStillServing();
}

// --- shared memory -------------------------------------------------------

TEST_F(ServerTest, SharedMemoryIsOffByDefault) {
  ShmObject shm(4096);
  grpc::ClientContext context;
  v1::RegisterSharedMemoryRequest request;
  request.set_shm_name(shm.name());
  request.set_bytes(4096);
  v1::RegisterSharedMemoryResponse response;
  EXPECT_THAT(FromGrpcStatus(stub_->RegisterSharedMemory(&context, request, &response)),
              StatusIs(Code::kFailedPrecondition, HasSubstr("--enable_shared_memory")));
  OwnedProblem p = Problem(4, 3, 6);
  v1::ForwardRequest r = BuildForwardRequest(Args(p));
  // Slices may still name regions of server memory, which need no flag:
  // one that names none is NOT_FOUND.
  r.mutable_hidden()->mutable_shm()->set_region_id("x");
  EXPECT_THAT(RawForward(r),
              StatusIs(Code::kNotFound, HasSubstr("hidden.shm: unknown region 'x'")));
  r = BuildForwardRequest(Args(p));
  r.set_ready_event("x");
  EXPECT_THAT(RawForward(r), StatusIs(Code::kNotFound, HasSubstr("ready_event: unknown region")));
}

// GET `path` from 127.0.0.1:`port` over plain HTTP/1.1; the whole reply.
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return "";
  }
  const std::string request =
      "GET " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
  (void)!write(fd, request.data(), request.size());
  std::string reply;
  char buffer[4096];
  for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) reply.append(buffer, n);
  close(fd);
  return reply;
}

TEST_F(ServerTest, MetricsEndpointAndGetStatsCountRequests) {
  server_.reset();
  ServerOptions o = TestOptions();
  o.metrics_address = "127.0.0.1:0";
  StartServer(o);
  ASSERT_GT(server_->metrics_port(), 0);
  const OwnedProblem p = Problem(9, 7, 31);
  auto fwd = client_->Forward(Args(p, true, BackwardMode::kStoreGrads));
  ASSERT_TRUE(fwd.ok());
  BackwardArgs back;
  back.session_id = fwd->session_id;
  ASSERT_TRUE(client_->Backward(back).ok());
  ASSERT_FALSE(client_->Backward(back).ok());  // consumed: FAILED_PRECONDITION

  // An RPC is counted when gRPC is done with it, a moment after its client
  // has the answer: the first Backward's count may land after the second's.
  const std::string ok = "flce_requests_total{rpc=\"Backward\",code=\"OK\"} 1\n";
  const std::string last = "flce_requests_total{rpc=\"Backward\",code=\"FAILED_PRECONDITION\"} 1\n";
  std::string reply;
  for (int i = 0;
       i < 500 && (reply.find(last) == std::string::npos || reply.find(ok) == std::string::npos);
       ++i) {
    if (i > 0) absl::SleepFor(absl::Milliseconds(10));
    reply = HttpGet(server_->metrics_port(), "/metrics");
  }
  EXPECT_THAT(reply, HasSubstr("200 OK"));
  EXPECT_THAT(reply, HasSubstr("Content-Type: text/plain; version=0.0.4"));
  EXPECT_THAT(reply, HasSubstr("flce_requests_total{rpc=\"Forward\",code=\"OK\"} 1\n"));
  EXPECT_THAT(reply, HasSubstr("flce_requests_total{rpc=\"Backward\",code=\"OK\"} 1\n"));
  EXPECT_THAT(reply,
              HasSubstr("flce_requests_total{rpc=\"Backward\",code=\"FAILED_PRECONDITION\"} 1\n"));
  EXPECT_THAT(reply, HasSubstr("flce_engine_duration_seconds_count{rpc=\"Forward\"} 1\n"));
  EXPECT_THAT(reply, HasSubstr("flce_live_sessions 0\n"));
  EXPECT_THAT(reply, HasSubstr("flce_serving 1\n"));
  EXPECT_THAT(HttpGet(server_->metrics_port(), "/other"), HasSubstr("404"));

  grpc::ClientContext context;
  v1::GetStatsResponse stats;
  ASSERT_TRUE(stub_->GetStats(&context, v1::GetStatsRequest(), &stats).ok());
  int64_t forwards = 0;
  for (const auto& r : stats.requests()) {
    if (r.rpc() == "Forward" && r.code() == "OK") forwards = r.count();
  }
  EXPECT_EQ(forwards, 1);
  EXPECT_EQ(stats.request_duration().at("Backward").count(), 2);
  EXPECT_GT(stats.received_bytes().at("Forward"), static_cast<int64_t>(p.hidden.data.size()));
  EXPECT_TRUE(stats.serving());
  EXPECT_EQ(stats.live_sessions(), 0);
}

// A NaN in X makes its row's logits NaN: the loss is NaN and the call
// succeeds. On a CUDA server with one-pass rows (--cuda_one_pass_rows) that
// row is out of their range (fp32, V a multiple of 4, STORE_GRADS): Forward
// runs again with two passes and GetStats and /metrics count it; the CPU
// engine has no such path.
TEST_F(ServerTest, NonFiniteLogitsAreServedAndCountedAsForwardReruns) {
  server_.reset();
  ServerOptions o = TestOptions();
  o.metrics_address = "127.0.0.1:0";
  o.engine.cuda.one_pass_rows = true;
  StartServer(o);
  OwnedProblem p = Problem(9, 7, 32);
  p.hidden.mutable_data<float>()[7 * 3] = std::nanf("");  // row 3
  p.target.mutable_data<int64_t>()[3] = 5;                // not ignored
  auto fwd = client_->Forward(Args(p, true, BackwardMode::kStoreGrads));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_TRUE(std::isnan(fwd->loss.data_as<float>()[0]));
  BackwardArgs back;
  back.session_id = fwd->session_id;
  ASSERT_TRUE(client_->Backward(back).ok());
  // Only the CUDA engine's unsharded STORE_GRADS has one-pass rows to rerun
  // (a shard's Forward makes statistics in one pass that never reruns).
  const EngineOptions engine = TestOptions().engine;
  const bool sharded = engine.vocab_shards > 1 ||
                       (engine.cuda_devices.size() > 1 && engine.cuda_devices_mode == "shard");
  const int64_t reruns = Backend() == "cuda" && !sharded;
  grpc::ClientContext context;
  v1::GetStatsResponse stats;
  ASSERT_TRUE(stub_->GetStats(&context, v1::GetStatsRequest(), &stats).ok());
  EXPECT_EQ(stats.engine_forward_reruns(), reruns);
  EXPECT_THAT(HttpGet(server_->metrics_port(), "/metrics"),
              HasSubstr(absl::StrCat("flce_engine_forward_reruns_total ", reruns, "\n")));
  EXPECT_TRUE(stats.serving());
}

TEST_F(ServerTest, DrainRefusesNewWorkButServesExistingSessions) {
  const OwnedProblem p = Problem(5, 4, 9);
  auto fwd = client_->Forward(Args(p, true, BackwardMode::kStoreGrads));
  ASSERT_TRUE(fwd.ok());
  std::atomic<int64_t> left{-1};
  std::thread drain([&] { left = server_->Drain(absl::Seconds(20)); });
  for (int i = 0;
       i < 200 && *client_->CheckHealth() == grpc::health::v1::HealthCheckResponse::SERVING; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(*client_->CheckHealth(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_THAT(client_->Forward(Args(p, true)).status(),
              StatusIs(Code::kUnavailable, HasSubstr("draining")));
  EXPECT_THAT(client_->PutWeight("w", p.weight.view(), std::nullopt).status(),
              StatusIs(Code::kUnavailable, HasSubstr("draining")));
  BackwardArgs back;
  back.session_id = fwd->session_id;
  EXPECT_TRUE(client_->Backward(back).ok());  // the session here is still served
  drain.join();                               // returns once no session is left
  EXPECT_EQ(left.load(), 0);
  server_->Shutdown(absl::Seconds(1));
}

TEST_F(ServerTest, CudaIpcRegistrationErrorsHaveTheirCodes) {
  server_.reset();
  ServerOptions o = TestOptions();
  o.enable_shared_memory = true;
  StartServer(o);
  auto register_handle = [&](const std::string& handle, int64_t bytes) {
    grpc::ClientContext context;
    v1::RegisterSharedMemoryRequest request;
    request.set_cuda_ipc_handle(handle);
    request.set_bytes(bytes);
    v1::RegisterSharedMemoryResponse response;
    return FromGrpcStatus(stub_->RegisterSharedMemory(&context, request, &response));
  };
  EXPECT_THAT(register_handle(std::string(10, 'x'), 0),
              StatusIs(Code::kInvalidArgument, HasSubstr("cuda_ipc_handle: expected 64 bytes")));
  EXPECT_THAT(register_handle(std::string(64, '\0'), -1),
              StatusIs(Code::kInvalidArgument, HasSubstr("bytes: -1")));
  auto register_event = [&](const std::string& handle, int64_t bytes) {
    grpc::ClientContext context;
    v1::RegisterSharedMemoryRequest request;
    request.set_cuda_ipc_event_handle(handle);
    request.set_bytes(bytes);
    v1::RegisterSharedMemoryResponse response;
    return FromGrpcStatus(stub_->RegisterSharedMemory(&context, request, &response));
  };
  EXPECT_THAT(register_event(std::string(10, 'x'), 0),
              StatusIs(Code::kInvalidArgument, HasSubstr("cuda_ipc_event_handle: expected 64")));
  EXPECT_THAT(register_event(std::string(64, '\0'), 8),
              StatusIs(Code::kInvalidArgument, HasSubstr("an event region has none")));
  // A handle no process exported: an engine without device memory (the
  // CPU backend, several devices) cannot map GPU memory at all; the CUDA
  // engine on one device fails to open it and keeps serving.
  if (server_->engine().device_memory() == nullptr) {
    EXPECT_THAT(register_handle(std::string(64, '\0'), 0),
                StatusIs(Code::kFailedPrecondition, HasSubstr("--backend=cuda")));
    EXPECT_THAT(register_event(std::string(64, '\0'), 0),
                StatusIs(Code::kFailedPrecondition, HasSubstr("--backend=cuda")));
  } else {
    EXPECT_THAT(register_handle(std::string(64, '\0'), 0),
                StatusIs(Code::kInvalidArgument, HasSubstr("cuda_ipc_handle: cannot open")));
    EXPECT_THAT(register_event(std::string(64, '\0'), 0),
                StatusIs(Code::kInvalidArgument, HasSubstr("cuda_ipc_event_handle: cannot open")));
  }
  ExpectStillServing();
  EXPECT_EQ(server_->Metrics().gauges.shared_memory_regions, 0);
  ExpectStillServing();
}

TEST_F(ServerTest, TensorsAndGradientsThroughSharedMemoryEqualTheWire) {
  server_.reset();
  ServerOptions o = TestOptions();
  o.enable_shared_memory = true;
  StartServer(o);
  RandomProblemSpec spec;
  spec.rows = 21;
  spec.hidden = 10;
  spec.vocab = 53;
  spec.dtype = DType::kBFloat16;
  spec.bias = true;
  const OwnedProblem p = MakeRandomProblem(spec);
  // Inputs at the start of the region, gradients after them.
  const size_t x = p.hidden.data.size(), w = p.weight.data.size(), t = p.target.data.size();
  const size_t b = p.bias->data.size();
  ShmObject shm(2 * (x + w + b) + t + 64);
  std::memcpy(shm.base(), p.hidden.data.data(), x);
  std::memcpy(shm.base() + x, p.weight.data.data(), w);
  std::memcpy(shm.base() + x + w, p.target.data.data(), t);
  grpc::ClientContext register_context;
  v1::RegisterSharedMemoryRequest reg;
  reg.set_shm_name(shm.name());
  reg.set_bytes(static_cast<int64_t>(2 * (x + w + b) + t + 64));
  v1::RegisterSharedMemoryResponse region;
  ASSERT_TRUE(stub_->RegisterSharedMemory(&register_context, reg, &region).ok());

  v1::ForwardRequest r = BuildForwardRequest(Args(p, true, BackwardMode::kStoreGrads));
  auto place = [&](v1::Tensor* tensor, size_t offset) {
    tensor->clear_data();
    tensor->mutable_shm()->set_region_id(region.region_id());
    tensor->mutable_shm()->set_offset(static_cast<int64_t>(offset));
  };
  place(r.mutable_hidden(), 0);
  place(r.mutable_weight(), x);
  place(r.mutable_target(), x + w);  // the bias stays on the wire
  grpc::ClientContext forward_context;
  v1::ForwardResponse shm_forward;
  ASSERT_TRUE(stub_->Forward(&forward_context, r, &shm_forward).ok());
  auto wire_forward = client_->Forward(Args(p, true, BackwardMode::kStoreGrads));
  ASSERT_TRUE(wire_forward.ok());
  EXPECT_EQ(shm_forward.loss().data(), wire_forward->loss.data);

  const size_t out = x + w + t;
  v1::BackwardRequest back;
  back.set_session_id(shm_forward.session_id());
  back.mutable_grad_hidden_out()->set_region_id(region.region_id());
  back.mutable_grad_hidden_out()->set_offset(static_cast<int64_t>(out));
  back.mutable_grad_weight_out()->set_region_id(region.region_id());
  back.mutable_grad_weight_out()->set_offset(static_cast<int64_t>(out + x));
  back.mutable_grad_bias_out()->set_region_id(region.region_id());
  back.mutable_grad_bias_out()->set_offset(static_cast<int64_t>(out + x + w));
  // A destination that does not fit is refused before any compute; the
  // session survives.
  v1::BackwardRequest too_far = back;
  too_far.mutable_grad_weight_out()->set_offset(static_cast<int64_t>(2 * (x + w + b) + t));
  grpc::ClientContext far_context;
  v1::BackwardResponse ignored;
  EXPECT_THAT(FromGrpcStatus(stub_->Backward(&far_context, too_far, &ignored)),
              StatusIs(Code::kInvalidArgument, HasSubstr("grad_weight_out.shm")));
  // Host memory never accumulates, dX never does, and a memory region is no
  // ready_event: refused before any compute, the session kept.
  v1::BackwardRequest adding = back;
  adding.mutable_grad_weight_out()->set_accumulate(true);
  grpc::ClientContext adding_context;
  EXPECT_THAT(
      FromGrpcStatus(stub_->Backward(&adding_context, adding, &ignored)),
      StatusIs(Code::kInvalidArgument, HasSubstr("grad_weight_out.accumulate: only GPU memory")));
  adding = back;
  adding.mutable_grad_hidden_out()->set_accumulate(true);
  grpc::ClientContext hidden_context;
  EXPECT_THAT(FromGrpcStatus(stub_->Backward(&hidden_context, adding, &ignored)),
              StatusIs(Code::kInvalidArgument, HasSubstr("dX is never accumulated")));
  v1::BackwardRequest not_an_event = back;
  not_an_event.set_ready_event(region.region_id());
  grpc::ClientContext event_context;
  EXPECT_THAT(FromGrpcStatus(stub_->Backward(&event_context, not_an_event, &ignored)),
              StatusIs(Code::kInvalidArgument, HasSubstr("ready_event: region")));
  not_an_event.set_ready_event("nope");
  grpc::ClientContext unknown_context;
  EXPECT_THAT(FromGrpcStatus(stub_->Backward(&unknown_context, not_an_event, &ignored)),
              StatusIs(Code::kNotFound, HasSubstr("ready_event: unknown region")));
  grpc::ClientContext backward_context;
  v1::BackwardResponse shm_grads;
  ASSERT_TRUE(stub_->Backward(&backward_context, back, &shm_grads).ok());
  EXPECT_TRUE(shm_grads.grad_weight().has_shm());
  EXPECT_TRUE(shm_grads.grad_weight().data().empty());
  BackwardArgs wire_back;
  wire_back.session_id = wire_forward->session_id;
  auto wire_grads = client_->Backward(wire_back);
  ASSERT_TRUE(wire_grads.ok());
  EXPECT_EQ(std::string(shm.base() + out, x), wire_grads->grad_hidden.data);
  EXPECT_EQ(std::string(shm.base() + out + x, w), wire_grads->grad_weight->data);
  EXPECT_EQ(std::string(shm.base() + out + x + w, b), wire_grads->grad_bias->data);

  // Forward and Backward in one call: the gradients land in the region as
  // the Backward above put them, and the session stays for another Backward.
  std::memset(shm.base() + out, 0, x + w + b);
  v1::ForwardRequest both = r;
  *both.mutable_backward()->mutable_grad_hidden_out() = back.grad_hidden_out();
  *both.mutable_backward()->mutable_grad_weight_out() = back.grad_weight_out();
  *both.mutable_backward()->mutable_grad_bias_out() = back.grad_bias_out();
  grpc::ClientContext both_context;
  v1::ForwardResponse both_response;
  ASSERT_TRUE(stub_->Forward(&both_context, both, &both_response).ok());
  EXPECT_EQ(both_response.loss().data(), wire_forward->loss.data);
  EXPECT_TRUE(both_response.backward().grad_weight().has_shm());
  EXPECT_EQ(std::string(shm.base() + out, x), wire_grads->grad_hidden.data);
  EXPECT_EQ(std::string(shm.base() + out + x, w), wire_grads->grad_weight->data);
  EXPECT_EQ(std::string(shm.base() + out + x + w, b), wire_grads->grad_bias->data);
  HostTensor two(DType::kFloat32, {});
  two.mutable_data<float>()[0] = 2.0f;
  BackwardArgs again;
  again.session_id = both_response.session_id();
  again.grad_output = two.view();
  again.keep_session = true;
  EXPECT_TRUE(client_->Backward(again).ok());
  // dX alone in the same call (a remote caller's row pieces): dW and db
  // stay in the session for a Backward with GRADIENTS_WEIGHT.
  std::memset(shm.base() + out, 0, x + w + b);
  v1::ForwardRequest hidden_only = r;
  hidden_only.mutable_backward()->set_gradients(v1::GRADIENTS_HIDDEN);
  *hidden_only.mutable_backward()->mutable_grad_hidden_out() = back.grad_hidden_out();
  grpc::ClientContext hidden_only_context;
  v1::ForwardResponse hidden_only_response;
  ASSERT_TRUE(stub_->Forward(&hidden_only_context, hidden_only, &hidden_only_response).ok());
  EXPECT_EQ(std::string(shm.base() + out, x), wire_grads->grad_hidden.data);
  EXPECT_EQ(std::string(shm.base() + out + x, w + b), std::string(w + b, '\0'));  // not written
  EXPECT_FALSE(hidden_only_response.backward().has_grad_weight());
  v1::BackwardRequest weight_part;
  weight_part.set_session_id(hidden_only_response.session_id());
  weight_part.set_gradients(v1::GRADIENTS_WEIGHT);
  grpc::ClientContext weight_part_context;
  v1::BackwardResponse weight_grads;
  ASSERT_TRUE(stub_->Backward(&weight_part_context, weight_part, &weight_grads).ok());
  EXPECT_EQ(weight_grads.grad_weight().data(), wire_grads->grad_weight->data);
  EXPECT_EQ(weight_grads.grad_bias().data(), wire_grads->grad_bias->data);
  EXPECT_FALSE(weight_grads.has_grad_hidden());
  v1::ForwardRequest marked = hidden_only;  // marks are for regions of server memory
  marked.mutable_backward()->set_written_mark(7);
  EXPECT_THAT(RawForward(marked),
              StatusIs(Code::kInvalidArgument, HasSubstr("backward.written_mark: posted on")));
  v1::ForwardRequest hidden_and_weight = hidden_only;
  *hidden_and_weight.mutable_backward()->mutable_grad_weight_out() = back.grad_weight_out();
  EXPECT_THAT(RawForward(hidden_and_weight),
              StatusIs(Code::kInvalidArgument, HasSubstr("GRADIENTS_HIDDEN writes dX only")));
  v1::ForwardRequest weight_first = both;
  weight_first.mutable_backward()->set_gradients(v1::GRADIENTS_WEIGHT);
  EXPECT_THAT(RawForward(weight_first),
              StatusIs(Code::kInvalidArgument, HasSubstr("backward.gradients")));
  // The next Forward may release it (as ReleaseSession; unknown ids ignored).
  const int64_t live = server_->Metrics().gauges.live_sessions;
  v1::ForwardRequest releasing = r;
  releasing.set_need_backward(false);
  releasing.add_release_sessions(both_response.session_id());
  releasing.add_release_sessions("unknown");
  EXPECT_TRUE(RawForward(releasing).ok());
  EXPECT_EQ(server_->Metrics().gauges.live_sessions, live - 1);
  v1::ForwardRequest too_many = r;
  for (int i = 0; i < 65; ++i) too_many.add_release_sessions("x");
  EXPECT_THAT(RawForward(too_many),
              StatusIs(Code::kInvalidArgument, HasSubstr("release_sessions: 65 ids")));
  v1::ForwardRequest no_session = both;
  no_session.set_need_backward(false);
  EXPECT_THAT(RawForward(no_session),
              StatusIs(Code::kInvalidArgument, HasSubstr("backward: needs need_backward")));
  v1::ForwardRequest no_bias_out = both;
  no_bias_out.mutable_backward()->clear_grad_bias_out();
  EXPECT_THAT(RawForward(no_bias_out),
              StatusIs(Code::kInvalidArgument, HasSubstr("every gradient needs its destination")));
  v1::ForwardRequest too_far_both = both;
  too_far_both.mutable_backward()->mutable_grad_weight_out()->set_offset(
      static_cast<int64_t>(2 * (x + w + b) + t));
  const int64_t sessions_before = server_->Metrics().gauges.live_sessions;
  EXPECT_THAT(RawForward(too_far_both),
              StatusIs(Code::kInvalidArgument, HasSubstr("grad_weight_out.shm")));
  EXPECT_EQ(server_->Metrics().gauges.live_sessions, sessions_before);  // none kept

  // Out of bounds, unknown region.
  v1::ForwardRequest bad = r;
  bad.mutable_hidden()->mutable_shm()->set_offset(static_cast<int64_t>(2 * (x + w + b) + t));
  EXPECT_THAT(RawForward(bad), StatusIs(Code::kInvalidArgument, HasSubstr("hidden.shm")));
  bad.mutable_hidden()->mutable_shm()->set_region_id("nope");
  EXPECT_THAT(RawForward(bad), StatusIs(Code::kNotFound, HasSubstr("unknown region")));
  bad = r;
  bad.mutable_hidden()->mutable_shm()->set_accumulate(true);
  EXPECT_THAT(RawForward(bad),
              StatusIs(Code::kInvalidArgument, HasSubstr("hidden.shm.accumulate")));
  bad = r;
  bad.set_ready_event(region.region_id());
  EXPECT_THAT(RawForward(bad), StatusIs(Code::kInvalidArgument, HasSubstr("not an event")));
  grpc::ClientContext missing_context;
  v1::RegisterSharedMemoryRequest missing;
  missing.set_shm_name("/flce-does-not-exist");
  missing.set_bytes(10);
  EXPECT_THAT(FromGrpcStatus(stub_->RegisterSharedMemory(&missing_context, missing, &region)),
              StatusIs(Code::kNotFound, HasSubstr("cannot open")));
  ExpectStillServing();
}

// A remote worker's row piece: its Forward writes dX into a region of
// server memory and posts its written_mark; the bulk port's read of that dX,
// sent before the Forward, waits for the post. A Forward that fails posts
// ABORTED; a mark on a region not of server memory is refused by name.
TEST_F(ServerTest, AWrittenMarkLetsABulkReadWaitForTheForwardsDx) {
  const OwnedProblem p = Problem(9, 6, 13);
  grpc::ClientContext register_context;
  v1::RegisterSharedMemoryRequest reg;
  reg.set_server_memory(true);
  reg.set_bytes(1 << 16);
  v1::RegisterSharedMemoryResponse region;
  ASSERT_TRUE(stub_->RegisterSharedMemory(&register_context, reg, &region).ok());
  ASSERT_TRUE(region.bulk_marks());
  ASSERT_NE(region.bulk_port(), 0);
  const size_t x = p.hidden.data.size();
  // The read of `mark`'s dX, sent at once; its answer once it comes.
  auto read_after = [&](uint64_t mark) {
    return std::async(std::launch::async, [&, mark] {
      const int fd = ConnectLoopback(region.bulk_port(), 30);
      if (fd < 0) return std::string();
      const std::string request = absl::StrCat(
          "GET /v1/regions/", region.region_id(), "?offset=0&length=", x, "&after_mark=", mark,
          "&wait_ms=30000 HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer ",
          region.bulk_ticket(), "\r\n\r\n");
      send(fd, request.data(), request.size(), MSG_NOSIGNAL);
      std::string reply;
      char buffer[4096];
      for (ssize_t n; (n = recv(fd, buffer, sizeof(buffer), 0)) > 0;) reply.append(buffer, n);
      close(fd);
      return reply;
    });
  };
  v1::ForwardRequest r = BuildForwardRequest(Args(p, true, BackwardMode::kStoreGrads));
  r.mutable_backward()->set_gradients(v1::GRADIENTS_HIDDEN);
  r.mutable_backward()->mutable_grad_hidden_out()->set_region_id(region.region_id());
  r.mutable_backward()->set_written_mark(41);
  auto reply = read_after(41);
  grpc::ClientContext forward_context;
  v1::ForwardResponse response;
  ASSERT_TRUE(stub_->Forward(&forward_context, r, &response).ok());
  auto wire_forward = client_->Forward(Args(p, true, BackwardMode::kStoreGrads));
  ASSERT_TRUE(wire_forward.ok());
  BackwardArgs wire_back;
  wire_back.session_id = wire_forward->session_id;
  auto wire_grads = client_->Backward(wire_back);
  ASSERT_TRUE(wire_grads.ok());
  std::string got = reply.get();
  EXPECT_TRUE(absl::StartsWith(got, "HTTP/1.1 200")) << got;
  const size_t body = got.find("\r\n\r\n");
  ASSERT_NE(body, std::string::npos);
  EXPECT_EQ(got.substr(body + 4), wire_grads->grad_hidden.data);
  // A Forward refused (a target out of range): ABORTED for its read.
  OwnedProblem bad = Problem(9, 6, 13);
  bad.target.mutable_data<int64_t>()[4] = 13;
  v1::ForwardRequest failing = BuildForwardRequest(Args(bad, true, BackwardMode::kStoreGrads));
  *failing.mutable_backward() = r.backward();
  failing.mutable_backward()->set_written_mark(42);
  reply = read_after(42);
  EXPECT_THAT(RawForward(failing), StatusIs(Code::kOutOfRange, HasSubstr("target[4]")));
  got = reply.get();
  EXPECT_TRUE(absl::StartsWith(got, "HTTP/1.1 409")) << got;
  EXPECT_THAT(got, HasSubstr("mark 42 ended without writing it"));
  // The mark names dX's region, which must be server memory of the caller's.
  v1::ForwardRequest elsewhere = r;
  elsewhere.mutable_backward()->mutable_grad_hidden_out()->set_region_id("nope");
  EXPECT_THAT(RawForward(elsewhere),
              StatusIs(Code::kInvalidArgument, HasSubstr("backward.written_mark")));
  ExpectStillServing();
}

// X in a region of server memory: on a server over one CUDA device each
// Forward's X is copied onto the device as the call arrives, beside the
// calls before it (--stage_ahead_bytes), and computes bit for bit what X
// sent in the message does; calls sent at once queue behind each other.
TEST_F(ServerTest, XInARegionOfServerMemoryIsStagedAheadAndComputesTheSame) {
  const std::vector<int64_t> rows = {61, 67, 71, 73};
  std::vector<OwnedProblem> problems;
  for (int64_t n : rows) problems.push_back(Problem(n, 40, 301, DType::kBFloat16));
  grpc::ClientContext register_context;
  v1::RegisterSharedMemoryRequest reg;
  reg.set_server_memory(true);
  reg.set_bytes(1 << 20);
  v1::RegisterSharedMemoryResponse region;
  ASSERT_TRUE(stub_->RegisterSharedMemory(&register_context, reg, &region).ok());
  std::vector<v1::ForwardRequest> sliced;
  {
    grpc::ClientContext context;
    v1::WriteRegionResponse written;
    auto writer = stub_->WriteRegion(&context, &written);
    int64_t offset = 0;
    for (const OwnedProblem& p : problems) {
      v1::RegionPart part;
      part.set_region_id(region.region_id());
      part.set_offset(offset);
      part.set_data(p.hidden.data);
      ASSERT_TRUE(writer->Write(part));
      v1::ForwardRequest r = BuildForwardRequest(Args(p, true, BackwardMode::kStoreGrads));
      r.mutable_hidden()->mutable_shm()->set_region_id(region.region_id());
      r.mutable_hidden()->mutable_shm()->set_offset(offset);
      sliced.push_back(std::move(r));
      offset += static_cast<int64_t>(p.hidden.data.size() + 4095) / 4096 * 4096;
    }
    writer->WritesDone();
    ASSERT_TRUE(writer->Finish().ok());
  }
  std::vector<std::future<absl::StatusOr<v1::ForwardResponse>>> calls;
  for (const v1::ForwardRequest& r : sliced) {
    calls.push_back(std::async(std::launch::async, [&, r]() -> absl::StatusOr<v1::ForwardResponse> {
      grpc::ClientContext context;
      v1::ForwardResponse response;
      absl::Status status = FromGrpcStatus(stub_->Forward(&context, r, &response));
      if (!status.ok()) return status;
      return response;
    }));
  }
  for (size_t i = 0; i < problems.size(); ++i) {
    absl::StatusOr<v1::ForwardResponse> from_region = calls[i].get();
    ASSERT_TRUE(from_region.ok()) << from_region.status();
    auto inline_forward = client_->Forward(Args(problems[i], true, BackwardMode::kStoreGrads));
    ASSERT_TRUE(inline_forward.ok()) << inline_forward.status();
    EXPECT_EQ(from_region->loss().data(), inline_forward->loss.data) << "call " << i;
    BackwardArgs a, b;
    a.session_id = from_region->session_id();
    b.session_id = inline_forward->session_id;
    auto ga = client_->Backward(a);
    auto gb = client_->Backward(b);
    ASSERT_TRUE(ga.ok() && gb.ok()) << ga.status() << gb.status();
    EXPECT_EQ(ga->grad_hidden.data, gb->grad_hidden.data) << "call " << i;
    EXPECT_EQ(ga->grad_weight->data, gb->grad_weight->data) << "call " << i;
  }
  grpc::ClientContext stats_context;
  v1::GetStatsResponse stats;
  ASSERT_TRUE(stub_->GetStats(&stats_context, v1::GetStatsRequest(), &stats).ok());
  const EngineOptions engine = TestOptions().engine;
  if (Backend() == "cuda" && engine.cuda_devices.empty()) {  // one engine, shards or not
    EXPECT_EQ(stats.forwards_staged(), static_cast<int64_t>(problems.size()));
  } else {
    EXPECT_EQ(stats.forwards_staged(), 0) << "nothing to stage without one engine's device";
  }
  ExpectStillServing();
}

TEST_F(ServerTest, ClientSharedMemoryArenaRoundTrip) {
  server_.reset();
  ServerOptions o = TestOptions();
  o.enable_shared_memory = true;
  StartServer(o);
  RandomProblemSpec spec;
  spec.rows = 17;
  spec.hidden = 12;
  spec.vocab = 71;
  spec.bias = true;
  spec.class_weight = true;
  spec.options.reduction = Reduction::kSum;
  const OwnedProblem p = MakeRandomProblem(spec);
  auto arena = client_->CreateSharedMemory(1 << 16);
  ASSERT_TRUE(arena.ok()) << arena.status();
  for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
    ForwardArgs args = Args(p, true, mode);
    auto wire = client_->Forward(args);
    args.shm = arena->get();
    auto shm = client_->Forward(args);
    ASSERT_TRUE(wire.ok() && shm.ok()) << wire.status() << shm.status();
    EXPECT_EQ(wire->loss.data, shm->loss.data);
    BackwardArgs bw, bs;
    bw.session_id = wire->session_id;
    bs.session_id = shm->session_id;
    bs.shm = arena->get();
    auto gw = client_->Backward(bw);
    auto gs = client_->Backward(bs);
    ASSERT_TRUE(gw.ok()) << gw.status();
    ASSERT_TRUE(gs.ok()) << gs.status();
    EXPECT_EQ(gw->grad_hidden.data, gs->grad_hidden.data);
    EXPECT_EQ(gw->grad_weight->data, gs->grad_weight->data);
    EXPECT_EQ(gw->grad_bias->data, gs->grad_bias->data);
  }
  auto tiny = client_->CreateSharedMemory(64);
  ASSERT_TRUE(tiny.ok());
  ForwardArgs args = Args(p);
  args.shm = tiny->get();
  EXPECT_THAT(client_->Forward(args),
              StatusIs(Code::kInvalidArgument, HasSubstr("more than the region's 64 bytes")));
}

// An engine that fails as the CUDA engine does after a sticky device error.
class BrokenEngine : public CpuEngine {
 public:
  absl::Status health() const override {
    return broken_ ? absl::UnavailableError("device lost") : absl::OkStatus();
  }
  absl::StatusOr<ForwardResult> Forward(const LossProblem& problem, const ForwardSpec& spec,
                                        const CancelFn& cancelled) override {
    broken_ = true;
    return absl::UnavailableError("engine stopped after an unrecoverable device error");
  }

 private:
  std::atomic<bool> broken_{false};
};

TEST(ServerHealthTest, AStickyEngineFailureTurnsHealthNotServing) {
  auto server = LossServer::Start(TestOptions(), std::make_unique<BrokenEngine>());
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = LossClient::Create("127.0.0.1:" + std::to_string((*server)->port()));
  EXPECT_EQ(*client->CheckHealth("flce.v1.LossService"),
            grpc::health::v1::HealthCheckResponse::SERVING);
  RandomProblemSpec spec;
  const OwnedProblem p = MakeRandomProblem(spec);
  ForwardArgs args;
  args.problem = p.view();
  EXPECT_THAT(client->Forward(args), StatusIs(Code::kUnavailable, HasSubstr("unrecoverable")));
  EXPECT_EQ(*client->CheckHealth("flce.v1.LossService"),
            grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(*client->CheckHealth(""), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_FALSE((*server)->Metrics().gauges.serving);
}

TEST(ServerStartTest, BadOptionsAndMissingBackends) {
  // Option handling, independent of the backend under test.
  auto cpu_options = [] {
    ServerOptions o = TestOptions();
    o.backend = "cpu";
    o.engine.cuda_devices.clear();
    return o;
  };
  ServerOptions o = cpu_options();
  if (!CudaBuiltIn()) {
    o.backend = "cuda";
    EXPECT_THAT(LossServer::Start(o), StatusIs(Code::kUnimplemented, HasSubstr("--backend=cuda")));
  }
  o.backend = "tpu";
  EXPECT_THAT(LossServer::Start(o), StatusIs(Code::kInvalidArgument, HasSubstr("--backend")));
  o = cpu_options();
  o.workers = 0;
  EXPECT_THAT(LossServer::Start(o), StatusIs(Code::kInvalidArgument, HasSubstr("--workers")));
  o = cpu_options();
  o.listen_address = "256.0.0.1:1";
  EXPECT_THAT(LossServer::Start(o), StatusIs(Code::kUnavailable, HasSubstr("--listen_address")));
}

}  // namespace
}  // namespace flce
