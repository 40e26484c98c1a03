// Numerics at the edges, on every backend this CPU can run, against the
// float64 reference within docs/decisions.md's tolerance (mha_test::tolerance):
// logits near ±1e4, scales from 1e-3 to 1e3, subnormal inputs, and (label
// "heavy") sequences of 65536.  Also: loading and running the plugins leaves
// the caller's floating-point environment alone (no flush-to-zero).
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cctype>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "backend_param.h"
#include "reference.h"
#include "test_util.h"

namespace mha_test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Problem {
  int64_t B = 1, H = 1, Hkv = 1, Lq = 1, Lk = 1, D = 16, Dv = 16;
  std::vector<float> q, k, v;
  bool has_scale = false;
  float scale = 1.0f;
  int32_t causal = MHA_CAUSAL_NONE;
  std::vector<float> mask;  // f32 [Lq, Lk] when not empty
  std::vector<int32_t> lens;
  std::string label;

  Problem(int64_t b, int64_t h, int64_t hkv, int64_t lq, int64_t lk, int64_t d, uint64_t seed,
          float q_amp = 1.0f, float k_amp = 1.0f, float v_amp = 1.0f)
      : B(b), H(h), Hkv(hkv), Lq(lq), Lk(lk), D(d), Dv(d) {
    Rng rng(seed);
    q.resize(static_cast<size_t>(B * H * Lq * D));
    k.resize(static_cast<size_t>(B * Hkv * Lk * D));
    v.resize(static_cast<size_t>(B * Hkv * Lk * Dv));
    for (float& x : q) x = q_amp * rng.uniform();
    for (float& x : k) x = k_amp * rng.uniform();
    for (float& x : v) x = v_amp * rng.uniform();
  }
  std::string describe() const {
    std::ostringstream os;
    os << label << " [B=" << B << " H=" << H << " Hkv=" << Hkv << " Lq=" << Lq << " Lk=" << Lk
       << " D=" << D;
    if (has_scale) os << " scale=" << scale;
    os << " causal=" << causal << (mask.empty() ? "" : " additive-mask")
       << (lens.empty() ? "" : " valid_lens") << "]";
    return os.str();
  }
};

struct Outcome {
  bool ok = false;
  double error = 0, tol = 0;
  std::vector<float> out;
  Reference ref;
};

// Runs p on the selected backend and checks out and lse against the reference.
// subnormal_bound: outputs are subnormal, so use a bound relative to them.
Outcome run(const Problem& p, bool subnormal_bound = false) {
  SCOPED_TRACE(p.describe());
  Outcome o;
  std::vector<float> q = p.q, k = p.k, v = p.v, mask = p.mask;
  std::vector<int32_t> lens = p.lens;
  mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {p.B, p.H, p.Lq, p.D});
  mha_tensor tk = describe(k.data(), MHA_DTYPE_F32, {p.B, p.Hkv, p.Lk, p.D});
  mha_tensor tv = describe(v.data(), MHA_DTYPE_F32, {p.B, p.Hkv, p.Lk, p.Dv});
  Arena out_arena(p.B * p.H * p.Lq * p.Dv), lse_arena(p.B * p.H * p.Lq);
  mha_tensor tout = describe(out_arena.base(), MHA_DTYPE_F32, {p.B, p.H, p.Lq, p.Dv});
  mha_tensor tlse = describe(lse_arena.base(), MHA_DTYPE_F32, {p.B, p.H, p.Lq});
  mha_tensor tmask{}, tlens{};
  mha_attention_params params;
  mha_attention_params_init(&params);
  params.causal = p.causal;
  if (p.has_scale) params.has_scale = 1, params.scale = p.scale;
  if (!mask.empty()) {
    tmask = describe(mask.data(), MHA_DTYPE_F32, {p.Lq, p.Lk});
    params.mask = &tmask;
  }
  if (!lens.empty()) {
    tlens = describe(lens.data(), MHA_DTYPE_I32, {p.B});
    params.valid_lens = &tlens;
  }
  params.lse = &tlse;
  o.ref = reference_attention(tq, tk, tv, &params);
  const std::vector<float> out_before = out_arena.all();
  const mha_status status = mha_attention(&tq, &tk, &tv, &tout, &params);
  EXPECT_EQ(status, MHA_OK) << mha_last_error();
  if (status != MHA_OK) return o;
  o.error = max_abs_error(tout, o.ref);
  if (subnormal_bound) {
    // Outputs around 1e-40: 1e-5 absolute would accept anything, zeros
    // included.  Allow 1e-5 relative to the largest output plus two quanta of
    // the subnormal grid per key (each product p * v rounds to it).
    o.tol = 1e-5 * o.ref.max_abs_out + 2.0 * static_cast<double>(p.Lk) * std::ldexp(1.0, -149);
  } else {
    o.tol = tolerance(o.ref);
  }
  EXPECT_LE(o.error, o.tol) << "max |out - ref| = " << o.error
                            << " (max |ref| = " << o.ref.max_abs_out
                            << ", max |logit| = " << o.ref.max_abs_logit << ")";
  // lse: the same bound as the attention suite.
  int64_t bad_lse = 0;
  for (size_t row = 0; row < o.ref.lse.size(); ++row) {
    const double want = o.ref.lse[row], got = static_cast<double>(lse_arena.base()[row]);
    const double tol = lse_tolerance(o.ref, want);
    if (want == -std::numeric_limits<double>::infinity() ? got != want
                                                         : !(std::fabs(got - want) <= tol)) {
      if (bad_lse++ == 0) {
        ADD_FAILURE() << "lse row " << row << " = " << got << ", reference " << want;
      }
    }
  }
  EXPECT_EQ(bad_lse, 0);
  EXPECT_EQ(out_arena.changed_outside(tout, out_before), 0) << "written outside out";
  o.ok = true;
  o.out.assign(out_arena.base(), out_arena.base() + p.B * p.H * p.Lq * p.Dv);
  return o;
}

class EdgeNumerics : public BackendTest {};

// The shapes every case runs in: prefill (query lanes), decode (heads sharing
// a KV head), and split-KV (a long key range merged by LSE).
struct Geometry {
  const char* name;
  int64_t B, H, Hkv, Lq, Lk, D;
};
constexpr Geometry kGeometries[] = {
    {"prefill", 1, 2, 1, 19, 45, 64},
    {"decode", 2, 4, 2, 1, 70, 64},
    {"split-kv", 1, 2, 1, 2, 2500, 32},
};

// ------------------------------------------------------------------ large logits

TEST_P(EdgeNumerics, LogitsNearTenThousand) {
  uint64_t seed = 1;
  for (const auto& g : kGeometries) {
    // |q|, |k| up to 100 per element with scale 1/sqrt(D): logits up to ~1e4.
    for (const float amp : {60.0f, 100.0f}) {
      Problem p(g.B, g.H, g.Hkv, g.Lq, g.Lk, g.D, ++seed, amp, amp);
      p.label = std::string(g.name) + " q, k amplitude " + std::to_string(amp);
      const Outcome o = run(p);
      EXPECT_GT(o.ref.max_abs_logit, 1000.0) << p.describe() << ": the logits are not large";
    }
    // Scale pushing every logit to exactly ±1e4 (q = k = 1): uniform weights
    // even though each exp argument alone would overflow or underflow.
    for (const float sign : {1.0f, -1.0f}) {
      Problem p(g.B, g.H, g.Hkv, g.Lq, g.Lk, g.D, ++seed);
      std::fill(p.q.begin(), p.q.end(), 1.0f);
      std::fill(p.k.begin(), p.k.end(), 1.0f);
      p.has_scale = true, p.scale = sign * 1e4f / static_cast<float>(g.D);
      p.label = std::string(g.name) + " every logit " + (sign > 0 ? "+1e4" : "-1e4");
      run(p);
    }
    // One key 1e4 above the rest (through the mask): its weight is 1, the
    // others' exactly 0 in fp32.
    {
      Problem p(g.B, g.H, g.Hkv, g.Lq, g.Lk, g.D, ++seed);
      p.mask.assign(static_cast<size_t>(g.Lq * g.Lk), -1e4f);
      for (int64_t i = 0; i < g.Lq; ++i)
        p.mask[static_cast<size_t>(i * g.Lk + (i * 7) % g.Lk)] = 1e4f;
      p.label = std::string(g.name) + " one key at +1e4, the rest at -1e4";
      run(p);
    }
    // Additive mask of ±1e4 on top of moderate scores, random.
    {
      Problem p(g.B, g.H, g.Hkv, g.Lq, g.Lk, g.D, ++seed, 3.0f, 3.0f);
      Rng rng(seed);
      p.mask.resize(static_cast<size_t>(g.Lq * g.Lk));
      for (float& x : p.mask) x = rng.chance(0.5) ? 1e4f : -1e4f + rng.uniform(-5.0f, 5.0f);
      p.label = std::string(g.name) + " additive mask +-1e4";
      run(p);
    }
  }
}

TEST_P(EdgeNumerics, LargeLogitsWithCausalAndValidLengths) {
  uint64_t seed = 100;
  for (const auto& g : kGeometries) {
    for (const int32_t causal : {MHA_CAUSAL_TOP_LEFT, MHA_CAUSAL_BOTTOM_RIGHT}) {
      Problem p(g.B, g.H, g.Hkv, g.Lq, g.Lk, g.D, ++seed, 100.0f, 100.0f);
      p.causal = causal;
      p.lens.assign(static_cast<size_t>(g.B), static_cast<int32_t>(g.Lk - g.Lk / 3));
      p.label = std::string(g.name) + " logits ~1e4, causal, valid_lens";
      run(p);
    }
  }
}

// ------------------------------------------------------------------ scales

TEST_P(EdgeNumerics, ScalesFromOneThousandthToOneThousand) {
  uint64_t seed = 200;
  for (const auto& g : kGeometries) {
    for (const float scale :
         {1e-3f, 3e-3f, 1e-2f, 0.1f, 1.0f, 10.0f, 100.0f, 1e3f, -1e-3f, -1.0f, -1e3f}) {
      Problem p(g.B, g.H, g.Hkv, g.Lq, g.Lk, g.D, ++seed);
      p.has_scale = true, p.scale = scale;
      p.label = std::string(g.name) + " scale " + std::to_string(scale);
      run(p);
    }
  }
}

TEST_P(EdgeNumerics, TinyScaleMakesWeightsUniform) {
  // scale 1e-3 with small logits: all weights nearly equal; out ~ mean of v.
  Problem p(1, 1, 1, 4, 300, 16, 7);
  p.has_scale = true, p.scale = 1e-3f;
  p.label = "tiny scale";
  const Outcome o = run(p);
  ASSERT_TRUE(o.ok);
  for (int64_t c = 0; c < p.Dv; ++c) {
    double mean = 0;
    for (int64_t j = 0; j < p.Lk; ++j)
      mean += static_cast<double>(p.v[static_cast<size_t>(j * p.Dv + c)]);
    mean /= static_cast<double>(p.Lk);
    EXPECT_NEAR(static_cast<double>(o.out[static_cast<size_t>(c)]), mean, 2e-3) << "feature " << c;
  }
}

// ------------------------------------------------------------------ subnormals

TEST_P(EdgeNumerics, SubnormalQueriesAndKeys) {
  // Logits around 1e-76 are 0 in fp32: uniform weights, no NaN from 0/0.
  uint64_t seed = 300;
  for (const auto& g : kGeometries) {
    Problem p(g.B, g.H, g.Hkv, g.Lq, g.Lk, g.D, ++seed, 1e-39f, 1e-39f);
    p.label = std::string(g.name) + " subnormal q and k";
    run(p);
    // A subnormal q against a huge k and a large scale: logits of order 0.1,
    // which a flush-to-zero of q would lose.
    Problem r(g.B, g.H, g.Hkv, g.Lq, g.Lk, g.D, ++seed, 1e-39f, 1e35f);
    r.has_scale = true, r.scale = 1e3f;
    r.label = std::string(g.name) + " subnormal q, k ~1e35";
    const Outcome o = run(r);
    EXPECT_GT(o.ref.max_abs_logit, 1e-2) << "the logits should not vanish";
  }
}

TEST_P(EdgeNumerics, SubnormalValues) {
  uint64_t seed = 400;
  for (const auto& g : kGeometries) {
    Problem p(g.B, g.H, g.Hkv, g.Lq, g.Lk, g.D, ++seed, 1.0f, 1.0f, 1e-39f);
    p.label = std::string(g.name) + " subnormal v";
    const Outcome o = run(p, /*subnormal_bound=*/true);
    EXPECT_GT(o.ref.max_abs_out, 0.0);
    ASSERT_TRUE(o.ok);
    int64_t flushed = 0;
    for (const float x : o.out) flushed += x == 0.0f;
    EXPECT_LT(flushed, static_cast<int64_t>(o.out.size()) / 2)
        << "most outputs are 0: subnormals flushed to zero?";
  }
}

TEST_P(EdgeNumerics, SubnormalsDoNotChangeTheCallersFloatingPointMode) {
  Problem p(1, 2, 1, 5, 40, 16, 500, 1e-39f, 1.0f, 1e-39f);
  p.label = "subnormal q, v";
  run(p, true);
  volatile float tiny = FLT_MIN / 4.0f;  // subnormal
  volatile float half = tiny * 0.5f;
  EXPECT_NE(half, 0.0f) << "subnormal arithmetic flushes to zero after calling mha (FTZ set)";
  EXPECT_NE(tiny + 0.0f, 0.0f) << "subnormal inputs read as zero after calling mha (DAZ set)";
#if defined(__x86_64__)
  const unsigned csr = _mm_getcsr();
  EXPECT_EQ(csr & 0x8040u, 0u) << "MXCSR = 0x" << std::hex << csr << ": FTZ or DAZ set";
#endif
}

// ------------------------------------------------------------------ long sequences (heavy)

class EdgeNumericsHeavy : public EdgeNumerics {};

TEST_P(EdgeNumericsHeavy, OneQueryOver65536Keys) {
  for (const int32_t causal : {MHA_CAUSAL_NONE, MHA_CAUSAL_BOTTOM_RIGHT}) {
    Problem p(1, 4, 1, 1, 65536, 64, 600);
    p.causal = causal;
    p.label = "one query, 65536 keys";
    run(p);
  }
  Problem p(1, 2, 2, 3, 65536, 64, 601, 30.0f, 30.0f);  // large logits over a long row
  p.label = "3 queries, 65536 keys, logits ~1e3";
  run(p);
  Problem m(1, 1, 1, 1, 65536, 32, 602);
  m.lens = {65535};
  m.mask.assign(65536, 0.0f);
  for (int64_t j = 1000; j < 60000; ++j) m.mask[static_cast<size_t>(j)] = -kInf;
  m.label = "65536 keys, most masked";
  run(m);
}

TEST_P(EdgeNumericsHeavy, Of65536QueriesOverFewKeys) {
  for (const int64_t lk : {1, 3, 17}) {
    Problem p(1, 1, 1, 65536, lk, 16, 700 + static_cast<uint64_t>(lk));
    p.label = "65536 queries";
    run(p);
    p.causal = MHA_CAUSAL_BOTTOM_RIGHT;  // all but the last lk rows see no key
    run(p);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, EdgeNumerics, ::testing::ValuesIn(backend_names()),
                         backend_param_name);
INSTANTIATE_TEST_SUITE_P(Backends, EdgeNumericsHeavy, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

}  // namespace
}  // namespace mha_test
