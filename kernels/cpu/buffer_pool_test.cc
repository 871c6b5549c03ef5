#include "kernels/cpu/buffer_pool.h"

#include "gtest/gtest.h"

namespace flce {
namespace {

TEST(BufferPoolTest, ReusesAFreedBuffer) {
  BufferPool pool(1 << 20);
  float* first;
  {
    PooledBuffer b = pool.Take(1000);
    first = b.data();
    b.data()[999] = 1.0f;
  }
  EXPECT_EQ(pool.cached_bytes(), 4000);
  PooledBuffer again = pool.Take(900);
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(pool.cached_bytes(), 0);
}

TEST(BufferPoolTest, DoesNotHandOutFarLargerBuffers) {
  BufferPool pool(1 << 20);
  { PooledBuffer b = pool.Take(10000); }
  PooledBuffer small = pool.Take(100);
  EXPECT_EQ(pool.cached_bytes(), 40000);
}

TEST(BufferPoolTest, KeepsAtMostItsCap) {
  BufferPool pool(10000);
  { PooledBuffer b = pool.Take(5000); }  // 20000 bytes: over the cap
  EXPECT_EQ(pool.cached_bytes(), 0);
  {
    PooledBuffer a = pool.Take(1000);
    PooledBuffer b = pool.Take(1500);
    PooledBuffer c = pool.Take(1200);
  }
  EXPECT_LE(pool.cached_bytes(), 10000);
}

TEST(BufferPoolTest, MovedBufferReturnsOnce) {
  BufferPool pool(1 << 20);
  {
    PooledBuffer a = pool.Take(10);
    PooledBuffer b = std::move(a);
    PooledBuffer c;
    c = std::move(b);
  }
  EXPECT_EQ(pool.cached_bytes(), 40);
}

}  // namespace
}  // namespace flce
