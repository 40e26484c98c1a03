// Self-tests of the float64 reference: hand-computed cases, and agreement with
// a second, differently written implementation (full score matrix, explicit
// broadcasting) on random problems.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "reference.h"
#include "test_util.h"

namespace mha_test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

mha_attention_params default_params() {
  // Written out by hand: the reference must not depend on the library.
  mha_attention_params p{};
  p.struct_size = sizeof p;
  p.window_left = -1;  // unbounded, as mha_attention_params_init sets them
  p.window_right = -1;
  return p;
}

mha_tensor f32(std::vector<float>& data, const std::vector<int64_t>& shape) {
  return describe(data.data(), MHA_DTYPE_F32, shape);
}

TEST(Reference, OneQueryTwoKeysKnownSoftmax) {
  // logits 0 and ln 3 -> weights 1/4 and 3/4.
  std::vector<float> q = {1.0f}, k = {0.0f, static_cast<float>(std::log(3.0))}, v = {2.0f, 6.0f};
  const mha_tensor tq = f32(q, {1, 1, 1, 1}), tk = f32(k, {1, 1, 2, 1}), tv = f32(v, {1, 1, 2, 1});
  mha_attention_params p = default_params();
  p.has_scale = 1;
  p.scale = 1.0f;
  const Reference ref = reference_attention(tq, tk, tv, &p);
  ASSERT_EQ(ref.out.size(), 1u);
  EXPECT_NEAR(ref.out[0], 0.25 * 2.0 + 0.75 * 6.0, 1e-6);
  EXPECT_NEAR(ref.lse[0], std::log(1.0 + 3.0), 1e-6);
  EXPECT_NEAR(ref.max_abs_logit, std::log(3.0), 1e-6);
  EXPECT_NEAR(ref.max_abs_out, 5.0, 1e-6);
}

TEST(Reference, DefaultScaleIsOneOverSqrtD) {
  // D = 4: scale 1/2.  q . k1 = 2 -> logit 1; q . k0 = 0 -> logit 0.
  std::vector<float> q = {1, 1, 1, 1}, k = {0, 0, 0, 0, 0.5f, 0.5f, 0.5f, 0.5f};
  std::vector<float> v = {1, 0, 0, 1};  // Dv = 2
  const mha_tensor tq = f32(q, {1, 1, 1, 4}), tk = f32(k, {1, 1, 2, 4}), tv = f32(v, {1, 1, 2, 2});
  const double e = std::exp(1.0);
  for (const bool null_params : {true, false}) {
    const mha_attention_params p = default_params();
    const Reference ref = reference_attention(tq, tk, tv, null_params ? nullptr : &p);
    EXPECT_NEAR(ref.out[0], 1.0 / (1.0 + e), 1e-12);
    EXPECT_NEAR(ref.out[1], e / (1.0 + e), 1e-12);
    EXPECT_NEAR(ref.lse[0], std::log(1.0 + e), 1e-12);
    EXPECT_NEAR(ref.max_abs_logit, 1.0, 1e-12);
  }
}

TEST(Reference, EqualScoresGiveUniformWeights) {
  const int64_t lk = 5, dv = 3;
  std::vector<float> q(4, 0.0f), k(static_cast<size_t>(lk * 4)), v(static_cast<size_t>(lk * dv));
  Rng rng(1);
  for (auto& x : k) x = rng.uniform();
  for (auto& x : v) x = rng.uniform();
  const Reference ref = reference_attention(f32(q, {1, 1, 1, 4}), f32(k, {1, 1, lk, 4}),
                                            f32(v, {1, 1, lk, dv}), nullptr);
  for (int64_t c = 0; c < dv; ++c) {
    double mean = 0;
    for (int64_t j = 0; j < lk; ++j) mean += double(v[static_cast<size_t>(j * dv + c)]);
    EXPECT_NEAR(ref.out[static_cast<size_t>(c)], mean / lk, 1e-7);
  }
  EXPECT_NEAR(ref.lse[0], std::log(5.0), 1e-12);
  EXPECT_EQ(ref.max_abs_logit, 0.0);
}

// q = 0 makes every score equal, and v = identity rows makes out[i][j] the
// weight of key j: the set of keys each row sees becomes visible.
struct Probe {
  int64_t lq, lk;
  std::vector<float> q, k, v;
  mha_tensor tq{}, tk{}, tv{};
  Probe(int64_t lq_, int64_t lk_)
      : lq(lq_),
        lk(lk_),
        q(static_cast<size_t>(lq_ * 2), 0.0f),
        k(static_cast<size_t>(lk_ * 2), 0.5f),
        v(static_cast<size_t>(lk_ * lk_), 0.0f) {
    for (int64_t j = 0; j < lk; ++j) v[static_cast<size_t>(j * lk + j)] = 1.0f;
    tq = describe(q.data(), MHA_DTYPE_F32, {1, 1, lq, 2});
    tk = describe(k.data(), MHA_DTYPE_F32, {1, 1, lk, 2});
    tv = describe(v.data(), MHA_DTYPE_F32, {1, 1, lk, lk});
  }
  // Expects row i to weigh keys [0, end(i)) uniformly.
  template <typename End>
  void expect_prefix(const Reference& ref, End end) const {
    for (int64_t i = 0; i < lq; ++i) {
      const int64_t n = end(i);
      for (int64_t j = 0; j < lk; ++j) {
        const double want = j < n ? 1.0 / static_cast<double>(n) : 0.0;
        EXPECT_NEAR(ref.out[static_cast<size_t>(i * lk + j)], want, 1e-12) << "row " << i;
      }
      if (n == 0) {
        EXPECT_EQ(ref.lse[static_cast<size_t>(i)], -kInf) << "row " << i;
      } else {
        EXPECT_NEAR(ref.lse[static_cast<size_t>(i)], std::log(static_cast<double>(n)), 1e-12);
      }
    }
  }
};

TEST(Reference, CausalTopLeft) {
  for (const auto& [lq, lk] : {std::pair<int64_t, int64_t>{4, 4}, {3, 6}, {6, 3}}) {
    Probe probe(lq, lk);
    mha_attention_params p = default_params();
    p.causal = MHA_CAUSAL_TOP_LEFT;
    const Reference ref = reference_attention(probe.tq, probe.tk, probe.tv, &p);
    probe.expect_prefix(ref, [lk = lk](int64_t i) { return std::min(i + 1, lk); });
  }
}

TEST(Reference, CausalBottomRightIncludingFullyMaskedRows) {
  for (const auto& [lq, lk] : {std::pair<int64_t, int64_t>{4, 4}, {3, 6}, {6, 3}}) {
    Probe probe(lq, lk);
    mha_attention_params p = default_params();
    p.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    const Reference ref = reference_attention(probe.tq, probe.tk, probe.tv, &p);
    probe.expect_prefix(
        ref, [lq = lq, lk = lk](int64_t i) { return std::max<int64_t>(0, i + lk - lq + 1); });
  }
}

TEST(Reference, ValidLensPerBatchAndPerQuery) {
  Probe probe(3, 5);
  for (const bool i64 : {false, true}) {
    const std::vector<int64_t> lens = {2, 0, 5};  // per query (B = 1)
    std::vector<int32_t> l32(lens.begin(), lens.end());
    std::vector<int64_t> l64(lens);
    void* data = i64 ? static_cast<void*>(l64.data()) : static_cast<void*>(l32.data());
    const mha_dtype dtype = i64 ? MHA_DTYPE_I64 : MHA_DTYPE_I32;
    mha_attention_params p = default_params();
    const mha_tensor per_query = describe(data, dtype, {1, 3});
    p.valid_lens = &per_query;
    probe.expect_prefix(reference_attention(probe.tq, probe.tk, probe.tv, &p),
                        [&](int64_t i) { return lens[static_cast<size_t>(i)]; });
    const mha_tensor per_batch = describe(data, dtype, {1});  // the first value, 2
    p.valid_lens = &per_batch;
    probe.expect_prefix(reference_attention(probe.tq, probe.tk, probe.tv, &p),
                        [](int64_t) { return int64_t{2}; });
  }
}

TEST(Reference, FullyMaskedRowsAreZeroWithLseMinusInf) {
  Probe probe(2, 3);
  // Bool mask: row 0 all false, row 1 keys 0 and 2.
  std::vector<uint8_t> bools = {0, 0, 0, 1, 0, 7};
  const mha_tensor bool_mask = describe(bools.data(), MHA_DTYPE_BOOL, {2, 3});
  mha_attention_params p = default_params();
  p.mask = &bool_mask;
  Reference ref = reference_attention(probe.tq, probe.tk, probe.tv, &p);
  for (int j = 0; j < 3; ++j) EXPECT_EQ(ref.out[static_cast<size_t>(j)], 0.0);
  EXPECT_EQ(ref.lse[0], -kInf);
  EXPECT_NEAR(ref.out[3], 0.5, 1e-12);
  EXPECT_EQ(ref.out[4], 0.0);
  EXPECT_NEAR(ref.out[5], 0.5, 1e-12);

  // Additive mask: row 0 all -inf, row 1 has -inf on key 1 only.
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<float> add = {ninf, ninf, ninf, 0.0f, ninf, 0.0f};
  const mha_tensor add_mask = describe(add.data(), MHA_DTYPE_F32, {2, 3});
  p.mask = &add_mask;
  ref = reference_attention(probe.tq, probe.tk, probe.tv, &p);
  for (int j = 0; j < 3; ++j) EXPECT_EQ(ref.out[static_cast<size_t>(j)], 0.0);
  EXPECT_EQ(ref.lse[0], -kInf);
  EXPECT_NEAR(ref.out[3], 0.5, 1e-12);
  EXPECT_EQ(ref.out[4], 0.0);
  EXPECT_EQ(ref.max_abs_logit, 0.0);  // masked keys do not count
}

TEST(Reference, MaskedKeysAreSkippedNotMultipliedByZero) {
  // Key 1 holds inf/NaN; masked out, it must not poison the row.
  std::vector<float> q = {1.0f}, k = {0.5f, std::numeric_limits<float>::infinity()};
  std::vector<float> v = {3.0f, std::numeric_limits<float>::quiet_NaN()};
  std::vector<uint8_t> keep = {1, 0};
  const mha_tensor mask = describe(keep.data(), MHA_DTYPE_BOOL, {1, 2});
  mha_attention_params p = default_params();
  p.mask = &mask;
  const Reference ref =
      reference_attention(f32(q, {1, 1, 1, 1}), f32(k, {1, 1, 2, 1}), f32(v, {1, 1, 2, 1}), &p);
  EXPECT_EQ(ref.out[0], 3.0);
  EXPECT_NEAR(ref.lse[0], 0.5, 1e-12);
}

TEST(Reference, AdditiveMaskAddsToScaledScores) {
  std::vector<float> q = {2.0f}, k = {1.0f, -1.0f}, v = {1.0f, 0.0f};
  std::vector<float> add = {-1.0f, 0.5f};
  const mha_tensor mask = describe(add.data(), MHA_DTYPE_F32, {1, 2});
  mha_attention_params p = default_params();
  p.has_scale = 1;
  p.scale = -0.75f;  // logits: -1.5 - 1 = -2.5 and 1.5 + 0.5 = 2
  p.mask = &mask;
  const Reference ref =
      reference_attention(f32(q, {1, 1, 1, 1}), f32(k, {1, 1, 2, 1}), f32(v, {1, 1, 2, 1}), &p);
  const double a = std::exp(-2.5), b = std::exp(2.0);
  EXPECT_NEAR(ref.out[0], a / (a + b), 1e-12);
  EXPECT_NEAR(ref.lse[0], std::log(a + b), 1e-12);
  EXPECT_NEAR(ref.max_abs_logit, 2.5, 1e-12);
}

TEST(Reference, HugeLogitsDoNotOverflow) {
  // logits 1e4 and 1e4 - 1: naive exp overflows, the stable form does not.
  std::vector<float> q = {1.0f}, k = {10000.0f, 9999.0f}, v = {1.0f, 0.0f};
  mha_attention_params p = default_params();
  p.has_scale = 1;
  p.scale = 1.0f;
  const Reference ref =
      reference_attention(f32(q, {1, 1, 1, 1}), f32(k, {1, 1, 2, 1}), f32(v, {1, 1, 2, 1}), &p);
  EXPECT_NEAR(ref.out[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-12);
  EXPECT_NEAR(ref.lse[0], 10000.0 + std::log(1.0 + std::exp(-1.0)), 1e-9);
  EXPECT_EQ(ref.max_abs_logit, 10000.0);
}

TEST(Reference, ToleranceFormula) {
  Reference ref;
  ref.max_abs_out = 0.5;
  ref.max_abs_logit = 0.0;
  EXPECT_DOUBLE_EQ(tolerance(ref), 1e-5);
  ref.max_abs_out = 3.0;
  ref.max_abs_logit = 1e4;
  EXPECT_DOUBLE_EQ(tolerance(ref), 3e-5 + 4.0 / 16777216.0 * 1e4);
}

// A logit whose terms cancel: q · k = 3·2 - 2·3 = 0, from terms of 6.  The
// logit rounding term of the tolerance follows the terms (|scale| = 0.5:
// 6), not the logit (0).
TEST(Reference, ScoreTermsOfACancellingLogit) {
  std::vector<float> q = {3.0f, 2.0f}, k = {2.0f, -3.0f}, v = {1.0f};
  mha_attention_params p = default_params();
  p.has_scale = 1;
  p.scale = -0.5f;
  const Reference ref =
      reference_attention(f32(q, {1, 1, 1, 2}), f32(k, {1, 1, 1, 2}), f32(v, {1, 1, 1, 1}), &p);
  EXPECT_EQ(ref.max_abs_logit, 0.0);
  EXPECT_EQ(ref.max_score_terms, 6.0);
  EXPECT_DOUBLE_EQ(logit_rounding(ref), 4.0 / 16777216.0 * 6.0);
  EXPECT_DOUBLE_EQ(lse_tolerance(ref, 0.0), 1e-5 + 4.0 / 16777216.0 * 6.0);
}

TEST(Reference, MaxAbsError) {
  std::vector<float> q = {0.0f}, k = {0.0f, 0.0f}, v = {1.0f, 3.0f};
  const Reference ref = reference_attention(f32(q, {1, 1, 1, 1}), f32(k, {1, 1, 2, 1}),
                                            f32(v, {1, 1, 2, 1}), nullptr);
  ASSERT_DOUBLE_EQ(ref.out[0], 2.0);
  std::vector<float> out = {2.0f};
  mha_tensor t = f32(out, {1, 1, 1, 1});
  EXPECT_EQ(max_abs_error(t, ref), 0.0);
  out[0] = 2.5f;
  EXPECT_DOUBLE_EQ(max_abs_error(t, ref), 0.5);
  out[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(max_abs_error(t, ref), kInf);
  out[0] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(max_abs_error(t, ref), kInf);
  std::vector<float> wrong(2, 2.0f);
  EXPECT_EQ(max_abs_error(f32(wrong, {1, 1, 1, 2}), ref), kInf);  // shape differs
}

TEST(Reference, GroupedHeadsUseHeadOverGroup) {
  // H = 4, Hkv = 2: heads 0,1 use KV head 0 and heads 2,3 KV head 1.  The same
  // problem with K and V repeated per head (stride tricks) must agree.
  Rng rng(7);
  const int64_t lq = 3, lk = 5, d = 4;
  std::vector<float> q(static_cast<size_t>(4 * lq * d)), k(static_cast<size_t>(2 * lk * d)),
      v(static_cast<size_t>(2 * lk * d));
  for (auto* buf : {&q, &k, &v})
    for (auto& x : *buf) x = rng.uniform();
  const mha_tensor tq = f32(q, {1, 4, lq, d});
  const Reference gqa =
      reference_attention(tq, f32(k, {1, 2, lk, d}), f32(v, {1, 2, lk, d}), nullptr);
  std::vector<float> k4, v4;
  for (int h = 0; h < 4; ++h) {
    const auto from = static_cast<std::ptrdiff_t>((h / 2) * lk * d);
    k4.insert(k4.end(), k.begin() + from, k.begin() + from + lk * d);
    v4.insert(v4.end(), v.begin() + from, v.begin() + from + lk * d);
  }
  const Reference mha =
      reference_attention(tq, f32(k4, {1, 4, lk, d}), f32(v4, {1, 4, lk, d}), nullptr);
  ASSERT_EQ(gqa.out.size(), mha.out.size());
  for (size_t i = 0; i < gqa.out.size(); ++i) EXPECT_DOUBLE_EQ(gqa.out[i], mha.out[i]);
  // And the grouping is not the other mapping (h % Hkv): head 1 differs from head 3's KV.
  bool differs = false;
  for (size_t i = 0; i < static_cast<size_t>(lq * d); ++i) {
    differs |= gqa.out[static_cast<size_t>(1 * lq * d) + i] !=
               gqa.out[static_cast<size_t>(3 * lq * d) + i];
  }
  EXPECT_TRUE(differs);
}

TEST(Reference, StridedLayoutEqualsContiguous) {
  Rng rng(11);
  const int64_t b = 2, h = 3, lq = 4, lk = 6, d = 5;
  // Fill BHLD and copy into BLHD (with padding) element by element.
  Arena aq(b * h * lq * d), ak(b * h * lk * d), av(b * h * lk * d), aout(b * h * lq * d);
  const mha_tensor q1 = aq.view(make_shape(Layout::BHLD, b, h, lq, d));
  const mha_tensor k1 = ak.view(make_shape(Layout::BHLD, b, h, lk, d));
  const mha_tensor v1 = av.view(make_shape(Layout::BHLD, b, h, lk, d));
  for (const mha_tensor* t : {&q1, &k1, &v1}) fill_uniform(*t, rng);
  const Shape4 sq = make_shape(Layout::BLHD, b, h, lq, d, 3),
               sk = make_shape(Layout::BLHD, b, h, lk, d, 3);
  Arena bq(sq.extent), bk(sk.extent), bv(sk.extent);
  const mha_tensor q2 = bq.view(sq), k2 = bk.view(sk), v2 = bv.view(sk);
  auto copy = [&](const mha_tensor& from, const mha_tensor& to) {
    for (int64_t i0 = 0; i0 < from.shape[0]; ++i0)
      for (int64_t i1 = 0; i1 < from.shape[1]; ++i1)
        for (int64_t i2 = 0; i2 < from.shape[2]; ++i2)
          for (int64_t i3 = 0; i3 < from.shape[3]; ++i3) {
            static_cast<float*>(to.data)[i0 * to.strides[0] + i1 * to.strides[1] +
                                         i2 * to.strides[2] + i3 * to.strides[3]] =
                static_cast<const float*>(from.data)[i0 * from.strides[0] + i1 * from.strides[1] +
                                                     i2 * from.strides[2] + i3 * from.strides[3]];
          }
  };
  copy(q1, q2);
  copy(k1, k2);
  copy(v1, v2);
  mha_attention_params p = default_params();
  p.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  const Reference r1 = reference_attention(q1, k1, v1, &p);
  const Reference r2 = reference_attention(q2, k2, v2, &p);
  ASSERT_EQ(r1.out.size(), r2.out.size());
  for (size_t i = 0; i < r1.out.size(); ++i) EXPECT_EQ(r1.out[i], r2.out[i]);
  for (size_t i = 0; i < r1.lse.size(); ++i) EXPECT_EQ(r1.lse[i], r2.lse[i]);
  // max_abs_error reads a strided out descriptor.
  const Shape4 so = make_shape(Layout::BLHD, b, h, lq, d, 2);
  Arena ao(so.extent);
  const mha_tensor out = ao.view(so);
  for (int64_t i0 = 0; i0 < b; ++i0)
    for (int64_t i1 = 0; i1 < h; ++i1)
      for (int64_t i2 = 0; i2 < lq; ++i2)
        for (int64_t i3 = 0; i3 < d; ++i3) {
          static_cast<float*>(
              out.data)[i0 * so.strides[0] + i1 * so.strides[1] + i2 * so.strides[2] + i3] =
              static_cast<float>(r1.out[static_cast<size_t>(((i0 * h + i1) * lq + i2) * d + i3)]);
        }
  EXPECT_LE(max_abs_error(out, r1), 1e-7);
  static_cast<float*>(out.data)[so.strides[0] + 2 * so.strides[1] + so.strides[2] + 4] += 0.25f;
  EXPECT_NEAR(max_abs_error(out, r1), 0.25, 1e-6);
  (void)aout;
}

// ---------------------------------------------------------------------------
// A second implementation, written differently: C-order copies, the full score
// matrix, masks broadcast by explicit index arithmetic, weights multiplied by 0
// where masked (inputs are finite here, so that is equivalent).

struct Dense {
  std::vector<double> out, lse;
};

Dense dense_attention(int64_t B, int64_t H, int64_t Hkv, int64_t Lq, int64_t Lk, int64_t D,
                      int64_t Dv, const std::vector<float>& q, const std::vector<float>& k,
                      const std::vector<float>& v, double scale, int causal,
                      const std::vector<int64_t>* lens_per_query,  // [B*Lq] or null
                      const std::vector<int64_t>& mask_shape4,     // padded to 4, or empty
                      const std::vector<float>* additive, const std::vector<uint8_t>* keep) {
  Dense r;
  r.out.assign(static_cast<size_t>(B * H * Lq * Dv), 0.0);
  r.lse.assign(static_cast<size_t>(B * H * Lq), -kInf);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / Hkv);
      std::vector<double> s(static_cast<size_t>(Lq * Lk));
      std::vector<char> on(static_cast<size_t>(Lq * Lk), 1);
      for (int64_t i = 0; i < Lq; ++i)
        for (int64_t j = 0; j < Lk; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < D; ++c)
            dot += double(q[static_cast<size_t>(((b * H + h) * Lq + i) * D + c)]) *
                   double(k[static_cast<size_t>(((b * Hkv + g) * Lk + j) * D + c)]);
          double x = dot * scale;
          char& o = on[static_cast<size_t>(i * Lk + j)];
          if (causal == MHA_CAUSAL_TOP_LEFT && j > i) o = 0;
          if (causal == MHA_CAUSAL_BOTTOM_RIGHT && j > i + (Lk - Lq)) o = 0;
          if (lens_per_query && j >= (*lens_per_query)[static_cast<size_t>(b * Lq + i)]) o = 0;
          if (!mask_shape4.empty()) {
            const int64_t idx[4] = {b, h, i, j};
            int64_t flat = 0;
            for (int a = 0; a < 4; ++a)
              flat = flat * mask_shape4[static_cast<size_t>(a)] +
                     (mask_shape4[static_cast<size_t>(a)] == 1 ? 0 : idx[a]);
            if (keep && (*keep)[static_cast<size_t>(flat)] == 0) o = 0;
            if (additive) {
              const float m = (*additive)[static_cast<size_t>(flat)];
              if (std::isinf(m))
                o = 0;
              else
                x += double(m);
            }
          }
          s[static_cast<size_t>(i * Lk + j)] = x;
        }
      for (int64_t i = 0; i < Lq; ++i) {
        double mx = -kInf;
        for (int64_t j = 0; j < Lk; ++j)
          if (on[static_cast<size_t>(i * Lk + j)])
            mx = std::max(mx, s[static_cast<size_t>(i * Lk + j)]);
        if (mx == -kInf) continue;
        double sum = 0;
        std::vector<double> w(static_cast<size_t>(Lk));
        for (int64_t j = 0; j < Lk; ++j) {
          w[static_cast<size_t>(j)] = on[static_cast<size_t>(i * Lk + j)]
                                          ? std::exp(s[static_cast<size_t>(i * Lk + j)] - mx)
                                          : 0.0;
          sum += w[static_cast<size_t>(j)];
        }
        r.lse[static_cast<size_t>((b * H + h) * Lq + i)] = mx + std::log(sum);
        for (int64_t c = 0; c < Dv; ++c) {
          double a = 0;
          for (int64_t j = 0; j < Lk; ++j)
            a += w[static_cast<size_t>(j)] / sum *
                 double(v[static_cast<size_t>(((b * Hkv + g) * Lk + j) * Dv + c)]);
          r.out[static_cast<size_t>(((b * H + h) * Lq + i) * Dv + c)] = a;
        }
      }
    }
  return r;
}

TEST(Reference, AgreesWithDenseImplementationOnRandomProblems) {
  Rng rng(2024);
  const std::vector<std::vector<int64_t>> mask_shapes = {
      {}, {-1, -1}, {-2, 1, -1, -1}, {1, -3, -1, -1}, {-2, -3, -1, -1}, {-2, 1, 1, -1}};
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t B = rng.integer(1, 3), Hkv = rng.integer(1, 2), H = Hkv * rng.integer(1, 3);
    const int64_t Lq = rng.integer(1, 7), Lk = rng.integer(1, 7), D = rng.integer(1, 6),
                  Dv = rng.integer(1, 5);
    const int causal = static_cast<int>(rng.integer(0, 2));
    const bool use_lens = rng.chance(0.5), per_query = rng.chance(0.5), i64 = rng.chance(0.5);
    const auto& mshape = mask_shapes[static_cast<size_t>(trial) % mask_shapes.size()];
    const bool bool_mask = rng.chance(0.5);
    const double scale = rng.chance(0.5) ? 1.0 / std::sqrt(double(D)) : double(rng.uniform(-2, 2));
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " B=" << B << " H=" << H
                                      << " Hkv=" << Hkv << " Lq=" << Lq << " Lk=" << Lk);

    std::vector<float> q(static_cast<size_t>(B * H * Lq * D)),
        k(static_cast<size_t>(B * Hkv * Lk * D)), v(static_cast<size_t>(B * Hkv * Lk * Dv));
    for (auto* buf : {&q, &k, &v})
      for (auto& x : *buf) x = rng.uniform();
    mha_attention_params p = default_params();
    p.causal = causal;
    if (scale != 1.0 / std::sqrt(double(D))) {
      p.has_scale = 1;
      p.scale = static_cast<float>(scale);
    }
    // valid lengths, expanded per query for the dense version
    std::vector<int64_t> lens_src(static_cast<size_t>(per_query ? B * Lq : B));
    for (auto& x : lens_src) x = rng.integer(0, Lk);
    std::vector<int32_t> lens32(lens_src.begin(), lens_src.end());
    std::vector<int64_t> expanded(static_cast<size_t>(B * Lq));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < Lq; ++i)
        expanded[static_cast<size_t>(b * Lq + i)] =
            lens_src[static_cast<size_t>(per_query ? b * Lq + i : b)];
    mha_tensor lens_t{};
    if (use_lens) {
      lens_t =
          describe(i64 ? static_cast<void*>(lens_src.data()) : static_cast<void*>(lens32.data()),
                   i64 ? MHA_DTYPE_I64 : MHA_DTYPE_I32,
                   per_query ? std::vector<int64_t>{B, Lq} : std::vector<int64_t>{B});
      p.valid_lens = &lens_t;
    }
    // mask: -1 = Lk, -2 = B, -3 = H (rank 2 shapes use the last two symbols)
    std::vector<int64_t> shape;
    for (int64_t s : mshape)
      shape.push_back(s == -1   ? (shape.size() + 1 == mshape.size() ? Lk : Lq)
                      : s == -2 ? B
                      : s == -3 ? H
                                : s);
    std::vector<int64_t> shape4;
    if (!shape.empty()) {
      shape4.assign(4 - shape.size(), 1);
      shape4.insert(shape4.end(), shape.begin(), shape.end());
    }
    const int64_t mcount = shape.empty() ? 0 : element_count(shape);
    std::vector<uint8_t> keep(static_cast<size_t>(mcount));
    std::vector<float> add(static_cast<size_t>(mcount));
    for (auto& x : keep) x = rng.chance(0.75) ? static_cast<uint8_t>(rng.integer(1, 255)) : 0;
    for (auto& x : add)
      x = rng.chance(0.2) ? -std::numeric_limits<float>::infinity() : rng.uniform(-3, 3);
    mha_tensor mask_t{};
    if (!shape.empty()) {
      mask_t = bool_mask ? describe(keep.data(), MHA_DTYPE_BOOL, shape)
                         : describe(add.data(), MHA_DTYPE_F32, shape);
      p.mask = &mask_t;
    }

    const Reference ref = reference_attention(f32(q, {B, H, Lq, D}), f32(k, {B, Hkv, Lk, D}),
                                              f32(v, {B, Hkv, Lk, Dv}), &p);
    const Dense dense = dense_attention(
        B, H, Hkv, Lq, Lk, D, Dv, q, k, v, p.has_scale ? double(p.scale) : scale, causal,
        use_lens ? &expanded : nullptr, shape4, !shape.empty() && !bool_mask ? &add : nullptr,
        !shape.empty() && bool_mask ? &keep : nullptr);
    ASSERT_EQ(ref.out.size(), dense.out.size());
    for (size_t i = 0; i < ref.out.size(); ++i) ASSERT_NEAR(ref.out[i], dense.out[i], 1e-12) << i;
    for (size_t i = 0; i < ref.lse.size(); ++i) {
      if (std::isinf(dense.lse[i])) {
        ASSERT_EQ(ref.lse[i], dense.lse[i]) << i;
      } else {
        ASSERT_NEAR(ref.lse[i], dense.lse[i], 1e-12) << i;
      }
    }
  }
}

TEST(Reference, HandlesLongRowsWithoutAScoreMatrix) {
  // Lq = 2, Lk = 65536, D = 1: the row buffer is Lk doubles, not Lq x Lk.
  const int64_t lk = 65536;
  std::vector<float> q = {0.0f, 0.0f}, k(static_cast<size_t>(lk), 1.0f), v(static_cast<size_t>(lk));
  for (int64_t j = 0; j < lk; ++j) v[static_cast<size_t>(j)] = static_cast<float>(j % 2);
  const Reference ref = reference_attention(f32(q, {1, 1, 2, 1}), f32(k, {1, 1, lk, 1}),
                                            f32(v, {1, 1, lk, 1}), nullptr);
  EXPECT_NEAR(ref.out[0], 0.5, 1e-12);
  EXPECT_NEAR(ref.lse[1], std::log(double(lk)), 1e-12);
}

}  // namespace
}  // namespace mha_test
