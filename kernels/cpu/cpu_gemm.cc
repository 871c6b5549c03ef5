#include "kernels/cpu/cpu_gemm.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace flce {
namespace {

using Dims = dnnl::memory::dims;
using DnnlType = dnnl::memory::data_type;

// The strides of op(X) as an r × c matrix: X stored row-major with leading
// dimension ld, read as is or transposed.
Dims Strides(const GemmOperand& x) {
  return x.transpose == Transpose::kNo ? Dims{x.ld, 1} : Dims{1, x.ld};
}

CBLAS_TRANSPOSE Blas(Transpose t) { return t == Transpose::kNo ? CblasNoTrans : CblasTrans; }

dnnl::engine& CpuEngine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

}  // namespace

// oneDNN's matmul: a primitive per operand type and shape (its JIT-compiled
// kernels are made once), at most kMaxShapes of them; executed with a
// scratchpad of the calling thread's, so that several calls run it at once.
class CpuGemm::OneDnn {
 public:
  static constexpr size_t kMaxShapes = 64;

  // `operands`: bf16 or f32; C is f32.
  absl::Status Multiply(DnnlType operands, int64_t m, int64_t n, int64_t k, const GemmOperand& a,
                        const GemmOperand& b, float* c, int64_t ldc, bool accumulate) {
    try {
      const Key key{operands, m, n, k, a.ld, b.ld, ldc, a.transpose, b.transpose, accumulate};
      std::shared_ptr<const Entry> entry = Find(key);
      if (entry == nullptr) entry = Make(key);
      dnnl::engine& engine = CpuEngine();
      dnnl::memory ma(entry->pd.src_desc(), engine, const_cast<void*>(a.data));
      dnnl::memory mb(entry->pd.weights_desc(), engine, const_cast<void*>(b.data));
      dnnl::memory mc(entry->pd.dst_desc(), engine, c);
      thread_local std::vector<char> scratch;
      const size_t scratch_bytes = entry->pd.scratchpad_desc().get_size();
      if (scratch.size() < scratch_bytes) scratch.resize(scratch_bytes);
      dnnl::memory ms(entry->pd.scratchpad_desc(), engine, scratch.data());
      dnnl::stream stream(engine);
      entry->matmul.execute(stream, {{DNNL_ARG_SRC, ma},
                                     {DNNL_ARG_WEIGHTS, mb},
                                     {DNNL_ARG_DST, mc},
                                     {DNNL_ARG_SCRATCHPAD, ms}});
      stream.wait();
      return absl::OkStatus();
    } catch (const dnnl::error& e) {
      return absl::InternalError(absl::StrCat("oneDNN ",
                                              operands == DnnlType::bf16 ? "bf16" : "fp32",
                                              " matmul ", m, "×", n, "×", k, ": ", e.what()));
    }
  }

  // The implementation oneDNN picks for a matmul of `operands` on this CPU.
  static std::string Implementation(DnnlType operands) {
    try {
      Key key{operands, 64, 64, 64, 64, 64, 64, Transpose::kNo, Transpose::kYes, false};
      return Describe(key).impl_info_str();
    } catch (const dnnl::error& e) {
      return "";
    }
  }

 private:
  using Key = std::tuple<DnnlType, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, Transpose,
                         Transpose, bool>;
  struct Entry {
    dnnl::matmul::primitive_desc pd;
    dnnl::matmul matmul;
  };

  static dnnl::matmul::primitive_desc Describe(const Key& key) {
    const auto [operands, m, n, k, lda, ldb, ldc, ta, tb, accumulate] = key;
    const dnnl::memory::desc a({m, k}, operands, Strides(GemmOperand{nullptr, lda, ta}));
    const dnnl::memory::desc b({k, n}, operands, Strides(GemmOperand{nullptr, ldb, tb}));
    const dnnl::memory::desc c({m, n}, DnnlType::f32, Dims{ldc, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (accumulate) {
      dnnl::post_ops sum;
      sum.append_sum(1.0f);
      attr.set_post_ops(sum);
    }
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attr, CpuEngine());
  }

  std::shared_ptr<const Entry> Find(const Key& key) {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(key);
    return it == cache_.end() ? nullptr : it->second;
  }

  std::shared_ptr<const Entry> Make(const Key& key) {
    dnnl::matmul::primitive_desc pd = Describe(key);
    auto entry = std::make_shared<const Entry>(Entry{pd, dnnl::matmul(pd)});
    absl::MutexLock lock(&mu_);
    if (cache_.size() >= kMaxShapes) cache_.clear();  // (calls in flight keep theirs)
    cache_.emplace(key, entry);
    return entry;
  }

  absl::Mutex mu_;
  std::map<Key, std::shared_ptr<const Entry>> cache_ ABSL_GUARDED_BY(mu_);
};

CpuGemm::CpuGemm(Bf16Gemms bf16, bool onednn_fp32)
    : bf16_(bf16 == Bf16Gemms::kWhereNative  ? NativeBf16()
            : bf16 == Bf16Gemms::kWhereFaster ? Bf16Faster()
                                              : false),
      onednn_fp32_(onednn_fp32),
      onednn_(bf16_ || onednn_fp32_ ? std::make_unique<OneDnn>() : nullptr) {}

CpuGemm::~CpuGemm() = default;

bool CpuGemm::NativeBf16() {
  // A bf16 kernel of oneDNN's own (e.g. "brg:avx512_core_bf16",
  // "brg:avx512_core_amx"), not a reference or converting one.
  static const bool native = [] {
    const std::string impl = OneDnn::Implementation(DnnlType::bf16);
    return impl.find("ref") == std::string::npos &&
           (impl.find("bf16") != std::string::npos || impl.find("amx") != std::string::npos);
  }();
  return native;
}

bool CpuGemm::Bf16Faster() {
  static const bool faster = [] {
    if (!NativeBf16()) return false;
    constexpr int64_t m = 256, n = 2048, k = 1024;
    std::vector<float> a32(m * k, 0.5f), b32(k * n, 0.25f), c(m * n);
    std::vector<uint16_t> a16(a32.size()), b16(b32.size());
    FromFloat(DType::kBFloat16, a32.data(), static_cast<int64_t>(a32.size()), a16.data());
    FromFloat(DType::kBFloat16, b32.data(), static_cast<int64_t>(b32.size()), b16.data());
    OneDnn onednn;
    auto best = [&](DnnlType type, const void* a, const void* b) {
      double fastest = 1e30;
      for (int run = 0; run < 4; ++run) {  // the first makes the primitive
        const auto start = std::chrono::steady_clock::now();
        if (!onednn.Multiply(type, m, n, k, {a, k}, {b, n}, c.data(), n, false).ok()) return 1e30;
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (run > 0) fastest = std::min(fastest, s);
      }
      return fastest;
    };
    return best(DnnlType::bf16, a16.data(), b16.data()) <
           best(DnnlType::f32, a32.data(), b32.data());
  }();
  return faster;
}

DType CpuGemm::OperandDType(DType input) const {
  return input == DType::kBFloat16 && bf16_ ? DType::kBFloat16 : DType::kFloat32;
}

absl::Status CpuGemm::Multiply(DType dtype, int64_t m, int64_t n, int64_t k, const GemmOperand& a,
                               const GemmOperand& b, float* c, int64_t ldc, bool accumulate) {
  if (m == 0 || n == 0) return absl::OkStatus();
  const bool bf16 = dtype == DType::kBFloat16 && bf16_;
  if (!bf16 && dtype != DType::kFloat32) {
    return absl::InternalError(absl::StrCat("CpuGemm: ", DTypeName(dtype), " operands"));
  }
  if (bf16 || onednn_fp32_) {
    if (k == 0) {  // (oneDNN refuses an empty reduction)
      if (!accumulate) {
        for (int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
      }
      return absl::OkStatus();
    }
    return onednn_->Multiply(bf16 ? DnnlType::bf16 : DnnlType::f32, m, n, k, a, b, c, ldc,
                             accumulate);
  }
  cblas_sgemm(CblasRowMajor, Blas(a.transpose), Blas(b.transpose), m, n, k, 1.0f,
              static_cast<const float*>(a.data), a.ld, static_cast<const float*>(b.data), b.ld,
              accumulate ? 1.0f : 0.0f, c, ldc);
  return absl::OkStatus();
}

}  // namespace flce
