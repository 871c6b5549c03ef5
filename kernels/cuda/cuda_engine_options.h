#ifndef FLCE_KERNELS_CUDA_CUDA_ENGINE_OPTIONS_H_
#define FLCE_KERNELS_CUDA_CUDA_ENGINE_OPTIONS_H_

// The CUDA engine's options, defined once: plain C++ without CUDA, so that
// the server embeds them (server/engine_factory.h) and maps each to a flag
// (server/main.cc) in builds without a toolkit too.

#include <cstdint>
#include <string>

namespace flce {

// Which of the engine's GEMMs run flce's own Hopper GEMM
// (CudaEngineOptions::hopper_gemms).
struct HopperGemmForms {
  bool logits = false, dx = false, dw = false;

  bool any() const { return logits || dx || dw; }
};

struct CudaEngineOptions {
  int device = 0;
  // Calls that run concurrently, each on its own stream and cuBLAS handle.
  int lanes = 2;
  // Upper bound on the logits chunk (rows × V in the input dtype); a chunk
  // holds at least kCudaMinChunkRows rows (chunk_plan.h). Large chunks keep
  // the GEMMs near peak and re-read the fp32 dW accumulator less often; the
  // chunk is most of the engine's memory beyond X, W, dX, dW (the default
  // leaves 8 MiB of a GiB for the per-row buffers).
  int64_t chunk_bytes = int64_t{1016} << 20;
  // The RECOMPUTE backward takes all rows at once, slicing the vocabulary
  // (rows × slice columns within chunk_bytes), when a slice of at least
  // this many columns fits; else it runs over token chunks like Forward.
  int64_t min_slice_columns = 2048;
  // The first GEMM of each shape (beta 0) times cuBLAS's default algorithm
  // against cuBLASLt's other candidates and keeps the fastest whose output
  // is bit-identical to the default's (GemmRunner): results never change,
  // the first call of a shape waits for the trials.
  bool tune_gemms = true;
  // STORE_GRADS Forward reads each logit once where the rows allow it
  // (no label smoothing, bf16 or fp32: LaunchOnePassRows), else twice. A call whose
  // rows fall outside the one-pass kernel's range runs again with two
  // passes (forward_reruns()). Off by default: one pass rounds each
  // gradient term twice (before its row's sum is known, then scaled into
  // the dW GEMM's operand), which puts bf16 dW at 1.1–1.2× eager's error
  // against the ≤ 1.05× bar; two passes are ≤ 1.0× on every output, for
  // 1–2 % more time (bench/RESULTS.md, 2026-12-04).
  bool one_pass_rows = false;
  // STORE_GRADS of a problem whose rows fit one chunk keeps the chunk's
  // logits and runs the gradient GEMMs in Backward, dW in its final dtype
  // (KeptLogits in device_pipeline.h). Off: fp32 gradients made in Forward,
  // as over several chunks (benchmarks compare).
  bool keep_chunk_logits = true;
  // flce's own Hopper GEMM (kernels/cuda/hopper_gemm.h) instead of cuBLAS
  // for the engine's logits, dX and dW GEMMs: each where the device
  // (compute capability 9.0) and the call allow it and its output at the
  // shape's first call is bit-identical to cuBLAS's default (checked once
  // per shape, as tuning does), else cuBLAS. Off until measured faster
  // inside the engine (bench/RESULTS.md, issue 22).
  HopperGemmForms hopper_gemms;
};

// *forms from the names "logits", "dx", "dw" (any of them, e.g. a flag's
// comma-separated list; "none" or no names: none). False for any other
// name, *error then saying which and what the choices are.
template <typename Names>
bool ParseHopperGemmForms(const Names& names, HopperGemmForms* forms, std::string* error) {
  *forms = HopperGemmForms();
  for (const auto& name : names) {
    if (name == "logits") {
      forms->logits = true;
    } else if (name == "dx") {
      forms->dx = true;
    } else if (name == "dw") {
      forms->dw = true;
    } else if (!(name == "none")) {
      *error = "'" + std::string(name) + "' is not one of logits, dx, dw";
      return false;
    }
  }
  return true;
}

}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_CUDA_ENGINE_OPTIONS_H_
