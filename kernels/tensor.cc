#include "kernels/tensor.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstring>

namespace flce {

std::string ShapeString(const std::vector<int64_t>& shape) {
  if (shape.empty()) return "scalar";
  std::string out;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += "×";
    out += std::to_string(shape[i]);
  }
  return out;
}

void AdviseHugePages(void* data, size_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) {
    // Advice only: failure (no THP support) leaves ordinary pages.
    madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
}

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape)
    : dtype(dtype), shape(std::move(shape)) {
  const size_t bytes = static_cast<size_t>(num_elements()) * DTypeSize(dtype);
  data.reserve(bytes);  // allocated, not yet touched
  AdviseHugePages(&data[0], bytes);
  data.assign(bytes, '\xff');
}

TensorView RowSlice(const TensorView& t, int64_t first, int64_t count) {
  TensorView out = t;
  int64_t row_bytes = DTypeSize(t.dtype);
  for (size_t d = 1; d < t.shape.size(); ++d) row_bytes *= t.shape[d];
  out.data = static_cast<const char*>(t.data) + first * row_bytes;
  out.shape[0] = count;
  return out;
}

HostTensor CopyTensor(const TensorView& view) {
  HostTensor t(view.dtype, view.shape);
  if (!t.data.empty()) std::memcpy(&t.data[0], view.data, t.data.size());
  return t;
}

std::vector<float> TensorToFloats(const TensorView& tensor) {
  std::vector<float> out(static_cast<size_t>(tensor.num_elements()));
  ToFloat(tensor.dtype, tensor.data, tensor.num_elements(), out.data());
  return out;
}

}  // namespace flce
