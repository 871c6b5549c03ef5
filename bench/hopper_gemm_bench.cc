// hopper_gemm_bench: flce's own Hopper GEMM against cuBLAS on the engine's
// three GEMMs of a token chunk of N rows (bf16, fp32 accumulation), each
// called as the engine calls cuBLAS for it:
//   logits [N, V] (bf16) = X [N, H] · W [V, H]ᵀ
//   dx     [N, H] (fp32) = G [N, V] · W [V, H]
//   dw     [V, H] (fp32) += G [N, V]ᵀ · X [N, H]   (a later chunk's sum)
//   dx_fused [N, H] (fp32) = G · W with G formed from the logits Z [N, V]
//          as they are read (LogitGradient): flce's one GEMM against the
//          engine's gradient rows (Z read, G written) and cuBLAS's dx
//   dw_last [V, H] (bf16) = dw (fp32) + G [N, V]ᵀ · X [N, H]   (the last
//          chunk's: cuBLAS adds into the fp32 sum and the engine's narrowing
//          kernel rounds it; flce rounds its sum once on the way out)
// and on the 8192³ product (the card's ceiling), in alternating rounds in
// one process (median of each round's runs; the median round of each, the
// median of the rounds' ratios, and the ratio of every round). flce's GEMM
// runs with clusters of 1 and of 2 blocks (HopperGemmArgs::cluster), and
// the same in ping-pong (HopperGemmArgs::ping_pong, --ping_pong). Also
// the relative L2 difference of cuBLAS's output and flce's (cluster 2, one
// run each from the same start) over a sample.
//
//   hopper_gemm_bench --shapes=4096x4096x128256,8192x4096x128256 --gemms=logits,dx,dw --rounds=3

#include <cstdio>

#ifdef FLCE_WITH_CUDA
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/cublas_floor.h"
#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/hopper_gemm.h"
#include "kernels/cuda/row_kernels.h"
#include "kernels/dtype.h"
#include "kernels/status_macros.h"

ABSL_FLAG(std::string, shapes, "4096x4096x128256,8192x4096x128256,8192x2304x256000,4096x4096x32000",
          "comma-separated NxHxV (bf16)");
ABSL_FLAG(std::string, gemms, "logits",
          "comma-separated: logits, dx, dx_fused, dw, dw_last (see the file's comment)");
ABSL_FLAG(int, rounds, 3, "alternating rounds of cuBLAS and flce's GEMM");
ABSL_FLAG(int, iters, 10, "timed runs per round (median)");
ABSL_FLAG(int, warmup, 5, "untimed runs before each round");
ABSL_FLAG(bool, ceiling, true, "also the 8192x8192x8192 product");
ABSL_FLAG(bool, ping_pong, true,
          "also flce's GEMM with the ping-pong schedule (HopperGemmArgs::ping_pong), clusters of "
          "1 and 2, in the same rounds (not for dx_fused)");

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

// Relative L2 difference of two buffers of `count` values in `dtype` over
// their first and last `sample` values.
absl::StatusOr<double> SampledDifference(const DeviceBuffer& x, const DeviceBuffer& y,
                                         int64_t count, DType dtype) {
  const int64_t sample = std::min<int64_t>(count / 2, int64_t{1} << 21);
  const size_t size = DTypeSize(dtype);
  std::vector<char> hx(2 * sample * size), hy(2 * sample * size);
  for (int part = 0; part < 2; ++part) {
    const int64_t first = part == 0 ? 0 : count - sample;
    for (auto [to, from] : {std::pair{&hx, &x}, std::pair{&hy, &y}}) {
      FLCE_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpy(to->data() + part * sample * size,
                     static_cast<const char*>(from->data()) + first * size, sample * size,
                     cudaMemcpyDeviceToHost),
          "download"));
    }
  }
  std::vector<float> fx(2 * sample), fy(2 * sample);
  ToFloat(dtype, hx.data(), 2 * sample, fx.data());
  ToFloat(dtype, hy.data(), 2 * sample, fy.data());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < fx.size(); ++i) {
    diff += (double{fx[i]} - fy[i]) * (double{fx[i]} - fy[i]);
    norm += double{fy[i]} * fy[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : 0.0;
}

// One of the engine's GEMMs on both sides: cuBLAS as the engine calls it
// (loss_gemms.cc's mapping) and flce's arguments for the same product.
struct GemmCase {
  GemmShape shape;  // cuBLAS's column-major view
  const void* a;
  const void* b;
  float beta;
  HopperGemmArgs args;  // flce's (c, and for dw the source, set by the caller)
  int64_t outputs;      // elements of C
  DType out_type;
};

absl::Status RunGemm(const std::string& gemm, int64_t n, int64_t h, int64_t v, int sms) {
  FLCE_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create(BenchHealth()));
  cudaStream_t s = stream.get();
  FLCE_ASSIGN_OR_RETURN(CublasHandle blas, CublasHandle::Create(s, BenchHealth()));
  const DType dtype = DType::kBFloat16;
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer x, DeviceBuffer::Allocate(n * h * 2, s, BenchHealth()));
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer w, DeviceBuffer::Allocate(v * h * 2, s, BenchHealth()));
  FLCE_RETURN_IF_ERROR(FillPattern(x, dtype, s));
  FLCE_RETURN_IF_ERROR(FillPattern(w, dtype, s));
  DeviceBuffer g;  // the chunk's gradient [N, V], for dx and dw
  if (gemm != "logits") {
    FLCE_ASSIGN_OR_RETURN(g, DeviceBuffer::Allocate(n * v * 2, s, BenchHealth()));
    FLCE_RETURN_IF_ERROR(FillPattern(g, dtype, s));
  }
  GemmCase c;
  if (gemm == "logits") {
    // logitsᵀ (V×N, ld V) = op(W) op(X): W column-major H×V op T, X H×N op N.
    c = {{CUBLAS_OP_T, CUBLAS_OP_N, v, n, h, dtype, h, dtype, h, dtype, v}, w.data(), x.data(), 0,
         {}, n * v, dtype};
  } else if (gemm == "dx" || gemm == "dx_fused") {
    // dXᵀ (H×N, ld H) = W (H×V, ld H) · G (V×N, ld V), as ChunkDxGemm.
    c = {{CUBLAS_OP_N, CUBLAS_OP_N, h, n, v, dtype, h, dtype, v, DType::kFloat32, h}, w.data(),
         g.data(), 0, {}, n * h, DType::kFloat32};
  } else if (gemm == "dw" || gemm == "dw_last") {
    // dWᵀ (H×V, ld H) += X (H×N, ld H) · Gᵀ (G: V×N, ld V, op T), as
    // ChunkDwGemm on a later chunk.
    c = {{CUBLAS_OP_N, CUBLAS_OP_T, h, v, n, dtype, h, dtype, v, DType::kFloat32, h}, x.data(),
         g.data(), 1, {}, v * h, gemm == "dw" ? DType::kFloat32 : dtype};
  } else {
    return absl::InvalidArgumentError("--gemms: unknown GEMM " + gemm);
  }
  // flce's operands for the same product, as the engine maps them (C, and
  // for dw the source, set below).
  c.args = *internal_cuda::HopperArgsFor(c.shape, c.a, c.b, 0.0f, nullptr, 1.0f);
  HopperGemmArgs& args = c.args;
  args.out_type = c.out_type;
  if (gemm == "dw" || gemm == "dw_last") args.ld_source = h;
  const int64_t out_bytes = c.outputs * DTypeSize(c.out_type);
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer out_cublas, DeviceBuffer::Allocate(out_bytes, s, BenchHealth()));
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer out_flce, DeviceBuffer::Allocate(out_bytes, s, BenchHealth()));
  args.c = out_flce.data();
  if (gemm == "dw") args.source = out_flce.as<float>();  // added in place
  // dw_last: the fp32 sums (cuBLAS adds into its own; flce's stays as it was).
  const bool narrow = gemm == "dw_last";
  DeviceBuffer sum_cublas, sum_flce;
  if (narrow) {
    FLCE_ASSIGN_OR_RETURN(sum_cublas, DeviceBuffer::Allocate(v * h * 4, s, BenchHealth()));
    FLCE_ASSIGN_OR_RETURN(sum_flce, DeviceBuffer::Allocate(v * h * 4, s, BenchHealth()));
    args.source = sum_flce.as<float>();
  }
  internal_cuda::GemmTuning untuned;
  untuned.enabled = false;
  FLCE_ASSIGN_OR_RETURN(std::unique_ptr<GemmRunner> gemms,
                        GemmRunner::Create(untuned, BenchHealth()));
  // dx_fused: the logits' statistics once (untimed), then per run the
  // gradient rows into G for cuBLAS, the per-row factors for flce.
  const bool fused = gemm == "dx_fused";
  DeviceBuffer z, target, row_scale, lse, loss, z_loss, correct, coef, column, target_value;
  internal_cuda::RowParams rows;
  if (fused) {
    FLCE_ASSIGN_OR_RETURN(z, DeviceBuffer::Allocate(n * v * 2, s, BenchHealth()));
    FLCE_RETURN_IF_ERROR(FillPattern(z, dtype, s));
    std::vector<int64_t> targets(n);
    std::vector<float> scales(n, 1.0f / static_cast<float>(n));
    for (int64_t r = 0; r < n; ++r) targets[r] = (r * 7919) % v;
    for (DeviceBuffer* b : {&row_scale, &lse, &loss, &z_loss, &coef, &column, &target_value}) {
      FLCE_ASSIGN_OR_RETURN(*b, DeviceBuffer::Allocate(n * 4, s, BenchHealth()));
    }
    FLCE_ASSIGN_OR_RETURN(correct, DeviceBuffer::Allocate(n * 4, s, BenchHealth()));
    FLCE_ASSIGN_OR_RETURN(target, DeviceBuffer::Allocate(n * 8, s, BenchHealth()));
    FLCE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(target.data(), targets.data(), n * 8,
                                                    cudaMemcpyHostToDevice, s),
                                    "upload"));
    FLCE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(row_scale.data(), scales.data(), n * 4,
                                                    cudaMemcpyHostToDevice, s),
                                    "upload"));
    rows.rows = n;
    rows.vocab = rows.cols = rows.full_vocab = v;
    rows.target = target.as<int64_t>();
    FLCE_RETURN_IF_ERROR(CudaStatus(
        internal_cuda::LaunchForwardRows(
            rows, z.data(), dtype, /*write_grad=*/false, row_scale.as<float>(),
            {lse.as<float>(), loss.as<float>(), z_loss.as<float>(), correct.as<int32_t>()}, s),
        "statistics"));
    FLCE_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(s), "statistics"));
    args.a = z.data();
    args.gradient = {lse.as<float>(), coef.as<float>(), column.as<int32_t>(),
                     target_value.as<float>()};
  }
  auto cublas = [&]() -> absl::Status {
    if (fused) {
      FLCE_RETURN_IF_ERROR(CudaStatus(
          internal_cuda::LaunchGradientRowsFrom(rows, z.data(), v, g.data(), dtype,
                                                lse.as<float>(), row_scale.as<float>(), s),
          "gradient rows"));
      return gemms->Run(blas.get(), s, c.shape, c.a, c.b, c.beta, out_cublas.data());
    }
    if (!narrow) return gemms->Run(blas.get(), s, c.shape, c.a, c.b, c.beta, out_cublas.data());
    FLCE_RETURN_IF_ERROR(gemms->Run(blas.get(), s, c.shape, c.a, c.b, c.beta, sum_cublas.data()));
    return CudaStatus(internal_cuda::LaunchConvert(sum_cublas.data(), DType::kFloat32,
                                                   out_cublas.data(), dtype, v * h, 1.0f, s),
                      "narrowing");
  };
  auto hopper = [&](int cluster, bool ping_pong = false) {
    return [&, cluster, ping_pong]() -> absl::Status {
      HopperGemmArgs a = args;
      a.cluster = cluster;
      a.ping_pong = ping_pong;
      if (fused) {
        FLCE_RETURN_IF_ERROR(CudaStatus(
            internal_cuda::LaunchGradientFactors(rows, z.data(), v, dtype, lse.as<float>(),
                                                 row_scale.as<float>(), coef.as<float>(),
                                                 column.as<int32_t>(), target_value.as<float>(), s),
            "gradient factors"));
      }
      return CudaStatus(internal_cuda::LaunchHopperGemm(a, sms, s), "hopper gemm");
    };
  };
  // Zero sums; dw_last's start from the same values.
  auto zero = [&]() -> absl::Status {
    for (const DeviceBuffer* out : {&out_cublas, &out_flce}) {
      FLCE_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(out->data(), 0, out_bytes, s), "zero"));
    }
    if (narrow) {
      FLCE_RETURN_IF_ERROR(FillPattern(sum_flce, DType::kFloat32, s));
      FLCE_RETURN_IF_ERROR(FillPattern(sum_cublas, DType::kFloat32, s));
    }
    return absl::OkStatus();
  };
  FLCE_RETURN_IF_ERROR(zero());
  const double flop = 2.0 * n * h * v;
  internal_cuda::EventTimer timer(BenchHealth());
  // cuBLAS and flce's GEMM with clusters of 1 and of 2 (and the same in
  // ping-pong), in turn, each round starting with the next of them (the
  // first runs of a process on a cool GPU ran up to 15–25 % faster than
  // later ones).
  std::vector<std::function<absl::Status()>> candidates = {cublas, hopper(1), hopper(2)};
  const bool ping_pong = absl::GetFlag(FLAGS_ping_pong) && !fused;
  if (ping_pong) {
    candidates.push_back(hopper(1, true));
    candidates.push_back(hopper(2, true));
  }
  const int count = static_cast<int>(candidates.size());
  std::vector<std::vector<double>> ms(count);
  const int warmup = absl::GetFlag(FLAGS_warmup), iters = absl::GetFlag(FLAGS_iters);
  for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    for (int i = 0; i < count; ++i) {
      const int which = (round + i) % count;
      FLCE_ASSIGN_OR_RETURN(const double t, timer.MedianMs(s, warmup, iters, candidates[which]));
      ms[which].push_back(t);
    }
  }
  // The outputs compared from the same start: one run each.
  FLCE_RETURN_IF_ERROR(zero());
  FLCE_RETURN_IF_ERROR(cublas());
  FLCE_RETURN_IF_ERROR(hopper(2)());
  FLCE_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(s), "sync"));
  FLCE_ASSIGN_OR_RETURN(const double difference,
                        SampledDifference(out_flce, out_cublas, c.outputs, c.out_type));
  // Each one's median round, and the median of the rounds' ratios (the
  // best round favoured whichever ran while the GPU was coolest).
  auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x.size() % 2 ? x[x.size() / 2] : (x[x.size() / 2 - 1] + x[x.size() / 2]) / 2;
  };
  std::vector<double> best(count);
  for (int i = 0; i < count; ++i) best[i] = median(ms[i]);
  // Candidate `which` over cuBLAS: the median of the rounds' ratios, and
  // each round's.
  auto ratios_of = [&](int which, std::string* rounds) {
    std::vector<double> ratios;
    for (size_t i = 0; i < ms[which].size(); ++i) {
      ratios.push_back(ms[which][i] / ms[0][i]);
      *rounds += (i ? " " : "") + std::to_string(ratios.back()).substr(0, 5);
    }
    return median(ratios);
  };
  std::string rounds;
  const double ratio = ratios_of(2, &rounds);
  std::printf("%-6s %6lldx%-6lldx%-7lld %8.3f %6.1f %8.3f %6.1f %8.3f %6.1f %7.3f  %-20s %.1e\n",
              gemm.c_str(), static_cast<long long>(n), static_cast<long long>(h),
              static_cast<long long>(v), best[0], flop / (best[0] * 1e9), best[1],
              flop / (best[1] * 1e9), best[2], flop / (best[2] * 1e9), ratio, rounds.c_str(),
              difference);
  if (ping_pong) {
    std::string pp_rounds;
    const double pp_ratio = ratios_of(4, &pp_rounds);
    std::printf("  ping-pong                       %8.3f %6.1f %8.3f %6.1f %7.3f  %-20s\n",
                best[3], flop / (best[3] * 1e9), best[4], flop / (best[4] * 1e9), pp_ratio,
                pp_rounds.c_str());
  }
  return absl::OkStatus();
}

int Main() {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  std::printf(
      "ms and TFLOP/s of each one's median round; flce's with clusters of 1 and 2 blocks\n"
      "(cooperative; under it, ping-pong); ratio: cluster 2 over cuBLAS, the median of the "
      "rounds'\n");
  std::printf("%-6s %-22s %8s %6s %8s %6s %8s %6s %7s  %-20s %s\n", "GEMM", "N x H x V", "cuBLAS",
              "TF/s", "flce c1", "TF/s", "flce c2", "TF/s", "ratio", "ratio per round",
              "rel. diff");
  std::vector<std::string> shapes = absl::StrSplit(absl::GetFlag(FLAGS_shapes), ',');
  if (absl::GetFlag(FLAGS_ceiling)) shapes.push_back("8192x8192x8192");
  const std::vector<std::string> gemms = absl::StrSplit(absl::GetFlag(FLAGS_gemms), ',');
  int status = 0;
  for (const std::string& text : shapes) {
    std::vector<std::string> parts = absl::StrSplit(text, 'x');
    int64_t n = 0, h = 0, v = 0;
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &n) || !absl::SimpleAtoi(parts[1], &h) ||
        !absl::SimpleAtoi(parts[2], &v)) {
      std::fprintf(stderr, "bad shape %s\n", text.c_str());
      return 2;
    }
    // The ceiling is the logits form's 8192³ product.
    const bool ceiling = absl::GetFlag(FLAGS_ceiling) && text == "8192x8192x8192";
    for (const std::string& gemm : ceiling ? std::vector<std::string>{"logits"} : gemms) {
      const absl::Status s = RunGemm(gemm, n, h, v, sms);
      if (!s.ok()) {
        std::printf("%s %s: %s\n", gemm.c_str(), text.c_str(), s.ToString().c_str());
        status = 1;
      }
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
