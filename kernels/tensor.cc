#include "kernels/tensor.h"

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

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape)
    : dtype(dtype), shape(std::move(shape)) {
  data.assign(static_cast<size_t>(num_elements()) * DTypeSize(dtype), '\xff');
}

std::vector<float> TensorToFloats(const TensorView& tensor) {
  std::vector<float> out(static_cast<size_t>(tensor.num_elements()));
  ToFloat(tensor.dtype, tensor.data, tensor.num_elements(), out.data());
  return out;
}

}  // namespace flce
