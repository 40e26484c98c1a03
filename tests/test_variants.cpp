// The score variants -- attention sinks (gpt-oss), the logit softcap (Gemma
// 2) and ALiBi (BLOOM, MPT) -- on every backend: each alone, with each other,
// with the sliding window and with every existing option (causal both ways,
// valid lengths, bool and additive masks, GQA, half precision and int8 K/V,
// the decode layout and split-KV), against the float64 reference; the edge
// values the issue names; bad input refused by name.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "backend_param.h"
#include "checked_call.h"
#include "reference.h"
#include "test_util.h"

namespace mha_test {
namespace {

struct VariantCase {
  const char* what = "";
  int64_t B = 1, H = 4, Hkv = 2, Lq = 70, Lk = 300, D = 32, Dv = 24;
  float softcap = 0.0f;
  bool alibi = false, alibi_per_batch = false, sinks = false;
  float sink_value = NAN;     // NaN: random sinks in [-2, 4); else every head's sink
  float slope_value = NAN;    // NaN: ALiBi's geometric slopes; else every slope
  float qk_amplitude = 2.0f;  // Q and K uniform in [-a, a)
  int64_t left = -1, right = -1;
  int32_t dtype = MHA_DTYPE_F32;  // of Q, K and V (I8: F32 Q, int8 K and V)
  CallOptions options;
  uint64_t seed = 1;
};

std::string describe_case(const VariantCase& c) {
  return std::string(c.what) + ": B" + std::to_string(c.B) + " H" + std::to_string(c.H) + "/" +
         std::to_string(c.Hkv) + " Lq" + std::to_string(c.Lq) + " Lk" + std::to_string(c.Lk) +
         " softcap " + std::to_string(c.softcap) + " alibi " + std::to_string(c.alibi) +
         (c.alibi_per_batch ? " per batch" : "") + " sinks " + std::to_string(c.sinks) +
         " window " + std::to_string(c.left) + "," + std::to_string(c.right) + " causal " +
         std::to_string(c.options.causal) + " mask " + std::to_string(c.options.mask) + " lens " +
         std::to_string(c.options.lens);
}

// Runs the case on the selected backend and checks it against the reference.
void run_variant_case(const VariantCase& c) {
  SCOPED_TRACE(describe_case(c));
  Rng rng(c.seed);
  Arena q(c.B * c.H * c.Lq * c.D), k(c.B * c.Hkv * c.Lk * c.D), v(c.B * c.Hkv * c.Lk * c.Dv);
  mha_tensor tq = describe(q.base(), MHA_DTYPE_F32, {c.B, c.H, c.Lq, c.D});
  mha_tensor tk = describe(k.base(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk, c.D});
  mha_tensor tv = describe(v.base(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk, c.Dv});
  fill_uniform(tq, rng, -c.qk_amplitude, c.qk_amplitude);
  fill_uniform(tk, rng, -c.qk_amplitude, c.qk_amplitude);
  fill_uniform(tv, rng);

  const bool int8 = c.dtype == MHA_DTYPE_I8;
  const int32_t float_dtype = int8 ? MHA_DTYPE_F32 : c.dtype;
  TypedCopy q_typed(tq, float_dtype), k_typed(tk, float_dtype), v_typed(tv, float_dtype);
  mha_tensor qq = q_typed.get(), kk = k_typed.get(), vv = v_typed.get();
  std::vector<int8_t> k8(static_cast<size_t>(c.B * c.Hkv * c.Lk * c.D));
  std::vector<int8_t> v8(static_cast<size_t>(c.B * c.Hkv * c.Lk * c.Dv));
  std::vector<float> k_scales(static_cast<size_t>(c.B * c.Hkv * c.Lk)), v_scales(k_scales.size());
  mha_tensor tks{}, tvs{};
  if (int8) {
    kk = describe(k8.data(), MHA_DTYPE_I8, {c.B, c.Hkv, c.Lk, c.D});
    vv = describe(v8.data(), MHA_DTYPE_I8, {c.B, c.Hkv, c.Lk, c.Dv});
    tks = describe(k_scales.data(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk});
    tvs = describe(v_scales.data(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk});
    ASSERT_EQ(mha_quantize_kv(&tk, &kk, &tks), MHA_OK) << mha_last_error();
    ASSERT_EQ(mha_quantize_kv(&tv, &vv, &tvs), MHA_OK) << mha_last_error();
  }

  CheckedCall call(rng, c.B, c.H, c.Lq, c.Lk, c.Dv, c.options);
  call.params.window_left = c.left;
  call.params.window_right = c.right;
  call.params.softcap = c.softcap;
  if (int8) {
    call.params.k_scale = &tks;
    call.params.v_scale = &tvs;
  }
  // ALiBi's slopes for H heads: 2^(-8 (h + 1) / H) (Press et al.), or one value.
  std::vector<float> slopes(static_cast<size_t>(c.B * c.H));
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t h = 0; h < c.H; ++h) {
      slopes[static_cast<size_t>(b * c.H + h)] =
          std::isnan(c.slope_value)
              ? std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(c.H)) *
                    (c.alibi_per_batch ? static_cast<float>(b + 1) : 1.0f)
              : c.slope_value;
    }
  }
  mha_tensor tslopes = c.alibi_per_batch ? describe(slopes.data(), MHA_DTYPE_F32, {c.B, c.H})
                                         : describe(slopes.data(), MHA_DTYPE_F32, {c.H});
  if (c.alibi) call.params.alibi_slopes = &tslopes;
  // Sinks, every other one strided (stride 2) to check the stride is read.
  std::vector<float> sink_values(static_cast<size_t>(2 * c.H), -1000.0f);
  for (int64_t h = 0; h < c.H; ++h) {
    sink_values[static_cast<size_t>(2 * h)] =
        std::isnan(c.sink_value) ? rng.uniform(-2.0f, 4.0f) : c.sink_value;
  }
  mha_tensor tsinks = describe(sink_values.data(), MHA_DTYPE_F32, {c.H}, {2});
  if (c.sinks) call.params.sinks = &tsinks;

  ASSERT_EQ(mha_attention(&qq, &kk, &vv, &call.out, &call.params), MHA_OK) << mha_last_error();
  const Reference ref = reference_attention(qq, kk, vv, &call.params);
  const char* backend = mha_selected_backend();
  ASSERT_NE(backend, nullptr) << mha_last_error();
  EXPECT_LE(max_abs_error(call.out, ref),
            tolerance_for(backend, float_dtype, kk.dtype, ref, c.options.out_dtype));
  call.expect_lse_matches(ref);
}

class Variants : public BackendTest {};

TEST_P(Variants, EachAloneAndWithEveryOtherOption) {
  std::vector<VariantCase> cases;
  const auto add = [&cases](const char* what) -> VariantCase& {
    cases.emplace_back();
    cases.back().what = what;
    return cases.back();
  };
  add("softcap 50 (Gemma 2)").softcap = 50.0f;
  {
    VariantCase& c = add("softcap 5 biting into logits of up to 40");
    c.softcap = 5.0f, c.qk_amplitude = 8.0f, c.D = 64;
  }
  add("ALiBi per head").alibi = true;
  {
    VariantCase& c = add("ALiBi per batch and head, causal bottom-right, Lq < Lk");
    c.B = 2, c.alibi = c.alibi_per_batch = true, c.options.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  }
  add("sinks").sinks = true;
  {
    VariantCase& c = add("all three with a window (gpt-oss and Gemma together)");
    c.softcap = 30.0f, c.alibi = c.sinks = true, c.left = 40, c.right = 0;
  }
  {
    VariantCase& c = add("sinks, causal bottom-right, Lq > Lk: rows without keys get the sink");
    c.sinks = true, c.Lq = 300, c.Lk = 100, c.options.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  }
  {
    VariantCase& c = add("softcap, bool mask and valid lengths (rows without keys)");
    c.softcap = 20.0f, c.options.mask = 1, c.options.lens = true, c.B = 3;
  }
  {
    VariantCase& c = add("ALiBi and an additive bf16 mask with -inf, bf16 inputs, GQA");
    c.alibi = true, c.H = 6, c.Hkv = 2, c.dtype = MHA_DTYPE_BF16;
    c.options.mask = 2, c.options.mask_dtype = MHA_DTYPE_BF16;
  }
  {
    VariantCase& c = add("softcap and sinks, f16 in and out");
    c.softcap = 40.0f, c.sinks = true, c.dtype = MHA_DTYPE_F16;
    c.options.out_dtype = MHA_DTYPE_F16;
  }
  {
    VariantCase& c = add("all three, int8 K and V");
    c.softcap = 50.0f, c.alibi = c.sinks = true, c.dtype = MHA_DTYPE_I8;
  }
  {
    VariantCase& c = add("all three over several query and key tiles, causal");
    c.H = c.Hkv = 2, c.Lq = c.Lk = 700, c.D = c.Dv = 64, c.softcap = 50.0f;
    c.alibi = c.sinks = true, c.options.causal = MHA_CAUSAL_TOP_LEFT;
  }
  {
    VariantCase& c = add("bf16 prefill over several tiles (the bf16 path where there is one)");
    c.Lq = 200, c.Lk = 600, c.D = c.Dv = 64, c.dtype = MHA_DTYPE_BF16;
    c.softcap = 50.0f, c.alibi = c.sinks = true;
  }
  {
    VariantCase& c = add("decode over a long cache (split-KV: the sink joins once)");
    c.H = 8, c.Lq = 1, c.Lk = 6000, c.D = c.Dv = 64, c.sinks = true, c.alibi = true;
    c.softcap = 50.0f, c.options.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  }
  {
    VariantCase& c = add("decode, three queries, window and sinks, bf16 K/V");
    c.Lq = 3, c.Lk = 3000, c.left = 1000, c.right = 0, c.sinks = true, c.softcap = 30.0f;
    c.dtype = MHA_DTYPE_BF16;
  }
  {
    VariantCase& c = add("decode with int8 K and V, ALiBi per batch");
    c.B = 2, c.Lq = 1, c.Lk = 2000, c.alibi = c.alibi_per_batch = true, c.dtype = MHA_DTYPE_I8;
  }
  for (VariantCase& c : cases) {
    c.seed = static_cast<uint64_t>(&c - cases.data()) + 31;
    run_variant_case(c);
  }
}

// The edge values the issue names: sinks of +-1e4 and -inf (no sink), a
// softcap with logits of +-1e4, ALiBi slopes of 0.
TEST_P(Variants, EdgeValues) {
  std::vector<VariantCase> cases(6);
  cases[0].what = "sink 1e4: it takes all the weight";
  cases[0].sinks = true, cases[0].sink_value = 1e4f;
  cases[1].what = "sink -1e4: it takes none", cases[1].sinks = true, cases[1].sink_value = -1e4f;
  cases[2].what = "sink -inf: no sink", cases[2].sinks = true, cases[2].sink_value = -INFINITY;
  cases[3].what = "softcap 30 over logits near +-1e4", cases[3].softcap = 30.0f;
  cases[3].qk_amplitude = 18.0f;
  cases[4].what = "ALiBi with slopes 0", cases[4].alibi = true, cases[4].slope_value = 0.0f;
  cases[5].what = "decode: sink 1e4 and softcap over huge logits", cases[5].Lq = 1;
  cases[5].Lk = 2000, cases[5].sinks = true, cases[5].sink_value = 1e4f;
  cases[5].softcap = 50.0f, cases[5].qk_amplitude = 18.0f;
  for (VariantCase& c : cases) {
    c.seed = static_cast<uint64_t>(&c - cases.data()) + 71;
    run_variant_case(c);
  }
}

// Tiny problems (at most 16 keys and 8 queries) take the rows layout of
// the SIMD plugins (docs/kernel-design.md): every option there, and just
// across its bounds (17 keys, 9 queries) where the prefill layout takes
// over -- head sizes that are not whole vectors, GQA, windows, the variants,
// masks, valid lengths, half precision and int8, f16 output.
TEST_P(Variants, TinyProblemsWithEveryOption) {
  Rng pick(8080);
  for (int trial = 0; trial < 48; ++trial) {
    VariantCase c;
    c.what = "tiny";
    c.Hkv = pick.integer(1, 2);
    c.H = c.Hkv * pick.integer(1, 3);
    c.B = pick.integer(1, 2);
    const int64_t lengths[] = {1, 2, 3, 5, 8, 9, 15, 16, 17};
    c.Lk = lengths[pick.integer(0, 8)];
    c.Lq = trial % 8 == 7 ? 9 : pick.integer(1, 8);
    c.D = pick.integer(1, 40), c.Dv = pick.integer(1, 40);
    if (pick.chance(0.3)) c.softcap = pick.uniform(5.0f, 50.0f);
    c.alibi = pick.chance(0.3);
    c.alibi_per_batch = c.alibi && pick.chance(0.5);
    c.sinks = pick.chance(0.3);
    if (pick.chance(0.3)) c.left = pick.integer(0, 6), c.right = pick.integer(-1, 3);
    const int32_t dtypes[] = {MHA_DTYPE_F32, MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16,
                              MHA_DTYPE_I8};
    c.dtype = dtypes[pick.integer(0, 4)];
    c.options.causal = static_cast<int32_t>(pick.integer(0, 2));
    c.options.mask = static_cast<int>(pick.integer(0, 2));
    c.options.lens = pick.chance(0.4);
    if (c.dtype == MHA_DTYPE_F16 && pick.chance(0.5)) c.options.out_dtype = MHA_DTYPE_F16;
    c.seed = static_cast<uint64_t>(trial) + 900;
    run_variant_case(c);
  }
}

// Dropout keeps or drops a key by its absolute index: a tiny problem (the
// rows layout) drops what the same keys drop when they are the valid part of
// a longer one (the prefill layout).  (Top-left causal: the same rule in both
// calls.)
TEST_P(Variants, TinyProblemDropoutMatchesTheLongerLayout) {
  const int64_t B = 2, H = 3, Lq = 5, Lk = 11, Lk_long = 40, D = 20;
  Rng rng(17);
  Arena q(B * H * Lq * D), k(B * H * Lk_long * D), v(B * H * Lk_long * D);
  mha_tensor tq = describe(q.base(), MHA_DTYPE_F32, {B, H, Lq, D});
  mha_tensor tk_long = describe(k.base(), MHA_DTYPE_F32, {B, H, Lk_long, D});
  mha_tensor tv_long = describe(v.base(), MHA_DTYPE_F32, {B, H, Lk_long, D});
  fill_uniform(tq, rng);
  fill_uniform(tk_long, rng);
  fill_uniform(tv_long, rng);
  // The first Lk keys of the long tensors, as a tensor of their own.
  mha_tensor tk = tk_long, tv = tv_long;
  tk.shape[2] = tv.shape[2] = Lk;
  std::vector<float> tiny(static_cast<size_t>(B * H * Lq * D)), longer(tiny.size());
  mha_tensor t_tiny = describe(tiny.data(), MHA_DTYPE_F32, {B, H, Lq, D});
  mha_tensor t_longer = describe(longer.data(), MHA_DTYPE_F32, {B, H, Lq, D});
  std::vector<int32_t> lens(static_cast<size_t>(B), static_cast<int32_t>(Lk));
  const mha_tensor tlens = describe(lens.data(), MHA_DTYPE_I32, {B});
  for (const int32_t causal : {MHA_CAUSAL_NONE, MHA_CAUSAL_TOP_LEFT}) {
    mha_attention_params p;
    mha_attention_params_init(&p);
    p.dropout_p = 0.3f;
    p.dropout_seed = 123;
    p.causal = causal;
    mha_attention_params long_p = p;
    long_p.valid_lens = &tlens;
    ASSERT_EQ(mha_attention(&tq, &tk, &tv, &t_tiny, &p), MHA_OK) << mha_last_error();
    ASSERT_EQ(mha_attention(&tq, &tk_long, &tv_long, &t_longer, &long_p), MHA_OK)
        << mha_last_error();
    for (size_t x = 0; x < tiny.size(); ++x) {
      ASSERT_NEAR(static_cast<double>(tiny[x]), static_cast<double>(longer[x]),
                  2e-5 * std::max(1.0, std::fabs(static_cast<double>(longer[x]))))
          << "causal " << causal << " element " << x;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, Variants, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

// A call refused by name: the status, a message naming `field`, out untouched.
struct SmallCall {
  std::vector<float> q = std::vector<float>(2 * 4 * 8, 0.5f), k = q, v = q,
                     out = std::vector<float>(q.size(), -3.0f);
  mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {1, 2, 4, 8});
  mha_tensor tk = describe(k.data(), MHA_DTYPE_F32, {1, 2, 4, 8});
  mha_tensor tv = describe(v.data(), MHA_DTYPE_F32, {1, 2, 4, 8});
  mha_tensor tout = describe(out.data(), MHA_DTYPE_F32, {1, 2, 4, 8});

  void expect_refused(const mha_attention_params& p, mha_status status, const char* field) {
    SCOPED_TRACE(field);
    EXPECT_EQ(mha_attention(&tq, &tk, &tv, &tout, &p), status);
    EXPECT_NE(std::string(mha_last_error()).find(field), std::string::npos) << mha_last_error();
    for (float x : out) ASSERT_EQ(x, -3.0f) << "a refused call wrote its output";
  }
};

TEST(VariantsBadInput, RefusedByName) {
  SmallCall call;
  mha_attention_params base;
  mha_attention_params_init(&base);
  for (const float cap : {-1.0f, -1e-30f, NAN, INFINITY, -INFINITY}) {
    mha_attention_params p = base;
    p.softcap = cap;
    call.expect_refused(p, MHA_ERR_INVALID_VALUE, "softcap");
  }
  std::vector<float> two = {0.5f, 1.0f}, three = {0.5f, 1.0f, 2.0f};
  std::vector<int32_t> two_i32 = {1, 2};
  const mha_tensor wrong_shape = describe(three.data(), MHA_DTYPE_F32, {3});
  const mha_tensor wrong_rank = describe(two.data(), MHA_DTYPE_F32, {1, 1, 2});
  const mha_tensor wrong_dtype = describe(two_i32.data(), MHA_DTYPE_I32, {2});
  for (const bool sinks : {true, false}) {
    const char* name = sinks ? "sinks" : "alibi_slopes";
    for (const mha_tensor* t : {&wrong_shape, &wrong_rank, &wrong_dtype}) {
      mha_attention_params p = base;
      (sinks ? p.sinks : p.alibi_slopes) = t;
      EXPECT_NE(mha_attention(&call.tq, &call.tk, &call.tv, &call.tout, &p), MHA_OK);
      EXPECT_NE(std::string(mha_last_error()).find(name), std::string::npos) << mha_last_error();
    }
  }
  for (const float bad : {NAN, INFINITY}) {
    std::vector<float> values = {0.0f, bad};
    const mha_tensor t = describe(values.data(), MHA_DTYPE_F32, {2});
    mha_attention_params p = base;
    p.sinks = &t;
    call.expect_refused(p, MHA_ERR_INVALID_VALUE, "sinks[1]");
  }
  for (const float bad : {NAN, INFINITY, -INFINITY}) {
    std::vector<float> values = {bad, 0.5f};
    const mha_tensor t = describe(values.data(), MHA_DTYPE_F32, {2});
    mha_attention_params p = base;
    p.alibi_slopes = &t;
    call.expect_refused(p, MHA_ERR_INVALID_VALUE, "alibi_slopes");
  }
  // [B, H] slopes with the wrong batch.
  std::vector<float> four(4, 0.5f);
  const mha_tensor per_batch = describe(four.data(), MHA_DTYPE_F32, {2, 2});
  mha_attention_params p = base;
  p.alibi_slopes = &per_batch;
  call.expect_refused(p, MHA_ERR_SHAPE_MISMATCH, "alibi_slopes");
  // The output may not overlap the sinks.
  mha_tensor overlapping = describe(call.out.data(), MHA_DTYPE_F32, {2});
  p = base;
  p.sinks = &overlapping;
  call.expect_refused(p, MHA_ERR_OVERLAP, "sinks");
}

// A caller built against the first 0.3 struct (window, no variants) passes
// its size: no variant, whatever lies past its end.
TEST(VariantsBadInput, OlderParamsSizeMeansNoVariants) {
  static float garbage[2] = {NAN, NAN};
  static const mha_tensor tgarbage = describe(garbage, MHA_DTYPE_F32, {2});
  expect_older_size_ignores_newer_fields(88, [](mha_attention_params& p) {
    p.sinks = &tgarbage;
    p.softcap = -5.0f;
    p.alibi_slopes = &tgarbage;
  });
}

}  // namespace
}  // namespace mha_test
