#include "kernels/cuda/chunk_plan.h"

#include <algorithm>

namespace flce {

int64_t EvenPiece(int64_t total, int64_t limit, int64_t align) {
  if (total <= limit) return std::max<int64_t>(1, total);
  const int64_t pieces = (total + limit - 1) / limit;
  const int64_t even = (total + pieces - 1) / pieces;
  const int64_t tiled = (even + 127) / 128 * 128;
  if (tiled <= limit) return tiled;
  const int64_t aligned = (even + align - 1) / align * align;
  return aligned <= limit ? aligned : limit / align * align;
}

int64_t ChunkRows(const CudaEngineOptions& options, int64_t rows, int64_t vocab, DType dtype) {
  const int64_t by_budget =
      std::max(kCudaMinChunkRows, options.chunk_bytes / (vocab * DTypeSize(dtype)));
  return EvenPiece(rows, by_budget, 1);
}

int64_t SliceColumns(const CudaEngineOptions& options, int64_t rows, int64_t vocab, DType dtype) {
  const int64_t by_budget = options.chunk_bytes / (std::max<int64_t>(1, rows) * DTypeSize(dtype));
  if (by_budget < vocab && by_budget < std::max<int64_t>(16, options.min_slice_columns)) {
    return 0;
  }
  return EvenPiece(vocab, by_budget, 16);
}

}  // namespace flce
