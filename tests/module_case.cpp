// The module tests' shared part (see the header), and the run's worst
// |got - reference| / bound, printed once at the end.
#include "module_case.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace mha_test {
namespace {

std::vector<float> read_c_order(const mha_tensor& t) {
  std::vector<float> values;
  for_each_offset(
      t, [&](int64_t offset) { values.push_back(static_cast<const float*>(t.data)[offset]); });
  return values;
}

int64_t input_extent(int64_t B, int64_t L, int64_t F, int64_t pad, int64_t feature_stride,
                     bool batch_broadcast) {
  return (batch_broadcast ? 1 : B) * L * (F * feature_stride + pad);
}

// Sets one weight, from a C-order copy or from a transposed (column-major) view.
::testing::AssertionResult set_weight(mha_module* m, const char* name,
                                      const std::vector<float>& values, int64_t rows, int64_t cols,
                                      bool transposed) {
  std::vector<float> storage = values;
  mha_tensor t{};
  if (cols == 0) {
    t = describe(storage.data(), MHA_DTYPE_F32, {rows});
  } else if (transposed) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        storage[static_cast<size_t>(c * rows + r)] = values[static_cast<size_t>(r * cols + c)];
    t = describe(storage.data(), MHA_DTYPE_F32, {rows, cols}, {1, rows});
  } else {
    t = describe(storage.data(), MHA_DTYPE_F32, {rows, cols});
  }
  const mha_status s = mha_module_set_weight(m, name, &t);
  if (s != MHA_OK) {
    return ::testing::AssertionFailure()
           << "set_weight(" << name << "): " << mha_status_name(s) << ": " << mha_last_error();
  }
  return ::testing::AssertionSuccess();
}

bool expect_ok(const ::testing::AssertionResult& result) {
  EXPECT_TRUE(result);
  return static_cast<bool>(result);
}

double g_worst_ratio = 0.0;  // over the whole run, printed at the end

// Printed once: how close the results came to their bounds.
class WorstRatioPrinter : public ::testing::Environment {
 public:
  void TearDown() override {
    std::printf("module: worst |got - reference| / bound over the run: %.3g\n", g_worst_ratio);
  }
};
const auto* const g_printer = ::testing::AddGlobalTestEnvironment(new WorstRatioPrinter);

}  // namespace

std::string ModuleCase::describe() const {
  std::ostringstream os;
  os << "B=" << B << " Lq=" << Lq << " Lk=" << Lk << " E=" << E << " H=" << H
     << " Eq/Ek/Ev=" << eq() << '/' << ek() << '/' << ev() << (bias ? " bias" : " no-bias")
     << (d2l_names ? " d2l-names" : "") << (separate_proj ? " q/k/v_proj_weight" : "")
     << (transposed_weight_storage ? " weights-from-transposed-views" : "") << " inputs="
     << (inputs == Inputs::Separate ? "separate"
                                    : (inputs == Inputs::SharedKeyValue ? "key=value" : "self"))
     << (ones_inputs ? " ones" : "") << (seq_first ? " seq-first" : "")
     << (out_seq_first ? " out-seq-first" : "") << " pad=" << pad
     << " value-feature-stride=" << feature_stride
     << (kv_batch_broadcast ? " kv-batch-stride-0" : "");
  if (lens != Lens::None) {
    os << " valid_lens=" << (lens == Lens::PerBatch ? "[B]" : "[B,Lq]")
       << (lens_dtype == MHA_DTYPE_I64 ? "/i64" : "/i32");
  }
  if (kpm != MaskKind::None) {
    os << " key_padding_mask=" << (kpm == MaskKind::Bool ? "bool" : "f32")
       << (kpm_dead_batch ? "/dead-batch" : "");
  }
  if (am != MaskKind::None) {
    os << " attn_mask=" << (am == MaskKind::Bool ? "bool" : "f32")
       << (am_3d ? "[B*H,Lq,Lk]" : "[Lq,Lk]");
  }
  os << " causal=" << causal;
  if (need_weights)
    os << " need_weights" << (average ? "/average" : "") << (weights_permuted ? "/permuted" : "");
  if (training) os << " training p=" << dropout << " seed=" << dropout_seed;
  if (window_left != -1 || window_right != -1)
    os << " window=" << window_left << ',' << window_right;
  if (softcap != 0.0f) os << " softcap=" << softcap;
  if (sinks)
    os << " sinks="
       << (std::isnan(sink_value) ? std::string("random") : std::to_string(sink_value));
  if (alibi) {
    os << " alibi" << (alibi_per_batch ? "[B,H]" : "[H]")
       << (std::isnan(slope_value) ? std::string() : "=" + std::to_string(slope_value));
  }
  if (qk_amplitude != 1.0f) os << " qk-amplitude=" << qk_amplitude;
  if (params_struct_64) os << " struct_size=64";
  os << (null_params ? " params=NULL" : "") << " seed=" << seed;
  return os.str();
}

mha_tensor make_input(Arena& arena, int64_t B, int64_t L, int64_t F, bool seq_first, int64_t pad,
                      int64_t feature_stride, bool batch_broadcast) {
  const int64_t row = F * feature_stride + pad;
  const int64_t b_count = batch_broadcast ? 1 : B;
  std::vector<int64_t> strides = seq_first
                                     ? std::vector<int64_t>{row, b_count * row, feature_stride}
                                     : std::vector<int64_t>{L * row, row, feature_stride};
  if (batch_broadcast) strides[0] = 0;
  return describe(arena.base(), MHA_DTYPE_F32, {B, L, F}, strides);
}

WeightSet make_weights(const ModuleCase& c, Rng& rng) {
  WeightSet w;
  const int64_t E = c.E;
  const auto fill = [&](std::vector<float>& v, int64_t rows, int64_t cols, bool zero) {
    v.assign(static_cast<size_t>(rows * cols), 0.0f);
    const float a = 1.0f / std::sqrt(static_cast<float>(cols));
    if (!zero)
      for (float& x : v) x = rng.uniform(-a, a);
  };
  fill(w.w_q, E, c.eq(), false);
  fill(w.w_k, E, c.ek(), false);
  fill(w.w_v, E, c.ev(), false);
  fill(w.w_o, E, E, false);
  fill(w.b_q, E, 1, !c.bias);
  fill(w.b_k, E, 1, !c.bias);
  fill(w.b_v, E, 1, !c.bias);
  fill(w.b_o, E, 1, !c.bias);
  const auto to_double = [](const std::vector<float>& v) {
    return std::vector<double>(v.begin(), v.end());
  };
  w.ref.embed_dim = E;
  w.ref.num_heads = c.H;
  w.ref.query_dim = c.eq();
  w.ref.key_dim = c.ek();
  w.ref.value_dim = c.ev();
  w.ref.w_q = to_double(w.w_q);
  w.ref.w_k = to_double(w.w_k);
  w.ref.w_v = to_double(w.w_v);
  w.ref.w_o = to_double(w.w_o);
  w.ref.b_q = to_double(w.b_q);
  w.ref.b_k = to_double(w.b_k);
  w.ref.b_v = to_double(w.b_v);
  w.ref.b_o = to_double(w.b_o);
  return w;
}

bool load_weights(mha_module* m, const ModuleCase& c, const WeightSet& w) {
  const int64_t E = c.E;
  const bool tr = c.transposed_weight_storage;
  bool ok = true;
  const bool same_dims = c.eq() == E && c.ek() == E && c.ev() == E;
  if (c.d2l_names) {
    ok &= expect_ok((set_weight(m, "W_q.weight", w.w_q, E, c.eq(), tr)));
    ok &= expect_ok((set_weight(m, "W_k.weight", w.w_k, E, c.ek(), tr)));
    ok &= expect_ok((set_weight(m, "W_v.weight", w.w_v, E, c.ev(), tr)));
    ok &= expect_ok((set_weight(m, "W_o.weight", w.w_o, E, E, tr)));
    if (c.bias) {
      ok &= expect_ok((set_weight(m, "W_q.bias", w.b_q, E, 0, false)));
      ok &= expect_ok((set_weight(m, "W_k.bias", w.b_k, E, 0, false)));
      ok &= expect_ok((set_weight(m, "W_v.bias", w.b_v, E, 0, false)));
      ok &= expect_ok((set_weight(m, "W_o.bias", w.b_o, E, 0, false)));
    }
    return ok;
  }
  if (same_dims && !c.separate_proj) {
    std::vector<float> in_proj = w.w_q;
    in_proj.insert(in_proj.end(), w.w_k.begin(), w.w_k.end());
    in_proj.insert(in_proj.end(), w.w_v.begin(), w.w_v.end());
    ok &= expect_ok((set_weight(m, "in_proj_weight", in_proj, 3 * E, E, tr)));
  } else {
    ok &= expect_ok((set_weight(m, "q_proj_weight", w.w_q, E, c.eq(), tr)));
    ok &= expect_ok((set_weight(m, "k_proj_weight", w.w_k, E, c.ek(), tr)));
    ok &= expect_ok((set_weight(m, "v_proj_weight", w.w_v, E, c.ev(), tr)));
  }
  ok &= expect_ok((set_weight(m, "out_proj.weight", w.w_o, E, E, tr)));
  if (c.bias) {
    std::vector<float> in_bias = w.b_q;
    in_bias.insert(in_bias.end(), w.b_k.begin(), w.b_k.end());
    in_bias.insert(in_bias.end(), w.b_v.begin(), w.b_v.end());
    ok &= expect_ok((set_weight(m, "in_proj_bias", in_bias, 3 * E, 0, false)));
    ok &= expect_ok((set_weight(m, "out_proj.bias", w.b_o, E, 0, false)));
  }
  return ok;
}

::testing::AssertionResult create_module(const ModuleCase& c, ModuleHandle& h) {
  mha_module_config config;
  mha_module_config_init(&config);
  config.embed_dim = c.E;
  config.num_heads = c.H;
  config.query_dim = c.Eq;
  config.key_dim = c.Ek;
  config.value_dim = c.Ev;
  config.bias = c.bias ? 1 : 0;
  config.dropout = c.dropout;
  config.activations = c.activations;
  const mha_status s = mha_module_create(&config, &h.m);
  if (s != MHA_OK)
    return ::testing::AssertionFailure()
           << "create: " << mha_status_name(s) << ": " << mha_last_error();
  return ::testing::AssertionSuccess();
}

std::string report(const char* what, const BoundCheck& check) {
  std::ostringstream os;
  os << what << ": " << check.outside << " of " << check.elements
     << " elements outside the reference's bound; worst |got - ref| / bound = " << check.worst_ratio
     << "; first: " << check.first;
  return os.str();
}

Outcome run_case(const ModuleCase& c) {
  SCOPED_TRACE(c.describe());
  Outcome outcome;
  Rng rng(c.seed * 0x9e3779b97f4a7c15ull + 99);
  const int64_t B = c.B, Lq = c.Lq, Lk = c.Lk, E = c.E, H = c.H;
  const int64_t eq = c.eq(), ek = c.ek(), ev = c.ev();
  if (c.inputs == Inputs::SelfAttention) {
    EXPECT_TRUE(Lq == Lk && eq == ek && ek == ev)
        << "self-attention needs Lq = Lk and Eq = Ek = Ev";
  }
  if (c.inputs == Inputs::SharedKeyValue) {
    EXPECT_EQ(ek, ev) << "key = value needs Ek = Ev";
  }

  ModuleHandle module;
  EXPECT_TRUE(create_module(c, module));
  if (module.m == nullptr) return outcome;
  const WeightSet w = make_weights(c, rng);
  if (!load_weights(module.m, c, w)) return outcome;

  // ---- inputs
  std::vector<Arena> arenas;
  arenas.reserve(3);
  mha_tensor q{}, k{}, v{};
  arenas.emplace_back(input_extent(B, Lq, eq, c.pad, 1, false));
  q = make_input(arenas[0], B, Lq, eq, c.seq_first, c.pad, 1, false);
  if (c.inputs == Inputs::SelfAttention) {
    k = v = q;
  } else {
    arenas.emplace_back(input_extent(B, Lk, ek, c.pad,
                                     c.inputs == Inputs::SharedKeyValue ? c.feature_stride : 1,
                                     c.kv_batch_broadcast));
    k = make_input(arenas[1], B, Lk, ek, c.seq_first, c.pad,
                   c.inputs == Inputs::SharedKeyValue ? c.feature_stride : 1, c.kv_batch_broadcast);
    if (c.inputs == Inputs::SharedKeyValue) {
      v = k;
    } else {
      arenas.emplace_back(input_extent(B, Lk, ev, c.pad, c.feature_stride, c.kv_batch_broadcast));
      v = make_input(arenas[2], B, Lk, ev, c.seq_first, c.pad, c.feature_stride,
                     c.kv_batch_broadcast);
    }
  }
  for (const mha_tensor* t : {&q, &k, &v}) {
    float* data = static_cast<float*>(t->data);
    const float amplitude = t == &v ? 1.0f : c.qk_amplitude;  // (value last: its own)
    for_each_offset(*t, [&](int64_t offset) {
      data[offset] = c.ones_inputs ? 1.0f : rng.uniform(-1.0f, 1.0f) * amplitude;
    });
  }

  // ---- out and attention weights
  Arena out_arena(input_extent(B, Lq, E, c.pad, 1, false));
  mha_tensor out = make_input(out_arena, B, Lq, E, c.out_seq_first, c.pad, 1, false);
  Arena weights_arena(c.need_weights ? B * H * Lq * Lk : 1);
  mha_tensor weights{};
  if (c.need_weights) {
    if (c.average) {
      weights = describe(weights_arena.base(), MHA_DTYPE_F32, {B, Lq, Lk});
    } else if (c.weights_permuted) {
      weights = describe(weights_arena.base(), MHA_DTYPE_F32, {B, H, Lq, Lk},
                         {Lq * H * Lk, Lk, H * Lk, 1});
    } else {
      weights = describe(weights_arena.base(), MHA_DTYPE_F32, {B, H, Lq, Lk});
    }
  }

  // ---- masks
  std::vector<int32_t> lens32;
  std::vector<int64_t> lens64;
  mha_tensor lens_t{};
  if (c.lens != Lens::None) {
    const int64_t count = c.lens == Lens::PerQuery ? B * Lq : B;
    std::vector<int64_t> values = c.lens_values;
    for (int64_t n = static_cast<int64_t>(values.size()); n < count; ++n) {
      const int64_t pattern[4] = {Lk, rng.integer(1, Lk), 0, rng.integer(0, Lk)};
      values.push_back(pattern[n % 4]);
    }
    lens32.assign(values.begin(), values.end());
    lens64 = values;
    void* data = c.lens_dtype == MHA_DTYPE_I64 ? static_cast<void*>(lens64.data())
                                               : static_cast<void*>(lens32.data());
    lens_t = c.lens == Lens::PerQuery ? describe(data, c.lens_dtype, {B, Lq})
                                      : describe(data, c.lens_dtype, {B});
  }
  std::vector<uint8_t> kpm_bool, am_bool;
  std::vector<float> kpm_f32, am_f32;
  mha_tensor kpm_t{}, am_t{};
  if (c.kpm != MaskKind::None) {
    const size_t n = static_cast<size_t>(B * Lk);
    if (c.kpm == MaskKind::Bool) {
      kpm_bool.resize(n);
      for (auto& x : kpm_bool) x = rng.chance(0.25) ? static_cast<uint8_t>(rng.integer(1, 255)) : 0;
      if (c.kpm_dead_batch) std::fill(kpm_bool.begin(), kpm_bool.begin() + Lk, uint8_t{1});
      kpm_t = describe(kpm_bool.data(), MHA_DTYPE_BOOL, {B, Lk});
    } else {
      kpm_f32.resize(n);
      for (auto& x : kpm_f32) x = rng.chance(0.15) ? -kInfF : rng.uniform(-2.0f, 2.0f);
      if (c.kpm_dead_batch) std::fill(kpm_f32.begin(), kpm_f32.begin() + Lk, -kInfF);
      kpm_t = describe(kpm_f32.data(), MHA_DTYPE_F32, {B, Lk});
    }
  }
  if (c.am != MaskKind::None) {
    const std::vector<int64_t> shape =
        c.am_3d ? std::vector<int64_t>{B * H, Lq, Lk} : std::vector<int64_t>{Lq, Lk};
    const size_t n = static_cast<size_t>(element_count(shape));
    if (c.am == MaskKind::Bool) {
      am_bool.resize(n);
      for (auto& x : am_bool) x = rng.chance(0.25) ? 1 : 0;
      am_t = describe(am_bool.data(), MHA_DTYPE_BOOL, shape);
    } else {
      am_f32.resize(n);
      for (auto& x : am_f32) x = rng.chance(0.15) ? -kInfF : rng.uniform(-2.0f, 2.0f);
      am_t = describe(am_f32.data(), MHA_DTYPE_F32, shape);
    }
  }

  // The variants: sinks strided (every other float, to check the stride is
  // read), ALiBi slopes [H] or [B, H].
  std::vector<float> sink_values(static_cast<size_t>(2 * H), -1000.0f);
  if (c.sinks) {
    for (int64_t h = 0; h < H; ++h) {
      sink_values[static_cast<size_t>(2 * h)] =
          std::isnan(c.sink_value) ? rng.uniform(-2.0f, 4.0f) : c.sink_value;
    }
  }
  const mha_tensor sinks_t = describe(sink_values.data(), MHA_DTYPE_F32, {H}, {2});
  std::vector<float> slopes(static_cast<size_t>(B * H));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      slopes[static_cast<size_t>(b * H + h)] =
          std::isnan(c.slope_value)
              ? std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(H)) *
                    (c.alibi_per_batch ? static_cast<float>(b + 1) : 1.0f)
              : c.slope_value;
    }
  }
  const mha_tensor slopes_t = c.alibi_per_batch ? describe(slopes.data(), MHA_DTYPE_F32, {B, H})
                                                : describe(slopes.data(), MHA_DTYPE_F32, {H});

  mha_module_forward_params params;
  mha_module_forward_params_init(&params);
  params.window_left = c.window_left;
  params.window_right = c.window_right;
  params.softcap = c.softcap;
  if (c.sinks) params.sinks = &sinks_t;
  if (c.alibi) params.alibi_slopes = &slopes_t;
  if (c.params_struct_64) {
    // A caller built against 0.1: its struct ends before the variants, and
    // whatever lies there must be ignored.
    EXPECT_FALSE(c.sinks || c.alibi || c.softcap != 0.0f || c.window_left != -1 ||
                 c.window_right != -1)
        << "an old caller has no variants";
    static const float kGarbage[2] = {NAN, NAN};
    static const mha_tensor kGarbageTensor =
        describe(const_cast<float*>(kGarbage), MHA_DTYPE_F32, {2});
    params.struct_size = 64;
    params.window_left = -7;
    params.window_right = 0;
    params.sinks = &kGarbageTensor;
    params.softcap = -3.0f;
    params.alibi_slopes = &kGarbageTensor;
  }
  if (c.lens != Lens::None) params.valid_lens = &lens_t;
  if (c.kpm != MaskKind::None) params.key_padding_mask = &kpm_t;
  if (c.am != MaskKind::None) params.attn_mask = &am_t;
  params.causal = c.causal;
  if (c.need_weights) {
    params.attn_weights = &weights;
    params.average_attn_weights = c.average ? 1 : 0;
  }
  params.training = c.training ? 1 : 0;
  params.dropout_seed = c.dropout_seed;

  ModuleInputs ri;
  ri.query = &q;
  ri.key = &k;
  ri.value = &v;
  ri.valid_lens = params.valid_lens;
  ri.key_padding_mask = params.key_padding_mask;
  ri.attn_mask = params.attn_mask;
  ri.causal = c.causal;
  ri.dropout_p = c.training ? static_cast<double>(c.dropout) : 0.0;
  ri.dropout_seed = c.dropout_seed;
  ri.window_left = c.window_left;
  ri.window_right = c.window_right;
  ri.softcap = static_cast<double>(c.softcap);
  ri.sinks = c.sinks ? &sinks_t : nullptr;
  ri.alibi_slopes = c.alibi ? &slopes_t : nullptr;
  outcome.ref = reference_module(w.ref, ri);

  std::vector<std::vector<float>> inputs_before;
  inputs_before.reserve(arenas.size());
  for (const auto& a : arenas) inputs_before.push_back(a.all());
  const auto kpm_bool_before = kpm_bool, am_bool_before = am_bool;
  const auto kpm_f32_before = kpm_f32, am_f32_before = am_f32;
  const auto out_before = out_arena.all();
  const auto weights_before = weights_arena.all();

  const mha_status status =
      mha_module_forward(module.m, &q, &k, &v, &out, c.null_params ? nullptr : &params);
  EXPECT_EQ(status, MHA_OK) << mha_status_name(status) << ": " << mha_last_error();
  if (status != MHA_OK) return outcome;

  const BoundCheck out_check = check_within(out, outcome.ref.out, outcome.ref.out_bound);
  EXPECT_EQ(out_check.outside, 0) << report("out", out_check);
  g_worst_ratio = std::max(g_worst_ratio, out_check.worst_ratio);
  EXPECT_EQ(out_arena.changed_outside(out, out_before), 0)
      << "written outside out (guards or row padding)";
  if (c.need_weights) {
    const BoundCheck wc =
        c.average ? check_within(weights, outcome.ref.average, outcome.ref.average_bound)
                  : check_within(weights, outcome.ref.weights, outcome.ref.weights_bound);
    EXPECT_EQ(wc.outside, 0) << report("attn_weights", wc);
    g_worst_ratio = std::max(g_worst_ratio, wc.worst_ratio);
    EXPECT_EQ(weights_arena.changed_outside(weights, weights_before), 0)
        << "written outside attn_weights";
    outcome.weights = read_c_order(weights);
  } else {
    EXPECT_TRUE(weights_arena.bits_equal(weights_before));
  }
  for (size_t n = 0; n < arenas.size(); ++n) {
    EXPECT_TRUE(arenas[n].bits_equal(inputs_before[n])) << "input buffer " << n << " was modified";
  }
  EXPECT_TRUE(kpm_bool == kpm_bool_before && am_bool == am_bool_before &&
              kpm_f32 == kpm_f32_before && am_f32 == am_f32_before)
      << "a mask was modified";
  outcome.ok = true;
  outcome.out = read_c_order(out);
  return outcome;
}

bool bits_equal(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  return a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

bool kernel_dropout_available() {
  float x[4] = {0.1f, 0.2f, 0.3f, 0.4f}, o[4];
  mha_tensor q = describe(x, MHA_DTYPE_F32, {1, 1, 2, 2});
  mha_tensor out = describe(o, MHA_DTYPE_F32, {1, 1, 2, 2});
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.dropout_p = 0.5f;
  return mha_attention(&q, &q, &q, &out, &p) == MHA_OK;
}

}  // namespace mha_test
