#ifndef FLCE_KERNELS_TENSOR_H_
#define FLCE_KERNELS_TENSOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/dtype.h"

namespace flce {

// Product of the dimensions (1 for a scalar shape {}).
inline int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// "8192×4096" (or "scalar").
std::string ShapeString(const std::vector<int64_t>& shape);

// Asks the kernel to back [data, data + bytes) with transparent huge pages
// where it can (whole 2 MiB pages inside the range; no-op elsewhere). Call
// before the memory is first touched: on virtual machines a 4 KiB page
// fault can cost more than the arithmetic done on the page.
void AdviseHugePages(void* data, size_t bytes);

// Where a view's bytes live: this process's memory, or the memory of the
// CUDA engine's device (mapped from another process through CUDA IPC).
enum class MemorySpace { kHost, kCuda };

// A read-only view of contiguous row-major memory owned elsewhere.
struct TensorView {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  MemorySpace space = MemorySpace::kHost;

  int64_t num_elements() const { return NumElements(shape); }
  int64_t bytes() const { return num_elements() * DTypeSize(dtype); }
  int64_t dim(int i) const { return shape[static_cast<size_t>(i)]; }
};

// A tensor that owns its bytes. The bytes live in a std::string so they can
// be moved into a protobuf `bytes` field without a copy.
struct HostTensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::string data;

  HostTensor() = default;
  // Allocates product(shape) elements filled with 0xff bytes (NaN for the
  // floating dtypes), so elements a computation forgets to write show up.
  HostTensor(DType dtype, std::vector<int64_t> shape);

  int64_t num_elements() const { return NumElements(shape); }
  TensorView view() const { return {dtype, shape, data.data()}; }
  template <typename T>
  T* mutable_data() {
    return reinterpret_cast<T*>(&data[0]);
  }
  template <typename T>
  const T* data_as() const {
    return reinterpret_cast<const T*>(data.data());
  }
};

// A view of rows [first, first + count) of a row-major tensor (a view of
// the same memory, which stays owned elsewhere).
TensorView RowSlice(const TensorView& t, int64_t first, int64_t count);

// A host copy of a view's bytes (REQUIRES: host memory).
HostTensor CopyTensor(const TensorView& view);

// The elements of a floating tensor as floats.
// REQUIRES: IsFloating(tensor.dtype).
std::vector<float> TensorToFloats(const TensorView& tensor);

}  // namespace flce

#endif  // FLCE_KERNELS_TENSOR_H_
