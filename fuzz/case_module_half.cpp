// mha_module_forward on bf16 and f16 tensors (run_module_half_case, the
// tenth case, on the bytes the packed backward case left).
//
// The module is drawn as for the f32 module cases (ModuleSetup); then its
// query in bf16 or f16, its key and value each in the query's dtype, f32 or
// the other half dtype; additive masks in the query's dtype or f32; the
// weights set again from a bf16 or f16 checkpoint, or not; out and the
// attention weights each in the query's dtype or f32.  Widening is exact, so
// the call must give the bits of the f32 call on the same values (a half
// output: that result rounded once, to nearest even), and the f32 call is
// checked against the module's float64 reference within its bounds.  Or the
// call is broken in one way and refused with nothing written.
//
// Then, when the bytes ask for it, mha_module_backward on the same tensors:
// dout in the query's dtype or f32, the input gradients and the weights'
// (biases', sinks') gradients each in f32, bf16 or f16 -- the f32 backward's
// bits on the same values, rounded once, nothing written outside them; or
// dout in the other half dtype, refused with every gradient untouched.
//
// Then, when the bytes ask for it, the same forward call on a module with
// config.activations = MHA_ACTIVATIONS_INPUT, against the reference that
// rounds the projections and heads to the query's dtype.
#include <fuzzer/FuzzedDataProvider.h>
#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz_cases.h"
#include "fuzz_common.h"
#include "fuzz_module.h"
#include "module_reference.h"
#include "test_util.h"

namespace mha_fuzz {
namespace {

const char* name_of(mha_dtype dtype) {
  return dtype == MHA_DTYPE_BF16 ? "bf16" : dtype == MHA_DTYPE_F16 ? "f16" : "f32";
}

// x's bits in a half dtype, rounded to nearest even (test_util.h's rounding,
// computed from the formats' definitions, not the library's).
uint16_t half_bits(float x, mha_dtype dtype) {
  return dtype == MHA_DTYPE_BF16 ? mha_test::round_to_bf16_bits(x) : mha_test::round_to_f16_bits(x);
}

// x as the nearest value of `dtype` (f32: x itself).
float representable(float x, mha_dtype dtype) {
  if (dtype == MHA_DTYPE_F32) return x;
  return static_cast<float>(mha_test::half_bits_value(half_bits(x, dtype), dtype));
}

// An input of `dtype` with f32 `source`'s shape and strides over `g`: the
// source's values are first rounded to `dtype` in place (so that the f32 call
// and the reference see the values the half tensor holds), then stored.
mha_tensor half_input(Guarded& g, mha_tensor& source, mha_dtype dtype) {
  float* values = static_cast<float*>(source.data);
  mha_test::for_each_offset(source,
                            [&](int64_t at) { values[at] = representable(values[at], dtype); });
  if (dtype == MHA_DTYPE_F32) return source;
  mha_tensor t = source;
  t.data = g.base();
  t.dtype = dtype;
  unsigned char* bytes = reinterpret_cast<unsigned char*>(g.base());
  mha_test::for_each_offset(source, [&](int64_t at) {
    const uint16_t bits = half_bits(values[at], dtype);
    std::memcpy(bytes + at * 2, &bits, 2);
  });
  return t;
}

// An additive mask's values rounded to `dtype` in place, and their bits.
mha_tensor half_mask(std::vector<float>& values, std::vector<uint16_t>& bits, const mha_tensor& f32,
                     mha_dtype dtype) {
  bits.resize(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = representable(values[i], dtype);
    bits[i] = half_bits(values[i], dtype);
  }
  mha_tensor t = f32;
  t.data = bits.data();
  t.dtype = dtype;
  return t;
}

// The module's weights set again from `dtype` arrays (a half-precision
// checkpoint), the reference's copy rounded alike.
void set_half_weights(ModuleSetup& m, mha_dtype dtype) {
  const auto set = [&](const char* name, std::vector<double>& kept, int64_t rows, int64_t cols) {
    std::vector<uint16_t> bits(kept.size());
    for (size_t i = 0; i < kept.size(); ++i) {
      bits[i] = half_bits(static_cast<float>(kept[i]), dtype);
      kept[i] = mha_test::half_bits_value(bits[i], dtype);
    }
    const mha_tensor t = cols == 0 ? mha_test::describe(bits.data(), dtype, {rows})
                                   : mha_test::describe(bits.data(), dtype, {rows, cols});
    if (mha_module_set_weight(m.module, name, &t) != MHA_OK) {
      finding(std::string("module half: set_weight in ") + name_of(dtype) +
              " failed: " + mha_last_error());
    }
  };
  set("q_proj_weight", m.w.w_q, m.E, m.Eq);
  set("k_proj_weight", m.w.w_k, m.E, m.Ek);
  set("v_proj_weight", m.w.w_v, m.E, m.Ev);
  set("out_proj.weight", m.w.w_o, m.E, m.E);
  if (m.bias) {
    std::vector<double> in_bias(m.w.b_q);
    in_bias.insert(in_bias.end(), m.w.b_k.begin(), m.w.b_k.end());
    in_bias.insert(in_bias.end(), m.w.b_v.begin(), m.w.b_v.end());
    set("in_proj_bias", in_bias, 3 * m.E, 0);
    const auto third = [&](int n) {
      return std::vector<double>(in_bias.begin() + n * m.E, in_bias.begin() + (n + 1) * m.E);
    };
    m.w.b_q = third(0);
    m.w.b_k = third(1);
    m.w.b_v = third(2);
    set("out_proj.bias", m.w.b_o, m.E, 0);
  }
}

// Elements of `got` (f32 or a half dtype) that are not `want`'s f32 bits, or
// those bits rounded once to got's dtype (NaN matches any NaN).
int64_t differing(const mha_tensor& got, const mha_tensor& want) {
  int64_t count = 0;
  const float* w = static_cast<const float*>(want.data);
  const unsigned char* g = static_cast<const unsigned char*>(got.data);
  mha_test::for_each_offset(want, [&](int64_t at) {
    const float x = w[at];
    if (got.dtype == MHA_DTYPE_F32) {
      float y = 0;
      std::memcpy(&y, g + at * 4, 4);
      if (!(std::isnan(x) && std::isnan(y)) && bits_of(x) != bits_of(y)) ++count;
      return;
    }
    uint16_t y = 0;
    std::memcpy(&y, g + at * 2, 2);
    const bool y_nan = std::isnan(mha_test::half_bits_value(y, got.dtype));
    if (!(std::isnan(x) && y_nan) && half_bits(x, static_cast<mha_dtype>(got.dtype)) != y) ++count;
  });
  return count;
}

// The backward on the forward's tensors (params without attention weights):
// half-precision gradients must be the f32 backward's, rounded once.
void check_half_backward(FuzzedDataProvider& fdp, ModuleSetup& m, const mha_tensor& query,
                         const mha_tensor& key, const mha_tensor& value,
                         mha_module_forward_params params, mha_dtype qdt, mha_dtype other) {
  params.attn_weights = nullptr;
  mha_module_forward_params params32 = m.params;
  params32.attn_weights = nullptr;
  const int64_t B = m.B, Lq = m.Lq, Lk = m.Lk, E = m.E;
  const auto any_dtype = [&] {
    const int n = fdp.ConsumeIntegralInRange<int>(0, 2);
    return n == 0 ? MHA_DTYPE_F32 : n == 1 ? MHA_DTYPE_BF16 : MHA_DTYPE_F16;
  };
  const mha_dtype dout_dt = fdp.ConsumeBool() ? qdt : MHA_DTYPE_F32;
  const mha_dtype in_dt = any_dtype(), w_dt = any_dtype();
  const bool broken = fdp.ConsumeProbability<float>() < 0.1f;
  note(" | backward: dout %s grads %s/%s%s", name_of(dout_dt), name_of(in_dt), name_of(w_dt),
       broken ? " broken: dout in the other half dtype" : "");

  // dout: random values that its dtype holds, f32 for the f32 call.
  Guarded dout32_buf(B * Lq * E), dout_buf(B * Lq * E);
  mha_tensor dout32 = rows3(dout32_buf, B, Lq, E, m.seq_first);
  mha_test::for_each_offset(
      dout32, [&](int64_t at) { dout32_buf.base()[at] = m.rng.uniform(-1.0f, 1.0f); });
  mha_tensor dout = half_input(dout_buf, dout32, dout_dt);
  if (broken) dout.dtype = other;

  // Each gradient twice: in its drawn dtype and in f32; shared inputs share
  // their gradient (a sum).
  struct Grad {
    Guarded buf, buf32;
    mha_tensor t, t32;
  };
  const auto make = [](Grad& g, const mha_tensor& shape_of, mha_dtype dtype) {
    g.t32 = shape_of;
    g.t32.data = g.buf32.base();
    g.t = g.t32;
    g.t.data = g.buf.base();
    g.t.dtype = dtype;
  };
  const auto vector_of = [](int64_t n) { return mha_test::describe(nullptr, MHA_DTYPE_F32, {n}); };
  const auto matrix_of = [](int64_t r, int64_t c) {
    return mha_test::describe(nullptr, MHA_DTYPE_F32, {r, c});
  };
  Grad g[12] = {{Guarded(B * Lq * m.Eq), Guarded(B * Lq * m.Eq), {}, {}},
                {Guarded(B * Lk * m.Ek), Guarded(B * Lk * m.Ek), {}, {}},
                {Guarded(B * Lk * m.Ev), Guarded(B * Lk * m.Ev), {}, {}},
                {Guarded(E * m.Eq), Guarded(E * m.Eq), {}, {}},
                {Guarded(E * m.Ek), Guarded(E * m.Ek), {}, {}},
                {Guarded(E * m.Ev), Guarded(E * m.Ev), {}, {}},
                {Guarded(E * E), Guarded(E * E), {}, {}},
                {Guarded(E), Guarded(E), {}, {}},
                {Guarded(E), Guarded(E), {}, {}},
                {Guarded(E), Guarded(E), {}, {}},
                {Guarded(E), Guarded(E), {}, {}},
                {Guarded(m.H), Guarded(m.H), {}, {}}};
  make(g[0], rows3(g[0].buf32, B, Lq, m.Eq, m.seq_first), in_dt);
  make(g[1], rows3(g[1].buf32, B, Lk, m.Ek, m.seq_first), in_dt);
  make(g[2], rows3(g[2].buf32, B, Lk, m.Ev, m.seq_first), in_dt);
  make(g[3], matrix_of(E, m.Eq), w_dt);
  make(g[4], matrix_of(E, m.Ek), w_dt);
  make(g[5], matrix_of(E, m.Ev), w_dt);
  make(g[6], matrix_of(E, E), w_dt);
  for (int n = 7; n < 11; ++n) make(g[n], vector_of(E), w_dt);
  make(g[11], vector_of(m.H), w_dt);
  const auto grads_of = [&](bool half) {
    const auto pick = [half](Grad& x) { return half ? &x.t : &x.t32; };
    mha_module_gradients r;
    mha_module_gradients_init(&r);
    r.query = pick(g[0]);
    r.key = m.inputs == 2 ? r.query : pick(g[1]);
    r.value = m.inputs != 0 ? r.key : pick(g[2]);
    r.q_proj_weight = pick(g[3]);
    r.k_proj_weight = pick(g[4]);
    r.v_proj_weight = pick(g[5]);
    r.out_proj_weight = pick(g[6]);
    if (m.bias) {
      r.q_proj_bias = pick(g[7]);
      r.k_proj_bias = pick(g[8]);
      r.v_proj_bias = pick(g[9]);
      r.out_proj_bias = pick(g[10]);
    }
    if (m.with_sinks) r.sinks = pick(g[11]);
    return r;
  };
  const mha_module_gradients grads = grads_of(true), grads32 = grads_of(false);
  std::vector<std::vector<float>> before;
  for (const Grad& x : g) before.push_back(x.buf.all);

  const mha_status status =
      mha_module_backward(m.module, &query, &key, &value, &dout, &params, &grads);
  const std::string message = mha_last_error();
  if (broken) {
    if (status == MHA_OK) finding("module half backward: an invalid call was accepted");
    if (message.empty()) finding("module half backward: a refused call left no message");
    for (size_t n = 0; n < std::size(g); ++n) {
      if (!same_bytes(g[n].buf.all, before[n])) {
        finding("module half backward: a refused call wrote a gradient");
      }
    }
    return;
  }
  if (status != MHA_OK) finding("module half backward: a valid call failed: " + message);
  if (mha_module_backward(m.module, &m.query, &m.key, &m.value, &dout32, &params32, &grads32) !=
      MHA_OK) {
    finding(std::string("module half backward: the f32 call failed: ") + mha_last_error());
  }
  const mha_tensor* given[12] = {grads.query,           grads.key,           grads.value,
                                 grads.q_proj_weight,   grads.k_proj_weight, grads.v_proj_weight,
                                 grads.out_proj_weight, grads.q_proj_bias,   grads.k_proj_bias,
                                 grads.v_proj_bias,     grads.out_proj_bias, grads.sinks};
  const char* names[12] = {"dquery",        "dkey",          "dvalue",          "q_proj_weight",
                           "k_proj_weight", "v_proj_weight", "out_proj_weight", "q_proj_bias",
                           "k_proj_bias",   "v_proj_bias",   "out_proj_bias",   "sinks"};
  for (size_t n = 0; n < std::size(g); ++n) {
    // A shared input's gradient lives in the first of its buffers.
    const bool owned = given[n] == &g[n].t;
    if (!owned) {
      if (!same_bytes(g[n].buf.all, before[n])) {
        finding(std::string("module half backward: ") + names[n] + " written but not asked for");
      }
      continue;
    }
    if (changed_outside(g[n].buf, g[n].t, before[n]) != 0) {
      finding(std::string("module half backward: written outside ") + names[n]);
    }
    if (const int64_t d = differing(g[n].t, g[n].t32); d != 0) {
      note(" %lld elements differ", static_cast<long long>(d));
      finding(std::string("module half backward: ") + names[n] +
              " is not the f32 call's rounded once");
    }
  }
}

// The same call on a module made alike with config.activations =
// MHA_ACTIVATIONS_INPUT (its weights the values m's hold, set as f32): its
// projections and heads rounded to the query's dtype, out and the attention
// weights in f32 -- against the float64 reference that rounds them too,
// nothing written outside them.
void check_half_activations(const ModuleSetup& m, const mha_tensor& query, const mha_tensor& key,
                            const mha_tensor& value, mha_module_forward_params params,
                            mha_dtype qdt, int weights_kind, bool out_seq_first) {
  note(" | activations in %s", name_of(qdt));
  mha_module_config config = m.config;
  config.activations = MHA_ACTIVATIONS_INPUT;
  mha_module* rounding = nullptr;
  if (mha_module_create(&config, &rounding) != MHA_OK) {
    finding(std::string("module half activations: create failed: ") + mha_last_error());
    return;
  }
  const auto set = [&](const char* name, const std::vector<double>& kept,
                       std::vector<int64_t> shape) {
    std::vector<float> values(kept.begin(), kept.end());
    const mha_tensor t = mha_test::describe(values.data(), MHA_DTYPE_F32, shape);
    if (mha_module_set_weight(rounding, name, &t) != MHA_OK) {
      finding(std::string("module half activations: set_weight failed: ") + mha_last_error());
    }
  };
  set("q_proj_weight", m.w.w_q, {m.E, m.Eq});
  set("k_proj_weight", m.w.w_k, {m.E, m.Ek});
  set("v_proj_weight", m.w.w_v, {m.E, m.Ev});
  set("out_proj.weight", m.w.w_o, {m.E, m.E});
  if (m.bias) {
    std::vector<double> in_bias(m.w.b_q);
    in_bias.insert(in_bias.end(), m.w.b_k.begin(), m.w.b_k.end());
    in_bias.insert(in_bias.end(), m.w.b_v.begin(), m.w.b_v.end());
    set("in_proj_bias", in_bias, {3 * m.E});
    set("out_proj.bias", m.w.b_o, {m.E});
  }
  Guarded out_buf(m.B * m.Lq * m.E);
  mha_tensor out = rows3(out_buf, m.B, m.Lq, m.E, out_seq_first);
  const int64_t aw_rows = weights_kind == 0 ? 0 : weights_kind == 1 ? m.B * m.H : m.B;
  Guarded aw_buf(aw_rows * m.Lq * m.Lk);
  mha_tensor aw{};
  params.attn_weights = nullptr;
  if (weights_kind != 0) {
    aw = mha_test::describe(aw_buf.base(), MHA_DTYPE_F32,
                            weights_kind == 1 ? std::vector<int64_t>{m.B, m.H, m.Lq, m.Lk}
                                              : std::vector<int64_t>{m.B, m.Lq, m.Lk});
    params.attn_weights = &aw;
  }
  const std::vector<float> out_before = out_buf.all, aw_before = aw_buf.all;
  if (mha_module_forward(rounding, &query, &key, &value, &out, &params) != MHA_OK) {
    finding(std::string("module half activations: a valid call failed: ") + mha_last_error());
  } else {
    if (changed_outside(out_buf, out, out_before) != 0) {
      finding("module half activations: written outside out");
    }
    if (weights_kind != 0 && changed_outside(aw_buf, aw, aw_before) != 0) {
      finding("module half activations: written outside attn_weights");
    }
    check_against_reference("module half activations: ", m, out, weights_kind, aw, qdt);
  }
  mha_module_destroy(rounding);
}

}  // namespace

int run_module_half_case(FuzzedDataProvider& fdp) {
  start_case(fdp, "module half: ");
  ModuleSetup m(fdp, false);
  const int64_t B = m.B, H = m.H, Lq = m.Lq, Lk = m.Lk, E = m.E;
  const mha_dtype qdt = fdp.ConsumeBool() ? MHA_DTYPE_BF16 : MHA_DTYPE_F16;
  const mha_dtype other = qdt == MHA_DTYPE_BF16 ? MHA_DTYPE_F16 : MHA_DTYPE_BF16;
  const auto pick = [&] {
    const int n = fdp.ConsumeIntegralInRange<int>(0, 2);
    return n == 0 ? qdt : n == 1 ? MHA_DTYPE_F32 : other;
  };
  const mha_dtype kdt = m.inputs == 2 ? qdt : pick();
  const mha_dtype vdt = m.inputs != 0 ? kdt : pick();

  // The inputs (one tensor for self-attention, one for key = value).
  Guarded hq(B * Lq * m.Eq), hk(B * Lk * m.Ek), hv(B * Lk * m.Ev);
  mha_tensor query = half_input(hq, m.query, qdt);
  mha_tensor key = m.inputs == 2 ? query : half_input(hk, m.key, kdt);
  mha_tensor value = m.inputs != 0 ? key : half_input(hv, m.value, vdt);

  // Additive masks in the query's dtype, or left in f32.
  mha_module_forward_params params = m.params;
  std::vector<uint16_t> kpm_bits, am_bits;
  mha_tensor kpm_half{}, am_half{};
  const bool kpm_half_dtype = m.kpm_kind == 2 && fdp.ConsumeBool();
  const bool am_half_dtype = m.am_kind == 2 && fdp.ConsumeBool();
  if (kpm_half_dtype) {
    kpm_half = half_mask(m.kpm_f32, kpm_bits, m.tkpm, qdt);
    params.key_padding_mask = &kpm_half;
  }
  if (am_half_dtype) {
    am_half = half_mask(m.am_f32, am_bits, m.tam, qdt);
    params.attn_mask = &am_half;
  }
  const int weights_from = fdp.ConsumeIntegralInRange<int>(0, 2);  // f32, bf16, f16
  if (weights_from != 0) set_half_weights(m, weights_from == 1 ? MHA_DTYPE_BF16 : MHA_DTYPE_F16);

  // The outputs, and the f32 call's.
  const bool out_seq_first = fdp.ConsumeBool();
  const mha_dtype out_dt = fdp.ConsumeBool() ? qdt : MHA_DTYPE_F32;
  const int weights_kind = fdp.ConsumeIntegralInRange<int>(0, 2);  // none, per head, averaged
  const mha_dtype aw_dt = fdp.ConsumeBool() ? qdt : MHA_DTYPE_F32;
  Guarded out_buf(B * Lq * E), out32_buf(B * Lq * E);
  mha_tensor out = rows3(out_buf, B, Lq, E, out_seq_first);
  mha_tensor out32 = rows3(out32_buf, B, Lq, E, out_seq_first);
  out.dtype = out_dt;
  const int64_t aw_rows = weights_kind == 0 ? 0 : weights_kind == 1 ? B * H : B;
  Guarded aw_buf(aw_rows * Lq * Lk), aw32_buf(aw_rows * Lq * Lk);
  mha_tensor aw{}, aw32{};
  mha_module_forward_params params32 = m.params;
  if (weights_kind != 0) {
    const std::vector<int64_t> shape =
        weights_kind == 1 ? std::vector<int64_t>{B, H, Lq, Lk} : std::vector<int64_t>{B, Lq, Lk};
    aw = mha_test::describe(aw_buf.base(), aw_dt, shape);
    aw32 = mha_test::describe(aw32_buf.base(), MHA_DTYPE_F32, shape);
    params.attn_weights = &aw;
    params32.attn_weights = &aw32;
    params.average_attn_weights = params32.average_attn_weights = weights_kind == 2 ? 1 : 0;
  }
  note(" q/k/v %s/%s/%s half kpm %d am %d weights from %s out %s seq %d attn_weights %d in %s",
       name_of(qdt), name_of(kdt), name_of(vdt), kpm_half_dtype, am_half_dtype,
       weights_from == 0   ? "f32"
       : weights_from == 1 ? "bf16"
                           : "f16",
       name_of(out_dt), out_seq_first, weights_kind, name_of(aw_dt));

  // At most one way of breaking the call (none when the bytes ran out).
  bool broken = true;
  mha_tensor wrong{};
  const mha_tensor* q_arg = &query;
  switch (fdp.ConsumeIntegralInRange<int>(0, 12)) {
    case 1:
      out.dtype = other;
      note(" broken: out in the other half dtype");
      break;
    case 2:
      if (weights_kind == 0) {
        broken = false;
        break;
      }
      aw.dtype = other;
      note(" broken: attn_weights in the other half dtype");
      break;
    case 3:
      if (!kpm_half_dtype && !am_half_dtype) {
        broken = false;
        break;
      }
      (kpm_half_dtype ? kpm_half : am_half).dtype = other;
      note(" broken: an additive mask in the other half dtype");
      break;
    case 4:
      wrong = query;
      wrong.dtype = MHA_DTYPE_I8;
      q_arg = &wrong;
      note(" broken: query in int8");
      break;
    case 5:
      out.data = hq.base();
      note(" broken: out over the half query");
      break;
    case 6:
      wrong = query;
      wrong.shape[2] += 1;
      q_arg = &wrong;
      note(" broken: the half query's features");
      break;
    default:
      broken = false;
  }

  Guarded* buffers[] = {&out_buf, &aw_buf, &hq, &hk, &hv, &m.xq, &m.xk, &m.xv};
  std::vector<std::vector<float>> before;
  for (Guarded* g : buffers) before.push_back(g->all);
  const mha_status status = mha_module_forward(m.module, q_arg, &key, &value, &out, &params);
  const std::string message = mha_last_error();
  for (size_t n = 2; n < std::size(buffers); ++n) {
    if (!same_bytes(buffers[n]->all, before[n])) finding("module half: an input was modified");
  }
  if (broken) {
    if (status == MHA_OK) finding("module half: an invalid call was accepted");
    if (message.empty()) finding("module half: a refused call left no message");
    if (!same_bytes(out_buf.all, before[0]) || !same_bytes(aw_buf.all, before[1])) {
      finding("module half: a refused call wrote its output");
    }
    return 0;
  }
  if (status != MHA_OK) finding("module half: a valid call failed: " + message);
  if (changed_outside(out_buf, out, before[0]) != 0) finding("module half: written outside out");
  if (weights_kind != 0 && changed_outside(aw_buf, aw, before[1]) != 0) {
    finding("module half: written outside attn_weights");
  }

  // The f32 call on the same values, against the reference; the half call
  // gives its bits.
  if (mha_module_forward(m.module, &m.query, &m.key, &m.value, &out32, &params32) != MHA_OK) {
    finding(std::string("module half: the f32 call failed: ") + mha_last_error());
  }
  if (const int64_t n = differing(out, out32); n != 0) {
    note(" %lld elements differ", static_cast<long long>(n));
    finding("module half: out is not the f32 call's result rounded once");
  }
  if (weights_kind != 0) {
    if (const int64_t n = differing(aw, aw32); n != 0) {
      note(" %lld elements differ", static_cast<long long>(n));
      finding("module half: attn_weights are not the f32 call's rounded once");
    }
  }
  check_against_reference("module half: the f32 call's ", m, out32, weights_kind, aw32);
  if (fdp.ConsumeBool()) check_half_backward(fdp, m, query, key, value, params, qdt, other);
  if (fdp.ConsumeBool()) {
    check_half_activations(m, query, key, value, params, qdt, weights_kind, out_seq_first);
  }
  return 0;
}

}  // namespace mha_fuzz
