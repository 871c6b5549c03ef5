#ifndef FLCE_CLIENT_NPY_H_
#define FLCE_CLIENT_NPY_H_

// NumPy .npy files (format versions 1-3), little-endian, C order.
// dtypes: <f4 (fp32), <f2 (fp16), <i4 (int32), <i8 (int64). NumPy has no
// bfloat16: bf16 tensors are written as fp32 (exact).

#include <string>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"

namespace flce {

// INVALID_ARGUMENT naming the file for a malformed or unsupported file,
// NOT_FOUND if it cannot be opened.
absl::StatusOr<HostTensor> ReadNpy(const std::string& path);

absl::Status WriteNpy(const std::string& path, const TensorView& tensor);

}  // namespace flce

#endif  // FLCE_CLIENT_NPY_H_
