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
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_engine.h"
#include "kernels/dtype.h"
#include "kernels/reference/random_problem.h"

namespace flce {
namespace cuda_test {

inline bool RequireGpu() {
  const char* v = std::getenv("REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

// Returns from the calling test (or SetUp), skipped, when there is no CUDA
// device; failed instead under REQUIRE_GPU=1.
#define FLCE_SKIP_WITHOUT_DEVICE()                                                   \
  do {                                                                               \
    int device_count_ = 0;                                                           \
    if (cudaGetDeviceCount(&device_count_) != cudaSuccess || device_count_ == 0) {   \
      if (::flce::cuda_test::RequireGpu()) FAIL() << "REQUIRE_GPU=1 but no CUDA device"; \
      GTEST_SKIP() << "no CUDA device";                                              \
    }                                                                                \
  } while (0)

// Whether device 0 is a Hopper GPU (compute capability 9.0), which flce's
// Hopper GEMM needs.
inline bool IsHopper() {
  int major = 0, minor = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) == cudaSuccess &&
         major == 9 && minor == 0;
}

// Returns from the calling test (or SetUp), skipped, off a Hopper device
// (or without a device: failed under REQUIRE_GPU=1).
#define FLCE_SKIP_OFF_HOPPER()                                                     \
  do {                                                                             \
    FLCE_SKIP_WITHOUT_DEVICE();                                                    \
    if (!::flce::cuda_test::IsHopper()) GTEST_SKIP() << "not a Hopper device (9.0)"; \
  } while (0)

// How the RECOMPUTE backward walks the logits.
enum class Layout {
  kTokenChunks,       // token chunks, like Forward (slices of every row do not fit)
  kVocabularySlices,  // all rows at once, vocabulary slices of 16+ columns
  kOneChunk           // the default budget: a test's rows fit one chunk
};

// The problem the gradient-destination tests run: bf16 with a bias, odd V.
inline RandomProblemSpec DestinationSpec() {
  RandomProblemSpec spec;
  spec.rows = 150;
  spec.hidden = 40;
  spec.vocab = 3001;
  spec.dtype = DType::kBFloat16;
  spec.bias = true;
  return spec;
}

// The test name of a (dtype, layout) parameter: "bf16_token_chunks", ...
inline std::string DTypeLayoutName(DType dtype, Layout layout) {
  return std::string(DTypeName(dtype)) + (layout == Layout::kTokenChunks ? "_token_chunks"
                                          : layout == Layout::kVocabularySlices
                                              ? "_vocabulary_slices"
                                              : "_one_chunk");
}

// Engines for the whole binary: two with a small chunk budget so that
// every case of more than kCudaMinChunkRows rows runs several token chunks
// in Forward, and with it several vocabulary slices or token chunks in the
// RECOMPUTE backward; one with the default budget, in which a test's rows
// fit one chunk (STORE_GRADS then keeps the logits).
// one_pass_rows: token chunks with STORE_GRADS's one-pass rows
// (CudaEngineOptions::one_pass_rows, off by default), `layout` ignored.
inline CudaEngine* Engine(std::string* why, Layout layout = Layout::kTokenChunks,
                          bool one_pass_rows = false) {
  auto make = [](int64_t chunk_bytes, int64_t min_slice_columns, bool one_pass) {
    CudaEngineOptions options;
    if (chunk_bytes > 0) options.chunk_bytes = chunk_bytes;
    options.min_slice_columns = min_slice_columns;
    options.one_pass_rows = one_pass;
    return new absl::StatusOr<std::unique_ptr<CudaEngine>>(CudaEngine::Create(options));
  };
  static absl::StatusOr<std::unique_ptr<CudaEngine>>* chunks =
      make(64 << 10, int64_t{1} << 40, false);
  static absl::StatusOr<std::unique_ptr<CudaEngine>>* one_pass =
      make(64 << 10, int64_t{1} << 40, true);
  static absl::StatusOr<std::unique_ptr<CudaEngine>>* slices = make(64 << 10, 16, false);
  static absl::StatusOr<std::unique_ptr<CudaEngine>>* whole =
      make(0, CudaEngineOptions().min_slice_columns, false);
  auto* engine = one_pass_rows                         ? one_pass
                 : layout == Layout::kTokenChunks      ? chunks
                 : layout == Layout::kVocabularySlices ? slices
                                                       : whole;
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
  // Copies `host` in (its bytes, at most size of them).
  template <typename T>
  void Write(const std::vector<T>& host) {
    ASSERT_LE(host.size() * sizeof(T), size);
    EXPECT_EQ(cudaMemcpy(data, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
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
