#include "kernels/cuda/gemm.h"

#include <algorithm>
#include <vector>

#include "kernels/cuda/cuda_resources.h"
#include "kernels/cuda/loss_kernels.h"
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

absl::Status RunDefault(cublasHandle_t blas, const GemmShape& g, const void* a, const void* b,
                        float beta, void* c) {
  const float alpha = 1.0f;
  return CublasStatus(
      cublasGemmEx(blas, g.op_a, g.op_b, static_cast<int>(g.m), static_cast<int>(g.n),
                   static_cast<int>(g.k), &alpha, a, CudaType(g.a_type), static_cast<int>(g.lda),
                   b, CudaType(g.b_type), static_cast<int>(g.ldb), &beta, c, CudaType(g.c_type),
                   static_cast<int>(g.ldc), ComputeType(g), CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

// Elapsed device time between two events, destroyed with it.
class EventPair {
 public:
  EventPair() {
    cudaEventCreate(&start_);
    cudaEventCreate(&stop_);
  }
  ~EventPair() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  // Device ms of f()'s work on `stream`, waited for.
  template <typename F>
  absl::StatusOr<float> Time(cudaStream_t stream, F&& f) {
    FLCE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(start_, stream), "tuning event"));
    FLCE_RETURN_IF_ERROR(f());
    FLCE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(stop_, stream), "tuning event"));
    FLCE_RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(stop_), "tuning"));
    float ms = 0;
    FLCE_RETURN_IF_ERROR(CudaStatus(cudaEventElapsedTime(&ms, start_, stop_), "tuning event"));
    return ms;
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

constexpr int kCandidates = 8;  // heuristic results considered per shape
// Rounds of one timed run of every eligible algorithm, each round in a
// rotated order, so that the card's clock drifting during the trials
// favours none of them; an algorithm's time is its median.
constexpr int kRounds = 5;
// A candidate replaces the default only when this much faster.
constexpr float kMinGain = 0.02f;

}  // namespace

// A shape's algorithm: the default (lt == false) or a cuBLASLt algorithm
// with the descriptors it runs with (read-only once made).
struct GemmRunner::Choice {
  bool lt = false;
  cublasLtMatmulAlgo_t algo{};
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;

  Choice() = default;
  Choice(const Choice&) = delete;
  Choice& operator=(const Choice&) = delete;
  ~Choice() {
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }

  // The descriptors of g (op(A) is m×k, op(B) k×n, C m×n, column-major).
  absl::Status Describe(const GemmShape& g) {
    FLCE_RETURN_IF_ERROR(
        CublasStatus(cublasLtMatmulDescCreate(&desc, ComputeType(g), CUDA_R_32F), "Lt desc"));
    FLCE_RETURN_IF_ERROR(CublasStatus(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.op_a, sizeof(g.op_a)),
        "Lt transa"));
    FLCE_RETURN_IF_ERROR(CublasStatus(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.op_b, sizeof(g.op_b)),
        "Lt transb"));
    const bool ta = g.op_a != CUBLAS_OP_N, tb = g.op_b != CUBLAS_OP_N;
    FLCE_RETURN_IF_ERROR(CublasStatus(
        cublasLtMatrixLayoutCreate(&la, CudaType(g.a_type), ta ? g.k : g.m, ta ? g.m : g.k, g.lda),
        "Lt layout A"));
    FLCE_RETURN_IF_ERROR(CublasStatus(
        cublasLtMatrixLayoutCreate(&lb, CudaType(g.b_type), tb ? g.n : g.k, tb ? g.k : g.n, g.ldb),
        "Lt layout B"));
    return CublasStatus(cublasLtMatrixLayoutCreate(&lc, CudaType(g.c_type), g.m, g.n, g.ldc),
                        "Lt layout C");
  }

  absl::Status Run(cublasLtHandle_t lt, cudaStream_t stream, const cublasLtMatmulAlgo_t& with,
                   const void* a, const void* b, float beta, void* c) const {
    const float alpha = 1.0f;
    return CublasStatus(cublasLtMatmul(lt, desc, &alpha, a, la, b, lb, &beta, c, lc, c, lc,
                                       &with, nullptr, 0, stream),
                        "cublasLtMatmul");
  }
};

absl::StatusOr<std::unique_ptr<GemmRunner>> GemmRunner::Create(const GemmTuning& tuning) {
  cublasLtHandle_t lt = nullptr;
  if (tuning.enabled) FLCE_RETURN_IF_ERROR(CublasStatus(cublasLtCreate(&lt), "cublasLtCreate"));
  return std::unique_ptr<GemmRunner>(new GemmRunner(tuning, lt));
}

GemmRunner::GemmRunner(const GemmTuning& tuning, cublasLtHandle_t lt)
    : tuning_(tuning), lt_(lt) {}

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
    if (choice->lt) ++counts.non_default;
  }
  return counts;
}

absl::Status GemmRunner::Run(cublasHandle_t blas, cudaStream_t stream, const GemmShape& g,
                             const void* a, const void* b, float beta, void* c, bool tune) {
  if (g.m == 0 || g.n == 0) return absl::OkStatus();
  if (!tuning_.enabled || !tune || 2.0 * g.m * g.n * g.k < tuning_.min_flop) {
    return RunDefault(blas, g, a, b, beta, c);
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
    if (beta != 0.0f || full) return RunDefault(blas, g, a, b, beta, c);
    FLCE_ASSIGN_OR_RETURN(choice, Tune(blas, stream, g, a, b, c));
    absl::MutexLock lock(&mu_);
    choices_.emplace(g, choice);  // a concurrent tuning of g may have won: either is valid
    return absl::OkStatus();      // Tune left the result in C
  }
  if (!choice->lt) return RunDefault(blas, g, a, b, beta, c);
  return choice->Run(lt_, stream, choice->algo, a, b, beta, c);
}

absl::StatusOr<std::shared_ptr<const GemmRunner::Choice>> GemmRunner::Tune(
    cublasHandle_t blas, cudaStream_t stream, const GemmShape& g, const void* a, const void* b,
    void* c) {
  auto choice = std::make_shared<Choice>();
  auto run_default = [&] { return RunDefault(blas, g, a, b, 0.0f, c); };
  FLCE_ASSIGN_OR_RETURN(DeviceBuffer hash_buffer, DeviceBuffer::Allocate(8, stream));
  auto* hash = hash_buffer.as<unsigned long long>();
  // The hash of C's bits as they are now.
  auto hash_c = [&]() -> absl::StatusOr<unsigned long long> {
    FLCE_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(hash, 0, 8, stream), "tuning hash"));
    FLCE_RETURN_IF_ERROR(CudaStatus(
        LaunchHashMatrix(c, DTypeSize(g.c_type), g.m, g.n, g.ldc, hash, stream), "tuning hash"));
    unsigned long long h = 0;
    FLCE_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(&h, hash, 8, cudaMemcpyDeviceToHost, stream), "tuning hash"));
    FLCE_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "tuning hash"));
    return h;
  };
  FLCE_RETURN_IF_ERROR(run_default());
  FLCE_ASSIGN_OR_RETURN(const unsigned long long expected, hash_c());

  // The candidates with the default's bits (nullptr: the default itself).
  std::vector<const cublasLtMatmulAlgo_t*> eligible = {nullptr};
  std::vector<cublasLtMatmulHeuristicResult_t> results(kCandidates);
  int found = 0;
  cublasLtMatmulPreference_t pref = nullptr;
  if (choice->Describe(g).ok() &&
      cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS) {
    const size_t no_workspace = 0;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                         &no_workspace, sizeof(no_workspace));
    if (cublasLtMatmulAlgoGetHeuristic(lt_, choice->desc, choice->la, choice->lb, choice->lc,
                                       choice->lc, pref, kCandidates, results.data(),
                                       &found) != CUBLAS_STATUS_SUCCESS) {
      found = 0;
    }
    cublasLtMatmulPreferenceDestroy(pref);
  }
  auto run = [&](const cublasLtMatmulAlgo_t* algo) {
    return algo == nullptr ? run_default()
                           : choice->Run(lt_, stream, *algo, a, b, 0.0f, c);
  };
  for (int i = 0; i < found; ++i) {
    const cublasLtMatmulAlgo_t& algo = results[i].algo;
    uint32_t split_k = 1;
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split_k,
                                         sizeof(split_k), &written);
    if (results[i].state != CUBLAS_STATUS_SUCCESS || results[i].workspaceSize != 0 ||
        split_k > 1) {
      continue;
    }
    if (!run(&algo).ok()) continue;  // a candidate cuBLAS refuses is skipped
    FLCE_ASSIGN_OR_RETURN(const unsigned long long h, hash_c());
    if (h == expected) eligible.push_back(&algo);  // other bits: never chosen
  }

  const cublasLtMatmulAlgo_t* best = nullptr;
  if (eligible.size() > 1) {
    EventPair events;
    const size_t count = eligible.size();
    std::vector<std::vector<float>> ms(count);
    for (int round = 0; round < kRounds; ++round) {
      for (size_t j = 0; j < count; ++j) {
        const size_t e = (j + round) % count;
        FLCE_ASSIGN_OR_RETURN(const float t,
                              events.Time(stream, [&] { return run(eligible[e]); }));
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
  if (best != nullptr) {
    choice->lt = true;
    choice->algo = *best;
  }
  // The trials leave C as whichever ran last wrote it: the choice writes
  // the result once more.
  FLCE_RETURN_IF_ERROR(run(best));
  return std::shared_ptr<const Choice>(std::move(choice));
}

}  // namespace internal_cuda
}  // namespace flce
