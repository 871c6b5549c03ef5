#ifndef FLCE_BENCH_CUBLAS_FLOOR_H_
#define FLCE_BENCH_CUBLAS_FLOOR_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/dtype.h"

namespace flce {

// The bare cuBLAS GEMMs of the loss at full size, with `dtype` operands and
// outputs (as torch.mm): logits = X·Wᵀ [N, V] (twice for RECOMPUTE), then
// dX = dZ·W and dW = dZᵀ·X, on random-ish data (never zeros). This is the
// floor an engine is measured against: 3 GEMMs for STORE_GRADS, 4 for
// RECOMPUTE. Its buffers live as long as the object, so a benchmark can
// alternate it with the engine's runs.
class GemmFloor {
 public:
  static absl::StatusOr<std::unique_ptr<GemmFloor>> Create(int64_t n, int64_t h, int64_t v,
                                                           DType dtype, int logits_gemms);
  ~GemmFloor();

  // Runs the GEMM sequence once and waits for it: milliseconds between
  // CUDA events around it.
  absl::StatusOr<double> RunMs();

 private:
  struct State;
  explicit GemmFloor(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace flce

#endif  // FLCE_BENCH_CUBLAS_FLOOR_H_
