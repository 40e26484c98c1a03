// A call as one block of a larger problem (mha_attention_params'
// query_offset, key_offset, full_lq, full_lk): on every backend, each block
// against the float64 reference of that block, and the blocks of a cut
// problem merged by their LSE (mha_merge_partials) against the whole call --
// causal in both alignments, the window, ALiBi, softcap, dropout, GQA, the
// decode layout, half precision.  The backward of the blocks, given the
// whole call's out and LSE, sums to the whole backward.  Blocks that do not
// fit are refused by name.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "backend_param.h"
#include "checked_call.h"
#include "reference.h"
#include "reference_backward.h"
#include "test_util.h"

namespace mha_test {
namespace {

struct BlockCase {
  const char* what = "";
  int64_t B = 2, H = 4, Hkv = 2, Lq = 150, Lk = 170, D = 32, Dv = 24;
  std::vector<int64_t> q_cuts{0, 37, 100, 150};  // query blocks [cuts[i], cuts[i + 1])
  std::vector<int64_t> k_cuts{0, 64, 65, 170};   // key blocks
  int32_t causal = MHA_CAUSAL_NONE;
  int64_t left = -1, right = -1;
  bool alibi = false;
  float softcap = 0.0f;
  float dropout = 0.0f;
  int32_t dtype = MHA_DTYPE_F32;
};

// Rows [begin, begin + count) of dimension 2.
mha_tensor rows(const mha_tensor& t, int64_t begin, int64_t count) {
  mha_tensor view = t;
  view.data = static_cast<char*>(t.data) + begin * t.strides[2] * element_bytes(t.dtype);
  view.shape[2] = count;
  return view;
}

std::vector<float> alibi_slopes(int64_t heads) {
  std::vector<float> slopes(static_cast<size_t>(heads));
  for (int64_t h = 0; h < heads; ++h) {
    slopes[static_cast<size_t>(h)] =
        std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(heads));
  }
  return slopes;
}

// The problem's params (no output fields).
mha_attention_params params_of(const BlockCase& c, const mha_tensor* slopes) {
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.causal = c.causal;
  p.window_left = c.left;
  p.window_right = c.right;
  p.softcap = c.softcap;
  p.dropout_p = c.dropout;
  p.dropout_seed = 1234;
  if (c.alibi) p.alibi_slopes = slopes;
  return p;
}

void run_block_case(const BlockCase& c) {
  SCOPED_TRACE(std::string(c.what) + ": Lq " + std::to_string(c.Lq) + " Lk " +
               std::to_string(c.Lk));
  Rng rng(7);
  RandomInputs in(rng, Layout::BHLD, c.B, c.H, c.Hkv, c.Lq, c.Lk, c.D, c.Dv);
  TypedCopy q(in.tq, c.dtype), k(in.tk, c.dtype), v(in.tv, c.dtype);
  std::vector<float> slopes = alibi_slopes(c.H);
  mha_tensor slopes_t = describe(slopes.data(), MHA_DTYPE_F32, {c.H});
  const mha_attention_params base = params_of(c, &slopes_t);
  const char* backend = mha_selected_backend();
  ASSERT_NE(backend, nullptr);

  // The whole call.
  std::vector<float> whole(static_cast<size_t>(c.B * c.H * c.Lq * c.Dv));
  std::vector<float> whole_lse(static_cast<size_t>(c.B * c.H * c.Lq));
  mha_tensor whole_t = describe(whole.data(), MHA_DTYPE_F32, {c.B, c.H, c.Lq, c.Dv});
  mha_tensor whole_lse_t = describe(whole_lse.data(), MHA_DTYPE_F32, {c.B, c.H, c.Lq});
  mha_attention_params whole_params = base;
  whole_params.lse = &whole_lse_t;
  ASSERT_EQ(mha_attention(&q.get(), &k.get(), &v.get(), &whole_t, &whole_params), MHA_OK)
      << mha_last_error();
  mha_attention_params no_dropout = base;
  no_dropout.dropout_p = 0.0f;
  const Reference whole_ref = reference_attention(q.get(), k.get(), v.get(), &no_dropout);
  const double tol = tolerance_for(backend, c.dtype, c.dtype, whole_ref, MHA_DTYPE_F32) /
                     (1.0 - static_cast<double>(c.dropout));

  for (size_t qb = 0; qb + 1 < c.q_cuts.size(); ++qb) {
    const int64_t q0 = c.q_cuts[qb], nq = c.q_cuts[qb + 1] - q0;
    const mha_tensor q_rows = rows(q.get(), q0, nq);
    std::vector<std::vector<float>> outs, lses;
    std::vector<mha_tensor> out_ts, lse_ts;
    for (size_t kb = 0; kb + 1 < c.k_cuts.size(); ++kb) {
      const int64_t k0 = c.k_cuts[kb], nk = c.k_cuts[kb + 1] - k0;
      SCOPED_TRACE("block q [" + std::to_string(q0) + ", +" + std::to_string(nq) + ") k [" +
                   std::to_string(k0) + ", +" + std::to_string(nk) + ")");
      const mha_tensor k_rows = rows(k.get(), k0, nk), v_rows = rows(v.get(), k0, nk);
      outs.emplace_back(static_cast<size_t>(c.B * c.H * nq * c.Dv), -7.0f);
      lses.emplace_back(static_cast<size_t>(c.B * c.H * nq), -7.0f);
      out_ts.push_back(describe(outs.back().data(), MHA_DTYPE_F32, {c.B, c.H, nq, c.Dv}));
      lse_ts.push_back(describe(lses.back().data(), MHA_DTYPE_F32, {c.B, c.H, nq}));
      mha_attention_params p = base;
      p.query_offset = q0;
      p.key_offset = k0;
      p.full_lq = c.Lq;
      p.full_lk = c.Lk;
      p.lse = &lse_ts.back();
      ASSERT_EQ(mha_attention(&q_rows, &k_rows, &v_rows, &out_ts.back(), &p), MHA_OK)
          << mha_last_error();
      if (c.dropout == 0.0f) {  // the block alone, against the reference of that block
        const Reference ref = reference_attention(q_rows, k_rows, v_rows, &p);
        EXPECT_LE(max_abs_error(out_ts.back(), ref),
                  tolerance_for(backend, c.dtype, c.dtype, ref, MHA_DTYPE_F32));
        for (size_t r = 0; r < ref.lse.size(); ++r) {
          const double want = ref.lse[r], got = static_cast<double>(lses.back()[r]);
          if (std::isinf(want)) {
            ASSERT_EQ(got, want) << "lse row " << r;
          } else {
            ASSERT_NEAR(got, want, lse_tolerance(ref, want)) << "lse row " << r;
          }
        }
      }
    }
    // The key blocks merged: the whole call's rows.
    std::vector<float> merged(static_cast<size_t>(c.B * c.H * nq * c.Dv));
    std::vector<float> merged_lse(static_cast<size_t>(c.B * c.H * nq));
    mha_tensor merged_t = describe(merged.data(), MHA_DTYPE_F32, {c.B, c.H, nq, c.Dv});
    mha_tensor merged_lse_t = describe(merged_lse.data(), MHA_DTYPE_F32, {c.B, c.H, nq});
    ASSERT_EQ(mha_merge_partials(static_cast<int32_t>(out_ts.size()), out_ts.data(), lse_ts.data(),
                                 &merged_t, &merged_lse_t),
              MHA_OK)
        << mha_last_error();
    double worst = 0, worst_lse = 0;
    for (int64_t bh = 0; bh < c.B * c.H; ++bh) {
      for (int64_t i = 0; i < nq; ++i) {
        const size_t row = static_cast<size_t>(bh * nq + i);
        const size_t whole_row = static_cast<size_t>(bh * c.Lq + q0 + i);
        for (int64_t x = 0; x < c.Dv; ++x) {
          worst = std::max(
              worst, static_cast<double>(std::fabs(
                         merged[row * static_cast<size_t>(c.Dv) + static_cast<size_t>(x)] -
                         whole[whole_row * static_cast<size_t>(c.Dv) + static_cast<size_t>(x)])));
        }
        const float a = merged_lse[row], b = whole_lse[whole_row];
        if (std::isinf(b) || std::isinf(a)) {
          EXPECT_EQ(a, b) << "lse of row " << q0 + i;
        } else {
          worst_lse = std::max(worst_lse, static_cast<double>(std::fabs(a - b)));
        }
      }
    }
    EXPECT_LE(worst, 2 * tol) << "merged blocks against the whole call, query block " << qb;
    EXPECT_LE(worst_lse, 2 * lse_tolerance(whole_ref, 30.0)) << "merged LSE, query block " << qb;
  }
}

class Blocks : public BackendTest {};

TEST_P(Blocks, MergedBlocksEqualTheWholeCall) {
  std::vector<BlockCase> cases(12);
  cases[0].what = "no rule of positions";
  cases[1].what = "causal, top-left", cases[1].causal = MHA_CAUSAL_TOP_LEFT;
  cases[2].what = "causal, bottom-right", cases[2].causal = MHA_CAUSAL_BOTTOM_RIGHT;
  cases[3].what = "causal, bottom-right, Lq > Lk", cases[3].causal = MHA_CAUSAL_BOTTOM_RIGHT;
  cases[3].Lq = 170, cases[3].Lk = 150, cases[3].q_cuts = {0, 64, 170};
  cases[3].k_cuts = {0, 1, 100, 150};
  cases[4].what = "window and causal", cases[4].causal = MHA_CAUSAL_BOTTOM_RIGHT;
  cases[4].left = 40;
  cases[5].what = "window on both sides", cases[5].left = 20, cases[5].right = 9;
  cases[6].what = "ALiBi and softcap", cases[6].alibi = true, cases[6].softcap = 5.0f;
  cases[6].causal = MHA_CAUSAL_TOP_LEFT;
  cases[7].what = "dropout", cases[7].dropout = 0.3f, cases[7].causal = MHA_CAUSAL_BOTTOM_RIGHT;
  cases[8].what = "decode: one query, many key blocks", cases[8].Lq = 1, cases[8].Lk = 600;
  cases[8].q_cuts = {0, 1}, cases[8].k_cuts = {0, 100, 300, 301, 600}, cases[8].H = 8;
  cases[8].alibi = true, cases[8].dropout = 0.2f;
  cases[9].what = "bf16, causal", cases[9].dtype = MHA_DTYPE_BF16;
  cases[9].causal = MHA_CAUSAL_TOP_LEFT;
  cases[10].what = "long: split-KV inside a block", cases[10].Lq = 40, cases[10].Lk = 5000;
  cases[10].q_cuts = {0, 40}, cases[10].k_cuts = {0, 2500, 5000}, cases[10].B = 1;
  cases[10].causal = MHA_CAUSAL_BOTTOM_RIGHT, cases[10].alibi = true;
  // Later query blocks lie wholly right of the first key block's window: no
  // key of it is visible to them (their key ranges once ran backwards).
  cases[11].what = "window's left edge only", cases[11].left = 20;
  for (const BlockCase& c : cases) run_block_case(c);
}

// A one-key block that no query of the block sees (the window's left edge
// past it, no right edge): zeros and an LSE of -inf, nothing read outside the
// one-element K and V (a fuzzer finding: the items' key ranges ran backwards,
// and every backend read K and V rows before and after them).
TEST_P(Blocks, BlockLeftOfTheWindowReadsNothingOutside) {
  std::vector<float> q{0.3f}, k{-0.2f}, v{0.7f}, out{123.0f}, lse{123.0f}, slope{0.5f};
  const mha_tensor tq = describe(q.data(), MHA_DTYPE_F32, {1, 1, 1, 1});
  const mha_tensor tk = describe(k.data(), MHA_DTYPE_F32, {1, 1, 1, 1});
  const mha_tensor tv = describe(v.data(), MHA_DTYPE_F32, {1, 1, 1, 1});
  mha_tensor tout = describe(out.data(), MHA_DTYPE_F32, {1, 1, 1, 1});
  mha_tensor tlse = describe(lse.data(), MHA_DTYPE_F32, {1, 1, 1});
  const mha_tensor tslope = describe(slope.data(), MHA_DTYPE_F32, {1});
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.lse = &tlse;
  p.query_offset = 32;  // full_lq 0: the block ends the problem (33 queries)
  p.key_offset = 20;
  p.full_lk = 48;
  p.window_left = 9;  // query 32 sees keys from 32 + 48 - 33 - 9 = 38 on
  p.alibi_slopes = &tslope;
  ASSERT_EQ(mha_attention(&tq, &tk, &tv, &tout, &p), MHA_OK) << mha_last_error();
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(lse[0], -INFINITY);
}

// The backward of the blocks, each given the whole call's out and LSE rows,
// sums to the whole backward: dQ over key blocks, dK and dV over query
// blocks (ring attention's backward).
TEST_P(Blocks, BackwardOfTheBlocksSumsToTheWholeBackward) {
  BlockCase c;
  c.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  c.alibi = true;
  c.dropout = 0.25f;
  c.left = 60;
  Rng rng(11);
  RandomInputs in(rng, Layout::BHLD, c.B, c.H, c.Hkv, c.Lq, c.Lk, c.D, c.Dv);
  std::vector<float> dout(static_cast<size_t>(c.B * c.H * c.Lq * c.Dv));
  for (float& x : dout) x = rng.uniform();
  const mha_tensor dout_t = describe(dout.data(), MHA_DTYPE_F32, {c.B, c.H, c.Lq, c.Dv});
  std::vector<float> slopes = alibi_slopes(c.H);
  mha_tensor slopes_t = describe(slopes.data(), MHA_DTYPE_F32, {c.H});
  const mha_attention_params base = params_of(c, &slopes_t);

  std::vector<float> out(static_cast<size_t>(c.B * c.H * c.Lq * c.Dv));
  std::vector<float> lse(static_cast<size_t>(c.B * c.H * c.Lq));
  mha_tensor out_t = describe(out.data(), MHA_DTYPE_F32, {c.B, c.H, c.Lq, c.Dv});
  mha_tensor lse_t = describe(lse.data(), MHA_DTYPE_F32, {c.B, c.H, c.Lq});
  mha_attention_params forward = base;
  forward.lse = &lse_t;
  ASSERT_EQ(mha_attention(&in.tq, &in.tk, &in.tv, &out_t, &forward), MHA_OK) << mha_last_error();

  // The blocks' gradients, summed in fp64.
  std::vector<double> dq(static_cast<size_t>(c.B * c.H * c.Lq * c.D), 0.0);
  std::vector<double> dk(static_cast<size_t>(c.B * c.Hkv * c.Lk * c.D), 0.0);
  std::vector<double> dv(static_cast<size_t>(c.B * c.Hkv * c.Lk * c.Dv), 0.0);
  for (size_t qb = 0; qb + 1 < c.q_cuts.size(); ++qb) {
    const int64_t q0 = c.q_cuts[qb], nq = c.q_cuts[qb + 1] - q0;
    for (size_t kb = 0; kb + 1 < c.k_cuts.size(); ++kb) {
      const int64_t k0 = c.k_cuts[kb], nk = c.k_cuts[kb + 1] - k0;
      std::vector<float> bq(static_cast<size_t>(c.B * c.H * nq * c.D));
      std::vector<float> bk(static_cast<size_t>(c.B * c.Hkv * nk * c.D));
      std::vector<float> bv(static_cast<size_t>(c.B * c.Hkv * nk * c.Dv));
      mha_tensor bq_t = describe(bq.data(), MHA_DTYPE_F32, {c.B, c.H, nq, c.D});
      mha_tensor bk_t = describe(bk.data(), MHA_DTYPE_F32, {c.B, c.Hkv, nk, c.D});
      mha_tensor bv_t = describe(bv.data(), MHA_DTYPE_F32, {c.B, c.Hkv, nk, c.Dv});
      const mha_tensor qr = rows(in.tq, q0, nq), kr = rows(in.tk, k0, nk), vr = rows(in.tv, k0, nk);
      const mha_tensor outr = rows(out_t, q0, nq), doutr = rows(dout_t, q0, nq);
      mha_tensor lser = lse_t;
      lser.data = lse.data() + q0;
      lser.shape[2] = nq;
      mha_attention_params p = base;
      p.query_offset = q0;
      p.key_offset = k0;
      p.full_lq = c.Lq;
      p.full_lk = c.Lk;
      ASSERT_EQ(mha_attention_backward(&qr, &kr, &vr, &outr, &lser, &doutr, &bq_t, &bk_t, &bv_t, &p,
                                       nullptr),
                MHA_OK)
          << mha_last_error();
      for (int64_t bh = 0; bh < c.B * c.H; ++bh) {
        for (int64_t i = 0; i < nq * c.D; ++i) {
          dq[static_cast<size_t>((bh * c.Lq + q0) * c.D + i)] +=
              static_cast<double>(bq[static_cast<size_t>(bh * nq * c.D + i)]);
        }
      }
      for (int64_t bh = 0; bh < c.B * c.Hkv; ++bh) {
        for (int64_t j = 0; j < nk * c.D; ++j) {
          dk[static_cast<size_t>((bh * c.Lk + k0) * c.D + j)] +=
              static_cast<double>(bk[static_cast<size_t>(bh * nk * c.D + j)]);
        }
        for (int64_t j = 0; j < nk * c.Dv; ++j) {
          dv[static_cast<size_t>((bh * c.Lk + k0) * c.Dv + j)] +=
              static_cast<double>(bv[static_cast<size_t>(bh * nk * c.Dv + j)]);
        }
      }
    }
  }
  const BackwardReference ref = reference_backward(in.tq, in.tk, in.tv, dout_t, &base);
  const auto worst = [](const std::vector<double>& got, const std::vector<double>& want) {
    double w = 0;
    for (size_t i = 0; i < got.size(); ++i) w = std::max(w, std::fabs(got[i] - want[i]));
    return w;
  };
  // Each gradient is a sum of the blocks' fp32 results: at most a few
  // roundings more than one call's.
  EXPECT_LE(worst(dq, ref.dq), 2 * gradient_tolerance(ref.dq, ref.terms_dq, ref.max_abs_logit));
  EXPECT_LE(worst(dk, ref.dk), 2 * gradient_tolerance(ref.dk, ref.terms_dk, ref.max_abs_logit));
  EXPECT_LE(worst(dv, ref.dv), 2 * gradient_tolerance(ref.dv, ref.terms_dv, ref.max_abs_logit));
}

INSTANTIATE_TEST_SUITE_P(Backends, Blocks, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

// A block that does not lie inside its full problem, named.
TEST(BlockBadInput, RefusedByName) {
  Rng rng(3);
  RandomInputs in(rng, Layout::BHLD, 1, 2, 2, 10, 12, 8, 8);
  std::vector<float> out(1 * 2 * 10 * 8, -7.0f);
  const std::vector<float> before = out;
  mha_tensor out_t = describe(out.data(), MHA_DTYPE_F32, {1, 2, 10, 8});
  const struct {
    int64_t query_offset, key_offset, full_lq, full_lk;
    const char* named;
  } bad[] = {{-1, 0, 0, 0, "query_offset"},
             {0, -5, 0, 0, "key_offset"},
             {5, 0, 14, 0, "full_lq"},
             {0, 3, 0, 14, "full_lk"},
             {0, 0, -2, 0, "full_lq"},
             {0, 0, 0, MHA_MAX_EXTENT + 1, "full_lk"},
             {MHA_MAX_EXTENT + 1, 0, 0, 0, "query_offset"}};
  for (const auto& b : bad) {
    mha_attention_params p;
    mha_attention_params_init(&p);
    p.query_offset = b.query_offset;
    p.key_offset = b.key_offset;
    p.full_lq = b.full_lq;
    p.full_lk = b.full_lk;
    EXPECT_EQ(mha_attention(&in.tq, &in.tk, &in.tv, &out_t, &p), MHA_ERR_INVALID_VALUE);
    EXPECT_NE(std::string(mha_last_error()).find(b.named), std::string::npos) << mha_last_error();
    EXPECT_EQ(out, before) << "a refused call wrote out";
  }
  // The defaults (0 full lengths) with offsets: the block ends the problem.
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.query_offset = 90;
  p.key_offset = 100;
  p.causal = MHA_CAUSAL_TOP_LEFT;  // query 90.. sees keys up to itself: none past key 99
  ASSERT_EQ(mha_attention(&in.tq, &in.tk, &in.tv, &out_t, &p), MHA_OK) << mha_last_error();
  for (float x : out) EXPECT_EQ(x, 0.0f) << "no key is visible to any query of the block";
}

}  // namespace
}  // namespace mha_test
