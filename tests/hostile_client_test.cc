// A real flce server (CPU backend) on localhost:0 against clients that mean
// harm or have bugs: each case asserts the exact code, that the server still
// serves afterwards, and that what the client made it hold is back to zero.

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/loss_client.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_engine.h"
#include "kernels/reference/random_problem.h"
#include "proto/codec.h"
#include "proto/crc32c.h"
#include "server/host_memory.h"
#include "server/loss_server.h"
#include "tests/shm_object.h"
#include "tests/status_matchers.h"

namespace flce {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using Code = absl::StatusCode;

ServerOptions Options() {
  ServerOptions o;
  o.listen_address = "127.0.0.1:0";
  o.security.insecure = true;
  o.backend = "cpu";
  o.workers = 2;
  o.reap_interval = absl::Milliseconds(50);
  return o;
}

// Resident memory of this process (server and clients), in bytes.
int64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

OwnedProblem Problem(int64_t n, int64_t h, int64_t v, uint64_t seed = 1) {
  RandomProblemSpec spec;
  spec.rows = n;
  spec.hidden = h;
  spec.vocab = v;
  spec.options.reduction = Reduction::kSum;
  spec.seed = seed;
  return MakeRandomProblem(spec);
}

ForwardArgs Args(const OwnedProblem& p, bool need_backward = true) {
  ForwardArgs a;
  a.problem = p.view();
  a.need_backward = need_backward;
  a.mode = BackwardMode::kStoreGrads;
  return a;
}

class HostileClientTest : public ::testing::Test {
 protected:
  void Start(ServerOptions options = Options(), std::unique_ptr<LossEngine> engine = nullptr) {
    auto server = engine ? LossServer::Start(options, std::move(engine)) : LossServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    address_ = "127.0.0.1:" + std::to_string(server_->port());
    ClientOptions client_options;
    client_options.max_message_bytes = options.max_message_bytes;
    client_ = LossClient::Create(address_, client_options);
    channel_ = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    stub_ = v1::LossService::NewStub(channel_);
  }

  // The server answers a good request correctly and holds nothing for the
  // hostile clients: no stream, no reserved byte, no session, no queued work.
  void ExpectStillServingAndEmpty() {
    OwnedProblem p = Problem(3, 4, 5);
    auto fwd = client_->Forward(Args(p, /*need_backward=*/false));
    EXPECT_TRUE(fwd.ok()) << fwd.status();
    v1::GetStatsResponse stats;
    for (int i = 0; i < 500; ++i) {  // calls are settled a moment after their answers
      stats = *client_->GetStats();
      if (stats.open_streams() == 0 && stats.request_memory_bytes() == 0 &&
          stats.live_sessions() == 0 && stats.running_requests() == 0) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_EQ(stats.open_streams(), 0);
    EXPECT_EQ(stats.request_memory_bytes(), 0);
    EXPECT_EQ(stats.live_sessions(), 0);
    EXPECT_EQ(stats.session_memory_bytes(), 0);
    EXPECT_EQ(stats.running_requests() + stats.queued_requests(), 0);
    EXPECT_TRUE(stats.serving());
  }

  // A ForwardStream whose header announces `hidden` [n, h] bf16 (and a
  // small weight and targets), and nothing else; left open.
  struct OpenStream {
    std::unique_ptr<grpc::ClientContext> context = std::make_unique<grpc::ClientContext>();
    v1::ForwardResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::ForwardRequestChunk>> writer;
    absl::Status Finish() { return FromGrpcStatus(writer->Finish()); }
  };
  OpenStream AnnounceForwardStream(int64_t n, int64_t h) {
    OpenStream s;
    s.context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    s.writer = stub_->ForwardStream(s.context.get(), &s.response);
    v1::ForwardRequestChunk first;
    v1::ForwardRequest* r = first.mutable_request();
    r->mutable_hidden()->set_dtype(v1::DTYPE_BFLOAT16);
    r->mutable_hidden()->add_shape(n);
    r->mutable_hidden()->add_shape(h);
    r->mutable_weight()->set_dtype(v1::DTYPE_BFLOAT16);
    r->mutable_weight()->add_shape(8);
    r->mutable_weight()->add_shape(h);
    r->mutable_target()->set_dtype(v1::DTYPE_INT32);
    r->mutable_target()->add_shape(n);
    s.writer->Write(first);
    return s;
  }

  // A PutWeight whose header announces [v, h] fp32 and nothing else.
  struct OpenPut {
    std::unique_ptr<grpc::ClientContext> context = std::make_unique<grpc::ClientContext>();
    v1::PutWeightResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::PutWeightChunk>> writer;
    absl::Status Finish() { return FromGrpcStatus(writer->Finish()); }
  };
  OpenPut AnnouncePutWeight(const std::string& name, int64_t v, int64_t h) {
    OpenPut s;
    s.context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    s.writer = stub_->PutWeight(s.context.get(), &s.response);
    v1::PutWeightChunk first;
    first.mutable_header()->set_name(name);
    first.mutable_header()->set_dtype(v1::DTYPE_FLOAT32);
    first.mutable_header()->add_shape(v);
    first.mutable_header()->add_shape(h);
    s.writer->Write(first);
    return s;
  }

  v1::GetStatsResponse Stats() { return *client_->GetStats(); }

  // Registers a POSIX shm object; the region id, or an error.
  absl::StatusOr<std::string> Register(const ShmObject& shm, int64_t bytes) {
    grpc::ClientContext context;
    v1::RegisterSharedMemoryRequest request;
    request.set_shm_name(shm.name());
    request.set_bytes(bytes);
    v1::RegisterSharedMemoryResponse response;
    absl::Status status = FromGrpcStatus(stub_->RegisterSharedMemory(&context, request, &response));
    if (!status.ok()) return status;
    return response.region_id();
  }

  std::unique_ptr<LossServer> server_;
  std::string address_;
  std::unique_ptr<LossClient> client_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::LossService::Stub> stub_;
};

// 1. A header announcing more than the budget (or the host) is refused at
// once; nothing is allocated, nothing hangs, and shutdown is not held up.
TEST_F(HostileClientTest, ForwardStreamHeadersBeyondTheBudgetAreRefusedAtOnce) {
  Start();
  const int64_t before = ResidentBytes();
  std::vector<OpenStream> streams;
  for (int i = 0; i < 20; ++i) streams.push_back(AnnounceForwardStream(3801088, 4096));  // 29 GiB
  for (OpenStream& s : streams) {
    s.writer->WritesDone();
    EXPECT_THAT(s.Finish(), StatusIs(Code::kResourceExhausted, HasSubstr("--request_memory_bytes")));
  }
  EXPECT_LT(ResidentBytes() - before, int64_t{64} << 20);
  ExpectStillServingAndEmpty();

  // With a budget above the host's memory, the host's memory is the bound
  // (a request between it and the 64 GiB request limit, where there is one).
  const int64_t host = HostAvailableBytes();
  if (host > 0 && host < (int64_t{60} << 30)) {
    server_.reset();
    ServerOptions o = Options();
    o.requests.memory_bytes = int64_t{1} << 50;
    Start(o);
    OpenStream huge = AnnounceForwardStream(host / 8192 + 1, 4096);
    huge.writer->WritesDone();
    EXPECT_THAT(huge.Finish(), StatusIs(Code::kResourceExhausted, HasSubstr("the host has")));
    ExpectStillServingAndEmpty();
  }
}

// The CPU engine, whose first Forward waits until the test opens the gate:
// a request that holds the only worker for as long as the test needs,
// whatever the machine's speed.
class GatedEngine : public CpuEngine {
 public:
  explicit GatedEngine(absl::Notification* gate) : gate_(gate) {}
  absl::StatusOr<ForwardResult> Forward(const LossProblem& problem, const ForwardSpec& spec,
                                        const CancelFn& cancelled) override {
    if (!first_done_.exchange(true)) gate_->WaitForNotification();
    return CpuEngine::Forward(problem, spec, cancelled);
  }

 private:
  absl::Notification* const gate_;
  std::atomic<bool> first_done_{false};
};

// Unary requests are held in request memory while their calls last: a
// client that queues requests behind a slow one is refused past the budget.
TEST_F(HostileClientTest, QueuedUnaryRequestsAreBoundedByRequestMemory) {
  ServerOptions o = Options();
  o.workers = 1;
  o.requests.memory_bytes = int64_t{50} << 20;
  absl::Notification gate;
  Start(o, std::make_unique<GatedEngine>(&gate));
  OwnedProblem slow = Problem(4096, 512, 8000, 2);  // 24 MiB, held at the gate
  std::thread busy([&] { EXPECT_TRUE(client_->Forward(Args(slow, false)).ok()); });
  for (int i = 0; i < 50000 && server_->Metrics().gauges.running_requests == 0; ++i) {
    absl::SleepFor(absl::Microseconds(200));
  }
  OwnedProblem medium = Problem(3072, 1024, 4, 3);  // 12 MiB
  std::vector<absl::Status> queued_results(2);
  std::vector<std::thread> queued;
  for (int i = 0; i < 2; ++i) {
    queued.emplace_back(
        [&, i] { queued_results[i] = client_->Forward(Args(medium, false)).status(); });
  }
  for (int i = 0; i < 150000 && server_->Metrics().gauges.queued_requests < 2; ++i) {
    absl::SleepFor(absl::Microseconds(200));
  }
  EXPECT_EQ(server_->Metrics().gauges.queued_requests, 2);
  EXPECT_GT(Stats().request_memory_bytes(), int64_t{47} << 20);
  // 24 + 12 + 12 MiB held: one more does not fit.
  EXPECT_THAT(client_->Forward(Args(medium, false)),
              StatusIs(Code::kResourceExhausted, HasSubstr("--request_memory_bytes")));
  gate.Notify();
  for (std::thread& t : queued) t.join();
  busy.join();
  for (const absl::Status& status : queued_results) EXPECT_TRUE(status.ok()) << status;
  ExpectStillServingAndEmpty();
}

// 6. Stalled streams: a bounded number, each holding only what it reserved,
// finished by the idle timeout.
TEST_F(HostileClientTest, StalledStreamsAreBoundedAndTimedOut) {
  ServerOptions o = Options();
  o.requests.max_streams = 4;
  o.requests.memory_bytes = int64_t{64} << 20;
  o.requests.idle_timeout = absl::Milliseconds(500);
  Start(o);
  std::vector<OpenStream> stalled;
  for (int i = 0; i < 3; ++i) stalled.push_back(AnnounceForwardStream(1024, 4096));  // 8 MiB
  OpenPut put = AnnouncePutWeight("w", 1024, 1024);
  for (int i = 0; i < 200 && Stats().open_streams() < 4; ++i) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(Stats().open_streams(), 4);
  EXPECT_EQ(Stats().request_memory_bytes(), 3 * (1024 * 4096 * 2 + 8 * 4096 * 2 + 1024 * 4));
  OpenStream fifth = AnnounceForwardStream(16, 16);
  fifth.writer->WritesDone();
  EXPECT_THAT(fifth.Finish(), StatusIs(Code::kResourceExhausted, HasSubstr("--max_streams")));
  // Nothing more arrives: each is finished with DEADLINE_EXCEEDED naming
  // the flag.
  for (OpenStream& s : stalled) {
    EXPECT_THAT(s.Finish(), StatusIs(Code::kDeadlineExceeded, HasSubstr("--stream_idle_timeout")));
  }
  EXPECT_THAT(put.Finish(), StatusIs(Code::kDeadlineExceeded, HasSubstr("--stream_idle_timeout")));
  EXPECT_EQ(Stats().stream_idle_timeouts(), 4);
  // The upload's reservation goes when the server is done with the call,
  // which is just after the client has its status.
  for (int i = 0; i < 400 && Stats().weight_memory_bytes() != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(Stats().weight_memory_bytes(), 0);
  ExpectStillServingAndEmpty();
  // A stream that keeps sending is not cut, however long it takes.
  OwnedProblem p = Problem(64, 16, 40);
  v1::ForwardRequest header = BuildForwardRequest(Args(p), /*with_data=*/false);
  grpc::ClientContext context;
  v1::ForwardResponse response;
  auto writer = stub_->ForwardStream(&context, &response);
  v1::ForwardRequestChunk first;
  *first.mutable_request() = header;
  writer->Write(first);
  for (size_t at = 0; at < p.hidden.data.size(); at += 256) {
    v1::ForwardRequestChunk c;
    c.mutable_chunk()->set_field(v1::TENSOR_FIELD_HIDDEN);
    c.mutable_chunk()->set_data(p.hidden.data.substr(at, 256));
    writer->Write(c);
    absl::SleepFor(absl::Milliseconds(40));  // 16 chunks: 0.64 s in all
  }
  for (auto [field, data] : {std::pair{v1::TENSOR_FIELD_WEIGHT, &p.weight.data},
                             std::pair{v1::TENSOR_FIELD_TARGET, &p.target.data}}) {
    v1::ForwardRequestChunk c;
    c.mutable_chunk()->set_field(field);
    c.mutable_chunk()->set_data(*data);
    writer->Write(c);
  }
  writer->WritesDone();
  EXPECT_TRUE(FromGrpcStatus(writer->Finish()).ok());
  ASSERT_TRUE(client_->ReleaseSession(response.session_id()).ok());
  ExpectStillServingAndEmpty();
}

// 2. PutWeight headers take their bytes from the weight budget before any
// data arrives, and nothing is allocated for bytes that never come.
TEST_F(HostileClientTest, PutWeightHeadersTakeTheWeightBudget) {
  ServerOptions o = Options();
  o.weight_memory_bytes = int64_t{1} << 30;
  Start(o);
  const int64_t before = ResidentBytes();
  OpenPut first = AnnouncePutWeight("a", 96 << 10, 1024);  // 384 MiB each
  OpenPut second = AnnouncePutWeight("b", 96 << 10, 1024);
  for (int i = 0; i < 200 && Stats().weight_memory_bytes() < (int64_t{768} << 20); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(Stats().weight_memory_bytes(), int64_t{768} << 20);
  OpenPut third = AnnouncePutWeight("c", 96 << 10, 1024);
  third.writer->WritesDone();
  EXPECT_THAT(third.Finish(),
              StatusIs(Code::kResourceExhausted, HasSubstr("--weight_memory_bytes")));
  EXPECT_LT(ResidentBytes() - before, int64_t{64} << 20);
  first.context->TryCancel();
  second.context->TryCancel();
  EXPECT_EQ(first.Finish().code(), Code::kCancelled);
  EXPECT_EQ(second.Finish().code(), Code::kCancelled);
  for (int i = 0; i < 200 && Stats().weight_memory_bytes() > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(Stats().weight_memory_bytes(), 0);
  EXPECT_EQ(Stats().registered_weights(), 0);
  ExpectStillServingAndEmpty();
}

// 3, 4. Shared memory: a region shrunk after registration is refused at
// use; shrunk during a call, the call fails (or, if the engine had read
// everything already, succeeds) and the server lives; the session stays.
TEST_F(HostileClientTest, ShrunkSharedMemoryFailsTheCallNotTheServer) {
  ServerOptions o = Options();
  o.enable_shared_memory = true;
  Start(o);
  OwnedProblem p = Problem(512, 256, 4000);
  const size_t x = p.hidden.data.size(), w = p.weight.data.size(), t = p.target.data.size();
  auto shm = std::make_unique<ShmObject>(x + w + t);
  std::memcpy(shm->base(), p.hidden.data.data(), x);
  std::memcpy(shm->base() + x, p.weight.data.data(), w);
  std::memcpy(shm->base() + x + w, p.target.data.data(), t);
  auto region = Register(*shm, static_cast<int64_t>(x + w + t));
  ASSERT_TRUE(region.ok()) << region.status();
  v1::ForwardRequest r = BuildForwardRequest(Args(p));
  auto place = [&](v1::Tensor* tensor, size_t offset) {
    tensor->clear_data();
    tensor->mutable_shm()->set_region_id(*region);
    tensor->mutable_shm()->set_offset(static_cast<int64_t>(offset));
  };
  place(r.mutable_hidden(), 0);
  place(r.mutable_weight(), x);
  place(r.mutable_target(), x + w);
  auto forward = [&] {
    grpc::ClientContext context;
    v1::ForwardResponse response;
    absl::Status status = FromGrpcStatus(stub_->Forward(&context, r, &response));
    if (status.ok()) client_->ReleaseSession(response.session_id()).IgnoreError();
    return status;
  };
  ASSERT_TRUE(forward().ok());
  for (int i = 0; i < 2000 && server_->Metrics().gauges.running_requests > 0; ++i) {
    absl::SleepFor(absl::Microseconds(200));
  }
  // Shrunk while the call computes: whatever it read after the shrink was
  // zeros, so it fails; the server lives on.
  std::thread shrink([&] {
    for (int i = 0; i < 2000 && server_->Metrics().gauges.running_requests == 0; ++i) {
      absl::SleepFor(absl::Microseconds(200));
    }
    shm->Resize(0);
  });
  EXPECT_THAT(forward(),
              AnyOf(StatusIs(Code::kOk, ::testing::_),
                    StatusIs(Code::kFailedPrecondition,
                             AnyOf(HasSubstr("shrunk by its owner"), HasSubstr("bytes now")))));
  shrink.join();
  // Shrunk before the call: refused at use.
  EXPECT_THAT(forward(), StatusIs(Code::kFailedPrecondition, HasSubstr("unregister it")));
  ExpectStillServingAndEmpty();
}

// 3. What was validated is what is computed on: targets and class weights
// in shared memory are copied when they are checked, so rewriting them
// while the request waits in the queue changes nothing.
TEST_F(HostileClientTest, SharedMemoryTargetsRewrittenWhileQueuedChangeNothing) {
  ServerOptions o = Options();
  o.enable_shared_memory = true;
  o.workers = 1;
  Start(o);
  OwnedProblem p = Problem(64, 32, 50);
  const size_t t = p.target.data.size();
  ShmObject shm(t);
  std::memcpy(shm.base(), p.target.data.data(), t);
  auto region = Register(shm, static_cast<int64_t>(t));
  ASSERT_TRUE(region.ok());
  v1::ForwardRequest r = BuildForwardRequest(Args(p, /*need_backward=*/false));
  r.mutable_target()->clear_data();
  r.mutable_target()->mutable_shm()->set_region_id(*region);
  auto expected = client_->Forward(Args(p, false));
  ASSERT_TRUE(expected.ok());
  // A slow call holds the only worker; ours waits in the queue.
  OwnedProblem slow = Problem(2048, 512, 8000, 2);
  std::thread busy([&] { client_->Forward(Args(slow, false)).IgnoreError(); });
  for (int i = 0; i < 5000 && server_->Metrics().gauges.running_requests == 0; ++i) {
    absl::SleepFor(absl::Microseconds(200));
  }
  v1::ForwardResponse response;
  grpc::Status status;
  std::thread queued([&] {
    grpc::ClientContext context;
    status = stub_->Forward(&context, r, &response);
  });
  for (int i = 0; i < 5000 && server_->Metrics().gauges.queued_requests == 0; ++i) {
    absl::SleepFor(absl::Microseconds(200));
  }
  ASSERT_EQ(server_->Metrics().gauges.queued_requests, 1);
  // Every target now out of range: a read at compute time would overflow.
  for (size_t i = 0; i < t / sizeof(int64_t); ++i) {
    reinterpret_cast<int64_t*>(shm.base())[i] = int64_t{1} << 40;
  }
  queued.join();
  busy.join();
  ASSERT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();
  EXPECT_EQ(response.loss().data(), expected->loss.data);
  ExpectStillServingAndEmpty();
}

// 5. Registrations are bounded; the bound gives its flag.
TEST_F(HostileClientTest, SharedMemoryRegistrationsAreBounded) {
  ServerOptions o = Options();
  o.enable_shared_memory = true;
  o.shared_memory.max_regions = 8;
  Start(o);
  ShmObject shm(4096);
  std::vector<std::string> ids;
  for (int i = 0; i < 8; ++i) ids.push_back(*Register(shm, 4096));
  EXPECT_THAT(Register(shm, 4096),
              StatusIs(Code::kResourceExhausted, HasSubstr("--max_shared_memory_regions")));
  grpc::ClientContext context;
  v1::UnregisterSharedMemoryRequest request;
  request.set_region_id(ids[0]);
  v1::UnregisterSharedMemoryResponse response;
  ASSERT_TRUE(stub_->UnregisterSharedMemory(&context, request, &response).ok());
  EXPECT_TRUE(Register(shm, 4096).ok());
  EXPECT_EQ(Stats().shared_memory_regions(), 8);
  ExpectStillServingAndEmpty();
}

// 12. A request that does not parse is INVALID_ARGUMENT, logged and counted.
TEST_F(HostileClientTest, UnparseableRequestsAreInvalidArgument) {
  Start();
  grpc::GenericStub generic(channel_);
  const std::string garbage("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11);
  for (const char* method : {"/flce.v1.LossService/Forward", "/flce.v1.LossService/Backward",
                             "/flce.v1.LossService/GetServerInfo"}) {
    grpc::ClientContext context;
    grpc::Slice slice(garbage);
    grpc::ByteBuffer request(&slice, 1), response;
    std::atomic<bool> done{false};
    grpc::Status status;
    generic.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                      [&](grpc::Status s) {
                        status = s;
                        done = true;
                      });
    for (int i = 0; i < 5000 && !done; ++i) absl::SleepFor(absl::Milliseconds(1));
    ASSERT_TRUE(done);
    EXPECT_THAT(FromGrpcStatus(status), StatusIs(Code::kInvalidArgument, HasSubstr("do not parse")))
        << method;
  }
  v1::GetStatsResponse stats;
  for (int i = 0; i < 500; ++i) {
    stats = Stats();
    int64_t refused = 0;
    for (const auto& r : stats.requests()) {
      if (r.code() == "INVALID_ARGUMENT") refused += r.count();
    }
    if (refused == 3) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  int64_t forward_refused = 0;
  for (const auto& r : stats.requests()) {
    if (r.rpc() == "Forward" && r.code() == "INVALID_ARGUMENT") forward_refused = r.count();
  }
  EXPECT_EQ(forward_refused, 1);
  ExpectStillServingAndEmpty();
}

// 9. A response over the message limit is refused before any compute: a
// Forward keeps no session, a Backward keeps its session (and BackwardStream
// serves it).
TEST_F(HostileClientTest, ResponsesOverTheLimitAreRefusedBeforeCompute) {
  ServerOptions o = Options();
  o.max_message_bytes = 64 << 10;
  Start(o);
  OwnedProblem rows = Problem(8192, 4, 5);
  ForwardArgs none = Args(rows, /*need_backward=*/true);
  none.problem.options.reduction = Reduction::kNone;
  none.mode = BackwardMode::kRecompute;
  none.want_lse = true;
  none.want_per_row_loss = true;
  auto refused = client_->Forward(none);
  EXPECT_THAT(refused, StatusIs(Code::kResourceExhausted, HasSubstr("per-row outputs")));
  EXPECT_EQ(Stats().live_sessions(), 0);

  OwnedProblem wide = Problem(16, 64, 400);  // dW: 100 KiB
  auto fwd = client_->Forward(Args(wide));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  grpc::ClientContext context;
  v1::BackwardRequest request;
  request.set_session_id(fwd->session_id);
  v1::BackwardResponse response;
  EXPECT_THAT(FromGrpcStatus(stub_->Backward(&context, request, &response)),
              StatusIs(Code::kResourceExhausted, HasSubstr("BackwardStream")));
  BackwardArgs back;
  back.session_id = fwd->session_id;
  auto grads = client_->Backward(back);  // streams by itself
  ASSERT_TRUE(grads.ok()) << grads.status();
  EXPECT_EQ(grads->grad_weight->data.size(), 400u * 64 * 4);
  ExpectStillServingAndEmpty();
}

// 11, 8. Streamed responses fit any message limit; a stream cut short
// leaves the session and the accumulated gradient as they were.
TEST_F(HostileClientTest, StreamsCutShortLoseNothing) {
  ServerOptions o = Options();
  o.max_message_bytes = 64 << 10;
  Start(o);
  // dW: 64 MiB in 48 KiB chunks, more than the transport's windows and
  // buffers hold: the server learns that the stream broke.
  OwnedProblem big = Problem(8, 1024, 16384);
  auto fwd = client_->Forward(Args(big));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  {
    grpc::ClientContext context;
    v1::BackwardRequest request;
    request.set_session_id(fwd->session_id);
    auto reader = stub_->BackwardStream(&context, request);
    v1::BackwardResponseChunk first;
    ASSERT_TRUE(reader->Read(&first));
    context.TryCancel();
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  BackwardArgs back;
  back.session_id = fwd->session_id;
  auto whole = client_->Backward(back);  // the session is still there
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->grad_weight->data.size(), 16384u * 1024 * 4);

  OwnedProblem p = Problem(32, 64, 1000);  // dW: 250 KiB
  auto plain = client_->Forward(Args(p));
  ASSERT_TRUE(plain.ok()) << plain.status();
  BackwardArgs plain_back;
  plain_back.session_id = plain->session_id;
  auto grads = client_->Backward(plain_back);
  ASSERT_TRUE(grads.ok()) << grads.status();

  // The same for a taken gradient sum.
  HostTensor weight(DType::kFloat32, {1000, 64});
  std::memcpy(weight.mutable_data<float>(), p.weight.data.data(), p.weight.data.size());
  ASSERT_TRUE(client_->PutWeight("head", weight.view(), std::nullopt).ok());
  ForwardArgs by_name = Args(p);
  by_name.weight_name = "head";
  auto session = client_->Forward(by_name);
  ASSERT_TRUE(session.ok()) << session.status();
  BackwardArgs accumulate;
  accumulate.session_id = session->session_id;
  accumulate.accumulate_weight_grad = true;
  ASSERT_TRUE(client_->Backward(accumulate).ok());
  // A client that stops reading after the first chunk. The server may have
  // sent everything before the cancellation reaches it; the take, kept
  // until the next one, is resumed by it.
  uint64_t lost = 0;
  for (int round = 0; round < 2; ++round) {
    grpc::ClientContext context;
    v1::TakeWeightGradRequest request;
    request.mutable_weight()->set_name("head");
    request.set_hold_until_acknowledged(true);
    request.set_resume_take(lost);
    auto reader = stub_->TakeWeightGrad(&context, request);
    v1::WeightGradChunk first;
    ASSERT_TRUE(reader->Read(&first));
    ASSERT_TRUE(first.has_header());
    EXPECT_EQ(first.header().accumulated_backwards(), 1);
    lost = first.header().take_id();
    EXPECT_NE(lost, 0u);
    context.TryCancel();
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  v1::TakeWeightGradRequest resume;
  resume.mutable_weight()->set_name("head");
  resume.set_resume_take(lost);
  grpc::ClientContext resume_context;
  auto reader = stub_->TakeWeightGrad(&resume_context, resume);
  std::string bytes;
  v1::WeightGradChunk chunk;
  int64_t backwards = 0;
  while (reader->Read(&chunk)) {
    if (chunk.has_header()) backwards = chunk.header().accumulated_backwards();
    bytes += chunk.data();
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(backwards, 1);
  EXPECT_EQ(bytes, grads->grad_weight->data);
  // Nothing is left, and a take not resumed is not given again.
  EXPECT_THAT(client_->TakeWeightGrad("head"),
              StatusIs(Code::kFailedPrecondition, HasSubstr("no gradient accumulated")));
  ExpectStillServingAndEmpty();
}

// 15. A port another server holds is refused, not shared.
TEST_F(HostileClientTest, ASecondServerOnTheSamePortIsRefused) {
  Start();
  ServerOptions o = Options();
  o.listen_address = address_;
  auto second = LossServer::Start(o);
  EXPECT_THAT(second, StatusIs(Code::kUnavailable, HasSubstr("cannot listen")));
  ExpectStillServingAndEmpty();
}

}  // namespace
}  // namespace flce
