// The module's forward pass on bf16 and f16 tensors, on every backend: query,
// key and value in half precision (widened as the projections read them),
// out and the attention weights in f32 or the query's dtype, an additive
// key_padding_mask in the query's dtype.  Each call against
//   - the float64 reference on the same stored values (the inputs' rounding
//     is the caller's), at the module's fp32 bound plus one rounding of a
//     half-precision output, and
//   - mha_module_forward on f32 copies of those values: the same bits (an f32
//     output), or those bits rounded once (a half-precision one).
// The backward pass likewise: half-precision inputs and dout, each gradient
// in f32, bf16 or f16, against mha_module_backward on f32 copies (the same
// bits, rounded once for a half-precision gradient), whose gradients are
// checked against the float64 backward reference.
#include <gtest/gtest.h>
#include <mha/mha.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "module_case.h"
#include "module_reference.h"
#include "module_reference_backward.h"
#include "test_util.h"

namespace mha_test {
namespace {

uint32_t bits_of(float x) {
  uint32_t b = 0;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

struct HalfCase {
  mha_dtype dtype = MHA_DTYPE_BF16;  // of query, key and value
  bool out_half = true;              // out (and the weights) in dtype, else f32
  bool self_attention = false;       // one tensor as query, key and value
  bool bias = true;
  bool key_padding = false;  // an additive key_padding_mask in dtype
  bool causal = false;
  bool need_weights = false, average = false;
  uint64_t seed = 1;
  std::string describe() const {
    return std::string(mha_types::dtype_name(dtype)) + (out_half ? " out half" : " out f32") +
           (self_attention ? " self-attention" : " cross") + (bias ? " bias" : " no bias") +
           (key_padding ? " key_padding_mask" : "") + (causal ? " causal" : "") +
           (need_weights ? (average ? " averaged weights" : " weights") : "");
  }
};

// A [B, L, F] tensor: f32 values rounded to `dtype`, kept as f32 (the
// reference's and the f32 call's) and as the dtype's bits (the call's).
struct HalfTensor {
  std::vector<float> values;
  std::vector<uint16_t> bits;
  mha_tensor f32{}, half{};
  HalfTensor(Rng& rng, const std::vector<int64_t>& shape, mha_dtype dtype, float lo, float hi) {
    int64_t n = 1;
    for (const int64_t s : shape) n *= s;
    values.resize(static_cast<size_t>(n));
    bits.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const float x = rng.uniform(lo, hi);
      mha_types::store_float(bits.data(), dtype, i, x);
      values[static_cast<size_t>(i)] = mha_types::load_float(bits.data(), dtype, i);
    }
    f32 = describe(values.data(), MHA_DTYPE_F32, shape);
    half = describe(bits.data(), dtype, shape);
  }
};

// Where an input [B, L, F]'s rows lie: batch-first or sequence-first ([L,
// B, F] in memory), `pad` unused values after each row and (batch-first)
// `gap` after each batch -- rows no single stride walks, so the module runs
// one product a batch (projections.h's RowOrder).
struct Layout {
  bool seq_first = false;
  int64_t pad = 0, gap = 0;
};

// An input [B, L, F] in `layout`, its values drawn in memory order.
HalfTensor laid_out(Rng& rng, int64_t b, int64_t l, int64_t f, mha_dtype dtype, float lo, float hi,
                    const Layout& layout) {
  const int64_t row = f + layout.pad;
  const int64_t batch_stride = layout.seq_first ? row : l * row + layout.gap;
  const int64_t row_stride = layout.seq_first ? b * row : row;
  HalfTensor t(rng, {layout.seq_first ? l * b * row : b * batch_stride}, dtype, lo, hi);
  for (mha_tensor* d : {&t.f32, &t.half}) {
    d->ndim = 3;
    d->shape[0] = b, d->shape[1] = l, d->shape[2] = f;
    d->strides[0] = batch_stride, d->strides[1] = row_stride, d->strides[2] = 1;
  }
  return t;
}

// A case's query, key and value in `dtype` (values in [-2, 2], [-2, 2] and
// [-1, 1], drawn in that order); for self-attention, key and value are the
// query; with shared_kv, the value is the key.
struct HalfInputs {
  HalfTensor query, key, value;
  bool self_attention, shared_kv;
  HalfInputs(Rng& rng, const ModuleCase& c, mha_dtype dtype, bool self, const Layout& layout = {},
             bool shared = false)
      : query(laid_out(rng, c.B, c.Lq, c.eq(), dtype, -2.0f, 2.0f, layout)),
        key(laid_out(rng, c.B, c.Lk, c.ek(), dtype, -2.0f, 2.0f, layout)),
        value(laid_out(rng, c.B, c.Lk, c.ev(), dtype, -1.0f, 1.0f, layout)),
        self_attention(self),
        shared_kv(shared) {}
  HalfTensor& k() { return self_attention ? query : key; }
  HalfTensor& v() { return self_attention ? query : (shared_kv ? key : value); }
};

// An output of the call: f32, or the dtype's bits, read back as f32.
struct Output {
  std::vector<float> f32;
  std::vector<uint16_t> bits;
  mha_tensor t{};
  Output(const std::vector<int64_t>& shape, mha_dtype dtype) {
    int64_t n = 1;
    for (const int64_t s : shape) n *= s;
    if (dtype == MHA_DTYPE_F32) {
      f32.assign(static_cast<size_t>(n), -7.0f);
      t = describe(f32.data(), dtype, shape);
    } else {
      bits.assign(static_cast<size_t>(n), 0x7e00);  // NaN in both half types
      t = describe(bits.data(), dtype, shape);
    }
  }
  std::vector<float> values() const {
    if (t.dtype == MHA_DTYPE_F32) return f32;
    std::vector<float> v(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) {
      v[i] = mha_types::load_float(bits.data(), t.dtype, static_cast<int64_t>(i));
    }
    return v;
  }
};

// Elements off the reference by more than the fp32 bound plus one rounding to
// `dtype` (u = 2^-8 for bf16, 2^-11 for f16, of |value|; 0 for f32).
int64_t outside(const std::vector<float>& got, const std::vector<double>& want,
                const std::vector<double>& bound, int32_t dtype) {
  const double u = dtype == MHA_DTYPE_BF16  ? std::ldexp(1.0, -8)
                   : dtype == MHA_DTYPE_F16 ? std::ldexp(1.0, -11)
                                            : 0.0;
  const double floor = dtype == MHA_DTYPE_F16 ? std::ldexp(1.0, -25) : 0.0;
  int64_t n = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = bound[i] + u * (std::fabs(want[i]) + bound[i]) + floor;
    const double error = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(error <= tol)) ++n;
  }
  return n;
}

// Elements of `got` that are not the f32 call's bits `f32`, rounded once
// when `got` is half-precision.
int64_t differing_from_f32(const Output& got, const Output& f32) {
  int64_t differ = 0;
  const std::vector<float> g = got.values();
  for (size_t i = 0; i < g.size(); ++i) {
    uint16_t rounded = 0;
    float want = f32.f32[i];
    if (got.t.dtype != MHA_DTYPE_F32) {
      mha_types::store_float(&rounded, got.t.dtype, 0, want);
      want = mha_types::load_float(&rounded, got.t.dtype, 0);
    }
    differ += bits_of(g[i]) != bits_of(want) ? 1 : 0;
  }
  return differ;
}

void run_half_case(const HalfCase& hc) {
  SCOPED_TRACE(hc.describe());
  ModuleCase c;
  c.B = 2;
  c.Lq = 6;
  c.Lk = hc.self_attention ? 6 : 9;
  c.E = 16;
  c.H = 4;
  if (!hc.self_attention) {
    c.Ek = 12;
    c.Ev = 20;
  }
  c.bias = hc.bias;
  Rng rng(hc.seed);
  const WeightSet weights = make_weights(c, rng);
  ModuleHandle h;
  ASSERT_TRUE(create_module(c, h));
  ASSERT_TRUE(load_weights(h.m, c, weights)) << mha_last_error();

  const mha_dtype dt = hc.dtype;
  HalfInputs inputs(rng, c, dt, hc.self_attention);
  HalfTensor& query = inputs.query;
  HalfTensor& k_in = inputs.k();
  HalfTensor& v_in = inputs.v();
  // An additive key_padding_mask: 0, a penalty, or -inf (key 0 of batch 1).
  HalfTensor kpm(rng, {c.B, c.Lk}, dt, -3.0f, 0.5f);
  mha_types::store_float(kpm.bits.data(), dt, c.Lk, -INFINITY);
  kpm.values[static_cast<size_t>(c.Lk)] = -INFINITY;

  const mha_dtype out_dt = hc.out_half ? dt : MHA_DTYPE_F32;
  Output out({c.B, c.Lq, c.E}, out_dt), out32({c.B, c.Lq, c.E}, MHA_DTYPE_F32);
  const std::vector<int64_t> weights_shape = hc.average
                                                 ? std::vector<int64_t>{c.B, c.Lq, c.Lk}
                                                 : std::vector<int64_t>{c.B, c.H, c.Lq, c.Lk};
  Output aw(weights_shape, out_dt), aw32(weights_shape, MHA_DTYPE_F32);

  const auto params_for = [&](bool half, Output& weights_out) {
    mha_module_forward_params p;
    mha_module_forward_params_init(&p);
    if (hc.key_padding) p.key_padding_mask = half ? &kpm.half : &kpm.f32;
    p.causal = hc.causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
    if (hc.need_weights) {
      p.attn_weights = &weights_out.t;
      p.average_attn_weights = hc.average ? 1 : 0;
    }
    return p;
  };
  const mha_module_forward_params p_half = params_for(true, aw);
  ASSERT_EQ(mha_module_forward(h.m, &query.half, &k_in.half, &v_in.half, &out.t, &p_half), MHA_OK)
      << mha_last_error();
  const mha_module_forward_params p_f32 = params_for(false, aw32);
  ASSERT_EQ(mha_module_forward(h.m, &query.f32, &k_in.f32, &v_in.f32, &out32.t, &p_f32), MHA_OK)
      << mha_last_error();

  // The f32 call on the same values: the same bits, rounded once for a
  // half-precision output.
  EXPECT_EQ(differing_from_f32(out, out32), 0)
      << "out differs from the f32 call on the same values";
  if (hc.need_weights) {
    EXPECT_EQ(differing_from_f32(aw, aw32), 0) << "the weights differ from the f32 call's";
  }

  // The float64 reference on the stored values.
  ModuleInputs in;
  in.query = &query.f32;
  in.key = &k_in.f32;
  in.value = &v_in.f32;
  if (hc.key_padding) in.key_padding_mask = &kpm.f32;
  in.causal = hc.causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
  const ModuleReference ref = reference_module(weights.ref, in);
  EXPECT_EQ(outside(out.values(), ref.out, ref.out_bound, out_dt), 0) << "out off the reference";
  if (hc.need_weights) {
    const std::vector<double>& want = hc.average ? ref.average : ref.weights;
    const std::vector<double>& bound = hc.average ? ref.average_bound : ref.weights_bound;
    EXPECT_EQ(outside(aw.values(), want, bound, out_dt), 0) << "weights off the reference";
  }
}

TEST_P(Module, HalfPrecisionForward) {
  for (const mha_dtype dt : {MHA_DTYPE_BF16, MHA_DTYPE_F16}) {
    run_half_case({.dtype = dt, .seed = 11});
    run_half_case({.dtype = dt, .out_half = false, .bias = false, .seed = 12});
    run_half_case({.dtype = dt, .self_attention = true, .causal = true, .seed = 13});
    run_half_case({.dtype = dt, .key_padding = true, .need_weights = true, .seed = 14});
    run_half_case({.dtype = dt,
                   .out_half = false,
                   .self_attention = true,
                   .key_padding = true,
                   .need_weights = true,
                   .average = true,
                   .seed = 15});
  }
}

// Weights set from bf16 and f16 arrays (a half-precision checkpoint): the
// module's results are those of the same values set as f32, bit for bit.
TEST_P(Module, HalfPrecisionWeights) {
  for (const mha_dtype dt : {MHA_DTYPE_BF16, MHA_DTYPE_F16}) {
    SCOPED_TRACE(mha_types::dtype_name(dt));
    ModuleCase c;
    Rng rng(31);
    const WeightSet w = make_weights(c, rng);
    ModuleHandle half, f32;
    ASSERT_TRUE(create_module(c, half));
    ASSERT_TRUE(create_module(c, f32));
    const int64_t e = c.E;
    // Each weight rounded to dt: as dt bits for one module, as their f32
    // values for the other.  Strided views: in_proj_weight read transposed.
    const auto set = [&](const char* name, const std::vector<float>& values,
                         const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
      std::vector<uint16_t> bits(values.size());
      std::vector<float> rounded(values.size());
      for (size_t i = 0; i < values.size(); ++i) {
        mha_types::store_float(bits.data(), dt, static_cast<int64_t>(i), values[i]);
        rounded[i] = mha_types::load_float(bits.data(), dt, static_cast<int64_t>(i));
      }
      mha_tensor th = describe(bits.data(), dt, shape, strides);
      mha_tensor tf = describe(rounded.data(), MHA_DTYPE_F32, shape, strides);
      ASSERT_EQ(mha_module_set_weight(half.m, name, &th), MHA_OK) << mha_last_error();
      ASSERT_EQ(mha_module_set_weight(f32.m, name, &tf), MHA_OK) << mha_last_error();
    };
    std::vector<float> in_proj(w.w_q);
    in_proj.insert(in_proj.end(), w.w_k.begin(), w.w_k.end());
    in_proj.insert(in_proj.end(), w.w_v.begin(), w.w_v.end());
    // [3E, E] stored column-major: strides {1, 3E}.
    std::vector<float> column_major(in_proj.size());
    for (int64_t r = 0; r < 3 * e; ++r) {
      for (int64_t col = 0; col < e; ++col) {
        column_major[static_cast<size_t>(col * 3 * e + r)] =
            in_proj[static_cast<size_t>(r * e + col)];
      }
    }
    set("in_proj_weight", column_major, {3 * e, e}, {1, 3 * e});
    std::vector<float> in_bias(w.b_q);
    in_bias.insert(in_bias.end(), w.b_k.begin(), w.b_k.end());
    in_bias.insert(in_bias.end(), w.b_v.begin(), w.b_v.end());
    set("in_proj_bias", in_bias, {3 * e}, {1});
    set("out_proj.weight", w.w_o, {e, e}, {e, 1});
    set("out_proj.bias", w.b_o, {e}, {1});
    HalfTensor x(rng, {c.B, c.Lq, e}, MHA_DTYPE_BF16, -1.0f, 1.0f);
    Output a({c.B, c.Lq, e}, MHA_DTYPE_F32), b({c.B, c.Lq, e}, MHA_DTYPE_F32);
    ASSERT_EQ(mha_module_forward(half.m, &x.f32, &x.f32, &x.f32, &a.t, nullptr), MHA_OK)
        << mha_last_error();
    ASSERT_EQ(mha_module_forward(f32.m, &x.f32, &x.f32, &x.f32, &b.t, nullptr), MHA_OK)
        << mha_last_error();
    EXPECT_EQ(std::memcmp(a.f32.data(), b.f32.data(), a.f32.size() * 4), 0);
  }
}

// Half-precision dtypes the module does not take, named, in the forward and
// the backward pass.
TEST_P(Module, HalfPrecisionRefusals) {
  ModuleCase c;
  Rng rng(21);
  const WeightSet weights = make_weights(c, rng);
  ModuleHandle h;
  ASSERT_TRUE(create_module(c, h));
  ASSERT_TRUE(load_weights(h.m, c, weights)) << mha_last_error();
  HalfTensor q(rng, {c.B, c.Lq, c.E}, MHA_DTYPE_BF16, -1.0f, 1.0f);
  HalfTensor kv(rng, {c.B, c.Lk, c.E}, MHA_DTYPE_BF16, -1.0f, 1.0f);
  Output out_f16({c.B, c.Lq, c.E}, MHA_DTYPE_F16);
  EXPECT_EQ(mha_module_forward(h.m, &q.half, &kv.half, &kv.half, &out_f16.t, nullptr),
            MHA_ERR_INVALID_DTYPE);
  EXPECT_NE(std::string(mha_last_error()).find("out has dtype f16; it must be f32 or the query's"),
            std::string::npos)
      << mha_last_error();
  // A mask of the other half dtype.
  HalfTensor kpm(rng, {c.B, c.Lk}, MHA_DTYPE_F16, -1.0f, 0.0f);
  Output out({c.B, c.Lq, c.E}, MHA_DTYPE_BF16);
  mha_module_forward_params p;
  mha_module_forward_params_init(&p);
  p.key_padding_mask = &kpm.half;
  EXPECT_EQ(mha_module_forward(h.m, &q.half, &kv.half, &kv.half, &out.t, &p),
            MHA_ERR_INVALID_DTYPE);
  EXPECT_NE(std::string(mha_last_error()).find("params->key_padding_mask has dtype f16"),
            std::string::npos)
      << mha_last_error();
  EXPECT_TRUE(out.bits == std::vector<uint16_t>(out.bits.size(), 0x7e00)) << "written";
  // The backward pass: dout in the other half dtype, a gradient in int32.
  Output dout({c.B, c.Lq, c.E}, MHA_DTYPE_F16);
  std::vector<uint16_t> dq(static_cast<size_t>(c.B * c.Lq * c.E), 0x7e00);
  mha_tensor tdq = describe(dq.data(), MHA_DTYPE_BF16, {c.B, c.Lq, c.E});
  mha_module_gradients grads;
  mha_module_gradients_init(&grads);
  grads.query = &tdq;
  EXPECT_EQ(mha_module_backward(h.m, &q.half, &kv.half, &kv.half, &dout.t, nullptr, &grads),
            MHA_ERR_INVALID_DTYPE);
  EXPECT_NE(std::string(mha_last_error()).find("dout has dtype f16; it must be f32 or the query's"),
            std::string::npos)
      << mha_last_error();
  Output dout_bf16({c.B, c.Lq, c.E}, MHA_DTYPE_BF16);
  std::vector<int32_t> dw(static_cast<size_t>(c.E * c.E));
  mha_tensor tdw = describe(dw.data(), MHA_DTYPE_I32, {c.E, c.E});
  grads.out_proj_weight = &tdw;
  EXPECT_EQ(mha_module_backward(h.m, &q.half, &kv.half, &kv.half, &dout_bf16.t, nullptr, &grads),
            MHA_ERR_INVALID_DTYPE);
  EXPECT_NE(std::string(mha_last_error())
                .find("grads->out_proj_weight has dtype i32; it must be f32, bf16 or f16"),
            std::string::npos)
      << mha_last_error();
  EXPECT_TRUE(dq == std::vector<uint16_t>(dq.size(), 0x7e00)) << "a refused call wrote dq";
}

// ---------------------------------------------------------------- backward

struct HalfBackwardCase {
  mha_dtype dtype = MHA_DTYPE_BF16;  // of query, key and value
  Inputs inputs = Inputs::Separate;
  bool dout_half = true;                   // dout in dtype, else f32
  mha_dtype input_grads = MHA_DTYPE_BF16;  // of dquery, dkey and dvalue
  mha_dtype weight_grads = MHA_DTYPE_F32;  // of the weights', biases' and sinks' gradients
  bool seq_first = false;                  // inputs, dout and input gradients [L, B, F]
  bool key_padding = false;                // an additive key_padding_mask in dtype
  bool causal = false, sinks = false, dropout = false;
  bool large = false;         // L 600, E 128: tensors the stand-ins convert in several blocks
  bool kv_broadcast = false;  // key and value with batch stride 0 (one index, one element)
  uint64_t seed = 1;
  std::string describe() const {
    const char* inputs_text = inputs == Inputs::SelfAttention    ? " self-attention"
                              : inputs == Inputs::SharedKeyValue ? " key = value"
                                                                 : " cross";
    return std::string(mha_types::dtype_name(dtype)) + inputs_text +
           (dout_half ? " dout half" : " dout f32") + " input grads " +
           mha_types::dtype_name(input_grads) + " weight grads " +
           mha_types::dtype_name(weight_grads) + (seq_first ? " seq-first" : "") +
           (key_padding ? " key_padding_mask" : "") + (causal ? " causal" : "") +
           (sinks ? " sinks" : "") + (dropout ? " dropout" : "") + (large ? " large" : "") +
           (kv_broadcast ? " key/value batch-broadcast" : "");
  }
};

// Strides {F, B·F, 1}: a [B, L, F] tensor stored [L, B, F] (sequence-first).
void make_seq_first(mha_tensor& t) {
  t.strides[0] = t.shape[2];
  t.strides[1] = t.shape[0] * t.shape[2];
  t.strides[2] = 1;
}

// One gradient: in the case's dtype for the half call, in f32 for the f32
// call on the same values.
struct GradPair {
  Output half, f32;
  GradPair(const std::vector<int64_t>& shape, mha_dtype dtype, bool seq_first)
      : half(shape, dtype), f32(shape, MHA_DTYPE_F32) {
    if (seq_first) {
      make_seq_first(half.t);
      make_seq_first(f32.t);
    }
  }
};

void run_half_backward_case(const HalfBackwardCase& hc) {
  SCOPED_TRACE(hc.describe());
  const bool self = hc.inputs == Inputs::SelfAttention;
  const bool shared = hc.inputs == Inputs::SharedKeyValue;
  ModuleCase c;
  c.B = 2;
  c.Lq = 6;
  c.Lk = self ? 6 : 9;
  c.E = 16;
  c.H = 4;
  if (hc.large) {
    c.Lq = c.Lk = 600;
    c.E = 128;
  }
  if (!self) c.Ek = c.Ev = hc.large ? 128 : 12;
  if (hc.inputs == Inputs::Separate) c.Ev = hc.large ? 136 : 20;
  c.inputs = hc.inputs;
  c.dropout = hc.dropout ? 0.25f : 0.0f;
  Rng rng(hc.seed);
  const WeightSet weights = make_weights(c, rng);
  ModuleHandle h;
  ASSERT_TRUE(create_module(c, h));
  ASSERT_TRUE(load_weights(h.m, c, weights)) << mha_last_error();

  const mha_dtype dt = hc.dtype;
  HalfTensor query(rng, {c.B, c.Lq, c.eq()}, dt, -2.0f, 2.0f);
  HalfTensor key(rng, {c.B, c.Lk, c.ek()}, dt, -2.0f, 2.0f);
  HalfTensor value(rng, {c.B, c.Lk, c.ev()}, dt, -1.0f, 1.0f);
  HalfTensor dout(rng, {c.B, c.Lq, c.E}, dt, -1.0f, 1.0f);
  if (hc.seq_first) {
    for (HalfTensor* t : {&query, &key, &value, &dout}) {
      make_seq_first(t->f32);
      make_seq_first(t->half);
    }
  }
  if (hc.kv_broadcast) {
    for (HalfTensor* t : {&key, &value}) t->f32.strides[0] = t->half.strides[0] = 0;
  }
  HalfTensor& k_in = self ? query : key;
  HalfTensor& v_in = self ? query : (shared ? key : value);
  HalfTensor kpm(rng, {c.B, c.Lk}, dt, -3.0f, 0.5f);
  mha_types::store_float(kpm.bits.data(), dt, c.Lk, -INFINITY);
  kpm.values[static_cast<size_t>(c.Lk)] = -INFINITY;
  std::vector<float> sinks(static_cast<size_t>(c.H));
  for (float& x : sinks) x = rng.uniform(-1.0f, 2.0f);
  const mha_tensor tsinks = describe(sinks.data(), MHA_DTYPE_F32, {c.H});
  constexpr uint64_t kDropoutSeed = 99;

  const auto params_for = [&](bool half) {
    mha_module_forward_params p;
    mha_module_forward_params_init(&p);
    if (hc.key_padding) p.key_padding_mask = half ? &kpm.half : &kpm.f32;
    p.causal = hc.causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
    if (hc.sinks) p.sinks = &tsinks;
    if (hc.dropout) {
      p.training = 1;
      p.dropout_seed = kDropoutSeed;
    }
    return p;
  };
  const int64_t e = c.E;
  const mha_dtype wg = hc.weight_grads;
  GradPair dq({c.B, c.Lq, c.eq()}, hc.input_grads, hc.seq_first);
  GradPair dk({c.B, c.Lk, c.ek()}, hc.input_grads, hc.seq_first);
  GradPair dv({c.B, c.Lk, c.ev()}, hc.input_grads, hc.seq_first);
  GradPair dwq({e, c.eq()}, wg, false), dwk({e, c.ek()}, wg, false), dwv({e, c.ev()}, wg, false);
  GradPair dwo({e, e}, wg, false), dbq({e}, wg, false), dbk({e}, wg, false), dbv({e}, wg, false);
  GradPair dbo({e}, wg, false), ds({c.H}, wg, false);
  const auto grads_for = [&](bool half) {
    const auto pick = [half](GradPair& g) { return half ? &g.half.t : &g.f32.t; };
    mha_module_gradients g;
    mha_module_gradients_init(&g);
    g.query = pick(dq);
    g.key = self ? g.query : pick(dk);
    g.value = self ? g.query : (shared ? g.key : pick(dv));
    g.q_proj_weight = pick(dwq);
    g.k_proj_weight = pick(dwk);
    g.v_proj_weight = pick(dwv);
    g.out_proj_weight = pick(dwo);
    g.q_proj_bias = pick(dbq);
    g.k_proj_bias = pick(dbk);
    g.v_proj_bias = pick(dbv);
    g.out_proj_bias = pick(dbo);
    if (hc.sinks) g.sinks = pick(ds);
    return g;
  };
  const mha_module_forward_params p_half = params_for(true), p_f32 = params_for(false);
  const mha_module_gradients g_half = grads_for(true), g_f32 = grads_for(false);
  ASSERT_EQ(mha_module_backward(h.m, &query.half, &k_in.half, &v_in.half,
                                hc.dout_half ? &dout.half : &dout.f32, &p_half, &g_half),
            MHA_OK)
      << mha_last_error();
  ASSERT_EQ(mha_module_backward(h.m, &query.f32, &k_in.f32, &v_in.f32, &dout.f32, &p_f32, &g_f32),
            MHA_OK)
      << mha_last_error();

  // The f32 call's bits, rounded once for a half-precision gradient.
  struct Named {
    const char* name;
    const GradPair* g;
  };
  std::vector<Named> compared = {
      {"dquery", &dq},         {"q_proj_weight", &dwq},   {"k_proj_weight", &dwk},
      {"v_proj_weight", &dwv}, {"out_proj_weight", &dwo}, {"q_proj_bias", &dbq},
      {"k_proj_bias", &dbk},   {"v_proj_bias", &dbv},     {"out_proj_bias", &dbo}};
  if (!self) compared.push_back({"dkey", &dk});
  if (hc.inputs == Inputs::Separate) compared.push_back({"dvalue", &dv});
  if (hc.sinks) compared.push_back({"sinks", &ds});
  for (const Named& n : compared) {
    EXPECT_EQ(differing_from_f32(n.g->half, n.g->f32), 0)
        << n.name << " differs from the f32 call's on the same values";
  }

  // The f32 call against the float64 reference on the stored values.
  ModuleInputs in;
  in.query = &query.f32;
  in.key = &k_in.f32;
  in.value = &v_in.f32;
  if (hc.key_padding) in.key_padding_mask = &kpm.f32;
  in.causal = hc.causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
  if (hc.sinks) in.sinks = &tsinks;
  if (hc.dropout) {
    in.dropout_p = 0.25;
    in.dropout_seed = kDropoutSeed;
  }
  const ModuleBackwardReference ref = reference_module_backward(weights.ref, in, dout.f32);
  const auto expect_close = [](const char* name, const GradPair& got, ReferenceGradient want,
                               std::initializer_list<const ReferenceGradient*> more) {
    for (const ReferenceGradient* m : more) {
      for (size_t i = 0; i < want.value.size(); ++i) want.value[i] += m->value[i];
      want.tolerance += m->tolerance;
    }
    const double diff = worst_difference(got.f32.t, want.value);
    EXPECT_LE(diff, want.tolerance) << name << ": the f32 call off the reference";
  };
  if (self) {
    expect_close("dquery (= dkey = dvalue)", dq, ref.query, {&ref.key, &ref.value});
  } else {
    expect_close("dquery", dq, ref.query, {});
    if (shared) {
      expect_close("dkey (= dvalue)", dk, ref.key, {&ref.value});
    } else {
      expect_close("dkey", dk, ref.key, {});
      expect_close("dvalue", dv, ref.value, {});
    }
  }
  expect_close("q_proj_weight", dwq, ref.w_q, {});
  expect_close("v_proj_weight", dwv, ref.w_v, {});
  expect_close("out_proj_weight", dwo, ref.w_o, {});
  expect_close("out_proj_bias", dbo, ref.b_o, {});
  if (hc.sinks) expect_close("sinks", ds, ref.sinks, {});
}

// Half-precision inputs and gradients in the backward pass: each gradient in
// f32, bf16 or f16 gives the f32 call's bits on the same values, rounded once.
TEST_P(Module, HalfPrecisionBackward) {
  for (const mha_dtype dt : {MHA_DTYPE_BF16, MHA_DTYPE_F16}) {
    const mha_dtype other = dt == MHA_DTYPE_BF16 ? MHA_DTYPE_F16 : MHA_DTYPE_BF16;
    run_half_backward_case({.dtype = dt, .input_grads = dt, .weight_grads = dt, .seed = 41});
    run_half_backward_case({.dtype = dt,
                            .inputs = Inputs::SelfAttention,
                            .dout_half = false,
                            .input_grads = dt,
                            .key_padding = true,
                            .causal = true,
                            .seed = 42});
    run_half_backward_case({.dtype = dt,
                            .inputs = Inputs::SharedKeyValue,
                            .input_grads = MHA_DTYPE_F32,
                            .weight_grads = other,
                            .seq_first = true,
                            .sinks = true,
                            .seed = 43});
    run_half_backward_case({.dtype = dt,
                            .inputs = Inputs::SelfAttention,
                            .input_grads = dt,
                            .weight_grads = dt,
                            .seq_first = true,
                            .key_padding = true,
                            .sinks = true,
                            .dropout = true,
                            .seed = 44});
  }
  run_half_backward_case({.dtype = MHA_DTYPE_BF16,
                          .inputs = Inputs::SelfAttention,
                          .input_grads = MHA_DTYPE_BF16,
                          .weight_grads = MHA_DTYPE_F16,
                          .causal = true,
                          .large = true,
                          .seed = 45});
  run_half_backward_case({.dtype = MHA_DTYPE_F16,
                          .input_grads = MHA_DTYPE_F16,
                          .weight_grads = MHA_DTYPE_BF16,
                          .large = true,
                          .kv_broadcast = true,
                          .seed = 46});
}

// A WeightSet rounded to bf16 values (a bf16 checkpoint), its reference too.
void round_to_bf16(WeightSet& w) {
  const auto round = [](std::vector<float>& v, std::vector<double>& ref) {
    for (size_t i = 0; i < v.size(); ++i) {
      v[i] = mha_types::bf16_to_f32(mha_types::f32_to_bf16(v[i]));
      ref[i] = static_cast<double>(v[i]);
    }
  };
  round(w.w_q, w.ref.w_q);
  round(w.w_k, w.ref.w_k);
  round(w.w_v, w.ref.w_v);
  round(w.w_o, w.ref.w_o);
  round(w.b_q, w.ref.b_q);
  round(w.b_k, w.ref.b_k);
  round(w.b_v, w.ref.b_v);
  round(w.b_o, w.ref.b_o);
}

// A module of case c on a bf16 checkpoint: make_weights' values rounded to
// bf16 (into *weights, the reference's too) and set.
::testing::AssertionResult bf16_checkpoint_module(const ModuleCase& c, Rng& rng, ModuleHandle& h,
                                                  WeightSet* weights) {
  *weights = make_weights(c, rng);
  round_to_bf16(*weights);
  if (::testing::AssertionResult made = create_module(c, h); !made) return made;
  if (!load_weights(h.m, c, *weights)) return ::testing::AssertionFailure() << mha_last_error();
  return ::testing::AssertionSuccess();
}

// A self-attention case: B sequences of L tokens, E features, H heads.
ModuleCase self_attention_case(int64_t batch, int64_t len, int64_t e, int64_t heads) {
  ModuleCase c;
  c.B = batch;
  c.Lq = c.Lk = len;
  c.E = e;
  c.H = heads;
  return c;
}

// The outputs of 1, 2 and 3 threads: the same bits.
void expect_same_bits(const std::vector<std::vector<float>>& outs) {
  EXPECT_EQ(std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * 4), 0) << "2 threads";
  EXPECT_EQ(std::memcmp(outs[0].data(), outs[2].data(), outs[0].size() * 4), 0) << "3 threads";
}

// The reference's inputs: the stored values.
ModuleInputs inputs_of(const HalfTensor& query, const HalfTensor& key, const HalfTensor& value) {
  ModuleInputs in;
  in.query = &query.f32;
  in.key = &key.f32;
  in.value = &value.f32;
  return in;
}

// A bf16 checkpoint's weights, E 64 (whole steps of 32) and 80 or 48 rows
// (a partial block of 32): where the selected backend has the AMX tiles,
// the products run on them (runtime/module/bf16_products.h) -- a bf16 input
// as it is, an fp32 input and the heads' concatenation split into three
// bf16 parts: the same products, summed in another order.  On every
// backend: within the float64 reference's bound, and the same bits for 1, 2
// and 3 threads.
void run_bf16_checkpoint_case(mha_dtype dtype, bool self_attention, bool bias, mha_dtype out_dt,
                              uint64_t seed) {
  SCOPED_TRACE(std::string(mha_types::dtype_name(dtype)) + " inputs, " +
               mha_types::dtype_name(out_dt) + " out, " +
               (self_attention ? "self-attention" : "cross") + (bias ? ", bias" : ", no bias"));
  ModuleCase c;
  c.B = 2;
  c.Lq = 40;
  c.Lk = self_attention ? 40 : 24;
  c.E = 64;
  c.H = 4;
  c.bias = bias;
  Rng rng(seed);
  WeightSet weights;
  ModuleHandle h;
  ASSERT_TRUE(bf16_checkpoint_module(c, rng, h, &weights));
  // bf16 values either way; an fp32 input's rows then hold them as fp32.
  HalfTensor query(rng, {c.B, c.Lq, c.E}, MHA_DTYPE_BF16, -2.0f, 2.0f);
  HalfTensor key(rng, {c.B, c.Lk, c.E}, MHA_DTYPE_BF16, -2.0f, 2.0f);
  HalfTensor value(rng, {c.B, c.Lk, c.E}, MHA_DTYPE_BF16, -1.0f, 1.0f);
  HalfTensor& k_in = self_attention ? query : key;
  HalfTensor& v_in = self_attention ? query : value;
  const bool half = dtype == MHA_DTYPE_BF16;
  std::vector<std::vector<float>> outs;
  const int32_t threads_before = mha_get_num_threads();
  for (const int32_t threads : {1, 2, 3}) {
    ASSERT_EQ(mha_set_num_threads(threads), MHA_OK);
    Output out({c.B, c.Lq, c.E}, out_dt);
    ASSERT_EQ(
        mha_module_forward(h.m, half ? &query.half : &query.f32, half ? &k_in.half : &k_in.f32,
                           half ? &v_in.half : &v_in.f32, &out.t, nullptr),
        MHA_OK)
        << mha_last_error();
    outs.push_back(out.values());
  }
  ASSERT_EQ(mha_set_num_threads(threads_before), MHA_OK);
  expect_same_bits(outs);
  const ModuleInputs in = inputs_of(query, k_in, v_in);
  const ModuleReference ref = reference_module(weights.ref, in);
  EXPECT_EQ(outside(outs[0], ref.out, ref.out_bound, out_dt), 0) << "out off the reference";
}

TEST_P(Module, Bf16Checkpoint) {
  run_bf16_checkpoint_case(MHA_DTYPE_BF16, true, true, MHA_DTYPE_F32, 51);
  run_bf16_checkpoint_case(MHA_DTYPE_BF16, false, true, MHA_DTYPE_BF16, 52);
  run_bf16_checkpoint_case(MHA_DTYPE_BF16, true, false, MHA_DTYPE_F32, 53);
  run_bf16_checkpoint_case(MHA_DTYPE_F32, true, true, MHA_DTYPE_F32, 54);
  run_bf16_checkpoint_case(MHA_DTYPE_F32, false, false, MHA_DTYPE_F32, 55);
}

// MHA_ACTIVATIONS_INPUT (mha.h): the projections and the heads' outputs
// rounded to the query's dtype.  Against the float64 reference that rounds
// them too (module_reference.h: a rounded value's bound is 0 where mha's
// fp32 value cannot round elsewhere), on every backend, bf16 checkpoints of
// E 64 (the products on AMX tiles where the backend has them, rows rounded
// as the tiles store them) and of E 16 with cross-attention's other widths
// (BLIS, then rounded); the same bits for 1, 2 and 3 threads; the weights
// path (attn_weights) too.  And the rounding is there: a bf16 call's f32 out
// is off the reference that does not round (its fp32 bound) in some
// elements.
struct ActivationsCase {
  mha_dtype dtype = MHA_DTYPE_BF16;  // of the inputs
  mha_dtype out_dt = MHA_DTYPE_F32;
  bool self_attention = true;
  bool bias = true;
  bool large = true;  // E 64, Lq 40 (the tiles' whole steps); else E 16 with Ek 12, Ev 20
  bool need_weights = false;
  bool causal = false;
  bool shared_kv = false;  // cross-attention with key = value
  Layout layout{};
  uint64_t seed = 1;
  std::string describe() const {
    return std::string(mha_types::dtype_name(dtype)) + " inputs, " + mha_types::dtype_name(out_dt) +
           " out, " +
           (self_attention ? "self-attention" : (shared_kv ? "cross, key = value" : "cross")) +
           (bias ? ", bias" : ", no bias") + (large ? ", E 64" : ", E 16") +
           (need_weights ? ", weights" : "") + (causal ? ", causal" : "") +
           (layout.seq_first ? ", sequence-first" : "") +
           (layout.gap > 0 ? ", a product a batch" : "");
  }
};

void run_activations_case(const ActivationsCase& ac) {
  SCOPED_TRACE(ac.describe());
  ModuleCase c;
  c.B = 2;
  c.Lq = ac.large ? 40 : 6;
  c.Lk = ac.self_attention ? c.Lq : (ac.large ? 24 : 9);
  c.E = ac.large ? 64 : 16;
  c.H = 4;
  if (!ac.self_attention && !ac.large) {
    c.Ek = 12;
    c.Ev = ac.shared_kv ? 12 : 20;
  }
  c.bias = ac.bias;
  c.activations = MHA_ACTIVATIONS_INPUT;
  Rng rng(ac.seed);
  WeightSet weights;
  ModuleHandle h;
  ASSERT_TRUE(bf16_checkpoint_module(c, rng, h, &weights));
  const mha_dtype dt = ac.dtype;
  HalfInputs inputs(rng, c, dt, ac.self_attention, ac.layout, ac.shared_kv);
  HalfTensor& query = inputs.query;
  HalfTensor& k_in = inputs.k();
  HalfTensor& v_in = inputs.v();
  const std::vector<int64_t> weights_shape = {c.B, c.H, c.Lq, c.Lk};
  std::vector<std::vector<float>> outs;
  std::vector<float> attn;
  const int32_t threads_before = mha_get_num_threads();
  for (const int32_t threads : {1, 2, 3}) {
    ASSERT_EQ(mha_set_num_threads(threads), MHA_OK);
    Output out({c.B, c.Lq, c.E}, ac.out_dt), aw(weights_shape, MHA_DTYPE_F32);
    mha_module_forward_params p;
    mha_module_forward_params_init(&p);
    p.causal = ac.causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
    if (ac.need_weights) p.attn_weights = &aw.t;
    ASSERT_EQ(mha_module_forward(h.m, &query.half, &k_in.half, &v_in.half, &out.t, &p), MHA_OK)
        << mha_last_error();
    outs.push_back(out.values());
    if (threads == 1) attn = aw.values();
  }
  ASSERT_EQ(mha_set_num_threads(threads_before), MHA_OK);
  expect_same_bits(outs);
  ModuleInputs in = inputs_of(query, k_in, v_in);
  in.causal = ac.causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
  in.activations = dt;
  const ModuleReference ref = reference_module(weights.ref, in);
  EXPECT_EQ(outside(outs[0], ref.out, ref.out_bound, ac.out_dt), 0) << "out off the reference";
  if (ac.need_weights) {
    EXPECT_EQ(outside(attn, ref.weights, ref.weights_bound, MHA_DTYPE_F32), 0)
        << "weights off the reference";
  }
  // (bf16 only: f16's roundings, 2^-12 of values about 0.1 here, hide under
  // the reference's absolute floor for the attention kernels, 1e-5.)
  if (ac.out_dt == MHA_DTYPE_F32 && dt == MHA_DTYPE_BF16) {
    in.activations = MHA_DTYPE_F32;
    const ModuleReference unrounded = reference_module(weights.ref, in);
    EXPECT_GT(outside(outs[0], unrounded.out, unrounded.out_bound, MHA_DTYPE_F32), 0)
        << "out is within the fp32 bound of the module that does not round: nothing was rounded";
  }
}

TEST_P(Module, HalfActivations) {
  run_activations_case({});
  run_activations_case({.out_dt = MHA_DTYPE_BF16, .self_attention = false, .seed = 2});
  run_activations_case({.bias = false, .need_weights = true, .causal = true, .seed = 3});
  run_activations_case({.self_attention = false, .large = false, .seed = 4});
  run_activations_case({.dtype = MHA_DTYPE_F16, .seed = 5});
  run_activations_case(
      {.dtype = MHA_DTYPE_F16, .out_dt = MHA_DTYPE_F16, .large = false, .causal = true, .seed = 6});
  run_activations_case({.dtype = MHA_DTYPE_F16, .need_weights = true, .seed = 7});
  // The projections' rows in other orders (the heads' slabs follow them).
  run_activations_case({.layout = {.seq_first = true, .pad = 3}, .seed = 8});
  run_activations_case({.out_dt = MHA_DTYPE_BF16,
                        .self_attention = false,
                        .causal = true,
                        .shared_kv = true,
                        .layout = {.gap = 5},
                        .seed = 9});
  run_activations_case({.dtype = MHA_DTYPE_F16,
                        .self_attention = false,
                        .large = false,
                        .shared_kv = true,
                        .layout = {.seq_first = true},
                        .seed = 10});
  run_activations_case({.self_attention = false, .layout = {.seq_first = true}, .seed = 11});
}

// An F32 query: config.activations changes nothing (the same bits as a
// module without it).
TEST_P(Module, HalfActivationsIgnoredOnF32) {
  ModuleCase c = self_attention_case(2, 40, 64, 4);
  Rng rng(71);
  WeightSet weights;
  ModuleHandle plain, rounding;
  ASSERT_TRUE(bf16_checkpoint_module(c, rng, plain, &weights));
  c.activations = MHA_ACTIVATIONS_INPUT;
  ASSERT_TRUE(create_module(c, rounding));
  ASSERT_TRUE(load_weights(rounding.m, c, weights)) << mha_last_error();
  HalfTensor x(rng, {c.B, c.Lq, c.E}, MHA_DTYPE_BF16, -2.0f, 2.0f);
  Output a({c.B, c.Lq, c.E}, MHA_DTYPE_F32), b({c.B, c.Lq, c.E}, MHA_DTYPE_F32);
  ASSERT_EQ(mha_module_forward(plain.m, &x.f32, &x.f32, &x.f32, &a.t, nullptr), MHA_OK);
  ASSERT_EQ(mha_module_forward(rounding.m, &x.f32, &x.f32, &x.f32, &b.t, nullptr), MHA_OK);
  EXPECT_EQ(std::memcmp(a.f32.data(), b.f32.data(), a.f32.size() * 4), 0);
}

// Run by ctest with MHA_VERBOSE=2 (module.verbose_bf16_products): a bf16
// checkpoint's module on a bf16 input.  The line must count two products on
// AMX tiles (the stacked Q, K, V product and the output's) where the
// selected backend has them, one with bf16 dot products where it runs those
// (the input product: the output's reads fp32 heads, which only the tiles
// take, split), and none elsewhere: the test says which it expects.
TEST(ModuleBf16Verbose, LinesCountTheBf16Products) {
  const char* verbose = std::getenv("MHA_VERBOSE");
  if (verbose == nullptr || std::string(verbose) != "2") GTEST_SKIP() << "runs with MHA_VERBOSE=2";
  const std::string selected = mha_selected_backend();
  int32_t bf16_dot = 0;
  for (int32_t i = 0; i < mha_backend_count(); ++i) {
    mha_backend_info info;
    ASSERT_EQ(mha_backend_get_info(i, &info), MHA_OK);
    if (selected == info.name) {
      ASSERT_EQ(mha_backend_get_bf16_dot(i, &bf16_dot), MHA_OK);
    }
  }
  const ModuleCase c = self_attention_case(1, 33, 64, 2);
  Rng rng(61);
  WeightSet weights;
  ModuleHandle h;
  ASSERT_TRUE(bf16_checkpoint_module(c, rng, h, &weights));
  HalfTensor x(rng, {c.B, c.Lq, c.E}, MHA_DTYPE_BF16, -1.0f, 1.0f);
  Output out({c.B, c.Lq, c.E}, MHA_DTYPE_F32);
  std::printf("expect bf16_products=%d on %s\n", std::clamp(bf16_dot, 0, 2), selected.c_str());
  std::fflush(stdout);
  ASSERT_EQ(mha_module_forward(h.m, &x.half, &x.half, &x.half, &out.t, nullptr), MHA_OK)
      << mha_last_error();
  std::fflush(stderr);
}

}  // namespace
}  // namespace mha_test
