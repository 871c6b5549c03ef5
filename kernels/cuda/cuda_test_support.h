#ifndef FLCE_KERNELS_CUDA_CUDA_TEST_SUPPORT_H_
#define FLCE_KERNELS_CUDA_CUDA_TEST_SUPPORT_H_

// What the CUDA engine's GPU tests share: the engines they run on, a skip
// without a device (a failure under REQUIRE_GPU=1), and device memory a
// test owns.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_engine.h"
#include "kernels/dtype.h"

namespace flce {
namespace cuda_test {

inline bool RequireGpu() {
  const char* v = std::getenv("REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

// How the RECOMPUTE backward walks the logits.
enum class Layout {
  kTokenChunks,      // token chunks, like Forward (slices of every row do not fit)
  kVocabularySlices  // all rows at once, vocabulary slices of 16+ columns
};

// The test name of a (dtype, layout) parameter: "bf16_token_chunks", ...
inline std::string DTypeLayoutName(DType dtype, Layout layout) {
  return std::string(DTypeName(dtype)) +
         (layout == Layout::kTokenChunks ? "_token_chunks" : "_vocabulary_slices");
}

// Two engines for the whole binary, both with a small chunk budget so that
// every case runs several token chunks (at least kCudaMinChunkRows rows each)
// in Forward, and with it several vocabulary slices or token chunks in the
// RECOMPUTE backward.
inline CudaEngine* Engine(std::string* why, Layout layout = Layout::kTokenChunks) {
  auto make = [](int64_t min_slice_columns) {
    CudaEngineOptions options;
    options.chunk_bytes = 64 << 10;
    options.min_slice_columns = min_slice_columns;
    return new absl::StatusOr<std::unique_ptr<CudaEngine>>(CudaEngine::Create(options));
  };
  static absl::StatusOr<std::unique_ptr<CudaEngine>>* chunks = make(int64_t{1} << 40);
  static absl::StatusOr<std::unique_ptr<CudaEngine>>* slices = make(16);
  auto* engine = layout == Layout::kTokenChunks ? chunks : slices;
  if (!engine->ok()) {
    *why = engine->status().ToString();
    return nullptr;
  }
  return engine->value().get();
}

#define FLCE_GET_ENGINE_OR_SKIP(engine, ...)                                     \
  std::string why_;                                                              \
  CudaEngine* engine = ::flce::cuda_test::Engine(&why_, ##__VA_ARGS__);          \
  if (engine == nullptr) {                                                       \
    if (::flce::cuda_test::RequireGpu()) FAIL() << "REQUIRE_GPU=1 but " << why_; \
    GTEST_SKIP() << "no CUDA device: " << why_;                                  \
  }

// Device memory a test owns.
struct DeviceBytes {
  explicit DeviceBytes(size_t n) : size(n) { EXPECT_EQ(cudaMalloc(&data, n), cudaSuccess); }
  ~DeviceBytes() { cudaFree(data); }
  std::string Read() const {
    std::string out(size, '\0');
    EXPECT_EQ(cudaMemcpy(out.data(), data, size, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  void* data = nullptr;
  size_t size;
};

// `p` with X and W copied into device memory this owns (the problem a
// same-host worker's tensors make).
struct ProblemOnDevice {
  explicit ProblemOnDevice(const OwnedProblem& p)
      : x(p.hidden.data.size()), w(p.weight.data.size()), view(p.view()) {
    EXPECT_EQ(cudaMemcpy(x.data, p.hidden.data.data(), x.size, cudaMemcpyHostToDevice),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpy(w.data, p.weight.data.data(), w.size, cudaMemcpyHostToDevice),
              cudaSuccess);
    view.hidden.data = x.data;
    view.hidden.space = MemorySpace::kCuda;
    view.weight.data = w.data;
    view.weight.space = MemorySpace::kCuda;
  }
  DeviceBytes x, w;
  LossProblem view;
};

}  // namespace cuda_test
}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_CUDA_TEST_SUPPORT_H_
