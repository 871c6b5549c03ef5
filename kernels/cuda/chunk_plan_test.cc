#include "kernels/cuda/chunk_plan.h"

#include "gtest/gtest.h"

namespace flce {
namespace {

TEST(EvenPieceTest, FewestEqualPiecesInWholeTilesWhereTheyFit) {
  EXPECT_EQ(EvenPiece(100, 1000, 1), 100);  // one piece
  EXPECT_EQ(EvenPiece(0, 1000, 1), 1);
  EXPECT_EQ(EvenPiece(8192, 4153, 1), 4096);  // two pieces of 32 tiles
  EXPECT_EQ(EvenPiece(1000, 600, 1), 512);    // 500 each, rounded up to 4 tiles
  EXPECT_EQ(EvenPiece(1000, 510, 16), 496);   // 512 > 510 either way: 510 down to 16s
  EXPECT_EQ(EvenPiece(1000, 501, 1), 500);    // 500 fits as it is
  EXPECT_EQ(EvenPiece(1000, 499, 16), 384);   // three of 334 → 3 tiles
  EXPECT_EQ(EvenPiece(35, 10, 16), 0);        // nothing of 16 fits under 10
}

TEST(ChunkPlanTest, ShapeAAtTheDefaultBudget) {
  const CudaEngineOptions o;  // 1016 MiB of logits
  // 8192 rows × 128256 bf16 columns: 4153 rows fit, two chunks of 4096.
  EXPECT_EQ(ChunkRows(o, 8192, 128256, DType::kBFloat16), 4096);
  // fp32 logits take twice the bytes: 2076 rows fit, four chunks of 2048.
  EXPECT_EQ(ChunkRows(o, 8192, 128256, DType::kFloat32), 2048);
  // RECOMPUTE's backward, all 8192 rows: 65024 columns fit, two slices.
  EXPECT_EQ(SliceColumns(o, 8192, 128256, DType::kBFloat16), 64128);
}

TEST(ChunkPlanTest, SmallBudgetsKeepTheMinimumRowsAndFallBackToChunks) {
  CudaEngineOptions o;
  o.chunk_bytes = 64 << 10;
  // The budget is kCudaMinChunkRows rows; 1000 rows in even pieces of at
  // most 64: sixteen of 63.
  EXPECT_EQ(ChunkRows(o, 1000, 128256, DType::kBFloat16), 63);
  EXPECT_EQ(ChunkRows(o, 10, 128256, DType::kBFloat16), 10);
  // 64 KiB over 1000 bf16 rows: 32 columns, under min_slice_columns (2048).
  EXPECT_EQ(SliceColumns(o, 1000, 20000, DType::kBFloat16), 0);
  o.min_slice_columns = 16;
  EXPECT_EQ(SliceColumns(o, 1000, 20000, DType::kBFloat16), 32);
  // The whole vocabulary fits: one slice, whatever min_slice_columns says.
  o.min_slice_columns = 1 << 20;
  EXPECT_EQ(SliceColumns(o, 4, 1000, DType::kFloat32), 1000);
}

}  // namespace
}  // namespace flce
