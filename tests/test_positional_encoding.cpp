// mha_positional_encoding_add against the formula (sin and cos of
// i / 10000^(2j/d), rounded once from double), and its refusals.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "module_case.h"

namespace mha_test {
namespace {

TEST(PositionalEncoding, MatchesTheFormula) {
  for (const int64_t d : {32, 33, 1}) {
    for (const bool seq_first : {false, true}) {
      const int64_t B = 2, L = 50, pad = 3;
      Arena arena(B * L * (d + pad));
      mha_tensor x = make_input(arena, B, L, d, seq_first, pad, 1, false);
      Rng rng(static_cast<uint64_t>(d));
      fill_uniform(x, rng);
      const std::vector<float> before = arena.all();
      ASSERT_EQ(mha_positional_encoding_add(&x), MHA_OK) << mha_last_error();
      int64_t bad = 0;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < L; ++i)
          for (int64_t c = 0; c < d; ++c) {
            const int64_t j = c / 2;
            const double angle =
                static_cast<double>(i) /
                std::pow(10000.0, 2.0 * static_cast<double>(j) / static_cast<double>(d));
            const double p = c % 2 == 0 ? std::sin(angle) : std::cos(angle);
            const int64_t at = b * x.strides[0] + i * x.strides[1] + c;
            const double x0 = static_cast<double>(before[static_cast<size_t>(at + Arena::kGuard)]);
            const float want = static_cast<float>(x0 + p);
            const float got = static_cast<const float*>(x.data)[at];
            // Rounded once from double: at most one float step from the exact sum.
            if (!(std::fabs(static_cast<double>(got) - (x0 + p)) <=
                  std::fabs(static_cast<double>(std::nextafter(want, kInfF)) -
                            static_cast<double>(want)))) {
              if (bad++ == 0)
                ADD_FAILURE() << "d=" << d << " [" << b << "," << i << "," << c << "] = " << got
                              << ", want " << want;
            }
          }
      EXPECT_EQ(bad, 0) << "d = " << d;
      EXPECT_EQ(arena.changed_outside(x, before), 0) << "written outside x";
    }
  }
  // Spot values: position 0 is (0, 1, 0, 1, ...); position 1, column 0 is sin(1).
  float y[2 * 5] = {};
  mha_tensor t = describe(y, MHA_DTYPE_F32, {1, 2, 5});
  ASSERT_EQ(mha_positional_encoding_add(&t), MHA_OK);
  EXPECT_EQ(y[0], 0.0f);
  EXPECT_EQ(y[1], 1.0f);
  EXPECT_EQ(y[4], 0.0f);  // d = 5: column 4 is a sine
  EXPECT_EQ(y[5], static_cast<float>(std::sin(1.0)));
  EXPECT_EQ(y[6], static_cast<float>(std::cos(1.0)));
  EXPECT_EQ(y[9], static_cast<float>(std::sin(1.0 / std::pow(10000.0, 4.0 / 5.0))));
}

TEST(PositionalEncoding, RefusesBadInput) {
  float x[8] = {};
  mha_tensor t = describe(x, MHA_DTYPE_F32, {2, 4});
  EXPECT_EQ(mha_positional_encoding_add(&t), MHA_ERR_INVALID_SIZE);
  EXPECT_NE(std::string(mha_last_error()).find("x must have 3 dimensions"), std::string::npos)
      << mha_last_error();
  EXPECT_EQ(mha_positional_encoding_add(nullptr), MHA_ERR_NULL_POINTER);
  int32_t ints[8] = {};
  t = describe(ints, MHA_DTYPE_I32, {1, 2, 4});
  EXPECT_EQ(mha_positional_encoding_add(&t), MHA_ERR_INVALID_DTYPE);
  t = describe(x, MHA_DTYPE_F32, {2, 2, 2}, {0, 2, 1});  // batch stride 0: adds twice
  EXPECT_EQ(mha_positional_encoding_add(&t), MHA_ERR_OVERLAP);
  for (float e : x) EXPECT_EQ(e, 0.0f);
}

}  // namespace
}  // namespace mha_test
