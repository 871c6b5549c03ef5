#ifndef FLCE_KERNELS_CUDA_GEMM_H_
#define FLCE_KERNELS_CUDA_GEMM_H_

// The CUDA engine's GEMMs: cublasGemmEx's default algorithm, or, once a
// shape has been tuned, the fastest cuBLASLt algorithm whose output is
// bit-identical to that default's, or flce's Hopper GEMM (hopper_gemm.h)
// where it is asked for and bit-identical to that default.

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/cuda_engine_options.h"
#include "kernels/cuda/device_health.h"
#include "kernels/cuda/hopper_gemm.h"
#include "kernels/dtype.h"

namespace flce {
namespace internal_cuda {

// C[m×n] (column-major, ldc) = op(A)·op(B) + beta·C with input-dtype
// operands and fp32 accumulation (no TF32 for fp32 operands).
struct GemmShape {
  cublasOperation_t op_a, op_b;
  int64_t m, n, k;
  DType a_type;
  int64_t lda;
  DType b_type;
  int64_t ldb;
  DType c_type;
  int64_t ldc;

  auto tie() const { return std::tie(op_a, op_b, m, n, k, a_type, lda, b_type, ldb, c_type, ldc); }
  bool operator==(const GemmShape& o) const { return tie() == o.tie(); }
  template <typename H>
  friend H AbslHashValue(H h, const GemmShape& g) {
    return H::combine(std::move(h), g.op_a, g.op_b, g.m, g.n, g.k, g.a_type, g.lda, g.b_type, g.ldb,
                      g.c_type, g.ldc);
  }
};

// The same product in flce's Hopper GEMM's row-major terms: the
// column-major C (m×n, ldc) is row-major C [n, m] = op(B)ᵀ · op(A)ᵀ, so
// B's storage is the Hopper A (K-major where op_b is N) and A's the Hopper
// B (MN-major where op_a is N); beta 1 adds an fp32 C into itself. None
// where nothing maps: beta other than 0 or 1, beta 1 with C not fp32, A and
// B of different dtypes. Whether the device and the pointers allow it is
// HopperGemmSupported's to say (cluster left at its default).
std::optional<HopperGemmArgs> HopperArgsFor(const GemmShape& g, const void* a, const void* b,
                                            float beta, void* c, float alpha);

// A GEMM shape's cuBLASLt descriptors (read-only once made): its heuristic
// candidates, and runs of it with one of them.
class LtGemm {
 public:
  // Statuses go through `health`, which must outlive this.
  static absl::StatusOr<std::unique_ptr<LtGemm>> Create(const GemmShape& g, DeviceHealth& health);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // Up to `count` of cuBLASLt's candidates that need at most
  // `workspace_bytes` (none when the heuristic has none).
  std::vector<cublasLtMatmulHeuristicResult_t> Candidates(cublasLtHandle_t lt, int count,
                                                          size_t workspace_bytes) const;
  // C = alpha·op(A)·op(B) + beta·C.
  absl::Status Run(cublasLtHandle_t lt, cudaStream_t stream, const cublasLtMatmulAlgo_t& algo,
                   const void* a, const void* b, float beta, void* c, void* workspace = nullptr,
                   size_t workspace_bytes = 0, float alpha = 1.0f) const;

 private:
  explicit LtGemm(DeviceHealth& health) : health_(health) {}
  DeviceHealth& health_;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t la_ = nullptr, lb_ = nullptr, lc_ = nullptr;
};

// Which GEMMs GemmRunner may tune.
struct GemmTuning {
  bool enabled = true;
  // Smaller GEMMs (2·m·n·k FLOP) run the default: their trials would cost
  // more than a few percent of them saves.
  double min_flop = 1e10;
  // A process tunes at most this many shapes (each distinct token count N
  // brings new chunk shapes); later shapes run the default.
  int max_shapes = 64;
  // GEMMs of these forms (by the Hopper operands' majors: logits K·K, dX
  // K·MN, dW MN·MN) run flce's Hopper GEMM instead, where the device
  // (compute capability 9.0) and the call allow it and its output is
  // bit-identical to cuBLAS's default at the shape's first call with beta 0
  // (checked once per shape, as tuning does, also with `enabled` false:
  // clusters of 1 and of 2 blocks, cooperative and ping-pong, the fastest
  // of those with the default's bits kept); else as above.
  HopperGemmForms hopper;
};

// Runs GEMMs, choosing their algorithms. With tuning on, the first call of
// a shape with beta 0 (which overwrites C, so the trials may too) runs
// cublasGemmEx's default and each of cuBLASLt's heuristic candidates that
// needs no workspace and no split-K reduction, keeps the candidates whose
// output hashes to the same bits as the default's, times them and the
// default in interleaved rounds (median, so the card's clock drifting
// during the trials favours none), and remembers the fastest if it beats
// the default by 2%. That call waits for the trials (host synchronisation,
// once per shape); later calls of the shape (beta 0 or 1) run the choice
// without any. C holds the result when the call returns. Calls of an
// untuned shape with beta 1, calls with an operand not 256-byte aligned
// (cuBLASLt's heuristic assumes that alignment), and every call with
// tuning off, run the default. Shapes of a form in GemmTuning::hopper are
// checked first the same way (at most max_shapes of them). Thread-safe.
//
// Trials time a GEMM alone, back to back; inside a pipeline an algorithm
// can rank differently (the engine says which of its GEMMs may be tuned).
class GemmRunner {
 public:
  // Statuses go through `health`, which must outlive this.
  static absl::StatusOr<std::unique_ptr<GemmRunner>> Create(const GemmTuning& tuning,
                                                            DeviceHealth& health);
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;

  // C = alpha·op(A)·op(B) + beta·C on `stream`, which `blas` is bound to
  // (alpha scales the fp32 products before C's one rounding). m == 0 or
  // n == 0 is a no-op. tune = false: this call runs the default whatever
  // the shape's cuBLASLt choice (flce's Hopper GEMM where
  // GemmTuning::hopper asks for its form all the same).
  absl::Status Run(cublasHandle_t blas, cudaStream_t stream, const GemmShape& g, const void* a,
                   const void* b, float beta, void* c, bool tune = true, float alpha = 1.0f);

  struct Counts {
    int tuned = 0;        // shapes timed
    int non_default = 0;  // of those, shapes that run a cuBLASLt algorithm
    int hopper = 0;       // shapes that run flce's Hopper GEMM
    int hopper_checked = 0;  // shapes checked for it (at most max_shapes)
  };
  Counts counts() const;

  // The next Run launches a trapping kernel on its stream and waits for it
  // before its GEMM: a sticky device error on the GEMM path, for tests of
  // the engine's health. The process's CUDA context is unusable after.
  void InjectFaultForTesting();

 private:
  struct Choice;
  // A shape's Hopper GEMM: its cluster size and schedule; cluster 0 where
  // it does not run (cuBLAS's default has other bits, or no launch
  // succeeded).
  struct HopperChoice {
    int cluster = 0;
    bool ping_pong = false;
  };
  GemmRunner(const GemmTuning& tuning, cublasLtHandle_t lt, int sms, DeviceHealth& health);
  absl::StatusOr<std::shared_ptr<const Choice>> Tune(cublasHandle_t blas, cudaStream_t stream,
                                                     const GemmShape& g, const void* a,
                                                     const void* b, void* c, float alpha);
  // The shape's Hopper choice, made at a beta-0 call that leaves its result
  // in C.
  absl::StatusOr<HopperChoice> ChooseHopper(cublasHandle_t blas, cudaStream_t stream,
                                            const GemmShape& g, HopperGemmArgs args, const void* a,
                                            const void* b, float alpha);
  // Runs `args` on flce's Hopper GEMM when this call may (form, device,
  // pointers) and the shape's choice says so; nullopt when cuBLAS runs it.
  std::optional<absl::Status> RunHopper(cublasHandle_t blas, cudaStream_t stream,
                                        const GemmShape& g, const void* a, const void* b,
                                        float beta, void* c, float alpha);

  const GemmTuning tuning_;
  const cublasLtHandle_t lt_;
  const int sms_;  // the device's multiprocessors (with hopper forms), else 0
  DeviceHealth& health_;
  std::atomic<bool> inject_fault_{false};
  mutable absl::Mutex mu_;
  absl::flat_hash_map<GemmShape, std::shared_ptr<const Choice>> choices_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<GemmShape, HopperChoice> hopper_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal_cuda
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_GEMM_H_
