#ifndef FLCE_KERNELS_CPU_CPU_ENGINE_H_
#define FLCE_KERNELS_CPU_CPU_ENGINE_H_

#include <cstdint>
#include <memory>

#include "kernels/cpu/cpu_gemm.h"
#include "kernels/loss_engine.h"

namespace flce {

struct CpuEngineOptions {
  // Upper bound on a chunk's fp32 logits and fp32 copy of X (rows × (V + H)
  // × 4 bytes; a bf16 GEMM's rounded gradient adds half the logits'). The
  // chunk holds at least kMinChunkRows rows whatever this says. 128 MiB:
  // 512 rows of a 32000-id vocabulary in one chunk (bench/RESULTS.md: 5 %
  // faster than two in fp32).
  int64_t chunk_bytes = int64_t{128} << 20;
  // Freed workspace (logits chunks, converted weights) kept for reuse.
  int64_t workspace_cache_bytes = int64_t{1} << 30;
  // When bf16 inputs multiply in bf16 (oneDNN) rather than widened to fp32,
  // as fp16 ones always are: by default where the CPU has bf16 dot products
  // and they outrun fp32 there (kernels/cpu/cpu_gemm.h).
  Bf16Gemms bf16_gemms = Bf16Gemms::kWhereFaster;
  // fp32 GEMM operands multiply on oneDNN; false: on OpenBLAS's sgemm
  // (kernels/cpu/cpu_gemm.h says why oneDNN is the default).
  bool onednn_fp32 = true;
};

class BufferPool;

// The CPU engine: the three GEMMs with fp32 accumulation (kernels/cpu/
// cpu_gemm.h: bf16 operands on oneDNN where the CPU multiplies bf16, the
// gradient rounded to bf16 for the dX and dW GEMMs as in PyTorch; fp32
// operands on oneDNN too, fp16 inputs widened to them), row math in fp32 with
// OpenMP across rows, chunked over tokens so the N×V logits never exist in
// full. dW and db accumulate across chunks in fp32 and are rounded once. Running out of host
// memory is RESOURCE_EXHAUSTED. Thread-safe: calls share only the workspace
// pool.
class CpuEngine : public LossEngine {
 public:
  static constexpr int64_t kMinChunkRows = 16;

  explicit CpuEngine(CpuEngineOptions options = {});
  ~CpuEngine() override;

  std::string backend() const override { return "cpu"; }
  std::vector<DeviceInfo> devices() const override;
  bool supports_vocab_shards() const override { return true; }
  int64_t SavedStateBytes(const LossProblem& problem, BackwardMode mode) const override;
  absl::StatusOr<ForwardResult> Forward(const LossProblem& problem, const ForwardSpec& spec,
                                        const CancelFn& cancelled) override;
  absl::StatusOr<Gradients> Backward(SavedState& state, const BackwardSpec& spec,
                                     const CancelFn& cancelled) override;

  // Rows per chunk for `rows` tokens, a vocabulary of `vocab` and hidden
  // size `hidden`.
  int64_t ChunkRows(int64_t rows, int64_t vocab, int64_t hidden) const;

 private:
  absl::StatusOr<ForwardResult> ForwardImpl(const LossProblem& problem, const ForwardSpec& spec,
                                            const CancelFn& cancelled);
  // A vocabulary shard's Forward: its statistics, and its state.
  absl::StatusOr<ForwardResult> ShardForward(const LossProblem& problem, const ForwardSpec& spec,
                                             const CancelFn& cancelled);
  absl::StatusOr<Gradients> BackwardImpl(SavedState& state, const BackwardSpec& spec,
                                         const CancelFn& cancelled);

  CpuEngineOptions options_;
  std::unique_ptr<BufferPool> pool_;
  std::unique_ptr<CpuGemm> gemm_;
};

}  // namespace flce

#endif  // FLCE_KERNELS_CPU_CPU_ENGINE_H_
