// gemm_algos: times every cuBLASLt algorithm the heuristic offers for each
// GEMM the CUDA engine runs at a shape (a token chunk's logits, dX and dW
// into the fp32 accumulator; the full-size GEMMs of the floor), next to
// cublasGemmEx's default choice, and says whether each algorithm's output is
// bit-identical to the default's. It answers one question: would choosing
// algorithms ourselves make the engine's GEMMs faster, and at what cost in
// reproducibility.
//
//   gemm_algos --shapes=8192x2304x256000 --chunk_rows=2048 --algos=24

#include <cstdio>

#ifdef FLCE_WITH_CUDA
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/cublas_floor.h"
#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/device_health.h"
#include "kernels/cuda/gemm.h"
#include "kernels/status_macros.h"

ABSL_FLAG(std::string, shapes, "8192x2304x256000", "comma-separated NxHxV (bf16)");
ABSL_FLAG(int64_t, chunk_rows, 2048, "token-chunk rows of the engine's chunk GEMMs");
ABSL_FLAG(int, algos, 24, "heuristic results to request per GEMM");
ABSL_FLAG(int, iters, 7, "timed runs per algorithm (median)");
ABSL_FLAG(bool, full, true, "also the floor's full-size GEMMs");

namespace flce {
namespace {

using internal_cuda::CublasHandle;
using internal_cuda::CudaStream;
using internal_cuda::DeviceBuffer;
using internal_cuda::EventTimer;
using internal_cuda::GemmRunner;
using internal_cuda::GemmShape;
using internal_cuda::GemmTuning;
using internal_cuda::LtGemm;

absl::Status CudaStatus(cudaError_t error, const char* what) {
  return BenchHealth().Check(error, what);
}
absl::Status CublasStatus(cublasStatus_t status, const char* what) {
  return BenchHealth().Check(status, what);
}

// One of the engine's GEMMs, C = op(A)·op(B) + beta·C, bf16 operands.
struct Probed {
  std::string name;
  GemmShape shape;
  const void* a;
  const void* b;
  void* c;
  float beta;
};

std::string AlgoConfig(const cublasLtMatmulAlgo_t& algo) {
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr) {
    uint32_t v = 0;  // every attribute read here fits 32 bits
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written);
    return v;
  };
  return absl::StrFormat(
      "id %u tile %u stages %u splitK %u red %u swz %u opt %u cluster %u",
      get(CUBLASLT_ALGO_CONFIG_ID), get(CUBLASLT_ALGO_CONFIG_TILE_ID),
      get(CUBLASLT_ALGO_CONFIG_STAGES_ID), get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
      get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME), get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
      get(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION), get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
}

absl::Status Probe(const Probed& p, cublasHandle_t blas, GemmRunner& defaults, cublasLtHandle_t lt,
                   cudaStream_t s, void* workspace, size_t workspace_bytes, EventTimer& timer) {
  const GemmShape& g = p.shape;
  const double tflop = 2.0 * g.m * g.n * g.k / 1e12;
  const int64_t c_bytes = g.m * g.n * DTypeSize(g.c_type);
  const int iters = absl::GetFlag(FLAGS_iters);
  auto run_default = [&] { return defaults.Run(blas, s, g, p.a, p.b, p.beta, p.c); };
  // The default's output from a zeroed C, the reference for bit equality.
  std::vector<char> expected(c_bytes), got(c_bytes);
  auto output_of = [&](auto&& run, std::vector<char>& out) -> absl::Status {
    FLCE_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(p.c, 0, c_bytes, s), "zero C"));
    FLCE_RETURN_IF_ERROR(run());
    FLCE_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(out.data(), p.c, c_bytes, cudaMemcpyDeviceToHost, s), "read C"));
    return CudaStatus(cudaStreamSynchronize(s), "read C");
  };
  FLCE_RETURN_IF_ERROR(output_of(run_default, expected));
  FLCE_ASSIGN_OR_RETURN(const double default_ms, timer.MedianMs(s, 2, iters, run_default));
  std::printf("%s  m=%ld n=%ld k=%ld C %s beta %g\n", p.name.c_str(), static_cast<long>(g.m),
              static_cast<long>(g.n), static_cast<long>(g.k), DTypeName(g.c_type), p.beta);
  std::printf("  cublasGemmEx default        %8.3f ms %6.1f TF/s\n", default_ms,
              tflop / default_ms * 1e3);

  FLCE_ASSIGN_OR_RETURN(std::unique_ptr<LtGemm> gemm, LtGemm::Create(g, BenchHealth()));
  const std::vector<cublasLtMatmulHeuristicResult_t> results =
      gemm->Candidates(lt, absl::GetFlag(FLAGS_algos), workspace_bytes);
  for (size_t i = 0; i < results.size(); ++i) {
    const cublasLtMatmulAlgo_t& algo = results[i].algo;
    auto run = [&] {
      return gemm->Run(lt, s, algo, p.a, p.b, p.beta, p.c, workspace, workspace_bytes);
    };
    FLCE_RETURN_IF_ERROR(output_of(run, got));
    const bool same = std::memcmp(expected.data(), got.data(), c_bytes) == 0;
    FLCE_ASSIGN_OR_RETURN(const double ms, timer.MedianMs(s, 2, iters, run));
    std::printf("  #%-2zu %-58s ws %6.1f MiB %8.3f ms %6.1f TF/s %5.3fx %s\n", i,
                AlgoConfig(algo).c_str(), results[i].workspaceSize / 1048576.0, ms,
                tflop / ms * 1e3, ms / default_ms, same ? "bit-equal" : "differs");
  }
  std::fflush(stdout);
  return absl::OkStatus();
}

absl::Status Run() {
  FLCE_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create(BenchHealth()));
  cudaStream_t s = stream.get();
  FLCE_ASSIGN_OR_RETURN(CublasHandle blas, CublasHandle::Create(s, BenchHealth()));
  cublasLtHandle_t lt = nullptr;
  FLCE_RETURN_IF_ERROR(CublasStatus(cublasLtCreate(&lt), "cublasLtCreate"));
  GemmTuning untuned;
  untuned.enabled = false;
  FLCE_ASSIGN_OR_RETURN(std::unique_ptr<GemmRunner> defaults,
                        GemmRunner::Create(untuned, BenchHealth()));
  const size_t workspace_bytes = size_t{64} << 20;
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer workspace,
                        DeviceBuffer::Allocate(workspace_bytes, s, BenchHealth()));
  EventTimer timer(BenchHealth());
  absl::Status status;
  const std::vector<std::string> shapes = absl::StrSplit(absl::GetFlag(FLAGS_shapes), ',');
  for (const std::string& text : shapes) {
    std::vector<std::string> parts = absl::StrSplit(text, 'x');
    int64_t n = 0, h = 0, v = 0;
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &n) || !absl::SimpleAtoi(parts[1], &h) ||
        !absl::SimpleAtoi(parts[2], &v)) {
      return absl::InvalidArgumentError("--shapes: NxHxV");
    }
    const int64_t r = std::min(n, absl::GetFlag(FLAGS_chunk_rows));
    const bool full = absl::GetFlag(FLAGS_full);
    const int64_t z_rows = full ? n : r;
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer x, DeviceBuffer::Allocate(n * h * 2, s, BenchHealth()));
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer w, DeviceBuffer::Allocate(v * h * 2, s, BenchHealth()));
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer z, DeviceBuffer::Allocate(z_rows * v * 2, s, BenchHealth()));
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer dx, DeviceBuffer::Allocate(n * h * 4, s, BenchHealth()));
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer dw, DeviceBuffer::Allocate(v * h * 4, s, BenchHealth()));
    for (const DeviceBuffer* b : {&x, &w, &z}) {
      FLCE_RETURN_IF_ERROR(FillPattern(*b, DType::kBFloat16, s));
    }
    std::printf("shape %ldx%ldx%ld, chunk rows %ld\n", static_cast<long>(n), static_cast<long>(h),
                static_cast<long>(v), static_cast<long>(r));
    // The engine's chunk GEMMs (cuda_engine.cc RunChunks).
    constexpr DType bf16 = DType::kBFloat16, fp32 = DType::kFloat32;
    std::vector<Probed> probes = {
        {"chunk logits",
         {CUBLAS_OP_T, CUBLAS_OP_N, v, r, h, bf16, h, bf16, h, bf16, v},
         w.data(),
         x.data(),
         z.data(),
         0.0f},
        {"chunk dX",
         {CUBLAS_OP_N, CUBLAS_OP_N, h, r, v, bf16, h, bf16, v, fp32, h},
         w.data(),
         z.data(),
         dx.data(),
         0.0f},
        {"chunk dW beta 0",
         {CUBLAS_OP_N, CUBLAS_OP_T, h, v, r, bf16, h, bf16, v, fp32, h},
         x.data(),
         z.data(),
         dw.data(),
         0.0f},
        {"chunk dW beta 1",
         {CUBLAS_OP_N, CUBLAS_OP_T, h, v, r, bf16, h, bf16, v, fp32, h},
         x.data(),
         z.data(),
         dw.data(),
         1.0f},
    };
    if (full) {
      // The floor's (cublas_floor.cc), outputs in bf16.
      probes.push_back({"full logits",
                        {CUBLAS_OP_T, CUBLAS_OP_N, v, n, h, bf16, h, bf16, h, bf16, v},
                        w.data(),
                        x.data(),
                        z.data(),
                        0.0f});
      probes.push_back({"full dX",
                        {CUBLAS_OP_N, CUBLAS_OP_N, h, n, v, bf16, h, bf16, v, bf16, h},
                        w.data(),
                        z.data(),
                        dx.data(),
                        0.0f});
      probes.push_back({"full dW",
                        {CUBLAS_OP_N, CUBLAS_OP_T, h, v, n, bf16, h, bf16, v, bf16, h},
                        x.data(),
                        z.data(),
                        dw.data(),
                        0.0f});
    }
    // Warm the card to its steady clock before the first timing.
    const float one = 1.0f, zero = 0.0f;
    for (int i = 0; i < 40; ++i) {
      FLCE_RETURN_IF_ERROR(
          CublasStatus(cublasGemmEx(blas.get(), CUBLAS_OP_T, CUBLAS_OP_N, v, r, h, &one, w.data(),
                                    CUDA_R_16BF, h, x.data(), CUDA_R_16BF, h, &zero, z.data(),
                                    CUDA_R_16BF, v, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                       "warm-up"));
    }
    for (const Probed& p : probes) {
      status = Probe(p, blas.get(), *defaults, lt, s, workspace.data(), workspace_bytes, timer);
      if (!status.ok()) break;
    }
    if (!status.ok()) break;
  }
  cublasLtDestroy(lt);
  return status;
}

}  // namespace
}  // namespace flce

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::Status status = flce::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "gemm_algos: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

#else  // FLCE_WITH_CUDA

int main() {
  std::fprintf(stderr, "gemm_algos: built without the CUDA toolkit\n");
  return 1;
}

#endif  // FLCE_WITH_CUDA
