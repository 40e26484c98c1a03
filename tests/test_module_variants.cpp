// The module's attention variants (issue 15: window, sinks, softcap, ALiBi) over
// every backend: each alone, together, with every option, their edge values, and
// the older params struct without them (the fixture Module of module_case.h).
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <iterator>
#include <utility>
#include <vector>

#include "module_case.h"

namespace mha_test {
namespace {

// Each variant alone, and all of them together, as a change to a case.
struct VariantSet {
  const char* what;
  void (*set)(ModuleCase& c);
};
const VariantSet kVariantSets[] = {
    {"window 3,1", [](ModuleCase& c) { c.window_left = 3, c.window_right = 1; }},
    {"window -1,0", [](ModuleCase& c) { c.window_right = 0; }},
    {"window 2,-1", [](ModuleCase& c) { c.window_left = 2; }},
    {"softcap 2 biting into logits of up to about 10",
     [](ModuleCase& c) { c.softcap = 2.0f, c.qk_amplitude = 6.0f; }},
    {"sinks", [](ModuleCase& c) { c.sinks = true; }},
    {"ALiBi [H]", [](ModuleCase& c) { c.alibi = true; }},
    {"ALiBi [B, H]", [](ModuleCase& c) { c.alibi = c.alibi_per_batch = true; }},
    {"all four",
     [](ModuleCase& c) {
       c.window_left = 4, c.window_right = 2, c.softcap = 3.0f, c.qk_amplitude = 3.0f;
       c.sinks = c.alibi = c.alibi_per_batch = true;
     }},
};
const VariantSet& all_variants() {
  return kVariantSets[std::size(kVariantSets) - 1];
}

TEST_P(Module, VariantsAloneAndCombined) {
  uint64_t seed = 300;
  for (const VariantSet& variant : kVariantSets) {
    SCOPED_TRACE(variant.what);
    for (int weights = 0; weights < 3; ++weights) {  // none, per head, averaged
      ModuleCase c;
      c.B = 2, c.Lq = 9, c.Lk = 12, c.E = 24, c.H = 3, c.seed = ++seed;
      variant.set(c);
      c.need_weights = weights > 0, c.average = weights == 2;
      run_case(c);
    }
  }
}

TEST_P(Module, VariantsWithEveryOption) {
  uint64_t seed = 400;
  std::vector<ModuleCase> cases;
  const auto add = [&cases, &seed]() -> ModuleCase& {
    cases.emplace_back();
    ModuleCase& c = cases.back();
    c.B = 2, c.Lq = 7, c.Lk = 10, c.E = 16, c.H = 2, c.seed = ++seed;
    all_variants().set(c);
    return c;
  };
  // Causal, both alignments, with Lq < Lk, Lq > Lk (rows without keys) and Lq = Lk.
  const std::pair<int64_t, int64_t> lengths[] = {{5, 12}, {12, 5}, {8, 8}};
  for (const int32_t causal : {MHA_CAUSAL_TOP_LEFT, MHA_CAUSAL_BOTTOM_RIGHT}) {
    for (const auto& [lq, lk] : lengths) {
      ModuleCase& c = add();
      c.causal = causal, c.Lq = lq, c.Lk = lk;
    }
  }
  for (const Lens lens : {Lens::PerBatch, Lens::PerQuery}) {  // valid lengths, 0 among them
    ModuleCase& c = add();
    c.lens = lens, c.lens_dtype = lens == Lens::PerQuery ? MHA_DTYPE_I64 : MHA_DTYPE_I32;
  }
  for (const MaskKind kind : {MaskKind::Bool, MaskKind::F32}) {
    ModuleCase& kpm = add();
    kpm.kpm = kind, kpm.kpm_dead_batch = true;  // batch 0: every key ignored
    for (const bool three_d : {false, true}) {
      ModuleCase& am = add();
      am.am = kind, am.am_3d = three_d;
    }
  }
  {
    ModuleCase& c = add();  // everything at once
    c.kpm = MaskKind::F32, c.am = MaskKind::Bool, c.am_3d = true, c.lens = Lens::PerQuery;
    c.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  }
  {
    ModuleCase& c = add();  // cross-attention: sizes and lengths differ, key = value
    c.Eq = 12, c.Ek = c.Ev = 20, c.Lq = 6, c.Lk = 15, c.inputs = Inputs::SharedKeyValue;
  }
  {
    ModuleCase& c = add();  // separate sizes, sequence-first, padded rows
    c.Eq = 10, c.Ek = 14, c.Ev = 6, c.seq_first = c.out_seq_first = true, c.pad = 3;
  }
  {
    ModuleCase& c = add();  // self-attention (the inputs' amplitude is then 1)
    c.inputs = Inputs::SelfAttention, c.Lq = c.Lk = 9, c.causal = MHA_CAUSAL_TOP_LEFT;
  }
  {
    ModuleCase& c = add();  // the weights path's query blocks (32 rows)
    c.Lq = 70, c.Lk = 40, c.kpm = MaskKind::Bool;
  }
  for (size_t n = 0; n < cases.size(); ++n) {
    for (int weights = 0; weights < 3; ++weights) {  // none, per head, averaged
      ModuleCase c = cases[n];
      c.need_weights = weights > 0, c.average = weights == 2;
      run_case(c);
    }
  }
}

TEST_P(Module, VariantsWithDropout) {
  // Training mode: the weights path drops the variants' weights by the
  // documented hash (the reference agrees element by element); the fused path
  // agrees with it, and neither depends on the thread count.
  uint64_t seed = 500;
  for (const float p : {0.2f, 0.5f}) {
    ModuleCase c;
    c.B = 2, c.Lq = 9, c.Lk = 17, c.E = 32, c.H = 4, c.training = true, c.dropout = p;
    c.kpm = MaskKind::F32, c.causal = MHA_CAUSAL_TOP_LEFT, c.seed = ++seed;
    all_variants().set(c);
    c.need_weights = true;
    std::vector<Outcome> weights;
    for (const int32_t threads : {1, 2}) {
      ASSERT_EQ(mha_set_num_threads(threads), MHA_OK);
      weights.push_back(run_case(c));
      ASSERT_TRUE(weights.back().ok);
    }
    EXPECT_TRUE(bits_equal(weights[0].out, weights[1].out)) << "same seed, 1 and 2 threads";
    EXPECT_TRUE(bits_equal(weights[0].weights, weights[1].weights));
    c.average = true;
    run_case(c);
    if (!kernel_dropout_available()) continue;
    c.need_weights = c.average = false;
    std::vector<Outcome> fused;
    for (const int32_t threads : {1, 2}) {
      ASSERT_EQ(mha_set_num_threads(threads), MHA_OK);
      fused.push_back(run_case(c));
      ASSERT_TRUE(fused.back().ok);
    }
    EXPECT_TRUE(bits_equal(fused[0].out, fused[1].out)) << "same seed, 1 and 2 threads";
    for (size_t n = 0; n < fused[0].out.size(); ++n) {
      ASSERT_LE(
          std::fabs(static_cast<double>(fused[0].out[n]) - static_cast<double>(weights[0].out[n])),
          2 * weights[0].ref.out_bound[n])
          << "fused and weights paths differ at element " << n;
    }
  }
}

TEST_P(Module, VariantsFusedAndWeightsPathsAgree) {
  ModuleCase c;
  c.B = 2, c.Lq = 9, c.Lk = 13, c.E = 32, c.H = 4, c.kpm = MaskKind::F32, c.am = MaskKind::Bool;
  c.lens = Lens::PerQuery, c.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  all_variants().set(c);
  const Outcome fused = run_case(c);
  c.need_weights = true;
  const Outcome weights = run_case(c);
  ASSERT_TRUE(fused.ok && weights.ok);
  for (size_t n = 0; n < fused.out.size(); ++n) {
    ASSERT_LE(std::fabs(static_cast<double>(fused.out[n]) - static_cast<double>(weights.out[n])),
              2 * fused.ref.out_bound[n])
        << "element " << n;
  }
}

// Weights of row (b, h, i) of a per-head outcome.
const float* weights_row_of(const Outcome& o, const ModuleCase& c, int64_t b, int64_t h,
                            int64_t i) {
  return o.weights.data() + ((b * c.H + h) * c.Lq + i) * c.Lk;
}

TEST_P(Module, VariantsEdgeValues) {
  ModuleCase base;
  base.B = 2, base.Lq = 9, base.Lk = 12, base.E = 24, base.H = 3, base.seed = 600;
  base.need_weights = true;

  {
    SCOPED_TRACE("window 0,0: the diagonal key alone, weight 1");
    ModuleCase c = base;
    c.window_left = c.window_right = 0;
    const Outcome o = run_case(c);
    ASSERT_TRUE(o.ok);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.Lq; ++i) {
          const float* row = weights_row_of(o, c, b, h, i);
          for (int64_t j = 0; j < c.Lk; ++j)
            ASSERT_EQ(row[j], j == i + c.Lk - c.Lq ? 1.0f : 0.0f) << b << "," << h << "," << i;
        }
    c.need_weights = false;
    run_case(c);
  }
  // Values that change nothing: the weights path gives the same bits as
  // without them; the fused path is checked against the reference.
  const VariantSet no_ops[] = {
      {"window wider than Lk", [](ModuleCase& c) { c.window_left = c.window_right = 1000; }},
      {"window as wide as int64 allows",
       [](ModuleCase& c) { c.window_left = c.window_right = INT64_MAX; }},
      {"sinks -inf (no sink)", [](ModuleCase& c) { c.sinks = true, c.sink_value = -INFINITY; }},
      {"sinks -1e4 (a share of e^-1e4: none)",
       [](ModuleCase& c) { c.sinks = true, c.sink_value = -1e4f; }},
      {"ALiBi slopes 0", [](ModuleCase& c) { c.alibi = true, c.slope_value = 0.0f; }},
  };
  const Outcome plain = run_case(base);
  ASSERT_TRUE(plain.ok);
  for (const VariantSet& v : no_ops) {
    SCOPED_TRACE(v.what);
    ModuleCase c = base;
    v.set(c);
    const Outcome o = run_case(c);
    ASSERT_TRUE(o.ok);
    EXPECT_TRUE(bits_equal(o.weights, plain.weights));
    EXPECT_TRUE(bits_equal(o.out, plain.out));
    c.need_weights = false;
    run_case(c);
  }
  {
    SCOPED_TRACE("sinks 1e4: the sink takes all the weight, out = out_proj.bias");
    ModuleCase c = base;
    c.sinks = true, c.sink_value = 1e4f;
    for (const bool need_weights : {true, false}) {
      c.need_weights = need_weights;
      const Outcome o = run_case(c);
      ASSERT_TRUE(o.ok);
      for (float x : o.weights) ASSERT_EQ(x, 0.0f);
      for (size_t n = 0; n < o.out.size(); ++n)
        ASSERT_EQ(o.out[n], static_cast<float>(o.ref.out[n])) << n;  // the bias, exactly
    }
  }
  {
    SCOPED_TRACE("sinks: the weights sum to 1 minus the sink's share");
    ModuleCase c = base;
    c.sinks = true, c.sink_value = 1.5f;
    const Outcome o = run_case(c);
    ASSERT_TRUE(o.ok);
    for (int64_t r = 0; r < c.B * c.H * c.Lq; ++r) {
      double sum = 0;
      for (int64_t j = 0; j < c.Lk; ++j)
        sum += static_cast<double>(o.weights[static_cast<size_t>(r * c.Lk + j)]);
      const double share = o.ref.sink_share[static_cast<size_t>(r)];
      ASSERT_GT(share, 0.01) << "row " << r;
      EXPECT_NEAR(sum, 1.0 - share, 1e-5) << "row " << r;
    }
  }
  {
    SCOPED_TRACE("rows without keys and a sink: zeros (a valid length 0, every key ignored)");
    for (const bool kpm : {false, true}) {
      ModuleCase c = base;
      c.sinks = true, c.sink_value = 2.0f;
      if (kpm) {
        c.kpm = MaskKind::Bool, c.kpm_dead_batch = true;
      } else {
        c.lens = Lens::PerBatch, c.lens_values = {0, 5};
      }
      for (const bool need_weights : {true, false}) {
        c.need_weights = need_weights;
        const Outcome o = run_case(c);
        ASSERT_TRUE(o.ok);
        EXPECT_EQ(o.ref.dead_rows, c.H * c.Lq);
        for (int64_t n = 0; n < c.H * c.Lq * c.Lk && need_weights; ++n)
          ASSERT_EQ(o.weights[static_cast<size_t>(n)], 0.0f) << n;  // batch 0
        for (int64_t n = 0; n < c.Lq * c.E; ++n)  // batch 0's output: out_proj.bias
          ASSERT_EQ(o.out[static_cast<size_t>(n)],
                    static_cast<float>(o.ref.out[static_cast<size_t>(n)]))
              << n;
      }
    }
  }
  {
    SCOPED_TRACE("softcap 20 over logits of up to about 1e4");
    ModuleCase c = base;
    c.softcap = 20.0f, c.qk_amplitude = 300.0f;
    run_case(c);
    c.need_weights = false;
    run_case(c);
    c.sinks = true, c.alibi = true, c.window_left = 5;
    run_case(c);
    c.need_weights = true, c.average = true;
    run_case(c);
  }
}

TEST_P(Module, OlderParamsSizeMeansNoVariants) {
  // 0.1's struct (64 bytes): the variants' fields past its end hold garbage
  // (a window of -7, NaN sinks and slopes, a negative softcap) and are not read.
  uint64_t seed = 700;
  for (int weights = 0; weights < 3; ++weights) {
    ModuleCase c;
    c.B = 2, c.Lq = 6, c.Lk = 9, c.E = 16, c.H = 2, c.kpm = MaskKind::Bool, c.seed = ++seed;
    c.causal = MHA_CAUSAL_TOP_LEFT, c.params_struct_64 = true;
    c.need_weights = weights > 0, c.average = weights == 2;
    const Outcome old = run_case(c);
    c.params_struct_64 = false;
    const Outcome now = run_case(c);
    ASSERT_TRUE(old.ok && now.ok);
    EXPECT_TRUE(bits_equal(old.out, now.out));
    EXPECT_TRUE(bits_equal(old.weights, now.weights));
  }
}

}  // namespace
}  // namespace mha_test
