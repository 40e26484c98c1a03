// The SIMD kernels' exp2 (backends/simd/exp2.hpp) against std::exp2 in
// float64, on every instruction set this CPU can run (the plugins' own
// detection decides, through libmha): the error its header states, exact 0
// and NaN where the softmax needs them.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "test_util.h"

using Exp2Fn = void (*)(const float* x, float* y, int64_t n);

extern "C" {
#if defined(__x86_64__)
void mha_test_exp2_avx2(const float* x, float* y, int64_t n);
void mha_test_exp2_avx512(const float* x, float* y, int64_t n);
#elif defined(__aarch64__)
void mha_test_exp2_neon(const float* x, float* y, int64_t n);
#endif
}

namespace mha_test {
namespace {

struct Isa {
  const char* backend;  // the plugin whose flags the instantiation uses
  Exp2Fn fn;
};

const Isa kIsas[] = {
#if defined(__x86_64__)
    {"avx2", mha_test_exp2_avx2},
    {"avx512", mha_test_exp2_avx512},
#elif defined(__aarch64__)
    {"neon", mha_test_exp2_neon},
#endif
};

// Stated in exp2.hpp: at most 2.4e-7 relative (about 2 ulp) where the result
// is a normal number.
constexpr double kMaxRelative = 2.4e-7;
constexpr int64_t kLanes = 64;  // a multiple of every vector width

std::vector<float> run(const Isa& isa, std::vector<float> x) {
  const size_t n = (x.size() + kLanes - 1) / kLanes * kLanes;
  x.resize(n, 0.0f);
  std::vector<float> y(n, -1.0f);
  isa.fn(x.data(), y.data(), static_cast<int64_t>(n));
  return y;
}

class Exp2 : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    const auto backends = list_backends();
    const BackendEntry* entry = find_backend(backends, GetParam().backend);
    if (entry == nullptr || !entry->usable) {
      GTEST_SKIP() << GetParam().backend << " is not usable on this CPU";
    }
  }
};

TEST_P(Exp2, RelativeErrorOverTheNormalRange) {
  // Every 1/4096 from -126 to 24 (the fused path keeps probabilities up to
  // 2^24 against a stale maximum), plus the points next to the reduction's
  // boundaries (the integers for AVX-512's x - floor(x), the halves for
  // rounding elsewhere).
  std::vector<float> x;
  for (int64_t i = -126 * 4096; i <= 24 * 4096; ++i) x.push_back(static_cast<float>(i) / 4096.0f);
  for (int n = -125; n <= 24; ++n) {
    for (const float h : {-0.5f, 0.0f, 0.5f}) {
      const float edge = static_cast<float>(n) + h;
      x.push_back(std::nextafter(edge, -1e9f));
      x.push_back(std::nextafter(edge, 1e9f));
    }
  }
  const std::vector<float> y = run(GetParam(), x);
  double worst = 0;
  float worst_x = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp2(static_cast<double>(x[i]));
    const double error = std::fabs(static_cast<double>(y[i]) - want) / want;
    if (!(error <= worst)) {
      worst = error;
      worst_x = x[i];
    }
  }
  EXPECT_LE(worst, kMaxRelative) << "at x = " << worst_x;
  // And it is not trivially far below what fp32 can do: the bound means something.
  EXPECT_GT(worst, 1e-8);
}

TEST_P(Exp2, UnderflowIsZeroOrTiny) {
  // Below 2^-126 the result is a subnormal or 0, never garbage: within 2^-126
  // of the truth and never negative.
  std::vector<float> x;
  for (int64_t i = -200 * 64; i <= -126 * 64; ++i) x.push_back(static_cast<float>(i) / 64.0f);
  x.push_back(-1e30f);
  x.push_back(-std::numeric_limits<float>::max());
  const std::vector<float> y = run(GetParam(), x);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_GE(y[i], 0.0f) << "x = " << x[i];
    ASSERT_LE(std::fabs(static_cast<double>(y[i]) - std::exp2(static_cast<double>(x[i]))),
              std::ldexp(1.0, -126))
        << "x = " << x[i];
    // Far below, exactly 0, never a subnormal: a subnormal probability
    // slows every FMA of P·V it enters (microcode assists on Intel).
    if (x[i] < -127.0f) {
      ASSERT_EQ(y[i], 0.0f) << "x = " << x[i];
    }
  }
}

TEST_P(Exp2, LargeInputsStayLarge) {
  // A score far above a stale maximum: the fused path must see a huge
  // probability (and compute the tile again), never a small or wrapped one.
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> x = {30.0f, 64.0f, 100.0f, 127.5f, 200.0f, 1e30f, inf};
  const std::vector<float> y = run(GetParam(), x);
  EXPECT_NEAR(y[0], std::ldexp(1.0, 30), std::ldexp(kMaxRelative, 30));
  for (size_t i = 1; i < x.size(); ++i) {
    EXPECT_GE(y[i], std::ldexp(1.0f, 63)) << "input " << i;
  }
}

TEST_P(Exp2, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> y = run(GetParam(), {-inf, nan, 0.0f, -0.0f, 1.0f, -1.0f});
  EXPECT_EQ(y[0], 0.0f) << "a masked score (-inf) must weigh exactly 0";
  EXPECT_TRUE(std::isnan(y[1])) << "a NaN score must poison its row";
  EXPECT_NEAR(y[2], 1.0, kMaxRelative);
  EXPECT_NEAR(y[3], 1.0, kMaxRelative);
  EXPECT_NEAR(y[4], 2.0, 2 * kMaxRelative);
  EXPECT_NEAR(y[5], 0.5, 0.5 * kMaxRelative);
}

std::string isa_name(const ::testing::TestParamInfo<Isa>& info) {
  return info.param.backend;
}

INSTANTIATE_TEST_SUITE_P(Isas, Exp2, ::testing::ValuesIn(kIsas), isa_name);

}  // namespace
}  // namespace mha_test
