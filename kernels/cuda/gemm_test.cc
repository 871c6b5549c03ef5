// GemmRunner: tuned GEMMs give cuBLAS's default bits. Tagged `gpu`: skips
// without a device, fails without one when REQUIRE_GPU=1.

#include "kernels/cuda/gemm.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/loss_kernels.h"

namespace flce {
namespace internal_cuda {
namespace {

bool RequireGpu() {
  const char* v = std::getenv("REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

// A stream and a cuBLAS handle bound to it; skips without a device.
class GemmRunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      if (RequireGpu()) FAIL() << "REQUIRE_GPU=1 but no CUDA device";
      GTEST_SKIP() << "no CUDA device";
    }
    auto stream = CudaStream::Create();
    ASSERT_TRUE(stream.ok());
    stream_ = *std::move(stream);
    auto blas = CublasHandle::Create(stream_.get());
    ASSERT_TRUE(blas.ok());
    blas_ = *std::move(blas);
  }
  cudaStream_t s() const { return stream_.get(); }
  cublasHandle_t blas() const { return blas_.get(); }

 private:
  CudaStream stream_;
  CublasHandle blas_;
};

// `count` elements of `dtype` on the device, uniform in [-1, 1).
DeviceBuffer RandomBuffer(int64_t count, DType dtype, uint32_t seed, cudaStream_t s) {
  std::vector<float> host(count);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : host) x = u(rng);
  auto f32 = DeviceBuffer::Allocate(count * 4, s);
  auto out = DeviceBuffer::Allocate(count * DTypeSize(dtype), s);
  EXPECT_TRUE(f32.ok() && out.ok());
  EXPECT_EQ(cudaMemcpyAsync(f32->data(), host.data(), count * 4, cudaMemcpyHostToDevice, s),
            cudaSuccess);
  EXPECT_EQ(LaunchConvert(f32->data(), DType::kFloat32, out->data(), dtype, count, 1.0f, s),
            cudaSuccess);
  return *std::move(out);
}

std::vector<char> Download(const DeviceBuffer& b, cudaStream_t s) {
  std::vector<char> host(b.bytes());
  EXPECT_EQ(cudaMemcpyAsync(host.data(), b.data(), b.bytes(), cudaMemcpyDeviceToHost, s),
            cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  return host;
}

struct Case {
  cublasOperation_t op_a, op_b;
  int64_t m, n, k;
  DType in, out;
};

// The engine's three GEMM forms (logits T·N, dX N·N, dW N·T) at odd sizes
// and one size large enough for cuBLASLt to offer several candidates.
std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (DType in : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    cases.push_back({CUBLAS_OP_T, CUBLAS_OP_N, 4099, 257, 129, in, in});
    cases.push_back({CUBLAS_OP_N, CUBLAS_OP_N, 129, 257, 4099, in, DType::kFloat32});
    cases.push_back({CUBLAS_OP_N, CUBLAS_OP_T, 129, 4099, 257, in, DType::kFloat32});
  }
  cases.push_back({CUBLAS_OP_T, CUBLAS_OP_N, 32000, 2048, 1024, DType::kBFloat16,
                   DType::kBFloat16});
  cases.push_back({CUBLAS_OP_N, CUBLAS_OP_T, 1024, 32000, 2048, DType::kBFloat16,
                   DType::kFloat32});
  return cases;
}

// Every case, beta 0 then 1, run by a runner that tunes (with `exhaustive`)
// and by one that does not: the outputs must be the same bits.
void ExpectTunedBitsEqualDefault(cublasHandle_t blas, cudaStream_t s, bool exhaustive) {
  GemmTuning off, every;
  off.enabled = false;
  every.min_flop = 0;  // the odd sizes are small
  every.exhaustive = exhaustive;
  auto plain = GemmRunner::Create(off);
  auto tuned = GemmRunner::Create(every);
  ASSERT_TRUE(plain.ok() && tuned.ok());
  int shapes = 0;
  for (const Case& c : Cases()) {
    SCOPED_TRACE(::testing::Message() << "m=" << c.m << " n=" << c.n << " k=" << c.k
                                      << " in=" << DTypeName(c.in));
    const bool ta = c.op_a != CUBLAS_OP_N, tb = c.op_b != CUBLAS_OP_N;
    const int64_t lda = ta ? c.k : c.m, ldb = tb ? c.n : c.k;
    DeviceBuffer a = RandomBuffer(c.m * c.k, c.in, 1, s);
    DeviceBuffer b = RandomBuffer(c.k * c.n, c.in, 2, s);
    DeviceBuffer c0 = RandomBuffer(c.m * c.n, c.out, 3, s);  // beta 1's addend
    const GemmShape shape{c.op_a, c.op_b, c.m, c.n, c.k, c.in, lda, c.in, ldb, c.out, c.m};
    auto expected = DeviceBuffer::Allocate(c0.bytes(), s);
    auto got = DeviceBuffer::Allocate(c0.bytes(), s);
    ASSERT_TRUE(expected.ok() && got.ok());
    for (float beta : {0.0f, 1.0f}) {
      SCOPED_TRACE(::testing::Message() << "beta " << beta);
      for (DeviceBuffer* out : {&*expected, &*got}) {
        ASSERT_EQ(cudaMemcpyAsync(out->data(), c0.data(), c0.bytes(), cudaMemcpyDeviceToDevice,
                                  s),
                  cudaSuccess);
      }
      ASSERT_TRUE((*plain)->Run(blas, s, shape, a.data(), b.data(), beta,
                                expected->data()).ok());
      // beta 0 tunes the shape on this first call; beta 1 runs the choice.
      ASSERT_TRUE((*tuned)->Run(blas, s, shape, a.data(), b.data(), beta,
                                got->data()).ok());
      const std::vector<char> want = Download(*expected, s), have = Download(*got, s);
      EXPECT_EQ(std::memcmp(want.data(), have.data(), want.size()), 0);
    }
    ++shapes;
  }
  const GemmRunner::Counts counts = (*tuned)->counts();
  EXPECT_EQ(counts.tuned, shapes);
  EXPECT_EQ((*plain)->counts().tuned, 0);
  std::printf("%s: tuned %d shapes, %d run a cuBLASLt algorithm other than the default\n",
              exhaustive ? "exhaustive" : "heuristic", counts.tuned, counts.non_default);
}

TEST_F(GemmRunnerTest, TunedAlgorithmsGiveTheDefaultsBits) {
  ExpectTunedBitsEqualDefault(blas(), s(), false);
}

// Every configuration cuBLASLt accepts is screened; only the default's
// bits may win.
TEST_F(GemmRunnerTest, ExhaustivelyTunedAlgorithmsGiveTheDefaultsBits) {
  ExpectTunedBitsEqualDefault(blas(), s(), true);
}

// LtGemm finds configurations around the heuristic's candidates, each
// accepted by cublasLtMatmulAlgoCheck and distinct, and honours the limit.
TEST_F(GemmRunnerTest, ConfigurationsAreAcceptedAndLimited) {
  const GemmShape shape{CUBLAS_OP_T, CUBLAS_OP_N, 32000, 2048, 1024, DType::kBFloat16, 1024,
                        DType::kBFloat16, 1024, DType::kBFloat16, 32000};
  auto gemm = LtGemm::Create(shape);
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  cublasLtHandle_t lt = nullptr;
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  std::vector<cublasLtMatmulAlgo_t> seeds;
  for (const auto& result : (*gemm)->Candidates(lt, 8, 0)) seeds.push_back(result.algo);
  ASSERT_FALSE(seeds.empty());
  const std::vector<cublasLtMatmulAlgo_t> all = (*gemm)->Configurations(lt, seeds, 1 << 20);
  const std::vector<cublasLtMatmulAlgo_t> few = (*gemm)->Configurations(lt, seeds, 3);
  for (const cublasLtMatmulAlgo_t& algo : all) {
    cublasLtMatmulHeuristicResult_t result{};
    EXPECT_EQ((*gemm)->Check(lt, algo, &result), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(result.workspaceSize, 0u);
  }
  for (size_t i = 0; i < all.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      ASSERT_NE(std::memcmp(&all[i], &all[j], sizeof(all[i])), 0) << i << " repeats " << j;
    }
  }
  cublasLtDestroy(lt);
  EXPECT_GT(all.size(), seeds.size());  // more than the heuristic offers
  EXPECT_EQ(few.size(), 3u);
  std::printf("%zu configurations around %zu candidates\n", all.size(), seeds.size());
}

}  // namespace
}  // namespace internal_cuda
}  // namespace flce
