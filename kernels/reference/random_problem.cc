#include "kernels/reference/random_problem.h"

#include <cmath>
#include <random>
#include <vector>

namespace flce {

namespace {

HostTensor RandomFloats(DType dtype, std::vector<int64_t> shape, double stddev,
                        std::mt19937_64& rng) {
  HostTensor t(dtype, std::move(shape));
  std::normal_distribution<float> dist(0.0f, static_cast<float>(stddev));
  std::vector<float> values(static_cast<size_t>(t.num_elements()));
  for (float& value : values) value = dist(rng);
  FromFloat(dtype, values.data(), t.num_elements(), &t.data[0]);
  return t;
}

}  // namespace

OwnedProblem MakeRandomProblem(const RandomProblemSpec& spec) {
  std::mt19937_64 rng(spec.seed);
  OwnedProblem p;
  p.options = spec.options;
  p.hidden = RandomFloats(spec.dtype, {spec.rows, spec.hidden}, 1.0, rng);
  p.weight = RandomFloats(spec.dtype, {spec.vocab, spec.hidden},
                          spec.logit_scale / std::sqrt(static_cast<double>(spec.hidden)),
                          rng);
  if (spec.bias) p.bias = RandomFloats(spec.dtype, {spec.vocab}, 0.5, rng);
  if (spec.class_weight) {
    p.class_weight = HostTensor(DType::kFloat32, {spec.vocab});
    std::uniform_real_distribution<float> dist(0.25f, 2.0f);
    for (int64_t j = 0; j < spec.vocab; ++j) {
      p.class_weight->mutable_data<float>()[j] = dist(rng);
    }
  }
  p.target = HostTensor(spec.target_dtype, {spec.rows});
  std::uniform_int_distribution<int64_t> cls(0, spec.vocab - 1);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int64_t i = 0; i < spec.rows; ++i) {
    int64_t t = unit(rng) < spec.ignore_fraction ? spec.options.ignore_index
                                                 : cls(rng);
    if (spec.target_dtype == DType::kInt32) {
      p.target.mutable_data<int32_t>()[i] = static_cast<int32_t>(t);
    } else {
      p.target.mutable_data<int64_t>()[i] = t;
    }
  }
  return p;
}

}  // namespace flce
