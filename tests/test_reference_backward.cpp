// Self-test of the float64 backward reference: its analytic gradients against
// central finite differences of the float64 forward reference, every option
// alone and combined (dropout excepted: the forward reference does not model
// it; test_backward checks dropout's gradient against this reference given
// the same mask).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "reference.h"
#include "reference_backward.h"
#include "test_util.h"

namespace mha_test {
namespace {

struct FdCase {
  const char* what;
  int64_t B = 1, H = 2, Hkv = 1, Lq = 5, Lk = 7, D = 4, Dv = 3;
  int32_t causal = MHA_CAUSAL_NONE;
  int64_t left = -1, right = -1;
  bool bool_mask = false, additive_mask = false, lens = false;
  float softcap = 0.0f;
  bool alibi = false, sinks = false;
};

// L = Σ dout ∘ out, in float64, with `x` (an fp32 input) moved by h.
double loss(const mha_tensor& q, const mha_tensor& k, const mha_tensor& v,
            const std::vector<float>& dout, const mha_attention_params& p) {
  const Reference ref = reference_attention(q, k, v, &p);
  double sum = 0;
  for (size_t e = 0; e < ref.out.size(); ++e) sum += static_cast<double>(dout[e]) * ref.out[e];
  return sum;
}

void check_against_finite_differences(const FdCase& c) {
  SCOPED_TRACE(c.what);
  Rng rng(11);
  std::vector<float> q(static_cast<size_t>(c.B * c.H * c.Lq * c.D));
  std::vector<float> k(static_cast<size_t>(c.B * c.Hkv * c.Lk * c.D));
  std::vector<float> v(static_cast<size_t>(c.B * c.Hkv * c.Lk * c.Dv));
  std::vector<float> dout(static_cast<size_t>(c.B * c.H * c.Lq * c.Dv));
  for (auto* x : {&q, &k, &v, &dout}) {
    for (float& f : *x) f = rng.uniform(-1.0f, 1.0f);
  }
  mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {c.B, c.H, c.Lq, c.D});
  mha_tensor tk = describe(k.data(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk, c.D});
  mha_tensor tv = describe(v.data(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk, c.Dv});
  mha_tensor tdout = describe(dout.data(), MHA_DTYPE_F32, {c.B, c.H, c.Lq, c.Dv});

  mha_attention_params p{};
  p.struct_size = sizeof p;
  p.causal = c.causal;
  p.window_left = c.left;
  p.window_right = c.right;
  p.softcap = c.softcap;
  std::vector<uint8_t> mask_bool(static_cast<size_t>(c.Lq * c.Lk));
  std::vector<float> mask_add(static_cast<size_t>(c.Lq * c.Lk)), slopes(static_cast<size_t>(c.H)),
      sinks(static_cast<size_t>(c.H));
  std::vector<int32_t> lens(static_cast<size_t>(c.B));
  mha_tensor tmask{}, tlens{}, tslopes{}, tsinks{};
  if (c.bool_mask) {
    for (auto& m : mask_bool) m = rng.chance(0.7) ? 1 : 0;
    tmask = describe(mask_bool.data(), MHA_DTYPE_BOOL, {c.Lq, c.Lk});
    p.mask = &tmask;
  }
  if (c.additive_mask) {
    for (auto& m : mask_add) m = rng.chance(0.2) ? -INFINITY : rng.uniform(-1.0f, 1.0f);
    tmask = describe(mask_add.data(), MHA_DTYPE_F32, {c.Lq, c.Lk});
    p.mask = &tmask;
  }
  if (c.lens) {
    for (size_t b = 0; b < lens.size(); ++b) lens[b] = static_cast<int32_t>(b == 0 ? 3 : c.Lk - 1);
    tlens = describe(lens.data(), MHA_DTYPE_I32, {c.B});
    p.valid_lens = &tlens;
  }
  if (c.alibi) {
    for (auto& s : slopes) s = rng.uniform(0.1f, 0.5f);
    tslopes = describe(slopes.data(), MHA_DTYPE_F32, {c.H});
    p.alibi_slopes = &tslopes;
  }
  if (c.sinks) {
    for (auto& s : sinks) s = rng.uniform(-0.5f, 1.0f);
    tsinks = describe(sinks.data(), MHA_DTYPE_F32, {c.H});
    p.sinks = &tsinks;
  }

  const BackwardReference ref = reference_backward(tq, tk, tv, tdout, &p);
  // Central differences with a step exact in fp32 for |x| < 1: error O(h²).
  const float h = 1.0f / 1024.0f;
  const auto check = [&](std::vector<float>& x, const std::vector<double>& grad, const char* name) {
    for (size_t e = 0; e < x.size(); ++e) {
      const float saved = x[e];
      x[e] = saved + h;
      const double up = loss(tq, tk, tv, dout, p);
      x[e] = saved - h;
      const double down = loss(tq, tk, tv, dout, p);
      x[e] = saved;
      const double fd = (up - down) / (2.0 * static_cast<double>(h));
      EXPECT_NEAR(grad[e], fd, 1e-5 + 1e-4 * std::fabs(fd)) << name << "[" << e << "]";
    }
  };
  check(q, ref.dq, "dq");
  check(k, ref.dk, "dk");
  check(v, ref.dv, "dv");
  if (c.sinks) check(sinks, ref.dsinks, "dsinks");
}

TEST(ReferenceBackward, MatchesFiniteDifferences) {
  const FdCase cases[] = {
      {"plain"},
      {"GQA, Lq != Lk, Dv != D", 2, 4, 2, 6, 9, 5, 3},
      {"causal top-left", 1, 2, 1, 7, 7, 4, 3, MHA_CAUSAL_TOP_LEFT},
      {"causal bottom-right", 1, 2, 1, 4, 8, 4, 3, MHA_CAUSAL_BOTTOM_RIGHT},
      {"window", 1, 2, 2, 8, 8, 4, 3, MHA_CAUSAL_NONE, 2, 1},
      {"bool mask", 1, 2, 1, 5, 7, 4, 3, MHA_CAUSAL_NONE, -1, -1, true},
      {"additive mask", 1, 2, 1, 5, 7, 4, 3, MHA_CAUSAL_NONE, -1, -1, false, true},
      {"valid lengths", 2, 2, 1, 5, 7, 4, 3, MHA_CAUSAL_NONE, -1, -1, false, false, true},
      {"softcap", 1, 2, 1, 5, 7, 4, 3, MHA_CAUSAL_NONE, -1, -1, false, false, false, 0.7f},
      {"alibi", 1, 2, 1, 5, 7, 4, 3, MHA_CAUSAL_BOTTOM_RIGHT, -1, -1, false, false, false, 0.0f,
       true},
      {"sinks", 1, 2, 1, 5, 7, 4, 3, MHA_CAUSAL_NONE, -1, -1, false, false, true, 0.0f, false,
       true},
      {"all", 2, 4, 2, 6, 9, 5, 3, MHA_CAUSAL_BOTTOM_RIGHT, 4, -1, false, true, true, 1.5f, true,
       true},
  };
  for (const FdCase& c : cases) check_against_finite_differences(c);
}

}  // namespace
}  // namespace mha_test
