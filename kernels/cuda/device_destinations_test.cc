// The CUDA engine and device memory: gradients delivered into device
// destinations (written, or added as autograd adds), X and W read where they
// live on the device. Tagged `gpu`: skips without a device, fails without
// one when REQUIRE_GPU=1.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_engine.h"
#include "kernels/cuda/cuda_test_support.h"
#include "kernels/dtype.h"
#include "kernels/reference/random_problem.h"

namespace flce {
namespace {

using cuda_test::DestinationSpec;
using cuda_test::DeviceBytes;
using cuda_test::Engine;
using cuda_test::Layout;
using cuda_test::RequireGpu;

// Gradients written straight into device memory (as CUDA IPC regions are
// given) equal the ones copied to the host, bit for bit: both modes, both
// RECOMPUTE layouts, dW in the input dtype and in fp32.
TEST(CudaEngineSemanticsTest, DeviceDestinationsHoldTheHostResults) {
  for (Layout layout : {Layout::kTokenChunks, Layout::kVocabularySlices, Layout::kOneChunk}) {
    FLCE_GET_ENGINE_OR_SKIP(engine, layout);
    RandomProblemSpec spec = DestinationSpec();
    const OwnedProblem p = MakeRandomProblem(spec);
    for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
      ForwardSpec fs;
      fs.need_backward = true;
      fs.mode = mode;
      auto fwd = engine->Forward(p.view(), fs, nullptr);
      ASSERT_TRUE(fwd.ok()) << fwd.status();
      for (DType wdtype : {DType::kBFloat16, DType::kFloat32}) {
        SCOPED_TRACE(std::string(BackwardModeName(mode)) + " dW " + DTypeName(wdtype));
        BackwardSpec host;
        host.weight_grad_dtype = wdtype;
        auto want = engine->Backward(*fwd->saved, host, nullptr);
        ASSERT_TRUE(want.ok()) << want.status();
        DeviceBytes dx(want->grad_hidden.data.size()), dw(want->grad_weight.data.size()),
            db(want->grad_bias->data.size());
        BackwardSpec device = host;
        device.grad_hidden_to = GradientDestination{dx.data, MemorySpace::kCuda};
        device.grad_weight_to = GradientDestination{dw.data, MemorySpace::kCuda};
        device.grad_bias_to = GradientDestination{db.data, MemorySpace::kCuda};
        auto got = engine->Backward(*fwd->saved, device, nullptr);
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_TRUE(got->grad_weight.data.empty());
        EXPECT_EQ(dx.Read(), want->grad_hidden.data);
        EXPECT_EQ(dw.Read(), want->grad_weight.data);
        EXPECT_EQ(db.Read(), want->grad_bias->data);
      }
    }
  }
}

// An accumulating destination (engine-allocated device memory) gets the
// scaled fp32 dW and db added (and a bf16 one autograd's rounding): overwritten by the first
// Backward, added by the second, so it holds exactly twice the host result; dX is returned as
// usual. Both modes, both RECOMPUTE layouts. The allocation is zeroed,
// counted in device_memory_bytes() while alive, and round-trips through
// DeviceMemory::CopyToDevice / CopyToHost.
TEST(CudaEngineSemanticsTest, AccumulatingDestinationsAddTheScaledGradient) {
  for (Layout layout : {Layout::kTokenChunks, Layout::kVocabularySlices, Layout::kOneChunk}) {
    FLCE_GET_ENGINE_OR_SKIP(engine, layout);
    RandomProblemSpec spec = DestinationSpec();
    spec.options.reduction = Reduction::kSum;
    const OwnedProblem p = MakeRandomProblem(spec);
    const int64_t dw_bytes = spec.vocab * spec.hidden * 4, db_bytes = spec.vocab * 4;
    const int64_t before = engine->device_memory_bytes();
    auto dw = engine->device_memory()->Allocate(dw_bytes);
    auto db = engine->device_memory()->Allocate(db_bytes);
    ASSERT_TRUE(dw.ok() && db.ok()) << dw.status() << db.status();
    EXPECT_EQ(engine->device_memory_bytes() - before, dw_bytes + db_bytes);
    std::string zeros(db_bytes, 'x');
    ASSERT_TRUE(engine->device_memory()->CopyToHost((*db)->data(), zeros.data(), db_bytes).ok());
    EXPECT_EQ(zeros, std::string(db_bytes, '\0'));
    HostTensor g(DType::kFloat32, {});
    g.mutable_data<float>()[0] = 0.5f;
    for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
      SCOPED_TRACE(BackwardModeName(mode));
      ForwardSpec fs;
      fs.need_backward = true;
      fs.mode = mode;
      auto fwd = engine->Forward(p.view(), fs, nullptr);
      ASSERT_TRUE(fwd.ok()) << fwd.status();
      BackwardSpec host;
      host.weight_grad_dtype = DType::kFloat32;
      host.grad_output = g.view();
      auto want = engine->Backward(*fwd->saved, host, nullptr);
      ASSERT_TRUE(want.ok()) << want.status();
      for (bool accumulate : {false, true}) {
        BackwardSpec into = host;
        into.grad_weight_to = GradientDestination{(*dw)->data(), MemorySpace::kCuda, accumulate};
        into.grad_bias_to = GradientDestination{(*db)->data(), MemorySpace::kCuda, accumulate};
        auto got = engine->Backward(*fwd->saved, into, nullptr);
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_TRUE(got->grad_weight.data.empty());
        EXPECT_EQ(got->grad_hidden.data, want->grad_hidden.data);
      }
      HostTensor sum_w(DType::kFloat32, {spec.vocab, spec.hidden}),
          sum_b(DType::kFloat32, {spec.vocab});
      ASSERT_TRUE(
          engine->device_memory()->CopyToHost((*dw)->data(), sum_w.data.data(), dw_bytes).ok());
      ASSERT_TRUE(
          engine->device_memory()->CopyToHost((*db)->data(), sum_b.data.data(), db_bytes).ok());
      for (int64_t i = 0; i < sum_w.num_elements(); ++i) {
        ASSERT_EQ(sum_w.data_as<float>()[i], 2.0f * want->grad_weight.data_as<float>()[i]) << i;
      }
      for (int64_t i = 0; i < sum_b.num_elements(); ++i) {
        ASSERT_EQ(sum_b.data_as<float>()[i], 2.0f * want->grad_bias->data_as<float>()[i]) << i;
      }
      // dX never accumulates, and host memory never does.
      BackwardSpec bad = host;
      bad.grad_hidden_to = GradientDestination{(*dw)->data(), MemorySpace::kCuda, true};
      EXPECT_EQ(engine->Backward(*fwd->saved, bad, nullptr).status().code(),
                absl::StatusCode::kInvalidArgument);
      bad = host;
      bad.grad_weight_to = GradientDestination{sum_w.data.data(), MemorySpace::kHost, true};
      EXPECT_EQ(engine->Backward(*fwd->saved, bad, nullptr).status().code(),
                absl::StatusCode::kInvalidArgument);
      // A bf16 destination (a bf16 parameter's .grad) gets round(old +
      // round(new)), as autograd adds a new gradient into it.
      BackwardSpec narrow = host;
      narrow.weight_grad_dtype = DType::kBFloat16;
      auto want16 = engine->Backward(*fwd->saved, narrow, nullptr);
      ASSERT_TRUE(want16.ok()) << want16.status();
      HostTensor old16(DType::kBFloat16, {spec.vocab, spec.hidden});
      for (int64_t i = 0; i < old16.num_elements(); ++i) {
        old16.mutable_data<uint16_t>()[i] = FloatToBFloat16(0.001f * static_cast<float>(i % 97));
      }
      DeviceBytes grad16(old16.data.size());
      ASSERT_EQ(
          cudaMemcpy(grad16.data, old16.data.data(), old16.data.size(), cudaMemcpyHostToDevice),
          cudaSuccess);
      narrow.grad_weight_to = GradientDestination{grad16.data, MemorySpace::kCuda, true};
      ASSERT_TRUE(engine->Backward(*fwd->saved, narrow, nullptr).ok());
      const std::string sum16 = grad16.Read();
      const uint16_t* got16 = reinterpret_cast<const uint16_t*>(sum16.data());
      for (int64_t i = 0; i < old16.num_elements(); ++i) {
        const float expected = BFloat16ToFloat(old16.data_as<uint16_t>()[i]) +
                               BFloat16ToFloat(want16->grad_weight.data_as<uint16_t>()[i]);
        ASSERT_EQ(got16[i], FloatToBFloat16(expected)) << i;
      }
    }
    std::string back(db_bytes, 'y');
    ASSERT_TRUE(engine->device_memory()->CopyToDevice(zeros.data(), (*db)->data(), db_bytes).ok());
    ASSERT_TRUE(engine->device_memory()->CopyToHost((*db)->data(), back.data(), db_bytes).ok());
    EXPECT_EQ(back, zeros);
    const int64_t held = engine->device_memory_bytes();
    dw->reset();
    db->reset();
    EXPECT_EQ(held - engine->device_memory_bytes(), dw_bytes + db_bytes);
  }
}

// The stream-ordered pool's high-water mark of what `f` allocates on top of
// what is allocated when it starts.
template <typename F>
int64_t PoolHighWater(F&& f) {
  cudaMemPool_t pool;
  EXPECT_EQ(cudaDeviceGetDefaultMemPool(&pool, 0), cudaSuccess);
  uint64_t used = 0, high = 0;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used), cudaSuccess);
  // The high-water mark can only be reset to zero (it then restarts from
  // what is in use).
  uint64_t zero = 0;
  EXPECT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero), cudaSuccess);
  f();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high), cudaSuccess);
  return static_cast<int64_t>(high) - static_cast<int64_t>(used);
}

// X and W that live on the device (a registered weight's device copy, CUDA
// IPC memory) are read in place: the same bits as from host memory, a
// Forward that allocates X's and W's bytes less, a RECOMPUTE state that
// holds neither but keeps their owner alive until it goes.
TEST(CudaEngineSemanticsTest, DeviceResidentInputsAreReadInPlace) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  RandomProblemSpec spec;
  spec.rows = 97;
  spec.hidden = 64;
  spec.vocab = 20011;
  spec.dtype = DType::kBFloat16;
  spec.bias = true;
  const OwnedProblem p = MakeRandomProblem(spec);
  const int64_t x_bytes = p.hidden.data.size(), w_bytes = p.weight.data.size();
  cuda_test::ProblemOnDevice device_copy(p);
  LossProblem& on_device = device_copy.view;
  for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
    SCOPED_TRACE(BackwardModeName(mode));
    ForwardSpec fs;
    fs.need_backward = true;
    fs.mode = mode;
    absl::StatusOr<ForwardResult> from_host, in_place;
    const int64_t host_high =
        PoolHighWater([&] { from_host = engine->Forward(p.view(), fs, nullptr); });
    auto owner = std::make_shared<int>(0);
    std::weak_ptr<int> watch = owner;
    on_device.device_owner = std::move(owner);
    const int64_t device_high =
        PoolHighWater([&] { in_place = engine->Forward(on_device, fs, nullptr); });
    on_device.device_owner.reset();
    ASSERT_TRUE(from_host.ok() && in_place.ok()) << from_host.status() << in_place.status();
    EXPECT_EQ(from_host->loss.data, in_place->loss.data);
    EXPECT_GE(host_high - device_high, x_bytes + w_bytes)
        << "from host " << host_high << " bytes, in place " << device_high;
    std::printf(
        "%s Forward, device memory allocated: %lld bytes with X and W from the host, "
        "%lld read in place (X %lld + W %lld bytes)\n",
        BackwardModeName(mode), static_cast<long long>(host_high),
        static_cast<long long>(device_high), static_cast<long long>(x_bytes),
        static_cast<long long>(w_bytes));
    EXPECT_EQ(engine->SavedStateBytes(p.view(), mode) - engine->SavedStateBytes(on_device, mode),
              mode == BackwardMode::kRecompute ? x_bytes + w_bytes : 0);
    EXPECT_EQ(in_place->saved->bytes(), engine->SavedStateBytes(on_device, mode));
    // Only a state that reads X and W again holds their owner.
    EXPECT_EQ(watch.expired(), mode == BackwardMode::kStoreGrads);
    auto want = engine->Backward(*from_host->saved, BackwardSpec{}, nullptr);
    auto got = engine->Backward(*in_place->saved, BackwardSpec{}, nullptr);
    ASSERT_TRUE(want.ok() && got.ok()) << want.status() << got.status();
    EXPECT_EQ(want->grad_hidden.data, got->grad_hidden.data);
    EXPECT_EQ(want->grad_weight.data, got->grad_weight.data);
    EXPECT_EQ(want->grad_bias->data, got->grad_bias->data);
    in_place->saved.reset();
    EXPECT_TRUE(watch.expired());
  }
}

}  // namespace
}  // namespace flce
