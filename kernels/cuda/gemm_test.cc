// GemmRunner: tuned GEMMs give cuBLAS's default bits. Tagged `gpu`: skips
// without a device, fails without one when REQUIRE_GPU=1.

#include "kernels/cuda/gemm.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_test_support.h"
#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/reductions.h"

namespace flce {
namespace internal_cuda {
namespace {

// A stream and a cuBLAS handle bound to it; skips without a device.
class GemmRunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FLCE_SKIP_WITHOUT_DEVICE();
    auto stream = CudaStream::Create(health_);
    ASSERT_TRUE(stream.ok());
    stream_ = *std::move(stream);
    auto blas = CublasHandle::Create(stream_.get(), health_);
    ASSERT_TRUE(blas.ok());
    blas_ = *std::move(blas);
  }
  cudaStream_t s() const { return stream_.get(); }
  cublasHandle_t blas() const { return blas_.get(); }

  DeviceHealth health_;

 private:
  CudaStream stream_;
  CublasHandle blas_;
};

// Statuses of the helpers below, which run outside a fixture.
DeviceHealth& TestHealth() {
  static DeviceHealth* health = new DeviceHealth();
  return *health;
}

// `count` elements of `dtype` on the device, uniform in [-1, 1).
DeviceBuffer RandomBuffer(int64_t count, DType dtype, uint32_t seed, cudaStream_t s) {
  std::vector<float> host(count);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : host) x = u(rng);
  auto f32 = DeviceBuffer::Allocate(count * 4, s, TestHealth());
  auto out = DeviceBuffer::Allocate(count * DTypeSize(dtype), s, TestHealth());
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
  cases.push_back(
      {CUBLAS_OP_T, CUBLAS_OP_N, 32000, 2048, 1024, DType::kBFloat16, DType::kBFloat16});
  cases.push_back({CUBLAS_OP_N, CUBLAS_OP_T, 1024, 32000, 2048, DType::kBFloat16, DType::kFloat32});
  return cases;
}

// A case on the device: random operands, beta 1's addend, its shape in
// cuBLAS's terms, and the two outputs compared.
struct CaseData {
  GemmShape shape;
  DeviceBuffer a, b, c0, expected, got;
};

CaseData MakeCaseData(const Case& c, cudaStream_t s) {
  const bool ta = c.op_a != CUBLAS_OP_N, tb = c.op_b != CUBLAS_OP_N;
  const int64_t lda = ta ? c.k : c.m, ldb = tb ? c.n : c.k;
  CaseData d;
  d.shape = {c.op_a, c.op_b, c.m, c.n, c.k, c.in, lda, c.in, ldb, c.out, c.m};
  d.a = RandomBuffer(c.m * c.k, c.in, 1, s);
  d.b = RandomBuffer(c.k * c.n, c.in, 2, s);
  d.c0 = RandomBuffer(c.m * c.n, c.out, 3, s);
  auto expected = DeviceBuffer::Allocate(d.c0.bytes(), s, TestHealth());
  auto got = DeviceBuffer::Allocate(d.c0.bytes(), s, TestHealth());
  EXPECT_TRUE(expected.ok() && got.ok());
  if (expected.ok()) d.expected = *std::move(expected);
  if (got.ok()) d.got = *std::move(got);
  return d;
}

// `reference` into d.expected and `runner` into d.got, with `beta`
// (`fresh`: both outputs start from the addend), then their bits compared.
void ExpectSameBits(GemmRunner& reference, GemmRunner& runner, cublasHandle_t blas,
                    cudaStream_t s, CaseData& d, float beta, bool fresh) {
  if (fresh) {
    for (DeviceBuffer* out : {&d.expected, &d.got}) {
      ASSERT_EQ(cudaMemcpyAsync(out->data(), d.c0.data(), d.c0.bytes(), cudaMemcpyDeviceToDevice, s),
                cudaSuccess);
    }
  }
  ASSERT_TRUE(reference.Run(blas, s, d.shape, d.a.data(), d.b.data(), beta, d.expected.data()).ok());
  ASSERT_TRUE(runner.Run(blas, s, d.shape, d.a.data(), d.b.data(), beta, d.got.data()).ok());
  const std::vector<char> want = Download(d.expected, s), have = Download(d.got, s);
  EXPECT_EQ(std::memcmp(want.data(), have.data(), want.size()), 0);
}

TEST_F(GemmRunnerTest, TunedAlgorithmsGiveTheDefaultsBits) {
  cudaStream_t s = this->s();
  GemmTuning off, every;
  off.enabled = false;
  every.min_flop = 0;  // the odd sizes are small
  auto plain = GemmRunner::Create(off, health_);
  auto tuned = GemmRunner::Create(every, health_);
  ASSERT_TRUE(plain.ok() && tuned.ok());
  int shapes = 0;
  for (const Case& c : Cases()) {
    SCOPED_TRACE(::testing::Message()
                 << "m=" << c.m << " n=" << c.n << " k=" << c.k << " in=" << DTypeName(c.in));
    CaseData d = MakeCaseData(c, s);
    for (float beta : {0.0f, 1.0f}) {
      SCOPED_TRACE(::testing::Message() << "beta " << beta);
      // beta 0 tunes the shape on this first call; beta 1 runs the choice.
      ExpectSameBits(**plain, **tuned, blas(), s, d, beta, /*fresh=*/true);
    }
    ++shapes;
  }
  const GemmRunner::Counts counts = (*tuned)->counts();
  EXPECT_EQ(counts.tuned, shapes);
  EXPECT_EQ((*plain)->counts().tuned, 0);
  std::printf("tuned %d shapes, %d run a cuBLASLt algorithm other than the default\n", counts.tuned,
              counts.non_default);
}

TEST_F(GemmRunnerTest, EmptyShapesAreNoOps) {
  auto tuned = GemmRunner::Create(GemmTuning{}, health_);
  ASSERT_TRUE(tuned.ok());
  const GemmShape shape{CUBLAS_OP_N, CUBLAS_OP_N,      0, 5,
                        3,           DType::kBFloat16, 1, DType::kBFloat16,
                        3,           DType::kFloat32,  1};
  EXPECT_TRUE((*tuned)->Run(blas(), s(), shape, nullptr, nullptr, 0.0f, nullptr).ok());
  EXPECT_EQ((*tuned)->counts().tuned, 0);
}

// Shapes under min_flop, and shapes beyond max_shapes, run the default and
// are not remembered.
TEST_F(GemmRunnerTest, SmallShapesAndShapesBeyondTheCapAreNotTuned) {
  cudaStream_t s = this->s();
  GemmTuning tuning;
  tuning.min_flop = 2.0 * 256 * 256 * 256;
  tuning.max_shapes = 2;
  auto runner = GemmRunner::Create(tuning, health_);
  ASSERT_TRUE(runner.ok());
  DeviceBuffer a = RandomBuffer(512 * 512, DType::kBFloat16, 1, s);
  DeviceBuffer b = RandomBuffer(512 * 512, DType::kBFloat16, 2, s);
  auto c = DeviceBuffer::Allocate(512 * 512 * 4, s, TestHealth());
  ASSERT_TRUE(c.ok());
  auto run = [&](int64_t size) {
    const GemmShape shape{CUBLAS_OP_N, CUBLAS_OP_N,      size, size,
                          size,        DType::kBFloat16, size, DType::kBFloat16,
                          size,        DType::kFloat32,  size};
    return (*runner)->Run(blas(), s, shape, a.data(), b.data(), 0.0f, c->data());
  };
  ASSERT_TRUE(run(255).ok());  // under min_flop
  EXPECT_EQ((*runner)->counts().tuned, 0);
  for (int64_t size : {256, 300, 400, 512}) ASSERT_TRUE(run(size).ok());
  EXPECT_EQ((*runner)->counts().tuned, 2);  // the cap
  ASSERT_TRUE(run(300).ok());               // a remembered shape runs its choice
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
}

// An operand off cuBLASLt's 256-byte alignment runs the default, whether
// the shape is tuned yet or not: no error, the default's bits, and no
// trials (an unaligned first call tunes nothing).
TEST_F(GemmRunnerTest, OperandsOffTheLtAlignmentRunTheDefault) {
  cudaStream_t s = this->s();
  GemmTuning off;
  off.enabled = false;
  auto plain = GemmRunner::Create(off, health_);
  auto tuned = GemmRunner::Create(GemmTuning{}, health_);
  ASSERT_TRUE(plain.ok() && tuned.ok());
  const int64_t m = 32000, n = 2048, k = 1024;
  const GemmShape shape{CUBLAS_OP_T, CUBLAS_OP_N,      m, n,
                        k,           DType::kBFloat16, k, DType::kBFloat16,
                        k,           DType::kBFloat16, m};
  DeviceBuffer a = RandomBuffer(m * k, DType::kBFloat16, 1, s);
  DeviceBuffer b = RandomBuffer(k * n + 8, DType::kBFloat16, 2, s);
  auto expected = DeviceBuffer::Allocate(m * n * 2, s, TestHealth());
  auto got = DeviceBuffer::Allocate(m * n * 2, s, TestHealth());
  ASSERT_TRUE(expected.ok() && got.ok());
  const void* shifted = b.as<const char>() + 2;  // one bf16 on: 2-byte aligned
  // Shifted before the shape is tuned, aligned (tunes it), shifted after.
  const std::pair<const void*, int> calls[] = {{shifted, 0}, {b.data(), 1}, {shifted, 1}};
  for (const auto& [b_ptr, tuned_after] : calls) {
    SCOPED_TRACE(b_ptr == shifted ? "shifted" : "aligned");
    ASSERT_TRUE((*plain)->Run(blas(), s, shape, a.data(), b_ptr, 0.0f, expected->data()).ok());
    ASSERT_TRUE((*tuned)->Run(blas(), s, shape, a.data(), b_ptr, 0.0f, got->data()).ok());
    const std::vector<char> want = Download(*expected, s), have = Download(*got, s);
    EXPECT_EQ(std::memcmp(want.data(), have.data(), want.size()), 0);
    EXPECT_EQ((*tuned)->counts().tuned, tuned_after);
  }
}

// HopperArgsFor: each of the engine's forms in cuBLAS's column-major terms
// maps to flce's row-major operands as hopper_gemm.h spells them.
TEST(HopperArgsForTest, MapsTheEngineFormsToRowMajorOperands) {
  const char a = 0, b = 0;
  char c = 0;
  const DType bf16 = DType::kBFloat16, f32 = DType::kFloat32;
  // logitsᵀ (V×N, ld V) = op(W) op(X): Hopper logits [N, V] = X · Wᵀ.
  auto logits = HopperArgsFor({CUBLAS_OP_T, CUBLAS_OP_N, 32000, 4096, 1024, bf16, 1024, bf16,
                               1024, bf16, 32000},
                              &a, &b, 0.0f, &c, 1.0f);
  ASSERT_TRUE(logits.has_value());
  EXPECT_EQ(logits->a, &b);
  EXPECT_EQ(logits->b, &a);
  EXPECT_EQ(logits->a_major, Major::kK);
  EXPECT_EQ(logits->b_major, Major::kK);
  EXPECT_EQ(logits->m, 4096);
  EXPECT_EQ(logits->n, 32000);
  EXPECT_EQ(logits->k, 1024);
  EXPECT_EQ(logits->ldc, 32000);
  EXPECT_EQ(logits->source, nullptr);
  // dXᵀ (H×N) = W (H×V) · G (V×N): Hopper dX [N, H] = G [N, V] · W [V, H].
  auto dx = HopperArgsFor({CUBLAS_OP_N, CUBLAS_OP_N, 1024, 4096, 32000, bf16, 1024, bf16, 32000,
                           f32, 1024},
                          &a, &b, 0.0f, &c, 1.0f);
  ASSERT_TRUE(dx.has_value());
  EXPECT_EQ(dx->a, &b);
  EXPECT_EQ(dx->lda, 32000);
  EXPECT_EQ(dx->a_major, Major::kK);
  EXPECT_EQ(dx->b, &a);
  EXPECT_EQ(dx->ldb, 1024);
  EXPECT_EQ(dx->b_major, Major::kMN);
  EXPECT_EQ(dx->m, 4096);
  EXPECT_EQ(dx->n, 1024);
  EXPECT_EQ(dx->k, 32000);
  EXPECT_EQ(dx->out_type, f32);
  // dWᵀ (H×V) += X (H×N) · Gᵀ: Hopper dW [V, H] += Gᵀ · X, C its own source.
  auto dw = HopperArgsFor({CUBLAS_OP_N, CUBLAS_OP_T, 1024, 32000, 4096, bf16, 1024, bf16, 32000,
                           f32, 1024},
                          &a, &b, 1.0f, &c, 1.0f);
  ASSERT_TRUE(dw.has_value());
  EXPECT_EQ(dw->a_major, Major::kMN);
  EXPECT_EQ(dw->lda, 32000);
  EXPECT_EQ(dw->b_major, Major::kMN);
  EXPECT_EQ(dw->ldb, 1024);
  EXPECT_EQ(dw->m, 32000);
  EXPECT_EQ(dw->n, 1024);
  EXPECT_EQ(dw->k, 4096);
  EXPECT_EQ(static_cast<const void*>(dw->source), static_cast<void*>(&c));
  EXPECT_EQ(dw->ld_source, 1024);
  // Nothing maps: beta 1 into a bf16 C, another beta, mixed operand dtypes.
  const GemmShape bf16_c{CUBLAS_OP_N, CUBLAS_OP_T, 8, 8, 8, bf16, 8, bf16, 8, bf16, 8};
  EXPECT_FALSE(HopperArgsFor(bf16_c, &a, &b, 1.0f, &c, 1.0f).has_value());
  EXPECT_TRUE(HopperArgsFor(bf16_c, &a, &b, 0.0f, &c, 1.0f).has_value());
  const GemmShape f32_c{CUBLAS_OP_N, CUBLAS_OP_T, 8, 8, 8, bf16, 8, bf16, 8, f32, 8};
  EXPECT_FALSE(HopperArgsFor(f32_c, &a, &b, 0.5f, &c, 1.0f).has_value());
  const GemmShape mixed{CUBLAS_OP_N, CUBLAS_OP_T, 8, 8, 8, bf16, 8, f32, 8, f32, 8};
  EXPECT_FALSE(HopperArgsFor(mixed, &a, &b, 0.0f, &c, 1.0f).has_value());
}

// With the three forms on flce's Hopper GEMM: every call gives cuBLAS's
// default bits, beta 0 (the shape's check) and beta 1 (dW's sum, added by
// the TMA), at the bench's 4096×4096×32000 (where all three forms were
// measured bit-identical, bench/RESULTS.md 2026-12-04) and at shapes the
// kernel does not take (K not a multiple of 8, fp32 operands), which run
// cuBLAS. Skips off Hopper.
TEST_F(GemmRunnerTest, HopperFormsGiveTheDefaultsBits) {
  if (!cuda_test::IsHopper()) GTEST_SKIP() << "not a Hopper device (9.0)";
  cudaStream_t s = this->s();
  GemmTuning off, hopper;
  off.enabled = hopper.enabled = false;
  hopper.hopper = {true, true, true};
  auto plain = GemmRunner::Create(off, health_);
  auto own = GemmRunner::Create(hopper, health_);
  ASSERT_TRUE(plain.ok() && own.ok());
  const int64_t n = 4096, h = 4096, v = 32000;
  const DType bf16 = DType::kBFloat16;
  std::vector<Case> cases = {
      {CUBLAS_OP_T, CUBLAS_OP_N, v, n, h, bf16, bf16},            // logits
      {CUBLAS_OP_N, CUBLAS_OP_N, h, n, v, bf16, DType::kFloat32},  // dX
      {CUBLAS_OP_N, CUBLAS_OP_T, h, v, n, bf16, DType::kFloat32},  // dW
  };
  for (const Case& c : Cases()) {
    if (c.k % 8 != 0 || c.in == DType::kFloat32) cases.push_back(c);
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "m=" << c.m << " n=" << c.n << " k=" << c.k << " in=" << DTypeName(c.in));
    CaseData d = MakeCaseData(c, s);
    for (float beta : {0.0f, 1.0f, 1.0f}) {
      SCOPED_TRACE(::testing::Message() << "beta " << beta);
      // beta 0 checks the shape on this first call; beta 1 adds into the
      // result before it, twice.
      ExpectSameBits(**plain, **own, blas(), s, d, beta, /*fresh=*/beta == 0.0f);
    }
  }
  // The three bench-shape forms run flce's GEMM; the others do not.
  EXPECT_EQ((*own)->counts().hopper, 3);
  EXPECT_EQ((*plain)->counts().hopper, 0);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
}

// What a client's token counts can make the runner remember is bounded:
// beyond max_shapes shapes checked for flce's Hopper GEMM, later shapes run
// cuBLAS unchecked (and still give its bits). Skips off Hopper.
TEST_F(GemmRunnerTest, HopperChecksStopAtTheShapeCap) {
  if (!cuda_test::IsHopper()) GTEST_SKIP() << "not a Hopper device (9.0)";
  cudaStream_t s = this->s();
  GemmTuning off, hopper;
  off.enabled = hopper.enabled = false;
  hopper.hopper = {true, true, true};
  hopper.max_shapes = 2;
  auto plain = GemmRunner::Create(off, health_);
  auto own = GemmRunner::Create(hopper, health_);
  ASSERT_TRUE(plain.ok() && own.ok());
  // Logits of 256, 264, 272 and 280 rows (K 512, V 4096): each a shape the
  // kernel takes.
  for (int64_t rows : {256, 264, 272, 280}) {
    SCOPED_TRACE(rows);
    CaseData d = MakeCaseData(
        {CUBLAS_OP_T, CUBLAS_OP_N, 4096, rows, 512, DType::kBFloat16, DType::kBFloat16}, s);
    ExpectSameBits(**plain, **own, blas(), s, d, 0.0f, /*fresh=*/true);
  }
  EXPECT_EQ((*own)->counts().hopper_checked, 2);
  EXPECT_LE((*own)->counts().hopper, 2);
}

}  // namespace
}  // namespace internal_cuda
}  // namespace flce
