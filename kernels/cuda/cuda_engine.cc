#include "kernels/cuda/cuda_engine.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/chunk_plan.h"
#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/loss_kernels.h"
#include "kernels/status_macros.h"

namespace flce {
namespace internal_cuda {
namespace {

// One concurrent call: a stream and a cuBLAS handle bound to it.
struct Lane {
  CudaStream stream;
  CublasHandle blas;
};

// A problem's tensors on the device.
struct DeviceInputs {
  DType dtype = DType::kFloat32;
  int64_t n = 0, h = 0, v = 0;
  LossOptions options;
  float class_weight_sum = 0;
  DeviceBuffer hidden, weight;  // input dtype
  DeviceBuffer bias;            // fp32 [V], or empty
  DeviceBuffer target;          // int64 [N]
  DeviceBuffer class_weight;    // fp32 [V], or empty

  int64_t bytes() const {
    return hidden.bytes() + weight.bytes() + bias.bytes() + target.bytes() +
           class_weight.bytes();
  }
  const char* x_row(int64_t r) const {
    return hidden.as<const char>() + r * h * DTypeSize(dtype);
  }
  // Whole rows [row0, row0 + rows).
  RowParams Params(int64_t row0, int64_t rows) const { return Params(row0, rows, 0, v); }
  // Columns [col0, col0 + cols) of rows [row0, row0 + rows).
  RowParams Params(int64_t row0, int64_t rows, int64_t col0, int64_t cols) const {
    RowParams p;
    p.rows = rows;
    p.row0 = row0;
    p.vocab = v;
    p.col0 = col0;
    p.cols = cols;
    p.bias = bias.bytes() > 0 ? bias.as<const float>() : nullptr;
    p.class_weight = class_weight.bytes() > 0 ? class_weight.as<const float>() : nullptr;
    p.class_weight_sum = class_weight_sum;
    p.target = target.as<const int64_t>();
    p.ignore_index = options.ignore_index;
    p.label_smoothing = options.label_smoothing;
    p.z_loss_scale = options.z_loss_scale;
    p.softcap = options.logit_softcap.value_or(0.0f);
    return p;
  }
};

// STORE_GRADS: gradients for grad_output 1, fp32, on the device.
class StoredGradients : public SavedState {
 public:
  DType dtype = DType::kFloat32;
  int64_t n = 0, h = 0, v = 0;
  DeviceBuffer dx, dw, db;
  int64_t bytes() const override { return dx.bytes() + dw.bytes() + db.bytes(); }
};

// RECOMPUTE: the inputs and per-row lse, on the device.
class RecomputeState : public SavedState {
 public:
  DeviceInputs inputs;
  DeviceBuffer lse;
  int64_t bytes() const override { return inputs.bytes() + lse.bytes(); }
};

// Per-row forward outputs and the reduction scalars.
struct RowBuffers {
  DeviceBuffer lse, loss, z_loss, correct, row_scale, denom, num_valid, totals;
  // The one-pass row kernel's per-row gradient factors ([N] fp32) and its
  // flag asking for the two-pass rerun (int32).
  DeviceBuffer row_factor, redo;
  RowOutputs outputs() const {
    return {lse.as<float>(), loss.as<float>(), z_loss.as<float>(), correct.as<int32_t>()};
  }
};

// What RunChunks computes: the loss; the loss and the gradients with the
// two-pass row kernel (LaunchForwardRows) or the one-pass one
// (LaunchOnePassRows, where EngineImpl::OnePassRows allows); the gradients
// from a saved lse.
enum class Pass { kLoss, kLossAndGrad, kLossAndGradOnePass, kGradFromLse };

// A mapping of another process's allocation; closed when destroyed.
class IpcMemory : public DeviceBlock {
 public:
  IpcMemory(int device, void* base, int64_t bytes)
      : device_(device), base_(base), bytes_(bytes) {}
  ~IpcMemory() override {
    cudaSetDevice(device_);
    cudaIpcCloseMemHandle(base_);
  }
  void* data() const override { return base_; }
  int64_t bytes() const override { return bytes_; }

 private:
  const int device_;
  void* const base_;
  const int64_t bytes_;
};

// Device memory of DeviceMemory::Allocate, freed when destroyed; counted in
// `allocated` (shared with the engine, which it may outlive) while alive.
class OwnedDeviceBlock : public DeviceBlock {
 public:
  OwnedDeviceBlock(int device, void* data, int64_t bytes,
                   std::shared_ptr<std::atomic<int64_t>> allocated)
      : device_(device), data_(data), bytes_(bytes), allocated_(std::move(allocated)) {
    *allocated_ += bytes_;
  }
  ~OwnedDeviceBlock() override {
    cudaSetDevice(device_);
    cudaFree(data_);
    *allocated_ -= bytes_;
  }
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }

 private:
  const int device_;
  void* const data_;
  const int64_t bytes_;
  const std::shared_ptr<std::atomic<int64_t>> allocated_;
};

// The size of the allocation that starts at `base`, from the driver's
// cuMemGetAddressRange (reached through the runtime, so the binary needs
// no link against the driver library).
absl::StatusOr<int64_t> AllocationBytes(void* base) {
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static GetAddressRange get_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<GetAddressRange>(fn);
  }();
  if (get_range == nullptr) return absl::InternalError("cuMemGetAddressRange is not available");
  CUdeviceptr start = 0;
  size_t size = 0;
  const CUresult result = get_range(&start, &size, reinterpret_cast<CUdeviceptr>(base));
  if (result != CUDA_SUCCESS || start != reinterpret_cast<CUdeviceptr>(base)) {
    return absl::InternalError(
        absl::StrCat("cuMemGetAddressRange failed on a mapped IPC handle (", result, ")"));
  }
  return static_cast<int64_t>(size);
}

// CUDA events between the stages of a run on one stream, for benchmarks:
// device milliseconds per stage, summed over chunks. Mark(stage) says that
// the work queued since the previous mark was `stage` (the first mark only
// starts the clock).
class StageClock {
 public:
  explicit StageClock(cudaStream_t stream) : stream_(stream) {}
  StageClock(const StageClock&) = delete;
  StageClock& operator=(const StageClock&) = delete;
  ~StageClock() {
    for (const auto& mark : marks_) cudaEventDestroy(mark.second);
  }

  void Mark(const char* stage) {
    cudaEvent_t event = nullptr;
    if (cudaEventCreate(&event) != cudaSuccess) return;
    cudaEventRecord(event, stream_);
    marks_.emplace_back(stage, event);
  }

  // Once the stream has run the marked work.
  std::map<std::string, double> Totals() const {
    std::map<std::string, double> totals;
    for (size_t i = 1; i < marks_.size(); ++i) {
      float ms = 0;
      cudaEventElapsedTime(&ms, marks_[i - 1].second, marks_[i].second);
      totals[marks_[i].first] += ms;
    }
    return totals;
  }

 private:
  cudaStream_t stream_;
  std::vector<std::pair<std::string, cudaEvent_t>> marks_;
};

// Marks a stage on `clock` when there is one.
void Mark(StageClock* clock, const char* stage) {
  if (clock != nullptr) clock->Mark(stage);
}

}  // namespace

class EngineImpl {
 public:
  EngineImpl(const CudaEngineOptions& options, cudaDeviceProp props)
      : options_(options), props_(props) {}

  absl::Status Init() {
    GemmTuning tuning;
    tuning.enabled = options_.tune_gemms;
    FLCE_ASSIGN_OR_RETURN(gemms_, GemmRunner::Create(tuning));
    for (int i = 0; i < std::max(1, options_.lanes); ++i) {
      auto lane = std::make_unique<Lane>();
      FLCE_ASSIGN_OR_RETURN(lane->stream, CudaStream::Create());
      FLCE_ASSIGN_OR_RETURN(lane->blas, CublasHandle::Create(lane->stream.get()));
      free_lanes_.push_back(lane.get());
      lanes_.push_back(std::move(lane));
    }
    return absl::OkStatus();
  }

  ~EngineImpl() {
    for (auto& lane : lanes_) cudaStreamSynchronize(lane->stream.get());
  }

  const cudaDeviceProp& props() const { return props_; }
  const GemmRunner& gemms() const { return *gemms_; }
  int64_t forward_reruns() const { return forward_reruns_.load(); }
  int device() const { return options_.device; }

  absl::Status health() const {
    if (healthy_.load()) return absl::OkStatus();
    absl::MutexLock lock(&mu_);
    return absl::UnavailableError(absl::StrCat(
        "CUDA engine stopped after an unrecoverable device error: ", sticky_error_));
  }

  // The chunk plan (chunk_plan.h) at this engine's options.
  int64_t ChunkRows(int64_t rows, int64_t vocab, DType dtype) const {
    return flce::ChunkRows(options_, rows, vocab, dtype);
  }
  int64_t SliceColumns(int64_t rows, int64_t vocab, DType dtype) const {
    return flce::SliceColumns(options_, rows, vocab, dtype);
  }

  // Whether Forward's STORE_GRADS chunks read each logit once
  // (CudaEngineOptions::one_pass_rows and LaunchOnePassRows's conditions).
  bool OnePassRows(const DeviceInputs& in) const {
    return options_.one_pass_rows && OnePassRowsSupported(in.Params(0, in.n), in.dtype);
  }

  // STORE_GRADS Forward's first try: one pass where the rows allow it. When
  // it sets rows.redo, the call runs again with Pass::kLossAndGrad.
  Pass StoreGradsPass(const DeviceInputs& in) const {
    return OnePassRows(in) ? Pass::kLossAndGradOnePass : Pass::kLossAndGrad;
  }

  // Holds one lane for a call.
  class LaneLease {
   public:
    explicit LaneLease(EngineImpl* impl) : impl_(impl) {
      absl::MutexLock lock(&impl_->mu_);
      impl_->mu_.Await(absl::Condition(
          +[](std::vector<Lane*>* free) { return !free->empty(); }, &impl_->free_lanes_));
      lane_ = impl_->free_lanes_.back();
      impl_->free_lanes_.pop_back();
    }
    ~LaneLease() {
      absl::MutexLock lock(&impl_->mu_);
      impl_->free_lanes_.push_back(lane_);
    }
    Lane& operator*() const { return *lane_; }
    Lane* operator->() const { return lane_; }

   private:
    EngineImpl* impl_;
    Lane* lane_;
  };

  // Records a failed CUDA status; sticky errors stop the engine.
  absl::Status Check(cudaError_t error, const char* what) {
    if (error == cudaSuccess) return absl::OkStatus();
    if (IsStickyError(error)) {
      absl::MutexLock lock(&mu_);
      if (healthy_.exchange(false)) {
        sticky_error_ = absl::StrCat(what, ": ", cudaGetErrorName(error));
      }
      return absl::UnavailableError(absl::StrCat(
          "CUDA engine stopped after an unrecoverable device error in ", what, ": ",
          cudaGetErrorName(error)));
    }
    return CudaStatus(error, what);
  }

  absl::Status SetDevice() { return Check(cudaSetDevice(options_.device), "cudaSetDevice"); }

  // C[m×n] (column-major, ldc) = op(A)·op(B) + beta·C with input-dtype
  // operands and fp32 accumulation (GemmRunner: no TF32 for fp32 inputs).
  // `tune`: the GEMM may run a tuned algorithm (CudaEngineOptions::
  // tune_gemms). Only the token-chunk logits and dW GEMMs do: tuned in
  // isolation, the long-K dX GEMMs and the vocabulary-slice GEMMs picked
  // algorithms that ran slower inside the engine than cuBLAS's defaults
  // (bench/RESULTS.md, per-GEMM experiment).
  absl::Status Gemm(Lane& lane, bool tune, cublasOperation_t op_a, cublasOperation_t op_b,
                    int64_t m, int64_t n, int64_t k, const void* a, DType a_type, int64_t lda,
                    const void* b, DType b_type, int64_t ldb, float beta, void* c,
                    DType c_type, int64_t ldc) {
    const GemmShape shape{op_a, op_b, m, n, k, a_type, lda, b_type, ldb, c_type, ldc};
    return gemms_->Run(lane.blas.get(), lane.stream.get(), shape, a, b, beta, c, tune);
  }

  // A device copy of `bytes` at `data`, in host memory or (mapped through
  // CUDA IPC) device memory: unified addressing tells them apart.
  absl::StatusOr<DeviceBuffer> Upload(Lane& lane, const void* data, int64_t bytes) {
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::Allocate(bytes, lane.stream.get()));
    if (bytes > 0) {
      FLCE_RETURN_IF_ERROR(Check(
          cudaMemcpyAsync(buffer.data(), data, bytes, cudaMemcpyDefault, lane.stream.get()),
          "upload"));
    }
    return buffer;
  }

  absl::StatusOr<DeviceInputs> UploadProblem(Lane& lane, const LossProblem& p) {
    // X and W may be device memory; the small tensors are read on the host.
    for (const TensorView* view : {p.bias ? &*p.bias : nullptr, &p.target,
                                   p.class_weight ? &*p.class_weight : nullptr}) {
      if (view != nullptr && view->space != MemorySpace::kHost) {
        return absl::FailedPreconditionError(
            "bias, target and class_weight must be in host memory");
      }
    }
    DeviceInputs in;
    in.dtype = p.hidden.dtype;
    in.n = p.rows();
    in.h = p.hidden_size();
    in.v = p.vocab();
    in.options = p.options;
    const int64_t elem = DTypeSize(in.dtype);
    FLCE_ASSIGN_OR_RETURN(in.hidden, Upload(lane, p.hidden.data, in.n * in.h * elem));
    FLCE_ASSIGN_OR_RETURN(in.weight, Upload(lane, p.weight.data, in.v * in.h * elem));
    if (p.bias) {
      const std::vector<float> bias = TensorToFloats(*p.bias);
      FLCE_ASSIGN_OR_RETURN(in.bias, Upload(lane, bias.data(), in.v * 4));
      // The host vector must outlive the copy.
      FLCE_RETURN_IF_ERROR(Check(cudaStreamSynchronize(lane.stream.get()), "upload bias"));
    }
    if (p.target.dtype == DType::kInt64) {
      FLCE_ASSIGN_OR_RETURN(in.target, Upload(lane, p.target.data, in.n * 8));
    } else {
      FLCE_ASSIGN_OR_RETURN(DeviceBuffer narrow, Upload(lane, p.target.data, in.n * 4));
      FLCE_ASSIGN_OR_RETURN(in.target, DeviceBuffer::Allocate(in.n * 8, lane.stream.get()));
      FLCE_RETURN_IF_ERROR(Check(LaunchWidenTargets(narrow.as<int32_t>(), in.n,
                                                    in.target.as<int64_t>(), lane.stream.get()),
                                 "widen targets"));
    }
    in.class_weight_sum = static_cast<float>(in.v);
    if (p.class_weight) {
      FLCE_ASSIGN_OR_RETURN(in.class_weight, Upload(lane, p.class_weight->data, in.v * 4));
      double sum = 0;
      const float* w = static_cast<const float*>(p.class_weight->data);
      for (int64_t j = 0; j < in.v; ++j) sum += w[j];
      in.class_weight_sum = static_cast<float>(sum);
    }
    return in;
  }

  absl::StatusOr<RowBuffers> AllocateRows(Lane& lane, int64_t n) {
    RowBuffers b;
    cudaStream_t s = lane.stream.get();
    FLCE_ASSIGN_OR_RETURN(b.lse, DeviceBuffer::Allocate(n * 4, s));
    FLCE_ASSIGN_OR_RETURN(b.loss, DeviceBuffer::Allocate(n * 4, s));
    FLCE_ASSIGN_OR_RETURN(b.z_loss, DeviceBuffer::Allocate(n * 4, s));
    FLCE_ASSIGN_OR_RETURN(b.correct, DeviceBuffer::Allocate(n * 4, s));
    FLCE_ASSIGN_OR_RETURN(b.row_scale, DeviceBuffer::Allocate(n * 4, s));
    FLCE_ASSIGN_OR_RETURN(b.denom, DeviceBuffer::Allocate(8, s));
    FLCE_ASSIGN_OR_RETURN(b.num_valid, DeviceBuffer::Allocate(8, s));
    FLCE_ASSIGN_OR_RETURN(b.totals, DeviceBuffer::Allocate(3 * 8, s));
    FLCE_ASSIGN_OR_RETURN(b.row_factor, DeviceBuffer::Allocate(n * 4, s));
    FLCE_ASSIGN_OR_RETURN(b.redo, DeviceBuffer::Allocate(4, s));
    return b;
  }

  // Row scales and the reduction divisor; grad_output is a device pointer
  // (or null for 1).
  absl::Status RowScales(Lane& lane, const DeviceInputs& in, const float* grad_output,
                         int64_t grad_output_count, RowBuffers& rows) {
    return Check(LaunchRowScales(in.target.as<const int64_t>(), in.n, in.options.ignore_index,
                                 in.class_weight.bytes() > 0 ? in.class_weight.as<float>()
                                                             : nullptr,
                                 in.options.reduction == Reduction::kMean, grad_output,
                                 grad_output_count, rows.row_scale.as<float>(),
                                 rows.denom.as<double>(), rows.num_valid.as<int64_t>(),
                                 lane.stream.get()),
                 "row scales");
  }

  // The chunk loop, all on the lane's stream. dx, dw, db are fp32 device
  // outputs (db may be null); the gradient passes overwrite them.
  //
  // Chunks are as large as the budget allows: every chunk after the first
  // re-reads and re-writes the fp32 dW accumulator, which costs more than
  // the row kernel does (measured: two half-size buffers alternating so the
  // row kernels overlapped the neighbouring GEMMs ran 4-16% slower than one
  // buffer; bench/RESULTS.md).
  //
  // kLossAndGradOnePass reads each logit once: the row kernel leaves
  // unnormalised exponentials and per-row factors, the chunk's X rows scaled
  // by them (into its dX rows, which the dX GEMM overwrites after) feed the
  // dW GEMM, and the dX rows are scaled after theirs. rows.redo then says
  // whether the results must be thrown away and the call run again with
  // kLossAndGrad (LaunchOnePassRows).
  absl::Status RunChunks(Lane& lane, const DeviceInputs& in, Pass pass, const RowBuffers& rows,
                         const float* lse_in, float* dx, float* dw, float* db,
                         const CancelFn& cancelled, StageClock* clock = nullptr) {
    cudaStream_t s = lane.stream.get();
    const bool grad = pass != Pass::kLoss;
    const int64_t chunk = ChunkRows(in.n, in.v, in.dtype);
    const bool one_pass = pass == Pass::kLossAndGradOnePass;
    if (one_pass && !OnePassRows(in)) {
      return absl::InternalError("one-pass rows asked for rows that need two passes");
    }
    float* row_factor = one_pass ? rows.row_factor.as<float>() : nullptr;
    if (one_pass) {
      FLCE_RETURN_IF_ERROR(Check(cudaMemsetAsync(rows.redo.data(), 0, 4, s), "clear redo"));
    }
    if (grad && in.n == 0) {
      FLCE_RETURN_IF_ERROR(Check(cudaMemsetAsync(dw, 0, in.v * in.h * 4, s), "zero dW"));
      if (db) FLCE_RETURN_IF_ERROR(Check(cudaMemsetAsync(db, 0, in.v * 4, s), "zero db"));
    }
    FLCE_ASSIGN_OR_RETURN(
        DeviceBuffer logits,
        DeviceBuffer::Allocate(std::min(chunk, in.n) * in.v * DTypeSize(in.dtype), s));
    for (int64_t r0 = 0; r0 < in.n; r0 += chunk) {
      if (cancelled && cancelled()) return absl::CancelledError("cancelled between chunks");
      const int64_t count = std::min(chunk, in.n - r0);
      // logits[count, V] (row-major, input dtype) = X_c · Wᵀ. Column-major
      // view: logitsᵀ (V×count, ld V) = op(A)·op(B) with
      //   A = W, stored row-major [V, H] = column-major H×V (ld H), op T → V×H;
      //   B = X_c, stored row-major [count, H] = column-major H×count (ld H), op N.
      FLCE_RETURN_IF_ERROR(Gemm(lane, true, CUBLAS_OP_T, CUBLAS_OP_N, in.v, count, in.h,
                                in.weight.data(), in.dtype, in.h, in.x_row(r0), in.dtype, in.h,
                                0.0f, logits.data(), in.dtype, in.v));
      Mark(clock, "logits GEMM");
      const RowParams params = in.Params(r0, count);
      if (pass == Pass::kGradFromLse) {
        FLCE_RETURN_IF_ERROR(Check(LaunchGradientRows(params, logits.data(), in.dtype, lse_in,
                                                      rows.row_scale.as<float>(), s),
                                   "gradient rows"));
      } else if (one_pass) {
        FLCE_RETURN_IF_ERROR(Check(
            LaunchOnePassRows(params, logits.data(), in.dtype, rows.row_scale.as<float>(),
                              rows.outputs(), row_factor, rows.redo.as<int32_t>(), s),
            "one-pass rows"));
      } else {
        FLCE_RETURN_IF_ERROR(Check(LaunchForwardRows(params, logits.data(), in.dtype, grad,
                                                     rows.row_scale.as<float>(), rows.outputs(),
                                                     s),
                                   "forward rows"));
      }
      Mark(clock, "row kernel");
      if (!grad) continue;
      float* dx_c = dx + r0 * in.h;
      if (one_pass) {
        // Each row holds its gradient over its factor: the dW GEMM takes X_c's
        // rows times their factors, rounded to the input dtype, from the
        // chunk's dX rows (fp32, so large enough; the dX GEMM overwrites them
        // next), dX's rows are scaled after their GEMM, and the bias column
        // sums weigh each row by its factor.
        FLCE_RETURN_IF_ERROR(Check(LaunchScaleRows(in.x_row(r0), dx_c, in.dtype,
                                                   row_factor + r0, count, in.h, s),
                                   "scale X rows"));
        Mark(clock, "scale X rows");
        FLCE_RETURN_IF_ERROR(
            ChunkDw(lane, in, dx_c, count, logits.data(), r0 == 0, dw, clock));
        FLCE_RETURN_IF_ERROR(ChunkDx(lane, in, count, logits.data(), dx_c, clock));
        FLCE_RETURN_IF_ERROR(Check(
            LaunchScaleRows(dx_c, dx_c, DType::kFloat32, row_factor + r0, count, in.h, s),
            "scale dX rows"));
        Mark(clock, "scale dX rows");
      } else {
        FLCE_RETURN_IF_ERROR(ChunkDx(lane, in, count, logits.data(), dx_c, clock));
        FLCE_RETURN_IF_ERROR(
            ChunkDw(lane, in, in.x_row(r0), count, logits.data(), r0 == 0, dw, clock));
      }
      if (db) {
        FLCE_RETURN_IF_ERROR(Check(LaunchColumnSums(logits.data(), in.dtype, count, in.v, in.v,
                                                    one_pass ? row_factor + r0 : nullptr,
                                                    r0 > 0, db, s),
                                   "bias gradient"));
        Mark(clock, "bias gradient");
      }
    }
    return absl::OkStatus();
  }

  // dX_c[count, H] (row-major, fp32) = dZ · W for a chunk's gradient dz
  // [count, V]. Column-major view: dX_cᵀ (H×count, ld H) = A·B with
  //   A = W as column-major H×V (ld H), op N;
  //   B = dZ, stored row-major [count, V] = column-major V×count (ld V), op N.
  absl::Status ChunkDx(Lane& lane, const DeviceInputs& in, int64_t count, const void* dz,
                       float* dx_c, StageClock* clock) {
    FLCE_RETURN_IF_ERROR(Gemm(lane, false, CUBLAS_OP_N, CUBLAS_OP_N, in.h, count, in.v,
                              in.weight.data(), in.dtype, in.h, dz, in.dtype, in.v, 0.0f, dx_c,
                              DType::kFloat32, in.h));
    Mark(clock, "dX GEMM");
    return absl::OkStatus();
  }

  // dW[V, H] (row-major, fp32) (+)= dZᵀ · X_c for a chunk of `count` rows
  // of X at x (input dtype) and their gradient dz [count, V]. Column-major
  // view: dWᵀ (H×V, ld H) = A·op(B) with
  //   A = X_c as column-major H×count (ld H), op N;
  //   B = dZ as column-major V×count (ld V), op T → count×V.
  // The first chunk overwrites (beta 0): dW needs no zeroing pass.
  absl::Status ChunkDw(Lane& lane, const DeviceInputs& in, const void* x, int64_t count,
                       const void* dz, bool first, float* dw, StageClock* clock) {
    FLCE_RETURN_IF_ERROR(Gemm(lane, true, CUBLAS_OP_N, CUBLAS_OP_T, in.h, in.v, count, x,
                              in.dtype, in.h, dz, in.dtype, in.v, first ? 0.0f : 1.0f, dw,
                              DType::kFloat32, in.h));
    Mark(clock, first ? "dW GEMM, fp32, beta 0" : "dW GEMM, fp32, beta 1");
    return absl::OkStatus();
  }

  // The RECOMPUTE backward: dX (fp32 [N, H]), dW ([V, H] in `wdtype`,
  // device memory) and db (fp32 [V], or null) for the row scales in `rows`
  // and the saved `lse`.
  //
  // Over vocabulary slices of all rows where the budget allows: per slice
  // the logits GEMM, the gradient in place from the lse, dX += dZ_s·W_s
  // (fp32, beta 1 after the first slice: N×H is small) and dW_s = dZ_sᵀ·X
  // over every token in one GEMM, rounded once straight into its final
  // dtype: no fp32 dW accumulator, no pass over it per chunk and none to
  // narrow it. Else over token chunks into an fp32 accumulator, narrowed
  // into dw at the end.
  absl::Status RecomputeGradients(Lane& lane, const DeviceInputs& in, const RowBuffers& rows,
                                  const float* lse, float* dx, void* dw, DType wdtype,
                                  float* db, const CancelFn& cancelled,
                                  StageClock* clock = nullptr) {
    cudaStream_t s = lane.stream.get();
    const int64_t width = SliceColumns(in.n, in.v, in.dtype);
    if (width == 0) {
      if (wdtype == DType::kFloat32) {
        return RunChunks(lane, in, Pass::kGradFromLse, rows, lse, dx, static_cast<float*>(dw),
                         db, cancelled, clock);
      }
      FLCE_ASSIGN_OR_RETURN(DeviceBuffer dw32, DeviceBuffer::Allocate(in.v * in.h * 4, s));
      FLCE_RETURN_IF_ERROR(RunChunks(lane, in, Pass::kGradFromLse, rows, lse, dx,
                                     dw32.as<float>(), db, cancelled, clock));
      FLCE_RETURN_IF_ERROR(Check(
          LaunchConvert(dw32.data(), DType::kFloat32, dw, wdtype, in.v * in.h, 1.0f, s),
          "convert"));
      Mark(clock, "narrowing dW");
      return absl::OkStatus();
    }
    const int64_t welem = DTypeSize(wdtype);
    if (in.n == 0) {
      FLCE_RETURN_IF_ERROR(Check(cudaMemsetAsync(dw, 0, in.v * in.h * welem, s), "zero dW"));
      if (db) FLCE_RETURN_IF_ERROR(Check(cudaMemsetAsync(db, 0, in.v * 4, s), "zero db"));
      return absl::OkStatus();
    }
    const int64_t elem = DTypeSize(in.dtype);
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer logits, DeviceBuffer::Allocate(in.n * width * elem, s));
    for (int64_t c0 = 0; c0 < in.v; c0 += width) {
      if (cancelled && cancelled()) return absl::CancelledError("cancelled between slices");
      const int64_t cols = std::min(width, in.v - c0);
      const char* w_s = in.weight.as<const char>() + c0 * in.h * elem;
      // logits_s[N, cols] (row-major) = X · W_sᵀ. Column-major view:
      // logits_sᵀ (cols×N, ld cols) = op(A)·op(B) with
      //   A = W_s, rows c0.. of W: column-major H×cols (ld H), op T;
      //   B = X, column-major H×N (ld H), op N.
      FLCE_RETURN_IF_ERROR(Gemm(lane, false, CUBLAS_OP_T, CUBLAS_OP_N, cols, in.n, in.h, w_s,
                                in.dtype, in.h, in.hidden.data(), in.dtype, in.h, 0.0f,
                                logits.data(), in.dtype, cols));
      Mark(clock, "logits GEMM");
      FLCE_RETURN_IF_ERROR(Check(LaunchGradientRows(in.Params(0, in.n, c0, cols), logits.data(),
                                                    in.dtype, lse, rows.row_scale.as<float>(),
                                                    s),
                                 "gradient rows"));
      Mark(clock, "row kernel");
      // dX[N, H] (+)= dZ_s · W_s. Column-major view: dXᵀ (H×N, ld H) = A·B
      // with A = W_s (H×cols, ld H), op N; B = dZ_s (cols×N, ld cols), op N.
      FLCE_RETURN_IF_ERROR(Gemm(lane, false, CUBLAS_OP_N, CUBLAS_OP_N, in.h, in.n, cols, w_s,
                                in.dtype, in.h, logits.data(), in.dtype, cols,
                                c0 == 0 ? 0.0f : 1.0f, dx, DType::kFloat32, in.h));
      Mark(clock, "dX GEMM");
      // dW_s[cols, H] = dZ_sᵀ · X. Column-major view: dW_sᵀ (H×cols, ld H)
      // = A·op(B) with A = X (H×N, ld H), op N; B = dZ_s (cols×N, ld cols),
      // op T → N×cols.
      FLCE_RETURN_IF_ERROR(Gemm(lane, false, CUBLAS_OP_N, CUBLAS_OP_T, in.h, cols, in.n,
                                in.hidden.data(), in.dtype, in.h, logits.data(), in.dtype, cols,
                                0.0f, static_cast<char*>(dw) + c0 * in.h * welem, wdtype, in.h));
      Mark(clock, "dW GEMM, final dtype");
      if (db) {
        FLCE_RETURN_IF_ERROR(Check(
            LaunchColumnSums(logits.data(), in.dtype, in.n, cols, cols, nullptr, false, db + c0,
                             s),
            "bias gradient"));
        Mark(clock, "bias gradient");
      }
    }
    return absl::OkStatus();
  }

  // Elements converted per slice when narrowing fp32 results: bounds the
  // conversion buffer (64 MiB of bf16) whatever the size of dW.
  static constexpr int64_t kSliceElements = int64_t{32} << 20;

  // Converts `count` fp32 device elements × scale to `dtype` slice by slice
  // into `slice` (kSliceElements of dtype) and hands each slice to `sink`
  // (device pointer, first element, element count), in stream order.
  template <typename Sink>
  absl::Status ConvertInSlices(Lane& lane, const float* src32, int64_t count, DType dtype,
                               float scale, DeviceBuffer& slice, Sink&& sink) {
    cudaStream_t s = lane.stream.get();
    for (int64_t first = 0; first < count; first += kSliceElements) {
      const int64_t m = std::min(kSliceElements, count - first);
      FLCE_RETURN_IF_ERROR(Check(
          LaunchConvert(src32 + first, DType::kFloat32, slice.data(), dtype, m, scale, s),
          "convert"));
      FLCE_RETURN_IF_ERROR(sink(slice.data(), first, m));
    }
    return absl::OkStatus();
  }

  // An fp32 device buffer × scale, rounded once on the device to `dtype`,
  // as a new host tensor or, with `to`, written there (device memory
  // directly, or added to what it holds when `to` accumulates; host memory
  // through the conversion slice) and returned without bytes.
  absl::StatusOr<HostTensor> Download(Lane& lane, const DeviceBuffer& src32,
                                      std::vector<int64_t> shape, DType dtype, float scale,
                                      const std::optional<GradientDestination>& to) {
    HostTensor out;
    out.dtype = dtype;
    out.shape = std::move(shape);
    const int64_t count = out.num_elements();
    cudaStream_t s = lane.stream.get();
    if (to && to->space == MemorySpace::kCuda) {
      if (count > 0) {
        FLCE_RETURN_IF_ERROR(Check(
            to->accumulate ? LaunchAccumulate(src32.as<float>(), static_cast<float*>(to->data),
                                              count, scale, s)
                           : LaunchConvert(src32.data(), DType::kFloat32, to->data, dtype, count,
                                           scale, s),
            "convert"));
      }
      FLCE_RETURN_IF_ERROR(Check(cudaStreamSynchronize(s), "download"));
      return out;
    }
    const int64_t elem = DTypeSize(dtype);
    char* dst = to ? static_cast<char*>(to->data) : nullptr;
    if (dst == nullptr) {
      out = HostTensor(dtype, out.shape);
      dst = out.data.data();
    }
    if (count == 0) return out;
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer slice,
                          DeviceBuffer::Allocate(std::min(count, kSliceElements) * elem, s));
    FLCE_RETURN_IF_ERROR(ConvertInSlices(
        lane, src32.as<float>(), count, dtype, scale, slice,
        [&](const void* data, int64_t first, int64_t m) {
          return Check(cudaMemcpyAsync(dst + first * elem, data, m * elem,
                                       cudaMemcpyDeviceToHost, s),
                       "download");
        }));
    FLCE_RETURN_IF_ERROR(Check(cudaStreamSynchronize(s), "download"));
    return out;
  }

  // A device tensor already in its final dtype, as a new host tensor or,
  // with a host `to`, copied there; with a device `to` it is there already
  // (`src` is that memory) and is returned without bytes.
  absl::StatusOr<HostTensor> CopyDown(Lane& lane, const void* src, std::vector<int64_t> shape,
                                      DType dtype, const std::optional<GradientDestination>& to) {
    HostTensor out;
    out.dtype = dtype;
    out.shape = std::move(shape);
    cudaStream_t s = lane.stream.get();
    if (!(to && to->space == MemorySpace::kCuda)) {
      void* dst = to ? to->data : nullptr;
      if (dst == nullptr) {
        out = HostTensor(dtype, out.shape);
        dst = out.data.data();
      }
      const int64_t bytes = out.num_elements() * DTypeSize(dtype);
      if (bytes > 0) {
        FLCE_RETURN_IF_ERROR(
            Check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s), "download"));
      }
    }
    FLCE_RETURN_IF_ERROR(Check(cudaStreamSynchronize(s), "download"));
    return out;
  }

  absl::StatusOr<ForwardResult> Forward(const LossProblem& problem, const ForwardSpec& spec,
                                        const CancelFn& cancelled) {
    FLCE_RETURN_IF_ERROR(health());
    FLCE_RETURN_IF_ERROR(SetDevice());
    LaneLease lane(this);
    cudaStream_t s = lane->stream.get();
    FLCE_ASSIGN_OR_RETURN(DeviceInputs in, UploadProblem(*lane, problem));
    const int64_t n = in.n;
    FLCE_ASSIGN_OR_RETURN(RowBuffers rows, AllocateRows(*lane, n));
    const bool store = spec.need_backward && spec.mode == BackwardMode::kStoreGrads;
    if (store && in.options.reduction == Reduction::kNone) {
      return absl::InternalError("STORE_GRADS with reduction none");
    }
    FLCE_RETURN_IF_ERROR(RowScales(*lane, in, nullptr, 0, rows));
    std::unique_ptr<StoredGradients> grads;
    if (store) {
      grads = std::make_unique<StoredGradients>();
      grads->dtype = in.dtype;
      grads->n = n;
      grads->h = in.h;
      grads->v = in.v;
      FLCE_ASSIGN_OR_RETURN(grads->dx, DeviceBuffer::Allocate(n * in.h * 4, s));
      FLCE_ASSIGN_OR_RETURN(grads->dw, DeviceBuffer::Allocate(in.v * in.h * 4, s));
      if (in.bias.bytes() > 0) {
        FLCE_ASSIGN_OR_RETURN(grads->db, DeviceBuffer::Allocate(in.v * 4, s));
      }
    }
    const bool divide = in.options.reduction == Reduction::kMean;
    double totals[3];
    int64_t num_valid = 0;
    int32_t redo = 0;
    ForwardResult result;
    // The chunks, the totals and the per-row results the spec asks for,
    // downloaded; waits for them.
    auto run = [&](Pass pass) -> absl::Status {
      FLCE_RETURN_IF_ERROR(RunChunks(
          *lane, in, pass, rows, nullptr, store ? grads->dx.as<float>() : nullptr,
          store ? grads->dw.as<float>() : nullptr,
          store && grads->db.bytes() > 0 ? grads->db.as<float>() : nullptr, cancelled));
      FLCE_RETURN_IF_ERROR(Check(LaunchReduceRows(rows.outputs(), n, rows.denom.as<double>(),
                                                  divide, rows.totals.as<double>(), s),
                                 "reduce rows"));
      FLCE_RETURN_IF_ERROR(Check(cudaMemcpyAsync(totals, rows.totals.data(), sizeof(totals),
                                                 cudaMemcpyDeviceToHost, s),
                                 "download totals"));
      FLCE_RETURN_IF_ERROR(Check(cudaMemcpyAsync(&num_valid, rows.num_valid.data(), 8,
                                                 cudaMemcpyDeviceToHost, s),
                                 "download totals"));
      if (pass == Pass::kLossAndGradOnePass) {
        FLCE_RETURN_IF_ERROR(Check(
            cudaMemcpyAsync(&redo, rows.redo.data(), 4, cudaMemcpyDeviceToHost, s), "redo"));
      }
      auto download_rows = [&](const DeviceBuffer& src, HostTensor& dst) -> absl::Status {
        dst = HostTensor(DType::kFloat32, {n});
        if (n == 0) return absl::OkStatus();
        return Check(
            cudaMemcpyAsync(&dst.data[0], src.data(), n * 4, cudaMemcpyDeviceToHost, s),
            "download rows");
      };
      if (in.options.reduction == Reduction::kNone) {
        FLCE_RETURN_IF_ERROR(download_rows(rows.loss, result.loss));
        FLCE_RETURN_IF_ERROR(download_rows(rows.z_loss, result.z_loss));
      }
      if (spec.want_lse) {
        result.lse.emplace();
        FLCE_RETURN_IF_ERROR(download_rows(rows.lse, *result.lse));
      }
      if (spec.want_per_row_loss) {
        result.per_row_loss.emplace();
        FLCE_RETURN_IF_ERROR(download_rows(rows.loss, *result.per_row_loss));
      }
      return Check(cudaStreamSynchronize(s), "Forward");
    };
    FLCE_RETURN_IF_ERROR(run(store ? StoreGradsPass(in) : Pass::kLoss));
    if (redo != 0) {
      // A row out of the one-pass kernel's range: every result again with
      // two passes (they overwrite all of them).
      forward_reruns_.fetch_add(1);
      FLCE_RETURN_IF_ERROR(run(Pass::kLossAndGrad));
    }
    if (in.options.reduction != Reduction::kNone) {
      result.loss = HostTensor(DType::kFloat32, {});
      result.z_loss = HostTensor(DType::kFloat32, {});
      result.loss.mutable_data<float>()[0] = static_cast<float>(totals[0]);
      result.z_loss.mutable_data<float>()[0] = static_cast<float>(totals[1]);
    }
    result.num_valid = num_valid;
    result.num_correct = static_cast<int64_t>(totals[2]);
    if (store) {
      result.saved = std::move(grads);
    } else if (spec.need_backward) {
      auto saved = std::make_unique<RecomputeState>();
      saved->lse = std::move(rows.lse);
      saved->inputs = std::move(in);
      result.saved = std::move(saved);
    }
    return result;
  }

  absl::StatusOr<Gradients> Backward(SavedState& state, const BackwardSpec& spec,
                                     const CancelFn& cancelled) {
    FLCE_RETURN_IF_ERROR(health());
    FLCE_RETURN_IF_ERROR(SetDevice());
    LaneLease lane(this);
    cudaStream_t s = lane->stream.get();
    std::vector<float> g;
    if (spec.grad_output) g = TensorToFloats(*spec.grad_output);
    FLCE_RETURN_IF_ERROR(CheckAccumulating(spec, state));
    Gradients out;
    if (auto* stored = dynamic_cast<StoredGradients*>(&state)) {
      const DType dtype = spec.hidden_dtype(stored->dtype);
      const DType wdtype = spec.weight_dtype(stored->dtype);
      const float scale = g.empty() ? 1.0f : g[0];
      FLCE_ASSIGN_OR_RETURN(out.grad_hidden, Download(*lane, stored->dx, {stored->n, stored->h},
                                                      dtype, scale, spec.grad_hidden_to));
      FLCE_ASSIGN_OR_RETURN(out.grad_weight, Download(*lane, stored->dw, {stored->v, stored->h},
                                                      wdtype, scale, spec.grad_weight_to));
      if (stored->db.bytes() > 0) {
        FLCE_ASSIGN_OR_RETURN(out.grad_bias, Download(*lane, stored->db, {stored->v}, wdtype,
                                                      scale, spec.grad_bias_to));
      }
      return out;
    }
    auto* saved = dynamic_cast<RecomputeState*>(&state);
    if (saved == nullptr) {
      return absl::InternalError("saved state was not made by the CUDA engine");
    }
    const DeviceInputs& in = saved->inputs;
    FLCE_ASSIGN_OR_RETURN(RowBuffers rows, AllocateRows(*lane, in.n));
    DeviceBuffer g_device;
    if (!g.empty()) {
      FLCE_ASSIGN_OR_RETURN(g_device, Upload(*lane, g.data(), static_cast<int64_t>(g.size()) * 4));
    }
    FLCE_RETURN_IF_ERROR(RowScales(*lane, in, g.empty() ? nullptr : g_device.as<float>(),
                                   static_cast<int64_t>(g.size()), rows));
    const DType dtype = spec.hidden_dtype(in.dtype);
    const DType wdtype = spec.weight_dtype(in.dtype);
    FLCE_ASSIGN_OR_RETURN(DeviceBuffer dx, DeviceBuffer::Allocate(in.n * in.h * 4, s));
    // dW is made in its final dtype: straight into the caller's device
    // memory, or into a buffer that is copied down.
    // An accumulating destination gets dW added only once all of it is
    // made (a cancelled call leaves the accumulator as it was).
    const bool dw_in_place = spec.grad_weight_to &&
                             spec.grad_weight_to->space == MemorySpace::kCuda &&
                             !spec.grad_weight_to->accumulate;
    DeviceBuffer dw;
    if (!dw_in_place) {
      FLCE_ASSIGN_OR_RETURN(dw, DeviceBuffer::Allocate(in.v * in.h * DTypeSize(wdtype), s));
    }
    void* dw_out = dw_in_place ? spec.grad_weight_to->data : dw.data();
    DeviceBuffer db;
    if (in.bias.bytes() > 0) {
      FLCE_ASSIGN_OR_RETURN(db, DeviceBuffer::Allocate(in.v * 4, s));
    }
    FLCE_RETURN_IF_ERROR(RecomputeGradients(*lane, in, rows, saved->lse.as<float>(),
                                            dx.as<float>(), dw_out, wdtype,
                                            db.bytes() > 0 ? db.as<float>() : nullptr,
                                            cancelled));
    // g (host) must outlive its upload: Download synchronises the stream.
    FLCE_ASSIGN_OR_RETURN(out.grad_hidden, Download(*lane, dx, {in.n, in.h}, dtype, 1.0f,
                                                    spec.grad_hidden_to));
    if (spec.grad_weight_to && spec.grad_weight_to->accumulate) {
      FLCE_ASSIGN_OR_RETURN(out.grad_weight, Download(*lane, dw, {in.v, in.h}, wdtype, 1.0f,
                                                      spec.grad_weight_to));
    } else {
      FLCE_ASSIGN_OR_RETURN(out.grad_weight,
                            CopyDown(*lane, dw_out, {in.v, in.h}, wdtype, spec.grad_weight_to));
    }
    if (db.bytes() > 0) {
      FLCE_ASSIGN_OR_RETURN(out.grad_bias,
                            Download(*lane, db, {in.v}, wdtype, 1.0f, spec.grad_bias_to));
    }
    return out;
  }

  // Accumulating destinations: dW and db only, in device memory, fp32.
  static absl::Status CheckAccumulating(const BackwardSpec& spec, const SavedState& state) {
    if (spec.grad_hidden_to && spec.grad_hidden_to->accumulate) {
      return absl::InvalidArgumentError("grad_hidden_out: dX is never accumulated");
    }
    const auto* stored = dynamic_cast<const StoredGradients*>(&state);
    const auto* saved = dynamic_cast<const RecomputeState*>(&state);
    if (stored == nullptr && saved == nullptr) return absl::OkStatus();  // Backward says so
    const DType input = stored != nullptr ? stored->dtype : saved->inputs.dtype;
    for (const auto* to : {&spec.grad_weight_to, &spec.grad_bias_to}) {
      if (*to && (*to)->accumulate &&
          ((*to)->space != MemorySpace::kCuda || spec.weight_dtype(input) != DType::kFloat32)) {
        return absl::InvalidArgumentError(
            "an accumulating gradient destination must be fp32 device memory");
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<DeviceBlock>> AllocateDeviceMemory(int64_t bytes) {
    FLCE_RETURN_IF_ERROR(health());
    FLCE_RETURN_IF_ERROR(SetDevice());
    void* data = nullptr;
    const cudaError_t error = cudaMalloc(&data, static_cast<size_t>(std::max<int64_t>(bytes, 1)));
    if (error == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("device memory: ", bytes, " bytes do not fit on the GPU"));
    }
    FLCE_RETURN_IF_ERROR(Check(error, "cudaMalloc"));
    auto memory = std::make_unique<OwnedDeviceBlock>(options_.device, data, bytes, allocated_);
    FLCE_RETURN_IF_ERROR(Check(cudaMemset(data, 0, bytes), "zero device memory"));
    return std::unique_ptr<DeviceBlock>(std::move(memory));
  }

  absl::Status CopyDeviceToHost(const void* device, void* host, int64_t bytes) {
    FLCE_RETURN_IF_ERROR(health());
    FLCE_RETURN_IF_ERROR(SetDevice());
    // The lanes' streams are non-blocking: wait for their work first.
    FLCE_RETURN_IF_ERROR(Check(cudaDeviceSynchronize(), "copy to host"));
    return Check(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost), "copy to host");
  }

  int64_t allocated_bytes() const { return allocated_->load(); }

  absl::Status CopyHostToDevice(const void* host, void* device, int64_t bytes) {
    FLCE_RETURN_IF_ERROR(health());
    FLCE_RETURN_IF_ERROR(SetDevice());
    return Check(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice), "copy to device");
  }

  absl::StatusOr<std::unique_ptr<DeviceBlock>> ImportCudaIpcMemory(
      const std::string& handle) {
    FLCE_RETURN_IF_ERROR(health());
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(absl::StrCat("cuda_ipc_handle: expected ",
                                                     sizeof(cudaIpcMemHandle_t),
                                                     " bytes (cudaIpcMemHandle_t), got ",
                                                     handle.size()));
    }
    FLCE_RETURN_IF_ERROR(SetDevice());
    cudaIpcMemHandle_t ipc;
    std::memcpy(&ipc, handle.data(), sizeof(ipc));
    void* base = nullptr;
    const cudaError_t error = cudaIpcOpenMemHandle(&base, ipc, cudaIpcMemLazyEnablePeerAccess);
    if (error != cudaSuccess) {
      if (IsStickyError(error)) return Check(error, "cudaIpcOpenMemHandle");
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda_ipc_handle: cannot open it (", cudaGetErrorName(error),
          "); it must come from cudaIpcGetMemHandle in another process on this host, "
          "for an allocation that is still alive"));
    }
    absl::StatusOr<int64_t> bytes = AllocationBytes(base);
    if (!bytes.ok()) {
      cudaIpcCloseMemHandle(base);
      return bytes.status();
    }
    return std::unique_ptr<DeviceBlock>(new IpcMemory(options_.device, base, *bytes));
  }

  // Benchmark path: inputs resident, Forward + Backward device work only.
  class DeviceRunImpl : public CudaEngine::DeviceRun {
   public:
    DeviceRunImpl(EngineImpl* impl, BackwardMode mode) : impl_(impl), mode_(mode) {}

    absl::Status Prepare(const LossProblem& problem) {
      FLCE_RETURN_IF_ERROR(impl_->SetDevice());
      LaneLease lane(impl_);
      cudaStream_t s = lane->stream.get();
      FLCE_ASSIGN_OR_RETURN(in_, impl_->UploadProblem(*lane, problem));
      FLCE_ASSIGN_OR_RETURN(rows_, impl_->AllocateRows(*lane, in_.n));
      FLCE_ASSIGN_OR_RETURN(dx_, DeviceBuffer::Allocate(in_.n * in_.h * 4, s));
      // STORE_GRADS keeps dW as an fp32 accumulator; RECOMPUTE makes it in
      // the input dtype (Backward's default).
      const int64_t dw_elem = mode_ == BackwardMode::kStoreGrads ? 4 : DTypeSize(in_.dtype);
      FLCE_ASSIGN_OR_RETURN(dw_, DeviceBuffer::Allocate(in_.v * in_.h * dw_elem, s));
      if (in_.bias.bytes() > 0) {
        FLCE_ASSIGN_OR_RETURN(db_, DeviceBuffer::Allocate(in_.v * 4, s));
      }
      return impl_->Check(cudaStreamSynchronize(s), "prepare");
    }

    absl::StatusOr<double> Run() override { return RunWith(nullptr); }

    absl::StatusOr<std::map<std::string, double>> RunStages() override {
      std::map<std::string, double> stages;
      FLCE_RETURN_IF_ERROR(RunWith(&stages).status());
      return stages;
    }

    int64_t gradient_bytes() const override { return dx_.bytes() + dw_.bytes(); }

   private:
    // One run, its device milliseconds; with `stages`, also timed stage by
    // stage into it.
    absl::StatusOr<double> RunWith(std::map<std::string, double>* stages) {
      FLCE_RETURN_IF_ERROR(impl_->SetDevice());
      LaneLease lane(impl_);
      cudaStream_t s = lane->stream.get();
      std::optional<StageClock> timer;
      if (stages != nullptr) timer.emplace(s);
      StageClock* clock = timer ? &*timer : nullptr;
      EventTimer events;
      absl::StatusOr<float> ms = events.Time(s, [&]() -> absl::Status {
        Mark(clock, "start");
        FLCE_RETURN_IF_ERROR(impl_->RowScales(*lane, in_, nullptr, 0, rows_));
        Mark(clock, "row scales and reductions");
        if (mode_ == BackwardMode::kStoreGrads) {
          // As Forward: one pass where possible, and when a row asks for
          // it (never on the benchmark's data), again with two.
          const Pass pass = impl_->StoreGradsPass(in_);
          FLCE_RETURN_IF_ERROR(impl_->RunChunks(*lane, in_, pass, rows_, nullptr,
                                                dx_.as<float>(), dw_.as<float>(), db(),
                                                nullptr, clock));
          if (pass == Pass::kLossAndGradOnePass) {
            int32_t redo = 0;
            FLCE_RETURN_IF_ERROR(impl_->Check(
                cudaMemcpyAsync(&redo, rows_.redo.data(), 4, cudaMemcpyDeviceToHost, s), "redo"));
            FLCE_RETURN_IF_ERROR(impl_->Check(cudaStreamSynchronize(s), "redo"));
            if (redo != 0) {
              FLCE_RETURN_IF_ERROR(impl_->RunChunks(*lane, in_, Pass::kLossAndGrad, rows_,
                                                    nullptr, dx_.as<float>(), dw_.as<float>(),
                                                    db(), nullptr, clock));
            }
          }
        } else {
          FLCE_RETURN_IF_ERROR(impl_->RunChunks(*lane, in_, Pass::kLoss, rows_, nullptr, nullptr,
                                                nullptr, nullptr, nullptr, clock));
          FLCE_RETURN_IF_ERROR(impl_->RecomputeGradients(
              *lane, in_, rows_, rows_.lse.as<float>(), dx_.as<float>(), dw_.data(), in_.dtype,
              db(), nullptr, clock));
        }
        FLCE_RETURN_IF_ERROR(impl_->Check(
            LaunchReduceRows(rows_.outputs(), in_.n, rows_.denom.as<double>(), true,
                             rows_.totals.as<double>(), s),
            "reduce rows"));
        Mark(clock, "row scales and reductions");
        // The gradients narrowed to their final dtype, as Backward does
        // before its download (the chunk buffer is free again by now).
        FLCE_ASSIGN_OR_RETURN(DeviceBuffer slice,
                              DeviceBuffer::Allocate(kSliceElements * DTypeSize(in_.dtype), s));
        auto no_download = [](const void*, int64_t, int64_t) { return absl::OkStatus(); };
        FLCE_RETURN_IF_ERROR(impl_->ConvertInSlices(*lane, dx_.as<float>(), in_.n * in_.h,
                                                    in_.dtype, 1.0f, slice, no_download));
        Mark(clock, "narrowing dX");
        if (mode_ == BackwardMode::kStoreGrads) {
          FLCE_RETURN_IF_ERROR(impl_->ConvertInSlices(*lane, dw_.as<float>(), in_.v * in_.h,
                                                      in_.dtype, 1.0f, slice, no_download));
          Mark(clock, "narrowing dW");
        }
        return absl::OkStatus();
      });
      // Time() waited for its stop event only when everything was queued.
      FLCE_RETURN_IF_ERROR(impl_->Check(cudaStreamSynchronize(s), "run"));
      FLCE_RETURN_IF_ERROR(ms.status());
      if (clock != nullptr) *stages = clock->Totals();
      return static_cast<double>(*ms);
    }

    EngineImpl* impl_;
    BackwardMode mode_;
    DeviceInputs in_;
    RowBuffers rows_;
    float* db() const { return db_.bytes() > 0 ? db_.as<float>() : nullptr; }

    DeviceBuffer dx_, dw_, db_;  // db_ with a bias only
  };

 private:
  const CudaEngineOptions options_;
  const cudaDeviceProp props_;
  std::unique_ptr<GemmRunner> gemms_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  mutable absl::Mutex mu_;
  std::vector<Lane*> free_lanes_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> healthy_{true};
  // Forward calls whose one-pass rows asked for the two-pass rerun.
  std::atomic<int64_t> forward_reruns_{0};
  // Bytes of DeviceMemory::Allocate's blocks alive.
  const std::shared_ptr<std::atomic<int64_t>> allocated_ =
      std::make_shared<std::atomic<int64_t>>(0);
  std::string sticky_error_ ABSL_GUARDED_BY(mu_);
};

// The engine's device memory, as the registries see it.
class EngineDeviceMemory final : public DeviceMemory {
 public:
  explicit EngineDeviceMemory(EngineImpl* impl) : impl_(impl) {}
  absl::StatusOr<std::unique_ptr<DeviceBlock>> ImportCudaIpc(const std::string& handle) override {
    return impl_->ImportCudaIpcMemory(handle);
  }
  absl::StatusOr<std::unique_ptr<DeviceBlock>> Allocate(int64_t bytes) override {
    return impl_->AllocateDeviceMemory(bytes);
  }
  absl::Status CopyToHost(const void* device, void* host, int64_t bytes) override {
    return impl_->CopyDeviceToHost(device, host, bytes);
  }
  absl::Status CopyToDevice(const void* host, void* device, int64_t bytes) override {
    return impl_->CopyHostToDevice(host, device, bytes);
  }

 private:
  EngineImpl* const impl_;
};

}  // namespace internal_cuda

absl::StatusOr<std::unique_ptr<CudaEngine>> CudaEngine::Create(const CudaEngineOptions& options) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("no usable CUDA device: ", cudaGetErrorString(error)));
  }
  if (options.device < 0 || options.device >= count) {
    return absl::UnavailableError(absl::StrCat("CUDA device ", options.device,
                                               " not present (", count, " device(s))"));
  }
  FLCE_RETURN_IF_ERROR(internal_cuda::CudaStatus(cudaSetDevice(options.device), "cudaSetDevice"));
  cudaDeviceProp props;
  FLCE_RETURN_IF_ERROR(internal_cuda::CudaStatus(
      cudaGetDeviceProperties(&props, options.device), "cudaGetDeviceProperties"));
  // Keep freed memory in the stream-ordered pool so requests reuse it.
  cudaMemPool_t pool;
  FLCE_RETURN_IF_ERROR(internal_cuda::CudaStatus(
      cudaDeviceGetDefaultMemPool(&pool, options.device), "cudaDeviceGetDefaultMemPool"));
  uint64_t threshold = std::numeric_limits<uint64_t>::max();
  FLCE_RETURN_IF_ERROR(internal_cuda::CudaStatus(
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
      "cudaMemPoolSetAttribute"));
  auto impl = std::make_unique<internal_cuda::EngineImpl>(options, props);
  FLCE_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<CudaEngine>(new CudaEngine(std::move(impl)));
}

CudaEngine::CudaEngine(std::unique_ptr<internal_cuda::EngineImpl> impl)
    : impl_(std::move(impl)),
      memory_(std::make_unique<internal_cuda::EngineDeviceMemory>(impl_.get())) {}

CudaEngine::~CudaEngine() = default;

std::vector<DeviceInfo> CudaEngine::devices() const {
  DeviceInfo info;
  info.name = impl_->props().name;
  info.total_memory_bytes = static_cast<int64_t>(impl_->props().totalGlobalMem);
  return {info};
}

absl::Status CudaEngine::health() const { return impl_->health(); }

int CudaEngine::tuned_gemm_shapes() const { return impl_->gemms().counts().tuned; }

int64_t CudaEngine::forward_reruns() const { return impl_->forward_reruns(); }

int64_t CudaEngine::device_memory_bytes() const {
  // The stream-ordered pool's reservation (freed workspace stays in it) and
  // the long-lived allocations (registered weights, their accumulators).
  cudaMemPool_t pool;
  uint64_t reserved = 0;
  if (cudaDeviceGetDefaultMemPool(&pool, impl_->device()) != cudaSuccess ||
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved) !=
          cudaSuccess) {
    cudaGetLastError();
    return impl_->allocated_bytes();
  }
  return static_cast<int64_t>(reserved) + impl_->allocated_bytes();
}

int64_t CudaEngine::SavedStateBytes(const LossProblem& p, BackwardMode mode) const {
  const int64_t n = p.rows(), h = p.hidden_size(), v = p.vocab();
  if (mode == BackwardMode::kStoreGrads) {
    return (n * h + v * h + (p.bias ? v : 0)) * int64_t{4};
  }
  return (n * h + v * h) * DTypeSize(p.hidden.dtype) + (p.bias ? v * 4 : 0) + n * 8 +
         (p.class_weight ? v * 4 : 0) + n * 4;
}

absl::StatusOr<ForwardResult> CudaEngine::Forward(const LossProblem& problem,
                                                  const ForwardSpec& spec,
                                                  const CancelFn& cancelled) {
  return impl_->Forward(problem, spec, cancelled);
}

absl::StatusOr<Gradients> CudaEngine::Backward(SavedState& state, const BackwardSpec& spec,
                                               const CancelFn& cancelled) {
  return impl_->Backward(state, spec, cancelled);
}

DeviceMemory* CudaEngine::device_memory() const { return memory_.get(); }

absl::StatusOr<std::unique_ptr<CudaEngine::DeviceRun>> CudaEngine::PrepareDeviceRun(
    const LossProblem& problem, BackwardMode mode) {
  auto run = std::make_unique<internal_cuda::EngineImpl::DeviceRunImpl>(impl_.get(), mode);
  FLCE_RETURN_IF_ERROR(run->Prepare(problem));
  return std::unique_ptr<DeviceRun>(std::move(run));
}

}  // namespace flce
