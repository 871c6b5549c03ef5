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
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/loss_kernels.h"
#include "kernels/status_macros.h"

ABSL_FLAG(std::string, shapes, "8192x2304x256000", "comma-separated NxHxV (bf16)");
ABSL_FLAG(int64_t, chunk_rows, 2048, "token-chunk rows of the engine's chunk GEMMs");
ABSL_FLAG(int, algos, 24, "heuristic results to request per GEMM");
ABSL_FLAG(int, iters, 7, "timed runs per algorithm (median)");
ABSL_FLAG(bool, full, true, "also the floor's full-size GEMMs");

namespace flce {
namespace {

using internal_cuda::CublasHandle;
using internal_cuda::CublasStatus;
using internal_cuda::CudaStatus;
using internal_cuda::CudaStream;
using internal_cuda::DeviceBuffer;

absl::Status LtStatus(cublasStatus_t status, const char* what) {
  return CublasStatus(status, what);
}

// One column-major GEMM C[m×n] = op(A)·op(B) + beta·C, bf16 operands.
struct GemmSpec {
  std::string name;
  cublasOperation_t op_a, op_b;
  int64_t m, n, k;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  void* c;
  cudaDataType_t c_type;
  int64_t ldc;
  float beta;
};

class Timer {
 public:
  Timer() {
    cudaEventCreate(&start_);
    cudaEventCreate(&stop_);
  }
  ~Timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  // Median ms of `iters` runs of f after two untimed ones.
  template <typename F>
  absl::StatusOr<double> Median(cudaStream_t s, int iters, F&& f) {
    std::vector<float> ms;
    for (int i = 0; i < iters + 2; ++i) {
      cudaEventRecord(start_, s);
      FLCE_RETURN_IF_ERROR(f());
      cudaEventRecord(stop_, s);
      FLCE_RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(stop_), "timing"));
      float t = 0;
      cudaEventElapsedTime(&t, start_, stop_);
      if (i >= 2) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }

 private:
  cudaEvent_t start_, stop_;
};

std::string AlgoConfig(const cublasLtMatmulAlgo_t& algo) {
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr) {
    uint32_t v = 0;  // every attribute read here fits 32 bits
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written);
    return v;
  };
  return absl::StrFormat("id %u tile %u stages %u splitK %u red %u swz %u opt %u cluster %u",
                         get(CUBLASLT_ALGO_CONFIG_ID), get(CUBLASLT_ALGO_CONFIG_TILE_ID),
                         get(CUBLASLT_ALGO_CONFIG_STAGES_ID), get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                         get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                         get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                         get(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
                         get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
}

absl::Status Probe(const GemmSpec& g, cublasHandle_t blas, cublasLtHandle_t lt, cudaStream_t s,
                   void* workspace, size_t workspace_bytes, Timer& timer) {
  const float one = 1.0f;
  const double tflop = 2.0 * g.m * g.n * g.k / 1e12;
  const int64_t c_bytes = g.m * g.n * (g.c_type == CUDA_R_32F ? 4 : 2);
  auto run_default = [&]() {
    return CublasStatus(
        cublasGemmEx(blas, g.op_a, g.op_b, g.m, g.n, g.k, &one, g.a, CUDA_R_16BF, g.lda, g.b,
                     CUDA_R_16BF, g.ldb, &g.beta, g.c, g.c_type, g.ldc, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
  };
  // The default's output from a zeroed C, the reference for bit equality.
  std::vector<char> expected(c_bytes), got(c_bytes);
  auto output_of = [&](auto&& run, std::vector<char>& out) -> absl::Status {
    FLCE_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(g.c, 0, c_bytes, s), "zero C"));
    FLCE_RETURN_IF_ERROR(run());
    return CudaStatus(cudaMemcpyAsync(out.data(), g.c, c_bytes, cudaMemcpyDeviceToHost, s),
                      "read C");
  };
  FLCE_RETURN_IF_ERROR(output_of(run_default, expected));
  FLCE_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(s), "default"));
  FLCE_ASSIGN_OR_RETURN(double default_ms,
                        timer.Median(s, absl::GetFlag(FLAGS_iters), run_default));
  std::printf("%s  m=%ld n=%ld k=%ld C %s beta %g\n", g.name.c_str(), static_cast<long>(g.m),
              static_cast<long>(g.n), static_cast<long>(g.k),
              g.c_type == CUDA_R_32F ? "fp32" : "bf16", g.beta);
  std::printf("  cublasGemmEx default        %8.3f ms %6.1f TF/s\n", default_ms,
              tflop / default_ms * 1e3);

  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  FLCE_RETURN_IF_ERROR(
      LtStatus(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc"));
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.op_a, sizeof(g.op_a));
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.op_b, sizeof(g.op_b));
  const bool ta = g.op_a == CUBLAS_OP_T, tb = g.op_b == CUBLAS_OP_T;
  cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, ta ? g.k : g.m, ta ? g.m : g.k, g.lda);
  cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, tb ? g.n : g.k, tb ? g.k : g.n, g.ldb);
  cublasLtMatrixLayoutCreate(&lc, g.c_type, g.m, g.n, g.ldc);
  cublasLtMatmulPreferenceCreate(&pref);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                       &workspace_bytes, sizeof(workspace_bytes));
  std::vector<cublasLtMatmulHeuristicResult_t> results(absl::GetFlag(FLAGS_algos));
  int found = 0;
  absl::Status status = LtStatus(
      cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, results.size(),
                                     results.data(), &found),
      "heuristic");
  for (int i = 0; i < found && status.ok(); ++i) {
    const cublasLtMatmulAlgo_t& algo = results[i].algo;
    auto run = [&]() {
      return LtStatus(cublasLtMatmul(lt, desc, &one, g.a, la, g.b, lb, &g.beta, g.c, lc, g.c, lc,
                                     &algo, workspace, workspace_bytes, s),
                      "cublasLtMatmul");
    };
    status = output_of(run, got);
    if (!status.ok()) break;
    status = CudaStatus(cudaStreamSynchronize(s), "algo");
    if (!status.ok()) break;
    const bool same = std::memcmp(expected.data(), got.data(), c_bytes) == 0;
    absl::StatusOr<double> ms = timer.Median(s, absl::GetFlag(FLAGS_iters), run);
    if (!ms.ok()) {
      status = ms.status();
      break;
    }
    std::printf("  #%-2d %-58s ws %6.1f MiB %8.3f ms %6.1f TF/s %5.3fx %s\n", i,
                AlgoConfig(algo).c_str(), results[i].workspaceSize / 1048576.0, *ms,
                tflop / *ms * 1e3, *ms / default_ms, same ? "bit-equal" : "differs");
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(desc);
  std::fflush(stdout);
  return status;
}

absl::Status Run() {
  FLCE_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  cudaStream_t s = stream.get();
  FLCE_ASSIGN_OR_RETURN(CublasHandle blas, CublasHandle::Create(s));
  cublasLtHandle_t lt = nullptr;
  FLCE_RETURN_IF_ERROR(LtStatus(cublasLtCreate(&lt), "cublasLtCreate"));
  const size_t workspace_bytes = size_t{64} << 20;
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer workspace, DeviceBuffer::Allocate(workspace_bytes, s));
  Timer timer;
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
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer x, DeviceBuffer::Allocate(n * h * 2, s));
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer w, DeviceBuffer::Allocate(v * h * 2, s));
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer z, DeviceBuffer::Allocate(z_rows * v * 2, s));
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer dx, DeviceBuffer::Allocate(n * h * 4, s));
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer dw, DeviceBuffer::Allocate(v * h * 4, s));
    {
      std::vector<float> pattern(1 << 20);
      for (size_t i = 0; i < pattern.size(); ++i) {
        pattern[i] = static_cast<float>((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
      }
      FLCE_ASSIGN_OR_RETURN(DeviceBuffer p, DeviceBuffer::Allocate(pattern.size() * 4, s));
      FLCE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(p.data(), pattern.data(),
                                                      pattern.size() * 4,
                                                      cudaMemcpyHostToDevice, s),
                                      "upload"));
      for (DeviceBuffer* b : {&x, &w, &z}) {
        const int64_t count = b->bytes() / 2;
        for (int64_t first = 0; first < count; first += static_cast<int64_t>(pattern.size())) {
          const int64_t m = std::min<int64_t>(pattern.size(), count - first);
          FLCE_RETURN_IF_ERROR(CudaStatus(
              internal_cuda::LaunchConvert(p.data(), DType::kFloat32, b->as<char>() + first * 2,
                                           DType::kBFloat16, m, 0.05f, s),
              "fill"));
        }
      }
    }
    std::printf("shape %ldx%ldx%ld, chunk rows %ld\n", static_cast<long>(n),
                static_cast<long>(h), static_cast<long>(v), static_cast<long>(r));
    // The engine's chunk GEMMs (cuda_engine.cc RunChunks).
    std::vector<GemmSpec> specs = {
        {"chunk logits", CUBLAS_OP_T, CUBLAS_OP_N, v, r, h, w.data(), h, x.data(), h, z.data(),
         CUDA_R_16BF, v, 0.0f},
        {"chunk dX", CUBLAS_OP_N, CUBLAS_OP_N, h, r, v, w.data(), h, z.data(), v, dx.data(),
         CUDA_R_32F, h, 0.0f},
        {"chunk dW beta 0", CUBLAS_OP_N, CUBLAS_OP_T, h, v, r, x.data(), h, z.data(), v,
         dw.data(), CUDA_R_32F, h, 0.0f},
        {"chunk dW beta 1", CUBLAS_OP_N, CUBLAS_OP_T, h, v, r, x.data(), h, z.data(), v,
         dw.data(), CUDA_R_32F, h, 1.0f},
    };
    if (full) {
      // The floor's (cublas_floor.cc), outputs in bf16.
      specs.push_back({"full logits", CUBLAS_OP_T, CUBLAS_OP_N, v, n, h, w.data(), h, x.data(),
                       h, z.data(), CUDA_R_16BF, v, 0.0f});
      specs.push_back({"full dX", CUBLAS_OP_N, CUBLAS_OP_N, h, n, v, w.data(), h, z.data(), v,
                       dx.data(), CUDA_R_16BF, h, 0.0f});
      specs.push_back({"full dW", CUBLAS_OP_N, CUBLAS_OP_T, h, v, n, x.data(), h, z.data(), v,
                       dw.data(), CUDA_R_16BF, h, 0.0f});
    }
    // Warm the card to its steady clock before the first timing.
    const float one = 1.0f, zero = 0.0f;
    for (int i = 0; i < 40; ++i) {
      FLCE_RETURN_IF_ERROR(CublasStatus(
          cublasGemmEx(blas.get(), CUBLAS_OP_T, CUBLAS_OP_N, v, r, h, &one, w.data(),
                       CUDA_R_16BF, h, x.data(), CUDA_R_16BF, h, &zero, z.data(), CUDA_R_16BF, v,
                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "warm-up"));
    }
    for (const GemmSpec& g : specs) {
      status = Probe(g, blas.get(), lt, s, workspace.data(), workspace_bytes, timer);
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
