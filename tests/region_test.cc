// Regions of the server's own memory against a real server on localhost:0:
// registered without --enable_shared_memory and bounded, written and read
// in checked parts (WriteRegion, ReadRegion), and named by Forward,
// Backward, PutWeight and TakeWeightGrad instead of bytes.

#include <zlib.h>

#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "client/loss_client.h"
#include "kernels/status_macros.h"
#include "proto/codec.h"
#include "server/loss_server.h"
#include "tests/shm_object.h"
#include "tests/status_matchers.h"

namespace flce {
namespace {

using ::testing::HasSubstr;
using Code = absl::StatusCode;

uint32_t Crc(const std::string& s) {
  return static_cast<uint32_t>(
      crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(s.data()), s.size()));
}

std::string Random(size_t n, int seed) {
  std::mt19937 gen(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(gen());
  return s;
}

class RegionTest : public ::testing::Test {
 protected:
  void Start(int64_t region_memory_bytes = int64_t{64} << 20, int64_t max_streams = 64) {
    ServerOptions o;
    o.requests.max_streams = max_streams;
    o.listen_address = "127.0.0.1:0";
    o.security.insecure = true;
    o.backend = "cpu";
    o.shared_memory.max_server_bytes = region_memory_bytes;
    auto server = LossServer::Start(o);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ = v1::LossService::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
  }

  absl::StatusOr<std::string> Register(int64_t bytes) {
    grpc::ClientContext context;
    v1::RegisterSharedMemoryRequest request;
    request.set_server_memory(true);
    request.set_bytes(bytes);
    v1::RegisterSharedMemoryResponse response;
    FLCE_RETURN_IF_ERROR(FromGrpcStatus(stub_->RegisterSharedMemory(&context, request, &response)));
    return response.region_id();
  }

  // One WriteRegion stream of these parts.
  absl::Status Write(const std::vector<v1::RegionPart>& parts) {
    grpc::ClientContext context;
    v1::WriteRegionResponse response;
    auto writer = stub_->WriteRegion(&context, &response);
    for (const v1::RegionPart& part : parts) {
      if (!writer->Write(part)) break;
    }
    writer->WritesDone();
    return FromGrpcStatus(writer->Finish());
  }

  absl::StatusOr<std::string> Read(const std::string& region, int64_t offset, int64_t length,
                                   int64_t part_bytes = 0) {
    grpc::ClientContext context;
    v1::ReadRegionRequest request;
    request.set_region_id(region);
    request.set_offset(offset);
    request.set_length(length);
    request.set_part_bytes(part_bytes);
    request.set_crc32(true);
    auto reader = stub_->ReadRegion(&context, request);
    std::string out;
    v1::RegionPart part;
    while (reader->Read(&part)) {
      EXPECT_EQ(part.offset(), offset + static_cast<int64_t>(out.size()));
      EXPECT_EQ(part.crc32(), Crc(part.data()));
      out += part.data();
    }
    FLCE_RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
    return out;
  }

  static v1::RegionPart Part(const std::string& region, int64_t offset, const std::string& data,
                             bool crc = true) {
    v1::RegionPart part;
    part.set_region_id(region);
    part.set_offset(offset);
    part.set_data(data);
    if (crc) part.set_crc32(Crc(data));
    return part;
  }

  std::unique_ptr<LossServer> server_;
  std::unique_ptr<v1::LossService::Stub> stub_;
};

TEST_F(RegionTest, ServerMemoryNeedsNoFlagAndIsBounded) {
  Start(/*region_memory_bytes=*/1 << 20);
  auto a = Register(512 << 10);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_THAT(Register(768 << 10),
              StatusIs(Code::kResourceExhausted, HasSubstr("(--region_memory_bytes)")));
  EXPECT_THAT(Register(0), StatusIs(Code::kInvalidArgument, HasSubstr("bytes: 0")));
  EXPECT_EQ(server_->CurrentGauges().region_memory_bytes, 512 << 10);
  // Clients' own memory still needs the flag.
  ShmObject shm(4096);
  grpc::ClientContext context;
  v1::RegisterSharedMemoryRequest posix;
  posix.set_shm_name(shm.name());
  posix.set_bytes(4096);
  v1::RegisterSharedMemoryResponse response;
  EXPECT_THAT(FromGrpcStatus(stub_->RegisterSharedMemory(&context, posix, &response)),
              StatusIs(Code::kFailedPrecondition, HasSubstr("--enable_shared_memory")));
  grpc::ClientContext unregister_context;
  v1::UnregisterSharedMemoryRequest unregister;
  unregister.set_region_id(*a);
  v1::UnregisterSharedMemoryResponse unregistered;
  ASSERT_TRUE(stub_->UnregisterSharedMemory(&unregister_context, unregister, &unregistered).ok());
  EXPECT_EQ(server_->CurrentGauges().region_memory_bytes, 0);
  EXPECT_TRUE(Register(1 << 20).ok());
}

TEST_F(RegionTest, WriteRegionStreamsCountAmongTheOpenStreams) {
  Start(int64_t{64} << 20, /*max_streams=*/1);
  auto region = Register(4096);
  ASSERT_TRUE(region.ok());
  grpc::ClientContext held_context;
  v1::WriteRegionResponse held_response;
  auto held = stub_->WriteRegion(&held_context, &held_response);
  ASSERT_TRUE(held->Write(Part(*region, 0, "open")));  // and stays open
  for (int i = 0; i < 1000 && server_->CurrentGauges().open_streams < 1; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(server_->CurrentGauges().open_streams, 1);
  EXPECT_THAT(Write({Part(*region, 8, "second")}),
              StatusIs(Code::kResourceExhausted, HasSubstr("--max_streams")));
  held->WritesDone();
  ASSERT_TRUE(held->Finish().ok());
  // (The server lets the stream go when it is done with it: maybe a moment
  // after the client's Finish.)
  for (int i = 0; i < 1000 && server_->CurrentGauges().open_streams > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(Write({Part(*region, 8, "second")}).ok());
}

TEST_F(RegionTest, PartsWrittenOnSeveralStreamsReadBackChecked) {
  Start();
  auto region = Register(100000);
  ASSERT_TRUE(region.ok());
  const std::string data = Random(100000, 1);
  // Two streams, out of order; the second names the region only once.
  ASSERT_TRUE(Write({Part(*region, 60000, data.substr(60000)), Part(*region, 0, data.substr(0, 1))})
                  .ok());
  v1::RegionPart later = Part("", 30001, data.substr(30001, 29999));
  ASSERT_TRUE(Write({Part(*region, 1, data.substr(1, 30000)), later}).ok());
  for (int64_t part_bytes : {0, 1000, 99999}) {
    auto back = Read(*region, 0, 100000, part_bytes);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, data) << part_bytes;
  }
  auto middle = Read(*region, 333, 4444, 1024);
  ASSERT_TRUE(middle.ok());
  EXPECT_EQ(*middle, data.substr(333, 4444));
}

TEST_F(RegionTest, BadPartsAreRefusedNamingTheFieldAndTheServerServesOn) {
  Start();
  auto region = Register(4096);
  ASSERT_TRUE(region.ok());
  EXPECT_THAT(Write({Part(*region, 4000, std::string(97, 'x'))}),
              StatusIs(Code::kInvalidArgument,
                       HasSubstr("97 bytes at offset 4000 do not lie inside the region's 4096")));
  EXPECT_THAT(Write({Part(*region, -1, "x")}),
              StatusIs(Code::kInvalidArgument, HasSubstr("at offset -1")));
  v1::RegionPart corrupt = Part(*region, 0, "abcdef");
  corrupt.set_crc32(corrupt.crc32() ^ 1);
  EXPECT_THAT(Write({corrupt}), StatusIs(Code::kInvalidArgument, HasSubstr("crc32: the 6 bytes")));
  EXPECT_THAT(Write({Part("", 0, "x")}),
              StatusIs(Code::kInvalidArgument, HasSubstr("region_id: required")));
  EXPECT_THAT(Write({Part("ffff", 0, "x")}),
              StatusIs(Code::kNotFound, HasSubstr("region_id: unknown region 'ffff'")));
  EXPECT_THAT(Read(*region, 4000, 100),
              StatusIs(Code::kInvalidArgument, HasSubstr("do not lie inside")));
  EXPECT_THAT(Read("ffff", 0, 1), StatusIs(Code::kNotFound, HasSubstr("unknown region")));
  auto still = Read(*region, 0, 6);
  EXPECT_TRUE(still.ok()) << still.status();
}

TEST_F(RegionTest, ForwardBackwardAndWeightsNameSlicesOfARegion) {
  Start();
  const int64_t n = 7, h = 5, v = 11;
  std::mt19937 gen(3);
  std::normal_distribution<float> normal;
  std::vector<float> x(n * h), w(v * h);
  for (float& f : x) f = normal(gen);
  for (float& f : w) f = normal(gen) / 2;
  std::vector<int64_t> t = {0, 3, 10, 5, -100, 2, 7};
  auto tensor = [](v1::Tensor* out, const void* data, size_t bytes, std::vector<int64_t> shape,
                   v1::DType dtype) {
    out->set_dtype(dtype);
    for (int64_t d : shape) out->add_shape(d);
    out->set_data(data, bytes);
  };
  v1::ForwardRequest inline_request;
  tensor(inline_request.mutable_hidden(), x.data(), x.size() * 4, {n, h}, v1::DTYPE_FLOAT32);
  tensor(inline_request.mutable_weight(), w.data(), w.size() * 4, {v, h}, v1::DTYPE_FLOAT32);
  tensor(inline_request.mutable_target(), t.data(), t.size() * 8, {n}, v1::DTYPE_INT64);
  inline_request.mutable_options()->set_ignore_index(-100);
  inline_request.set_need_backward(true);

  Start();
  auto region = Register(1 << 16);
  ASSERT_TRUE(region.ok());
  const std::string xs(reinterpret_cast<const char*>(x.data()), x.size() * 4);
  const std::string ws(reinterpret_cast<const char*>(w.data()), w.size() * 4);
  ASSERT_TRUE(Write({Part(*region, 0, xs), Part(*region, 4096, ws)}).ok());
  v1::ForwardRequest sliced = inline_request;
  sliced.mutable_hidden()->mutable_shm()->set_region_id(*region);
  sliced.mutable_hidden()->mutable_shm()->set_offset(0);
  sliced.mutable_weight()->mutable_shm()->set_region_id(*region);
  sliced.mutable_weight()->mutable_shm()->set_offset(4096);

  std::vector<v1::ForwardResponse> forwards(2);
  for (int i = 0; i < 2; ++i) {
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->Forward(&context, i == 0 ? inline_request : sliced, &forwards[i]).ok());
  }
  EXPECT_EQ(forwards[0].loss().data(), forwards[1].loss().data());
  // The gradients into the region, against the inline ones.
  v1::BackwardResponse inline_grads, sliced_grads;
  {
    grpc::ClientContext context;
    v1::BackwardRequest b;
    b.set_session_id(forwards[0].session_id());
    ASSERT_TRUE(stub_->Backward(&context, b, &inline_grads).ok());
  }
  {
    grpc::ClientContext context;
    v1::BackwardRequest b;
    b.set_session_id(forwards[1].session_id());
    b.mutable_grad_hidden_out()->set_region_id(*region);
    b.mutable_grad_hidden_out()->set_offset(8192);
    b.mutable_grad_weight_out()->set_region_id(*region);
    b.mutable_grad_weight_out()->set_offset(12288);
    ASSERT_TRUE(stub_->Backward(&context, b, &sliced_grads).ok());
  }
  EXPECT_EQ(*Read(*region, 8192, n * h * 4), inline_grads.grad_hidden().data());
  EXPECT_EQ(*Read(*region, 12288, v * h * 4), inline_grads.grad_weight().data());

  // PutWeight from the region, then a TakeWeightGrad into it.
  auto put_from = [&](int64_t offset, std::optional<uint32_t> crc) -> absl::StatusOr<int64_t> {
    grpc::ClientContext context;
    v1::PutWeightResponse put;
    auto writer = stub_->PutWeight(&context, &put);
    v1::PutWeightChunk chunk;
    v1::WeightHeader* header = chunk.mutable_header();
    header->set_name("head");
    header->set_dtype(v1::DTYPE_FLOAT32);
    header->add_shape(v);
    header->add_shape(h);
    if (crc) header->set_crc32(*crc);
    header->mutable_source()->set_region_id(*region);
    header->mutable_source()->set_offset(offset);
    writer->Write(chunk);
    writer->WritesDone();
    FLCE_RETURN_IF_ERROR(FromGrpcStatus(writer->Finish()));
    return put.weight().version();
  };
  absl::StatusOr<int64_t> version = put_from(4096, Crc(ws));
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 1);
  v1::ForwardRequest registered = sliced;
  registered.clear_weight();
  registered.mutable_weight_ref()->set_name("head");
  v1::ForwardResponse fwd;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->Forward(&context, registered, &fwd).ok());
  }
  EXPECT_EQ(fwd.loss().data(), forwards[0].loss().data());
  {
    grpc::ClientContext context;
    v1::BackwardRequest b;
    b.set_session_id(fwd.session_id());
    b.set_accumulate_weight_grad(true);
    v1::BackwardResponse ignored;
    ASSERT_TRUE(stub_->Backward(&context, b, &ignored).ok());
  }
  {
    grpc::ClientContext context;
    v1::TakeWeightGradRequest take;
    take.mutable_weight()->set_name("head");
    take.mutable_into()->set_region_id(*region);
    take.mutable_into()->set_offset(20480);
    auto reader = stub_->TakeWeightGrad(&context, take);
    v1::WeightGradChunk chunk;
    int chunks = 0;
    while (reader->Read(&chunk)) {
      EXPECT_TRUE(chunk.data().empty());
      ++chunks;
    }
    ASSERT_TRUE(reader->Finish().ok());
    EXPECT_EQ(chunks, 1);
  }
  EXPECT_EQ(*Read(*region, 20480, v * h * 4), inline_grads.grad_weight().data());
  // A source that does not hold the weight, or whose CRC does not match,
  // is refused.
  EXPECT_THAT(put_from((1 << 16) - 8, std::nullopt),
              StatusIs(Code::kInvalidArgument, HasSubstr("header.source.shm")));
  EXPECT_THAT(put_from(4096, Crc(ws) ^ 1),
              StatusIs(Code::kInvalidArgument, HasSubstr("header.crc32")));
}

TEST_F(RegionTest, TheCppClientMovesLargeWeightsOverSeveralConnections) {
  Start();
  const int64_t v = 3001, h = 701;  // 8.4 MB of fp32
  HostTensor w(DType::kFloat32, {v, h}), b(DType::kFloat32, {v});
  std::mt19937 gen(4);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < v * h; ++i) w.mutable_data<float>()[i] = normal(gen) / 30;
  for (int64_t i = 0; i < v; ++i) b.mutable_data<float>()[i] = normal(gen);
  HostTensor x(DType::kFloat32, {5, h}), t(DType::kInt64, {5});
  for (int64_t i = 0; i < 5 * h; ++i) x.mutable_data<float>()[i] = normal(gen);
  for (int64_t i = 0; i < 5; ++i) t.mutable_data<int64_t>()[i] = i * 577;
  std::vector<WeightGrad> grads;
  auto count = [&](const char* rpc) {
    const MetricsSnapshot m = server_->Metrics();
    auto it = m.requests.find({rpc, "OK"});
    return it == m.requests.end() ? int64_t{0} : it->second;
  };
  for (auto [connections, http] : {std::pair{0, true}, {3, true}, {3, false}}) {
    ClientOptions options;
    options.bulk_connections = connections;
    options.bulk_threshold_bytes = 1 << 20;
    options.bulk_http = http;
    auto client = LossClient::Create("127.0.0.1:" + std::to_string(server_->port()), options);
    const std::string name = "w" + std::to_string(connections) + (http ? "http" : "grpc");
    const int64_t puts = count("BulkWrite"), gets = count("BulkRead"),
                  writes = count("WriteRegion"), reads = count("ReadRegion");
    auto info = client->PutWeight(name, w.view(), b.view());
    ASSERT_TRUE(info.ok()) << info.status();
    ForwardArgs args;
    args.problem.hidden = x.view();
    args.problem.target = t.view();
    args.weight_name = name;
    args.need_backward = true;
    auto fwd = client->Forward(args);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    BackwardArgs back;
    back.session_id = fwd->session_id;
    back.accumulate_weight_grad = true;
    ASSERT_TRUE(client->Backward(back).ok());
    auto grad = client->TakeWeightGrad(name);
    ASSERT_TRUE(grad.ok()) << grad.status();
    grads.push_back(*std::move(grad));
    // The bulk client's weight and gradient went through a region of its
    // own: W and b each way apart (3 ranges or streams for W's 8.4 MB, one
    // for b), over the bulk port or as gRPC streams.
    EXPECT_EQ(server_->CurrentGauges().region_memory_bytes > 0, connections > 0);
    // (A stream is counted when the server is done with it, which may come
    // a moment after the client's.)
    const bool bulk = connections > 0;
    auto counted = [&](const char* rpc, int64_t before, int64_t expected) {
      for (int i = 0; i < 500 && count(rpc) - before < expected; ++i) {
        absl::SleepFor(absl::Milliseconds(10));
      }
      return count(rpc) - before;
    };
    EXPECT_EQ(counted("BulkWrite", puts, bulk && http ? 4 : 0), bulk && http ? 4 : 0);
    EXPECT_EQ(counted("BulkRead", gets, bulk && http ? 4 : 0), bulk && http ? 4 : 0);
    EXPECT_EQ(counted("WriteRegion", writes, bulk && !http ? 4 : 0), bulk && !http ? 4 : 0);
    EXPECT_EQ(counted("ReadRegion", reads, bulk && !http ? 4 : 0), bulk && !http ? 4 : 0);
    // The same gradient again, into the caller's memory (`into`).
    fwd = client->Forward(args);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    back.session_id = fwd->session_id;
    ASSERT_TRUE(client->Backward(back).ok());
    std::string dw(grads.back().grad_weight.data.size(), '\0'), db(v * 4, '\0');
    auto into = client->TakeWeightGrad(name, 0, DType::kFloat32,
                                       LossClient::TakeInto{dw.data(), db.data()});
    ASSERT_TRUE(into.ok()) << into.status();
    EXPECT_TRUE(into->grad_weight.data.empty());
    EXPECT_EQ(into->grad_weight.shape, grads.back().grad_weight.shape);
    EXPECT_EQ(dw, grads.back().grad_weight.data);
    EXPECT_EQ(db, grads.back().grad_bias->data);
    EXPECT_THAT(client->TakeWeightGrad(name, 0, DType::kFloat32, LossClient::TakeInto{}).status(),
                StatusIs(Code::kInvalidArgument, HasSubstr("into.weight")));
    // That take's reads, counted before the next configuration's baseline.
    EXPECT_EQ(counted("BulkRead", gets, bulk && http ? 8 : 0), bulk && http ? 8 : 0);
    EXPECT_EQ(counted("ReadRegion", reads, bulk && !http ? 8 : 0), bulk && !http ? 8 : 0);
  }
  for (int i : {1, 2}) {
    EXPECT_EQ(grads[0].grad_weight.data, grads[i].grad_weight.data);
    EXPECT_EQ(grads[0].grad_bias->data, grads[i].grad_bias->data);
  }
  // A name instead of an address: resolved, and pinned to the address
  // holding the region (where "localhost" is also ::1, that one refuses).
  // W in 4 ranges (the default connections), b in one.
  {
    ClientOptions options;
    options.bulk_threshold_bytes = 1 << 20;
    auto client = LossClient::Create("localhost:" + std::to_string(server_->port()), options);
    const int64_t puts = count("BulkWrite");
    auto info = client->PutWeight("by_name", w.view(), b.view());
    ASSERT_TRUE(info.ok()) << info.status();
    for (int i = 0; i < 500 && count("BulkWrite") - puts < 5; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_EQ(count("BulkWrite") - puts, 5);
  }
  EXPECT_EQ(server_->CurrentGauges().region_memory_bytes, 0);  // gone with its client
}

}  // namespace
}  // namespace flce
