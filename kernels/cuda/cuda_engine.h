#ifndef FLCE_KERNELS_CUDA_CUDA_ENGINE_H_
#define FLCE_KERNELS_CUDA_CUDA_ENGINE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_engine_options.h"
#include "kernels/cuda/device_run.h"
#include "kernels/loss_engine.h"

namespace flce {

namespace internal_cuda {
class EngineImpl;
}  // namespace internal_cuda

// The CUDA engine (a map of its files: DESIGN.md, "CUDA engine"). Per token chunk: the logits GEMM
// on cuBLAS (input-dtype operands, fp32 accumulation, logits in the input dtype as PyTorch's
// F.linear gives them) into a reused chunk buffer; one fused row kernel
// (online max/sum-exp, loss, lse, z-loss, softcap, smoothing, class weights,
// ignore_index, accuracy, all in fp32) that writes the gradient in place over
// the logits; then dX = dZ·W and dW += dZᵀ·X (fp32 across chunks), db
// likewise. bf16/fp32 rows without label smoothing read each logit once
// in STORE_GRADS instead (one_pass_rows: unnormalised exponentials in
// place, per-row factors applied to X's rows before the dW GEMM, to dX's
// rows after theirs and to db's column sums). The RECOMPUTE backward instead slices the vocabulary,
// all rows at once where the budget allows: per slice dX += dZ_s·W_s (fp32) and dW_s = dZ_sᵀ·X in
// one GEMM, written in its final dtype. No host synchronisation inside the chunk loop. X and W that
// live on the engine's device (MemorySpace::kCuda) are read in place, never copied. Device OOM is
// RESOURCE_EXHAUSTED and the engine keeps serving; after a sticky CUDA error, wherever it surfaces,
// every call is UNAVAILABLE (see health(); device_health.h decides).
class CudaEngine : public LossEngine {
 public:
  // UNAVAILABLE when no usable CUDA device is present (the message says why).
  static absl::StatusOr<std::unique_ptr<CudaEngine>> Create(const CudaEngineOptions& options = {});
  ~CudaEngine() override;

  std::string backend() const override { return "cuda"; }
  std::vector<DeviceInfo> devices() const override;
  absl::Status health() const override;
  int64_t device_memory_bytes() const override;
  int64_t forward_reruns() const override;
  bool supports_vocab_shards() const override { return true; }
  int64_t SavedStateBytes(const LossProblem& problem, BackwardMode mode) const override;
  absl::StatusOr<ForwardResult> Forward(const LossProblem& problem, const ForwardSpec& spec,
                                        const CancelFn& cancelled) override;
  absl::StatusOr<Gradients> Backward(SavedState& state, const BackwardSpec& spec,
                                     const CancelFn& cancelled) override;
  // Blocks on this engine's device, CUDA IPC imports, and copies.
  DeviceMemory* device_memory() const override;

  // GEMM shapes whose algorithm has been tuned so far (tune_gemms).
  int tuned_gemm_shapes() const;
  // GEMM shapes that run flce's Hopper GEMM (CudaEngineOptions::hopper_*).
  int hopper_gemm_shapes() const;

  // The next GEMM any call runs meets a sticky device error (a trapping
  // kernel before it), as a fault inside cuBLAS would: for tests of the
  // health path. The process's CUDA context is unusable after it.
  void InjectGemmFaultForTesting();

  // For benchmarks: X and W of `problem` uploaded once, then each
  // DeviceRun::Run() runs the served Forward(need_backward, mode) +
  // Backward(grad_output 1) pipeline with X and W read in place on the
  // device and the gradients delivered into device memory (no host
  // transfers of them), and waits.
  // REQUIRES: `problem`'s host tensors stay valid while the run lives.
  absl::StatusOr<std::unique_ptr<DeviceRun>> PrepareDeviceRun(const LossProblem& problem,
                                                              BackwardMode mode);

 private:
  explicit CudaEngine(std::unique_ptr<internal_cuda::EngineImpl> impl);
  std::unique_ptr<internal_cuda::EngineImpl> impl_;
};

}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_CUDA_ENGINE_H_
