#ifndef FLCE_KERNELS_CPU_VECTOR_EXP_H_
#define FLCE_KERNELS_CPU_VECTOR_EXP_H_

// exp over a row of logits, eight at a time where the CPU has AVX2 and FMA
// (the softmax's exponentials were a scalar call per logit: 15-20 % of the
// CPU engine's step, bench/RESULTS.md). Within 2 units of roundoff of
// std::exp for results of at least FLT_MIN; exp(x) for x < -87.34 (a
// result below FLT_MIN, 2^-126) is 0, exp(-inf) 0, exp(NaN) NaN; arguments
// of 88.37 and above give +inf (the true result is then within a factor of
// 2 of FLT_MAX). The same bits with or without AVX2.

#include <cstdint>

namespace flce {

// Σ_j exp(z[j] − shift), summed in fp64; with `store`, z[j] becomes
// exp(z[j] − shift) (float) too.
double ShiftedExpSum(float* z, int64_t n, float shift, bool store);

// exp(x) of one float, the vector code's arithmetic (for tests and tails).
float VectorExpReference(float x);

}  // namespace flce

#endif  // FLCE_KERNELS_CPU_VECTOR_EXP_H_
