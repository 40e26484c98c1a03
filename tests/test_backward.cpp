// mha_attention_backward on every backend: every option of the forward alone
// and combined, GQA/MQA, Lq != Lk, Dv != D, fully masked rows, dropout, the
// variants with dsinks, dmask (in place and broadcast), split key chunks --
// against the float64 analytic reference (itself checked against finite
// differences in test_reference); the same bits for 1, 2, 3 and 7 threads;
// nothing written outside the outputs; bad input refused by name.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backend_param.h"
#include "reference_backward.h"
#include "test_util.h"

namespace mha_test {
namespace {

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
    tq = describe(q.base(), MHA_DTYPE_F32, {c.B, c.H, c.Lq, c.D});
    tk = describe(k.base(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk, c.D});
    tv = describe(v.base(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk, c.Dv});
    tdout = describe(dout.base(), MHA_DTYPE_F32, {c.B, c.H, c.Lq, c.Dv});
    tout = describe(out.base(), MHA_DTYPE_F32, {c.B, c.H, c.Lq, c.Dv});
    tlse = describe(lse.base(), MHA_DTYPE_F32, {c.B, c.H, c.Lq});
    tdq = describe(dq.base(), MHA_DTYPE_F32, {c.B, c.H, c.Lq, c.D});
    tdk = describe(dk.base(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk, c.D});
    tdv = describe(dv.base(), MHA_DTYPE_F32, {c.B, c.Hkv, c.Lk, c.Dv});
    fill_uniform(tq, rng, -c.qk, c.qk);
    fill_uniform(tk, rng, -c.qk, c.qk);
    fill_uniform(tv, rng);
    fill_uniform(tdout, rng);

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

  Arena q, k, v, dout, out, lse, dq, dk, dv;
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
         " D" + std::to_string(c.D) + " Dv" + std::to_string(c.Dv);
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

  const BackwardReference ref =
      reference_backward(run.tq, run.tk, run.tv, run.tdout, &run.params, c.want_dmask);
  EXPECT_LE(max_abs_diff(run.tdq, ref.dq),
            backward_tolerance(ref.dq, ref.terms_dq, ref.max_abs_logit))
      << "dq";
  EXPECT_LE(max_abs_diff(run.tdk, ref.dk),
            backward_tolerance(ref.dk, ref.terms_dk, ref.max_abs_logit))
      << "dk";
  EXPECT_LE(max_abs_diff(run.tdv, ref.dv),
            backward_tolerance(ref.dv, ref.terms_dv, ref.max_abs_logit))
      << "dv";
  if (c.want_dsinks) {
    const double tol = backward_tolerance(ref.dsinks, ref.terms_dsinks, ref.max_abs_logit);
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
        backward_tolerance(want, ref.terms_dlogit * static_cast<double>(c.H), ref.max_abs_logit))
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

TEST_F(BackwardBadInput, HalfPrecisionNotYet) {
  std::vector<uint16_t> half(static_cast<size_t>(2 * 8 * 8), 0);
  mha_tensor hq = describe(half.data(), MHA_DTYPE_BF16, {1, 2, 8, 8});
  run.tq = hq;
  expect_refused(MHA_ERR_UNSUPPORTED, "q");
}

TEST_F(BackwardBadInput, UnknownStructSize) {
  run.backward.struct_size = 3;
  expect_refused(MHA_ERR_INVALID_PARAMS, "backward->struct_size");
}

}  // namespace
}  // namespace mha_test
