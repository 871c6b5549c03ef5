#ifndef FLCE_KERNELS_CUDA_CHUNK_PLAN_H_
#define FLCE_KERNELS_CUDA_CHUNK_PLAN_H_

// How the CUDA engine cuts a problem to fit its logits budget
// (CudaEngineOptions::chunk_bytes): rows per token chunk, and columns per
// vocabulary slice for RECOMPUTE's all-rows backward. Plain C++, unit-tested
// without a GPU (chunk_plan_test.cc).

#include <cstdint>

#include "kernels/cuda/cuda_engine_options.h"
#include "kernels/dtype.h"

namespace flce {

// The rows a token chunk's budget holds at least, whatever chunk_bytes says.
inline constexpr int64_t kCudaMinChunkRows = 64;

// The size of each of the fewest equal pieces of at most `limit` that cover
// `total` (at least 1): rounded up to whole GEMM tiles of 128 where that
// still fits, else up to a multiple of `align` where that fits, else
// `limit` rounded down to one.
int64_t EvenPiece(int64_t total, int64_t limit, int64_t align);

// Rows per logits chunk: as few chunks as the budget allows (each one after
// the first is a pass over the fp32 dW accumulator), of equal size (no
// small last chunk that costs a whole pass), rounded up to whole GEMM tiles
// of 128 rows where that still fits. The budget is at least
// kCudaMinChunkRows rows (its even pieces may be a few rows fewer).
int64_t ChunkRows(const CudaEngineOptions& options, int64_t rows, int64_t vocab, DType dtype);

// Columns per vocabulary slice when the RECOMPUTE backward takes all `rows`
// at once, or 0 when a slice of min_slice_columns does not fit the budget.
// As few slices as fit, of equal width, whole GEMM tiles of 128 columns
// where that still fits, else a multiple of 16 (so every slice but the last
// keeps its rows 16-byte aligned).
int64_t SliceColumns(const CudaEngineOptions& options, int64_t rows, int64_t vocab, DType dtype);

}  // namespace flce

#endif  // FLCE_KERNELS_CUDA_CHUNK_PLAN_H_
