// The Hopper GEMM against an fp64 reference on random data of odd sizes,
// in each of its three forms, with and without an added source.
// Tagged `gpu`: skips without a device (fails without one when
// REQUIRE_GPU=1) and on a device that is not compute capability 9.0.

#include "kernels/cuda/hopper_gemm.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_test_support.h"
#include "kernels/cuda/row_kernels.h"
#include "kernels/dtype.h"

namespace flce {
namespace internal_cuda {
namespace {

class HopperGemmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FLCE_SKIP_OFF_HOPPER();
    ASSERT_EQ(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int sms_ = 0;
  cudaStream_t stream_ = nullptr;
};

// The three forms (hopper_gemm.h): which operands are MN-major.
enum class Form { kLogits, kDx, kDw };

const char* FormName(Form f) {
  return f == Form::kLogits ? "A·Bᵀ (K, K)" : f == Form::kDx ? "A·B (K, MN)" : "Aᵀ·B (MN, MN)";
}

struct Case {
  int64_t m, n, k;
  DType in, out;
  int64_t lda = 0, ldb = 0, ldc = 0;  // 0: dense (A's and B's rows padded to 16 bytes)
  Form form = Form::kLogits;
  bool source = false;  // C = alpha·A·B + an fp32 source
  float alpha = 1.0f;
};

// An operand of `extent` rows along M or N and k along K, stored K-major
// ([extent, k], row stride ld) or MN-major ([k, extent]); the padding NaN.
// Random values in [-1, 1) rounded to `dtype`, as the stored bits and as
// doubles indexed [row][p] (row < extent, p < k).
void RandomOperand(int64_t extent, int64_t k, Major major, int64_t ld, DType dtype, uint32_t seed,
                   std::vector<uint16_t>& bits, std::vector<double>& values) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int64_t stored_rows = major == Major::kK ? extent : k;
  bits.assign(stored_rows * ld, 0x7fff);
  values.assign(extent * k, 0.0);
  for (int64_t r = 0; r < extent; ++r) {
    for (int64_t p = 0; p < k; ++p) {
      const float x = u(rng);
      const uint16_t b = dtype == DType::kBFloat16 ? FloatToBFloat16(x) : FloatToHalf(x);
      bits[major == Major::kK ? r * ld + p : p * ld + r] = b;
      values[r * k + p] = dtype == DType::kBFloat16 ? BFloat16ToFloat(b) : HalfToFloat(b);
    }
  }
}

TEST_F(HopperGemmTest, MatchesTheFp64Reference) {
  std::vector<Case> cases;
  for (Form form : {Form::kLogits, Form::kDx, Form::kDw}) {
    for (DType in : {DType::kBFloat16, DType::kFloat16}) {
      for (DType out : {in, DType::kFloat32}) {
        // With both operands MN-major, K need not be a multiple of 8.
        const bool any_k = form == Form::kDw;
        cases.push_back({1, 1, 8, in, out, 0, 0, 0, form});
        cases.push_back({3, 7, any_k ? 5 : 8, in, out, 0, 0, 0, form});
        cases.push_back({17, 1000, any_k ? 73 : 72, in, out, 0, 0, 0, form});
        cases.push_back({733, 257, any_k ? 263 : 264, in, out, 0, 0, 0, form});
      }
    }
  }
  // Many tiles per block (persistence, bands), an odd count of row tiles
  // (a cluster's second block past m), a long K, padded rows and an odd C
  // stride (element stores), C's rows in 16-byte pieces with n ending
  // inside one.
  cases.push_back({1000, 8191, 256, DType::kBFloat16, DType::kBFloat16});
  cases.push_back({2100, 1100, 128, DType::kBFloat16, DType::kFloat32});
  cases.push_back({129, 513, 4096, DType::kBFloat16, DType::kFloat32});
  cases.push_back({300, 301, 136, DType::kBFloat16, DType::kBFloat16, 144, 152, 307});
  cases.push_back({130, 260, 40, DType::kFloat16, DType::kFloat32, 48, 40, 263});
  cases.push_back({70, 300, 64, DType::kBFloat16, DType::kBFloat16, 0, 0, 304});
  cases.push_back({65, 258, 32, DType::kFloat16, DType::kFloat32, 0, 0, 260});
  // The gradient GEMMs' shapes in small: dX [count, H] over a long K (V),
  // dW [V, H] over the chunk's tokens; padded MN-major rows; a source
  // added (dW's sum over chunks, fp32 in place or narrowed on the way) with
  // a scale; C's pieces whole and not.
  cases.push_back({300, 520, 5000, DType::kBFloat16, DType::kFloat32, 0, 0, 0, Form::kDx});
  cases.push_back({1030, 264, 333, DType::kBFloat16, DType::kFloat32, 0, 0, 0, Form::kDw});
  cases.push_back({2000, 136, 700, DType::kBFloat16, DType::kBFloat16, 2008, 144, 0, Form::kDw});
  // fp32 C its own source: added by the TMA (16-byte rows), or by the
  // epilogue's own loads (rows that are not).
  cases.push_back({515, 264, 130, DType::kBFloat16, DType::kFloat32, 0, 0, 0, Form::kDw, true});
  cases.push_back({1000, 1000, 200, DType::kBFloat16, DType::kFloat32, 0, 0, 0, Form::kDw, true,
                   0.5f});
  cases.push_back({515, 263, 130, DType::kFloat16, DType::kFloat32, 0, 0, 0, Form::kDw, true});
  cases.push_back({515, 264, 130, DType::kBFloat16, DType::kBFloat16, 0, 0, 0, Form::kDw, true,
                   0.25f});
  cases.push_back({77, 300, 40, DType::kFloat16, DType::kFloat16, 80, 304, 301, Form::kDw, true});
  cases.push_back({129, 257, 1000, DType::kBFloat16, DType::kFloat32, 0, 264, 259, Form::kDx, true,
                   -2.0f});
  cases.push_back({200, 1000, 128, DType::kBFloat16, DType::kBFloat16, 0, 0, 0, Form::kLogits, true,
                   0.5f});

  uint32_t seed = 1;
  for (const Case& c : cases) {
    // Every cluster size and schedule gives the same bits (the same sums in
    // the same order): the first one's output, kept.
    std::vector<char> first_bits;
    const uint32_t case_seed = seed;
    for (const auto& [cluster, ping_pong] :
         {std::pair{1, false}, std::pair{2, false}, std::pair{1, true}, std::pair{2, true}}) {
      const Major a_major = c.form == Form::kDw ? Major::kMN : Major::kK;
      const Major b_major = c.form == Form::kLogits ? Major::kK : Major::kMN;
      // Dense rows, rounded up to the TMA's 16 bytes.
      const auto dense = [](int64_t elements) { return (elements + 7) / 8 * 8; };
      const int64_t lda = c.lda ? c.lda : dense(a_major == Major::kK ? c.k : c.m);
      const int64_t ldb = c.ldb ? c.ldb : dense(b_major == Major::kK ? c.k : c.n);
      const int64_t ldc = c.ldc ? c.ldc : c.n;
      SCOPED_TRACE(::testing::Message()
                   << FormName(c.form) << " m=" << c.m << " n=" << c.n << " k=" << c.k
                   << " in=" << DTypeName(c.in) << " out=" << DTypeName(c.out) << " lda=" << lda
                   << " ldb=" << ldb << " ldc=" << ldc << " source=" << c.source
                   << " alpha=" << c.alpha << " cluster=" << cluster
                   << " ping_pong=" << ping_pong);
      seed = case_seed;  // the same operands for every schedule
      std::vector<uint16_t> a_bits, b_bits;
      std::vector<double> a, b;
      RandomOperand(c.m, c.k, a_major, lda, c.in, seed++, a_bits, a);
      RandomOperand(c.n, c.k, b_major, ldb, c.in, seed++, b_bits, b);
      const size_t out_size = DTypeSize(c.out);
      cuda_test::DeviceBytes da(a_bits.size() * 2), db(b_bits.size() * 2), dc(c.m * ldc * out_size);
      da.Write(a_bits);
      db.Write(b_bits);
      ASSERT_EQ(cudaMemset(dc.data, 0xff, dc.size), cudaSuccess);  // NaN: unwritten shows
      // The source: random fp32 [m, n] with row stride ldc + 3 (its own
      // memory), or C's own fp32 values when C is fp32 (added in place).
      const bool in_place = c.source && c.out == DType::kFloat32 && c.form == Form::kDw;
      const int64_t ld_source = in_place ? ldc : ldc + 3;
      std::vector<float> source;
      cuda_test::DeviceBytes dsource(c.source && !in_place ? c.m * ld_source * 4 : 0);
      if (c.source) {
        std::mt19937 rng(seed++);
        std::uniform_real_distribution<float> u(-4.0f, 4.0f);
        source.resize(c.m * ld_source);
        for (float& x : source) x = u(rng);
        void* to = in_place ? dc.data : dsource.data;
        ASSERT_EQ(cudaMemcpy(to, source.data(), source.size() * 4, cudaMemcpyHostToDevice),
                  cudaSuccess);
      }

      HopperGemmArgs args;
      args.a = da.data;
      args.lda = lda;
      args.a_major = a_major;
      args.b = db.data;
      args.ldb = ldb;
      args.b_major = b_major;
      args.c = dc.data;
      args.ldc = ldc;
      if (c.source) {
        args.source = static_cast<const float*>(in_place ? dc.data : dsource.data);
        args.ld_source = ld_source;
      }
      args.alpha = c.alpha;
      args.m = c.m;
      args.n = c.n;
      args.k = c.k;
      args.in_type = c.in;
      args.out_type = c.out;
      args.cluster = cluster;
      args.ping_pong = ping_pong;
      ASSERT_TRUE(HopperGemmSupported(args, 0));
      ASSERT_EQ(LaunchHopperGemm(args, sms_, stream_), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);

      std::vector<char> raw(dc.size);
      ASSERT_EQ(cudaMemcpy(raw.data(), dc.data, dc.size, cudaMemcpyDeviceToHost), cudaSuccess);
      if (first_bits.empty()) {
        first_bits = raw;
      } else {
        EXPECT_EQ(std::memcmp(first_bits.data(), raw.data(), raw.size()), 0)
            << "other bits than cluster 1, cooperative";
      }
      std::vector<float> got(c.m * ldc);
      ToFloat(c.out, raw.data(), c.m * ldc, got.data());
      // fp32 accumulation over k, then C's one rounding.
      const double round = c.out == DType::kBFloat16  ? std::ldexp(1.0, -8)
                           : c.out == DType::kFloat16 ? std::ldexp(1.0, -11)
                                                      : 0.0;
      int64_t bad = 0, untouched = 0;
      for (int64_t i = 0; i < c.m; ++i) {
        for (int64_t j = 0; j < ldc; ++j) {
          const float x = got[i * ldc + j];
          if (j >= c.n) {
            // Past n: still the poison (or, added in place, the source).
            if (in_place ? x != source[i * ld_source + j] : !std::isnan(x)) ++untouched;
            continue;
          }
          double exact = 0, magnitude = 0;
          for (int64_t p = 0; p < c.k; ++p) {
            exact += a[i * c.k + p] * b[j * c.k + p];
            magnitude += std::fabs(a[i * c.k + p] * b[j * c.k + p]);
          }
          exact *= c.alpha;
          magnitude *= std::fabs(c.alpha);
          if (c.source) {
            const double added = source[i * ld_source + j];
            exact += added;
            magnitude += std::fabs(added);
          }
          const double bar = 1e-5 * magnitude + round * std::fabs(exact) + 1e-30;
          if (!(std::fabs(x - exact) <= bar) && bad++ < 5) {
            ADD_FAILURE() << "C[" << i << "][" << j << "] = " << x << ", expected " << exact;
          }
        }
      }
      EXPECT_EQ(bad, 0);
      EXPECT_EQ(untouched, 0) << "elements past n were written";
    }
  }
}

// The fused dX: A is the logits, the GEMM multiplies their gradient
// (LogitGradient) formed in registers. Against the gradient rounded to the
// input dtype on the host and an fp64 sum: rows with the target among the
// columns, without it (-1) and ignored; m, n and k off the tiles; both
// cluster sizes; fp32 C overwritten and added to in place.
TEST_F(HopperGemmTest, FusedGradientMatchesItsReference) {
  struct Fused {
    int64_t m, n, k;
    DType in;
    bool add;
  };
  const std::vector<Fused> cases = {
      {3, 7, 40, DType::kBFloat16, false},      {200, 300, 1000, DType::kBFloat16, false},
      {129, 257, 4104, DType::kBFloat16, false}, {150, 264, 520, DType::kBFloat16, true},
      {70, 100, 336, DType::kFloat16, false},
  };
  uint32_t seed = 100;
  for (const Fused& c : cases) {
    for (const int cluster : {1, 2}) {
      SCOPED_TRACE(::testing::Message() << "m=" << c.m << " n=" << c.n << " k=" << c.k
                                        << " in=" << DTypeName(c.in) << " add=" << c.add
                                        << " cluster=" << cluster);
      std::mt19937 rng(seed++);
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      // The logits z [m, k] in [-4, 4), W [k, n] (MN-major B).
      const auto round = [&](float x) {
        return c.in == DType::kBFloat16 ? FloatToBFloat16(x) : FloatToHalf(x);
      };
      const auto value = [&](uint16_t b) {
        return c.in == DType::kBFloat16 ? BFloat16ToFloat(b) : HalfToFloat(b);
      };
      const int64_t ldb = (c.n + 7) / 8 * 8;
      std::vector<uint16_t> z_bits(c.m * c.k), w_bits(c.k * ldb, 0x7fff);
      for (auto& b : z_bits) b = round(4.0f * u(rng));
      for (int64_t j = 0; j < c.k; ++j) {
        for (int64_t i = 0; i < c.n; ++i) w_bits[j * ldb + i] = round(u(rng));
      }
      // Per row: lse of the row, a coefficient, the target's column (every
      // fifth row none, every seventh ignored) and its value.
      std::vector<float> lse(c.m), coef(c.m), target(c.m);
      std::vector<int32_t> column(c.m);
      for (int64_t r = 0; r < c.m; ++r) {
        double sum = 0;
        for (int64_t j = 0; j < c.k; ++j) sum += std::exp(double{value(z_bits[r * c.k + j])});
        lse[r] = static_cast<float>(std::log(sum));
        coef[r] = 0.5f + std::fabs(u(rng));
        column[r] = r % 7 == 3   ? LogitGradient::kIgnoredRow
                    : r % 5 == 1 ? -1
                                 : static_cast<int32_t>((r * 7919) % c.k);
        target[r] = -1.0f - std::fabs(u(rng));
      }
      // G rounded as the kernel rounds it.
      std::vector<double> g(c.m * c.k);
      for (int64_t r = 0; r < c.m; ++r) {
        for (int64_t j = 0; j < c.k; ++j) {
          double x = 0;
          if (column[r] == LogitGradient::kIgnoredRow) {
            x = 0;
          } else if (j == column[r]) {
            x = target[r];
          } else {
            x = coef[r] * std::exp(double{value(z_bits[r * c.k + j])} - lse[r]);
          }
          g[r * c.k + j] = RoundTo(c.in, static_cast<float>(x));
        }
      }
      std::vector<float> source(c.m * c.n);
      for (float& x : source) x = 2.0f * u(rng);

      cuda_test::DeviceBytes dz(z_bits.size() * 2), dw(w_bits.size() * 2), dc(c.m * c.n * 4),
          dlse(c.m * 4), dcoef(c.m * 4), dtarget(c.m * 4), dcolumn(c.m * 4);
      dz.Write(z_bits);
      dw.Write(w_bits);
      dlse.Write(lse);
      dcoef.Write(coef);
      dtarget.Write(target);
      dcolumn.Write(column);
      if (c.add) {
        dc.Write(source);
      } else {
        ASSERT_EQ(cudaMemset(dc.data, 0xff, dc.size), cudaSuccess);  // NaN: unwritten shows
      }
      HopperGemmArgs args;
      args.a = dz.data;
      args.lda = c.k;
      args.b = dw.data;
      args.ldb = ldb;
      args.b_major = Major::kMN;
      args.c = dc.data;
      args.ldc = c.n;
      if (c.add) {
        args.source = static_cast<const float*>(dc.data);
        args.ld_source = c.n;
      }
      args.m = c.m;
      args.n = c.n;
      args.k = c.k;
      args.in_type = c.in;
      args.out_type = DType::kFloat32;
      args.cluster = cluster;
      args.gradient.lse = static_cast<const float*>(dlse.data);
      args.gradient.coef = static_cast<const float*>(dcoef.data);
      args.gradient.column = static_cast<const int32_t*>(dcolumn.data);
      args.gradient.target = static_cast<const float*>(dtarget.data);
      ASSERT_TRUE(HopperGemmSupported(args, 0));
      ASSERT_EQ(LaunchHopperGemm(args, sms_, stream_), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      std::vector<float> got(c.m * c.n);
      ASSERT_EQ(cudaMemcpy(got.data(), dc.data, dc.size, cudaMemcpyDeviceToHost), cudaSuccess);
      int64_t bad = 0;
      for (int64_t r = 0; r < c.m; ++r) {
        for (int64_t i = 0; i < c.n; ++i) {
          double exact = c.add ? source[r * c.n + i] : 0.0, magnitude = std::fabs(exact);
          for (int64_t j = 0; j < c.k; ++j) {
            const double term = g[r * c.k + j] * value(w_bits[j * ldb + i]);
            exact += term;
            magnitude += std::fabs(term);
          }
          // The device's exponential (ex2.approx) may round an element of
          // G to the neighbouring value now and then: 2⁻⁹ of the terms.
          const double bar = std::ldexp(1.0, -9) * magnitude + 1e-30;
          const float x = got[r * c.n + i];
          if (!(std::fabs(x - exact) <= bar) && bad++ < 5) {
            ADD_FAILURE() << "C[" << r << "][" << i << "] = " << x << ", expected " << exact;
          }
        }
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

// The fused dX against the engine's own two steps on the same logits: the
// gradient rows (LaunchGradientRowsFrom, which LaunchGradientFactors's
// factors mirror) into G, then the plain dX form on G. Bit for bit, as
// logit_gradient.h promises for rows without class weights: plain rows,
// z-loss, ignored rows, and a slice of the columns with targets outside it.
TEST_F(HopperGemmTest, FusedGradientIsTheGradientRowsBitForBit) {
  struct Slice {
    int64_t rows, v, h, col0, cols;
    float z_loss;
  };
  const std::vector<Slice> cases = {
      {300, 1000, 264, 0, 1000, 0.0f},
      {129, 2056, 136, 0, 2056, 1e-3f},
      {200, 3000, 256, 1024, 1000, 0.0f},  // targets outside the slice too
  };
  uint32_t seed = 500;
  for (const Slice& c : cases) {
    SCOPED_TRACE(::testing::Message() << "rows=" << c.rows << " v=" << c.v << " h=" << c.h
                                      << " columns " << c.col0 << "+" << c.cols
                                      << " z_loss=" << c.z_loss);
    std::mt19937 rng(seed++);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<uint16_t> z(c.rows * c.v), w(c.v * c.h);
    for (auto& b : z) b = FloatToBFloat16(6.0f * u(rng));
    for (auto& b : w) b = FloatToBFloat16(u(rng));
    std::vector<int64_t> targets(c.rows);
    for (int64_t r = 0; r < c.rows; ++r) targets[r] = r % 9 == 4 ? -100 : (r * 7919) % c.v;
    std::vector<float> scale(c.rows, 1.0f / static_cast<float>(c.rows));

    cuda_test::DeviceBytes dz(z.size() * 2), dw(w.size() * 2), dtarget(c.rows * 8),
        dscale(c.rows * 4), lse(c.rows * 4), loss(c.rows * 4), zl(c.rows * 4),
        correct(c.rows * 4), g(c.rows * c.cols * 2), coef(c.rows * 4), column(c.rows * 4),
        tvalue(c.rows * 4), out_rows(c.rows * c.h * 4), out_fused(c.rows * c.h * 4);
    dz.Write(z);
    dw.Write(w);
    dtarget.Write(targets);
    dscale.Write(scale);
    RowParams p;
    p.rows = c.rows;
    p.vocab = p.cols = p.full_vocab = c.v;
    p.target = static_cast<const int64_t*>(dtarget.data);
    p.z_loss_scale = c.z_loss;
    const auto* row_scale = static_cast<const float*>(dscale.data);
    // The whole rows' lse, then the slice's gradient and factors.
    ASSERT_EQ(LaunchForwardRows(p, dz.data, DType::kBFloat16, /*write_grad=*/false, row_scale,
                                {static_cast<float*>(lse.data), static_cast<float*>(loss.data),
                                 static_cast<float*>(zl.data), static_cast<int32_t*>(correct.data)},
                                stream_),
              cudaSuccess);
    p.col0 = c.col0;
    p.cols = c.cols;
    const auto* slice = static_cast<const uint16_t*>(dz.data) + c.col0;
    ASSERT_EQ(LaunchGradientRowsFrom(p, slice, c.v, g.data, DType::kBFloat16,
                                     static_cast<const float*>(lse.data), row_scale, stream_),
              cudaSuccess);
    ASSERT_EQ(LaunchGradientFactors(p, slice, c.v, DType::kBFloat16,
                                    static_cast<const float*>(lse.data), row_scale,
                                    static_cast<float*>(coef.data),
                                    static_cast<int32_t*>(column.data),
                                    static_cast<float*>(tvalue.data), stream_),
              cudaSuccess);
    HopperGemmArgs args;
    args.b = static_cast<const uint16_t*>(dw.data) + c.col0 * c.h;
    args.ldb = c.h;
    args.b_major = Major::kMN;
    args.ldc = c.h;
    args.m = c.rows;
    args.n = c.h;
    args.k = c.cols;
    args.out_type = DType::kFloat32;
    HopperGemmArgs rows = args;
    rows.a = g.data;
    rows.lda = c.cols;
    rows.c = out_rows.data;
    HopperGemmArgs fused = args;
    fused.a = slice;
    fused.lda = c.v;
    fused.c = out_fused.data;
    fused.gradient = {static_cast<const float*>(lse.data), static_cast<const float*>(coef.data),
                      static_cast<const int32_t*>(column.data),
                      static_cast<const float*>(tvalue.data)};
    ASSERT_TRUE(HopperGemmSupported(rows, 0));
    ASSERT_TRUE(HopperGemmSupported(fused, 0));
    ASSERT_EQ(LaunchHopperGemm(rows, sms_, stream_), cudaSuccess);
    ASSERT_EQ(LaunchHopperGemm(fused, sms_, stream_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    const std::string a = out_rows.Read(), b = out_fused.Read();
    int64_t differ = 0;
    for (size_t i = 0; i < a.size(); i += 4) differ += std::memcmp(&a[i], &b[i], 4) != 0;
    EXPECT_EQ(differ, 0) << "of " << a.size() / 4 << " dX values";
  }
}

TEST_F(HopperGemmTest, RefusesWhatItDoesNotTake) {
  cuda_test::DeviceBytes a(1 << 16), b(1 << 16), c(1 << 16);
  HopperGemmArgs args;
  args.a = a.data;
  args.b = b.data;
  args.c = c.data;
  args.m = args.n = 16;
  args.k = args.lda = args.ldb = args.ldc = 16;
  ASSERT_TRUE(HopperGemmSupported(args, 0));

  HopperGemmArgs odd_k = args;
  odd_k.k = odd_k.lda = odd_k.ldb = 12;  // rows not a multiple of 16 bytes
  EXPECT_FALSE(HopperGemmSupported(odd_k, 0));
  EXPECT_EQ(LaunchHopperGemm(odd_k, sms_, stream_), cudaErrorInvalidValue);

  HopperGemmArgs fp32 = args;
  fp32.in_type = fp32.out_type = DType::kFloat32;
  EXPECT_FALSE(HopperGemmSupported(fp32, 0));

  HopperGemmArgs misaligned = args;
  misaligned.a = static_cast<char*>(a.data) + 2;
  EXPECT_FALSE(HopperGemmSupported(misaligned, 0));

  HopperGemmArgs cluster = args;
  cluster.cluster = 3;
  EXPECT_FALSE(HopperGemmSupported(cluster, 0));

  // An MN-major A only with an MN-major B (the forms hopper_gemm.h names).
  HopperGemmArgs mn_k = args;
  mn_k.a_major = Major::kMN;
  EXPECT_FALSE(HopperGemmSupported(mn_k, 0));
  EXPECT_EQ(LaunchHopperGemm(mn_k, sms_, stream_), cudaErrorInvalidValue);
  mn_k.b_major = Major::kMN;
  EXPECT_TRUE(HopperGemmSupported(mn_k, 0));

  // An MN-major operand's rows run along M or N: its stride must hold them.
  HopperGemmArgs short_rows = args;
  short_rows.b_major = Major::kMN;
  short_rows.n = 24;
  EXPECT_FALSE(HopperGemmSupported(short_rows, 0));

  // The fused gradient only in the dX form (A K-major, B MN-major).
  HopperGemmArgs fused = args;
  fused.gradient.lse = fused.gradient.coef = static_cast<const float*>(c.data);
  fused.gradient.target = static_cast<const float*>(c.data);
  fused.gradient.column = static_cast<const int32_t*>(c.data);
  EXPECT_FALSE(HopperGemmSupported(fused, 0));
  fused.b_major = Major::kMN;
  EXPECT_TRUE(HopperGemmSupported(fused, 0));
  fused.ping_pong = true;  // cooperatively only
  EXPECT_FALSE(HopperGemmSupported(fused, 0));
  fused.ping_pong = false;
  fused.gradient.column = nullptr;
  EXPECT_FALSE(HopperGemmSupported(fused, 0));

  // A source's rows hold n values.
  HopperGemmArgs source = args;
  source.source = static_cast<const float*>(c.data);
  source.ld_source = 8;
  EXPECT_FALSE(HopperGemmSupported(source, 0));

  HopperGemmArgs empty = args;
  empty.m = 0;
  EXPECT_EQ(LaunchHopperGemm(empty, sms_, stream_), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

}  // namespace
}  // namespace internal_cuda
}  // namespace flce
