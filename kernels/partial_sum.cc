#include "kernels/partial_sum.h"

namespace flce {
namespace {

class HostSum final : public PartialSum {
 public:
  absl::Status SumIntoFirst(const std::vector<float*>& parts, int64_t count) override {
    for (size_t k = 1; k < parts.size(); ++k) {
      for (int64_t i = 0; i < count; ++i) parts[0][i] += parts[k][i];
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<PartialSum> HostPartialSum() { return std::make_unique<HostSum>(); }

}  // namespace flce
