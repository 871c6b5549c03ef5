// flce_bench: times an engine's Forward + Backward against the bare GEMMs of
// the same shapes in the same process (the floor: 3 GEMMs for STORE_GRADS,
// 4 for RECOMPUTE), and checks accuracy against the fp64 reference on a
// smaller problem of the same options.
//
//   flce_bench --backend=cpu --shapes=512x1024x32000 --dtypes=bf16,fp32
//
// Effective rate = 6·N·H·V / time (the useful FLOP of fwd+bwd), as in
// DESIGN.md §7. Prints a table; --json prints one JSON object per row.

#include <cblas.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kernels/cpu/cpu_engine.h"
#include "kernels/reference/accuracy.h"
#include "kernels/reference/random_problem.h"

ABSL_FLAG(std::string, backend, "cpu", "engine to time (cpu)");
ABSL_FLAG(std::string, shapes, "512x1024x32000", "comma-separated NxHxV");
ABSL_FLAG(std::string, dtypes, "bf16,fp32", "comma-separated bf16, fp16, fp32");
ABSL_FLAG(std::string, modes, "store_grads,recompute", "backward modes");
ABSL_FLAG(int, warmup, 1, "untimed runs first");
ABSL_FLAG(int, iters, 5, "timed runs (median reported)");
ABSL_FLAG(std::string, check_shape, "257x128x4099",
          "NxHxV of the accuracy check against fp64 (0 to skip)");
ABSL_FLAG(bool, json, false, "print JSON lines instead of a table");

namespace flce {
namespace {

struct Shape {
  int64_t n, h, v;
};

Shape ParseShape(const std::string& s) {
  std::vector<std::string> parts = absl::StrSplit(s, 'x');
  Shape shape{0, 0, 0};
  if (parts.size() == 3) {
    (void)absl::SimpleAtoi(parts[0], &shape.n);
    (void)absl::SimpleAtoi(parts[1], &shape.h);
    (void)absl::SimpleAtoi(parts[2], &shape.v);
  }
  return shape;
}

DType ParseDType(const std::string& s) {
  if (s == "bf16") return DType::kBFloat16;
  if (s == "fp16") return DType::kFloat16;
  return DType::kFloat32;
}

template <typename F>
double MedianMs(int warmup, int iters, F&& run) {
  for (int i = 0; i < warmup; ++i) run();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    const absl::Time start = absl::Now();
    run();
    ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// The bare fp32 GEMMs of the loss at full size (no chunking, no row math).
double BlasFloorMs(const Shape& s, bool recompute, int warmup, int iters) {
  std::vector<float> x(s.n * s.h, 0.5f), w(s.v * s.h, 0.25f), z(s.n * s.v, 0.125f),
      dx(s.n * s.h), dw(s.v * s.h);
  return MedianMs(warmup, iters, [&] {
    const int logits_gemms = recompute ? 2 : 1;
    for (int i = 0; i < logits_gemms; ++i) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s.n, s.v, s.h, 1.0f, x.data(),
                  s.h, w.data(), s.h, 0.0f, z.data(), s.v);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s.n, s.h, s.v, 1.0f, z.data(),
                s.v, w.data(), s.h, 0.0f, dx.data(), s.h);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, s.v, s.h, s.n, 1.0f, z.data(),
                s.v, x.data(), s.h, 0.0f, dw.data(), s.h);
  });
}

// Forward (need_backward) + Backward; returns the Backward's gradients.
absl::StatusOr<Gradients> RunOnce(LossEngine& engine, const LossProblem& p,
                                  BackwardMode mode, ForwardResult* fwd_out) {
  ForwardSpec spec;
  spec.need_backward = true;
  spec.mode = mode;
  spec.want_lse = true;
  absl::StatusOr<ForwardResult> fwd = engine.Forward(p, spec, nullptr);
  if (!fwd.ok()) return fwd.status();
  // As a consumed session: the state is dropped after Backward.
  BackwardSpec backward;
  backward.last_use = true;
  absl::StatusOr<Gradients> grads = engine.Backward(*fwd->saved, backward, nullptr);
  if (fwd_out) *fwd_out = std::move(*fwd);
  return grads;
}

std::string CheckAccuracyOf(LossEngine& engine, DType dtype, BackwardMode mode) {
  const Shape s = ParseShape(absl::GetFlag(FLAGS_check_shape));
  if (s.n == 0) return "skipped";
  RandomProblemSpec spec;
  spec.rows = s.n;
  spec.hidden = s.h;
  spec.vocab = s.v;
  spec.dtype = dtype;
  spec.ignore_fraction = 0.05;
  const OwnedProblem p = MakeRandomProblem(spec);
  ForwardResult fwd;
  absl::StatusOr<Gradients> grads = RunOnce(engine, p.view(), mode, &fwd);
  if (!grads.ok()) return grads.status().ToString();
  const EngineOutputs out = CollectOutputs(fwd, &*grads);
  const AccuracyReport report = CheckAccuracy(p.view(), {}, out);
  char buf[160];
  std::snprintf(buf, sizeof(buf), "loss %.1e dX %.1e dW %.1e %s",
                report.entries[0].error, report.entries[3].error,
                report.entries[4].error, report.ok() ? "ok" : "FAIL");
  return buf;
}

int Main() {
  if (absl::GetFlag(FLAGS_backend) != "cpu") {
    std::fprintf(stderr, "--backend: only cpu is built in\n");
    return 2;
  }
  CpuEngine engine;
  const int warmup = absl::GetFlag(FLAGS_warmup), iters = absl::GetFlag(FLAGS_iters);
  const bool json = absl::GetFlag(FLAGS_json);
  if (!json) {
    std::printf("%-20s %-5s %-12s %10s %10s %8s %10s  %s\n", "N×H×V", "dtype", "mode",
                "engine ms", "floor ms", "ratio", "eff GF/s", "accuracy vs fp64");
  }
  for (const std::string& shape_text : std::vector<std::string>(absl::StrSplit(absl::GetFlag(FLAGS_shapes), ','))) {
    const Shape s = ParseShape(shape_text);
    for (const std::string& dtype_text : std::vector<std::string>(absl::StrSplit(absl::GetFlag(FLAGS_dtypes), ','))) {
      const DType dtype = ParseDType(dtype_text);
      RandomProblemSpec spec;
      spec.rows = s.n;
      spec.hidden = s.h;
      spec.vocab = s.v;
      spec.dtype = dtype;
      const OwnedProblem p = MakeRandomProblem(spec);
      for (const std::string& mode_text : std::vector<std::string>(absl::StrSplit(absl::GetFlag(FLAGS_modes), ','))) {
        const BackwardMode mode = mode_text == "recompute" ? BackwardMode::kRecompute
                                                           : BackwardMode::kStoreGrads;
        bool failed = false;
        const double ms = MedianMs(warmup, iters, [&] {
          failed |= !RunOnce(engine, p.view(), mode, nullptr).ok();
        });
        const double floor_ms =
            BlasFloorMs(s, mode == BackwardMode::kRecompute, warmup, iters);
        const double gflops = 6.0 * s.n * s.h * s.v / (ms * 1e6);
        const std::string accuracy = CheckAccuracyOf(engine, dtype, mode);
        if (json) {
          std::printf(
              "{\"backend\":\"cpu\",\"n\":%lld,\"h\":%lld,\"v\":%lld,\"dtype\":\"%s\","
              "\"mode\":\"%s\",\"engine_ms\":%.3f,\"floor_ms\":%.3f,\"ratio\":%.3f,"
              "\"effective_gflops\":%.2f,\"accuracy\":\"%s\",\"error\":%s}\n",
              static_cast<long long>(s.n), static_cast<long long>(s.h),
              static_cast<long long>(s.v), DTypeName(dtype), BackwardModeName(mode), ms,
              floor_ms, ms / floor_ms, gflops, accuracy.c_str(), failed ? "true" : "false");
        } else {
          std::printf("%-20s %-5s %-12s %10.1f %10.1f %8.2f %10.1f  %s%s\n",
                      shape_text.c_str(), DTypeName(dtype), BackwardModeName(mode), ms,
                      floor_ms, ms / floor_ms, gflops, accuracy.c_str(),
                      failed ? " (engine error)" : "");
        }
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace flce

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return flce::Main();
}
