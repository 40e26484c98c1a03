// mha_attention_backward on every backend: every option of the forward alone
// and combined, GQA/MQA, Lq != Lk, Dv != D, fully masked rows, dropout, the
// variants with dsinks, dmask (in place and broadcast), split key chunks --
// against the float64 analytic reference (itself checked against finite
// differences in test_reference); the same bits for 1, 2, 3 and 7 threads;
// nothing written outside the outputs; bad input refused by name.  Half
// precision: BF16 and F16 q, k, v, out and dout with F32 or half-precision
// gradients, against the reference of the same stored values (the inputs'
// rounding is the caller's, not the kernel's error) at the fp32 tolerance
// plus one rounding of a half-precision gradient (gradient_tolerance).
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "backend_param.h"
#include "common/dtype.h"
#include "reference_backward.h"
#include "test_util.h"

namespace mha_test {
namespace {

// The dtypes of a call: the inputs (q, k and v, the forward's out, dout)
// and the gradients.
struct Dtypes {
  int32_t q = MHA_DTYPE_F32, kv = MHA_DTYPE_F32, out = MHA_DTYPE_F32, dout = MHA_DTYPE_F32;
  int32_t dq = MHA_DTYPE_F32, dk = MHA_DTYPE_F32, dv = MHA_DTYPE_F32;
  std::string describe() const {
    using mha_types::dtype_name;
    return std::string(" q ") + dtype_name(q) + " kv " + dtype_name(kv) + " out " +
           dtype_name(out) + " dout " + dtype_name(dout) + " dq " + dtype_name(dq) + " dk " +
           dtype_name(dk) + " dv " + dtype_name(dv);
  }
};

// Every input in `in`; the gradients F32, or each in its input's dtype.
Dtypes all_of(int32_t in, bool half_grads) {
  const int32_t g = half_grads ? in : MHA_DTYPE_F32;
  return Dtypes{in, in, in, in, g, g, g};
}

struct BackwardCase {
  const char* what = "";
  int64_t B = 2, H = 4, Hkv = 2, Lq = 70, Lk = 90, D = 32, Dv = 24;
  int32_t causal = MHA_CAUSAL_NONE;
  int64_t left = -1, right = -1;
  int mask = 0;          // 0 none, 1 bool [Lq, Lk], 2 additive [B, 1, Lq, Lk], 3 additive full
  bool lens = false;     // valid lengths per batch (one of them 0)
  float dropout = 0.0f;  // dropout_p
  float softcap = 0.0f;
  bool alibi = false, sinks = false;
  bool want_dmask = false, want_dsinks = false;
  float qk = 1.5f;  // Q and K uniform in [-qk, qk)
  uint64_t seed = 7;
  Dtypes dt{};
  int32_t mask_dtype = MHA_DTYPE_F32;  // of an additive mask (its values rounded to it)
};

// A buffer of `dtype` (F32, BF16, F16) holding a float tensor's values
// rounded to it; F32 keeps the float tensor itself.
struct TypedInput {
  TypedInput(const mha_tensor& values, int32_t dtype) {
    if (dtype == MHA_DTYPE_F32) {
      t = values;
    } else {
      copy.emplace_back(values, dtype);
      t = copy[0].get();
    }
  }
  std::vector<TypedCopy> copy;  // empty for F32
  mha_tensor t{};
};

// The buffers of one case: inputs, the forward's results, the gradients.
struct BackwardRun {
  explicit BackwardRun(const BackwardCase& c)
      : q(c.B * c.H * c.Lq * c.D),
        k(c.B * c.Hkv * c.Lk * c.D),
        v(c.B * c.Hkv * c.Lk * c.Dv),
        dout(c.B * c.H * c.Lq * c.Dv),
        out(c.B * c.H * c.Lq * c.Dv),
        lse(c.B * c.H * c.Lq),
        dq(c.B * c.H * c.Lq * c.D),
        dk(c.B * c.Hkv * c.Lk * c.D),
        dv(c.B * c.Hkv * c.Lk * c.Dv) {
    Rng rng(c.seed);
    const auto as = [](int32_t dtype) { return static_cast<mha_dtype>(dtype); };
    mha_tensor q32 = describe(q.base(), MHA_DTYPE_F32, {c.B, c.H, c.Lq, c.D});
    mha_tensor k32 = describe(k.base(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk, c.D});
    mha_tensor v32 = describe(v.base(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk, c.Dv});
    mha_tensor dout32 = describe(dout.base(), MHA_DTYPE_F32, {c.B, c.H, c.Lq, c.Dv});
    fill_uniform(q32, rng, -c.qk, c.qk);
    fill_uniform(k32, rng, -c.qk, c.qk);
    fill_uniform(v32, rng);
    fill_uniform(dout32, rng);
    inputs.reserve(4);  // (the descriptors point into them)
    tq = inputs.emplace_back(q32, c.dt.q).t;
    tk = inputs.emplace_back(k32, c.dt.kv).t;
    tv = inputs.emplace_back(v32, c.dt.kv).t;
    tdout = inputs.emplace_back(dout32, c.dt.dout).t;
    // The outputs live in guarded arenas in their own dtype (a half tensor
    // takes the first half of its arena's bytes).
    tout = describe(out.base(), as(c.dt.out), {c.B, c.H, c.Lq, c.Dv});
    tlse = describe(lse.base(), MHA_DTYPE_F32, {c.B, c.H, c.Lq});
    tdq = describe(dq.base(), as(c.dt.dq), {c.B, c.H, c.Lq, c.D});
    tdk = describe(dk.base(), as(c.dt.dk), {c.B, c.Hkv, c.Lk, c.D});
    tdv = describe(dv.base(), as(c.dt.dv), {c.B, c.Hkv, c.Lk, c.Dv});

    mha_attention_params_init(&params);
    params.causal = c.causal;
    params.window_left = c.left;
    params.window_right = c.right;
    params.dropout_p = c.dropout;
    params.dropout_seed = 0x5eed + c.seed;
    params.softcap = c.softcap;
    if (c.mask == 1) {
      mask_bool.resize(static_cast<size_t>(c.Lq * c.Lk));
      for (auto& m : mask_bool) m = rng.chance(0.8) ? 1 : 0;
      tmask = describe(mask_bool.data(), MHA_DTYPE_BOOL, {c.Lq, c.Lk});
    } else if (c.mask >= 2) {
      const int64_t heads = c.mask == 2 ? 1 : c.H;
      mask_add.resize(static_cast<size_t>(c.B * heads * c.Lq * c.Lk));
      for (auto& m : mask_add) m = rng.chance(0.1) ? -INFINITY : rng.uniform(-2.0f, 2.0f);
      tmask = describe(mask_add.data(), MHA_DTYPE_F32, {c.B, heads, c.Lq, c.Lk});
      if (c.mask_dtype != MHA_DTYPE_F32) {
        mask_typed.emplace_back(tmask, c.mask_dtype);
        tmask = mask_typed[0].get();
      }
      dmask.assign(mask_add.size(), -5.0f);
      tdmask = describe(dmask.data(), MHA_DTYPE_F32, {c.B, heads, c.Lq, c.Lk});
    }
    if (c.mask != 0) params.mask = &tmask;
    if (c.lens) {
      lens.resize(static_cast<size_t>(c.B));
      for (size_t b = 0; b < lens.size(); ++b) {
        lens[b] = b == 0 ? 0 : static_cast<int32_t>(rng.integer(1, c.Lk));
      }
      tlens = describe(lens.data(), MHA_DTYPE_I32, {c.B});
      params.valid_lens = &tlens;
    }
    if (c.alibi) {
      slopes.resize(static_cast<size_t>(c.H));
      for (int64_t h = 0; h < c.H; ++h) {
        slopes[static_cast<size_t>(h)] =
            std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(c.H));
      }
      tslopes = describe(slopes.data(), MHA_DTYPE_F32, {c.H});
      params.alibi_slopes = &tslopes;
    }
    if (c.sinks) {
      sinks.resize(static_cast<size_t>(c.H));
      for (auto& s : sinks) s = rng.uniform(-1.0f, 2.0f);
      sinks[0] = -INFINITY;  // no sink on head 0
      tsinks = describe(sinks.data(), MHA_DTYPE_F32, {c.H});
      params.sinks = &tsinks;
      dsinks.assign(sinks.size(), -5.0f);
      tdsinks = describe(dsinks.data(), MHA_DTYPE_F32, {c.H});
    }
    mha_backward_params_init(&backward);
    if (c.want_dmask) backward.dmask = &tdmask;
    if (c.want_dsinks) backward.dsinks = &tdsinks;
  }
  BackwardRun(const BackwardRun&) = delete;
  BackwardRun& operator=(const BackwardRun&) = delete;

  mha_status forward() {
    params.lse = &tlse;
    const mha_status s = mha_attention(&tq, &tk, &tv, &tout, &params);
    params.lse = nullptr;
    return s;
  }
  mha_status run() {
    return mha_attention_backward(&tq, &tk, &tv, &tout, &tlse, &tdout, &tdq, &tdk, &tdv, &params,
                                  &backward);
  }

  Arena q, k, v, dout, out, lse, dq, dk, dv;  // q, k, v, dout: the values, as floats
  std::vector<TypedInput> inputs;             // q, k, v, dout as passed
  std::vector<TypedCopy> mask_typed;
  mha_tensor tq{}, tk{}, tv{}, tdout{}, tout{}, tlse{}, tdq{}, tdk{}, tdv{};
  mha_attention_params params{};
  mha_backward_params backward{};
  std::vector<uint8_t> mask_bool;
  std::vector<float> mask_add, dmask, slopes, sinks, dsinks;
  std::vector<int32_t> lens;
  mha_tensor tmask{}, tdmask{}, tlens{}, tslopes{}, tsinks{}, tdsinks{};
};

std::string describe_case(const BackwardCase& c) {
  return std::string(c.what) + ": B" + std::to_string(c.B) + " H" + std::to_string(c.H) + "/" +
         std::to_string(c.Hkv) + " Lq" + std::to_string(c.Lq) + " Lk" + std::to_string(c.Lk) +
         " D" + std::to_string(c.D) + " Dv" + std::to_string(c.Dv) + c.dt.describe();
}

// The reference of a run: of the stored inputs; unless every input is F32,
// with the delta the backward takes from the out it is given
// (reference_backward.h) -- a half-precision out is rounded, and half
// inputs may take a forward that rounds P (avx512bf16's bf16 dot products:
// 4 · 2^-9 · max|V| in out): the forward's errors, not the backward's.  An
// all-F32 call keeps the exact delta: it checks the forward's out as well.
BackwardReference reference_of(const BackwardRun& run, const BackwardCase& c) {
  const bool all_f32 = c.dt.q == MHA_DTYPE_F32 && c.dt.kv == MHA_DTYPE_F32 &&
                       c.dt.out == MHA_DTYPE_F32 && c.dt.dout == MHA_DTYPE_F32;
  return reference_backward(run.tq, run.tk, run.tv, run.tdout, &run.params, c.want_dmask,
                            all_f32 ? nullptr : &run.tout);
}

// Each gradient's worst error over its tolerance (gradient_error: <= 1
// passes; a half-precision gradient's tolerance adds its one rounding).
struct GradientErrors {
  double dq, dk, dv;
};
GradientErrors errors_of(const BackwardRun& run, const BackwardReference& ref) {
  return {gradient_error(run.tdq, ref.dq, ref.terms_dq, ref.max_abs_logit),
          gradient_error(run.tdk, ref.dk, ref.terms_dk, ref.max_abs_logit),
          gradient_error(run.tdv, ref.dv, ref.terms_dv, ref.max_abs_logit)};
}

void check_case(const BackwardCase& c) {
  SCOPED_TRACE(describe_case(c));
  BackwardRun run(c);
  ASSERT_EQ(run.forward(), MHA_OK) << mha_last_error();
  const std::vector<float> dq_before = run.dq.all(), dk_before = run.dk.all(),
                           dv_before = run.dv.all();
  ASSERT_EQ(run.run(), MHA_OK) << mha_last_error();
  EXPECT_EQ(run.dq.changed_outside(run.tdq, dq_before), 0);
  EXPECT_EQ(run.dk.changed_outside(run.tdk, dk_before), 0);
  EXPECT_EQ(run.dv.changed_outside(run.tdv, dv_before), 0);

  const BackwardReference ref = reference_of(run, c);
  const GradientErrors error = errors_of(run, ref);
  EXPECT_LE(error.dq, 1.0) << "dq: worst error / tolerance";
  EXPECT_LE(error.dk, 1.0) << "dk: worst error / tolerance";
  EXPECT_LE(error.dv, 1.0) << "dv: worst error / tolerance";
  if (c.want_dsinks) {
    const double tol = gradient_tolerance(ref.dsinks, ref.terms_dsinks, ref.max_abs_logit);
    for (size_t h = 0; h < ref.dsinks.size(); ++h) {
      EXPECT_NEAR(run.dsinks[h], ref.dsinks[h], tol) << "dsinks[" << h << "]";
    }
  }
  if (c.want_dmask) {
    // dmask sums dL/dlogit over the axes the mask broadcasts (heads, for mask 2).
    const int64_t heads = c.mask == 2 ? 1 : c.H;
    std::vector<double> want(run.dmask.size(), 0.0);
    for (int64_t b = 0; b < c.B; ++b) {
      for (int64_t h = 0; h < c.H; ++h) {
        for (int64_t e = 0; e < c.Lq * c.Lk; ++e) {
          want[static_cast<size_t>((b * heads + (heads == 1 ? 0 : h)) * c.Lq * c.Lk + e)] +=
              ref.dlogit[static_cast<size_t>((b * c.H + h) * c.Lq * c.Lk + e)];
        }
      }
    }
    const mha_tensor got = describe(run.dmask.data(), MHA_DTYPE_F32, {c.B, heads, c.Lq, c.Lk});
    EXPECT_LE(
        max_abs_diff(got, want),
        gradient_tolerance(want, ref.terms_dlogit * static_cast<double>(c.H), ref.max_abs_logit))
        << "dmask";
  }
}

class Backward : public BackendTest {};

TEST_P(Backward, Plain) {
  check_case({.what = "plain"});
}
TEST_P(Backward, SquareSelfAttention) {
  check_case({.what = "square", .B = 1, .H = 2, .Hkv = 2, .Lq = 128, .Lk = 128, .D = 64, .Dv = 64});
}
TEST_P(Backward, OddSizes) {
  check_case({.what = "odd", .B = 1, .H = 3, .Hkv = 1, .Lq = 5, .Lk = 67, .D = 20, .Dv = 13});
  check_case({.what = "one query", .B = 2, .H = 2, .Hkv = 2, .Lq = 1, .Lk = 33, .D = 7, .Dv = 9});
  check_case({.what = "one key", .B = 1, .H = 2, .Hkv = 1, .Lq = 17, .Lk = 1, .D = 16, .Dv = 16});
  // Dv far above D: V's rows must not be staged in a tile sized by D.
  check_case({.what = "Dv >> D", .B = 1, .H = 1, .Hkv = 1, .Lq = 9, .Lk = 70, .D = 8, .Dv = 1500});
}
TEST_P(Backward, MultiQuery) {
  check_case({.what = "MQA", .B = 1, .H = 6, .Hkv = 1, .Lq = 40, .Lk = 100});
}
TEST_P(Backward, CausalTopLeft) {
  check_case({.what = "causal top-left", .Lq = 100, .Lk = 80, .causal = MHA_CAUSAL_TOP_LEFT});
  check_case(
      {.what = "causal top-left square", .Lq = 130, .Lk = 130, .causal = MHA_CAUSAL_TOP_LEFT});
}
TEST_P(Backward, CausalBottomRight) {
  check_case(
      {.what = "causal bottom-right", .Lq = 50, .Lk = 140, .causal = MHA_CAUSAL_BOTTOM_RIGHT});
  check_case({.what = "causal bottom-right, Lq > Lk (empty rows)",
              .Lq = 90,
              .Lk = 60,
              .causal = MHA_CAUSAL_BOTTOM_RIGHT});
}
TEST_P(Backward, ValidLengthsWithEmptyRows) {
  check_case({.what = "valid lengths", .lens = true});
}
TEST_P(Backward, BoolMask) {
  check_case({.what = "bool mask", .mask = 1});
}
TEST_P(Backward, AdditiveMaskAndItsGradient) {
  check_case({.what = "additive, broadcast over heads", .mask = 2, .want_dmask = true});
  check_case({.what = "additive, full", .mask = 3, .want_dmask = true});
}
TEST_P(Backward, Dropout) {
  check_case({.what = "dropout", .dropout = 0.3f});
  check_case({.what = "dropout, causal",
              .Lq = 80,
              .Lk = 80,
              .causal = MHA_CAUSAL_TOP_LEFT,
              .dropout = 0.1f});
}
TEST_P(Backward, SlidingWindow) {
  check_case({.what = "window", .Lq = 120, .Lk = 150, .left = 20, .right = 5});
  check_case(
      {.what = "window, causal", .Lq = 150, .Lk = 150, .causal = MHA_CAUSAL_TOP_LEFT, .left = 40});
}
TEST_P(Backward, Softcap) {
  check_case({.what = "softcap", .softcap = 2.0f, .qk = 2.0f});
}
TEST_P(Backward, Alibi) {
  check_case({.what = "alibi", .causal = MHA_CAUSAL_BOTTOM_RIGHT, .alibi = true});
}
TEST_P(Backward, SinksAndTheirGradient) {
  check_case({.what = "sinks", .lens = true, .sinks = true, .want_dsinks = true});
}
TEST_P(Backward, EverythingTogether) {
  check_case({.what = "all",
              .B = 2,
              .H = 4,
              .Hkv = 2,
              .Lq = 75,
              .Lk = 110,
              .causal = MHA_CAUSAL_BOTTOM_RIGHT,
              .left = 50,
              .mask = 2,
              .lens = true,
              .dropout = 0.2f,
              .softcap = 3.0f,
              .alibi = true,
              .sinks = true,
              .want_dmask = true,
              .want_dsinks = true});
}
TEST_P(Backward, SplitKeyChunks) {
  // One (batch, KV head) pair and 1500 keys: the runtime splits the keys
  // into chunks whose dQ shares it sums in order.
  check_case({.what = "chunks", .B = 1, .H = 2, .Hkv = 1, .Lq = 40, .Lk = 1500, .D = 16, .Dv = 16});
  check_case({.what = "chunks, causal",
              .B = 1,
              .H = 1,
              .Hkv = 1,
              .Lq = 1100,
              .Lk = 1100,
              .D = 16,
              .Dv = 8,
              .causal = MHA_CAUSAL_TOP_LEFT});
}

// The same bits for any thread count (and from run to run).
TEST_P(Backward, BitIdenticalAcrossThreadCounts) {
  const BackwardCase cases[] = {
      {.what = "heads",
       .B = 2,
       .H = 8,
       .Hkv = 4,
       .Lq = 200,
       .Lk = 200,
       .causal = MHA_CAUSAL_TOP_LEFT,
       .dropout = 0.1f},
      {.what = "chunks", .B = 1, .H = 2, .Hkv = 1, .Lq = 300, .Lk = 2100, .D = 16, .Dv = 16},
  };
  for (const BackwardCase& c : cases) {
    SCOPED_TRACE(c.what);
    BackwardRun run(c);
    ASSERT_EQ(run.forward(), MHA_OK) << mha_last_error();
    std::vector<float> first[3];
    for (int32_t threads : {1, 2, 3, 7, 2}) {
      ASSERT_EQ(mha_set_num_threads(threads), MHA_OK);
      ASSERT_EQ(run.run(), MHA_OK) << mha_last_error();
      const Arena* grads[3] = {&run.dq, &run.dk, &run.dv};
      for (int g = 0; g < 3; ++g) {
        if (first[g].empty()) {
          first[g] = grads[g]->all();
        } else {
          EXPECT_TRUE(grads[g]->bits_equal(first[g]))
              << "gradient " << g << ", " << threads << " threads";
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Backward, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

// ------------------------------------------------------------------ half precision

// The options, each with the given dtypes: plain (GQA: 4 query heads over 2
// KV heads), MQA, causal, a bool mask, an additive mask of the inputs' dtype
// with its gradient, valid lengths with an empty batch, dropout, the window,
// the variants with dsinks, and all of it together.  Shapes stay small (more
// than one key block, partial tiles): the suite also runs under qemu.
void check_options(const Dtypes& dt, bool every_option = true) {
  const BackwardCase cases[] = {
      {.what = "plain", .B = 1, .Lq = 37, .Lk = 80},
      {.what = "all",
       .Lq = 45,
       .Lk = 90,
       .causal = MHA_CAUSAL_BOTTOM_RIGHT,
       .left = 50,
       .mask = 2,
       .lens = true,
       .dropout = 0.2f,
       .softcap = 3.0f,
       .alibi = true,
       .sinks = true,
       .want_dmask = true,
       .want_dsinks = true},
      {.what = "MQA", .B = 1, .H = 3, .Hkv = 1, .Lq = 20, .Lk = 70, .D = 64, .Dv = 64},
      {.what = "causal", .B = 1, .Lq = 60, .Lk = 50, .causal = MHA_CAUSAL_TOP_LEFT},
      {.what = "bool mask", .B = 1, .Lq = 30, .Lk = 70, .mask = 1},
      {.what = "additive mask", .B = 1, .Lq = 30, .Lk = 70, .mask = 3, .want_dmask = true},
      {.what = "valid lengths", .Lq = 30, .Lk = 70, .lens = true},
      {.what = "dropout", .B = 1, .Lq = 30, .Lk = 70, .dropout = 0.3f},
      {.what = "window", .B = 1, .Lq = 60, .Lk = 90, .left = 20, .right = 5},
      {.what = "softcap", .B = 1, .Lq = 30, .Lk = 70, .softcap = 2.0f, .qk = 2.0f},
      {.what = "alibi, sinks",
       .B = 1,
       .Lq = 30,
       .Lk = 70,
       .causal = MHA_CAUSAL_BOTTOM_RIGHT,
       .alibi = true,
       .sinks = true,
       .want_dsinks = true},
  };
  for (BackwardCase c : cases) {
    c.dt = dt;
    c.mask_dtype = dt.q;  // an additive mask in q's dtype (the forward allows any float)
    check_case(c);
    if (!every_option && c.what == std::string("all")) break;
  }
}

class BackwardHalf : public BackendTest {};

// Every option with half-precision gradients; F32 gradients of the same
// inputs on the plain case and all options together (the kernels see no
// difference: only the runtime's last rounding differs).
TEST_P(BackwardHalf, Bf16) {
  check_options(all_of(MHA_DTYPE_BF16, true));
  check_options(all_of(MHA_DTYPE_BF16, false), false);
}
TEST_P(BackwardHalf, F16) {
  check_options(all_of(MHA_DTYPE_F16, true));
  check_options(all_of(MHA_DTYPE_F16, false), false);
}

// Dtypes that differ between the arguments, as the forward's rules allow
// them: F32 q over a bf16 cache; f16 q over bf16 K and V with an F32 out and
// dout; each gradient F32 or its own input's dtype.
TEST_P(BackwardHalf, MixedDtypes) {
  const int32_t f32 = MHA_DTYPE_F32, bf16 = MHA_DTYPE_BF16, f16 = MHA_DTYPE_F16;
  const Dtypes mixes[] = {
      {.q = f32, .kv = bf16, .out = f32, .dout = f32, .dq = f32, .dk = bf16, .dv = bf16},
      {.q = f16, .kv = bf16, .out = f32, .dout = f32, .dq = f16, .dk = f32, .dv = bf16},
      {.q = bf16, .kv = f16, .out = bf16, .dout = f32, .dq = f32, .dk = f16, .dv = f32},
      {.q = f16, .kv = f16, .out = f32, .dout = f16, .dq = f16, .dk = f16, .dv = f16},
  };
  for (const Dtypes& dt : mixes) {
    check_case({.what = "mixed", .B = 1, .Lq = 37, .Lk = 80, .dt = dt});
    check_case({.what = "mixed, MQA, causal",
                .B = 1,
                .H = 3,
                .Hkv = 1,
                .Lq = 40,
                .Lk = 40,
                .causal = MHA_CAUSAL_TOP_LEFT,
                .dt = dt});
  }
}

// Split key chunks (1500 keys of one KV head: 3 chunks): a half-precision
// dq is the fp32 sum of the chunks' shares, rounded once; and the same bits
// for any thread count.
TEST_P(BackwardHalf, SplitKeyChunks) {
  for (const int32_t in : {MHA_DTYPE_BF16, MHA_DTYPE_F16}) {
    check_case({.what = "chunks",
                .B = 1,
                .H = 2,
                .Hkv = 1,
                .Lq = 20,
                .Lk = 1500,
                .D = 16,
                .Dv = 16,
                .dt = all_of(in, true)});
  }
}

TEST_P(BackwardHalf, BitIdenticalAcrossThreadCounts) {
  for (const int32_t in : {MHA_DTYPE_BF16, MHA_DTYPE_F16}) {
    const BackwardCase c{.what = "chunks",
                         .B = 1,
                         .H = 2,
                         .Hkv = 1,
                         .Lq = 70,
                         .Lk = 1100,
                         .D = 16,
                         .Dv = 16,
                         .dt = all_of(in, true)};
    SCOPED_TRACE(describe_case(c));
    BackwardRun run(c);
    ASSERT_EQ(run.forward(), MHA_OK) << mha_last_error();
    std::vector<float> first[3];
    for (int32_t threads : {1, 2, 3}) {
      ASSERT_EQ(mha_set_num_threads(threads), MHA_OK);
      ASSERT_EQ(run.run(), MHA_OK) << mha_last_error();
      const Arena* grads[3] = {&run.dq, &run.dk, &run.dv};
      for (int g = 0; g < 3; ++g) {
        if (first[g].empty()) {
          first[g] = grads[g]->all();
        } else {
          EXPECT_TRUE(grads[g]->bits_equal(first[g]))
              << "gradient " << g << ", " << threads << " threads";
        }
      }
    }
    ASSERT_EQ(mha_set_num_threads(0), MHA_OK);
  }
}

// The check above can fail: dout stored as one half type but read as the
// other (q's) -- what a kernel that took q's dtype for dout's would compute
// -- puts dq, dk and dv far outside the tolerance, on every backend.  Only
// dout's reading differs between the call and the reference.
TEST_P(BackwardHalf, DoutReadAsTheWrongDtypeIsCaught) {
  for (const int32_t in : {MHA_DTYPE_BF16, MHA_DTYPE_F16}) {
    const int32_t other = in == MHA_DTYPE_BF16 ? MHA_DTYPE_F16 : MHA_DTYPE_BF16;
    const BackwardCase c{.what = "mutation",
                         .B = 1,
                         .Lq = 37,
                         .Lk = 80,
                         .dt = {.q = in, .kv = in, .out = in, .dout = other}};
    SCOPED_TRACE(describe_case(c));
    BackwardRun run(c);
    ASSERT_EQ(run.forward(), MHA_OK) << mha_last_error();
    const mha_tensor stored = run.tdout;
    run.tdout.dtype = in;  // the misreading
    ASSERT_EQ(run.run(), MHA_OK) << mha_last_error();
    run.tdout = stored;
    const BackwardReference ref = reference_of(run, c);
    const GradientErrors error = errors_of(run, ref);
    EXPECT_GT(error.dq, 1.0);
    EXPECT_GT(error.dk, 1.0);
    EXPECT_GT(error.dv, 1.0);
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackwardHalf, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

// ------------------------------------------------------------------ bad input

class BackwardBadInput : public ::testing::Test {
 protected:
  BackwardBadInput()
      : run(BackwardCase{
            .what = "bad", .B = 1, .H = 2, .Hkv = 1, .Lq = 8, .Lk = 8, .D = 8, .Dv = 8}) {}
  void expect_refused(mha_status want, const char* names) {
    EXPECT_EQ(run.run(), want);
    EXPECT_NE(std::string(mha_last_error()).find(names), std::string::npos) << mha_last_error();
  }
  BackwardRun run;
};

TEST_F(BackwardBadInput, NullAndShapes) {
  EXPECT_EQ(mha_attention_backward(&run.tq, &run.tk, &run.tv, &run.tout, &run.tlse, &run.tdout,
                                   nullptr, &run.tdk, &run.tdv, nullptr, nullptr),
            MHA_ERR_NULL_POINTER);
  EXPECT_NE(std::string(mha_last_error()).find("dq"), std::string::npos);
  run.tdq.shape[3] = 4;
  expect_refused(MHA_ERR_SHAPE_MISMATCH, "dq");
  run.tdq.shape[3] = 8;
  run.tlse.shape[2] = 7;
  expect_refused(MHA_ERR_SHAPE_MISMATCH, "lse");
  run.tlse.shape[2] = 8;
  run.tdout.shape[2] = 7;
  expect_refused(MHA_ERR_SHAPE_MISMATCH, "dout");
}

TEST_F(BackwardBadInput, Overlaps) {
  mha_tensor dk_over_q = run.tq;
  dk_over_q.shape[1] = 1;
  run.tdk = dk_over_q;
  expect_refused(MHA_ERR_OVERLAP, "dk");
}

TEST_F(BackwardBadInput, GradientsWithoutTheirInputs) {
  std::vector<float> room(2, 0.0f);
  mha_tensor dsinks = describe(room.data(), MHA_DTYPE_F32, {2});
  run.backward.dsinks = &dsinks;
  expect_refused(MHA_ERR_INVALID_VALUE, "dsinks");
  run.backward.dsinks = nullptr;
  run.backward.dmask = &dsinks;
  expect_refused(MHA_ERR_INVALID_VALUE, "dmask");
}

// Dtypes the backward does not take, each refused by name with the
// gradients untouched: the forward's mixtures (k and v differ, out neither
// f32 nor q's dtype), dout neither f32 nor q's dtype, a gradient neither f32
// nor its input's dtype, and an int8 KV cache.
TEST_F(BackwardBadInput, DtypesRefusedByName) {
  std::vector<uint16_t> half(static_cast<size_t>(2 * 8 * 8), 0x3C00);  // 1.0 in f16
  std::vector<uint16_t> kv_half(static_cast<size_t>(8 * 8), 0x3C00);
  std::vector<int8_t> kv_i8(static_cast<size_t>(8 * 8), 1);
  std::vector<float> scales(8, 1.0f);
  const auto t = [](void* data, int32_t dtype, const std::vector<int64_t>& shape) {
    return describe(data, static_cast<mha_dtype>(dtype), shape);
  };
  const mha_tensor q_f16 = t(half.data(), MHA_DTYPE_F16, {1, 2, 8, 8});
  const mha_tensor kv_f16 = t(kv_half.data(), MHA_DTYPE_F16, {1, 1, 8, 8});
  const mha_tensor kv_bf16 = t(kv_half.data(), MHA_DTYPE_BF16, {1, 1, 8, 8});
  const mha_tensor kv_int8 = t(kv_i8.data(), MHA_DTYPE_I8, {1, 1, 8, 8});
  mha_tensor scale = describe(scales.data(), MHA_DTYPE_F32, {1, 1, 8});
  struct Bad {
    const char* what;
    std::function<void(BackwardRun&)> change;
    mha_status status;
    const char* text;
  };
  const Bad cases[] = {
      {"k and v differ", [&](BackwardRun& r) { r.tk = kv_f16; }, MHA_ERR_INVALID_DTYPE,
       "v has dtype f32 but k has f16"},
      {"out bf16 for f16 q",
       [&](BackwardRun& r) {
         r.tq = q_f16;
         r.tout.dtype = MHA_DTYPE_BF16;
       },
       MHA_ERR_INVALID_DTYPE, "out has dtype bf16; it must be f32 or q's dtype (f16)"},
      {"dout f16 for f32 q", [&](BackwardRun& r) { r.tdout.dtype = MHA_DTYPE_F16; },
       MHA_ERR_INVALID_DTYPE, "dout has dtype f16; it must be f32 or q's dtype (f32)"},
      {"dout bf16 for f16 q",
       [&](BackwardRun& r) {
         r.tq = q_f16;
         r.tdout.dtype = MHA_DTYPE_BF16;
       },
       MHA_ERR_INVALID_DTYPE, "dout has dtype bf16; it must be f32 or q's dtype (f16)"},
      {"dq bf16 for f16 q",
       [&](BackwardRun& r) {
         r.tq = q_f16;
         r.tdq.dtype = MHA_DTYPE_BF16;
       },
       MHA_ERR_INVALID_DTYPE, "dq has dtype bf16; it must be f32 or q's dtype (f16)"},
      {"dk f16 for bf16 k",
       [&](BackwardRun& r) {
         r.tk = kv_bf16;
         r.tv = kv_bf16;
         r.tdk.dtype = MHA_DTYPE_F16;
       },
       MHA_ERR_INVALID_DTYPE, "dk has dtype f16; it must be f32 or k's dtype (bf16)"},
      {"dv bf16 for f32 v", [&](BackwardRun& r) { r.tdv.dtype = MHA_DTYPE_BF16; },
       MHA_ERR_INVALID_DTYPE, "dv has dtype bf16; it must be f32 or v's dtype (f32)"},
      {"dq i32", [&](BackwardRun& r) { r.tdq.dtype = MHA_DTYPE_I32; }, MHA_ERR_INVALID_DTYPE,
       "dq has dtype i32"},
      {"int8 K and V",
       [&](BackwardRun& r) {
         r.tk = kv_int8;
         r.tv = kv_int8;
         r.params.k_scale = &scale;
         r.params.v_scale = &scale;
       },
       MHA_ERR_UNSUPPORTED, "k and v are I8"},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.what);
    BackwardRun r(
        BackwardCase{.what = "bad", .B = 1, .H = 2, .Hkv = 1, .Lq = 8, .Lk = 8, .D = 8, .Dv = 8});
    bad.change(r);
    const std::vector<float> dq = r.dq.all(), dk = r.dk.all(), dv = r.dv.all();
    EXPECT_EQ(r.run(), bad.status) << mha_last_error();
    EXPECT_NE(std::string(mha_last_error()).find(bad.text), std::string::npos) << mha_last_error();
    EXPECT_TRUE(r.dq.bits_equal(dq) && r.dk.bits_equal(dk) && r.dv.bits_equal(dv))
        << "a refused call wrote a gradient";
  }
}

TEST_F(BackwardBadInput, UnknownStructSize) {
  run.backward.struct_size = 3;
  expect_refused(MHA_ERR_INVALID_PARAMS, "backward->struct_size");
}

}  // namespace
}  // namespace mha_test
