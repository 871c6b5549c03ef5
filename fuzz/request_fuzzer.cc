// libFuzzer target over request decoding and validation: the bytes after a
// selector byte are parsed as a ForwardRequest (even selector) or a
// BackwardRequest (odd) and run through DecodeForward / DecodeBackward with
// a registered weight and a shared-memory region to refer to; a Forward that
// validates and is small is also computed by the CPU engine (validation's
// promise: what passes it never crashes an engine). Any crash, sanitizer
// report or leak is a finding.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/cpu/cpu_engine.h"
#include "proto/codec.h"
#include "proto/flce/v1/loss_service.pb.h"
#include "server/request_validation.h"
#include "server/weight_registry.h"

namespace flce {
namespace {

// One host region "region" of 4 KiB, for slices to name.
class FakeRegions : public SliceResolver {
 public:
  absl::StatusOr<SliceMemory> Resolve(const SliceRef& slice, int64_t bytes,
                                      const std::string& field) const override {
    if (slice.region_id != "region") return absl::NotFoundError(field);
    if (slice.offset < 0 || bytes < 0 || slice.offset > kBytes - bytes) {
      return absl::InvalidArgumentError(field);
    }
    return SliceMemory{const_cast<char*>(memory_) + slice.offset, MemorySpace::kHost};
  }

 private:
  static constexpr int64_t kBytes = 4096;
  char memory_[kBytes] = {};
};

struct Harness {
  Harness() : weights(int64_t{1} << 20) {
    HostTensor w(DType::kFloat32, {7, 5});
    for (int64_t i = 0; i < w.num_elements(); ++i) w.mutable_data<float>()[i] = 0.01f * i;
    (void)weights.Put("w", "", std::move(w), std::nullopt);
  }
  WeightRegistry weights;
  std::shared_ptr<FakeRegions> regions = std::make_shared<FakeRegions>();
  CpuEngine engine;
};

void RunForward(Harness& h, const std::string& bytes) {
  v1::ForwardRequest request;
  if (!request.ParseFromString(bytes)) return;
  absl::StatusOr<ForwardCall> call = DecodeForward(request, h.weights, "", h.regions);
  if (!call.ok()) return;
  const LossProblem& p = call->problem;
  if (p.rows() * p.vocab() * p.hidden_size() > 200000) return;
  ForwardSpec spec;
  spec.need_backward = call->need_backward;
  spec.mode = call->requested_mode == BackwardMode::kRecompute ||
                      p.options.reduction == Reduction::kNone
                  ? BackwardMode::kRecompute
                  : BackwardMode::kStoreGrads;
  spec.want_lse = call->want_lse;
  absl::StatusOr<ForwardResult> result = h.engine.Forward(p, spec, nullptr);
  if (result.ok() && result->saved != nullptr) {
    (void)h.engine.Backward(*result->saved, BackwardSpec(), nullptr);
  }
}

void RunBackward(Harness& h, const std::string& bytes) {
  v1::BackwardRequest request;
  if (!request.ParseFromString(bytes)) return;
  absl::StatusOr<BackwardCall> call = DecodeBackward(request, h.regions);
  if (!call.ok()) return;
  SessionInfo info;
  info.reduction = Reduction::kNone;
  info.rows = 3;
  (void)CheckGradOutput(*call, info);
}

}  // namespace
}  // namespace flce

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static flce::Harness* harness = new flce::Harness();
  if (size < 1) return 0;
  const std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    flce::RunForward(*harness, bytes);
  } else {
    flce::RunBackward(*harness, bytes);
  }
  return 0;
}
