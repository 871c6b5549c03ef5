#include "kernels/shard_combine.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace flce {

absl::StatusOr<CombinedShards> CombineShards(const LossProblem& problem, int64_t full_vocab,
                                             const std::vector<const ShardStats*>& shards) {
  const int64_t n = problem.rows();
  for (const ShardStats* s : shards) {
    if (s->max.num_elements() != n || s->sum_exp.num_elements() != n ||
        s->target_logit.num_elements() != n || s->argmax.num_elements() != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard statistics: expected ", n, " rows each"));
    }
  }
  const LossOptions& o = problem.options;
  const std::vector<float> cw = problem.class_weight ? TensorToFloats(*problem.class_weight)
                                                     : std::vector<float>();
  double cw_sum = cw.empty() ? static_cast<double>(full_vocab) : 0.0;
  for (float w : cw) cw_sum += w;
  CombinedShards out;
  out.lse = HostTensor(DType::kFloat32, {n});
  out.loss.assign(n, 0.0);
  out.z_loss.assign(n, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    double m = -std::numeric_limits<double>::infinity(), best = m;
    int64_t argmax = 0;
    bool nan = false;
    for (const ShardStats* s : shards) {
      const double ms = s->max.data_as<float>()[i];
      nan |= std::isnan(ms);
      m = std::max(m, ms);
      if (ms > best) {  // the first shard (lowest ids) on ties
        best = ms;
        argmax = s->argmax.data_as<int64_t>()[i];
      }
    }
    double sum = 0, z_t = 0, wz = 0;
    for (const ShardStats* s : shards) {
      sum += s->sum_exp.data_as<float>()[i] * std::exp(s->max.data_as<float>()[i] - m);
      z_t += s->target_logit.data_as<float>()[i];
      if (s->weighted_logit_sum) wz += s->weighted_logit_sum->data_as<float>()[i];
    }
    const double lse = nan ? std::numeric_limits<double>::quiet_NaN() : m + std::log(sum);
    out.lse.mutable_data<float>()[i] = static_cast<float>(lse);
    const int64_t t = problem.target.dtype == DType::kInt32
                          ? static_cast<const int32_t*>(problem.target.data)[i]
                          : static_cast<const int64_t*>(problem.target.data)[i];
    if (t == o.ignore_index) continue;
    const double wt = cw.empty() ? 1.0 : cw[t];
    const double eps = o.label_smoothing;
    out.z_loss[i] = o.z_loss_scale * lse * lse;
    out.loss[i] = (1 - eps) * wt * (lse - z_t) + eps / full_vocab * (cw_sum * lse - wz) +
                  out.z_loss[i];
    out.denom += wt;
    ++out.num_valid;
    out.num_correct += argmax == t;
  }
  return out;
}

}  // namespace flce
