// The multi-head attention module (mha_module_*) against the float64
// reference of module_reference.h, over every backend this CPU can run:
// configurations, weight names, layouts, every mask kind, attention weights,
// dropout, the attention variants (window, sinks, softcap, ALiBi: each alone,
// together, with every option, their edge values and refusals, and the older
// params struct without them); the positional encoding; bad input; the C++
// wrapper.  Each call
// also checks that nothing outside the outputs was written and that the
// inputs were not modified.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <algorithm>
#include <cctype>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <mha/mha.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "backend_param.h"
#include "module_reference.h"
#include "test_util.h"
#if defined(MHA_TEST_MODULE_TOOL)
#include <filesystem>

#include "npy.h"
#endif

namespace mha_test {
namespace {

constexpr float kInfF = std::numeric_limits<float>::infinity();

enum class Inputs { Separate, SharedKeyValue, SelfAttention };
enum class MaskKind { None, Bool, F32 };
enum class Lens { None, PerBatch, PerQuery };

struct ModuleCase {
  int64_t B = 2, Lq = 5, Lk = 7, E = 16, H = 4;
  int64_t Eq = 0, Ek = 0, Ev = 0;  // 0: E
  bool bias = true;
  bool d2l_names = false;                  // W_q.weight, ... instead of PyTorch's names
  bool separate_proj = false;              // q/k/v_proj_weight even when in_proj_weight fits
  bool transposed_weight_storage = false;  // weights set from column-major views
  Inputs inputs = Inputs::Separate;
  bool ones_inputs = false;  // every input element 1 (the d2l example)
  bool seq_first = false;    // inputs [L, B, F] in memory
  bool out_seq_first = false;
  int64_t pad = 0;                  // unused floats after each row of the inputs and out
  int64_t feature_stride = 1;       // of the value input (2: a general-stride operand)
  bool kv_batch_broadcast = false;  // key and value with batch stride 0
  Lens lens = Lens::None;
  mha_dtype lens_dtype = MHA_DTYPE_I32;
  std::vector<int64_t> lens_values;  // empty: generated
  MaskKind kpm = MaskKind::None;
  MaskKind am = MaskKind::None;
  bool am_3d = false;
  bool kpm_dead_batch = false;  // key_padding_mask ignores every key of batch 0
  int32_t causal = MHA_CAUSAL_NONE;
  bool need_weights = false, average = false;
  bool weights_permuted = false;  // per-head weights stored [B, Lq, H, Lk]
  bool training = false;
  float dropout = 0.0f;  // the module's configuration
  uint64_t dropout_seed = 7;
  bool null_params = false;
  uint64_t seed = 1;
  // The attention variants.
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool sinks = false;
  float sink_value = NAN;  // NaN: random sinks in [-2, 4); else every head's sink
  bool alibi = false, alibi_per_batch = false;
  float slope_value = NAN;        // NaN: ALiBi's geometric slopes 2^(-8 (h + 1) / H); else each
  float qk_amplitude = 1.0f;      // query and key inputs in [-a, a) (separate inputs only)
  bool params_struct_64 = false;  // struct_size 64 (0.1's), the variants' fields garbage

  int64_t eq() const { return Eq != 0 ? Eq : E; }
  int64_t ek() const { return Ek != 0 ? Ek : E; }
  int64_t ev() const { return Ev != 0 ? Ev : E; }

  std::string describe() const {
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
};

struct Outcome {
  bool ok = false;
  std::vector<float> out, weights;  // C order of the logical shapes
  ModuleReference ref;
};

std::vector<float> read_c_order(const mha_tensor& t) {
  std::vector<float> values;
  for_each_offset(
      t, [&](int64_t offset) { values.push_back(static_cast<const float*>(t.data)[offset]); });
  return values;
}

// A [B, L, F] tensor in an arena: batch-first or sequence-first, rows padded.
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

int64_t input_extent(int64_t B, int64_t L, int64_t F, int64_t pad, int64_t feature_stride,
                     bool batch_broadcast) {
  return (batch_broadcast ? 1 : B) * L * (F * feature_stride + pad);
}

// The module's weights, random (PyTorch's default ranges: U(-1/sqrt(fan_in),
// 1/sqrt(fan_in))), kept as floats (what is set) and doubles (the reference).
struct WeightSet {
  std::vector<float> w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o;
  ModuleWeights ref;
};

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

struct ModuleHandle {
  mha_module* m = nullptr;
  ~ModuleHandle() { mha_module_destroy(m); }
};

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

double g_worst_ratio = 0.0;  // over the whole run, printed at the end

// Runs one case on the selected backend and checks everything.
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

// Whether mha_attention implements dropout yet (until it does, it refuses
// dropout_p != 0, and the module's fused path with it).
bool kernel_dropout_available() {
  float x[4] = {0.1f, 0.2f, 0.3f, 0.4f}, o[4];
  mha_tensor q = describe(x, MHA_DTYPE_F32, {1, 1, 2, 2});
  mha_tensor out = describe(o, MHA_DTYPE_F32, {1, 1, 2, 2});
  mha_attention_params p;
  mha_attention_params_init(&p);
  p.dropout_p = 0.5f;
  return mha_attention(&q, &q, &q, &out, &p) == MHA_OK;
}

// ------------------------------------------------------------------ fixture

class Module : public BackendTest {};

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

// ---- the attention variants (issue 15): window, sinks, softcap, ALiBi

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

INSTANTIATE_TEST_SUITE_P(Backends, Module, ::testing::ValuesIn(backend_names()),
                         backend_param_name);

// ------------------------------------------------------------------ positional encoding

TEST(PositionalEncoding, MatchesTheFormula) {
  for (const int64_t d : {32, 33, 1}) {
    for (const bool seq_first : {false, true}) {
      const int64_t B = 2, L = 50, pad = 3;
      Arena arena(B * L * (d + pad));
      mha_tensor x = make_input(arena, B, L, d, seq_first, pad, 1, false);
      Rng rng(static_cast<uint64_t>(d));
      fill_uniform(x, rng);
      const std::vector<float> before = arena.all();
      ASSERT_EQ(mha_positional_encoding_add(&x), MHA_OK) << mha_last_error();
      int64_t bad = 0;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < L; ++i)
          for (int64_t c = 0; c < d; ++c) {
            const int64_t j = c / 2;
            const double angle =
                static_cast<double>(i) /
                std::pow(10000.0, 2.0 * static_cast<double>(j) / static_cast<double>(d));
            const double p = c % 2 == 0 ? std::sin(angle) : std::cos(angle);
            const int64_t at = b * x.strides[0] + i * x.strides[1] + c;
            const double x0 = static_cast<double>(before[static_cast<size_t>(at + Arena::kGuard)]);
            const float want = static_cast<float>(x0 + p);
            const float got = static_cast<const float*>(x.data)[at];
            // Rounded once from double: at most one float step from the exact sum.
            if (!(std::fabs(static_cast<double>(got) - (x0 + p)) <=
                  std::fabs(static_cast<double>(std::nextafter(want, kInfF)) -
                            static_cast<double>(want)))) {
              if (bad++ == 0)
                ADD_FAILURE() << "d=" << d << " [" << b << "," << i << "," << c << "] = " << got
                              << ", want " << want;
            }
          }
      EXPECT_EQ(bad, 0) << "d = " << d;
      EXPECT_EQ(arena.changed_outside(x, before), 0) << "written outside x";
    }
  }
  // Spot values: position 0 is (0, 1, 0, 1, ...); position 1, column 0 is sin(1).
  float y[2 * 5] = {};
  mha_tensor t = describe(y, MHA_DTYPE_F32, {1, 2, 5});
  ASSERT_EQ(mha_positional_encoding_add(&t), MHA_OK);
  EXPECT_EQ(y[0], 0.0f);
  EXPECT_EQ(y[1], 1.0f);
  EXPECT_EQ(y[4], 0.0f);  // d = 5: column 4 is a sine
  EXPECT_EQ(y[5], static_cast<float>(std::sin(1.0)));
  EXPECT_EQ(y[6], static_cast<float>(std::cos(1.0)));
  EXPECT_EQ(y[9], static_cast<float>(std::sin(1.0 / std::pow(10000.0, 4.0 / 5.0))));
}

TEST(PositionalEncoding, RefusesBadInput) {
  float x[8] = {};
  mha_tensor t = describe(x, MHA_DTYPE_F32, {2, 4});
  EXPECT_EQ(mha_positional_encoding_add(&t), MHA_ERR_INVALID_SIZE);
  EXPECT_NE(std::string(mha_last_error()).find("x must have 3 dimensions"), std::string::npos)
      << mha_last_error();
  EXPECT_EQ(mha_positional_encoding_add(nullptr), MHA_ERR_NULL_POINTER);
  int32_t ints[8] = {};
  t = describe(ints, MHA_DTYPE_I32, {1, 2, 4});
  EXPECT_EQ(mha_positional_encoding_add(&t), MHA_ERR_INVALID_DTYPE);
  t = describe(x, MHA_DTYPE_F32, {2, 2, 2}, {0, 2, 1});  // batch stride 0: adds twice
  EXPECT_EQ(mha_positional_encoding_add(&t), MHA_ERR_OVERLAP);
  for (float e : x) EXPECT_EQ(e, 0.0f);
}

// ------------------------------------------------------------------ bad input

::testing::AssertionResult fails_with(mha_status got, mha_status want, const std::string& text) {
  const std::string message = mha_last_error();
  if (got != want) {
    return ::testing::AssertionFailure() << "status " << mha_status_name(got) << ", want "
                                         << mha_status_name(want) << " (" << message << ")";
  }
  if (message.find(text) == std::string::npos) {
    return ::testing::AssertionFailure() << "message '" << message << "' lacks '" << text << "'";
  }
  return ::testing::AssertionSuccess();
}

TEST(ModuleConfig, BadConfigurationsAreRefused) {
  struct Bad {
    int64_t e, h, eq, ek, ev;
    float dropout;
    mha_status status;
    const char* text;
  };
  const Bad cases[] = {
      {0, 1, 0, 0, 0, 0.0f, MHA_ERR_INVALID_SIZE, "config->embed_dim = 0; it must be positive"},
      {-8, 2, 0, 0, 0, 0.0f, MHA_ERR_INVALID_SIZE, "config->embed_dim = -8"},
      {8, 0, 0, 0, 0, 0.0f, MHA_ERR_INVALID_SIZE, "config->num_heads = 0"},
      {10, 3, 0, 0, 0, 0.0f, MHA_ERR_INVALID_SIZE,
       "config->embed_dim = 10 is not a multiple of config->num_heads = 3"},
      {8, 2, -1, 0, 0, 0.0f, MHA_ERR_INVALID_SIZE, "config->query_dim = -1"},
      {8, 2, 0, -3, 0, 0.0f, MHA_ERR_INVALID_SIZE, "config->key_dim = -3"},
      {8, 2, 0, 0, -2, 0.0f, MHA_ERR_INVALID_SIZE, "config->value_dim = -2"},
      {8, 2, 0, 0, 0, 1.0f, MHA_ERR_INVALID_VALUE, "config->dropout = 1; it must be in [0, 1)"},
      {8, 2, 0, 0, 0, -0.1f, MHA_ERR_INVALID_VALUE, "config->dropout = -0.1"},
      {8, 2, 0, 0, 0, std::numeric_limits<float>::quiet_NaN(), MHA_ERR_INVALID_VALUE,
       "config->dropout = nan"},
      {int64_t{1} << 40, 1, 0, 0, 0, 0.0f, MHA_ERR_SIZE_OVERFLOW, "overflow"},
  };
  // A pointer that is not a module, to see that a failed create leaves it alone.
  alignas(64) static char not_a_module[64];
  mha_module* const sentinel = reinterpret_cast<mha_module*>(not_a_module);
  for (const Bad& b : cases) {
    mha_module_config c;
    mha_module_config_init(&c);
    c.embed_dim = b.e, c.num_heads = b.h, c.query_dim = b.eq, c.key_dim = b.ek, c.value_dim = b.ev;
    c.dropout = b.dropout;
    mha_module* m = sentinel;  // must stay untouched
    EXPECT_TRUE(fails_with(mha_module_create(&c, &m), b.status, b.text)) << b.text;
    EXPECT_EQ(m, sentinel) << "a failed create wrote its output";
  }
  mha_module_config c;
  mha_module_config_init(&c);
  c.embed_dim = 8, c.num_heads = 2;
  mha_module* m = nullptr;
  EXPECT_TRUE(fails_with(mha_module_create(nullptr, &m), MHA_ERR_NULL_POINTER, "config is NULL"));
  EXPECT_TRUE(fails_with(mha_module_create(&c, nullptr), MHA_ERR_NULL_POINTER, "module is NULL"));
  c.struct_size = 12;
  EXPECT_TRUE(
      fails_with(mha_module_create(&c, &m), MHA_ERR_INVALID_PARAMS, "config->struct_size is 12"));
  EXPECT_EQ(m, nullptr);
  mha_module_config_init(&c);
  EXPECT_EQ(c.bias, 1) << "biases on by default, as PyTorch";
  mha_module_destroy(nullptr);  // a no-op
}

TEST(ModuleWeights, WrongWeightsAreRefused) {
  mha_module_config c;
  mha_module_config_init(&c);
  c.embed_dim = 8, c.num_heads = 2;
  ModuleHandle m;
  ASSERT_EQ(mha_module_create(&c, &m.m), MHA_OK);
  std::vector<float> data(3 * 8 * 8, 0.25f);
  std::vector<int32_t> ints(64);
  const auto t = [&](const std::vector<int64_t>& shape) {
    return describe(data.data(), MHA_DTYPE_F32, shape);
  };
  mha_tensor w = t({24, 8});
  EXPECT_EQ(mha_module_set_weight(m.m, "in_proj_weight", &w), MHA_OK) << mha_last_error();
  w = t({8, 8});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "in_proj_weight", &w), MHA_ERR_SHAPE_MISMATCH,
                         "in_proj_weight has shape [8, 8]; it must be [3E, E] = [24, 8]"));
  w = t({8, 7});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "out_proj.weight", &w), MHA_ERR_SHAPE_MISMATCH,
                         "out_proj.weight has shape [8, 7]; it must be [E, E] = [8, 8]"));
  w = t({8});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "W_q.weight", &w), MHA_ERR_INVALID_SIZE,
                         "W_q.weight must have 2 dimensions, has 1"));
  w = t({8, 8});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "in_proj_bias", &w), MHA_ERR_INVALID_SIZE,
                         "in_proj_bias must have 1 dimensions, has 2"));
  w = t({16});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "in_proj_bias", &w), MHA_ERR_SHAPE_MISMATCH,
                         "in_proj_bias has shape [16]; it must be [3E] = [24]"));
  w = describe(ints.data(), MHA_DTYPE_I32, {8, 8});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "W_o.weight", &w), MHA_ERR_INVALID_DTYPE,
                         "W_o.weight has dtype i32; it must be f32"));
  w = t({8, 8});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "out_proj.weights", &w), MHA_ERR_INVALID_VALUE,
                         "unknown weight name 'out_proj.weights'"));
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "bias_k", &w), MHA_ERR_INVALID_VALUE,
                         "unknown weight name 'bias_k'"));
  EXPECT_TRUE(
      fails_with(mha_module_set_weight(m.m, nullptr, &w), MHA_ERR_NULL_POINTER, "name is NULL"));
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "W_o.weight", nullptr), MHA_ERR_NULL_POINTER,
                         "is NULL"));
  EXPECT_TRUE(fails_with(mha_module_set_weight(nullptr, "W_o.weight", &w), MHA_ERR_NULL_POINTER,
                         "module is NULL"));
  w.data = nullptr;
  EXPECT_TRUE(fails_with(mha_module_set_weight(m.m, "W_o.weight", &w), MHA_ERR_NULL_POINTER,
                         "W_o.weight->data is NULL"));

  // in_proj_weight needs equal sizes; biases need a module with biases.
  c.query_dim = 5, c.bias = 0;
  ModuleHandle m2;
  ASSERT_EQ(mha_module_create(&c, &m2.m), MHA_OK);
  w = t({24, 8});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m2.m, "in_proj_weight", &w), MHA_ERR_INVALID_VALUE,
                         "'in_proj_weight' needs query_dim = key_dim = value_dim = embed_dim"));
  w = t({8, 5});
  EXPECT_EQ(mha_module_set_weight(m2.m, "q_proj_weight", &w), MHA_OK) << mha_last_error();
  w = t({8});
  EXPECT_TRUE(fails_with(mha_module_set_weight(m2.m, "out_proj.bias", &w), MHA_ERR_INVALID_VALUE,
                         "'out_proj.bias': this module has no biases"));
  EXPECT_TRUE(fails_with(mha_module_set_weight(m2.m, "W_k.bias", &w), MHA_ERR_INVALID_VALUE,
                         "has no biases"));
}

// A well-formed forward call on [2, 3, 8] inputs that a test then breaks.
struct ForwardFixture {
  ModuleHandle m;
  std::vector<float> x = std::vector<float>(2 * 3 * 8, 0.5f),
                     kv = std::vector<float>(2 * 4 * 6, 0.5f);
  std::vector<float> o = std::vector<float>(2 * 3 * 8, 42.0f);
  std::vector<float> w = std::vector<float>(2 * 2 * 3 * 4, 42.0f);
  std::vector<int32_t> lens = {4, 5};
  std::vector<uint8_t> bytes = std::vector<uint8_t>(2 * 2 * 3 * 4, 0);
  std::vector<double> doubles = std::vector<double>(16, 0.0);
  mha_tensor q{}, k{}, v{}, out{}, weights{}, lens_t{};
  mha_module_forward_params p{};

  ForwardFixture() {
    mha_module_config c;
    mha_module_config_init(&c);
    c.embed_dim = 8, c.num_heads = 2, c.key_dim = 6, c.value_dim = 6;
    EXPECT_EQ(mha_module_create(&c, &m.m), MHA_OK) << mha_last_error();
    q = describe(x.data(), MHA_DTYPE_F32, {2, 3, 8});
    k = v = describe(kv.data(), MHA_DTYPE_F32, {2, 4, 6});
    out = describe(o.data(), MHA_DTYPE_F32, {2, 3, 8});
    weights = describe(w.data(), MHA_DTYPE_F32, {2, 2, 3, 4});
    lens_t = describe(lens.data(), MHA_DTYPE_I32, {2});
    mha_module_forward_params_init(&p);
  }
  mha_status call() { return mha_module_forward(m.m, &q, &k, &v, &out, &p); }
  bool out_untouched() const {
    for (float e : o)
      if (e != 42.0f) return false;
    for (float e : w)
      if (e != 42.0f) return false;
    return true;
  }
};

// Run by ctest with MHA_VERBOSE=2 (module.verbose_gemm_kernel): a module call
// on avx512, then on avx2.  The entry's regular expression checks that the
// first call's line names avx512's micro-kernel for the products (BLIS's
// "skx" set, which mha gives BLIS on AVX-512 CPUs, packs for its 32 x 12
// tile) and the second BLIS's own (avx2 offers none for that set).
TEST(ModuleVerbose, LinesNameTheGemmKernel) {
  const char* verbose = std::getenv("MHA_VERBOSE");
  if (verbose == nullptr || std::string(verbose) != "2") GTEST_SKIP() << "runs with MHA_VERBOSE=2";
  const auto backends = list_backends();
  for (const char* name : {"avx512", "avx2"}) {
    const BackendEntry* entry = find_backend(backends, name);
    if (entry == nullptr || !entry->usable) {
      std::printf("%s is not usable here\n", name);
      continue;
    }
    ASSERT_EQ(mha_select_backend(name), MHA_OK) << mha_last_error();
    ForwardFixture f;
    ASSERT_EQ(f.call(), MHA_OK) << mha_last_error();
    std::fflush(stderr);
    std::printf("module call on %s done\n", name);
    std::fflush(stdout);
  }
  mha_select_backend("auto");
}

TEST(ModuleForward, BadCallsAreRefusedAndWriteNothing) {
  struct Bad {
    const char* what;
    std::function<void(ForwardFixture&)> edit;
    mha_status status;
    const char* text;
  };
  const Bad cases[] = {
      {"query features", [](ForwardFixture& f) { f.q.shape[2] = 7; }, MHA_ERR_SHAPE_MISMATCH,
       "query has 7 features (shape [2, 3, 7]) but the module's query_dim is 8"},
      {"key features", [](ForwardFixture& f) { f.k = f.q; }, MHA_ERR_SHAPE_MISMATCH,
       "key has 8 features (shape [2, 3, 8]) but the module's key_dim is 6"},
      {"value batch", [](ForwardFixture& f) { f.v.shape[0] = 1; }, MHA_ERR_SHAPE_MISMATCH,
       "batch: query has 2"},
      {"value length", [](ForwardFixture& f) { f.v.shape[1] = 3; }, MHA_ERR_SHAPE_MISMATCH,
       "key length: key has 4 but value has 3"},
      {"out shape", [](ForwardFixture& f) { f.out.shape[2] = 6; }, MHA_ERR_SHAPE_MISMATCH,
       "out has shape [2, 3, 6]; it must be [B, Lq, E] = [2, 3, 8]"},
      {"rank", [](ForwardFixture& f) { f.q.ndim = 4; }, MHA_ERR_INVALID_SIZE,
       "query must have 3 dimensions, has 4"},
      {"dtype", [](ForwardFixture& f) { f.k.dtype = MHA_DTYPE_I32; }, MHA_ERR_INVALID_DTYPE,
       "key has dtype i32; it must be f32"},
      {"null", [](ForwardFixture& f) { f.v.data = nullptr; }, MHA_ERR_NULL_POINTER,
       "value->data is NULL"},
      {"overlap", [](ForwardFixture& f) { f.out.data = f.x.data(); }, MHA_ERR_OVERLAP,
       "out overlaps query"},
      {"self overlap", [](ForwardFixture& f) { f.out.strides[1] = 0; }, MHA_ERR_OVERLAP,
       "out overlaps itself"},
      {"causal", [](ForwardFixture& f) { f.p.causal = 7; }, MHA_ERR_INVALID_VALUE,
       "params->causal = 7"},
      {"struct size", [](ForwardFixture& f) { f.p.struct_size = 8; }, MHA_ERR_INVALID_PARAMS,
       "params->struct_size is 8"},
      {"valid_lens value",
       [](ForwardFixture& f) {
         f.lens[1] = 5;
         f.p.valid_lens = &f.lens_t;
       },
       MHA_ERR_INVALID_VALUE, "params->valid_lens[1] = 5 is outside [0, Lk = 4]"},
      {"valid_lens shape",
       [](ForwardFixture& f) {
         f.lens_t.shape[0] = 1;
         f.p.valid_lens = &f.lens_t;
       },
       MHA_ERR_SHAPE_MISMATCH, "params->valid_lens has shape [1]"},
      {"valid_lens dtype",
       [](ForwardFixture& f) {
         f.lens_t.dtype = MHA_DTYPE_F32;
         f.p.valid_lens = &f.lens_t;
       },
       MHA_ERR_INVALID_DTYPE, "params->valid_lens has dtype f32; it must be i32 or i64"},
      {"key_padding_mask shape",
       [](ForwardFixture& f) {
         static mha_tensor t;
         t = describe(f.bytes.data(), MHA_DTYPE_BOOL, {2, 3});
         f.p.key_padding_mask = &t;
       },
       MHA_ERR_SHAPE_MISMATCH,
       "params->key_padding_mask has shape [2, 3]; it must be [B, Lk] = [2, 4]"},
      {"key_padding_mask dtype",
       [](ForwardFixture& f) {
         static mha_tensor t;
         t = describe(f.lens.data(), MHA_DTYPE_I32, {2, 1});
         f.p.key_padding_mask = &t;
       },
       MHA_ERR_INVALID_DTYPE, "params->key_padding_mask has dtype i32; it must be bool or f32"},
      {"attn_mask shape",
       [](ForwardFixture& f) {
         static mha_tensor t;
         t = describe(f.bytes.data(), MHA_DTYPE_BOOL, {2, 3, 4});
         f.p.attn_mask = &t;
       },
       MHA_ERR_SHAPE_MISMATCH,
       "params->attn_mask has shape [2, 3, 4]; it must be [Lq, Lk] = [3, 4] or [B*H, Lq, Lk] = [4, "
       "3, 4]"},
      {"attn_mask rank",
       [](ForwardFixture& f) {
         static mha_tensor t;
         t = describe(f.bytes.data(), MHA_DTYPE_BOOL, {1, 4, 3, 4});
         f.p.attn_mask = &t;
       },
       MHA_ERR_INVALID_SIZE, "params->attn_mask must have 2 to 3 dimensions, has 4"},
      {"attn_weights shape",
       [](ForwardFixture& f) {
         f.weights.shape[1] = 1;
         f.p.attn_weights = &f.weights;
       },
       MHA_ERR_SHAPE_MISMATCH,
       "params->attn_weights has shape [2, 1, 3, 4]; it must be [B, H, Lq, Lk] = [2, 2, 3, 4]"},
      {"averaged attn_weights rank",
       [](ForwardFixture& f) {
         f.p.attn_weights = &f.weights;
         f.p.average_attn_weights = 1;
       },
       MHA_ERR_INVALID_SIZE, "params->attn_weights must have 3 dimensions, has 4"},
      {"attn_weights overlap out",
       [](ForwardFixture& f) {
         f.weights.data = f.o.data();
         f.p.attn_weights = &f.weights;
       },
       MHA_ERR_OVERLAP, "out overlaps params->attn_weights"},
  };
  for (const Bad& b : cases) {
    ForwardFixture f;
    b.edit(f);
    EXPECT_TRUE(fails_with(f.call(), b.status, b.text)) << b.what;
    EXPECT_TRUE(f.out_untouched()) << b.what << ": a failed call wrote an output";
  }
  ForwardFixture f;
  EXPECT_EQ(f.call(), MHA_OK) << mha_last_error();
  EXPECT_TRUE(fails_with(mha_module_forward(nullptr, &f.q, &f.k, &f.v, &f.out, nullptr),
                         MHA_ERR_NULL_POINTER, "module is NULL"));
  EXPECT_TRUE(fails_with(mha_module_forward(f.m.m, &f.q, nullptr, &f.v, &f.out, nullptr),
                         MHA_ERR_NULL_POINTER, "key is NULL"));
}

// The variants' refusals: the status, the argument named as the core names
// it (prefixed params->), nothing written.
TEST(ModuleForward, VariantsRefusedByName) {
  struct Bad {
    const char* what;
    std::function<void(ForwardFixture&)> edit;
    mha_status status;
    const char* text;
  };
  // An F32 descriptor over `values`, kept until the next one is made (each
  // case's edit runs just before its call).  The fixture has H = 2, B = 2.
  static std::vector<float> floats;
  static mha_tensor t;
  const auto tensor = [](std::vector<float> values, const std::vector<int64_t>& shape) {
    floats = std::move(values);
    t = describe(floats.data(), MHA_DTYPE_F32, shape);
    return &t;
  };
  const Bad cases[] = {
      {"window_left -2", [](ForwardFixture& f) { f.p.window_left = -2; }, MHA_ERR_INVALID_VALUE,
       "params->window_left = -2; it must be -1 (unbounded) or a key count >= 0"},
      {"window_right -5", [](ForwardFixture& f) { f.p.window_right = -5; }, MHA_ERR_INVALID_VALUE,
       "params->window_right = -5"},
      {"softcap negative", [](ForwardFixture& f) { f.p.softcap = -1.0f; }, MHA_ERR_INVALID_VALUE,
       "params->softcap = -1; it must be 0 (off) or a finite value > 0"},
      {"softcap NaN", [](ForwardFixture& f) { f.p.softcap = NAN; }, MHA_ERR_INVALID_VALUE,
       "params->softcap = nan"},
      {"softcap inf", [](ForwardFixture& f) { f.p.softcap = INFINITY; }, MHA_ERR_INVALID_VALUE,
       "params->softcap = inf"},
      {"softcap -inf", [](ForwardFixture& f) { f.p.softcap = -INFINITY; }, MHA_ERR_INVALID_VALUE,
       "params->softcap = -inf"},
      {"sinks shape",
       [&](ForwardFixture& f) {
         f.p.sinks = tensor({0, 0, 0}, {3});
       },
       MHA_ERR_SHAPE_MISMATCH, "params->sinks has shape [3]; it must be [H] = [2]"},
      {"sinks rank",
       [&](ForwardFixture& f) {
         f.p.sinks = tensor({0, 0}, {1, 2});
       },
       MHA_ERR_INVALID_SIZE, "params->sinks must have 1 dimensions, has 2"},
      {"sinks dtype",
       [](ForwardFixture& f) {
         static mha_tensor ints;
         ints = describe(f.lens.data(), MHA_DTYPE_I32, {2});
         f.p.sinks = &ints;
       },
       MHA_ERR_INVALID_DTYPE, "params->sinks has dtype i32; it must be f32"},
      {"sinks NaN",
       [&](ForwardFixture& f) {
         f.p.sinks = tensor({0, NAN}, {2});
       },
       MHA_ERR_INVALID_VALUE, "params->sinks[1] = nan; a sink must be finite or -inf (no sink)"},
      {"sinks +inf",
       [&](ForwardFixture& f) {
         f.p.sinks = tensor({INFINITY, 0}, {2});
       },
       MHA_ERR_INVALID_VALUE, "params->sinks[0] = inf"},
      {"sinks NULL data",
       [&](ForwardFixture& f) {
         f.p.sinks = tensor({0, 0}, {2});
         t.data = nullptr;
       },
       MHA_ERR_NULL_POINTER, "params->sinks->data is NULL"},
      {"alibi_slopes shape",
       [&](ForwardFixture& f) {
         f.p.alibi_slopes = tensor({1, 1, 1}, {3});
       },
       MHA_ERR_SHAPE_MISMATCH,
       "params->alibi_slopes has shape [3]; it must be [H] = [2] or [B, H] = [2, 2]"},
      {"alibi_slopes batch",
       [&](ForwardFixture& f) {
         f.p.alibi_slopes = tensor({1, 1, 1, 1, 1, 1}, {3, 2});
       },
       MHA_ERR_SHAPE_MISMATCH, "params->alibi_slopes has shape [3, 2]"},
      {"alibi_slopes rank",
       [&](ForwardFixture& f) {
         f.p.alibi_slopes = tensor({1, 1, 1, 1}, {1, 2, 2});
       },
       MHA_ERR_INVALID_SIZE, "params->alibi_slopes must have 1 to 2 dimensions, has 3"},
      {"alibi_slopes dtype",
       [](ForwardFixture& f) {
         static mha_tensor ints;
         ints = describe(f.lens.data(), MHA_DTYPE_I32, {2});
         f.p.alibi_slopes = &ints;
       },
       MHA_ERR_INVALID_DTYPE, "params->alibi_slopes has dtype i32; it must be f32"},
      {"alibi_slopes inf",
       [&](ForwardFixture& f) {
         f.p.alibi_slopes = tensor({1, 1, 1, INFINITY}, {2, 2});
       },
       MHA_ERR_INVALID_VALUE, "params->alibi_slopes holds inf; slopes must be finite"},
      {"alibi_slopes NaN",
       [&](ForwardFixture& f) {
         f.p.alibi_slopes = tensor({NAN, 1}, {2});
       },
       MHA_ERR_INVALID_VALUE, "params->alibi_slopes holds nan"},
      {"sinks overlap out",
       [](ForwardFixture& f) {
         static mha_tensor in_out;
         in_out = describe(f.o.data() + 4, MHA_DTYPE_F32, {2});
         f.p.sinks = &in_out;
       },
       MHA_ERR_OVERLAP, "out overlaps params->sinks"},
      {"alibi_slopes overlap attn_weights",
       [](ForwardFixture& f) {
         static mha_tensor in_weights;
         in_weights = describe(f.w.data() + 6, MHA_DTYPE_F32, {2, 2});
         f.p.alibi_slopes = &in_weights;
         f.p.attn_weights = &f.weights;
       },
       MHA_ERR_OVERLAP, "params->attn_weights overlaps params->alibi_slopes"},
      {"a struct size of no version", [](ForwardFixture& f) { f.p.struct_size = 88; },
       MHA_ERR_INVALID_PARAMS, "params->struct_size is 88"},
  };
  for (const Bad& b : cases) {
    ForwardFixture f;
    b.edit(f);
    EXPECT_TRUE(fails_with(f.call(), b.status, b.text)) << b.what;
    EXPECT_TRUE(f.out_untouched()) << b.what << ": a failed call wrote an output";
  }
  // The defaults, and every variant in range, are accepted.
  ForwardFixture f;
  EXPECT_EQ(f.p.window_left, -1);
  EXPECT_EQ(f.p.window_right, -1);
  EXPECT_EQ(f.p.sinks, nullptr);
  EXPECT_EQ(f.p.softcap, 0.0f);
  EXPECT_EQ(f.p.alibi_slopes, nullptr);
  EXPECT_EQ(f.p.struct_size, sizeof(mha_module_forward_params));
  std::vector<float> sinks = {-INFINITY, 1e4f}, slopes = {0.0f, -0.5f, 0.25f, 1e3f};
  const mha_tensor sinks_t = describe(sinks.data(), MHA_DTYPE_F32, {2});
  const mha_tensor slopes_t = describe(slopes.data(), MHA_DTYPE_F32, {2, 2});
  f.p.window_left = 0, f.p.window_right = INT64_MAX, f.p.softcap = FLT_MAX;
  f.p.sinks = &sinks_t, f.p.alibi_slopes = &slopes_t, f.p.attn_weights = &f.weights;
  EXPECT_EQ(f.call(), MHA_OK) << mha_last_error();
}

// ------------------------------------------------------------------ C++ wrapper

TEST(ModuleCpp, RaiiMoveAndErrors) {
  mha::ModuleConfig config;
  config.embed_dim = 8;
  config.num_heads = 2;
  config.bias = true;
  mha::Module a(config);
  std::vector<float> bias = {1, 2, 3, 4, 5, 6, 7, 8};
  a.set_weight("out_proj.bias", mha::Tensor(bias.data(), {8}));
  mha::Module b(std::move(a));
  EXPECT_EQ(a.get(), nullptr);  // NOLINT(bugprone-use-after-move,clang-analyzer-cplusplus.Move):
                                // the moved-from state is what is tested
  std::vector<float> x(2 * 3 * 8, 0.5f), o(2 * 3 * 8, 0.0f);
  mha::Tensor xt(x.data(), {2, 3, 8});
  mha::Tensor ot(o.data(), {2, 3, 8});
  b.forward(xt, xt, xt, ot);
  for (size_t n = 0; n < o.size(); ++n) EXPECT_EQ(o[n], bias[n % 8]);
  mha::Module c(4, 2);
  c = std::move(b);
  EXPECT_NE(c.get(), nullptr);
  std::vector<float> weights(2 * 2 * 3 * 3);
  mha::Tensor wt(weights.data(), {2, 2, 3, 3});
  c.forward(xt, xt, xt, ot,
            mha::ModuleForwardParams().attn_weights(wt).causal(MHA_CAUSAL_TOP_LEFT));
  EXPECT_EQ(weights[1], 0.0f);  // causal: query 0 does not see key 1
  EXPECT_FLOAT_EQ(weights[0], 1.0f);
  try {
    c.set_weight("nonsense", mha::Tensor(bias.data(), {8}));
    ADD_FAILURE() << "no exception";
  } catch (const mha::Error& e) {
    EXPECT_EQ(e.status(), MHA_ERR_INVALID_VALUE);
    EXPECT_NE(std::string(e.what()).find("unknown weight name 'nonsense'"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(mha::Module(10, 3), mha::Error);
  mha::Tensor pe(x.data(), {2, 3, 8});
  mha::positional_encoding_add(pe);
  EXPECT_EQ(x[1], 1.5f);  // position 0, column 1: cos(0) = 1
}

#if defined(MHA_TEST_MODULE_TOOL)
// ------------------------------------------------------------------ mha-run module
//
// The ends of ctest chains (tests/CMakeLists.txt) around the program itself:
// ModuleTool.Write writes weights and inputs into $MHA_MODULE_TOOL_DIR, ctest
// runs `mha-run module` on them, ModuleTool.Check compares its files with the
// reference.  Without MHA_MODULE_TOOL_DIR (a plain run of this binary) they
// skip; ctest runs them only in the chains.

std::string tool_dir() {
  const char* dir = std::getenv("MHA_MODULE_TOOL_DIR");
  return dir != nullptr ? dir : "";
}

mha_tools::NpyArray npy_of(const std::vector<float>& v, std::vector<int64_t> shape) {
  mha_tools::NpyArray a(mha_tools::NpyDtype::F32, std::move(shape));
  for (int64_t i = 0; i < a.size(); ++i)
    a.set_from_double(i, static_cast<double>(v[static_cast<size_t>(i)]));
  return a;
}

mha_tools::NpyArray random_npy(Rng& rng, std::vector<int64_t> shape, float amplitude = 1.0f) {
  mha_tools::NpyArray a(mha_tools::NpyDtype::F32, std::move(shape));
  for (int64_t i = 0; i < a.size(); ++i)
    a.set_from_double(i, static_cast<double>(rng.uniform(-amplitude, amplitude)));
  return a;
}

// The tool cases:
//   a: PyTorch names and biases, config.json with num_heads 4, batch-first
//      query [2, 5, 16], key = value [2, 7, 16], valid_lens [B], averaged weights;
//   b: q/k/v_proj_weight (Eq 12, Ek = Ev 10), no biases, --heads 2, sequence-first,
//      a bool key_padding_mask, an f32 attn_mask [Lq, Lk], causal, per-head weights;
//   c: the attention variants: --heads 4, query [2, 6, 16] (amplitude 4, so
//      that the softcap bites), key = value [2, 9, 16], --window 3,1, causal
//      bottom-right, --softcap 1.5, sinks [H] (one -inf), ALiBi slopes [B, H],
//      per-head weights.
struct ToolCase {
  const char* name;
  int64_t B, Lq, Lk, E, H, Eq, Ek, Ev;
  bool bias, seq_first;
};
const ToolCase kToolCases[] = {{"a", 2, 5, 7, 16, 4, 16, 16, 16, true, false},
                               {"b", 2, 6, 8, 8, 2, 12, 10, 10, false, true},
                               {"c", 2, 6, 9, 16, 4, 16, 16, 16, true, false}};

ModuleWeights tool_weights(const ToolCase& t, Rng& rng,
                           std::vector<std::pair<std::string, mha_tools::NpyArray>>* files) {
  ModuleWeights w;
  w.embed_dim = t.E, w.num_heads = t.H, w.query_dim = t.Eq, w.key_dim = t.Ek, w.value_dim = t.Ev;
  const auto make = [&](int64_t rows, int64_t cols, bool zero) {
    std::vector<float> v(static_cast<size_t>(rows * cols), 0.0f);
    if (!zero)
      for (float& x : v) x = rng.uniform(-0.3f, 0.3f);
    return v;
  };
  std::vector<float> wq = make(t.E, t.Eq, false), wk = make(t.E, t.Ek, false),
                     wv = make(t.E, t.Ev, false), wo = make(t.E, t.E, false),
                     bq = make(t.E, 1, !t.bias), bk = make(t.E, 1, !t.bias),
                     bv = make(t.E, 1, !t.bias), bo = make(t.E, 1, !t.bias);
  const auto d = [](const std::vector<float>& v) {
    return std::vector<double>(v.begin(), v.end());
  };
  w.w_q = d(wq), w.w_k = d(wk), w.w_v = d(wv), w.w_o = d(wo), w.b_q = d(bq), w.b_k = d(bk),
  w.b_v = d(bv), w.b_o = d(bo);
  if (files != nullptr) {
    if (t.Eq == t.E && t.Ek == t.E && t.Ev == t.E) {
      std::vector<float> in = wq;
      in.insert(in.end(), wk.begin(), wk.end());
      in.insert(in.end(), wv.begin(), wv.end());
      files->emplace_back("in_proj_weight", npy_of(in, {3 * t.E, t.E}));
    } else {
      files->emplace_back("q_proj_weight", npy_of(wq, {t.E, t.Eq}));
      files->emplace_back("k_proj_weight", npy_of(wk, {t.E, t.Ek}));
      files->emplace_back("v_proj_weight", npy_of(wv, {t.E, t.Ev}));
    }
    files->emplace_back("out_proj.weight", npy_of(wo, {t.E, t.E}));
    if (t.bias) {
      std::vector<float> in = bq;
      in.insert(in.end(), bk.begin(), bk.end());
      in.insert(in.end(), bv.begin(), bv.end());
      files->emplace_back("in_proj_bias", npy_of(in, {3 * t.E}));
      files->emplace_back("out_proj.bias", npy_of(bo, {t.E}));
    }
  }
  return w;
}

// Everything of a case but the weights, derived from its seed.
struct ToolInputs {
  mha_tools::NpyArray query, key, valid_lens, kpm, attn_mask, sinks, alibi;
};

ToolInputs tool_inputs(const ToolCase& t, Rng& rng) {
  ToolInputs in;
  const float amplitude = t.name[0] == 'c' ? 4.0f : 1.0f;
  in.query = random_npy(
      rng,
      t.seq_first ? std::vector<int64_t>{t.Lq, t.B, t.Eq} : std::vector<int64_t>{t.B, t.Lq, t.Eq},
      amplitude);
  in.key = random_npy(rng, t.seq_first ? std::vector<int64_t>{t.Lk, t.B, t.Ek}
                                       : std::vector<int64_t>{t.B, t.Lk, t.Ek});
  if (t.name[0] == 'a') {
    in.valid_lens = mha_tools::NpyArray(mha_tools::NpyDtype::I32, {t.B});
    in.valid_lens.set_from_double(0, 4);
    in.valid_lens.set_from_double(1, 7);
  } else if (t.name[0] == 'c') {
    in.sinks = mha_tools::NpyArray(mha_tools::NpyDtype::F32, {t.H});
    for (int64_t h = 0; h < t.H; ++h)
      in.sinks.set_from_double(h, h == 1 ? -HUGE_VAL : 0.5 * static_cast<double>(h));
    in.alibi = mha_tools::NpyArray(mha_tools::NpyDtype::F32, {t.B, t.H});
    for (int64_t b = 0; b < t.B; ++b)  // 2^-(h + 1) · (b + 1)
      for (int64_t h = 0; h < t.H; ++h)
        in.alibi.set_from_double(
            b * t.H + h, std::exp2(-static_cast<double>(h + 1)) * static_cast<double>(b + 1));
  } else {
    in.kpm = mha_tools::NpyArray(mha_tools::NpyDtype::Bool, {t.B, t.Lk});
    for (int64_t i = 0; i < in.kpm.size(); ++i) in.kpm.set_from_double(i, rng.chance(0.3) ? 1 : 0);
    in.attn_mask = random_npy(rng, {t.Lq, t.Lk}, 2.0f);
  }
  return in;
}

void write_file(const std::string& path, const mha_tools::NpyArray& a) {
  mha_tools::write_npy(path, a);
}

TEST(ModuleTool, Write) {
  const std::string dir = tool_dir();
  if (dir.empty()) GTEST_SKIP() << "runs in the ctest chain (MHA_MODULE_TOOL_DIR unset)";
  for (const ToolCase& t : kToolCases) {
    const std::string root = dir + "/" + t.name;
    const std::string weights_dir = root + "/weights";
    std::filesystem::create_directories(weights_dir);
    Rng rng(t.name[0]);
    std::vector<std::pair<std::string, mha_tools::NpyArray>> files;
    tool_weights(t, rng, &files);
    for (const auto& [key, array] : files) write_file(weights_dir + "/" + (key + ".npy"), array);
    if (t.name[0] == 'a') {
      std::FILE* f = std::fopen((weights_dir + "/config.json").c_str(), "w");
      ASSERT_NE(f, nullptr);
      std::fprintf(f, "{\"num_heads\": %lld, \"embed_dim\": %lld}\n", static_cast<long long>(t.H),
                   static_cast<long long>(t.E));
      std::fclose(f);
    }
    ToolInputs in = tool_inputs(t, rng);
    write_file(root + "/query.npy", in.query);
    write_file(root + "/key.npy", in.key);
    if (t.name[0] == 'a') {
      write_file(root + "/valid_lens.npy", in.valid_lens);
    } else if (t.name[0] == 'c') {
      write_file(root + "/sinks.npy", in.sinks);
      write_file(root + "/alibi.npy", in.alibi);
      write_file(root + "/sinks3.npy", random_npy(rng, {3}));  // refused: H is 4
    } else {
      write_file(root + "/kpm.npy", in.kpm);
      write_file(root + "/attn_mask.npy", in.attn_mask);
    }
  }
  // Directories the tool must refuse: a weight PyTorch has but mha does not
  // support, and no number of heads anywhere.
  std::filesystem::create_directories(dir + "/bias_kv");
  std::filesystem::create_directories(dir + "/no_heads");
  Rng rng(3);
  write_file(dir + "/bias_kv/out_proj.weight.npy", random_npy(rng, {16, 16}));
  write_file(dir + "/bias_kv/bias_k.npy", random_npy(rng, {1, 1, 16}));
  write_file(dir + "/no_heads/out_proj.weight.npy", random_npy(rng, {16, 16}));
}

TEST(ModuleTool, Check) {
  const std::string dir = tool_dir();
  const char* which = std::getenv("MHA_MODULE_TOOL_CASE");
  if (dir.empty() || which == nullptr)
    GTEST_SKIP() << "runs in the ctest chain (MHA_MODULE_TOOL_DIR unset)";
  const ToolCase* found = nullptr;
  for (const ToolCase& t : kToolCases)
    if (std::string(t.name) == which) found = &t;
  ASSERT_NE(found, nullptr) << which;
  const ToolCase& t = *found;
  const std::string root = dir + "/" + t.name;
  Rng rng(t.name[0]);
  const ModuleWeights w = tool_weights(t, rng, nullptr);
  ToolInputs in = tool_inputs(t, rng);  // regenerated: the same values as written
  mha_tools::NpyArray out = mha_tools::read_npy(root + "/out.npy");
  mha_tools::NpyArray weights = mha_tools::read_npy(root + "/weights.npy");
  const auto view = [&](mha_tools::NpyArray& a, mha_dtype dtype, bool swap) {
    std::vector<int64_t> shape = a.shape(), strides = a.strides();
    if (swap) std::swap(shape[0], shape[1]), std::swap(strides[0], strides[1]);
    return describe(a.data(), dtype, shape, strides);
  };
  ASSERT_EQ(out.shape(), (t.seq_first ? std::vector<int64_t>{t.Lq, t.B, t.E}
                                      : std::vector<int64_t>{t.B, t.Lq, t.E}));
  const mha_tensor q = view(in.query, MHA_DTYPE_F32, t.seq_first);
  const mha_tensor k = view(in.key, MHA_DTYPE_F32, t.seq_first);
  const mha_tensor o = view(out, MHA_DTYPE_F32, t.seq_first);
  ModuleInputs ri;
  ri.query = &q;
  ri.key = &k;
  ri.value = &k;
  mha_tensor vl{}, kpm{}, am{}, sinks{}, alibi{};
  if (t.name[0] == 'a') {
    vl = view(in.valid_lens, MHA_DTYPE_I32, false);
    ri.valid_lens = &vl;
  } else if (t.name[0] == 'c') {
    sinks = view(in.sinks, MHA_DTYPE_F32, false);
    alibi = view(in.alibi, MHA_DTYPE_F32, false);
    ri.sinks = &sinks;
    ri.alibi_slopes = &alibi;
    ri.window_left = 3;
    ri.window_right = 1;
    ri.softcap = 1.5;
    ri.causal = MHA_CAUSAL_BOTTOM_RIGHT;
  } else {
    kpm = view(in.kpm, MHA_DTYPE_BOOL, false);
    am = view(in.attn_mask, MHA_DTYPE_F32, false);
    ri.key_padding_mask = &kpm;
    ri.attn_mask = &am;
    ri.causal = MHA_CAUSAL_TOP_LEFT;
  }
  const ModuleReference ref = reference_module(w, ri);
  const BoundCheck oc = check_within(o, ref.out, ref.out_bound);
  EXPECT_EQ(oc.outside, 0) << report("out.npy", oc);
  const mha_tensor wt = view(weights, MHA_DTYPE_F32, false);
  const bool average = t.name[0] == 'a';
  ASSERT_EQ(weights.rank(), average ? 3 : 4);
  const BoundCheck wc = average ? check_within(wt, ref.average, ref.average_bound)
                                : check_within(wt, ref.weights, ref.weights_bound);
  EXPECT_EQ(wc.outside, 0) << report("weights.npy", wc);
}
#endif  // MHA_TEST_MODULE_TOOL

// Printed once: how close the results came to their bounds.
class WorstRatioPrinter : public ::testing::Environment {
 public:
  void TearDown() override {
    std::printf("module: worst |got - reference| / bound over the run: %.3g\n", g_worst_ratio);
  }
};
const auto* const g_printer = ::testing::AddGlobalTestEnvironment(new WorstRatioPrinter);

}  // namespace
}  // namespace mha_test
