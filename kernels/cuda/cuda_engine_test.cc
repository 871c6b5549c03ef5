// The CUDA engine against the fp64 reference and the CPU engine. Tagged
// `gpu`: skips without a device, fails without one when REQUIRE_GPU=1.

#include "kernels/cuda/cuda_engine.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_engine.h"
#include "kernels/dtype.h"
#include "kernels/engine_conformance.h"
#include "kernels/reference/accuracy.h"
#include "kernels/reference/random_problem.h"

namespace flce {
namespace {

bool RequireGpu() {
  const char* v = std::getenv("REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

// How the RECOMPUTE backward walks the logits.
enum class Layout {
  kTokenChunks,      // token chunks, like Forward (slices of every row do not fit)
  kVocabularySlices  // all rows at once, vocabulary slices of 16+ columns
};

// Two engines for the whole binary, both with a small chunk budget so that
// every case runs several token chunks (at least kCudaMinChunkRows rows each)
// in Forward, and with it several vocabulary slices or token chunks in the
// RECOMPUTE backward.
CudaEngine* Engine(std::string* why, Layout layout = Layout::kTokenChunks) {
  auto make = [](int64_t min_slice_columns) {
    CudaEngineOptions options;
    options.chunk_bytes = 64 << 10;
    options.min_slice_columns = min_slice_columns;
    return new absl::StatusOr<std::unique_ptr<CudaEngine>>(CudaEngine::Create(options));
  };
  static absl::StatusOr<std::unique_ptr<CudaEngine>>* chunks = make(int64_t{1} << 40);
  static absl::StatusOr<std::unique_ptr<CudaEngine>>* slices = make(16);
  auto* engine = layout == Layout::kTokenChunks ? chunks : slices;
  if (!engine->ok()) {
    *why = engine->status().ToString();
    return nullptr;
  }
  return engine->value().get();
}

#define FLCE_GET_ENGINE_OR_SKIP(engine, ...)                  \
  std::string why_;                                           \
  CudaEngine* engine = Engine(&why_, ##__VA_ARGS__);          \
  if (engine == nullptr) {                                    \
    if (RequireGpu()) FAIL() << "REQUIRE_GPU=1 but " << why_; \
    GTEST_SKIP() << "no CUDA device: " << why_;               \
  }

class CudaEngineTest : public ::testing::TestWithParam<std::tuple<DType, Layout>> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
  void RunAll(const std::vector<ConformanceCase>& cases) {
    FLCE_GET_ENGINE_OR_SKIP(engine, std::get<1>(GetParam()));
    for (const ConformanceCase& c : cases) RunConformanceCase(*engine, c);
  }
};

TEST_P(CudaEngineTest, OddSizesBothModesAllReductions) { RunAll(OddSizeCases(dtype())); }
TEST_P(CudaEngineTest, EveryOptionTogether) { RunAll(EveryOptionCases(dtype())); }
TEST_P(CudaEngineTest, EachOptionAlone) { RunAll(EachOptionCases(dtype())); }
TEST_P(CudaEngineTest, PeakedAndFlatSoftmaxes) { RunAll(SoftmaxShapeCases(dtype())); }
TEST_P(CudaEngineTest, LargeVocabulary) { RunAll(LargeVocabularyCases(dtype())); }

INSTANTIATE_TEST_SUITE_P(
    AllDTypes, CudaEngineTest,
    ::testing::Combine(::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                       ::testing::Values(Layout::kTokenChunks, Layout::kVocabularySlices)),
    [](const auto& info) {
      return std::string(DTypeName(std::get<0>(info.param))) +
             (std::get<1>(info.param) == Layout::kTokenChunks ? "_token_chunks"
                                                              : "_vocabulary_slices");
    });

// Device memory a test owns.
struct DeviceBytes {
  explicit DeviceBytes(size_t n) : size(n) { EXPECT_EQ(cudaMalloc(&data, n), cudaSuccess); }
  ~DeviceBytes() { cudaFree(data); }
  std::string Read() const {
    std::string out(size, '\0');
    EXPECT_EQ(cudaMemcpy(out.data(), data, size, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  void* data = nullptr;
  size_t size;
};

// The problem the gradient-destination tests run: bf16 with a bias, odd V.
RandomProblemSpec DestinationSpec() {
  RandomProblemSpec spec;
  spec.rows = 150;
  spec.hidden = 40;
  spec.vocab = 3001;
  spec.dtype = DType::kBFloat16;
  spec.bias = true;
  return spec;
}

// Gradients written straight into device memory (as CUDA IPC regions are
// given) equal the ones copied to the host, bit for bit: both modes, both
// RECOMPUTE layouts, dW in the input dtype and in fp32.
TEST(CudaEngineSemanticsTest, DeviceDestinationsHoldTheHostResults) {
  for (Layout layout : {Layout::kTokenChunks, Layout::kVocabularySlices}) {
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
  for (Layout layout : {Layout::kTokenChunks, Layout::kVocabularySlices}) {
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
  DeviceBytes x(x_bytes), w(w_bytes);
  ASSERT_EQ(cudaMemcpy(x.data, p.hidden.data.data(), x_bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(w.data, p.weight.data.data(), w_bytes, cudaMemcpyHostToDevice), cudaSuccess);
  LossProblem on_device = p.view();
  on_device.hidden.data = x.data;
  on_device.hidden.space = MemorySpace::kCuda;
  on_device.weight.data = w.data;
  on_device.weight.space = MemorySpace::kCuda;
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

// The benchmark's stage timing names every stage of a run and times each.
TEST(CudaEngineSemanticsTest, DeviceRunTimesItsStages) {
  for (Layout layout : {Layout::kTokenChunks, Layout::kVocabularySlices}) {
    FLCE_GET_ENGINE_OR_SKIP(engine, layout);
    RandomProblemSpec spec;
    spec.rows = 300;
    spec.hidden = 32;
    spec.vocab = 2000;
    spec.dtype = DType::kBFloat16;
    const OwnedProblem p = MakeRandomProblem(spec);
    for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
      SCOPED_TRACE(BackwardModeName(mode));
      auto run = engine->PrepareDeviceRun(p.view(), mode);
      ASSERT_TRUE(run.ok()) << run.status();
      auto stages = (*run)->RunStages();
      ASSERT_TRUE(stages.ok()) << stages.status();
      for (const char* stage : {"logits GEMM", "row kernel", "dX GEMM", "narrowing dX"}) {
        ASSERT_EQ(stages->count(stage), 1u) << stage;
        EXPECT_GT(stages->at(stage), 0.0) << stage;
      }
      const char* dw = mode == BackwardMode::kStoreGrads     ? "dW GEMM, fp32, beta 1"
                       : layout == Layout::kVocabularySlices ? "dW GEMM, final dtype"
                                                             : "dW GEMM, fp32, beta 1";
      EXPECT_EQ(stages->count(dw), 1u) << dw;
      absl::StatusOr<double> ms = (*run)->Run();
      ASSERT_TRUE(ms.ok()) << ms.status();
      EXPECT_GT(*ms, 0.0);  // device milliseconds
    }
  }
}

// Tuning the GEMMs' algorithms changes no bit of any result: an engine
// that tunes and one that runs cuBLAS's defaults agree exactly, both modes,
// several token chunks (dW GEMMs with beta 1 after tuning at beta 0).
TEST(CudaEngineSemanticsTest, TunedGemmsChangeNoBit) {
  FLCE_GET_ENGINE_OR_SKIP(any_engine);
  auto make = [](bool tune) {
    CudaEngineOptions options;
    options.chunk_bytes = 32 << 20;  // 838 rows of 20011 bf16 logits: 3 chunks
    options.tune_gemms = tune;
    return CudaEngine::Create(options);
  };
  auto tuned = make(true), plain = make(false);
  ASSERT_TRUE(tuned.ok() && plain.ok());
  RandomProblemSpec spec;
  spec.rows = 2000;  // chunk GEMMs of 2.7e10 FLOP: above GemmTuning::min_flop
  spec.hidden = 1024;
  spec.vocab = 20011;
  spec.dtype = DType::kBFloat16;
  spec.options.z_loss_scale = 1e-4f;
  const OwnedProblem p = MakeRandomProblem(spec);
  for (BackwardMode mode : {BackwardMode::kStoreGrads, BackwardMode::kRecompute}) {
    SCOPED_TRACE(BackwardModeName(mode));
    ForwardSpec fs;
    fs.need_backward = true;
    fs.mode = mode;
    auto results = [&](CudaEngine& engine) {
      std::vector<std::string> out;
      for (int call = 0; call < 2; ++call) {  // the first call tunes, the second reuses
        auto fwd = engine.Forward(p.view(), fs, nullptr);
        EXPECT_TRUE(fwd.ok()) << fwd.status();
        if (!fwd.ok()) return out;
        auto grads = engine.Backward(*fwd->saved, {}, nullptr);
        EXPECT_TRUE(grads.ok()) << grads.status();
        if (!grads.ok()) return out;
        out.push_back(fwd->loss.data);
        out.push_back(grads->grad_hidden.data);
        out.push_back(grads->grad_weight.data);
      }
      return out;
    };
    const std::vector<std::string> want = results(**plain), got = results(**tuned);
    EXPECT_GT((*tuned)->tuned_gemm_shapes(), 0);
    EXPECT_EQ((*plain)->tuned_gemm_shapes(), 0);
    ASSERT_EQ(want.size(), 6u);
    ASSERT_EQ(got.size(), 6u);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(want[i] == got[i]) << "result " << i;
  }
}

// The one-pass rows (STORE_GRADS, bf16/fp32 rows without label smoothing,
// V a multiple of the 16-byte pack) against the fp64 reference: rows of
// several tiles, flat to peaked softmaxes, z-loss, ignored rows, both
// reductions STORE_GRADS takes, then bias, class weights and softcap alone
// and together. None of them leaves the kernel's range, so none runs again
// with two passes: the one-pass results are what was judged.
TEST(CudaEngineSemanticsTest, OnePassRowsMeetTheBar) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  const int64_t reruns = engine->forward_reruns();
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    auto one_pass = [&](const std::string& name, Reduction reduction) {
      ConformanceCase c =
          MakeCase("one pass, " + name, 67, 24, 20008, dtype, reduction, BackwardMode::kStoreGrads);
      c.spec.ignore_fraction = 0.2;
      c.spec.options.z_loss_scale = 1e-3f;
      return c;
    };
    for (double scale : {0.1, 2.0, 30.0}) {
      for (Reduction reduction : {Reduction::kMean, Reduction::kSum}) {
        ConformanceCase c = one_pass("logit scale " + std::to_string(scale), reduction);
        c.spec.logit_scale = scale;
        RunConformanceCase(*engine, c);
      }
    }
    for (int options = 1; options < 8; ++options) {
      ConformanceCase c = one_pass("options " + std::to_string(options), Reduction::kMean);
      c.spec.bias = (options & 1) != 0;
      c.spec.class_weight = (options & 2) != 0;
      if ((options & 4) != 0) c.spec.options.logit_softcap = 5.0f;
      RunConformanceCase(*engine, c);
    }
  }
  EXPECT_EQ(engine->forward_reruns(), reruns);
}

// A target whose class weight is 0 (no z-loss) has an all-zero gradient
// row: the one-pass rows give it a zero factor without a rerun, and the
// results meet the bar.
TEST(CudaEngineSemanticsTest, ZeroClassWeightRowsStayOnePass) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  RandomProblemSpec spec;
  spec.rows = 50;
  spec.hidden = 24;
  spec.vocab = 9000;
  spec.dtype = DType::kBFloat16;
  spec.class_weight = true;
  OwnedProblem p = MakeRandomProblem(spec);
  const int64_t* target = p.target.data_as<int64_t>();
  for (int i = 0; i < 10; ++i) p.class_weight->mutable_data<float>()[target[i]] = 0.0f;
  const int64_t reruns = engine->forward_reruns();
  ForwardSpec fs;
  fs.need_backward = true;
  fs.want_lse = true;
  fs.want_per_row_loss = true;
  auto fwd = engine->Forward(p.view(), fs, nullptr);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  auto grads = engine->Backward(*fwd->saved, {}, nullptr);
  ASSERT_TRUE(grads.ok()) << grads.status();
  const AccuracyReport report = CheckAccuracy(p.view(), {}, CollectOutputs(*fwd, &*grads));
  EXPECT_TRUE(report.ok()) << report.ToString();
  EXPECT_EQ(engine->forward_reruns(), reruns);
}

// Forward (STORE_GRADS) and Backward of `p`: the loss, per-row loss, lse,
// dX and dW bits.
std::vector<std::string> StoreGradsBits(CudaEngine& engine, const OwnedProblem& p) {
  ForwardSpec fs;
  fs.need_backward = true;
  fs.want_lse = true;
  fs.want_per_row_loss = true;
  auto fwd = engine.Forward(p.view(), fs, nullptr);
  EXPECT_TRUE(fwd.ok()) << fwd.status();
  if (!fwd.ok()) return {};
  auto grads = engine.Backward(*fwd->saved, {}, nullptr);
  EXPECT_TRUE(grads.ok()) << grads.status();
  if (!grads.ok()) return {};
  return {fwd->loss.data, fwd->per_row_loss->data, fwd->lse->data, grads->grad_hidden.data,
          grads->grad_weight.data};
}

// A row whose largest logit lies far above the maximum of its first tile
// (here ~300 nats past the first 8192 columns), or holds a NaN, is outside
// the one-pass kernel's range: Forward runs again with two passes, and its
// results are those of an engine that always reads twice, bit for bit.
TEST(CudaEngineSemanticsTest, RowsOutOfOnePassRangeRunAgainWithTwoPasses) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  CudaEngineOptions options;
  options.chunk_bytes = 64 << 10;
  options.one_pass_rows = false;
  auto two_pass = CudaEngine::Create(options);
  ASSERT_TRUE(two_pass.ok()) << two_pass.status();
  RandomProblemSpec spec;
  spec.rows = 40;
  spec.hidden = 16;
  spec.vocab = 12000;
  spec.dtype = DType::kBFloat16;
  spec.options.z_loss_scale = 1e-4f;
  const OwnedProblem plain = MakeRandomProblem(spec);

  // W's last row along X's row 3: that logit is 300, the others a few units.
  OwnedProblem far = MakeRandomProblem(spec);
  const int64_t h = spec.hidden, v = spec.vocab;
  std::vector<float> x3(h), w(v * h);
  ToFloat(spec.dtype, far.hidden.data.data() + 3 * h * 2, h, x3.data());
  double norm2 = 0;
  for (float e : x3) norm2 += double{e} * e;
  for (int64_t j = 0; j < h; ++j) w[j] = static_cast<float>(300.0 * x3[j] / norm2);
  FromFloat(spec.dtype, w.data(), h, far.weight.data.data() + (v - 1) * h * 2);

  OwnedProblem nan = MakeRandomProblem(spec);
  const float not_a_number = std::nanf("");
  FromFloat(spec.dtype, &not_a_number, 1, nan.hidden.data.data() + 5 * h * 2);

  const int64_t reruns = engine->forward_reruns();
  const std::vector<std::string> ok = StoreGradsBits(*engine, plain);
  EXPECT_EQ(engine->forward_reruns(), reruns) << "in-range rows ran again";
  for (const OwnedProblem* p : {&far, &nan}) {
    SCOPED_TRACE(p == &far ? "a logit far above its first tile" : "a NaN");
    const int64_t before = engine->forward_reruns();
    const std::vector<std::string> got = StoreGradsBits(*engine, *p);
    const std::vector<std::string> want = StoreGradsBits(**two_pass, *p);
    EXPECT_EQ(engine->forward_reruns(), before + 1);
    ASSERT_EQ(got.size(), 5u);
    ASSERT_EQ(want.size(), 5u);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(got[i] == want[i]) << "result " << i;
  }
  EXPECT_EQ((*two_pass)->forward_reruns(), 0);
  EXPECT_TRUE(engine->health().ok());
}

TEST(CudaEngineSemanticsTest, AgreesWithTheCpuEngine) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  CpuEngine cpu;
  RandomProblemSpec spec;
  spec.rows = 300;
  spec.hidden = 96;
  spec.vocab = 5003;
  spec.bias = true;
  spec.options.label_smoothing = 0.05f;
  const OwnedProblem p = MakeRandomProblem(spec);
  ForwardSpec fs;
  fs.want_lse = true;
  auto gpu = engine->Forward(p.view(), fs, nullptr);
  auto host = cpu.Forward(p.view(), fs, nullptr);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ASSERT_TRUE(host.ok()) << host.status();
  const float a = gpu->loss.data_as<float>()[0], b = host->loss.data_as<float>()[0];
  EXPECT_NEAR(a, b, 1e-5 * std::fabs(b));
  EXPECT_EQ(gpu->num_valid, host->num_valid);
  EXPECT_EQ(gpu->num_correct, host->num_correct);
  for (int64_t i = 0; i < spec.rows; ++i) {
    ASSERT_NEAR(gpu->lse->data_as<float>()[i], host->lse->data_as<float>()[i], 1e-4) << i;
  }
}

TEST(CudaEngineSemanticsTest, MeanOverAllIgnoredRowsIsNaNWithZeroGradients) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  RandomProblemSpec spec;
  spec.rows = 70;
  spec.ignore_fraction = 1.0;
  const OwnedProblem p = MakeRandomProblem(spec);
  ForwardSpec fs;
  fs.need_backward = true;
  auto fwd = engine->Forward(p.view(), fs, nullptr);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_TRUE(std::isnan(fwd->loss.data_as<float>()[0]));
  auto grads = engine->Backward(*fwd->saved, {}, nullptr);
  ASSERT_TRUE(grads.ok()) << grads.status();
  for (float v : TensorToFloats(grads->grad_weight.view())) ASSERT_EQ(v, 0.0f);
}

TEST(CudaEngineSemanticsTest, NoRowsGiveZeroWeightGradient) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  std::string why;
  CudaEngine* sliced = Engine(&why, Layout::kVocabularySlices);
  ASSERT_NE(sliced, nullptr) << why;
  RandomProblemSpec spec;
  spec.rows = 0;
  spec.options.reduction = Reduction::kSum;
  spec.bias = true;
  const OwnedProblem p = MakeRandomProblem(spec);
  for (auto [mode, e] :
       {std::pair{BackwardMode::kStoreGrads, engine}, std::pair{BackwardMode::kRecompute, engine},
        std::pair{BackwardMode::kRecompute, sliced}}) {
    ForwardSpec fs;
    fs.need_backward = true;
    fs.mode = mode;
    auto fwd = e->Forward(p.view(), fs, nullptr);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    EXPECT_EQ(fwd->loss.data_as<float>()[0], 0.0f);
    auto grads = e->Backward(*fwd->saved, {}, nullptr);
    ASSERT_TRUE(grads.ok()) << grads.status();
    for (float v : TensorToFloats(grads->grad_weight.view())) ASSERT_EQ(v, 0.0f);
    for (float v : TensorToFloats(grads->grad_bias->view())) ASSERT_EQ(v, 0.0f);
  }
}

TEST(CudaEngineSemanticsTest, NonFiniteInputsGiveNaNLoss) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  RandomProblemSpec spec;
  spec.rows = 5;
  OwnedProblem p = MakeRandomProblem(spec);
  p.hidden.mutable_data<float>()[7] = std::nanf("");
  auto fwd = engine->Forward(p.view(), {}, nullptr);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_TRUE(std::isnan(fwd->loss.data_as<float>()[0]));
  EXPECT_TRUE(engine->health().ok());
}

TEST(CudaEngineSemanticsTest, CancellationStopsBetweenChunks) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  RandomProblemSpec spec;
  spec.rows = 500;
  const OwnedProblem p = MakeRandomProblem(spec);
  auto fwd = engine->Forward(p.view(), {}, [] { return true; });
  EXPECT_EQ(fwd.status().code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(engine->health().ok());
}

TEST(CudaEngineSemanticsTest, OutOfMemoryIsResourceExhaustedAndTheEngineKeepsServing) {
  std::string why;
  if (Engine(&why) == nullptr) {
    if (RequireGpu()) FAIL() << why;
    GTEST_SKIP() << why;
  }
  // A chunk budget far beyond the card: the logits chunk cannot be had.
  CudaEngineOptions options;
  options.chunk_bytes = int64_t{1} << 40;
  auto greedy = CudaEngine::Create(options);
  ASSERT_TRUE(greedy.ok()) << greedy.status();
  RandomProblemSpec spec;
  spec.rows = 1 << 20;
  spec.hidden = 1;
  spec.vocab = 100000;  // 1 Mi rows × 100000 × 4 bytes = 400 GiB of logits
  const OwnedProblem p = MakeRandomProblem(spec);
  auto fwd = (*greedy)->Forward(p.view(), {}, nullptr);
  EXPECT_EQ(fwd.status().code(), absl::StatusCode::kResourceExhausted) << fwd.status();
  EXPECT_TRUE((*greedy)->health().ok());
  RandomProblemSpec small;
  const OwnedProblem q = MakeRandomProblem(small);
  EXPECT_TRUE((*greedy)->Forward(q.view(), {}, nullptr).ok());
}

TEST(CudaEngineSemanticsTest, ReportsTheDevice) {
  FLCE_GET_ENGINE_OR_SKIP(engine);
  ASSERT_EQ(engine->devices().size(), 1u);
  EXPECT_FALSE(engine->devices()[0].name.empty());
  EXPECT_GT(engine->devices()[0].total_memory_bytes, 0);
  EXPECT_EQ(engine->backend(), "cuda");
}

}  // namespace
}  // namespace flce
