// The SIMD micro-kernels of every instruction set this CPU can run, each
// against plain float64 loops, over every block shape the kernels use
// (XNNPACK's way: a wrong lane or a skipped tail shows here, not as a small
// error in a full attention call).
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "micro_kernels.h"
#include "micro_registry.h"  // generated: kMicroIsas
#include "test_util.h"

namespace mha_test {
namespace {

using mha_micro::MicroKernels;

// 64-byte aligned floats, zeroed.
class Aligned {
 public:
  explicit Aligned(size_t n)
      : data_(static_cast<float*>(std::aligned_alloc(64, (n * 4 + 63) / 64 * 64))) {
    for (size_t i = 0; i < n; ++i) data_[i] = 0.0f;
  }
  ~Aligned() { std::free(data_); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  float* get() { return data_; }
  float& operator[](size_t i) { return data_[i]; }

 private:
  float* data_;
};

class Micro : public ::testing::TestWithParam<mha_micro::MicroIsa> {
 protected:
  void SetUp() override {
    const auto backends = list_backends();
    const BackendEntry* entry = find_backend(backends, GetParam().name);
    ASSERT_NE(entry, nullptr);
    if (!entry->usable) GTEST_SKIP() << GetParam().name << " is not usable here: " << entry->reason;
    k_ = GetParam().get();
  }
  const MicroKernels* k_ = nullptr;
};

double D(float f) {
  return static_cast<double>(f);
}

// Relative to the size of the sum's terms: fp32 rounding of d products.
double dot_tolerance(double abs_sum, int64_t d) {
  return 4.0 * static_cast<double>(d) * 6e-8 * abs_sum + 1e-30;
}

// Σ_x a[x·a_step] · b[x] over d terms in float64, and Σ |a·b| into *abs_sum
// (for dot_tolerance).
double dot_f64(const float* a, int64_t a_step, const float* b, int64_t d, double* abs_sum) {
  double dot = 0, mag = 0;
  for (int64_t x = 0; x < d; ++x) {
    const double t = D(a[x * a_step]) * D(b[x]);
    dot += t;
    mag += std::fabs(t);
  }
  *abs_sum = mag;
  return dot;
}

TEST_P(Micro, ScoreBlockMatchesPlainDotProducts) {
  const int w = k_->lanes, stride = k_->stride;
  Rng rng(11);
  for (const int64_t d : {int64_t{1}, int64_t{3}, int64_t{64}, int64_t{130}}) {
    for (int nv = 1; nv <= k_->max_nv; ++nv) {
      for (int nk = 1; nk <= k_->max_nk; ++nk) {
        SCOPED_TRACE("d " + std::to_string(d) + " nv " + std::to_string(nv) + " nk " +
                     std::to_string(nk));
        const int64_t k_stride = d + 3;  // padded rows
        Aligned qt(static_cast<size_t>(d * stride)), scores(static_cast<size_t>(stride * (nk + 1)));
        std::vector<float> k(
            static_cast<size_t>((nk + 1) * k_stride + 64));  // + the prefetched group
        for (int64_t x = 0; x < d * stride; ++x) qt[static_cast<size_t>(x)] = rng.uniform();
        for (float& f : k) f = rng.uniform();
        k_->score(0, nv, nk, qt.get(), k.data(), k_stride, d, scores.get(), nullptr, nullptr);
        for (int n = 0; n < nk; ++n) {
          for (int lane = 0; lane < nv * w; ++lane) {
            double mag = 0;
            const double ref = dot_f64(qt.get() + lane, stride, k.data() + n * k_stride, d, &mag);
            ASSERT_NEAR(scores[static_cast<size_t>(n * stride + lane)], ref, dot_tolerance(mag, d))
                << "key " << n << " lane " << lane;
          }
        }
      }
    }
  }
}

// The fused form stores 2^(score - row_max) and adds them to tile_sum (the
// kernel checks the tile's sums): near the maximum, and far above it (a
// score 40 above a stale maximum: 2^40, exact in the sums that the kernel
// then finds too large).
TEST_P(Micro, FusedScoreBlockExponentiatesAndSums) {
  const int w = k_->lanes, stride = k_->stride;
  const int nv = k_->max_nv, nk = k_->max_nk;
  const int64_t d = 16, k_stride = d;
  Rng rng(12);
  for (const bool exceed : {false, true}) {
    SCOPED_TRACE(exceed ? "a score far above the maximum" : "scores near the maximum");
    Aligned qt(static_cast<size_t>(d * stride)), scores(static_cast<size_t>(stride * nk)),
        row_max(static_cast<size_t>(stride)), tile_sum(static_cast<size_t>(stride));
    std::vector<float> k(static_cast<size_t>((nk + 1) * k_stride + 64));
    for (int64_t x = 0; x < d * stride; ++x) qt[static_cast<size_t>(x)] = rng.uniform(-0.5f, 0.5f);
    for (float& f : k) f = rng.uniform(-0.5f, 0.5f);
    for (int lane = 0; lane < stride; ++lane) {
      row_max[static_cast<size_t>(lane)] = exceed && lane == w - 1 ? -40.0f : 1.0f;
      tile_sum[static_cast<size_t>(lane)] = 0.25f;
    }
    k_->score(1, nv, nk, qt.get(), k.data(), k_stride, d, scores.get(), row_max.get(),
              tile_sum.get());
    for (int lane = 0; lane < nv * w; ++lane) {
      double sum = 0.25;
      for (int n = 0; n < nk; ++n) {
        double s = 0;
        for (int64_t x = 0; x < d; ++x) {
          s += D(qt[static_cast<size_t>(x * stride + lane)]) *
               D(k[static_cast<size_t>(n * k_stride + x)]);
        }
        const double e = std::exp2(s - D(row_max[static_cast<size_t>(lane)]));
        sum += e;
        ASSERT_NEAR(scores[static_cast<size_t>(n * stride + lane)], e, 1e-5 * e + 1e-30)
            << "key " << n << " lane " << lane;
      }
      ASSERT_NEAR(tile_sum[static_cast<size_t>(lane)], sum, 1e-5 * sum) << "lane " << lane;
    }
  }
}

// The first key group of a query tile (kSetMax): row_max becomes each lane's
// maximum over the group's keys, and the probabilities are taken against it
// (so the largest is 1 within the exp's error), for every block shape.
TEST_P(Micro, FusedScoreBlockSetsItsMaximum) {
  const int w = k_->lanes, stride = k_->stride;
  const int64_t d = 24, k_stride = d + 3;
  Rng rng(15);
  for (int nv = 1; nv <= k_->max_nv; ++nv) {
    for (int nk = 1; nk <= k_->max_nk; ++nk) {
      SCOPED_TRACE("nv " + std::to_string(nv) + " nk " + std::to_string(nk));
      Aligned qt(static_cast<size_t>(d * stride)), scores(static_cast<size_t>(stride * nk)),
          row_max(static_cast<size_t>(stride)), tile_sum(static_cast<size_t>(stride));
      std::vector<float> k(static_cast<size_t>((2 * nk + 1) * k_stride + 64));
      for (int64_t x = 0; x < d * stride; ++x) qt[static_cast<size_t>(x)] = rng.uniform(-2, 2);
      for (float& f : k) f = rng.uniform(-2, 2);
      for (int lane = 0; lane < stride; ++lane) {
        row_max[static_cast<size_t>(lane)] = 1e30f;  // overwritten for the block's lanes
        tile_sum[static_cast<size_t>(lane)] = 0.5f;
      }
      k_->score(2, nv, nk, qt.get(), k.data(), k_stride, d, scores.get(), row_max.get(),
                tile_sum.get());
      for (int lane = 0; lane < nv * w; ++lane) {
        std::vector<double> s(static_cast<size_t>(nk), 0.0);
        for (int n = 0; n < nk; ++n) {
          for (int64_t x = 0; x < d; ++x) {
            s[static_cast<size_t>(n)] += D(qt[static_cast<size_t>(x * stride + lane)]) *
                                         D(k[static_cast<size_t>(n * k_stride + x)]);
          }
        }
        const double m = *std::max_element(s.begin(), s.end());
        ASSERT_NEAR(row_max[static_cast<size_t>(lane)], m, 1e-5 * (1 + std::abs(m)))
            << "lane " << lane;
        double sum = 0.5;
        for (int n = 0; n < nk; ++n) {
          const double e = std::exp2(s[static_cast<size_t>(n)] - m);
          sum += e;
          ASSERT_NEAR(scores[static_cast<size_t>(n * stride + lane)], e, 2e-5 * e + 1e-30)
              << "key " << n << " lane " << lane;
        }
        ASSERT_NEAR(tile_sum[static_cast<size_t>(lane)], sum, 1e-5 * sum) << "lane " << lane;
      }
      for (int lane = nv * w; lane < stride; ++lane) {
        ASSERT_EQ(row_max[static_cast<size_t>(lane)], 1e30f) << "lane " << lane << " untouched";
      }
    }
  }
}

// Each way the sum joins the accumulators (mha_simd::PvJoin): rescaled by
// alpha (0), overwriting them (1), added to them (2).
TEST_P(Micro, PvBlockMatchesPlainSums) {
  const int w = k_->lanes, stride = k_->stride;
  Rng rng(13);
  for (const int join : {0, 1, 2}) {
    for (const int keys : {1, 2, 17, 96}) {
      for (int nr = 1; nr <= k_->max_nr; ++nr) {
        for (int nc = 1; nc <= k_->max_nc; ++nc) {
          SCOPED_TRACE("join " + std::to_string(join) + " keys " + std::to_string(keys) + " nr " +
                       std::to_string(nr) + " nc " + std::to_string(nc));
          const int64_t dvp = nc * w, v_stride = dvp + 5, acc_stride = dvp + w;
          Aligned probs(static_cast<size_t>(keys * stride)), alpha(static_cast<size_t>(stride)),
              acc(static_cast<size_t>(nr * acc_stride));
          std::vector<float> v(static_cast<size_t>(keys * v_stride));
          for (int64_t x = 0; x < keys * stride; ++x)
            probs[static_cast<size_t>(x)] = rng.uniform(0, 1);
          for (int r = 0; r < stride; ++r) alpha[static_cast<size_t>(r)] = rng.uniform(0, 1);
          for (float& f : v) f = rng.uniform();
          for (int64_t x = 0; x < nr * acc_stride; ++x) acc[static_cast<size_t>(x)] = rng.uniform();
          std::vector<double> expected(static_cast<size_t>(nr * dvp));
          for (int r = 0; r < nr; ++r) {
            for (int64_t c = 0; c < dvp; ++c) {
              double sum = 0;
              for (int j = 0; j < keys; ++j) {
                sum += D(probs[static_cast<size_t>(j) * static_cast<size_t>(stride) +
                               static_cast<size_t>(r)]) *
                       D(v[static_cast<size_t>(j * v_stride + c)]);
              }
              const double old = D(acc[static_cast<size_t>(r * acc_stride + c)]);
              const double joined = join == 0   ? old * D(alpha[static_cast<size_t>(r)])
                                    : join == 1 ? 0.0
                                                : old;
              expected[static_cast<size_t>(r * dvp + c)] = joined + sum;
            }
          }
          k_->pv(join, nr, nc, probs.get(), alpha.get(), v.data(), v_stride, keys, acc.get(),
                 acc_stride);
          for (int r = 0; r < nr; ++r) {
            for (int64_t c = 0; c < dvp; ++c) {
              ASSERT_NEAR(acc[static_cast<size_t>(r * acc_stride + c)],
                          expected[static_cast<size_t>(r * dvp + c)], 1e-5 * (keys + 1))
                  << "row " << r << " column " << c;
            }
          }
        }
      }
    }
  }
}

TEST_P(Micro, DecodeRowKernelsMatchPlainLoops) {
  const int w = k_->lanes;
  Rng rng(14);
  // 200 and 515 keys: key streams with keys left over (rows_scores: streams
  // of 6w and 16w keys; rows_pv: of 32 and 128).
  for (const int keys : {1, w - 1 > 0 ? w - 1 : 1, w, 3 * w + 1, 200, 515}) {
    // rows_pv both ways: rows within the register budget (one column block)
    // and wider ones (column blocks inside each run, 5 and 40 vectors);
    // rows_scores with dp fixed at compile time (64, 128) and not.
    for (const int64_t dp :
         {int64_t{w}, int64_t{4 * w}, int64_t{5 * w}, int64_t{64}, int64_t{128}, int64_t{40 * w}}) {
      if (dp % w != 0) continue;
      const int64_t k_stride = dp + w, s_stride = (keys + w - 1) / w * w + w;  // aligned rows
      const int max_rows = k_->max_rows;
      Aligned q(static_cast<size_t>(max_rows * dp)), s(static_cast<size_t>(max_rows * s_stride)),
          acc(static_cast<size_t>(max_rows * dp)), total(static_cast<size_t>(max_rows * dp));
      std::vector<float> k(static_cast<size_t>(keys * k_stride + w));
      for (size_t x = 0; x < static_cast<size_t>(max_rows * dp); ++x) q[x] = rng.uniform();
      for (float& f : k) f = rng.uniform();
      // The same K rows back to back (AVX-512 reads such rows two keys in
      // step): the same scores, bit for bit.
      std::vector<float> k_dense(static_cast<size_t>(keys * dp + w));
      for (int j = 0; j < keys; ++j) {
        for (int64_t x = 0; x < dp; ++x) {
          k_dense[static_cast<size_t>(j * dp + x)] = k[static_cast<size_t>(j * k_stride + x)];
        }
      }
      Aligned s_dense(static_cast<size_t>(max_rows * s_stride));
      std::vector<float> probs(static_cast<size_t>(max_rows * keys)),
          acc0(static_cast<size_t>(max_rows * dp));
      for (float& f : probs) f = rng.uniform(0, 1);
      for (float& f : acc0) f = rng.uniform();
      const float alphas[] = {0.75f, 1.0f, 0.5f, 0.0f, 0.25f, 2.0f, 0.125f, 1.5f};
      // Row r's results from a group of one row, to compare every grouping with.
      std::vector<float> single_scores, single_acc;
      for (int rows = 1; rows <= max_rows; ++rows) {
        SCOPED_TRACE("keys " + std::to_string(keys) + " dp " + std::to_string(dp) + " rows " +
                     std::to_string(rows));
        // Every form: rows one at a time (from memory), keys in step (rows
        // in cache) and key streams, which give the same bits (a paged cache
        // read into cache first gives the bits of the same keys read in
        // place; the streams only read the keys in another order).
        for (const int form : {0, 1, 2}) {
          const bool in_cache = form == 1, streamed = form == 2;
          SCOPED_TRACE(in_cache ? "rows in cache" : streamed ? "key streams" : "rows from memory");
          k_->rows_scores(rows, q.get(), dp, k.data(), k_stride, keys, s.get(), s_stride, in_cache,
                          streamed);
          k_->rows_scores(rows, q.get(), dp, k_dense.data(), dp, keys, s_dense.get(), s_stride,
                          in_cache, streamed);
          for (int r = 0; r < rows; ++r) {
            for (int j = 0; j < keys; ++j) {
              ASSERT_EQ(s_dense[static_cast<size_t>(r * s_stride + j)],
                        s[static_cast<size_t>(r * s_stride + j)])
                  << "rows back to back, row " << r << " key " << j;
              double mag = 0;
              const double ref = dot_f64(q.get() + r * dp, 1, k.data() + j * k_stride, dp, &mag);
              const float got = s[static_cast<size_t>(r * s_stride + j)];
              ASSERT_NEAR(got, ref, dot_tolerance(mag, dp)) << "row " << r << " key " << j;
              // A row's scores depend neither on the rows grouped with it
              // nor on the form.
              if (rows == 1 && form == 0) single_scores.push_back(got);
              if (r == 0) {
                ASSERT_EQ(got, single_scores[static_cast<size_t>(j)])
                    << "row 0 key " << j << " against one row from memory";
              }
            }
          }
        }
        // rows_pv over the same rows as V, in address order and as key
        // streams (another order of the sums: against the reference only).
        for (const bool streamed : {false, true}) {
          SCOPED_TRACE(streamed ? "P·V, key streams" : "P·V");
          const float* p_rows[8];
          float* acc_rows[8];
          for (int r = 0; r < rows; ++r) {
            p_rows[r] = probs.data() + r * keys;
            acc_rows[r] = acc.get() + r * dp;
            for (int64_t x = 0; x < dp; ++x) {
              acc[static_cast<size_t>(r * dp + x)] = acc0[static_cast<size_t>(r * dp + x)];
            }
          }
          k_->rows_pv(rows, p_rows, alphas, k.data(), k_stride, keys, dp, acc_rows, total.get(),
                      streamed);
          for (int r = 0; r < rows; ++r) {
            for (int64_t x = 0; x < dp; ++x) {
              double sum = 0;
              for (int j = 0; j < keys; ++j) {
                sum += D(probs[static_cast<size_t>(int64_t{r} * keys + j)]) *
                       D(k[static_cast<size_t>(j * k_stride + x)]);
              }
              const double expected = D(acc0[static_cast<size_t>(r * dp + x)]) * D(alphas[r]) + sum;
              const float got = acc[static_cast<size_t>(r * dp + x)];
              ASSERT_NEAR(got, expected, 1e-5 * (keys + 1)) << "row " << r << " column " << x;
              if (streamed) continue;
              if (rows == 1) single_acc.push_back(got);
              if (r == 0) {
                ASSERT_EQ(got, single_acc[static_cast<size_t>(x)]) << "row 0 column " << x;
              }
            }
          }
        }
      }
    }
  }
}

// store_narrow and load_widen against the scalar conversions of
// common/dtype.h, bit for bit: ties to even, the largest finite values and
// the first that overflow, subnormals, signed zeros, infinities, NaN; every
// lane position (a value is tried in each lane).
TEST_P(Micro, NarrowingAndWideningMatchTheScalarConversions) {
  const int w = k_->lanes;
  std::vector<float> values = {0.0f, -0.0f, 1.0f, -1.0f, INFINITY, -INFINITY, NAN, -NAN,
                               // ties: exactly half an ulp of bf16 (1 + 2^-8) and f16 (1 + 2^-11)
                               1.00390625f, 1.01171875f, 1.00048828125f, 1.00146484375f,
                               // largest f16, the first that rounds to inf, overflow
                               65504.0f, 65519.99f, 65520.0f, 1e30f, -1e30f,
                               // f16 subnormals and below; fp32 subnormals
                               5.9604645e-8f, 2.9802322e-8f, 1e-6f, 1e-40f, -1e-45f,
                               // bf16: the largest finite, and a value rounding to inf
                               3.3895314e38f, 3.4028235e38f};
  Rng rng(21);
  for (int i = 0; i < 2000; ++i) values.push_back(rng.uniform(-70000.0f, 70000.0f));
  for (int i = 0; i < 2000; ++i)
    values.push_back(std::ldexp(rng.uniform(-1.0f, 1.0f), i % 300 - 150));
  const auto same = [](uint16_t a, uint16_t b, int32_t dtype) {
    const double fa = half_bits_value(a, dtype), fb = half_bits_value(b, dtype);
    return std::isnan(fa) ? std::isnan(fb) : a == b;
  };
  for (const int32_t dtype : {int32_t{MHA_DTYPE_BF16}, int32_t{MHA_DTYPE_F16}}) {
    SCOPED_TRACE(dtype == MHA_DTYPE_BF16 ? "bf16" : "f16");
    for (size_t first = 0; first < values.size(); ++first) {
      std::vector<float> lanes(static_cast<size_t>(w));
      for (int l = 0; l < w; ++l)
        lanes[static_cast<size_t>(l)] = values[(first + static_cast<size_t>(l)) % values.size()];
      std::vector<uint16_t> out(static_cast<size_t>(w) + 1, 0xABCD);
      k_->narrow(dtype, lanes.data(), out.data());
      ASSERT_EQ(out[static_cast<size_t>(w)], 0xABCD) << "wrote past the vector";
      for (int l = 0; l < w; ++l) {
        const float x = lanes[static_cast<size_t>(l)];
        const uint16_t want =
            dtype == MHA_DTYPE_BF16 ? mha_types::f32_to_bf16(x) : mha_types::f32_to_f16(x);
        ASSERT_TRUE(same(out[static_cast<size_t>(l)], want, dtype))
            << "lane " << l << ": " << x << " -> 0x" << std::hex << out[static_cast<size_t>(l)]
            << ", want 0x" << want;
      }
      // And back: every lane of the stored bits.
      std::vector<float> back(static_cast<size_t>(w));
      k_->widen(dtype, out.data(), back.data());
      for (int l = 0; l < w; ++l) {
        const double want = half_bits_value(out[static_cast<size_t>(l)], dtype);
        const double got = static_cast<double>(back[static_cast<size_t>(l)]);
        ASSERT_TRUE(std::isnan(want) ? std::isnan(got)
                                     : got == want && std::signbit(got) == std::signbit(want))
            << "lane " << l;
      }
    }
  }
  // int8: every value, in every lane.
  for (int first = 0; first < 256; ++first) {
    std::vector<int8_t> bytes(static_cast<size_t>(w));
    for (int l = 0; l < w; ++l)
      bytes[static_cast<size_t>(l)] = static_cast<int8_t>((first + l) % 256 - 128);
    std::vector<float> back(static_cast<size_t>(w));
    k_->widen(MHA_DTYPE_I8, bytes.data(), back.data());
    for (int l = 0; l < w; ++l) {
      ASSERT_EQ(back[static_cast<size_t>(l)], static_cast<float>(bytes[static_cast<size_t>(l)]))
          << "lane " << l;
    }
  }
}

// softcap_scores against c · tanh(s / c) in float64: the relative error
// score_variants.hpp states, over arguments small (where the cap barely bends the
// logits) to saturated, for caps of 1, 50 (Gemma 2) and 1e4; ±inf -> ±c,
// NaN stays NaN.
TEST_P(Micro, SoftcapMatchesTanhInFloat64) {
  const int w = k_->lanes;
  std::vector<float> args = {0.0f,    -0.0f, 1e-30f, -1e-20f,  0.6249f,  0.625f,
                             -0.625f, 9.0f,  20.0f,  INFINITY, -INFINITY};
  Rng rng(5);
  for (int i = 0; i < 20000; ++i) args.push_back(std::ldexp(rng.uniform(-1.0f, 1.0f), i % 40 - 30));
  while (args.size() % static_cast<size_t>(w) != 0) args.push_back(0.5f);
  double worst = 0;  // in units of 2^-24 relative
  for (const float cap : {1.0f, 50.0f, 1e4f}) {
    Aligned s(args.size());
    for (size_t i = 0; i < args.size(); ++i) s[i] = args[i] * cap;
    k_->softcap(s.get(), static_cast<int64_t>(args.size()), cap);
    for (size_t i = 0; i < args.size(); ++i) {
      const double x = static_cast<double>(args[i] * cap);
      const double want = static_cast<double>(cap) * std::tanh(x / static_cast<double>(cap));
      const double got = static_cast<double>(s[i]);
      if (std::isinf(x)) {
        ASSERT_EQ(got, want) << "cap " << cap << " of " << x;
        continue;
      }
      const double error = want == 0.0 ? std::fabs(got) : std::fabs(got - want) / std::fabs(want);
      worst = std::max(worst, error * 16777216.0);
      ASSERT_LE(error, 6.0 * std::ldexp(1.0, -24)) << "cap " << cap << " of " << x << ": " << got;
    }
  }
  Aligned nan(static_cast<size_t>(w));
  for (int l = 0; l < w; ++l) nan[static_cast<size_t>(l)] = NAN;
  k_->softcap(nan.get(), w, 50.0f);
  for (int l = 0; l < w; ++l) EXPECT_TRUE(std::isnan(nan[static_cast<size_t>(l)]));
  RecordProperty("worst_ulps", std::to_string(worst));
  std::printf("softcap on %s: worst relative error %.2f * 2^-24\n", k_->name, worst);
}

// The module's micro-kernel (packed_gemm.hpp) on BLIS's packed panels:
// every corner of its tile, C in columns, in rows and strided both ways,
// alpha and beta (beta 0 over NaN: C is not read), k from 0 up, the next
// panels given or not.  Each element must be the plain loop's float result
// bit for bit (one FMA a term, in order, then alpha, then beta·C in one FMA),
// that within k rounding steps of float64, and nothing outside the corner
// written.
TEST_P(Micro, PackedGemmMatchesPlainLoops) {
  if (k_->gemm == nullptr) {
    std::printf("%s offers no module micro-kernel (BLIS's own run)\n", k_->name);
    return;
  }
  const int mr = k_->gemm_mr, nr = k_->gemm_nr;
  Rng rng(11);
  int64_t checked = 0;
  for (const int64_t k : {0, 1, 5, 64, 385}) {
    std::vector<float> a(static_cast<size_t>(std::max<int64_t>(k, 1) * mr));
    std::vector<float> b(static_cast<size_t>(std::max<int64_t>(k, 1) * nr));
    for (float& x : a) x = rng.uniform(-1.0f, 1.0f);
    for (float& x : b) x = rng.uniform(-1.0f, 1.0f);
    const std::vector<std::pair<int, int>> corners = {
        {mr, nr}, {mr - 1, nr}, {mr, nr - 1}, {1, 1}, {1, nr}, {mr, 1}, {mr / 2 + 1, 3}};
    for (const auto& [m, n] : corners) {
      // Layouts: 0 columns, 1 rows, 2 strided both ways.
      for (int layout = 0; layout < 3; ++layout) {
        const int64_t ld = (layout == 1 ? nr : mr) + 3;
        const int64_t rs = layout == 0 ? 1 : (layout == 1 ? ld : 2);
        const int64_t cs = layout == 0 ? ld : (layout == 1 ? 1 : 2 * ld);
        const size_t size = static_cast<size_t>(mr * rs + nr * cs + 8);
        for (const float alpha : {1.0f, -0.75f}) {
          for (const float beta : {0.0f, 1.0f, 0.5f}) {
            std::vector<float> start(size);
            for (float& x : start) x = beta == 0.0f ? NAN : rng.uniform(-1.0f, 1.0f);
            std::vector<float> c = start;
            const bool next = (m + n + layout) % 2 == 0;
            k_->gemm(m, n, k, alpha, a.data(), b.data(), beta, c.data(), rs, cs,
                     next ? a.data() : nullptr, next ? b.data() : nullptr);
            std::vector<bool> inside(size, false);
            for (int i = 0; i < m; ++i) {
              for (int j = 0; j < n; ++j) {
                const auto at = static_cast<size_t>(i * rs + j * cs);
                inside[at] = true;
                float acc = 0.0f;
                double exact = 0.0, terms = 0.0;
                for (int64_t p = 0; p < k; ++p) {
                  const float x = a[static_cast<size_t>(p * mr + i)];
                  const float y = b[static_cast<size_t>(p * nr + j)];
                  acc = std::fma(x, y, acc);
                  exact += D(x) * D(y);
                  terms += std::fabs(D(x) * D(y));
                }
                const float sum = alpha == 1.0f ? acc : acc * alpha;
                const float want = beta == 0.0f ? sum : std::fma(beta, start[at], sum);
                ASSERT_EQ(c[at], want)
                    << k_->name << ": (" << i << ", " << j << ") of " << m << " x " << n << ", k "
                    << k << ", layout " << layout << ", alpha " << alpha << ", beta " << beta;
                const double old = beta == 0.0f ? 0.0 : D(beta) * D(start[at]);
                ASSERT_LE(std::fabs(D(c[at]) - (D(alpha) * exact + old)),
                          dot_tolerance(std::fabs(D(alpha)) * terms + std::fabs(old), k + 2));
                ++checked;
              }
            }
            for (size_t i = 0; i < size; ++i) {
              if (inside[i]) continue;
              ASSERT_TRUE(std::isnan(start[i]) ? std::isnan(c[i]) : c[i] == start[i])
                  << k_->name << ": element " << i << " outside the " << m << " x " << n
                  << " corner was written";
            }
          }
        }
      }
    }
  }
  std::printf("packed_gemm on %s (%d x %d, vectors along %s): %lld elements bit for bit\n",
              k_->name, mr, nr, k_->gemm_row_major != 0 ? "rows" : "columns",
              static_cast<long long>(checked));
}

// The module's products on AMX tiles (amx_gemm.hpp): C = A · Wᵀ + bias, W
// holding bf16 values, A bf16 (run) or fp32 split into three bf16 parts
// (run_split), for shapes around every edge of its 32 x 32 blocks and
// 32-value steps, rows in place and staged, C whole blocks and through the
// staging tile, groups of rows smaller than the problem (a small L2), with
// and without biases.  Each element within k + 2 fp32 rounding steps (3k + 2
// split) of the float64 sum of the same values, and nothing outside rows [0,
// m) x columns [0, n) written.  fp32 A holds values of every magnitude the
// split must keep whole, and one row of infinities and NaNs, whose results
// are BLIS's: inf·w, NaN.
// C's element (i, j) = bias[j] + Σ_p a[i · lda + p] · wt[p · ldw + j] in
// float64, and in *terms the sum of its terms' magnitudes (dot_tolerance).
double product_f64(const std::vector<float>& a, int64_t lda, const std::vector<float>& wt,
                   int64_t ldw, const float* bias, int64_t i, int64_t j, int64_t k, double* terms) {
  const double b = bias != nullptr ? D(bias[j]) : 0.0;
  double mag = 0.0;
  const double dot = dot_f64(wt.data() + j, ldw, a.data() + i * lda, k, &mag);
  *terms = mag + std::fabs(b);
  return b + dot;
}

// The m x n fp32 C (rows ldc apart, two rows more below it) against
// product_f64: each element within `roundings` fp32 roundings of its terms,
// NaN in row nan_row (-1: none; A's row there holds inf, -inf and NaN), and
// NaN (not written) outside C.  *checked counts the elements compared.
::testing::AssertionResult products_within(const std::vector<float>& c, int64_t ldc,
                                           const std::vector<float>& a, int64_t lda,
                                           const std::vector<float>& wt, int64_t ldw,
                                           const float* bias, int64_t m, int64_t n, int64_t k,
                                           int64_t roundings, int64_t nan_row, int64_t* checked) {
  for (int64_t i = 0; i < m + 2; ++i) {
    for (int64_t j = 0; j < ldc; ++j) {
      const float got = c[static_cast<size_t>(i * ldc + j)];
      if (i >= m || j >= n || i == nan_row) {
        if (!std::isnan(got)) {
          return ::testing::AssertionFailure()
                 << "(" << i << ", " << j << ") of " << m << " x " << n << " x " << k << ": " << got
                 << (i == nan_row ? " where inf - inf and NaN must give NaN"
                                  : " written outside C");
        }
        continue;
      }
      double terms = 0.0;
      const double exact = product_f64(a, lda, wt, ldw, bias, i, j, k, &terms);
      if (std::fabs(D(got) - exact) > dot_tolerance(terms, roundings)) {
        return ::testing::AssertionFailure() << "(" << i << ", " << j << ") of " << m << " x " << n
                                             << " x " << k << ": " << got << " against " << exact;
      }
      ++*checked;
    }
  }
  return ::testing::AssertionSuccess();
}

// A bf16 C in slabs of `slab` columns (rows ld16 apart, the slabs `stride`
// apart, m + 2 rows each): the m x n fp32 C (rows ldc apart) rounded once,
// and 0xFFFF (not written) everywhere else.
::testing::AssertionResult rounded_in_slabs(const std::vector<uint16_t>& c16,
                                            const std::vector<float>& c, int64_t m, int64_t n,
                                            int64_t ldc, int64_t slab, int64_t ld16,
                                            int64_t stride) {
  for (int64_t sl = 0; sl < (n + slab - 1) / slab; ++sl) {
    for (int64_t i = 0; i < m + 2; ++i) {
      for (int64_t x = 0; x < ld16; ++x) {
        const int64_t j = sl * slab + x;
        const bool in_c = i < m && x < slab && j < n;
        const uint16_t want =
            in_c ? mha_types::f32_to_bf16(c[static_cast<size_t>(i * ldc + j)]) : 0xFFFFu;
        const uint16_t got = c16[static_cast<size_t>(sl * stride + i * ld16 + x)];
        if (got != want) {
          return ::testing::AssertionFailure()
                 << "bf16 C (" << i << ", " << j << ") of " << m << " x " << n << ", slabs of "
                 << slab << ": " << got << " against " << want;
        }
      }
    }
  }
  return ::testing::AssertionSuccess();
}

TEST_P(Micro, Bf16AmxGemmMatchesFloat64) {
  if (k_->bf16_gemm == nullptr) {
    std::printf("%s builds no bf16 products on AMX tiles\n", k_->name);
    return;
  }
  if (std::string(mha_cpu_features()).find("amx-bf16") == std::string::npos) {
    GTEST_SKIP() << "this CPU (or OS, or process) does not allow AMX tiles with bf16: "
                 << mha_cpu_features();
  }
  struct Shape {
    int64_t m, n, k, l2;
    bool bias;
  };
  const std::vector<Shape> shapes = {
      {1, 1, 1, 0, true},
      {31, 17, 33, 0, false},
      {32, 32, 32, 0, true},
      {33, 33, 64, 0, true},
      {64, 96, 768, 0, true},
      {100, 50, 100, 0, false},
      {5, 2304, 64, 0, true},
      {200, 70, 96, 16384, true},
      {97, 64, 40, 8192, false},
      // One and two terms, no bias: a part of A lost shows beside k + 2 roundings.
      {40, 40, 1, 0, false},
      {33, 20, 2, 0, false},
  };
  Rng rng(19);
  int64_t checked = 0;
  for (const bool split : {false, true}) {
    for (const Shape& s : shapes) {
      const int64_t lda = s.k + 5, ldw = s.n + 3, ldc = s.n + 7;
      // bf16 A (run), or fp32 A with 24 significant bits and magnitudes
      // from 2^-60 to 2^60 (run_split); W bf16 values.
      std::vector<uint16_t> a16(static_cast<size_t>(s.m * lda));
      std::vector<float> a(a16.size());
      for (size_t i = 0; i < a.size(); ++i) {
        if (split) {
          a[i] = std::ldexp(rng.uniform(-1.0f, 1.0f), static_cast<int>(i % 121) - 60);
        } else {
          a16[i] = mha_types::f32_to_bf16(rng.uniform(-1.0f, 1.0f));
          a[i] = mha_types::bf16_to_f32(a16[i]);
        }
      }
      const bool specials = split && s.m > 2 && s.k > 2;  // row 1: inf, -inf and NaN
      if (specials) {
        a[static_cast<size_t>(lda)] = INFINITY;
        a[static_cast<size_t>(lda + 1)] = -INFINITY;
        a[static_cast<size_t>(lda + 2)] = NAN;
      }
      std::vector<float> wt(static_cast<size_t>(s.k * ldw));
      for (float& x : wt) {
        x = mha_types::bf16_to_f32(mha_types::f32_to_bf16(rng.uniform(-1.0f, 1.0f)));
      }
      std::vector<float> bias(static_cast<size_t>(s.n));
      for (float& x : bias) x = rng.uniform(-1.0f, 1.0f);
      Aligned packed((k_->bf16_packed_bytes(s.n, s.k) + 3) / 4);
      Aligned scratch(
          ((split ? k_->bf16_split_scratch_bytes(s.k, s.l2) : k_->bf16_scratch_bytes(s.k, s.l2)) +
           3) /
          4);
      k_->bf16_pack(s.n, s.k, wt.data(), ldw, packed.get());
      std::vector<float> c(static_cast<size_t>((s.m + 2) * ldc), NAN);
      const float* b = s.bias ? bias.data() : nullptr;
      if (split) {
        k_->bf16_gemm_split(s.m, s.n, s.k, a.data(), lda, packed.get(), b, c.data(), ldc,
                            scratch.get(), s.l2);
      } else {
        k_->bf16_gemm(s.m, s.n, s.k, a16.data(), lda, packed.get(), b, c.data(), ldc, scratch.get(),
                      s.l2);
        // C in bf16: the same sums, each rounded once; nothing else written.
        // One slab (rows ldc apart), then slabs of 20 columns (straddling
        // the tiles' blocks of 32) and of 64 (a head), rows ld16 apart.
        for (const int64_t slab : {s.n, int64_t{20}, int64_t{64}}) {
          const int64_t ld16 = slab == s.n ? ldc : slab + 3;
          const int64_t stride = (s.m + 2) * ld16, slabs = (s.n + slab - 1) / slab;
          std::vector<uint16_t> c16(static_cast<size_t>(slabs * stride), 0xFFFFu);
          k_->bf16_gemm_to_bf16(s.m, s.n, s.k, a16.data(), lda, packed.get(), b, c16.data(), ld16,
                                slab, stride, scratch.get(), s.l2);
          ASSERT_TRUE(rounded_in_slabs(c16, c, s.m, s.n, ldc, slab, ld16, stride))
              << k_->name << ": k " << s.k << ", l2 " << s.l2;
        }
      }
      ASSERT_TRUE(products_within(c, ldc, a, lda, wt, ldw, b, s.m, s.n, s.k,
                                  (split ? 3 : 1) * s.k + 2, specials ? 1 : -1, &checked))
          << k_->name << (split ? " split" : "") << ", l2 " << s.l2 << ", bias " << s.bias;
    }
  }
  std::printf("products on AMX tiles on %s: %lld elements within their roundings\n", k_->name,
              static_cast<long long>(checked));
}

// The module's bf16 products with AVX512_BF16 dot products (dot_gemm.hpp) on
// the tiles' packed weights: every element of C within k + 2 roundings of
// the float64 products (odd k, partial blocks of rows and of columns, k in
// several blocks: an L1d of 4 KiB takes 16 pairs a block), nothing outside C
// written, and a bf16 C (in slabs of 20 and 64 columns) each fp32 sum
// rounded once.
TEST_P(Micro, Bf16DotGemmMatchesFloat64) {
  if (k_->bf16_dot_gemm == nullptr) {
    std::printf("%s builds no bf16 dot-product gemm\n", k_->name);
    return;
  }
  if (std::string(mha_cpu_features()).find("avx512bf16") == std::string::npos) {
    GTEST_SKIP() << "this CPU has no AVX512_BF16: " << mha_cpu_features();
  }
  struct Shape {
    int64_t m, n, k;
    bool bias;
  };
  const std::vector<Shape> shapes = {{1, 1, 1, true},    {7, 33, 3, false},    {6, 64, 64, true},
                                     {13, 96, 33, true}, {31, 17, 200, false}, {40, 130, 768, true},
                                     {5, 2304, 64, true}};
  Rng rng(23);
  int64_t checked = 0;
  for (const Shape& s : shapes) {
    const int64_t lda = s.k + 3, ldw = s.n + 3, ldc = s.n + 5;
    std::vector<uint16_t> a16(static_cast<size_t>(s.m * lda));
    std::vector<float> a(a16.size());
    for (size_t x = 0; x < a16.size(); ++x) {
      a16[x] = mha_types::f32_to_bf16(rng.uniform(-1.0f, 1.0f));
      a[x] = mha_types::bf16_to_f32(a16[x]);
    }
    std::vector<float> wt(static_cast<size_t>(s.k * ldw));
    for (float& x : wt)
      x = mha_types::bf16_to_f32(mha_types::f32_to_bf16(rng.uniform(-1.0f, 1.0f)));
    std::vector<float> bias(static_cast<size_t>(s.n));
    for (float& x : bias) x = rng.uniform(-1.0f, 1.0f);
    const float* b = s.bias ? bias.data() : nullptr;
    Aligned packed((k_->bf16_packed_bytes(s.n, s.k) + 3) / 4);
    k_->bf16_pack(s.n, s.k, wt.data(), ldw, packed.get());
    for (const int64_t l1d : {int64_t{0}, int64_t{4096}, int64_t{48} << 10}) {
      for (const int64_t l2 : {int64_t{0}, int64_t{8192}}) {
        Aligned scratch((k_->bf16_dot_scratch_bytes(s.k, l2) + 3) / 4);
        std::vector<float> c(static_cast<size_t>((s.m + 2) * ldc), NAN);
        k_->bf16_dot_gemm(s.m, s.n, s.k, a16.data(), lda, packed.get(), b, c.data(), nullptr, ldc,
                          s.n, 0, scratch.get(), l1d, l2);
        ASSERT_TRUE(
            products_within(c, ldc, a, lda, wt, ldw, b, s.m, s.n, s.k, s.k + 2, -1, &checked))
            << k_->name << ": l1d " << l1d << ", l2 " << l2;
        for (const int64_t slab : {s.n, int64_t{20}, int64_t{64}}) {
          const int64_t ld16 = slab + 3, stride = (s.m + 2) * ld16;
          const int64_t slabs = (s.n + slab - 1) / slab;
          std::vector<uint16_t> c16(static_cast<size_t>(slabs * stride), 0xFFFFu);
          k_->bf16_dot_gemm(s.m, s.n, s.k, a16.data(), lda, packed.get(), b, nullptr, c16.data(),
                            ld16, slab, stride, scratch.get(), l1d, l2);
          ASSERT_TRUE(rounded_in_slabs(c16, c, s.m, s.n, ldc, slab, ld16, stride))
              << k_->name << ": k " << s.k << ", l1d " << l1d << ", l2 " << l2;
        }
      }
    }
  }
  std::printf("bf16 dot-product products on %s: %lld elements within their roundings\n", k_->name,
              static_cast<long long>(checked));
}

std::string isa_name(const ::testing::TestParamInfo<mha_micro::MicroIsa>& info) {
  return info.param.name;
}

INSTANTIATE_TEST_SUITE_P(Isas, Micro, ::testing::ValuesIn(mha_micro::kMicroIsas), isa_name);

}  // namespace
}  // namespace mha_test
