// hopper_gemm_bench: flce's own Hopper GEMM against cuBLAS on the engine's
// logits GEMM (logits [N, V] = X [N, H] · W [V, H]ᵀ, bf16, fp32
// accumulation) at each shape, and on the 8192³ product (the card's
// ceiling), in alternating rounds in one process (median of each round's
// runs; the best round's median of each, and the ratio of every round).
// flce's GEMM runs with clusters of 1 and of 2 blocks (HopperGemmArgs::cluster).
// Also the relative L2 difference of cuBLAS's output and flce's (the last
// run, cluster 2) over a sample.
//
//   hopper_gemm_bench --shapes=4096x4096x128256,8192x4096x128256 --rounds=3

#include <cstdio>

#ifdef FLCE_WITH_CUDA
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/cublas_floor.h"
#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/hopper_gemm.h"
#include "kernels/dtype.h"
#include "kernels/status_macros.h"

ABSL_FLAG(std::string, shapes, "4096x4096x128256,8192x4096x128256,8192x2304x256000,4096x4096x32000",
          "comma-separated NxHxV: the logits GEMM's M=N, N=V, K=H (bf16)");
ABSL_FLAG(int, rounds, 3, "alternating rounds of cuBLAS and flce's GEMM");
ABSL_FLAG(int, iters, 10, "timed runs per round (median)");
ABSL_FLAG(int, warmup, 5, "untimed runs before each round");
ABSL_FLAG(bool, ceiling, true, "also the 8192x8192x8192 product");

namespace flce {
namespace {

using internal_cuda::CublasHandle;
using internal_cuda::CudaStream;
using internal_cuda::DeviceBuffer;
using internal_cuda::GemmRunner;
using internal_cuda::GemmShape;
using internal_cuda::HopperGemmArgs;

absl::Status CudaStatus(cudaError_t error, const char* what) {
  return BenchHealth().Check(error, what);
}

// Relative L2 difference of two bf16 buffers over their first and last
// `sample` elements.
absl::StatusOr<double> SampledDifference(const DeviceBuffer& x, const DeviceBuffer& y,
                                         int64_t count) {
  const int64_t sample = std::min<int64_t>(count / 2, int64_t{1} << 21);
  std::vector<uint16_t> hx(2 * sample), hy(2 * sample);
  for (int part = 0; part < 2; ++part) {
    const int64_t first = part == 0 ? 0 : count - sample;
    FLCE_RETURN_IF_ERROR(CudaStatus(cudaMemcpy(hx.data() + part * sample, x.as<uint16_t>() + first,
                                               sample * 2, cudaMemcpyDeviceToHost),
                                    "download"));
    FLCE_RETURN_IF_ERROR(CudaStatus(cudaMemcpy(hy.data() + part * sample, y.as<uint16_t>() + first,
                                               sample * 2, cudaMemcpyDeviceToHost),
                                    "download"));
  }
  double diff = 0, norm = 0;
  for (size_t i = 0; i < hx.size(); ++i) {
    const double a = BFloat16ToFloat(hx[i]), b = BFloat16ToFloat(hy[i]);
    diff += (a - b) * (a - b);
    norm += b * b;
  }
  return norm > 0 ? std::sqrt(diff / norm) : 0.0;
}

absl::Status RunShape(int64_t n, int64_t h, int64_t v, int sms) {
  FLCE_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create(BenchHealth()));
  cudaStream_t s = stream.get();
  FLCE_ASSIGN_OR_RETURN(CublasHandle blas, CublasHandle::Create(s, BenchHealth()));
  const DType dtype = DType::kBFloat16;
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer x, DeviceBuffer::Allocate(n * h * 2, s, BenchHealth()));
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer w, DeviceBuffer::Allocate(v * h * 2, s, BenchHealth()));
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer z_cublas, DeviceBuffer::Allocate(n * v * 2, s, BenchHealth()));
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer z_flce, DeviceBuffer::Allocate(n * v * 2, s, BenchHealth()));
  for (const DeviceBuffer* b : {&x, &w}) FLCE_RETURN_IF_ERROR(FillPattern(*b, dtype, s));
  internal_cuda::GemmTuning untuned;
  untuned.enabled = false;
  FLCE_ASSIGN_OR_RETURN(std::unique_ptr<GemmRunner> gemms,
                        GemmRunner::Create(untuned, BenchHealth()));
  auto cublas = [&]() -> absl::Status {
    // Column-major view, as the engine's ChunkLogitsGemm: logitsᵀ (V×N, ld V)
    // = op(A)·op(B), A = W (column-major H×V, ld H) op T, B = X (H×N, ld H) op N.
    const GemmShape shape{CUBLAS_OP_T, CUBLAS_OP_N, v, n, h, dtype, h, dtype, h, dtype, v};
    return gemms->Run(blas.get(), s, shape, w.data(), x.data(), 0.0f, z_cublas.data());
  };
  HopperGemmArgs args;
  args.a = x.data();
  args.lda = h;
  args.b = w.data();
  args.ldb = h;
  args.c = z_flce.data();
  args.ldc = v;
  args.m = n;
  args.n = v;
  args.k = h;
  auto hopper = [&](int cluster) {
    return [&args, cluster, sms, s]() -> absl::Status {
      HopperGemmArgs a = args;
      a.cluster = cluster;
      return CudaStatus(internal_cuda::LaunchHopperGemm(a, sms, s), "hopper gemm");
    };
  };
  const double flop = 2.0 * n * h * v;
  internal_cuda::EventTimer timer(BenchHealth());
  // cuBLAS, then flce's GEMM with clusters of 1 and of 2, in turn.
  std::vector<double> ms[3];
  const int warmup = absl::GetFlag(FLAGS_warmup), iters = absl::GetFlag(FLAGS_iters);
  for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    FLCE_ASSIGN_OR_RETURN(const double c, timer.MedianMs(s, warmup, iters, cublas));
    FLCE_ASSIGN_OR_RETURN(const double one, timer.MedianMs(s, warmup, iters, hopper(1)));
    FLCE_ASSIGN_OR_RETURN(const double two, timer.MedianMs(s, warmup, iters, hopper(2)));
    ms[0].push_back(c);
    ms[1].push_back(one);
    ms[2].push_back(two);
  }
  FLCE_ASSIGN_OR_RETURN(const double difference, SampledDifference(z_flce, z_cublas, n * v));
  double best[3];
  for (int i = 0; i < 3; ++i) best[i] = *std::min_element(ms[i].begin(), ms[i].end());
  std::string rounds;
  for (size_t i = 0; i < ms[2].size(); ++i) {
    rounds += (i ? " " : "") + std::to_string(ms[2][i] / ms[0][i]).substr(0, 5);
  }
  std::printf("%6lldx%-6lldx%-7lld %8.3f %6.1f %8.3f %6.1f %8.3f %6.1f %7.3f  %-20s %.1e\n",
              static_cast<long long>(n), static_cast<long long>(h), static_cast<long long>(v),
              best[0], flop / (best[0] * 1e9), best[1], flop / (best[1] * 1e9), best[2],
              flop / (best[2] * 1e9), best[2] / best[0], rounds.c_str(), difference);
  return absl::OkStatus();
}

int Main() {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  std::printf(
      "logits GEMM [N, V] = X [N, H] · W [V, H]ᵀ, bf16; ms and TFLOP/s of each one's best round;\n"
      "flce's with clusters of 1 and 2 blocks; ratio: cluster 2 over cuBLAS\n");
  std::printf("%-22s %8s %6s %8s %6s %8s %6s %7s  %-20s %s\n", "N x H x V", "cuBLAS", "TF/s",
              "flce c1", "TF/s", "flce c2", "TF/s", "ratio", "ratio per round", "rel. diff");
  std::vector<std::string> shapes = absl::StrSplit(absl::GetFlag(FLAGS_shapes), ',');
  if (absl::GetFlag(FLAGS_ceiling)) shapes.push_back("8192x8192x8192");
  int status = 0;
  for (const std::string& text : shapes) {
    std::vector<std::string> parts = absl::StrSplit(text, 'x');
    int64_t n = 0, h = 0, v = 0;
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &n) || !absl::SimpleAtoi(parts[1], &h) ||
        !absl::SimpleAtoi(parts[2], &v)) {
      std::fprintf(stderr, "bad shape %s\n", text.c_str());
      return 2;
    }
    const absl::Status s = RunShape(n, h, v, sms);
    if (!s.ok()) {
      std::printf("%s: %s\n", text.c_str(), s.ToString().c_str());
      status = 1;
    }
  }
  return status;
}

}  // namespace
}  // namespace flce

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return flce::Main();
}

#else

int main() {
  std::fprintf(stderr, "hopper_gemm_bench: built without CUDA\n");
  return 1;
}

#endif
