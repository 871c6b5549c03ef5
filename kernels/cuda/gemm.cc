#include "kernels/cuda/gemm.h"

#include <algorithm>
#include <vector>

#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/reductions.h"
#include "kernels/status_macros.h"

namespace flce {
namespace internal_cuda {
namespace {

cudaDataType_t CudaType(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return CUDA_R_16F;
    case DType::kBFloat16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_32F;
  }
}

// fp32 operands: no TF32 or other reduced-precision path.
cublasComputeType_t ComputeType(const GemmShape& g) {
  return g.a_type == DType::kFloat32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
}

absl::Status RunDefault(DeviceHealth& health, cublasHandle_t blas, const GemmShape& g,
                        const void* a, const void* b, float beta, void* c, float alpha = 1.0f) {
  return health.Check(
      cublasGemmEx(blas, g.op_a, g.op_b, static_cast<int>(g.m), static_cast<int>(g.n),
                   static_cast<int>(g.k), &alpha, a, CudaType(g.a_type), static_cast<int>(g.lda), b,
                   CudaType(g.b_type), static_cast<int>(g.ldb), &beta, c, CudaType(g.c_type),
                   static_cast<int>(g.ldc), ComputeType(g), CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

constexpr int kCandidates = 8;  // heuristic results considered per shape
// Rounds of one timed run of every eligible algorithm, each round in a
// rotated order, so that the card's clock drifting during the trials
// favours none of them; an algorithm's time is its median.
constexpr int kRounds = 5;
// A candidate replaces the default only when this much faster.
constexpr float kMinGain = 0.02f;

// cuBLASLt's heuristic assumes operands aligned to this many bytes (its
// default minimum alignment preference); a GEMM on pointers with less runs
// the default, which takes any (same bits: the tuned choice gives them).
constexpr uintptr_t kLtAlignment = 256;

bool LtAligned(const void* a, const void* b, const void* c) {
  return (reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) |
          reinterpret_cast<uintptr_t>(c)) %
             kLtAlignment ==
         0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<LtGemm>> LtGemm::Create(const GemmShape& g, DeviceHealth& health) {
  std::unique_ptr<LtGemm> d(new LtGemm(health));
  FLCE_RETURN_IF_ERROR(
      health.Check(cublasLtMatmulDescCreate(&d->desc_, ComputeType(g), CUDA_R_32F), "Lt desc"));
  FLCE_RETURN_IF_ERROR(
      health.Check(cublasLtMatmulDescSetAttribute(d->desc_, CUBLASLT_MATMUL_DESC_TRANSA, &g.op_a,
                                                  sizeof(g.op_a)),
                   "Lt transa"));
  FLCE_RETURN_IF_ERROR(
      health.Check(cublasLtMatmulDescSetAttribute(d->desc_, CUBLASLT_MATMUL_DESC_TRANSB, &g.op_b,
                                                  sizeof(g.op_b)),
                   "Lt transb"));
  // op(A) is m×k, op(B) k×n, C m×n, all column-major.
  const bool ta = g.op_a != CUBLAS_OP_N, tb = g.op_b != CUBLAS_OP_N;
  FLCE_RETURN_IF_ERROR(
      health.Check(cublasLtMatrixLayoutCreate(&d->la_, CudaType(g.a_type), ta ? g.k : g.m,
                                              ta ? g.m : g.k, g.lda),
                   "Lt layout A"));
  FLCE_RETURN_IF_ERROR(
      health.Check(cublasLtMatrixLayoutCreate(&d->lb_, CudaType(g.b_type), tb ? g.n : g.k,
                                              tb ? g.k : g.n, g.ldb),
                   "Lt layout B"));
  FLCE_RETURN_IF_ERROR(health.Check(
      cublasLtMatrixLayoutCreate(&d->lc_, CudaType(g.c_type), g.m, g.n, g.ldc), "Lt layout C"));
  return d;
}

LtGemm::~LtGemm() {
  if (lc_) cublasLtMatrixLayoutDestroy(lc_);
  if (lb_) cublasLtMatrixLayoutDestroy(lb_);
  if (la_) cublasLtMatrixLayoutDestroy(la_);
  if (desc_) cublasLtMatmulDescDestroy(desc_);
}

std::vector<cublasLtMatmulHeuristicResult_t> LtGemm::Candidates(cublasLtHandle_t lt, int count,
                                                                size_t workspace_bytes) const {
  std::vector<cublasLtMatmulHeuristicResult_t> results(count);
  int found = 0;
  cublasLtMatmulPreference_t pref = nullptr;
  if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return {};
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                       &workspace_bytes, sizeof(workspace_bytes));
  // No split-K reduction in the output type (as the handle's math mode).
  const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_INPLACE |
                           CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes,
                                       sizeof(schemes));
  if (cublasLtMatmulAlgoGetHeuristic(lt, desc_, la_, lb_, lc_, lc_, pref, count, results.data(),
                                     &found) != CUBLAS_STATUS_SUCCESS) {
    found = 0;
  }
  cublasLtMatmulPreferenceDestroy(pref);
  results.resize(found);
  return results;
}

absl::Status LtGemm::Run(cublasLtHandle_t lt, cudaStream_t stream, const cublasLtMatmulAlgo_t& algo,
                         const void* a, const void* b, float beta, void* c, void* workspace,
                         size_t workspace_bytes, float alpha) const {
  return health_.Check(cublasLtMatmul(lt, desc_, &alpha, a, la_, b, lb_, &beta, c, lc_, c, lc_,
                                      &algo, workspace, workspace_bytes, stream),
                       "cublasLtMatmul");
}

// A shape's algorithm: the default (lt == nullptr) or a cuBLASLt algorithm.
struct GemmRunner::Choice {
  std::unique_ptr<LtGemm> lt;
  cublasLtMatmulAlgo_t algo{};
};

absl::StatusOr<std::unique_ptr<GemmRunner>> GemmRunner::Create(const GemmTuning& tuning,
                                                               DeviceHealth& health) {
  cublasLtHandle_t lt = nullptr;
  if (tuning.enabled) FLCE_RETURN_IF_ERROR(health.Check(cublasLtCreate(&lt), "cublasLtCreate"));
  return std::unique_ptr<GemmRunner>(new GemmRunner(tuning, lt, health));
}

GemmRunner::GemmRunner(const GemmTuning& tuning, cublasLtHandle_t lt, DeviceHealth& health)
    : tuning_(tuning), lt_(lt), health_(health) {}

void GemmRunner::InjectFaultForTesting() { inject_fault_.store(true); }

GemmRunner::~GemmRunner() {
  {
    absl::MutexLock lock(&mu_);
    choices_.clear();
  }
  if (lt_) cublasLtDestroy(lt_);
}

GemmRunner::Counts GemmRunner::counts() const {
  absl::MutexLock lock(&mu_);
  Counts counts;
  for (const auto& [shape, choice] : choices_) {
    ++counts.tuned;
    if (choice->lt != nullptr) ++counts.non_default;
  }
  return counts;
}

absl::Status GemmRunner::Run(cublasHandle_t blas, cudaStream_t stream, const GemmShape& g,
                             const void* a, const void* b, float beta, void* c, bool tune,
                             float alpha) {
  if (g.m == 0 || g.n == 0) return absl::OkStatus();
  if (inject_fault_.exchange(false)) {
    // A trap on the GEMM's stream, waited for: the context is gone when the
    // GEMM below is launched, as after a device fault inside it. Both
    // results are dropped; the GEMM's status is what the engine sees.
    LaunchTrap(stream);
    cudaStreamSynchronize(stream);
  }
  if (!tuning_.enabled || !tune || 2.0 * g.m * g.n * g.k < tuning_.min_flop ||
      !LtAligned(a, b, c)) {
    return RunDefault(health_, blas, g, a, b, beta, c, alpha);
  }
  std::shared_ptr<const Choice> choice;
  bool full = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = choices_.find(g);
    if (it != choices_.end()) choice = it->second;
    full = static_cast<int>(choices_.size()) >= tuning_.max_shapes;
  }
  if (choice == nullptr) {
    // Only beta 0 may overwrite C with trials.
    if (beta != 0.0f || full) return RunDefault(health_, blas, g, a, b, beta, c, alpha);
    FLCE_ASSIGN_OR_RETURN(choice, Tune(blas, stream, g, a, b, c, alpha));
    absl::MutexLock lock(&mu_);
    choices_.emplace(g, choice);  // a concurrent tuning of g may have won: either is valid
    return absl::OkStatus();      // Tune left the result in C
  }
  if (choice->lt == nullptr) return RunDefault(health_, blas, g, a, b, beta, c, alpha);
  return choice->lt->Run(lt_, stream, choice->algo, a, b, beta, c, nullptr, 0, alpha);
}

absl::StatusOr<std::shared_ptr<const GemmRunner::Choice>> GemmRunner::Tune(
    cublasHandle_t blas, cudaStream_t stream, const GemmShape& g, const void* a, const void* b,
    void* c, float alpha) {
  auto choice = std::make_shared<Choice>();
  auto run_default = [&] { return RunDefault(health_, blas, g, a, b, 0.0f, c, alpha); };
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer hash_buffer, DeviceBuffer::Allocate(8, stream, health_));
  auto* hash = hash_buffer.as<unsigned long long>();
  // The hash of C's bits as they are now.
  auto hash_c = [&]() -> absl::StatusOr<unsigned long long> {
    FLCE_RETURN_IF_ERROR(health_.Check(cudaMemsetAsync(hash, 0, 8, stream), "tuning hash"));
    FLCE_RETURN_IF_ERROR(health_.Check(
        LaunchHashMatrix(c, DTypeSize(g.c_type), g.m, g.n, g.ldc, hash, stream), "tuning hash"));
    unsigned long long h = 0;
    FLCE_RETURN_IF_ERROR(
        health_.Check(cudaMemcpyAsync(&h, hash, 8, cudaMemcpyDeviceToHost, stream), "tuning hash"));
    FLCE_RETURN_IF_ERROR(health_.Check(cudaStreamSynchronize(stream), "tuning hash"));
    return h;
  };
  FLCE_RETURN_IF_ERROR(run_default());
  FLCE_ASSIGN_OR_RETURN(const unsigned long long expected, hash_c());

  // The candidates with the default's bits (nullptr: the default itself).
  std::vector<const cublasLtMatmulAlgo_t*> eligible = {nullptr};
  absl::StatusOr<std::unique_ptr<LtGemm>> lt_gemm = LtGemm::Create(g, health_);
  std::vector<cublasLtMatmulHeuristicResult_t> results;
  if (lt_gemm.ok()) results = (*lt_gemm)->Candidates(lt_, kCandidates, 0);
  auto run = [&](const cublasLtMatmulAlgo_t* algo) {
    return algo == nullptr ? run_default()
                           : (*lt_gemm)->Run(lt_, stream, *algo, a, b, 0.0f, c, nullptr, 0, alpha);
  };
  for (const cublasLtMatmulHeuristicResult_t& result : results) {
    const cublasLtMatmulAlgo_t& algo = result.algo;
    uint32_t split_k = 1;
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split_k,
                                         sizeof(split_k), &written);
    if (result.state != CUBLAS_STATUS_SUCCESS || result.workspaceSize != 0 || split_k > 1) {
      continue;
    }
    if (!run(&algo).ok()) continue;  // a candidate cuBLAS refuses is skipped
    FLCE_ASSIGN_OR_RETURN(const unsigned long long h, hash_c());
    if (h == expected) eligible.push_back(&algo);  // other bits: never chosen
  }

  const cublasLtMatmulAlgo_t* best = nullptr;
  if (eligible.size() > 1) {
    EventTimer timer(health_);
    const size_t count = eligible.size();
    std::vector<std::vector<float>> ms(count);
    for (int round = 0; round < kRounds; ++round) {
      for (size_t j = 0; j < count; ++j) {
        const size_t e = (j + round) % count;
        FLCE_ASSIGN_OR_RETURN(const float t, timer.Time(stream, [&] { return run(eligible[e]); }));
        ms[e].push_back(t);
      }
    }
    std::vector<float> median(count);
    for (size_t e = 0; e < count; ++e) {
      std::sort(ms[e].begin(), ms[e].end());
      median[e] = ms[e][ms[e].size() / 2];
    }
    float best_ms = median[0] * (1.0f - kMinGain);
    for (size_t e = 1; e < count; ++e) {
      if (median[e] < best_ms) {
        best_ms = median[e];
        best = eligible[e];
      }
    }
  }
  // The trials leave C as whichever ran last wrote it: the choice writes
  // the result once more.
  FLCE_RETURN_IF_ERROR(run(best));
  if (best != nullptr) {
    choice->algo = *best;
    choice->lt = *std::move(lt_gemm);
  }
  return std::shared_ptr<const Choice>(std::move(choice));
}

}  // namespace internal_cuda
}  // namespace flce
