// The Hopper GEMM against an fp64 reference on random data of odd sizes.
// Tagged `gpu`: skips without a device (fails without one when
// REQUIRE_GPU=1) and on a device that is not compute capability 9.0.

#include "kernels/cuda/hopper_gemm.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_test_support.h"
#include "kernels/dtype.h"

namespace flce {
namespace internal_cuda {
namespace {

class HopperGemmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FLCE_SKIP_WITHOUT_DEVICE();
    int major = 0, minor = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
    ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
    if (major != 9 || minor != 0) GTEST_SKIP() << "not a Hopper device (9.0)";
    ASSERT_EQ(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int sms_ = 0;
  cudaStream_t stream_ = nullptr;
};

// Device memory that frees itself.
struct Case {
  int64_t m, n, k;
  DType in, out;
  int64_t lda = 0, ldb = 0, ldc = 0;  // 0: dense
};

// `rows` rows of `cols` random values in [-1, 1) rounded to `dtype`, row
// stride `ld` (the padding NaN), as the dtype's bits and as doubles.
void RandomMatrix(int64_t rows, int64_t cols, int64_t ld, DType dtype, uint32_t seed,
                  std::vector<uint16_t>& bits, std::vector<double>& values) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  bits.assign(rows * ld, 0x7fff);
  values.assign(rows * cols, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float x = u(rng);
      const uint16_t b = dtype == DType::kBFloat16 ? FloatToBFloat16(x) : FloatToHalf(x);
      bits[r * ld + c] = b;
      values[r * cols + c] = dtype == DType::kBFloat16 ? BFloat16ToFloat(b) : HalfToFloat(b);
    }
  }
}

TEST_F(HopperGemmTest, MatchesTheFp64Reference) {
  std::vector<Case> cases;
  for (DType in : {DType::kBFloat16, DType::kFloat16}) {
    for (DType out : {in, DType::kFloat32}) {
      cases.push_back({1, 1, 8, in, out});
      cases.push_back({3, 7, 8, in, out});
      cases.push_back({17, 1000, 72, in, out});
      cases.push_back({733, 257, 264, in, out});
    }
  }
  // Many tiles per block (persistence, bands), an odd count of row tiles
  // (a cluster's second block past m), a long K, padded rows and an odd C
  // stride (element stores), C's rows in 16-byte pieces with n ending
  // inside one.
  cases.push_back({1000, 8191, 256, DType::kBFloat16, DType::kBFloat16});
  cases.push_back({2100, 1100, 128, DType::kBFloat16, DType::kFloat32});
  cases.push_back({129, 513, 4096, DType::kBFloat16, DType::kFloat32});
  cases.push_back({300, 301, 136, DType::kBFloat16, DType::kBFloat16, 144, 152, 307});
  cases.push_back({130, 260, 40, DType::kFloat16, DType::kFloat32, 48, 40, 263});
  cases.push_back({70, 300, 64, DType::kBFloat16, DType::kBFloat16, 0, 0, 304});
  cases.push_back({65, 258, 32, DType::kFloat16, DType::kFloat32, 0, 0, 260});

  uint32_t seed = 1;
  for (const Case& c : cases) {
    for (const int cluster : {1, 2}) {
      const int64_t lda = c.lda ? c.lda : c.k, ldb = c.ldb ? c.ldb : c.k, ldc = c.ldc ? c.ldc : c.n;
      SCOPED_TRACE(::testing::Message()
                   << "m=" << c.m << " n=" << c.n << " k=" << c.k << " in=" << DTypeName(c.in)
                   << " out=" << DTypeName(c.out) << " lda=" << lda << " ldb=" << ldb
                   << " ldc=" << ldc << " cluster=" << cluster);
      std::vector<uint16_t> a_bits, b_bits;
      std::vector<double> a, b;
      RandomMatrix(c.m, c.k, lda, c.in, seed++, a_bits, a);
      RandomMatrix(c.n, c.k, ldb, c.in, seed++, b_bits, b);
      const size_t out_size = DTypeSize(c.out);
      cuda_test::DeviceBytes da(a_bits.size() * 2), db(b_bits.size() * 2), dc(c.m * ldc * out_size);
      ASSERT_EQ(cudaMemcpy(da.data, a_bits.data(), da.size, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(db.data, b_bits.data(), db.size, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemset(dc.data, 0xff, dc.size), cudaSuccess);  // NaN: unwritten shows

      HopperGemmArgs args;
      args.a = da.data;
      args.lda = lda;
      args.b = db.data;
      args.ldb = ldb;
      args.c = dc.data;
      args.ldc = ldc;
      args.m = c.m;
      args.n = c.n;
      args.k = c.k;
      args.in_type = c.in;
      args.out_type = c.out;
      args.cluster = cluster;
      ASSERT_TRUE(HopperGemmSupported(args, 0));
      ASSERT_EQ(LaunchHopperGemm(args, sms_, stream_), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);

      std::vector<char> raw(dc.size);
      ASSERT_EQ(cudaMemcpy(raw.data(), dc.data, dc.size, cudaMemcpyDeviceToHost), cudaSuccess);
      std::vector<float> got(c.m * ldc);
      ToFloat(c.out, raw.data(), c.m * ldc, got.data());
      // fp32 accumulation over k, then C's one rounding.
      const double round = c.out == DType::kBFloat16  ? std::ldexp(1.0, -8)
                           : c.out == DType::kFloat16 ? std::ldexp(1.0, -11)
                                                      : 0.0;
      int64_t bad = 0, untouched = 0;
      for (int64_t i = 0; i < c.m; ++i) {
        for (int64_t j = 0; j < ldc; ++j) {
          const float x = got[i * ldc + j];
          if (j >= c.n) {
            if (!std::isnan(x)) ++untouched;  // past n: still the poison
            continue;
          }
          double exact = 0, magnitude = 0;
          for (int64_t p = 0; p < c.k; ++p) {
            exact += a[i * c.k + p] * b[j * c.k + p];
            magnitude += std::fabs(a[i * c.k + p] * b[j * c.k + p]);
          }
          const double bar = 1e-5 * magnitude + round * std::fabs(exact) + 1e-30;
          if (!(std::fabs(x - exact) <= bar) && bad++ < 5) {
            ADD_FAILURE() << "C[" << i << "][" << j << "] = " << x << ", expected " << exact;
          }
        }
      }
      EXPECT_EQ(bad, 0);
      EXPECT_EQ(untouched, 0) << "elements past n were written";
    }
  }
}

TEST_F(HopperGemmTest, RefusesWhatItDoesNotTake) {
  cuda_test::DeviceBytes a(1 << 16), b(1 << 16), c(1 << 16);
  HopperGemmArgs args;
  args.a = a.data;
  args.b = b.data;
  args.c = c.data;
  args.m = args.n = 16;
  args.k = args.lda = args.ldb = args.ldc = 16;
  ASSERT_TRUE(HopperGemmSupported(args, 0));

  HopperGemmArgs odd_k = args;
  odd_k.k = odd_k.lda = odd_k.ldb = 12;  // rows not a multiple of 16 bytes
  EXPECT_FALSE(HopperGemmSupported(odd_k, 0));
  EXPECT_EQ(LaunchHopperGemm(odd_k, sms_, stream_), cudaErrorInvalidValue);

  HopperGemmArgs fp32 = args;
  fp32.in_type = fp32.out_type = DType::kFloat32;
  EXPECT_FALSE(HopperGemmSupported(fp32, 0));

  HopperGemmArgs misaligned = args;
  misaligned.a = static_cast<char*>(a.data) + 2;
  EXPECT_FALSE(HopperGemmSupported(misaligned, 0));

  HopperGemmArgs cluster = args;
  cluster.cluster = 3;
  EXPECT_FALSE(HopperGemmSupported(cluster, 0));

  HopperGemmArgs empty = args;
  empty.m = 0;
  EXPECT_EQ(LaunchHopperGemm(empty, sms_, stream_), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

}  // namespace
}  // namespace internal_cuda
}  // namespace flce
