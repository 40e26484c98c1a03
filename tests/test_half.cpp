// Half precision and the int8 KV cache on every backend: bf16 and f16 Q, K,
// V, masks and outputs, and int8 K/V with row scales, against the float64
// reference computed from the same stored values (rounding the inputs is the
// caller's, not the kernel's error).  Tolerances, as the paths that widen to
// fp32 promise: the fp32 tolerance (docs/decisions.md) plus, for a half
// output, one rounding of it (half an ulp of the largest value).  A backend
// whose bf16 Q with bf16 K and V run on bf16 dot products (avx512bf16) may
// add what rounding P to bf16 once costs, 4 · 2^-9 · max|V|
// (tolerance_for; tests/test_bf16_dot.cpp holds that path to account).
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "backend_param.h"
#include "checked_call.h"
#include "common/dtype.h"
#include "reference.h"
#include "test_util.h"

namespace mha_test {
namespace {

// One problem: float values, stored in the dtypes under test.
struct HalfCase {
  int64_t B = 1, H = 4, Hkv = 2, Lq = 37, Lk = 90, D = 64, Dv = 48;
  Layout layout = Layout::BHLD;
  int32_t causal = MHA_CAUSAL_NONE;
  int mask = 0;  // 0 none, 1 bool [Lq, Lk], 2 additive [B,1,Lq,Lk] of mask_dtype
  int32_t mask_dtype = MHA_DTYPE_F32;
  bool lens = false;
  uint64_t seed = 1;
  std::string describe(int32_t q, int32_t kv, int32_t out) const {
    return "q " + std::string(mha_types::dtype_name(q)) + " kv " + mha_types::dtype_name(kv) +
           " out " + mha_types::dtype_name(out) + " B" + std::to_string(B) + " H" +
           std::to_string(H) + "/" + std::to_string(Hkv) + " Lq" + std::to_string(Lq) + " Lk" +
           std::to_string(Lk) + " D" + std::to_string(D) + "/" + std::to_string(Dv) + " " +
           layout_name(layout) + " causal " + std::to_string(causal) + " mask " +
           std::to_string(mask) + " lens " + std::to_string(lens);
  }
};

// Runs the case with the given dtypes on the selected backend and checks it.
void run_half_case(const HalfCase& c, int32_t q_dtype, int32_t kv_dtype, int32_t out_dtype) {
  SCOPED_TRACE(c.describe(q_dtype, kv_dtype, out_dtype));
  Rng rng(c.seed);
  RandomInputs in(rng, c.layout, c.B, c.H, c.Hkv, c.Lq, c.Lk, c.D, c.Dv);
  const mha_tensor &tk = in.tk, &tv = in.tv;
  TypedCopy q_typed(in.tq, q_dtype);

  // K and V: half copies, or int8 with their row scales (mha_quantize_kv).
  std::vector<int8_t> k8, v8;
  std::vector<float> k_scales(static_cast<size_t>(c.B * c.Hkv * c.Lk)),
      v_scales(static_cast<size_t>(c.B * c.Hkv * c.Lk));
  mha_tensor tk8{}, tv8{}, tks{}, tvs{};
  TypedCopy k_typed(tk, kv_dtype == MHA_DTYPE_I8 ? MHA_DTYPE_F32 : kv_dtype);
  TypedCopy v_typed(tv, kv_dtype == MHA_DTYPE_I8 ? MHA_DTYPE_F32 : kv_dtype);
  mha_tensor* key = &k_typed.get();
  mha_tensor* value = &v_typed.get();
  if (kv_dtype == MHA_DTYPE_I8) {
    k8.assign(static_cast<size_t>(c.B * c.Hkv * c.Lk * c.D), 0);
    v8.assign(static_cast<size_t>(c.B * c.Hkv * c.Lk * c.Dv), 0);
    tk8 = describe(k8.data(), MHA_DTYPE_I8, {c.B, c.Hkv, c.Lk, c.D});
    tv8 = describe(v8.data(), MHA_DTYPE_I8, {c.B, c.Hkv, c.Lk, c.Dv});
    tks = describe(k_scales.data(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk});
    tvs = describe(v_scales.data(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk});
    ASSERT_EQ(mha_quantize_kv(&tk, &tk8, &tks), MHA_OK) << mha_last_error();
    ASSERT_EQ(mha_quantize_kv(&tv, &tv8, &tvs), MHA_OK) << mha_last_error();
    key = &tk8;
    value = &tv8;
  }

  CallOptions o;
  o.causal = c.causal;
  o.mask = c.mask;
  o.mask_dtype = c.mask_dtype;
  o.lens = c.lens;
  o.out_dtype = out_dtype;
  CheckedCall call(rng, c.B, c.H, c.Lq, c.Lk, c.Dv, o);
  if (kv_dtype == MHA_DTYPE_I8) {
    call.params.k_scale = &tks;
    call.params.v_scale = &tvs;
  }
  ASSERT_EQ(mha_attention(&q_typed.get(), key, value, &call.out, &call.params), MHA_OK)
      << mha_last_error();

  const Reference ref = reference_attention(q_typed.get(), *key, *value, &call.params);
  const char* backend = mha_selected_backend();
  ASSERT_NE(backend, nullptr) << mha_last_error();
  EXPECT_LE(max_abs_error(call.out, ref),
            tolerance_for(backend, q_dtype, kv_dtype, ref, out_dtype));
  call.expect_lse_matches(ref);
}

class Half : public BackendTest {};

// Every combination of dtypes the API takes, on a prefill and a decode shape.
TEST_P(Half, EveryDtypeCombination) {
  for (const int32_t q : {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16}) {
    for (const int32_t kv : {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16, MHA_DTYPE_I8}) {
      for (const int32_t out : {int32_t{MHA_DTYPE_F32}, q}) {
        HalfCase prefill;
        prefill.seed = (static_cast<uint64_t>(q) * 100) + (static_cast<uint64_t>(kv) * 10) +
                       static_cast<uint64_t>(out);
        run_half_case(prefill, q, kv, out);
        HalfCase decode;
        // Few queries over many keys: the decode layout (lanes along D).
        decode.H = 4, decode.Hkv = 2, decode.Lq = 1, decode.Lk = 700, decode.D = 64, decode.Dv = 64,
        decode.seed = prefill.seed + 7;
        run_half_case(decode, q, kv, out);
        if (out == MHA_DTYPE_F32 && q == kv) break;  // out = q's dtype is the same case
      }
    }
  }
}

// The mask and shape matrix on a representative subset: each half dtype with
// each causal mode and each mask kind (not their full product).
TEST_P(Half, MasksLayoutsAndLengths) {
  uint64_t seed = 500;
  struct Combination {
    int32_t causal;
    int mask;
    bool lens;
  };
  const Combination combinations[] = {{MHA_CAUSAL_NONE, 0, true},
                                      {MHA_CAUSAL_TOP_LEFT, 1, false},
                                      {MHA_CAUSAL_BOTTOM_RIGHT, 2, false},
                                      {MHA_CAUSAL_NONE, 2, true},
                                      {MHA_CAUSAL_TOP_LEFT, 0, true}};
  for (const int32_t dt : {MHA_DTYPE_BF16, MHA_DTYPE_F16, MHA_DTYPE_I8}) {
    const int32_t q = dt == MHA_DTYPE_I8 ? MHA_DTYPE_BF16 : dt;
    for (const Combination& m : combinations) {
      HalfCase c;
      c.causal = m.causal, c.mask = m.mask, c.mask_dtype = q, c.lens = m.lens,
      c.layout = m.mask == 1 ? Layout::BLHD : Layout::BHLD, c.B = 2, c.Lq = 70, c.Lk = 100,
      c.D = 40, c.Dv = 40, c.seed = ++seed;
      run_half_case(c, q, dt, q);
      c.Lq = 3, c.Lk = 700, c.seed = ++seed;  // few queries: the decode layout
      run_half_case(c, q, dt, MHA_DTYPE_F32);
    }
  }
  // Split-KV over a long cache (chunks merged into a half output).
  HalfCase split;
  split.H = 2, split.Hkv = 1, split.Lq = 1, split.Lk = 6000, split.D = 64, split.Dv = 64;
  run_half_case(split, MHA_DTYPE_BF16, MHA_DTYPE_BF16, MHA_DTYPE_BF16);
  run_half_case(split, MHA_DTYPE_F16, MHA_DTYPE_I8, MHA_DTYPE_F16);
}

INSTANTIATE_TEST_SUITE_P(Backends, Half, ::testing::ValuesIn(backend_names()), backend_param_name);

// ------------------------------------------------------------------ mha_quantize_kv

TEST(QuantizeKv, RoundTripWithinHalfAScale) {
  for (const int32_t dtype : {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16}) {
    SCOPED_TRACE(mha_types::dtype_name(dtype));
    const int64_t B = 2, H = 3, L = 17, D = 40;
    std::vector<float> x(static_cast<size_t>(B * H * L * D));
    Rng rng(9);
    for (float& f : x) f = rng.uniform(-5.0f, 5.0f);
    for (int64_t d = 0; d < D; ++d) x[static_cast<size_t>(D + d)] = 0.0f;  // a row of zeros
    mha_tensor src = describe(x.data(), MHA_DTYPE_F32, {B, H, L, D});
    TypedCopy typed(src, dtype);
    std::vector<int8_t> q(x.size(), 99);
    std::vector<float> scales(static_cast<size_t>(B * H * L), -1.0f);
    mha_tensor dst = describe(q.data(), MHA_DTYPE_I8, {B, H, L, D});
    mha_tensor sc = describe(scales.data(), MHA_DTYPE_F32, {B, H, L});
    ASSERT_EQ(mha_quantize_kv(&typed.get(), &dst, &sc), MHA_OK) << mha_last_error();
    // Each row against the float64 values actually stored.
    for (int64_t row = 0; row < B * H * L; ++row) {
      double largest = 0;
      std::vector<double> values(static_cast<size_t>(D));
      for (int64_t d = 0; d < D; ++d) {
        const float stored = x[static_cast<size_t>(row * D + d)];
        const double value =
            dtype == MHA_DTYPE_F32
                ? static_cast<double>(stored)
                : half_bits_value(dtype == MHA_DTYPE_BF16 ? round_to_bf16_bits(stored)
                                                          : round_to_f16_bits(stored),
                                  dtype);
        values[static_cast<size_t>(d)] = value;
        largest = std::max(largest, std::fabs(value));
      }
      const double scale = static_cast<double>(scales[static_cast<size_t>(row)]);
      EXPECT_NEAR(scale, largest / 127.0, 1e-6 * largest) << "row " << row;
      for (int64_t d = 0; d < D; ++d) {
        const int8_t stored = q[static_cast<size_t>(row * D + d)];
        ASSERT_GE(stored, -127);
        ASSERT_LE(stored, 127);
        EXPECT_LE(std::fabs(values[static_cast<size_t>(d)] - scale * stored),
                  0.5 * scale * (1.0 + 1e-5) + 1e-30)
            << "row " << row << " element " << d;
      }
    }
    EXPECT_EQ(scales[1], 0.0f) << "the row of zeros";
  }
}

TEST(QuantizeKv, RefusesBadArgumentsAndWritesNothing) {
  std::vector<float> x(2 * 4, 1.0f), scales(2, -1.0f);
  std::vector<int8_t> q(2 * 4, 99);
  mha_tensor src = describe(x.data(), MHA_DTYPE_F32, {1, 1, 2, 4});
  mha_tensor dst = describe(q.data(), MHA_DTYPE_I8, {1, 1, 2, 4});
  mha_tensor sc = describe(scales.data(), MHA_DTYPE_F32, {1, 1, 2});
  struct Bad {
    const char* what;
    mha_tensor src, dst, scale;
    mha_status status;
    const char* names;
  };
  mha_tensor f32_dst = dst;
  f32_dst.dtype = MHA_DTYPE_F32;
  mha_tensor i8_src = src;
  i8_src.dtype = MHA_DTYPE_I8;
  mha_tensor short_scale = sc;
  short_scale.shape[2] = 1;
  mha_tensor overlapping = sc;
  overlapping.data = q.data();
  const Bad cases[] = {
      {"dst not i8", src, f32_dst, sc, MHA_ERR_INVALID_DTYPE, "dst"},
      {"src i8", i8_src, dst, sc, MHA_ERR_INVALID_DTYPE, "src"},
      {"scale shape", src, dst, short_scale, MHA_ERR_SHAPE_MISMATCH, "scale"},
      {"scale overlaps dst", src, dst, overlapping, MHA_ERR_OVERLAP, "dst"},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.what);
    mha_tensor s1 = bad.src, d1 = bad.dst, c1 = bad.scale;
    EXPECT_EQ(mha_quantize_kv(&s1, &d1, &c1), bad.status);
    EXPECT_NE(std::string(mha_last_error()).find(bad.names), std::string::npos) << mha_last_error();
    for (int8_t v : q) ASSERT_EQ(v, 99);
    for (float v : scales) ASSERT_EQ(v, -1.0f);
  }
  x[5] = NAN;
  EXPECT_EQ(mha_quantize_kv(&src, &dst, &sc), MHA_ERR_INVALID_VALUE);
  EXPECT_NE(std::string(mha_last_error()).find("src[0][0][1][1]"), std::string::npos)
      << mha_last_error();
  for (int8_t v : q) ASSERT_EQ(v, 99);
  EXPECT_EQ(mha_quantize_kv(nullptr, &dst, &sc), MHA_ERR_NULL_POINTER);
}

// ------------------------------------------------------------------ bad dtypes

TEST(HalfBadInput, UnsupportedCombinationsAreRefusedByName) {
  std::vector<uint16_t> h(2 * 8, 0x3C00);  // 1.0 in f16
  std::vector<float> f(2 * 8, 1.0f), out(2 * 8, -7.0f), scales(2, 1.0f);
  std::vector<int8_t> i8(2 * 8, 1);
  const auto t = [](void* data, int32_t dtype) {
    return describe(data, static_cast<mha_dtype>(dtype), {1, 1, 2, 8});
  };
  mha_tensor tsc = describe(scales.data(), MHA_DTYPE_F32, {1, 1, 2});
  mha_tensor wrong_sc = describe(scales.data(), MHA_DTYPE_F32, {1, 2, 1});
  struct Bad {
    const char* what;
    mha_tensor q, k, v, out;
    const mha_tensor* k_scale;
    const mha_tensor* v_scale;
    mha_status status;
    const char* text;
  };
  const Bad cases[] = {
      {"q i8", t(i8.data(), MHA_DTYPE_I8), t(f.data(), MHA_DTYPE_F32), t(f.data(), MHA_DTYPE_F32),
       t(out.data(), MHA_DTYPE_F32), nullptr, nullptr, MHA_ERR_INVALID_DTYPE, "q has dtype i8"},
      {"k and v differ", t(f.data(), MHA_DTYPE_F32), t(h.data(), MHA_DTYPE_F16),
       t(f.data(), MHA_DTYPE_F32), t(out.data(), MHA_DTYPE_F32), nullptr, nullptr,
       MHA_ERR_INVALID_DTYPE, "v has dtype f32 but k has f16"},
      {"out bf16 for f16 q", t(h.data(), MHA_DTYPE_F16), t(h.data(), MHA_DTYPE_F16),
       t(h.data(), MHA_DTYPE_F16), t(out.data(), MHA_DTYPE_BF16), nullptr, nullptr,
       MHA_ERR_INVALID_DTYPE, "out has dtype bf16"},
      {"out i32", t(f.data(), MHA_DTYPE_F32), t(f.data(), MHA_DTYPE_F32),
       t(f.data(), MHA_DTYPE_F32), t(out.data(), MHA_DTYPE_I32), nullptr, nullptr,
       MHA_ERR_INVALID_DTYPE, "out has dtype i32"},
      {"i8 without scales", t(f.data(), MHA_DTYPE_F32), t(i8.data(), MHA_DTYPE_I8),
       t(i8.data(), MHA_DTYPE_I8), t(out.data(), MHA_DTYPE_F32), nullptr, nullptr,
       MHA_ERR_NULL_POINTER, "params->k_scale is NULL"},
      {"i8 without v_scale", t(f.data(), MHA_DTYPE_F32), t(i8.data(), MHA_DTYPE_I8),
       t(i8.data(), MHA_DTYPE_I8), t(out.data(), MHA_DTYPE_F32), &tsc, nullptr,
       MHA_ERR_NULL_POINTER, "params->v_scale is NULL"},
      {"scales of the wrong shape", t(f.data(), MHA_DTYPE_F32), t(i8.data(), MHA_DTYPE_I8),
       t(i8.data(), MHA_DTYPE_I8), t(out.data(), MHA_DTYPE_F32), &wrong_sc, &tsc,
       MHA_ERR_SHAPE_MISMATCH, "k_scale has shape [1, 2, 1]"},
      {"scales without i8", t(f.data(), MHA_DTYPE_F32), t(f.data(), MHA_DTYPE_F32),
       t(f.data(), MHA_DTYPE_F32), t(out.data(), MHA_DTYPE_F32), &tsc, &tsc, MHA_ERR_INVALID_VALUE,
       "params->k_scale is given but k and v are not i8"},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.what);
    mha_attention_params p;
    mha_attention_params_init(&p);
    p.k_scale = bad.k_scale;
    p.v_scale = bad.v_scale;
    mha_tensor q = bad.q, k = bad.k, v = bad.v, o = bad.out;
    EXPECT_EQ(mha_attention(&q, &k, &v, &o, &p), bad.status) << mha_last_error();
    EXPECT_NE(std::string(mha_last_error()).find(bad.text), std::string::npos) << mha_last_error();
    for (float x : out) ASSERT_EQ(x, -7.0f) << "a refused call wrote out";
  }
  // A mask of a dtype masks do not take.
  mha_tensor q = t(f.data(), MHA_DTYPE_F32), k = q, v = q, o = t(out.data(), MHA_DTYPE_F32);
  std::vector<int32_t> m(2 * 2, 0);
  mha_tensor mask = describe(m.data(), MHA_DTYPE_I32, {2, 2});
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.mask = &mask;
  EXPECT_EQ(mha_attention(&q, &k, &v, &o, &p), MHA_ERR_INVALID_DTYPE);
  EXPECT_NE(std::string(mha_last_error()).find("mask has dtype i32"), std::string::npos);
}

// A program built against 0.1's headers passes the older, smaller params:
// the int8 scale fields take their defaults (none).
TEST(HalfBadInput, OlderParamsSizeIsAccepted) {
  std::vector<float> f(2 * 8, 0.5f), out(2 * 8, -7.0f);
  mha_tensor q = describe(f.data(), MHA_DTYPE_F32, {1, 1, 2, 8}), k = q, v = q;
  mha_tensor o = describe(out.data(), MHA_DTYPE_F32, {1, 1, 2, 8});
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.struct_size = 56;  // 0.1's size: ends with dropout_seed
  EXPECT_EQ(mha_attention(&q, &k, &v, &o, &p), MHA_OK) << mha_last_error();
  EXPECT_FLOAT_EQ(out[0], 0.5f);
}

}  // namespace
}  // namespace mha_test
