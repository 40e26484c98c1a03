// The module as the module cases draw it (fuzz_module.h).
#include "fuzz_module.h"

#include <algorithm>
#include <string>

namespace mha_fuzz {

mha_tensor rows3(Guarded& g, int64_t b, int64_t l, int64_t f, bool seq_first) {
  return mha_test::describe(
      g.base(), MHA_DTYPE_F32, {b, l, f},
      seq_first ? std::vector<int64_t>{f, b * f, 1} : std::vector<int64_t>{l * f, f, 1});
}

ModuleSetup::ModuleSetup(FuzzedDataProvider& fdp, bool with_dout) {
  B = fdp.ConsumeIntegralInRange<int64_t>(1, 2);
  H = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  E = H * fdp.ConsumeIntegralInRange<int64_t>(1, 8);
  inputs = fdp.ConsumeIntegralInRange<int>(0, 2);
  Lq = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  Lk = inputs == 2 ? Lq : fdp.ConsumeIntegralInRange<int64_t>(1, 70);
  Eq = inputs == 2 || fdp.ConsumeBool() ? E : fdp.ConsumeIntegralInRange<int64_t>(1, 20);
  Ek = inputs == 2 || fdp.ConsumeBool() ? Eq : fdp.ConsumeIntegralInRange<int64_t>(1, 20);
  Ev = inputs != 0 ? Ek : fdp.ConsumeIntegralInRange<int64_t>(1, 20);
  bias = fdp.ConsumeBool();
  seq_first = fdp.ConsumeBool();
  note(" B %lld H %lld E %lld Eq/Ek/Ev %lld/%lld/%lld Lq %lld Lk %lld inputs %d bias %d seq %d",
       static_cast<long long>(B), static_cast<long long>(H), static_cast<long long>(E),
       static_cast<long long>(Eq), static_cast<long long>(Ek), static_cast<long long>(Ev),
       static_cast<long long>(Lq), static_cast<long long>(Lk), inputs, bias, seq_first);
  rng = mha_test::Rng(fdp.ConsumeIntegral<uint32_t>());

  mha_module_config_init(&config);
  config.embed_dim = E;
  config.num_heads = H;
  config.query_dim = Eq;
  config.key_dim = Ek;
  config.value_dim = Ev;
  config.bias = bias ? 1 : 0;
  config.dropout = fdp.ConsumeBool() ? 0.25f : 0.0f;
  if (mha_module_create(&config, &module) != MHA_OK) {
    finding(std::string("module create failed: ") + mha_last_error());
  }
  set_weights();
  draw_data(with_dout);
  draw_params(fdp);
}

void ModuleSetup::set(const char* name, int64_t rows, int64_t cols, std::vector<double>& kept) {
  std::vector<float> values(static_cast<size_t>(rows * std::max<int64_t>(cols, 1)));
  for (float& x : values) x = rng.uniform(-0.5f, 0.5f);
  kept.assign(values.begin(), values.end());
  const mha_tensor t = cols == 0 ? mha_test::describe(values.data(), MHA_DTYPE_F32, {rows})
                                 : mha_test::describe(values.data(), MHA_DTYPE_F32, {rows, cols});
  if (mha_module_set_weight(module, name, &t) != MHA_OK) {
    finding(std::string("set_weight failed: ") + mha_last_error());
  }
}

void ModuleSetup::set_weights() {
  w.embed_dim = E;
  w.num_heads = H;
  w.query_dim = Eq;
  w.key_dim = Ek;
  w.value_dim = Ev;
  set("q_proj_weight", E, Eq, w.w_q);
  set("k_proj_weight", E, Ek, w.w_k);
  set("v_proj_weight", E, Ev, w.w_v);
  set("out_proj.weight", E, E, w.w_o);
  w.b_q.assign(static_cast<size_t>(E), 0.0);
  w.b_k = w.b_v = w.b_o = w.b_q;
  if (bias) {
    std::vector<double> in_bias;
    set("in_proj_bias", 3 * E, 0, in_bias);
    w.b_q.assign(in_bias.begin(), in_bias.begin() + E);
    w.b_k.assign(in_bias.begin() + E, in_bias.begin() + 2 * E);
    w.b_v.assign(in_bias.begin() + 2 * E, in_bias.end());
    set("out_proj.bias", E, 0, w.b_o);
  }
}

void ModuleSetup::draw_data(bool with_dout) {
  xq = Guarded(B * Lq * Eq);
  xk = Guarded(B * Lk * Ek);
  xv = Guarded(B * Lk * Ev);
  gout = Guarded(with_dout ? B * Lq * E : 0);
  query = rows3(xq, B, Lq, Eq, seq_first);
  key = inputs == 2 ? query : rows3(xk, B, Lk, Ek, seq_first);
  value = inputs != 0 ? key : rows3(xv, B, Lk, Ev, seq_first);
  if (with_dout) dout = rows3(gout, B, Lq, E, seq_first);
  for (const mha_tensor* t : {&query, &key, &value, &dout}) {
    if (t->data == nullptr) continue;
    mha_test::for_each_offset(
        *t, [&](int64_t at) { static_cast<float*>(t->data)[at] = rng.uniform(-1.0f, 1.0f); });
  }
}

void ModuleSetup::draw_params(FuzzedDataProvider& fdp) {
  mha_module_forward_params_init(&params);
  in.query = &query;
  in.key = &key;
  in.value = &value;
  params.causal = in.causal = fdp.ConsumeIntegralInRange<int32_t>(0, 2);
  if (fdp.ConsumeBool())
    params.window_left = in.window_left = fdp.ConsumeIntegralInRange<int64_t>(0, 30);
  if (fdp.ConsumeBool())
    params.window_right = in.window_right = fdp.ConsumeIntegralInRange<int64_t>(0, 30);
  if (config.dropout > 0.0f && fdp.ConsumeBool()) {
    params.training = 1;
    params.dropout_seed = in.dropout_seed = fdp.ConsumeIntegral<uint64_t>();
    in.dropout_p = static_cast<double>(config.dropout);
  }
  if (fdp.ConsumeBool()) {
    params.softcap = fdp.ConsumeBool() ? 1.5f : 30.0f;
    in.softcap = static_cast<double>(params.softcap);
  }
  slopes.resize(static_cast<size_t>(H));
  sinks.resize(static_cast<size_t>(H));
  lens.resize(static_cast<size_t>(B));
  kpm_kind = fdp.ConsumeIntegralInRange<int>(0, 2);
  if (kpm_kind == 1) {
    kpm_bool.resize(static_cast<size_t>(B * Lk));
    for (auto& m : kpm_bool) m = rng.chance(0.2) ? 1 : 0;
    tkpm = mha_test::describe(kpm_bool.data(), MHA_DTYPE_BOOL, {B, Lk});
  } else if (kpm_kind == 2) {
    kpm_f32.resize(static_cast<size_t>(B * Lk));
    for (auto& m : kpm_f32) m = rng.chance(0.1) ? -kInf : rng.uniform(-2.0f, 2.0f);
    tkpm = mha_test::describe(kpm_f32.data(), MHA_DTYPE_F32, {B, Lk});
  }
  if (kpm_kind != 0) params.key_padding_mask = in.key_padding_mask = &tkpm;
  am_kind = fdp.ConsumeIntegralInRange<int>(0, 2);
  if (am_kind == 1) {
    am_bool.resize(static_cast<size_t>(Lq * Lk));
    for (auto& m : am_bool) m = rng.chance(0.2) ? 1 : 0;
    tam = mha_test::describe(am_bool.data(), MHA_DTYPE_BOOL, {Lq, Lk});
  } else if (am_kind == 2) {
    am_f32.resize(static_cast<size_t>(B * H * Lq * Lk));
    for (auto& m : am_f32) m = rng.uniform(-2.0f, 2.0f);
    tam = mha_test::describe(am_f32.data(), MHA_DTYPE_F32, {B * H, Lq, Lk});
  }
  if (am_kind != 0) params.attn_mask = in.attn_mask = &tam;
  if (fdp.ConsumeBool()) {
    for (auto& l : lens) l = static_cast<int32_t>(rng.integer(0, Lk));
    tlens = mha_test::describe(lens.data(), MHA_DTYPE_I32, {B});
    params.valid_lens = in.valid_lens = &tlens;
  }
  if (fdp.ConsumeBool()) {
    for (auto& x : slopes) x = rng.uniform(0.0f, 0.5f);
    tslopes = mha_test::describe(slopes.data(), MHA_DTYPE_F32, {H});
    params.alibi_slopes = in.alibi_slopes = &tslopes;
  }
  with_sinks = fdp.ConsumeBool();
  if (with_sinks) {
    for (auto& x : sinks) x = rng.chance(0.2) ? -kInf : rng.uniform(-2.0f, 3.0f);
    tsinks = mha_test::describe(sinks.data(), MHA_DTYPE_F32, {H});
    params.sinks = in.sinks = &tsinks;
  }
  note(" causal %d window %lld,%lld dropout %d softcap %g kpm %d am %d lens %d alibi %d sinks %d",
       params.causal, static_cast<long long>(params.window_left),
       static_cast<long long>(params.window_right), params.training,
       static_cast<double>(params.softcap), kpm_kind, am_kind, params.valid_lens != nullptr,
       params.alibi_slopes != nullptr, with_sinks);
}

void check_against_reference(const char* prefix, const ModuleSetup& m, const mha_tensor& out,
                             int weights_kind, const mha_tensor& weights, int32_t activations) {
  mha_test::ModuleInputs in = m.in;
  in.activations = activations;
  const mha_test::ModuleReference ref = mha_test::reference_module(m.w, in);
  const auto check = [prefix](const mha_tensor& got, const std::vector<double>& want,
                              const std::vector<double>& bound, const char* name) {
    const mha_test::BoundCheck c = mha_test::check_within(got, want, bound);
    if (c.outside != 0) {
      note(" %lld of %lld outside, worst %.3g of the bound; first: %s",
           static_cast<long long>(c.outside), static_cast<long long>(c.elements), c.worst_ratio,
           c.first.c_str());
      finding(std::string(prefix) + name + " off");
    }
  };
  check(out, ref.out, ref.out_bound, "out");
  if (weights_kind == 1) check(weights, ref.weights, ref.weights_bound, "attn_weights");
  if (weights_kind == 2) check(weights, ref.average, ref.average_bound, "averaged attn_weights");
}

}  // namespace mha_fuzz
