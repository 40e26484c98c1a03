// The bf16 dot-product path: avx512bf16 runs bf16 Q with bf16 K and V (the
// prefill layout) on vdpbf16ps, with exact products summed in fp32, the scale
// applied to the fp32 score and P rounded to bf16 once for P·V.  Checked on
// every backend (the others widen to fp32 and keep the fp32 tolerance):
//   - against the float64 reference of the same bf16 values, within
//     tolerance_for: on avx512bf16 the fp32 tolerance plus 4 · 2^-9 · max|V|
//     (and one rounding of a half output); LSE within 1e-5;
//   - a case that fails if Q is rounded to bf16 after scaling (logits ~30);
//   - decode (few queries) keeps widening to fp32: the fp32 tolerance;
//   - masks, causal, GQA, odd D and key counts, strided rows, non-finite data;
// and, where avx512 and avx512bf16 both run: every call that is not bf16 Q
// with bf16 K/V in the prefill layout is bit-identical to avx512, dropout on
// the bf16 path agrees with avx512's within the P-rounding allowance, and
// MHA_VERBOSE=2 names the path of each call (a ctest entry's regular
// expression checks the lines).
//
// Whether avx512bf16 takes the path is the runtime's choice from the CPU
// (runtime/bf16_dot.cpp: not on Intel's, where vdpbf16ps runs at half the
// FMA's rate).  ctest runs this suite with MHA_BF16_DOT=1, so that the path
// is tested on every CPU that has the instructions, and the choice's own test
// (Bf16DotAgainstAvx512.Bf16CallsFollowTheRuntimesChoice) both ways.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "backend_param.h"
#include "checked_call.h"
#include "reference.h"
#include "small_call.h"
#include "test_util.h"

namespace mha_test {
namespace {

// A float tensor of [b, h, l, d] in `layout`, rows padded by `pad` elements
// and features `step` elements apart, rounded to `dtype`.
struct Tensor {
  std::vector<float> values;
  mha_tensor floats{};
  std::vector<TypedCopy> typed;  // one element: the copy of dtype

  Tensor(Layout layout, int64_t b, int64_t h, int64_t l, int64_t d, int64_t pad, int64_t step,
         int32_t dtype) {
    Shape4 s = make_shape(layout, b, h, l, d * step, pad);
    s.shape[3] = d;
    s.strides[3] = step;
    values.assign(static_cast<size_t>(s.extent), 0.0f);
    floats = describe(values.data(), MHA_DTYPE_F32, {b, h, l, d},
                      {s.strides[0], s.strides[1], s.strides[2], s.strides[3]});
    typed.emplace_back(floats, dtype);
  }
  // Rounds the float values into the typed copy again (after they changed).
  void refresh() {
    const int32_t dtype = typed[0].get().dtype;
    typed.clear();
    typed.emplace_back(floats, dtype);
  }
  mha_tensor& get() { return typed[0].get(); }
};

struct DotCase {
  const char* what = "";
  int64_t B = 1, H = 4, Hkv = 2, Lq = 100, Lk = 300, D = 64, Dv = 64;
  Layout layout = Layout::BHLD;
  int64_t pad = 0, step = 1;  // rows padded, features apart (K and V: the packing paths)
  int32_t causal = MHA_CAUSAL_NONE;
  int mask = 0;  // 0 none, 1 bool [Lq, Lk], 2 additive bf16 [B, 1, Lq, Lk] with -inf
  bool lens = false;
  int32_t out_dtype = MHA_DTYPE_F32;
  float qk_amplitude = 2.0f;
  uint64_t seed = 1;
};

struct Outcome {
  double error = 0, tolerance = 0;
};

// Runs the case in bf16 on the selected backend; checks the LSE and returns
// the output's error with the tolerance the backend must meet.
Outcome run_dot_case(const DotCase& c) {
  SCOPED_TRACE(std::string(c.what) + ": B" + std::to_string(c.B) + " H" + std::to_string(c.H) +
               "/" + std::to_string(c.Hkv) + " Lq" + std::to_string(c.Lq) + " Lk" +
               std::to_string(c.Lk) + " D" + std::to_string(c.D) + "/" + std::to_string(c.Dv));
  Rng rng(c.seed);
  Tensor q(c.layout, c.B, c.H, c.Lq, c.D, c.pad, 1, MHA_DTYPE_BF16);
  Tensor k(c.layout, c.B, c.Hkv, c.Lk, c.D, c.pad, c.step, MHA_DTYPE_BF16);
  Tensor v(c.layout, c.B, c.Hkv, c.Lk, c.Dv, c.pad, c.step, MHA_DTYPE_BF16);
  fill_uniform(q.floats, rng, -c.qk_amplitude, c.qk_amplitude);
  fill_uniform(k.floats, rng, -c.qk_amplitude, c.qk_amplitude);
  fill_uniform(v.floats, rng);
  q.refresh();
  k.refresh();
  v.refresh();

  CallOptions o;
  o.causal = c.causal;
  o.mask = c.mask;
  o.mask_dtype = MHA_DTYPE_BF16;
  o.lens = c.lens;
  o.out_dtype = c.out_dtype;
  CheckedCall call(rng, c.B, c.H, c.Lq, c.Lk, c.Dv, o);
  Outcome outcome;
  EXPECT_EQ(mha_attention(&q.get(), &k.get(), &v.get(), &call.out, &call.params), MHA_OK)
      << mha_last_error();
  const Reference ref = reference_attention(q.get(), k.get(), v.get(), &call.params);
  outcome.error = max_abs_error(call.out, ref);
  outcome.tolerance =
      tolerance_for(mha_selected_backend(), MHA_DTYPE_BF16, MHA_DTYPE_BF16, ref, c.out_dtype);
  EXPECT_LE(outcome.error, outcome.tolerance);
  call.expect_lse_matches(ref);
  return outcome;
}

class Bf16Dot : public BackendTest {};

// The prefill layout over the shapes and options the path must handle.
TEST_P(Bf16Dot, ShapesMasksAndLayoutsWithinTolerance) {
  std::vector<DotCase> cases(17);
  cases[0].what = "several key tiles";
  cases[1].what = "GQA, odd key count, Dv below a register pair", cases[1].H = 6, cases[1].Hkv = 2,
  cases[1].Lq = 70, cases[1].Lk = 333, cases[1].D = 40, cases[1].Dv = 24;
  cases[2].what = "odd D and Dv", cases[2].Lq = 33, cases[2].Lk = 129, cases[2].D = 37,
  cases[2].Dv = 51;
  cases[3].what = "D = Dv = 1", cases[3].Lq = 17, cases[3].Lk = 5, cases[3].D = 1, cases[3].Dv = 1;
  cases[4].what = "D = 128, causal top-left", cases[4].H = 2, cases[4].Hkv = 1, cases[4].Lq = 400,
  cases[4].Lk = 400, cases[4].D = 128, cases[4].Dv = 128, cases[4].causal = MHA_CAUSAL_TOP_LEFT;
  cases[5].what = "causal bottom-right", cases[5].Lq = 50, cases[5].Lk = 300,
  cases[5].causal = MHA_CAUSAL_BOTTOM_RIGHT;
  cases[6].what = "bool mask, BLHD", cases[6].mask = 1, cases[6].layout = Layout::BLHD;
  cases[7].what = "additive bf16 mask with -inf, valid lengths", cases[7].B = 2, cases[7].mask = 2,
  cases[7].lens = true;
  cases[8].what = "rows at odd element offsets (pairs unaligned)", cases[8].layout = Layout::BLHD,
  cases[8].pad = 3, cases[8].D = 48, cases[8].Dv = 40;
  cases[9].what = "K and V features two apart (packed)", cases[9].step = 2, cases[9].D = 34,
  cases[9].Dv = 33;
  cases[10].what = "bf16 output", cases[10].out_dtype = MHA_DTYPE_BF16, cases[10].Lk = 97;
  cases[11].what = "few queries, short keys (query lanes)", cases[11].Lq = 3, cases[11].Lk = 40;
  cases[12].what = "long keys", cases[12].H = 2, cases[12].Hkv = 1, cases[12].Lq = 64,
  cases[12].Lk = 1500, cases[12].qk_amplitude = 4.0f;
  cases[13].what = "large logits (fused path's maximum checks)", cases[13].qk_amplitude = 8.0f,
  cases[13].Lk = 700;
  cases[14].what = "causal with padding mask and lengths", cases[14].B = 2,
  cases[14].causal = MHA_CAUSAL_TOP_LEFT, cases[14].mask = 2, cases[14].lens = true,
  cases[14].D = 96, cases[14].Dv = 80;
  // Query tiles of one item see odd key counts that grow from tile to tile:
  // the item's cached V pairs are extended, the odd last key paired again.
  // (Enough heads that the runtime gives an item two query tiles.)
  cases[15].what = "causal bottom-right, odd offset (V pairs extended)", cases[15].H = 64,
  cases[15].Hkv = 8, cases[15].Lq = 256, cases[15].Lk = 289, cases[15].D = 16, cases[15].Dv = 16,
  cases[15].causal = MHA_CAUSAL_BOTTOM_RIGHT;
  // Logits hundreds apart: a query tile's first key group's maximum (the
  // first tile's reference) is far below later keys', whose probabilities
  // against it would overflow: the checks send such tiles to the two-pass path.
  cases[16].what = "logits hundreds apart (first tile's maximum checks)",
  cases[16].qk_amplitude = 16.0f, cases[16].Lq = 130, cases[16].Lk = 200;
  uint64_t seed = 100;
  for (DotCase& c : cases) {
    c.seed = ++seed;
    run_dot_case(c);
  }
}

// A case that a kernel rounding Q to bf16 after scaling it would fail: half of
// the head dimensions hold a value whose product with the scale (or with
// scale · log2 e) rounds up in bf16, the other half one that rounds down; even
// keys see only the first half, odd keys only the second, every logit near 30,
// V +1 on even keys and -1 on odd ones.  Pre-scaling moves the two groups'
// logits apart by about 30 · 2^-9, which tilts the output by several times the
// tolerance; exact products scaled in fp32 do not.
TEST_P(Bf16Dot, ScaleIsAppliedToTheFp32ScoreNotToQ) {
  const int64_t Lq = 64, Lk = 256, D = 64, half = D / 2;
  const float scale = 0.1f;  // not a power of two
  const double factors[] = {static_cast<double>(scale),
                            static_cast<double>(scale) * 1.4426950408889634};
  const auto bf16 = [](double x) {
    return half_bits_value(round_to_bf16_bits(static_cast<float>(x)), MHA_DTYPE_BF16);
  };
  // bf16 values in [1, 2) whose product with every factor rounds up (down)
  // by at least 2^-10 of itself.
  double up = 0, down = 0;
  for (int m = 0; m < 128 && (up == 0 || down == 0); ++m) {
    const double a = 1.0 + m / 128.0;
    bool all_up = true, all_down = true;
    for (const double f : factors) {
      const double relative = bf16(a * f) / (a * f) - 1.0;
      all_up = all_up && relative >= std::ldexp(1.0, -10);
      all_down = all_down && relative <= -std::ldexp(1.0, -10);
    }
    if (all_up && up == 0) up = a;
    if (all_down && down == 0) down = a;
  }
  ASSERT_NE(up, 0.0);
  ASSERT_NE(down, 0.0);
  const double k_even = bf16(30.0 / (static_cast<double>(scale) * half * up)),
               k_odd = bf16(30.0 / (static_cast<double>(scale) * half * down));

  std::vector<float> qf(static_cast<size_t>(Lq * D)), kf(static_cast<size_t>(Lk * D), 0.0f),
      vf(static_cast<size_t>(Lk * D)), out(static_cast<size_t>(Lq * D), -7.0f);
  for (int64_t i = 0; i < Lq; ++i) {
    for (int64_t x = 0; x < D; ++x)
      qf[static_cast<size_t>(i * D + x)] = static_cast<float>(x < half ? up : down);
  }
  for (int64_t j = 0; j < Lk; ++j) {
    for (int64_t x = 0; x < D; ++x) {
      const bool even = j % 2 == 0;
      if (even == (x < half)) {
        kf[static_cast<size_t>(j * D + x)] = static_cast<float>(even ? k_even : k_odd);
      }
      vf[static_cast<size_t>(j * D + x)] = even ? 1.0f : -1.0f;
    }
  }
  const auto t = [&](std::vector<float>& data, int64_t l) {
    return describe(data.data(), MHA_DTYPE_F32, {1, 1, l, D});
  };
  TypedCopy q(t(qf, Lq), MHA_DTYPE_BF16), k(t(kf, Lk), MHA_DTYPE_BF16),
      v(t(vf, Lk), MHA_DTYPE_BF16);
  mha_tensor tout = t(out, Lq);
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.has_scale = 1;
  p.scale = scale;
  ASSERT_EQ(mha_attention(&q.get(), &k.get(), &v.get(), &tout, &p), MHA_OK) << mha_last_error();
  const Reference ref = reference_attention(q.get(), k.get(), v.get(), &p);
  EXPECT_GT(ref.max_abs_logit, 29.0);
  EXPECT_LT(ref.max_abs_logit, 31.0);
  const double tol = bf16_dot_tolerance(ref, MHA_DTYPE_F32);

  // What a kernel that pre-scales Q by f and rounds it to bf16 would compute:
  // logits (bf16(Q·f) · K) · scale / f.
  for (const double f : factors) {
    std::vector<float> scaled(qf.size());
    for (size_t n = 0; n < qf.size(); ++n) {
      scaled[n] = static_cast<float>(bf16(static_cast<double>(qf[n]) * f));
    }
    TypedCopy q_rounded(t(scaled, Lq), MHA_DTYPE_BF16);
    mha_attention_params rp = p;
    rp.scale = static_cast<float>(static_cast<double>(scale) / f);
    const Reference wrong = reference_attention(q_rounded.get(), k.get(), v.get(), &rp);
    double drift = 0;
    for (size_t n = 0; n < ref.out.size(); ++n) {
      drift = std::max(drift, std::fabs(wrong.out[n] - ref.out[n]));
    }
    EXPECT_GT(drift, 2.5 * tol) << "pre-scaling by " << f << " would not be caught";
  }
  const double error = max_abs_error(tout, ref);
  EXPECT_LE(error, tolerance_for(GetParam(), MHA_DTYPE_BF16, MHA_DTYPE_BF16, ref, MHA_DTYPE_F32));
  std::printf("%s: error %.3g, tolerance %.3g\n", GetParam().c_str(), error, tol);
}

// Decode (few queries over many keys) keeps widening bf16 to fp32 on every
// backend: the fp32 tolerance, not the P-rounding allowance.
TEST_P(Bf16Dot, DecodeKeepsTheFp32Tolerance) {
  for (const int64_t lq : {int64_t{1}, int64_t{3}}) {
    SCOPED_TRACE("Lq " + std::to_string(lq));
    Rng rng(static_cast<uint64_t>(40 + lq));
    const int64_t H = 8, Hkv = 2, Lk = 1300, D = 64;
    Tensor q(Layout::BHLD, 1, H, lq, D, 0, 1, MHA_DTYPE_BF16);
    Tensor k(Layout::BHLD, 1, Hkv, Lk, D, 0, 1, MHA_DTYPE_BF16);
    Tensor v(Layout::BHLD, 1, Hkv, Lk, D, 0, 1, MHA_DTYPE_BF16);
    fill_uniform(q.floats, rng, -2.0f, 2.0f);
    fill_uniform(k.floats, rng, -2.0f, 2.0f);
    fill_uniform(v.floats, rng);
    q.refresh();
    k.refresh();
    v.refresh();
    std::vector<float> out(static_cast<size_t>(H * lq * D));
    mha_tensor tout = describe(out.data(), MHA_DTYPE_F32, {1, H, lq, D});
    ASSERT_EQ(mha_attention(&q.get(), &k.get(), &v.get(), &tout, nullptr), MHA_OK)
        << mha_last_error();
    const Reference ref = reference_attention(q.get(), k.get(), v.get(), nullptr);
    EXPECT_LE(max_abs_error(tout, ref), tolerance(ref, MHA_DTYPE_F32));
  }
}

// Non-finite data on the bf16 path: a masked key whose V row is infinite (the
// query tile goes to the fp32 path's guarded P·V), a NaN in Q (its row comes
// out NaN: the careful pass), a row that a mask removes entirely (zeros, LSE
// -inf).
TEST_P(Bf16Dot, NonFiniteData) {
  const int64_t Lq = 128, Lk = 200, D = 32;
  Rng rng(77);
  Tensor q(Layout::BHLD, 1, 1, Lq, D, 0, 1, MHA_DTYPE_BF16);
  Tensor k(Layout::BHLD, 1, 1, Lk, D, 0, 1, MHA_DTYPE_BF16);
  Tensor v(Layout::BHLD, 1, 1, Lk, D, 0, 1, MHA_DTYPE_BF16);
  fill_uniform(q.floats, rng);
  fill_uniform(k.floats, rng);
  fill_uniform(v.floats, rng);
  v.values[static_cast<size_t>(150 * D + 3)] = INFINITY;  // key 150, masked below
  q.values[static_cast<size_t>(5 * D + 7)] = NAN;         // query 5
  q.refresh();
  v.refresh();
  std::vector<uint8_t> mask(static_cast<size_t>(Lq * Lk), 1);
  for (int64_t i = 0; i < Lq; ++i) mask[static_cast<size_t>(i * Lk + 150)] = 0;
  for (int64_t j = 0; j < Lk; ++j) mask[static_cast<size_t>(9 * Lk + j)] = 0;  // query 9: none
  mha_tensor tmask = describe(mask.data(), MHA_DTYPE_BOOL, {Lq, Lk});
  std::vector<float> out(static_cast<size_t>(Lq * D)), lse(static_cast<size_t>(Lq));
  mha_tensor tout = describe(out.data(), MHA_DTYPE_F32, {1, 1, Lq, D});
  mha_tensor tlse = describe(lse.data(), MHA_DTYPE_F32, {1, 1, Lq});
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.mask = &tmask;
  p.lse = &tlse;
  ASSERT_EQ(mha_attention(&q.get(), &k.get(), &v.get(), &tout, &p), MHA_OK) << mha_last_error();
  const Reference ref = reference_attention(q.get(), k.get(), v.get(), &p);
  EXPECT_LE(max_abs_error(tout, ref),
            tolerance_for(GetParam(), MHA_DTYPE_BF16, MHA_DTYPE_BF16, ref, MHA_DTYPE_F32));
  for (int64_t x = 0; x < D; ++x) {
    EXPECT_TRUE(std::isnan(out[static_cast<size_t>(5 * D + x)])) << "query 5, column " << x;
    EXPECT_EQ(out[static_cast<size_t>(9 * D + x)], 0.0f) << "query 9, column " << x;
    EXPECT_TRUE(std::isfinite(out[static_cast<size_t>(100 * D + x)])) << "query 100, column " << x;
  }
  EXPECT_EQ(lse[9], -INFINITY);
}

INSTANTIATE_TEST_SUITE_P(Backends, Bf16Dot, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

// ------------------------------------------------------------------ against avx512

// Both backends usable here, or a reason to skip.
std::string both_usable() {
  const auto backends = list_backends();
  for (const char* name : {"avx512", "avx512bf16"}) {
    const BackendEntry* entry = find_backend(backends, name);
    if (entry == nullptr) return std::string(name) + " is not built for this architecture";
    if (!entry->usable) return std::string(name) + " is not usable here: " + entry->reason;
  }
  return "";
}

// One call's inputs, run on a backend: the output and LSE bits.
struct Call {
  int32_t q_dtype, kv_dtype, out_dtype;
  int64_t B, H, Hkv, Lq, Lk, D, Dv;
  int32_t causal;
  bool mask, lens;
  float dropout;
  bool nonfinite;  // an infinity in V under the mask and a NaN in Q
};

std::vector<unsigned char> run_on(const std::string& backend, const Call& c) {
  EXPECT_EQ(mha_select_backend(backend.c_str()), MHA_OK) << mha_last_error();
  Rng rng(static_cast<uint64_t>(c.Lq * 131 + c.Lk));
  std::vector<float> qf(static_cast<size_t>(c.B * c.H * c.Lq * c.D)),
      kf(static_cast<size_t>(c.B * c.Hkv * c.Lk * c.D)),
      vf(static_cast<size_t>(c.B * c.Hkv * c.Lk * c.Dv));
  for (float& x : qf) x = rng.uniform(-2.0f, 2.0f);
  for (float& x : kf) x = rng.uniform(-2.0f, 2.0f);
  for (float& x : vf) x = rng.uniform();
  if (c.nonfinite) {
    vf[static_cast<size_t>(1 * c.Dv)] = INFINITY;  // key 1 of the first KV head
    qf[3] = NAN;
  }
  const auto t = [](std::vector<float>& data, const std::vector<int64_t>& shape) {
    return describe(data.data(), MHA_DTYPE_F32, shape);
  };
  std::vector<int8_t> k8, v8;
  std::vector<float> ks(static_cast<size_t>(c.B * c.Hkv * c.Lk)), vs(ks.size());
  mha_tensor tk8{}, tv8{}, tks{}, tvs{};
  TypedCopy q(t(qf, {c.B, c.H, c.Lq, c.D}), c.q_dtype);
  const int32_t stored = c.kv_dtype == MHA_DTYPE_I8 ? MHA_DTYPE_F32 : c.kv_dtype;
  TypedCopy k(t(kf, {c.B, c.Hkv, c.Lk, c.D}), stored), v(t(vf, {c.B, c.Hkv, c.Lk, c.Dv}), stored);
  mha_tensor* key = &k.get();
  mha_tensor* value = &v.get();
  mha_attention_params p;
  mha_attention_params_init(&p);
  if (c.kv_dtype == MHA_DTYPE_I8) {
    k8.assign(kf.size(), 0);
    v8.assign(vf.size(), 0);
    tk8 = describe(k8.data(), MHA_DTYPE_I8, {c.B, c.Hkv, c.Lk, c.D});
    tv8 = describe(v8.data(), MHA_DTYPE_I8, {c.B, c.Hkv, c.Lk, c.Dv});
    tks = describe(ks.data(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk});
    tvs = describe(vs.data(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk});
    EXPECT_EQ(mha_quantize_kv(key, &tk8, &tks), MHA_OK) << mha_last_error();
    EXPECT_EQ(mha_quantize_kv(value, &tv8, &tvs), MHA_OK) << mha_last_error();
    key = &tk8;
    value = &tv8;
    p.k_scale = &tks;
    p.v_scale = &tvs;
  }
  std::vector<uint8_t> mask(static_cast<size_t>(c.Lq * c.Lk));
  for (auto& m : mask) m = rng.chance(0.7) ? 1 : 0;
  for (int64_t i = 0; i < c.Lq; ++i) mask[static_cast<size_t>(i * c.Lk + 1)] = 0;
  mha_tensor tmask = describe(mask.data(), MHA_DTYPE_BOOL, {c.Lq, c.Lk});
  std::vector<int32_t> lens(static_cast<size_t>(c.B));
  for (auto& l : lens) l = static_cast<int32_t>(rng.integer(1, c.Lk));
  mha_tensor tlens = describe(lens.data(), MHA_DTYPE_I32, {c.B});
  const size_t out_bytes =
      static_cast<size_t>(c.B * c.H * c.Lq * c.Dv) * (c.out_dtype == MHA_DTYPE_F32 ? 4 : 2);
  const size_t lse_bytes = static_cast<size_t>(c.B * c.H * c.Lq) * 4;
  std::vector<unsigned char> result(out_bytes + lse_bytes, 0xAB);
  mha_tensor tout =
      describe(result.data(), static_cast<mha_dtype>(c.out_dtype), {c.B, c.H, c.Lq, c.Dv});
  mha_tensor tlse = describe(result.data() + out_bytes, MHA_DTYPE_F32, {c.B, c.H, c.Lq});
  p.causal = c.causal;
  if (c.mask) p.mask = &tmask;
  if (c.lens) p.valid_lens = &tlens;
  p.lse = &tlse;
  p.dropout_p = c.dropout;
  p.dropout_seed = 1234;
  EXPECT_EQ(mha_attention(&q.get(), key, value, &tout, &p), MHA_OK) << mha_last_error();
  return result;
}

// Every call the bf16 path does not take computes exactly avx512's code:
// fp32, the other dtypes, bf16 with a non-bf16 KV cache, and bf16 decode.
TEST(Bf16DotAgainstAvx512, EveryOtherCallIsBitIdentical) {
  if (const std::string why = both_usable(); !why.empty()) GTEST_SKIP() << why;
  const int32_t f32 = MHA_DTYPE_F32, bf16 = MHA_DTYPE_BF16, f16 = MHA_DTYPE_F16, i8 = MHA_DTYPE_I8;
  const Call calls[] = {
      {f32, f32, f32, 2, 4, 2, 100, 300, 64, 64, MHA_CAUSAL_NONE, false, false, 0.0f, false},
      {f32, f32, f32, 1, 2, 2, 200, 200, 37, 21, MHA_CAUSAL_TOP_LEFT, true, true, 0.0f, false},
      {f32, f32, f32, 1, 4, 1, 1, 2000, 128, 128, MHA_CAUSAL_NONE, false, false, 0.0f, false},
      {f32, f32, f32, 1, 2, 2, 70, 150, 64, 64, MHA_CAUSAL_BOTTOM_RIGHT, false, false, 0.25f,
       false},
      {f32, f32, f32, 1, 2, 1, 64, 90, 32, 32, MHA_CAUSAL_NONE, true, false, 0.0f, true},
      {f16, f16, f16, 2, 4, 2, 100, 300, 64, 48, MHA_CAUSAL_NONE, false, false, 0.0f, false},
      {bf16, f16, f32, 1, 4, 2, 80, 200, 64, 64, MHA_CAUSAL_TOP_LEFT, false, false, 0.0f, false},
      {f16, bf16, f32, 1, 4, 2, 80, 200, 64, 64, MHA_CAUSAL_NONE, true, false, 0.0f, false},
      {bf16, i8, bf16, 1, 4, 2, 80, 200, 64, 64, MHA_CAUSAL_NONE, false, true, 0.0f, false},
      {f32, bf16, f32, 1, 4, 2, 80, 200, 64, 64, MHA_CAUSAL_NONE, false, false, 0.0f, false},
      {bf16, bf16, bf16, 1, 8, 2, 1, 1300, 64, 64, MHA_CAUSAL_NONE, false, false, 0.0f, false},
      {bf16, bf16, f32, 2, 4, 4, 3, 900, 96, 80, MHA_CAUSAL_NONE, true, true, 0.0f, false},
  };
  int index = 0;
  for (const Call& c : calls) {
    SCOPED_TRACE("call " + std::to_string(index++));
    const std::vector<unsigned char> a = run_on("avx512", c), b = run_on("avx512bf16", c);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size()), 0) << "outputs or LSE differ";
  }
  mha_select_backend("auto");
}

// bf16 prefill on avx512bf16 takes the dot products exactly when the runtime
// says so (mha_backend_get_bf16_dot): otherwise it is avx512's widened
// computation, bit for bit; with them, P's rounding to bf16 shows.
TEST(Bf16DotAgainstAvx512, Bf16CallsFollowTheRuntimesChoice) {
  if (const std::string why = both_usable(); !why.empty()) GTEST_SKIP() << why;
  const auto backends = list_backends();
  const BackendEntry* entry = find_backend(backends, "avx512bf16");
  ASSERT_NE(entry, nullptr);
  const bool dot = entry->bf16_dot;
  if (const std::string forced = env("MHA_BF16_DOT"); forced == "0" || forced == "1") {
    EXPECT_EQ(dot, forced == "1") << "MHA_BF16_DOT=" << forced << " was not followed";
  }
  const int32_t f32 = MHA_DTYPE_F32, bf16 = MHA_DTYPE_BF16;
  const Call calls[] = {
      {bf16, bf16, f32, 2, 4, 2, 100, 300, 64, 64, MHA_CAUSAL_NONE, false, false, 0.0f, false},
      {bf16, bf16, bf16, 1, 4, 4, 130, 130, 32, 48, MHA_CAUSAL_TOP_LEFT, true, true, 0.0f, false},
      {bf16, bf16, f32, 1, 2, 1, 70, 150, 64, 64, MHA_CAUSAL_BOTTOM_RIGHT, false, false, 0.25f,
       false},
  };
  int index = 0;
  for (const Call& c : calls) {
    SCOPED_TRACE("call " + std::to_string(index++) + (dot ? ", dot products" : ", widened"));
    const std::vector<unsigned char> a = run_on("avx512", c), b = run_on("avx512bf16", c);
    ASSERT_EQ(a.size(), b.size());
    const bool same = std::memcmp(a.data(), b.data(), a.size()) == 0;
    EXPECT_EQ(same, !dot) << (dot ? "the dot products left no trace of P's rounding"
                                  : "widened bf16 differs from avx512's");
  }
  mha_select_backend("auto");
}

// Dropout on the bf16 path keeps the fp32 path's dropout decisions: the
// outputs agree with avx512's within the P-rounding allowance, scaled by the
// 1 / (1 - p) that kept weights carry.
TEST(Bf16DotAgainstAvx512, DropoutAgreesWithinThePRoundingAllowance) {
  if (const std::string why = both_usable(); !why.empty()) GTEST_SKIP() << why;
  const Call c{MHA_DTYPE_BF16,      MHA_DTYPE_BF16, MHA_DTYPE_F32, 1,     4,    2, 100, 400, 64, 64,
               MHA_CAUSAL_TOP_LEFT, false,          false,         0.25f, false};
  const std::vector<unsigned char> a = run_on("avx512", c), b = run_on("avx512bf16", c);
  const size_t n = static_cast<size_t>(c.B * c.H * c.Lq * c.Dv);
  std::vector<float> fa(n), fb(n);
  std::memcpy(fa.data(), a.data(), n * 4);
  std::memcpy(fb.data(), b.data(), n * 4);
  double worst = 0;
  size_t differ = 0;
  for (size_t i = 0; i < n; ++i) {
    worst = std::max(worst, static_cast<double>(std::fabs(fa[i] - fb[i])));
    differ += fa[i] != fb[i] ? 1 : 0;
  }
  EXPECT_LE(worst, 4.0 * std::ldexp(1.0, -9) / (1.0 - static_cast<double>(c.dropout)) + 1e-5);
  EXPECT_GT(differ, 0u) << "the bf16 path did not run";
  mha_select_backend("auto");
}

// Run by ctest with MHA_VERBOSE=2 (bf16_dot.verbose_path): a bf16 prefill, a
// bf16 decode and an fp32 prefill on avx512bf16; the entry's regular
// expression checks each call line's path= (bf16-dot, widened-to-fp32, fp32).
TEST(Bf16DotVerbose, CallLinesNameThePath) {
  if (env("MHA_VERBOSE") != "2") GTEST_SKIP() << "runs with MHA_VERBOSE=2";
  const auto backends = list_backends();
  const BackendEntry* entry = find_backend(backends, "avx512bf16");
  if (entry == nullptr || !entry->usable) {
    std::printf("avx512bf16 is not usable here: no path lines to check\n");
    return;
  }
  ASSERT_EQ(mha_select_backend("avx512bf16"), MHA_OK) << mha_last_error();
  const Call prefill{
      MHA_DTYPE_BF16,  MHA_DTYPE_BF16, MHA_DTYPE_F32, 1,    4,    2, 128, 200, 64, 64,
      MHA_CAUSAL_NONE, false,          false,         0.0f, false};
  const Call decode{MHA_DTYPE_BF16,  MHA_DTYPE_BF16, MHA_DTYPE_F32, 1,    4,    2, 1, 1200, 64, 64,
                    MHA_CAUSAL_NONE, false,          false,         0.0f, false};
  const Call fp32{MHA_DTYPE_F32,   MHA_DTYPE_F32, MHA_DTYPE_F32, 1,    4,    2, 128, 200, 64, 64,
                  MHA_CAUSAL_NONE, false,         false,         0.0f, false};
  for (const Call& c : {prefill, decode, fp32}) run_on("avx512bf16", c);
  mha_select_backend("auto");
}

}  // namespace
}  // namespace mha_test
