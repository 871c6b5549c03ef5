// rpc_bench: Forward + Backward round trips through the gRPC service over
// loopback, for one problem shape, per transport: the weight inline in
// unary messages, the same through the streaming RPCs, and a registered
// weight (only X and t travel). Reports p50/p99 of the round trip, the bytes
// moved per second, and the ratio of round-trip time to the server's own
// engine time.
//
//   rpc_bench --shape=512x1024x32000 --dtype=bf16 --iters=20
//   rpc_bench --server=host:port ...   (an already running server)
//
// With --transfer_mib (a list), instead: a weight of each size (fp32) put
// (PutWeight) and its gradient taken (TakeWeightGrad, after one
// accumulating Backward), over one stream and over 1, 2, 4 and 8 bulk
// connections (--connections) of each transport (--transports: the
// server's bulk HTTP port, gRPC streams): the median time and GB/s each way,
// and the first call on each new version between them (a one-row Forward +
// Backward: W to the engine's device, the gradient sums made), which a
// training loop's optimizer step pays as well.

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/loss_client.h"
#include "kernels/reference/random_problem.h"
#include "server/loss_server.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, server, "", "host:port of a running server (default: start one here)");
ABSL_FLAG(std::string, backend, "auto", "backend of the server started here");
ABSL_FLAG(std::string, shape, "512x1024x32000", "NxHxV");
ABSL_FLAG(std::string, dtype, "bf16", "bf16, fp16 or fp32");
ABSL_FLAG(int, warmup, 2, "untimed round trips first");
ABSL_FLAG(int, iters, 20, "timed round trips");
ABSL_FLAG(std::string, transfer_mib, "",
          "weight sizes in MiB (e.g. 64,1024): time PutWeight and TakeWeightGrad instead");
ABSL_FLAG(std::string, connections, "0,1,2,4,8",
          "bulk connections to time with --transfer_mib (0: one stream, no region)");
ABSL_FLAG(std::string, transports, "http,grpc",
          "bulk transports to time with --transfer_mib: http (the bulk port), grpc (streams)");

namespace flce {
namespace {

struct Sample {
  double rpc_ms = 0;     // Forward + Backward, client side
  double engine_ms = 0;  // Forward + Backward, server engine time
};

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

// PutWeight and TakeWeightGrad of fp32 weights of the given sizes, over one
// stream and over bulk connections.
int Transfers(const std::string& address) {
  std::printf("%-10s %-10s %-12s %12s %10s %14s %12s %10s\n", "weight", "transport", "connections",
              "put ms", "GB/s", "first call ms", "take ms", "GB/s");
  const std::vector<std::string> transports = absl::StrSplit(absl::GetFlag(FLAGS_transports), ',');
  for (absl::string_view mib_text : absl::StrSplit(absl::GetFlag(FLAGS_transfer_mib), ',')) {
    int64_t mib = 0;
    if (!absl::SimpleAtoi(mib_text, &mib) || mib < 1) {
      std::fprintf(stderr, "--transfer_mib: sizes in MiB\n");
      return 2;
    }
    const int64_t h = 1024, v = mib * 256;  // v * h * 4 bytes = mib MiB
    HostTensor w(DType::kFloat32, {v, h});
    for (int64_t i = 0; i < v * h; ++i) w.mutable_data<float>()[i] = 1e-3f * static_cast<float>(i % 977);
    HostTensor x(DType::kFloat32, {1, h}), t(DType::kInt64, {1});
    for (int64_t i = 0; i < h; ++i) x.mutable_data<float>()[i] = 0.01f * static_cast<float>(i % 13);
    t.mutable_data<int64_t>()[0] = 3;
    const double bytes = static_cast<double>(v * h * 4);
    std::vector<std::pair<std::string, int>> runs;
    for (const std::string& transport : transports) {
      for (absl::string_view c_text : absl::StrSplit(absl::GetFlag(FLAGS_connections), ',')) {
        int connections = 0;
        if (!absl::SimpleAtoi(c_text, &connections)) return 2;
        if (connections > 0 || transport == transports.front()) {
          runs.push_back({connections > 0 ? transport : "one stream", connections});
        }
      }
    }
    for (const auto& [transport, connections] : runs) {
      ClientOptions options;
      options.max_message_bytes = int64_t{64} << 20;
      options.bulk_connections = connections;
      options.bulk_threshold_bytes = 1;
      options.bulk_http = transport == "http";
      auto client = LossClient::Create(address, options);
      const std::string name = absl::StrCat("transfer_", mib, "_", connections > 0 ? transport : "one", connections);
      std::vector<double> put_ms, first_ms, take_ms;
      std::string grad_memory(w.data.size(), '\0');
      for (int i = 0; i < 1 + absl::GetFlag(FLAGS_iters); ++i) {
        const absl::Time start = absl::Now();
        auto info = client->PutWeight(name, w.view(), std::nullopt);
        const double put = absl::ToDoubleMilliseconds(absl::Now() - start);
        if (!info.ok()) {
          std::fprintf(stderr, "PutWeight: %s\n", info.status().ToString().c_str());
          return 1;
        }
        const absl::Time first_start = absl::Now();
        ForwardArgs args;
        args.problem.hidden = x.view();
        args.problem.target = t.view();
        args.weight_name = name;
        args.need_backward = true;
        auto fwd = client->Forward(args);
        if (!fwd.ok()) return 1;
        BackwardArgs b;
        b.session_id = fwd->session_id;
        b.accumulate_weight_grad = true;
        if (!client->Backward(b).ok()) return 1;
        const double first = absl::ToDoubleMilliseconds(absl::Now() - first_start);
        // Into memory kept from take to take (a training loop's .grad).
        const absl::Time take_start = absl::Now();
        auto grad = client->TakeWeightGrad(name, 0, DType::kFloat32,
                                           LossClient::TakeInto{&grad_memory[0], nullptr});
        const double take = absl::ToDoubleMilliseconds(absl::Now() - take_start);
        if (!grad.ok()) {
          std::fprintf(stderr, "TakeWeightGrad: %s\n", grad.status().ToString().c_str());
          return 1;
        }
        if (i == 0) continue;  // the first makes the region and touches its pages
        put_ms.push_back(put);
        first_ms.push_back(first);
        take_ms.push_back(take);
      }
      (void)client->DeleteWeight(name);
      const double put = Median(put_ms), take = Median(take_ms);
      std::printf("%-10s %-10s %-12d %12.1f %10.2f %14.1f %12.1f %10.2f\n",
                  absl::StrCat(mib, " MiB").c_str(), transport.c_str(), connections, put,
                  bytes / (put * 1e6), Median(first_ms), take, bytes / (take * 1e6));
    }
  }
  return 0;
}

int Main() {
  std::vector<std::string> parts = absl::StrSplit(absl::GetFlag(FLAGS_shape), 'x');
  int64_t n = 0, h = 0, v = 0;
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &n) || !absl::SimpleAtoi(parts[1], &h) ||
      !absl::SimpleAtoi(parts[2], &v)) {
    std::fprintf(stderr, "--shape: expected NxHxV\n");
    return 2;
  }
  const std::string dtype_name = absl::GetFlag(FLAGS_dtype);
  RandomProblemSpec spec;
  spec.rows = n;
  spec.hidden = h;
  spec.vocab = v;
  spec.dtype = dtype_name == "fp32"   ? DType::kFloat32
               : dtype_name == "fp16" ? DType::kFloat16
                                      : DType::kBFloat16;
  spec.fast_fill = true;
  const OwnedProblem p = MakeRandomProblem(spec);

  std::unique_ptr<LossServer> local;
  std::string address = absl::GetFlag(FLAGS_server);
  if (address.empty()) {
    ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.security.insecure = true;
    options.backend = absl::GetFlag(FLAGS_backend);
    options.max_message_bytes = int64_t{1} << 30;
    options.enable_shared_memory = true;
    auto server = LossServer::Start(options);
    if (!server.ok()) {
      std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
      return 1;
    }
    local = std::move(*server);
    address = "127.0.0.1:" + std::to_string(local->port());
  }
  if (!absl::GetFlag(FLAGS_transfer_mib).empty()) return Transfers(address);
  ClientOptions unary_options;
  unary_options.max_message_bytes = int64_t{1} << 30;
  unary_options.stream_above_bytes = int64_t{1} << 40;  // never stream
  ClientOptions stream_options = unary_options;
  stream_options.stream_above_bytes = 0;  // always stream
  auto unary = LossClient::Create(address, unary_options);
  auto streaming = LossClient::Create(address, stream_options);
  auto info = unary->GetServerInfo();
  if (!info.ok()) {
    std::fprintf(stderr, "%s\n", info.status().ToString().c_str());
    return 1;
  }
  if (!unary->PutWeight("rpc_bench", p.weight.view(), std::nullopt).ok()) return 1;
  // Room for X, W, t in and dX, dW out (64-byte aligned), if the server
  // takes shared memory.
  absl::StatusOr<std::unique_ptr<SharedMemoryArena>> arena = unary->CreateSharedMemory(
      2 * (n * h + v * h) * DTypeSize(spec.dtype) + n * 8 + 1024);

  const int64_t elem = DTypeSize(spec.dtype);
  const int64_t x_bytes = n * h * elem, w_bytes = v * h * elem, t_bytes = n * 8;
  std::printf("server %s backend %s; %lldx%lldx%lld %s; X %.1f MiB, W %.1f MiB\n",
              address.c_str(), info->backend().c_str(), static_cast<long long>(n),
              static_cast<long long>(h), static_cast<long long>(v), dtype_name.c_str(),
              x_bytes / 1048576.0, w_bytes / 1048576.0);
  std::printf("%-22s %9s %9s %10s %9s %9s\n", "transport", "p50 ms", "p99 ms", "MB moved",
              "GB/s", "rpc/eng");
  struct Transport {
    const char* name;
    LossClient* client;
    bool registered;
    SharedMemoryArena* shm;
  };
  SharedMemoryArena* shm = arena.ok() ? arena->get() : nullptr;
  for (const Transport& t :
       {Transport{"unary, W inline", unary.get(), false, nullptr},
        Transport{"streaming, W inline", streaming.get(), false, nullptr},
        Transport{"unary, W registered", unary.get(), true, nullptr},
        Transport{"shared memory, W inline", unary.get(), false, shm}}) {
    if (std::string(t.name).rfind("shared", 0) == 0 && t.shm == nullptr) {
      std::printf("%-22s   (not available: %s)\n", t.name,
                  std::string(arena.status().message()).c_str());
      continue;
    }
    if (t.client == unary.get() && !t.registered &&
        x_bytes + w_bytes + t_bytes > unary_options.max_message_bytes) {
      std::printf("%-22s   (the request is over the %lld-byte unary limit: streaming only)\n",
                  t.name, static_cast<long long>(unary_options.max_message_bytes));
      continue;
    }
    std::vector<Sample> samples;
    for (int i = 0; i < absl::GetFlag(FLAGS_warmup) + absl::GetFlag(FLAGS_iters); ++i) {
      ForwardArgs args;
      args.problem = p.view();
      args.need_backward = true;
      args.mode = BackwardMode::kStoreGrads;
      if (t.registered) args.weight_name = "rpc_bench";
      args.shm = t.shm;
      const absl::Time start = absl::Now();
      auto fwd = t.client->Forward(args);
      if (!fwd.ok()) {
        std::fprintf(stderr, "%s\n", fwd.status().ToString().c_str());
        return 1;
      }
      BackwardArgs b;
      b.session_id = fwd->session_id;
      b.accumulate_weight_grad = t.registered;  // dW stays on the server
      b.shm = t.shm;
      auto grads = t.client->Backward(b);
      if (!grads.ok()) {
        std::fprintf(stderr, "%s\n", grads.status().ToString().c_str());
        return 1;
      }
      if (i < absl::GetFlag(FLAGS_warmup)) continue;
      samples.push_back({absl::ToDoubleMilliseconds(absl::Now() - start),
                         fwd->times.engine_ms + grads->times.engine_ms});
    }
    if (t.registered) (void)unary->TakeWeightGrad("rpc_bench");
    std::vector<double> rpc, ratio;
    for (const Sample& s : samples) {
      rpc.push_back(s.rpc_ms);
      ratio.push_back(s.rpc_ms / std::max(s.engine_ms, 1e-3));
    }
    // Request X, t (and W) in; dX (and dW) out (through the socket or the
    // shared region).
    const double moved = t.registered ? 2.0 * x_bytes + t_bytes
                                      : 2.0 * x_bytes + t_bytes + 2.0 * w_bytes;
    const double p50 = Percentile(rpc, 0.5);
    std::printf("%-22s %9.1f %9.1f %10.1f %9.2f %9.2f\n", t.name, p50, Percentile(rpc, 0.99),
                moved / 1e6, moved / (p50 * 1e6), Percentile(ratio, 0.5));
  }
  return 0;
}

}  // namespace
}  // namespace flce

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  spdlog::set_level(spdlog::level::warn);  // the table, not one line per RPC
  return flce::Main();
}
