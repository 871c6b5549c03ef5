// flce_bench: times an engine's Forward + Backward against the bare GEMMs of
// the same shapes in the same process (the floor: 3 GEMMs for STORE_GRADS,
// 4 for RECOMPUTE), and checks accuracy against the fp64 reference on a
// smaller problem of the same options.
//
//   flce_bench --backend=cpu --shapes=512x1024x32000 --dtypes=bf16,fp32
//   flce_bench --backend=cuda --shapes=8192x4096x128256 --dtypes=bf16
//
// CPU: the engine's host API, floor = OpenBLAS sgemm, both on the host
// clock. CUDA: the engine's device work on resident inputs
// (DeviceRun, kernels/cuda/device_run.h: no host transfers), floor = cuBLAS GEMMs in the
// input dtype, both timed with CUDA events (median); the extra device memory is the
// stream-ordered pool's measured high-water mark minus X, W and the dX, dW
// the run keeps (fp32 sums: STORE_GRADS over several chunks dX and dW, in one chunk and
// RECOMPUTE dX only, their dW made in the input dtype).
//
// Effective rate = 6·N·H·V / time (the useful FLOP of fwd+bwd), as in
// DESIGN.md §7; on CUDA also over the ceiling, cuBLAS's rate for an
// 8192³ GEMM in the row's dtype timed in the same process
// (--ceiling_size). Prints a table; --json prints one JSON object per row.
//
// --vocab_shards=2,4 also times the served call (Forward + Backward through
// the engine's API, wall clock; CUDA: X and W in device memory, gradients
// written into device memory) of the vocabulary-sharded engine with that
// many shards on one engine against the unsharded engine's, in the same
// process: the shard path's overhead.

#include <cblas.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kernels/cpu/cpu_engine.h"
#include "kernels/reference/accuracy.h"
#include "kernels/reference/random_problem.h"
#include "kernels/sharded_engine.h"
#include "server/engine_factory.h"
#include "server/loss_core.h"

#ifdef FLCE_WITH_CUDA
#include <cuda_runtime_api.h>

#include "bench/cublas_floor.h"
#include "kernels/cuda/cuda_engine.h"
#endif

ABSL_FLAG(std::string, backend, "cpu", "engine to time: cpu or cuda");
ABSL_FLAG(std::string, shapes, "512x1024x32000", "comma-separated NxHxV");
ABSL_FLAG(std::string, dtypes, "bf16,fp32", "comma-separated bf16, fp16, fp32");
ABSL_FLAG(std::string, modes, "store_grads,recompute", "backward modes");
ABSL_FLAG(int, warmup, 1, "untimed runs first");
ABSL_FLAG(int, iters, 10, "timed runs (median reported)");
ABSL_FLAG(std::string, check_shape, "257x128x4099",
          "NxHxV of the accuracy check against fp64 (0 to skip)");
ABSL_FLAG(bool, json, false, "print JSON lines instead of a table");
ABSL_FLAG(bool, floor, true,
          "time the bare GEMMs too (false: the engine alone, e.g. under a profiler)");
ABSL_FLAG(int64_t, ceiling_size, 8192,
          "CUDA: the size of the square GEMM whose rate (cuBLAS, the row's dtype) each row's "
          "effective TFLOP/s is read against, timed once per dtype with the floor (0: none)");
ABSL_FLAG(bool, bias, false, "problems with a bias");
ABSL_FLAG(bool, class_weight, false, "problems with class weights");
ABSL_FLAG(float, softcap, 0.0f, "logit softcap (0: none)");
ABSL_FLAG(float, z_loss, 0.0f, "z-loss scale");
ABSL_FLAG(float, label_smoothing, 0.0f, "label smoothing");
ABSL_FLAG(bool, cuda_stages, false,
          "CUDA engine: after the timed runs, one more with CUDA events between its stages; "
          "prints device ms per stage under the row");
ABSL_FLAG(bool, cuda_tune_gemms, true,
          "CUDA engine: tune each GEMM shape's algorithm (bit-identical to cuBLAS's default); "
          "the floor is then also timed with tuned algorithms, printed under the row");
ABSL_FLAG(bool, cuda_one_pass_rows, flce::CudaEngineOptions().one_pass_rows,
          "CUDA engine: STORE_GRADS reads each logit once where it can (false: twice)");
ABSL_FLAG(bool, cuda_keep_chunk_logits, true,
          "CUDA engine: STORE_GRADS in one chunk keeps the logits, dW made in Backward in its "
          "final dtype (false: fp32 gradients in Forward)");
ABSL_FLAG(std::vector<std::string>, cuda_hopper_gemms, {},
          "CUDA engine: which GEMMs (logits,dx,dw) run flce's own Hopper GEMM where it gives "
          "cuBLAS's bits (the floor stays cuBLAS)");
ABSL_FLAG(int64_t, cpu_chunk_bytes, 0,
          "CPU engine: chunk budget in bytes (0: the engine's default)");
ABSL_FLAG(bool, cpu_native_bf16, true,
          "CPU engine: bf16 inputs multiply in bf16 where the CPU can and it outruns fp32 "
          "(false: widened to fp32)");
ABSL_FLAG(bool, cpu_onednn_fp32, true,
          "CPU engine: fp32 GEMMs on oneDNN (false: on OpenBLAS's sgemm)");
ABSL_FLAG(int64_t, cuda_chunk_bytes, 0,
          "CUDA engine: logits chunk budget in bytes (0: the engine's default)");
ABSL_FLAG(std::string, vocab_shards, "",
          "comma-separated shard counts: also time the served call sharded that many ways "
          "on one engine against the unsharded one");
ABSL_FLAG(std::string, cuda_devices, "",
          "comma-separated CUDA devices (e.g. 0,1): also time a registered weight's served "
          "call through the server's core on the first device alone and sharded over all of "
          "them (the server's --cuda_devices), in the same process");

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
  std::vector<float> x(s.n * s.h, 0.5f), w(s.v * s.h, 0.25f), z(s.n * s.v, 0.125f), dx(s.n * s.h),
      dw(s.v * s.h);
  return MedianMs(warmup, iters, [&] {
    const int logits_gemms = recompute ? 2 : 1;
    for (int i = 0; i < logits_gemms; ++i) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s.n, s.v, s.h, 1.0f, x.data(), s.h,
                  w.data(), s.h, 0.0f, z.data(), s.v);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s.n, s.h, s.v, 1.0f, z.data(), s.v,
                w.data(), s.h, 0.0f, dx.data(), s.h);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, s.v, s.h, s.n, 1.0f, z.data(), s.v,
                x.data(), s.h, 0.0f, dw.data(), s.h);
  });
}

// Forward (need_backward) + Backward; returns the Backward's gradients.
absl::StatusOr<Gradients> RunOnce(LossEngine& engine, const LossProblem& p, BackwardMode mode,
                                  ForwardResult* fwd_out) {
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

// The served call, wall clock: Forward (need_backward, `mode`) + Backward
// with `backward`'s destinations, the state dropped after it. Median ms;
// the first error in `status`.
double ServedMs(LossEngine& engine, const LossProblem& p, BackwardMode mode,
                const BackwardSpec& backward, int warmup, int iters, absl::Status& status) {
  return MedianMs(warmup, iters, [&] {
    if (!status.ok()) return;
    ForwardSpec spec;
    spec.need_backward = true;
    spec.mode = mode;
    absl::StatusOr<ForwardResult> fwd = engine.Forward(p, spec, nullptr);
    if (!fwd.ok()) {
      status = fwd.status();
      return;
    }
    BackwardSpec last = backward;
    last.last_use = true;
    status = engine.Backward(*fwd->saved, last, nullptr).status();
  });
}

// --vocab_shards: the served call unsharded, then sharded over one engine of
// make()'s for each count the flag names; one line each.
void PrintShardRows(const std::function<std::unique_ptr<LossEngine>()>& make, const LossProblem& p,
                    BackwardMode mode, const BackwardSpec& backward) {
  const std::string flag = absl::GetFlag(FLAGS_vocab_shards);
  if (flag.empty()) return;
  const int warmup = absl::GetFlag(FLAGS_warmup), iters = absl::GetFlag(FLAGS_iters);
  absl::Status status;
  std::unique_ptr<LossEngine> whole = make();
  const double base = ServedMs(*whole, p, mode, backward, warmup, iters, status);
  whole.reset();
  std::printf("    served call, unsharded: %.2f ms%s\n", base,
              status.ok() ? "" : (" " + status.ToString()).c_str());
  for (const std::string& text : std::vector<std::string>(absl::StrSplit(flag, ','))) {
    int shards = 0;
    if (!absl::SimpleAtoi(text, &shards) || shards < 1) continue;
    std::vector<std::unique_ptr<LossEngine>> engines;
    engines.push_back(make());
    ShardedEngine sharded(std::move(engines), shards);
    absl::Status sharded_status;
    const double ms = ServedMs(sharded, p, mode, backward, warmup, iters, sharded_status);
    std::printf("    served call, %d vocabulary shards on one engine: %.2f ms, %.3fx unsharded%s\n",
                shards, ms, ms / base,
                sharded_status.ok() ? "" : (" " + sharded_status.ToString()).c_str());
  }
  std::fflush(stdout);
}

// One region of host memory, page-locked for the engine's devices where it
// has any: a remote worker's row pieces put X there and read dX from there
// (a server_memory region), so the registered served call reads and writes
// it the same way.
class LockedRegion : public SliceResolver {
 public:
  static constexpr const char* kId = "bench";
  LockedRegion(int64_t bytes, DeviceMemory* locker)
      : bytes_(bytes), memory_(new char[static_cast<size_t>(bytes)]) {
    if (locker == nullptr) return;
    absl::StatusOr<std::unique_ptr<DeviceBlock>> pin = locker->PinHostMemory(memory_.get(), bytes);
    if (pin.ok()) pin_ = *std::move(pin);
  }
  char* data() const { return memory_.get(); }
  bool locked() const { return pin_ != nullptr; }
  absl::StatusOr<SliceMemory> Resolve(const SliceRef& slice, int64_t bytes,
                                      const std::string& field) const override {
    if (slice.region_id != kId || slice.offset < 0 || slice.offset + bytes > bytes_) {
      return absl::InvalidArgumentError(field + ": outside the bench's region");
    }
    return SliceMemory{memory_.get() + slice.offset, MemorySpace::kHost};
  }

 private:
  const int64_t bytes_;
  std::unique_ptr<char[]> memory_;
  std::unique_ptr<DeviceBlock> pin_;  // (unlocked before the memory goes)
};

// A registered weight's served call through the server's core (LossCore,
// as a Forward and a Backward with accumulate_weight_grad): W and the
// gradient sums where the engine keeps them (its WeightParts), X read from
// and dX written into a page-locked region (LockedRegion), dW and db added
// into the sums. Median ms, then one TakeWeightGrad's gather of the sums
// into host memory (`take_ms`); the first error in `status`.
double RegisteredServedMs(LossEngine& engine, const OwnedProblem& p, BackwardMode mode,
                          int warmup, int iters, double& take_ms, absl::Status& status) {
  SessionStore sessions(SessionLimits{});
  WeightRegistry weights(int64_t{1} << 40, int64_t{1} << 40);
  LossCore core(&engine, &sessions, &weights);
  std::optional<HostTensor> bias;
  if (p.bias) bias = CopyTensor(p.bias->view());
  absl::StatusOr<std::shared_ptr<RegisteredWeight>> registered =
      weights.Put("w", "", CopyTensor(p.weight.view()), std::move(bias));
  if (!registered.ok()) {
    status = registered.status();
    return 0;
  }
  const int64_t x_bytes = static_cast<int64_t>(p.hidden.data.size());
  const int64_t dx_at = (x_bytes + 4095) / 4096 * 4096;
  auto region = std::make_shared<LockedRegion>(dx_at + x_bytes, engine.host_locker());
  std::memcpy(region->data(), p.hidden.data.data(), static_cast<size_t>(x_bytes));
  ForwardCall call;
  call.problem = p.view();
  call.problem.hidden.data = region->data();
  call.problem.weight = (*registered)->weight().view();
  if (p.bias) call.problem.bias = (*registered)->bias()->view();
  call.weight_ref = *registered;
  call.shm = region;
  call.need_backward = true;
  call.requested_mode = mode;
  const double ms = MedianMs(warmup, iters, [&] {
    if (!status.ok()) return;
    absl::StatusOr<ForwardOutcome> fwd = core.Forward(call, "", nullptr);
    if (!fwd.ok()) {
      status = fwd.status();
      return;
    }
    BackwardCall back;
    back.session_id = fwd->session_id;
    back.accumulate_weight_grad = true;
    back.grad_hidden_out = SliceRef{LockedRegion::kId, dx_at};
    back.shm = region;
    absl::StatusOr<BackwardOutcome> bwd = core.Backward(back, "", nullptr);
    if (!bwd.ok()) {
      status = bwd.status();
      return;
    }
    core.Answered(*bwd);
    core.Settle(*bwd, /*delivered=*/true);
  });
  if (status.ok() && !region->locked()) status = absl::UnavailableError("region not page-locked");
  const absl::Time start = absl::Now();
  if (status.ok()) status = (*registered)->TakeGrad().status();
  take_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  return ms;
}

// The loss options the flags ask for.
void ApplyOptionFlags(RandomProblemSpec& spec) {
  spec.bias = absl::GetFlag(FLAGS_bias);
  spec.class_weight = absl::GetFlag(FLAGS_class_weight);
  if (absl::GetFlag(FLAGS_softcap) > 0.0f) {
    spec.options.logit_softcap = absl::GetFlag(FLAGS_softcap);
  }
  spec.options.z_loss_scale = absl::GetFlag(FLAGS_z_loss);
  spec.options.label_smoothing = absl::GetFlag(FLAGS_label_smoothing);
}

std::string CheckAccuracyOf(LossEngine& engine, DType dtype, BackwardMode mode) {
  // Run through the engine's host API, as the service calls it.
  const Shape s = ParseShape(absl::GetFlag(FLAGS_check_shape));
  if (s.n == 0) return "skipped";
  RandomProblemSpec spec;
  spec.rows = s.n;
  spec.hidden = s.h;
  spec.vocab = s.v;
  spec.dtype = dtype;
  spec.ignore_fraction = 0.05;
  ApplyOptionFlags(spec);
  const OwnedProblem p = MakeRandomProblem(spec);
  ForwardResult fwd;
  absl::StatusOr<Gradients> grads = RunOnce(engine, p.view(), mode, &fwd);
  if (!grads.ok()) return grads.status().ToString();
  const EngineOutputs out = CollectOutputs(fwd, &*grads);
  const AccuracyReport report = CheckAccuracy(p.view(), {}, out);
  // Each error, and for half dtypes its ratio to the plain same-dtype
  // computation's (eager PyTorch's rounding): issue 22's ≤ 1.05× eager.
  std::string line;
  for (const int i : {0, 3, 4}) {
    const AccuracyReport::Entry& e = report.entries[i];
    line += absl::StrFormat("%s %.1e ", i == 0 ? "loss" : i == 3 ? "dX" : "dW", e.error);
    if (e.plain > 0) line += absl::StrFormat("(%.2gx eager) ", e.vs_plain());
  }
  return line + (report.ok() ? "ok" : "FAIL");
}

RandomProblemSpec SpecFor(const Shape& s, DType dtype) {
  RandomProblemSpec spec;
  spec.rows = s.n;
  spec.hidden = s.h;
  spec.vocab = s.v;
  spec.dtype = dtype;
  spec.fast_fill = true;
  ApplyOptionFlags(spec);
  return spec;
}

BackwardMode ParseMode(const std::string& text) {
  return text == "recompute" ? BackwardMode::kRecompute : BackwardMode::kStoreGrads;
}

void PrintHeader(bool json, const char* memory_column) {
  if (!json) {
    std::printf("%-20s %-5s %-12s %10s %10s %7s %10s %10s  %s\n", "N×H×V", "dtype", "mode",
                "engine ms", "floor ms", "ratio", "eff TF/s", memory_column, "accuracy vs fp64");
  }
}

// ceiling_tflops: the card's square-GEMM rate in this dtype (0: none timed).
void PrintRow(bool json, const std::string& backend, const std::string& shape_text, const Shape& s,
              DType dtype, BackwardMode mode, double ms, double floor_ms, double tuned_floor_ms,
              double extra_gib, const std::string& accuracy, const std::string& error,
              double ceiling_tflops = 0.0) {
  const double tflops = 6.0 * s.n * s.h * s.v / (ms * 1e9);
  const double ratio = floor_ms > 0 ? ms / floor_ms : 0.0;  // (0: no floor timed)
  if (json) {
    std::printf(
        "{\"backend\":\"%s\",\"n\":%lld,\"h\":%lld,\"v\":%lld,\"dtype\":\"%s\","
        "\"mode\":\"%s\",\"engine_ms\":%.3f,\"floor_ms\":%.3f,\"ratio\":%.3f,"
        "\"tuned_floor_ms\":%.3f,\"effective_tflops\":%.3f,\"ceiling_tflops\":%.3f,"
        "\"extra_gib\":%.3f,\"accuracy\":\"%s\",\"error\":\"%s\"}\n",
        backend.c_str(), static_cast<long long>(s.n), static_cast<long long>(s.h),
        static_cast<long long>(s.v), DTypeName(dtype), BackwardModeName(mode), ms, floor_ms, ratio,
        tuned_floor_ms, tflops, ceiling_tflops, extra_gib, accuracy.c_str(), error.c_str());
  } else {
    std::printf("%-20s %-5s %-12s %10.2f %10.2f %7.3f %10.1f %10.3f  %s%s\n", shape_text.c_str(),
                DTypeName(dtype), BackwardModeName(mode), ms, floor_ms, ratio, tflops, extra_gib,
                accuracy.c_str(), error.c_str());
    if (tuned_floor_ms > 0) {
      std::printf("    floor with the GEMM algorithms tuned as the engine's: %.2f ms, ratio %.3f\n",
                  tuned_floor_ms, ms / tuned_floor_ms);
    }
    if (ceiling_tflops > 0) {
      std::printf("    effective TFLOP/s over the square-GEMM ceiling (%.1f TFLOP/s): %.3f\n",
                  ceiling_tflops, tflops / ceiling_tflops);
    }
  }
  std::fflush(stdout);
}

// Calls run(shape text, shape, dtype, problem, mode) for every configuration
// the flags name; one random problem per shape and dtype.
template <typename Run>
void ForEachConfig(Run&& run) {
  for (const std::string& shape_text :
       std::vector<std::string>(absl::StrSplit(absl::GetFlag(FLAGS_shapes), ','))) {
    const Shape s = ParseShape(shape_text);
    for (const std::string& dtype_text :
         std::vector<std::string>(absl::StrSplit(absl::GetFlag(FLAGS_dtypes), ','))) {
      const DType dtype = ParseDType(dtype_text);
      const OwnedProblem p = MakeRandomProblem(SpecFor(s, dtype));
      for (const std::string& mode_text :
           std::vector<std::string>(absl::StrSplit(absl::GetFlag(FLAGS_modes), ','))) {
        run(shape_text, s, dtype, p, ParseMode(mode_text));
      }
    }
  }
}

int RunCpu() {
  CpuEngineOptions options;
  if (absl::GetFlag(FLAGS_cpu_chunk_bytes) > 0) {
    options.chunk_bytes = absl::GetFlag(FLAGS_cpu_chunk_bytes);
  }
  options.bf16_gemms =
      absl::GetFlag(FLAGS_cpu_native_bf16) ? Bf16Gemms::kWhereFaster : Bf16Gemms::kNever;
  options.onednn_fp32 = absl::GetFlag(FLAGS_cpu_onednn_fp32);
  CpuEngine engine(options);
  const int warmup = absl::GetFlag(FLAGS_warmup), iters = absl::GetFlag(FLAGS_iters);
  const bool json = absl::GetFlag(FLAGS_json);
  PrintHeader(json, "extra GiB");
  ForEachConfig([&](const std::string& shape_text, const Shape& s, DType dtype,
                    const OwnedProblem& p, BackwardMode mode) {
    bool failed = false;
    const double ms =
        MedianMs(warmup, iters, [&] { failed |= !RunOnce(engine, p.view(), mode, nullptr).ok(); });
    const double floor_ms = absl::GetFlag(FLAGS_floor)
                                ? BlasFloorMs(s, mode == BackwardMode::kRecompute, warmup, iters)
                                : 0.0;
    PrintRow(json, "cpu", shape_text, s, dtype, mode, ms, floor_ms, 0.0, 0.0,
             CheckAccuracyOf(engine, dtype, mode), failed ? " (engine error)" : "");
    PrintShardRows([&] { return std::make_unique<CpuEngine>(options); }, p.view(), mode, {});
  });
  return 0;
}

#ifdef FLCE_WITH_CUDA
// Device memory holding a copy of `bytes`, freed when destroyed.
struct DeviceCopy {
  explicit DeviceCopy(const std::string& bytes) {
    if (cudaMalloc(&data, bytes.size()) != cudaSuccess ||
        cudaMemcpy(data, bytes.data(), bytes.size(), cudaMemcpyHostToDevice) != cudaSuccess) {
      std::fprintf(stderr, "device copy of %zu bytes failed\n", bytes.size());
      std::exit(1);
    }
  }
  ~DeviceCopy() { cudaFree(data); }
  void* data = nullptr;
};

// --cuda_devices: a registered weight's served call on the first device
// alone, then sharded over every device listed (a --cuda_devices server's
// engine), in this process; one line each, with the sharded engine's
// combining times.
void PrintDeviceRows(const CudaEngineOptions& options, const OwnedProblem& p, BackwardMode mode) {
  std::vector<int> devices;
  for (const std::string& text :
       std::vector<std::string>(absl::StrSplit(absl::GetFlag(FLAGS_cuda_devices), ','))) {
    int device = 0;
    if (absl::SimpleAtoi(text, &device)) devices.push_back(device);
  }
  if (devices.empty()) return;
  const int warmup = absl::GetFlag(FLAGS_warmup), iters = absl::GetFlag(FLAGS_iters);
  double one_ms = 0;
  for (const std::vector<int>& set : {std::vector<int>{devices[0]}, devices}) {
    if (set.size() == 1 && one_ms > 0) break;  // (one device listed: done)
    EngineOptions engine_options;
    engine_options.cuda = options;
    engine_options.cuda_devices = set;
    absl::StatusOr<std::unique_ptr<LossEngine>> engine = CreateEngine("cuda", engine_options);
    const std::string name = absl::StrJoin(set, ",");
    if (!engine.ok()) {
      std::printf("    registered served call, devices %s: %s\n", name.c_str(),
                  engine.status().ToString().c_str());
      continue;
    }
    absl::Status status;
    double take_ms = 0;
    const double ms = RegisteredServedMs(**engine, p, mode, warmup, iters, take_ms, status);
    std::string combine;
    if (const auto* sharded = dynamic_cast<const ShardedEngine*>(engine->get())) {
      const ShardedEngine::CombineTimes t = sharded->last_combine_times();
      combine = absl::StrFormat(" (statistics combine %.2f ms; dX: wait %.2f ms, sum %.2f ms)",
                                t.stats_ms, t.dx_wait_ms, t.dx_sum_ms);
    }
    if (set.size() == 1) one_ms = ms;
    std::printf(
        "    registered served call (X and dX in a page-locked region, dW summed where W is), "
        "devices %s: %.2f ms%s, take %.1f ms%s%s\n",
        name.c_str(), ms,
        set.size() > 1 && one_ms > 0 ? absl::StrFormat(", %.3fx one device", ms / one_ms).c_str()
                                     : "",
        take_ms, combine.c_str(), status.ok() ? "" : (" " + status.ToString()).c_str());
    std::fflush(stdout);
  }
}

int RunCuda() {
  CudaEngineOptions options;
  if (absl::GetFlag(FLAGS_cuda_chunk_bytes) > 0) {
    options.chunk_bytes = absl::GetFlag(FLAGS_cuda_chunk_bytes);
  }
  options.tune_gemms = absl::GetFlag(FLAGS_cuda_tune_gemms);
  options.one_pass_rows = absl::GetFlag(FLAGS_cuda_one_pass_rows);
  options.keep_chunk_logits = absl::GetFlag(FLAGS_cuda_keep_chunk_logits);
  if (std::string error; !ParseHopperGemmForms(absl::GetFlag(FLAGS_cuda_hopper_gemms),
                                                &options.hopper_gemms, &error)) {
    std::fprintf(stderr, "--cuda_hopper_gemms: %s\n", error.c_str());
    return 2;
  }
  auto engine = CudaEngine::Create(options);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }
  const int warmup = absl::GetFlag(FLAGS_warmup), iters = absl::GetFlag(FLAGS_iters);
  const bool json = absl::GetFlag(FLAGS_json);
  cudaMemPool_t pool;
  cudaDeviceGetDefaultMemPool(&pool, 0);
  if (!json) {
    std::printf("device: %s, chunk budget %lld MiB\n", (*engine)->devices()[0].name.c_str(),
                static_cast<long long>(options.chunk_bytes >> 20));
    const HopperGemmForms& hopper = options.hopper_gemms;
    if (hopper.any()) {
      std::printf("flce's Hopper GEMM for:%s%s%s (the floor: cuBLAS)\n",
                  hopper.logits ? " logits" : "", hopper.dx ? " dx" : "", hopper.dw ? " dw" : "");
    }
  }
  PrintHeader(json, "extra GiB");
  int failures = 0;
  std::map<DType, double> ceilings;  // TFLOP/s of the square GEMM, per dtype
  ForEachConfig([&](const std::string& shape_text, const Shape& s, DType dtype,
                    const OwnedProblem& p, BackwardMode mode) {
    std::string error;
    double ms = 0, extra_gib = 0;
    std::map<std::string, double> stages;
    {
      auto run = (*engine)->PrepareDeviceRun(p.view(), mode);
      if (!run.ok()) {
        error = " " + run.status().ToString();
      } else {
        uint64_t zero = 0;
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero);
        // Device time (CUDA events around each run's work), as the floor.
        absl::Status status;
        std::vector<double> device_ms;
        for (int i = 0; i < warmup + iters && status.ok(); ++i) {
          absl::StatusOr<double> t = (*run)->Run();
          status = t.status();
          if (t.ok() && i >= warmup) device_ms.push_back(*t);
        }
        if (!status.ok()) error = " " + status.ToString();
        if (!device_ms.empty()) {
          std::sort(device_ms.begin(), device_ms.end());
          ms = device_ms[device_ms.size() / 2];
        }
        uint64_t high = 0;
        cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high);
        const int64_t resident = (s.n * s.h + s.v * s.h) * DTypeSize(dtype) +  // X, W
                                 (*run)->gradient_bytes();                     // dX, dW
        extra_gib = (static_cast<double>(high) - resident) / (1 << 30);
        if (status.ok() && absl::GetFlag(FLAGS_cuda_stages)) {
          absl::StatusOr<std::map<std::string, double>> timed = (*run)->RunStages();
          if (timed.ok()) {
            stages = *std::move(timed);
          } else {
            error += " stages: " + timed.status().ToString();
          }
        }
      }
    }
    const int logits_gemms = mode == BackwardMode::kRecompute ? 2 : 1;
    auto floor = MeasureGemmFloor(s.n, s.h, s.v, dtype, logits_gemms, false, warmup, iters);
    if (!floor.ok()) error += " floor: " + floor.status().ToString();
    absl::StatusOr<GemmFloor> tuned_floor = GemmFloor{};
    if (options.tune_gemms) {
      tuned_floor = MeasureGemmFloor(s.n, s.h, s.v, dtype, logits_gemms, true, warmup, iters);
      if (!tuned_floor.ok()) error += " tuned floor: " + tuned_floor.status().ToString();
    }
    // The card's square-GEMM rate in this dtype, once per dtype.
    double ceiling_tflops = 0;
    if (const int64_t size = absl::GetFlag(FLAGS_ceiling_size); size > 0) {
      auto it = ceilings.find(dtype);
      if (it == ceilings.end()) {
        absl::StatusOr<GemmFloor> ceiling = MeasureGemmCeiling(size, dtype, warmup, iters);
        if (!ceiling.ok()) error += " ceiling: " + ceiling.status().ToString();
        it = ceilings.emplace(dtype, ceiling.ok() ? ceiling->tflops : 0.0).first;
        if (ceiling.ok() && !json) {
          std::printf("    the ceiling: cuBLAS's %lld³ %s GEMM, %.3f ms, %.1f TFLOP/s\n",
                      static_cast<long long>(size), DTypeName(dtype), ceiling->ms,
                      ceiling->tflops);
        }
      }
      ceiling_tflops = it->second;
    }
    const std::string accuracy = CheckAccuracyOf(**engine, dtype, mode);
    // (An accuracy check skipped with --check_shape=0 is no failure.)
    if (!error.empty() || (accuracy.find("ok") == std::string::npos && accuracy != "skipped")) {
      ++failures;
    }
    PrintRow(json, "cuda", shape_text, s, dtype, mode, ms, floor.ok() ? floor->ms : 0.0,
             tuned_floor.ok() ? tuned_floor->ms : 0.0, extra_gib, accuracy, error,
             ceiling_tflops);
    if (!stages.empty() && !json) {
      std::string line = "    stages (device ms):";
      for (const auto& [stage, stage_ms] : stages) {
        line += absl::StrFormat(" %s %.2f;", stage, stage_ms);
      }
      std::printf("%s\n", line.c_str());
    }
    if (!absl::GetFlag(FLAGS_vocab_shards).empty()) {
      // X and W in device memory, the gradients written there: the served
      // call of a same-host worker's tensors.
      DeviceCopy x(p.hidden.data), w(p.weight.data);
      DeviceCopy dx(std::string(p.hidden.data.size(), '\0')),
          dw(std::string(p.weight.data.size(), '\0'));
      LossProblem on_device = p.view();
      on_device.hidden.data = x.data;
      on_device.hidden.space = MemorySpace::kCuda;
      on_device.weight.data = w.data;
      on_device.weight.space = MemorySpace::kCuda;
      BackwardSpec backward;
      backward.grad_hidden_to = GradientDestination{dx.data, MemorySpace::kCuda};
      backward.grad_weight_to = GradientDestination{dw.data, MemorySpace::kCuda};
      PrintShardRows(
          [&]() -> std::unique_ptr<LossEngine> {
            return std::move(CudaEngine::Create(options).value());
          },
          on_device, mode, backward);
    }
    if (!absl::GetFlag(FLAGS_cuda_devices).empty()) PrintDeviceRows(options, p, mode);
  });
  if (!json && options.hopper_gemms.any()) {
    std::printf("GEMM shapes on flce's Hopper GEMM (bit-identical to cuBLAS's default): %d\n",
                (*engine)->hopper_gemm_shapes());
  }
  return failures == 0 ? 0 : 1;
}
#endif

int Main() {
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend == "cpu") return RunCpu();
#ifdef FLCE_WITH_CUDA
  if (backend == "cuda") return RunCuda();
#endif
  std::fprintf(stderr, "--backend: %s is not built in\n", backend.c_str());
  return 2;
}

}  // namespace
}  // namespace flce

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return flce::Main();
}
