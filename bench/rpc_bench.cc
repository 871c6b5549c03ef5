// rpc_bench: Forward + Backward round trips through the gRPC service over
// loopback, for one problem shape, per transport: the weight inline in
// unary messages, the same through the streaming RPCs, and a registered
// weight (only X and t travel). Reports p50/p99 of the round trip, the bytes
// moved per second, and the ratio of round-trip time to the server's own
// engine time.
//
//   rpc_bench --shape=512x1024x32000 --dtype=bf16 --iters=20
//   rpc_bench --server=host:port ...   (an already running server)

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
