#include "kernels/reference/random_problem.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace flce {

namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

HostTensor RandomFloats(DType dtype, std::vector<int64_t> shape, double stddev,
                        std::mt19937_64& rng, bool fast) {
  HostTensor t(dtype, std::move(shape));
  const int64_t count = t.num_elements();
  constexpr int64_t kBlock = 1 << 16;
  std::vector<float> values(static_cast<size_t>(std::min(count, kBlock)));
  std::normal_distribution<float> normal(0.0f, static_cast<float>(stddev));
  const uint64_t stream = rng();
  // Uniform on [-a, a] has standard deviation a/√3.
  const float a = static_cast<float>(stddev * std::sqrt(3.0));
  char* out = &t.data[0];
  for (int64_t first = 0; first < count; first += kBlock) {
    const int64_t m = std::min(kBlock, count - first);
    for (int64_t i = 0; i < m; ++i) {
      if (fast) {
        const uint64_t bits = SplitMix64(stream ^ static_cast<uint64_t>(first + i));
        values[i] = a * (static_cast<float>(bits >> 40) * (2.0f / 16777216.0f) - 1.0f);
      } else {
        values[i] = normal(rng);
      }
    }
    FromFloat(dtype, values.data(), m, out + first * DTypeSize(dtype));
  }
  return t;
}

}  // namespace

OwnedProblem MakeRandomProblem(const RandomProblemSpec& spec) {
  std::mt19937_64 rng(spec.seed);
  OwnedProblem p;
  p.options = spec.options;
  p.hidden = RandomFloats(spec.dtype, {spec.rows, spec.hidden}, 1.0, rng, spec.fast_fill);
  p.weight = RandomFloats(spec.dtype, {spec.vocab, spec.hidden},
                          spec.logit_scale / std::sqrt(static_cast<double>(spec.hidden)),
                          rng, spec.fast_fill);
  if (spec.bias) p.bias = RandomFloats(spec.dtype, {spec.vocab}, 0.5, rng, spec.fast_fill);
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
