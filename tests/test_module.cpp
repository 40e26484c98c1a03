// The multi-head attention module (mha_module_*) against the float64
// reference of module_reference.h, over every backend this CPU can run:
// configurations, weight names, layouts, every mask kind, attention weights,
// threads, dropout.  The same fixture's attention variants are in
// test_module_variants.cpp; the positional encoding, bad input, the C++
// wrapper and `mha-run module` in files of their own.  Each call also checks
// that nothing outside the outputs was written and that the inputs were not
// modified (module_case.h).
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include "module_case.h"

namespace mha_test {
namespace {

// ------------------------------------------------------------------ the cases

TEST_P(Module, D2lExample) {
  // d2l.ai: num_hiddens 100, 5 heads, X = ones(2, 4, 100), Y = ones(2, 6, 100),
  // valid_lens [3, 2], eval mode; d2l's names and its default bias=False.
  for (const mha_dtype dtype : {MHA_DTYPE_I32, MHA_DTYPE_I64}) {
    for (const bool need_weights : {false, true}) {
      ModuleCase c;
      c.B = 2, c.Lq = 4, c.Lk = 6, c.E = 100, c.H = 5, c.bias = false, c.d2l_names = true;
      c.ones_inputs = true, c.inputs = Inputs::SharedKeyValue;
      c.lens = Lens::PerBatch, c.lens_dtype = dtype, c.lens_values = {3, 2};
      c.need_weights = need_weights;
      const Outcome o = run_case(c);
      ASSERT_TRUE(o.ok);
      EXPECT_EQ(o.out.size(), size_t{2 * 4 * 100});  // (2, 4, 100), as d2l prints
      if (need_weights) {  // keys at or past the valid length have weight 0, exactly
        for (int64_t b = 0; b < 2; ++b)
          for (int64_t h = 0; h < 5; ++h)
            for (int64_t i = 0; i < 4; ++i)
              for (int64_t j = b == 0 ? 3 : 2; j < 6; ++j)
                EXPECT_EQ(o.weights[static_cast<size_t>(((b * 5 + h) * 4 + i) * 6 + j)], 0.0f);
      }
    }
  }
  ModuleCase c;  // the same with random inputs and biases
  c.B = 2, c.Lq = 4, c.Lk = 6, c.E = 100, c.H = 5, c.d2l_names = true;
  c.lens = Lens::PerBatch, c.lens_values = {3, 2};
  run_case(c);
}

TEST_P(Module, PyTorchNames) {
  uint64_t seed = 10;
  for (const bool bias : {true, false}) {
    for (const bool separate : {false, true}) {
      for (const bool transposed : {false, true}) {
        ModuleCase c;
        c.B = 3, c.Lq = 7, c.Lk = 9, c.E = 32, c.H = 4, c.bias = bias, c.separate_proj = separate;
        c.transposed_weight_storage = transposed, c.seed = ++seed;
        run_case(c);
      }
    }
  }
}

TEST_P(Module, QueryKeyValueSizesDiffer) {
  uint64_t seed = 20;
  const int64_t dims[][3] = {{12, 20, 7}, {16, 5, 5}, {3, 16, 40}, {1, 1, 1}};
  for (const auto& dim : dims) {
    for (const bool bias : {true, false}) {
      for (const bool d2l : {false, true}) {
        ModuleCase c;
        c.B = 2, c.Lq = 6, c.Lk = 11, c.E = 16, c.H = 2, c.Eq = dim[0], c.Ek = dim[1],
        c.Ev = dim[2];
        c.bias = bias, c.d2l_names = d2l, c.seed = ++seed;
        run_case(c);
      }
    }
  }
  ModuleCase c;  // key = value with their own size
  c.B = 2, c.Lq = 3, c.Lk = 8, c.E = 24, c.H = 6, c.Eq = 10, c.Ek = 13, c.Ev = 13;
  c.inputs = Inputs::SharedKeyValue;
  run_case(c);
}

TEST_P(Module, HeadCounts) {
  uint64_t seed = 30;
  for (const int64_t h : {1, 2, 3, 6, 12, 24}) {
    ModuleCase c;
    c.B = 2, c.Lq = 5, c.Lk = 8, c.E = 24, c.H = h, c.seed = ++seed;
    run_case(c);
  }
}

TEST_P(Module, SelfAttentionAndSharedKeyValue) {
  uint64_t seed = 40;
  for (const Inputs inputs : {Inputs::SelfAttention, Inputs::SharedKeyValue, Inputs::Separate}) {
    for (const bool seq_first : {false, true}) {
      ModuleCase c;
      c.B = 3, c.Lq = 9, c.Lk = 9, c.E = 32, c.H = 4, c.inputs = inputs, c.seq_first = seq_first;
      c.out_seq_first = seq_first, c.seed = ++seed;
      run_case(c);
    }
  }
}

TEST_P(Module, SequenceFirstAndPaddedLayouts) {
  uint64_t seed = 50;
  for (int combo = 0; combo < 8; ++combo) {
    ModuleCase c;
    c.B = 3, c.Lq = 6, c.Lk = 10, c.E = 16, c.H = 2, c.seed = ++seed;
    c.seq_first = (combo & 1) != 0;
    c.out_seq_first = (combo & 2) != 0;
    c.pad = (combo & 4) != 0 ? 3 : 0;
    run_case(c);
  }
}

TEST_P(Module, GeneralStridesAndBroadcastInputs) {
  uint64_t seed = 60;
  for (const bool broadcast : {false, true}) {
    for (const Inputs inputs : {Inputs::Separate, Inputs::SharedKeyValue}) {
      ModuleCase c;
      c.B = 3, c.Lq = 4, c.Lk = 7, c.E = 16, c.H = 4, c.Ev = 9,
      c.Ek = inputs == Inputs::SharedKeyValue ? 9 : 0;
      c.feature_stride = 2, c.pad = 1, c.kv_batch_broadcast = broadcast, c.inputs = inputs;
      c.seed = ++seed;
      run_case(c);
      c.seq_first = true, c.seed = ++seed;
      run_case(c);
    }
  }
  ModuleCase c;  // one query per batch, one key
  c.B = 4, c.Lq = 1, c.Lk = 1, c.E = 8, c.H = 2;
  run_case(c);
  c.B = 1, c.Lq = 1, c.Lk = 5, c.seq_first = true, c.out_seq_first = true;
  run_case(c);
}

TEST_P(Module, ValidLens) {
  uint64_t seed = 70;
  for (const Lens lens : {Lens::PerBatch, Lens::PerQuery}) {
    for (const mha_dtype dtype : {MHA_DTYPE_I32, MHA_DTYPE_I64}) {
      for (const bool need_weights : {false, true}) {
        ModuleCase c;  // lengths cycle Lk, random, 0, random
        c.B = 4, c.Lq = 5, c.Lk = 9, c.E = 16, c.H = 4, c.lens = lens, c.lens_dtype = dtype;
        c.need_weights = need_weights, c.seed = ++seed;
        const Outcome o = run_case(c);
        ASSERT_TRUE(o.ok);
        EXPECT_GT(o.ref.dead_rows, 0) << "the case should have rows without any key";
      }
    }
  }
}

TEST_P(Module, KeyPaddingMask) {
  uint64_t seed = 80;
  for (const MaskKind kind : {MaskKind::Bool, MaskKind::F32}) {
    for (const bool need_weights : {false, true}) {
      for (const bool dead : {false, true}) {
        ModuleCase c;
        c.B = 3, c.Lq = 6, c.Lk = 12, c.E = 16, c.H = 2, c.kpm = kind, c.kpm_dead_batch = dead;
        c.need_weights = need_weights, c.seed = ++seed;
        const Outcome o = run_case(c);
        ASSERT_TRUE(o.ok);
        if (dead) {
          EXPECT_EQ(o.ref.dead_rows, c.H * c.Lq);
        }
      }
    }
  }
}

TEST_P(Module, AttnMask) {
  uint64_t seed = 90;
  for (const MaskKind kind : {MaskKind::Bool, MaskKind::F32}) {
    for (const bool three_d : {false, true}) {
      for (const bool need_weights : {false, true}) {
        ModuleCase c;
        c.B = 2, c.Lq = 7, c.Lk = 10, c.E = 24, c.H = 3, c.am = kind, c.am_3d = three_d;
        c.need_weights = need_weights, c.seed = ++seed;
        run_case(c);
      }
    }
  }
}

TEST_P(Module, CombinedMasks) {
  uint64_t seed = 100;
  for (const MaskKind kpm : {MaskKind::Bool, MaskKind::F32}) {
    for (const MaskKind am : {MaskKind::Bool, MaskKind::F32}) {
      for (const bool three_d : {false, true}) {
        for (const int32_t causal : {MHA_CAUSAL_NONE, MHA_CAUSAL_TOP_LEFT}) {
          for (const Lens lens : {Lens::None, Lens::PerBatch}) {
            ModuleCase c;
            c.B = 2, c.Lq = 6, c.Lk = 8, c.E = 16, c.H = 2, c.kpm = kpm, c.am = am,
            c.am_3d = three_d;
            c.causal = causal, c.lens = lens, c.seed = ++seed;
            c.need_weights = (seed % 3) == 0, c.average = (seed % 2) == 0;
            run_case(c);
          }
        }
      }
    }
  }
}

TEST_P(Module, Causal) {
  uint64_t seed = 140;
  const std::pair<int64_t, int64_t> lengths[] = {{8, 8}, {5, 12}, {12, 5}, {1, 6}};
  for (const int32_t causal : {MHA_CAUSAL_TOP_LEFT, MHA_CAUSAL_BOTTOM_RIGHT}) {
    for (const auto& [lq, lk] : lengths) {
      for (const bool need_weights : {false, true}) {
        ModuleCase c;
        c.B = 2, c.Lq = lq, c.Lk = lk, c.E = 16, c.H = 4, c.causal = causal;
        c.need_weights = need_weights, c.seed = ++seed;
        run_case(c);
      }
    }
  }
}

TEST_P(Module, CausalSelfAttention) {
  uint64_t seed = 160;
  for (const bool seq_first : {false, true}) {
    for (const bool need_weights : {false, true}) {
      ModuleCase c;
      c.B = 2, c.Lq = 11, c.Lk = 11, c.E = 32, c.H = 4, c.inputs = Inputs::SelfAttention;
      c.causal = MHA_CAUSAL_TOP_LEFT, c.seq_first = seq_first, c.out_seq_first = seq_first;
      c.need_weights = need_weights, c.seed = ++seed;
      const Outcome o = run_case(c);
      ASSERT_TRUE(o.ok);
      if (need_weights) {  // nothing above the diagonal
        for (int64_t bh = 0; bh < c.B * c.H; ++bh)
          for (int64_t i = 0; i < c.Lq; ++i)
            for (int64_t j = i + 1; j < c.Lk; ++j)
              EXPECT_EQ(o.weights[static_cast<size_t>((bh * c.Lq + i) * c.Lk + j)], 0.0f);
      }
    }
  }
}

TEST_P(Module, AttentionWeights) {
  uint64_t seed = 170;
  for (const bool average : {false, true}) {
    for (const bool permuted : {false, true}) {
      if (average && permuted) continue;
      ModuleCase c;
      c.B = 2, c.Lq = 5, c.Lk = 9, c.E = 24, c.H = 3, c.need_weights = true, c.average = average;
      c.weights_permuted = permuted, c.seed = ++seed;
      const Outcome o = run_case(c);
      ASSERT_TRUE(o.ok);
      // Rows sum to 1 (no masks, no dropout).
      const int64_t rows = average ? c.B * c.Lq : c.B * c.H * c.Lq;
      for (int64_t r = 0; r < rows; ++r) {
        double sum = 0;
        for (int64_t j = 0; j < c.Lk; ++j)
          sum += static_cast<double>(o.weights[static_cast<size_t>(r * c.Lk + j)]);
        EXPECT_NEAR(sum, 1.0, 1e-5) << "row " << r;
      }
    }
  }
  // A query block boundary of the weights path (32 queries), and seq-first inputs.
  ModuleCase c;
  c.B = 2, c.Lq = 70, c.Lk = 33, c.E = 16, c.H = 2, c.need_weights = true, c.seq_first = true;
  c.kpm = MaskKind::Bool, c.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  run_case(c);
  c.average = true;
  run_case(c);
}

TEST_P(Module, FusedAndWeightsPathsAgree) {
  ModuleCase c;
  c.B = 2, c.Lq = 9, c.Lk = 13, c.E = 32, c.H = 4, c.kpm = MaskKind::F32, c.am = MaskKind::Bool;
  c.lens = Lens::PerQuery;
  const Outcome fused = run_case(c);
  c.need_weights = true;
  const Outcome weights = run_case(c);
  ASSERT_TRUE(fused.ok && weights.ok);
  for (size_t n = 0; n < fused.out.size(); ++n) {
    const double bound = 2 * fused.ref.out_bound[n];
    ASSERT_LE(std::fabs(static_cast<double>(fused.out[n]) - static_cast<double>(weights.out[n])),
              bound)
        << "element " << n;
  }
}

TEST_P(Module, NullParamsMeansInference) {
  ModuleCase c;
  c.B = 2, c.Lq = 4, c.Lk = 6, c.E = 16, c.H = 2, c.null_params = true, c.dropout = 0.5f;
  run_case(c);
}

TEST_P(Module, UnsetWeightsAreZero) {
  float x[2 * 3 * 8], o[2 * 3 * 8];
  for (float& e : x) e = 0.5f;
  mha_tensor xt = describe(x, MHA_DTYPE_F32, {2, 3, 8});
  mha_tensor ot = describe(o, MHA_DTYPE_F32, {2, 3, 8});
  mha_module_config config;
  mha_module_config_init(&config);
  config.embed_dim = 8;
  config.num_heads = 2;
  ModuleHandle m;
  ASSERT_EQ(mha_module_create(&config, &m.m), MHA_OK) << mha_last_error();
  ASSERT_EQ(mha_module_forward(m.m, &xt, &xt, &xt, &ot, nullptr), MHA_OK) << mha_last_error();
  for (float e : o) EXPECT_EQ(e, 0.0f);
  float bias[8] = {1, -2, 3, -4, 5, -6, 7, -8};
  mha_tensor bt = describe(bias, MHA_DTYPE_F32, {8});
  ASSERT_EQ(mha_module_set_weight(m.m, "out_proj.bias", &bt), MHA_OK) << mha_last_error();
  ASSERT_EQ(mha_module_forward(m.m, &xt, &xt, &xt, &ot, nullptr), MHA_OK) << mha_last_error();
  for (int n = 0; n < 2 * 3 * 8; ++n) EXPECT_EQ(o[n], bias[n % 8]);
}

TEST_P(Module, ResultsDoNotDependOnThreadCount) {
  for (const bool need_weights : {false, true}) {
    ModuleCase c;
    c.B = 3, c.Lq = 40, c.Lk = 40, c.E = 64, c.H = 4, c.inputs = Inputs::SelfAttention;
    c.causal = MHA_CAUSAL_TOP_LEFT, c.kpm = MaskKind::Bool, c.need_weights = need_weights;
    if (need_weights) c.training = true, c.dropout = 0.25f;
    std::vector<Outcome> outcomes;
    for (const int32_t threads : {1, 2}) {
      ASSERT_EQ(mha_set_num_threads(threads), MHA_OK);
      outcomes.push_back(run_case(c));
      ASSERT_TRUE(outcomes.back().ok);
    }
    for (size_t n = 1; n < outcomes.size(); ++n) {
      EXPECT_TRUE(bits_equal(outcomes[n].out, outcomes[0].out)) << "out differs, run " << n;
      EXPECT_TRUE(bits_equal(outcomes[n].weights, outcomes[0].weights))
          << "weights differ, run " << n;
    }
  }
}

TEST_P(Module, ConcurrentCallersShareOneModule) {
  // Forward only reads the module; its scratch is per calling thread.
  ModuleCase c;
  c.B = 2, c.Lq = 12, c.Lk = 12, c.E = 32, c.H = 4, c.inputs = Inputs::SelfAttention;
  ModuleHandle module;
  ASSERT_TRUE(create_module(c, module));
  Rng rng(77);
  const WeightSet w = make_weights(c, rng);
  ASSERT_TRUE(load_weights(module.m, c, w));
  constexpr int kCallers = 3;
  std::vector<std::vector<float>> x(kCallers), serial(kCallers), parallel(kCallers);
  for (int t = 0; t < kCallers; ++t) {
    x[t].resize(static_cast<size_t>(c.B * c.Lq * c.E));
    for (float& e : x[t]) e = rng.uniform();
    serial[t].assign(x[t].size(), 0.0f);
    parallel[t].assign(x[t].size(), 0.0f);
  }
  const auto forward = [&](int t, std::vector<float>& out, bool weights) {
    mha_tensor xt = describe(x[static_cast<size_t>(t)].data(), MHA_DTYPE_F32, {c.B, c.Lq, c.E});
    mha_tensor ot = describe(out.data(), MHA_DTYPE_F32, {c.B, c.Lq, c.E});
    std::vector<float> aw(static_cast<size_t>(c.B * c.H * c.Lq * c.Lk));
    mha_tensor wt = describe(aw.data(), MHA_DTYPE_F32, {c.B, c.H, c.Lq, c.Lk});
    mha_module_forward_params p;
    mha_module_forward_params_init(&p);
    p.causal = MHA_CAUSAL_TOP_LEFT;
    if (weights) p.attn_weights = &wt;
    return mha_module_forward(module.m, &xt, &xt, &xt, &ot, &p);
  };
  for (const bool weights : {false, true}) {
    for (int t = 0; t < kCallers; ++t)
      ASSERT_EQ(forward(t, serial[static_cast<size_t>(t)], weights), MHA_OK);
    std::vector<std::thread> threads;
    threads.reserve(kCallers);
    std::vector<mha_status> status(kCallers, MHA_ERR_INTERNAL);
    for (int t = 0; t < kCallers; ++t) {
      threads.emplace_back([&, t] {
        for (int r = 0; r < 3; ++r)
          status[static_cast<size_t>(t)] = forward(t, parallel[static_cast<size_t>(t)], weights);
      });
    }
    for (auto& th : threads) th.join();
    for (int t = 0; t < kCallers; ++t) {
      EXPECT_EQ(status[static_cast<size_t>(t)], MHA_OK);
      EXPECT_TRUE(bits_equal(serial[static_cast<size_t>(t)], parallel[static_cast<size_t>(t)]))
          << "caller " << t;
    }
  }
}

// ---- dropout

TEST_P(Module, DropoutKeptFraction) {
  // Weights that take part are kept with probability 1 - p, scaled by 1/(1-p).
  for (const float p : {0.1f, 0.5f}) {
    ModuleCase c;
    c.B = 2, c.Lq = 32, c.Lk = 64, c.E = 16, c.H = 4, c.need_weights = true, c.training = true;
    c.dropout = p, c.dropout_seed = 12345;
    const Outcome o = run_case(c);
    ASSERT_TRUE(o.ok);
    // (run_case has checked each weight against the reference: kept ones are
    // scaled by 1/(1-p), and the decisions are the documented hash's.)
    int64_t total = 0, kept = 0;
    for (size_t n = 0; n < o.weights.size(); ++n) {
      if (o.ref.weights_before_dropout[n] <= 0) continue;
      ++total;
      if (o.weights[n] != 0.0f) ++kept;
    }
    ASSERT_GT(total, 10000);
    const double fraction = static_cast<double>(kept) / static_cast<double>(total);
    const double pd = static_cast<double>(p);
    const double sigma = std::sqrt(pd * (1.0 - pd) / static_cast<double>(total));
    EXPECT_NEAR(fraction, 1.0 - pd, 4 * sigma) << "kept " << kept << " of " << total;
  }
}

TEST_P(Module, DropoutZeroIsInference) {
  for (const bool need_weights : {false, true}) {
    ModuleCase c;
    c.B = 2, c.Lq = 6, c.Lk = 8, c.E = 16, c.H = 2, c.kpm = MaskKind::Bool,
    c.need_weights = need_weights;
    const Outcome inference = run_case(c);
    c.training = true;  // p = 0
    const Outcome trained = run_case(c);
    c.dropout = 0.5f, c.training = false;  // p configured, but inference
    const Outcome configured = run_case(c);
    ASSERT_TRUE(inference.ok && trained.ok && configured.ok);
    EXPECT_TRUE(bits_equal(inference.out, trained.out));
    EXPECT_TRUE(bits_equal(inference.out, configured.out));
    EXPECT_TRUE(bits_equal(inference.weights, trained.weights));
  }
}

TEST_P(Module, DropoutWeightsPathMatchesReference) {
  // The weights path applies the documented hash: the reference (which has its
  // own copy of the hash, written from mha.h) agrees element by element.
  uint64_t seed = 200;
  for (const float p : {0.2f, 0.6f}) {
    for (const bool average : {false, true}) {
      ModuleCase c;
      c.B = 2, c.Lq = 7, c.Lk = 11, c.E = 24, c.H = 3, c.need_weights = true, c.average = average;
      c.training = true, c.dropout = p, c.dropout_seed = 0xDEADBEEFCAFEull + seed;
      c.kpm = MaskKind::Bool, c.lens = Lens::PerQuery, c.seed = ++seed;
      run_case(c);
    }
  }
}

TEST_P(Module, DropoutSeedsAndThreads) {
  ModuleCase c;
  c.B = 2, c.Lq = 8, c.Lk = 16, c.E = 16, c.H = 2, c.need_weights = true, c.training = true;
  c.dropout = 0.3f;
  std::vector<Outcome> runs;
  for (const int32_t threads : {1, 2}) {
    ASSERT_EQ(mha_set_num_threads(threads), MHA_OK);
    runs.push_back(run_case(c));
  }
  c.dropout_seed += 1;
  runs.push_back(run_case(c));
  for (const auto& r : runs) ASSERT_TRUE(r.ok);
  EXPECT_TRUE(bits_equal(runs[0].out, runs[1].out)) << "same seed, 1 and 2 threads";
  EXPECT_TRUE(bits_equal(runs[0].weights, runs[1].weights));
  EXPECT_FALSE(bits_equal(runs[0].weights, runs[2].weights)) << "another seed, the same dropout";
}

TEST_P(Module, DropoutFusedPath) {
  // The fused path hands dropout to mha_attention; it must agree with the
  // weights path (same seed, same hash) and with the reference.
  if (!kernel_dropout_available()) {
    GTEST_SKIP() << "mha_attention does not implement dropout yet (it refuses dropout_p != 0)";
  }
  for (const float p : {0.2f, 0.5f}) {
    ModuleCase c;
    c.B = 2, c.Lq = 9, c.Lk = 17, c.E = 32, c.H = 4, c.training = true, c.dropout = p;
    c.kpm = MaskKind::F32, c.causal = MHA_CAUSAL_TOP_LEFT;
    std::vector<Outcome> fused;
    for (const int32_t threads : {1, 2}) {
      ASSERT_EQ(mha_set_num_threads(threads), MHA_OK);
      fused.push_back(run_case(c));  // checked against the reference inside
      ASSERT_TRUE(fused.back().ok);
    }
    EXPECT_TRUE(bits_equal(fused[0].out, fused[1].out)) << "same seed, 1 and 2 threads";
    c.need_weights = true;
    const Outcome weights = run_case(c);
    ASSERT_TRUE(weights.ok);
    for (size_t n = 0; n < weights.out.size(); ++n) {
      ASSERT_LE(
          std::fabs(static_cast<double>(fused[0].out[n]) - static_cast<double>(weights.out[n])),
          2 * weights.ref.out_bound[n])
          << "fused and weights paths differ at element " << n;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, Module, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

}  // namespace
}  // namespace mha_test
