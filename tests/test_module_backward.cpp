// mha_module_backward on every backend: the gradients of the inputs, every
// weight and bias and the sinks, against the float64 reference of
// module_reference_backward.h (itself checked here against finite
// differences of the module's forward reference), for every option of the
// forward alone and combined, self-attention and shared key/value (summed
// gradients), sequence-first layouts; the same bits for 1, 2, 3 and 7
// threads; bad input refused by name with nothing written.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backend_param.h"
#include "module_reference.h"
#include "module_reference_backward.h"
#include "reference_backward.h"
#include "test_util.h"

namespace mha_test {
namespace {

enum class Inputs { Separate, SharedKeyValue, SelfAttention };

struct ModuleBackwardCase {
  const char* what = "";
  int64_t B = 2, Lq = 7, Lk = 9, E = 16, H = 4;
  int64_t Eq = 0, Ek = 0, Ev = 0;  // 0: E
  bool bias = true;
  Inputs inputs = Inputs::Separate;
  bool seq_first = false;    // inputs and dout [L, B, F] in memory
  bool grads_other = false;  // the inputs' gradients in the other layout than the inputs
  int kpm = 0;               // key_padding_mask: 0 none, 1 bool, 2 f32
  int am = 0;                // attn_mask: 0 none, 1 bool [Lq, Lk], 2 f32 [B*H, Lq, Lk]
  bool lens = false;         // valid_lens [B], one of them 0
  int32_t causal = MHA_CAUSAL_NONE;
  float dropout = 0.0f;
  int64_t left = -1, right = -1;
  float softcap = 0.0f;
  bool alibi = false, sinks = false;
  uint64_t seed = 3;

  int64_t eq() const { return Eq != 0 ? Eq : E; }
  int64_t ek() const { return Ek != 0 ? Ek : E; }
  int64_t ev() const { return Ev != 0 ? Ev : E; }
};

// A [B, L, F] tensor over `storage`, batch-first or sequence-first.
mha_tensor layout(std::vector<float>& storage, int64_t b, int64_t l, int64_t f, bool seq_first) {
  storage.resize(static_cast<size_t>(b * l * f));
  const std::vector<int64_t> strides =
      seq_first ? std::vector<int64_t>{f, b * f, 1} : std::vector<int64_t>{l * f, f, 1};
  return describe(storage.data(), MHA_DTYPE_F32, {b, l, f}, strides);
}

// Every buffer of one case, the module, and the reference's inputs.
struct ModuleBackwardRun {
  explicit ModuleBackwardRun(const ModuleBackwardCase& c) : c_(c) {
    Rng rng(c.seed);
    mha_module_config config;
    mha_module_config_init(&config);
    config.embed_dim = c.E;
    config.num_heads = c.H;
    config.query_dim = c.Eq;
    config.key_dim = c.Ek;
    config.value_dim = c.Ev;
    config.bias = c.bias ? 1 : 0;
    config.dropout = c.dropout;
    EXPECT_EQ(mha_module_create(&config, &module), MHA_OK) << mha_last_error();

    // Weights: PyTorch's default ranges, U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    const int64_t E = c.E;
    weights.embed_dim = E;
    weights.num_heads = c.H;
    weights.query_dim = c.eq();
    weights.key_dim = c.ek();
    weights.value_dim = c.ev();
    set_random(rng, "q_proj_weight", E, c.eq(), weights.w_q);
    set_random(rng, "k_proj_weight", E, c.ek(), weights.w_k);
    set_random(rng, "v_proj_weight", E, c.ev(), weights.w_v);
    set_random(rng, "out_proj.weight", E, E, weights.w_o);
    weights.b_q.assign(static_cast<size_t>(E), 0.0);
    weights.b_k = weights.b_q;
    weights.b_v = weights.b_q;
    weights.b_o = weights.b_q;
    if (c.bias) {
      std::vector<double> in_bias;
      set_random(rng, "in_proj_bias", 3 * E, 0, in_bias);
      weights.b_q.assign(in_bias.begin(), in_bias.begin() + E);
      weights.b_k.assign(in_bias.begin() + E, in_bias.begin() + 2 * E);
      weights.b_v.assign(in_bias.begin() + 2 * E, in_bias.end());
      set_random(rng, "out_proj.bias", E, 0, weights.b_o);
    }

    // Inputs, dout and the gradients' buffers.
    const bool grads_seq = c.grads_other ? !c.seq_first : c.seq_first;
    query = layout(query_data, c.B, c.Lq, c.eq(), c.seq_first);
    fill_uniform(query, rng);
    dquery = layout(dquery_data, c.B, c.Lq, c.eq(), grads_seq);
    if (c.inputs == Inputs::SelfAttention) {
      key = value = query;
      dkey = dvalue = dquery;
    } else {
      key = layout(key_data, c.B, c.Lk, c.ek(), c.seq_first);
      fill_uniform(key, rng);
      dkey = layout(dkey_data, c.B, c.Lk, c.ek(), grads_seq);
      if (c.inputs == Inputs::SharedKeyValue) {
        value = key;
        dvalue = dkey;
      } else {
        value = layout(value_data, c.B, c.Lk, c.ev(), c.seq_first);
        fill_uniform(value, rng);
        dvalue = layout(dvalue_data, c.B, c.Lk, c.ev(), grads_seq);
      }
    }
    dout = layout(dout_data, c.B, c.Lq, E, c.seq_first);
    fill_uniform(dout, rng);
    const auto matrix = [](std::vector<float>& data, const std::vector<int64_t>& shape) {
      int64_t n = 1;
      for (int64_t s : shape) n *= s;
      data.assign(static_cast<size_t>(n), 0.0f);
      return describe(data.data(), MHA_DTYPE_F32, shape);
    };
    dw_q = matrix(dw_q_data, {E, c.eq()});
    dw_k = matrix(dw_k_data, {E, c.ek()});
    dw_v = matrix(dw_v_data, {E, c.ev()});
    dw_o = matrix(dw_o_data, {E, E});
    db_q = matrix(db_q_data, {E});
    db_k = matrix(db_k_data, {E});
    db_v = matrix(db_v_data, {E});
    db_o = matrix(db_o_data, {E});
    dsinks = matrix(dsinks_data, {c.H});

    // Options.
    mha_module_forward_params_init(&params);
    params.causal = c.causal;
    params.window_left = c.left;
    params.window_right = c.right;
    params.softcap = c.softcap;
    params.training = c.dropout > 0.0f ? 1 : 0;
    params.dropout_seed = 11;
    inputs.query = &query;
    inputs.key = &key;
    inputs.value = &value;
    inputs.causal = c.causal;
    inputs.dropout_p = static_cast<double>(c.dropout);
    inputs.dropout_seed = params.dropout_seed;
    inputs.window_left = c.left;
    inputs.window_right = c.right;
    inputs.softcap = static_cast<double>(c.softcap);
    if (c.lens) {
      for (int64_t b = 0; b < c.B; ++b) {
        lens_data.push_back(b == 0 ? 0 : static_cast<int32_t>(rng.integer(1, c.Lk)));
      }
      lens = describe(lens_data.data(), MHA_DTYPE_I32, {c.B});
      params.valid_lens = inputs.valid_lens = &lens;
    }
    if (c.kpm != 0) {
      kpm_bool.resize(static_cast<size_t>(c.B * c.Lk));
      kpm_f32.resize(kpm_bool.size());
      for (size_t n = 0; n < kpm_bool.size(); ++n) {
        kpm_bool[n] = rng.chance(0.3) ? 1 : 0;
        kpm_f32[n] = rng.uniform(-2.0f, 1.0f);
      }
      kpm = c.kpm == 1 ? describe(kpm_bool.data(), MHA_DTYPE_BOOL, {c.B, c.Lk})
                       : describe(kpm_f32.data(), MHA_DTYPE_F32, {c.B, c.Lk});
      params.key_padding_mask = inputs.key_padding_mask = &kpm;
    }
    if (c.am == 1) {
      am_bool.resize(static_cast<size_t>(c.Lq * c.Lk));
      for (uint8_t& x : am_bool) x = rng.chance(0.25) ? 1 : 0;
      am = describe(am_bool.data(), MHA_DTYPE_BOOL, {c.Lq, c.Lk});
    } else if (c.am == 2) {
      am_f32.resize(static_cast<size_t>(c.B * c.H * c.Lq * c.Lk));
      for (float& x : am_f32) x = rng.uniform(-3.0f, 1.0f);
      am = describe(am_f32.data(), MHA_DTYPE_F32, {c.B * c.H, c.Lq, c.Lk});
    }
    if (c.am != 0) params.attn_mask = inputs.attn_mask = &am;
    if (c.alibi) {
      for (int64_t h = 0; h < c.H; ++h) {
        slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(c.H)));
      }
      alibi = describe(slopes.data(), MHA_DTYPE_F32, {c.H});
      params.alibi_slopes = inputs.alibi_slopes = &alibi;
    }
    if (c.sinks) {
      for (int64_t h = 0; h < c.H; ++h) sink_values.push_back(rng.uniform(-1.0f, 2.0f));
      sinks = describe(sink_values.data(), MHA_DTYPE_F32, {c.H});
      params.sinks = inputs.sinks = &sinks;
    }
    mha_module_gradients_init(&grads);
    grads.query = &dquery;
    grads.key = &dkey;
    grads.value = &dvalue;
    grads.q_proj_weight = &dw_q;
    grads.k_proj_weight = &dw_k;
    grads.v_proj_weight = &dw_v;
    grads.out_proj_weight = &dw_o;
    if (c.bias) {
      grads.q_proj_bias = &db_q;
      grads.k_proj_bias = &db_k;
      grads.v_proj_bias = &db_v;
      grads.out_proj_bias = &db_o;
    }
    if (c.sinks) grads.sinks = &dsinks;
  }
  ~ModuleBackwardRun() { mha_module_destroy(module); }
  ModuleBackwardRun(const ModuleBackwardRun&) = delete;
  ModuleBackwardRun& operator=(const ModuleBackwardRun&) = delete;

  mha_status run() {
    return mha_module_backward(module, &query, &key, &value, &dout, &params, &grads);
  }

  // Every gradient's values, in a fixed order (for bit comparisons).
  std::vector<float> all_gradients() const {
    std::vector<float> all;
    for (const auto* v :
         {&dquery_data, &dkey_data, &dvalue_data, &dw_q_data, &dw_k_data, &dw_v_data, &dw_o_data,
          &db_q_data, &db_k_data, &db_v_data, &db_o_data, &dsinks_data}) {
      all.insert(all.end(), v->begin(), v->end());
    }
    return all;
  }

  const ModuleBackwardCase& c_;
  mha_module* module = nullptr;
  ModuleWeights weights;
  ModuleInputs inputs;
  mha_module_forward_params params{};
  mha_module_gradients grads{};
  std::vector<float> query_data, key_data, value_data, dout_data, dquery_data, dkey_data,
      dvalue_data, dw_q_data, dw_k_data, dw_v_data, dw_o_data, db_q_data, db_k_data, db_v_data,
      db_o_data, dsinks_data, kpm_f32, am_f32, slopes, sink_values;
  std::vector<uint8_t> kpm_bool, am_bool;
  std::vector<int32_t> lens_data;
  mha_tensor query{}, key{}, value{}, dout{}, dquery{}, dkey{}, dvalue{}, dw_q{}, dw_k{}, dw_v{},
      dw_o{}, db_q{}, db_k{}, db_v{}, db_o{}, dsinks{}, lens{}, kpm{}, am{}, alibi{}, sinks{};

 private:
  // Sets a random weight (rows x cols, cols = 0: a vector) and keeps it in double.
  void set_random(Rng& rng, const char* name, int64_t rows, int64_t cols,
                  std::vector<double>& kept) {
    std::vector<float> values(static_cast<size_t>(rows * std::max<int64_t>(cols, 1)));
    const float a = 1.0f / std::sqrt(static_cast<float>(cols != 0 ? cols : c_.E));
    for (float& x : values) x = rng.uniform(-a, a);
    kept.assign(values.begin(), values.end());
    const mha_tensor t = cols == 0 ? describe(values.data(), MHA_DTYPE_F32, {rows})
                                   : describe(values.data(), MHA_DTYPE_F32, {rows, cols});
    EXPECT_EQ(mha_module_set_weight(module, name, &t), MHA_OK) << name << ": " << mha_last_error();
  }
};

ReferenceGradient sum_of(const ReferenceGradient& a, const ReferenceGradient& b) {
  ReferenceGradient s = a;
  for (size_t n = 0; n < s.value.size(); ++n) s.value[n] += b.value[n];
  s.tolerance += b.tolerance;
  return s;
}

// `zero`: a gradient that is 0 in exact arithmetic (k_proj_bias: adding b_k
// to every key adds q·b_k to every logit of a row, which the softmax
// ignores), so only its rounding is left to compare.
void expect_close(const char* name, const mha_tensor& got, const ReferenceGradient& want,
                  bool zero = false) {
  const double diff = worst_difference(got, want.value);
  EXPECT_LE(diff, want.tolerance) << name << ": max |got - ref| = " << diff << " (largest |ref| "
                                  << max_abs(want.value) << ")";
  // A tolerance that could not fail would be no test: it stays well below
  // the gradient's own size.
  if (!zero) {
    EXPECT_LT(want.tolerance, 0.01 * max_abs(want.value)) << name;
  }
}

void check_case(const ModuleBackwardCase& c) {
  SCOPED_TRACE(c.what);
  ModuleBackwardRun run(c);
  ASSERT_EQ(run.run(), MHA_OK) << mha_last_error();
  const ModuleBackwardReference ref = reference_module_backward(run.weights, run.inputs, run.dout);
  switch (c.inputs) {
    case Inputs::SelfAttention:
      expect_close("dquery (= dkey = dvalue)", run.dquery,
                   sum_of(sum_of(ref.query, ref.key), ref.value));
      break;
    case Inputs::SharedKeyValue:
      expect_close("dquery", run.dquery, ref.query);
      expect_close("dkey (= dvalue)", run.dkey, sum_of(ref.key, ref.value));
      break;
    case Inputs::Separate:
      expect_close("dquery", run.dquery, ref.query);
      expect_close("dkey", run.dkey, ref.key);
      expect_close("dvalue", run.dvalue, ref.value);
      break;
  }
  expect_close("q_proj_weight", run.dw_q, ref.w_q);
  expect_close("k_proj_weight", run.dw_k, ref.w_k);
  expect_close("v_proj_weight", run.dw_v, ref.w_v);
  expect_close("out_proj_weight", run.dw_o, ref.w_o);
  if (c.bias) {
    expect_close("q_proj_bias", run.db_q, ref.b_q);
    expect_close("k_proj_bias", run.db_k, ref.b_k, /*zero=*/true);
    expect_close("v_proj_bias", run.db_v, ref.b_v);
    expect_close("out_proj_bias", run.db_o, ref.b_o);
  }
  if (c.sinks) expect_close("sinks", run.dsinks, ref.sinks);
}

class ModuleBackward : public BackendTest {};

TEST_P(ModuleBackward, CrossAttention) {
  check_case({.what = "cross-attention"});
}
TEST_P(ModuleBackward, FeatureSizesDifferAndNoBias) {
  check_case({.what = "Eq/Ek/Ev differ, no bias", .Eq = 12, .Ek = 20, .Ev = 8, .bias = false});
}
TEST_P(ModuleBackward, SelfAttentionSumsTheInputGradients) {
  check_case({.what = "self-attention", .Lk = 7, .inputs = Inputs::SelfAttention});
}
TEST_P(ModuleBackward, SharedKeyValue) {
  check_case({.what = "key = value", .inputs = Inputs::SharedKeyValue});
}
TEST_P(ModuleBackward, SequenceFirstLayouts) {
  check_case(
      {.what = "[L, B, E] inputs, batch-first gradients", .seq_first = true, .grads_other = true});
  check_case({.what = "[L, B, E] self-attention",
              .Lk = 7,
              .inputs = Inputs::SelfAttention,
              .seq_first = true});
}
TEST_P(ModuleBackward, MasksAndValidLengths) {
  check_case({.what = "bool key_padding_mask + bool attn_mask", .kpm = 1, .am = 1});
  check_case({.what = "f32 key_padding_mask + f32 [B*H] attn_mask", .kpm = 2, .am = 2});
  check_case({.what = "valid_lens (one row empty)", .lens = true});
}
TEST_P(ModuleBackward, Causal) {
  check_case({.what = "causal top-left", .causal = MHA_CAUSAL_TOP_LEFT});
  check_case({.what = "causal bottom-right", .causal = MHA_CAUSAL_BOTTOM_RIGHT});
}
TEST_P(ModuleBackward, Dropout) {
  check_case({.what = "dropout 0.3", .dropout = 0.3f});
}
TEST_P(ModuleBackward, Variants) {
  check_case({.what = "window", .left = 3, .right = 1});
  check_case({.what = "softcap", .softcap = 1.5f});
  check_case({.what = "alibi", .alibi = true});
  check_case({.what = "sinks and their gradient", .sinks = true});
}
TEST_P(ModuleBackward, EverythingTogetherAcrossTiles) {
  check_case({.what = "every option, 70 x 90 tokens",
              .Lq = 70,
              .Lk = 90,
              .E = 64,
              .H = 2,
              .Ek = 40,
              .Ev = 40,
              .inputs = Inputs::SharedKeyValue,
              .seq_first = true,
              .kpm = 2,
              .am = 1,
              .lens = true,
              .causal = MHA_CAUSAL_BOTTOM_RIGHT,
              .dropout = 0.2f,
              .left = 40,
              .softcap = 3.0f,
              .alibi = true,
              .sinks = true});
}

TEST_P(ModuleBackward, BitIdenticalAcrossThreadCounts) {
  const ModuleBackwardCase c{.what = "threads",
                             .B = 3,
                             .Lq = 600,
                             .Lk = 1100,
                             .E = 32,
                             .H = 2,
                             .kpm = 2,
                             .causal = MHA_CAUSAL_BOTTOM_RIGHT,
                             .dropout = 0.1f};
  std::vector<float> first;
  for (int32_t threads : {1, 2, 3, 7, 2}) {
    ASSERT_EQ(mha_set_num_threads(threads), MHA_OK);
    ModuleBackwardRun run(c);
    ASSERT_EQ(run.run(), MHA_OK) << mha_last_error();
    const std::vector<float> got = run.all_gradients();
    if (first.empty()) {
      first = got;
      continue;
    }
    EXPECT_EQ(std::memcmp(got.data(), first.data(), got.size() * sizeof(float)), 0)
        << threads << " threads";
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, ModuleBackward, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

// ---------------------------------------------------------------- the reference itself

// L(θ) = Σ dout ∘ reference_module(θ).out by central differences, for the
// weights (exact in double) and the inputs (floats: the step is the
// difference of the two rounded points).  The reference's own fp32 rounding
// of the projections (2^-24 relative) and the differences' truncation
// (h² · L''' with h = 1e-3) stay below 1e-6 of the gradients.
TEST(ModuleBackwardReference, MatchesFiniteDifferencesOfTheForward) {
  const ModuleBackwardCase c{.what = "finite differences",
                             .B = 2,
                             .Lq = 3,
                             .Lk = 4,
                             .E = 6,
                             .H = 2,
                             .Ek = 5,
                             .Ev = 4,
                             .kpm = 2,
                             .am = 1,
                             .causal = MHA_CAUSAL_BOTTOM_RIGHT,
                             .dropout = 0.25f,
                             .softcap = 2.0f,
                             .alibi = true,
                             .sinks = true};
  ModuleBackwardRun run(c);
  const ModuleBackwardReference ref = reference_module_backward(run.weights, run.inputs, run.dout);
  const auto loss = [&](const ModuleWeights& w) {
    const ModuleReference f = reference_module(w, run.inputs);
    double sum = 0;
    size_t n = 0;
    for_each_offset(run.dout, [&](int64_t offset) {
      sum += static_cast<double>(static_cast<const float*>(run.dout.data)[offset]) * f.out[n++];
    });
    return sum;
  };
  const double h = 1e-3;
  const auto check_weights = [&](const char* name, std::vector<double> ModuleWeights::*member,
                                 const ReferenceGradient& want) {
    ModuleWeights w = run.weights;
    std::vector<double>& values = w.*member;
    double worst = 0;
    for (size_t n = 0; n < values.size(); ++n) {
      const double kept = values[n];
      values[n] = kept + h;
      const double up = loss(w);
      values[n] = kept - h;
      const double down = loss(w);
      values[n] = kept;
      worst = std::max(worst, std::fabs((up - down) / (2 * h) - want.value[n]));
    }
    EXPECT_LE(worst, 1e-6 * std::max(1.0, max_abs(want.value))) << name;
  };
  check_weights("w_q", &ModuleWeights::w_q, ref.w_q);
  check_weights("w_k", &ModuleWeights::w_k, ref.w_k);
  check_weights("w_v", &ModuleWeights::w_v, ref.w_v);
  check_weights("w_o", &ModuleWeights::w_o, ref.w_o);
  check_weights("b_q", &ModuleWeights::b_q, ref.b_q);
  check_weights("b_k", &ModuleWeights::b_k, ref.b_k);
  check_weights("b_v", &ModuleWeights::b_v, ref.b_v);
  check_weights("b_o", &ModuleWeights::b_o, ref.b_o);

  const auto check_floats = [&](const char* name, mha_tensor& t, const ReferenceGradient& want) {
    auto* data = static_cast<float*>(t.data);
    double worst = 0;
    size_t n = 0;
    for_each_offset(t, [&](int64_t offset) {
      const float kept = data[offset];
      const float up_x = kept + static_cast<float>(h), down_x = kept - static_cast<float>(h);
      data[offset] = up_x;
      const double up = loss(run.weights);
      data[offset] = down_x;
      const double down = loss(run.weights);
      data[offset] = kept;
      const double slope = (up - down) / static_cast<double>(up_x - down_x);
      worst = std::max(worst, std::fabs(slope - want.value[n++]));
    });
    EXPECT_LE(worst, 1e-6 * std::max(1.0, max_abs(want.value))) << name;
  };
  check_floats("query", run.query, ref.query);
  check_floats("key", run.key, ref.key);
  check_floats("value", run.value, ref.value);
  check_floats("sinks", run.sinks, ref.sinks);
}

// ---------------------------------------------------------------- bad input

class ModuleBackwardBadInput : public ::testing::Test {
 protected:
  ModuleBackwardCase c{.what = "bad input", .sinks = true};
  ModuleBackwardRun run{c};

  // Refused with `status`, a message naming `name`, and nothing written.
  void expect_refused(mha_status status, const std::string& name) {
    const std::vector<float> before = run.all_gradients();
    EXPECT_EQ(run.run(), status) << mha_last_error();
    EXPECT_NE(std::string(mha_last_error()).find(name), std::string::npos) << mha_last_error();
    const std::vector<float> after = run.all_gradients();
    EXPECT_EQ(std::memcmp(before.data(), after.data(), before.size() * sizeof(float)), 0);
  }
};

TEST_F(ModuleBackwardBadInput, NullsAndShapes) {
  EXPECT_EQ(mha_module_backward(nullptr, &run.query, &run.key, &run.value, &run.dout, nullptr,
                                &run.grads),
            MHA_ERR_NULL_POINTER);
  EXPECT_EQ(mha_module_backward(run.module, &run.query, &run.key, &run.value, &run.dout, nullptr,
                                nullptr),
            MHA_ERR_NULL_POINTER);
  EXPECT_NE(std::string(mha_last_error()).find("grads"), std::string::npos);
  run.dout.shape[2] = 15;
  expect_refused(MHA_ERR_SHAPE_MISMATCH, "dout");
  run.dout.shape[2] = 16;
  run.dw_q.shape[1] = 3;
  expect_refused(MHA_ERR_SHAPE_MISMATCH, "grads->q_proj_weight");
  run.dw_q.shape[1] = 16;
  run.dkey.shape[1] = 8;
  expect_refused(MHA_ERR_SHAPE_MISMATCH, "grads->key");
  run.dkey.shape[1] = 9;
  run.db_o.dtype = MHA_DTYPE_I32;
  expect_refused(MHA_ERR_INVALID_DTYPE, "grads->out_proj_bias");
  run.db_o.dtype = MHA_DTYPE_F32;
  EXPECT_EQ(run.run(), MHA_OK) << mha_last_error();
}

TEST_F(ModuleBackwardBadInput, OverlapsAndMissingCounterparts) {
  run.grads.key = &run.dw_q;  // a matrix where [B, Lk, Ek] belongs
  expect_refused(MHA_ERR_INVALID_SIZE, "grads->key");
  std::vector<float> joint(2 * 9 * 16 + 1);  // dkey and dvalue one float apart
  mha_tensor dk = run.dkey, dv = run.dvalue;
  dk.data = joint.data();
  dv.data = joint.data() + 1;
  run.grads.key = &dk;
  run.grads.value = &dv;
  expect_refused(MHA_ERR_OVERLAP, "grads->key overlaps grads->value");
  run.grads.key = &run.dkey;
  run.grads.value = &run.dvalue;
  mha_tensor into_input = run.dkey;  // writes over the key input
  into_input.data = run.key_data.data();
  run.grads.key = &into_input;
  expect_refused(MHA_ERR_OVERLAP, "grads->key overlaps key");
  run.grads.key = &run.dkey;
  run.grads.out_proj_weight = &run.dw_q;  // [E, E] = [E, Eq] here: one buffer twice
  expect_refused(MHA_ERR_OVERLAP, "grads->q_proj_weight overlaps grads->out_proj_weight");
  run.grads.out_proj_weight = &run.dw_o;
  run.params.sinks = nullptr;
  expect_refused(MHA_ERR_INVALID_VALUE, "grads->sinks");
  run.params.sinks = &run.sinks;
  std::vector<float> weights_data(static_cast<size_t>(2 * 4 * 7 * 9));
  mha_tensor weights = describe(weights_data.data(), MHA_DTYPE_F32, {2, 4, 7, 9});
  run.params.attn_weights = &weights;
  expect_refused(MHA_ERR_INVALID_VALUE, "params->attn_weights");
  run.params.attn_weights = nullptr;
  run.grads.struct_size = 12;
  expect_refused(MHA_ERR_INVALID_PARAMS, "grads->struct_size");
  run.grads.struct_size = sizeof run.grads;
  EXPECT_EQ(run.run(), MHA_OK) << mha_last_error();
}

TEST(ModuleBackwardBiases, BiasGradientsNeedBiases) {
  const ModuleBackwardCase c{.what = "no bias", .bias = false};
  ModuleBackwardRun run(c);
  run.grads.q_proj_bias = &run.db_q;
  EXPECT_EQ(run.run(), MHA_ERR_INVALID_VALUE);
  EXPECT_NE(std::string(mha_last_error()).find("grads->q_proj_bias"), std::string::npos);
}

}  // namespace
}  // namespace mha_test
