#include "kernels/loss_engine.h"

namespace flce {

const char* ReductionName(Reduction reduction) {
  switch (reduction) {
    case Reduction::kMean:
      return "mean";
    case Reduction::kSum:
      return "sum";
    case Reduction::kNone:
      return "none";
  }
  return "unknown";
}

const char* BackwardModeName(BackwardMode mode) {
  switch (mode) {
    case BackwardMode::kAuto:
      return "auto";
    case BackwardMode::kStoreGrads:
      return "store_grads";
    case BackwardMode::kRecompute:
      return "recompute";
  }
  return "unknown";
}

}  // namespace flce
