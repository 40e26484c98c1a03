// The module's cases: mha_module_backward (run_module_backward_case, the
// fifth case, on the bytes the backward case left) and mha_module_forward
// (run_module_forward_case, the last, on the bytes the positional case left),
// the module, its data and its parameters drawn the same way (ModuleSetup).
//
// mha_module_backward: any feature sizes, self-attention and key = value
// (summed gradients), either layout, every mask and variant, a random subset
// of the gradients -- against the module's float64 backward reference, or a
// broken call refused with every gradient untouched.
//
// mha_module_forward: the module drawn as for its backward case, the output
// in either layout, the attention weights per head, averaged or not wanted --
// against the module's float64 reference within its error bounds, or a broken
// call (shapes, dtypes, overlaps, bad parameters, NULLs) refused with nothing
// written.
#include "fuzz_cases.h"

#include <fuzzer/FuzzedDataProvider.h>
#include <mha/mha.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "fuzz_module.h"
#include "module_reference.h"
#include "module_reference_backward.h"
#include "test_util.h"

namespace mha_fuzz {

int run_module_backward_case(FuzzedDataProvider& fdp) {
  const std::string backend = start_case(fdp, "module backward: ");
  ModuleSetup m(fdp, true);
  const int64_t B = m.B, H = m.H, E = m.E, Lq = m.Lq, Lk = m.Lk, Eq = m.Eq, Ek = m.Ek, Ev = m.Ev;
  const int inputs = m.inputs;
  const bool bias = m.bias, with_sinks = m.with_sinks;
  mha_tensor &query = m.query, &key = m.key, &value = m.value, &dout = m.dout;
  mha_module* module = m.module;
  const mha_module_forward_params& params = m.params;

  // The gradients: each wanted or not; the inputs' in either layout, shared
  // (summed) where the inputs are.
  const bool grads_seq = fdp.ConsumeBool();
  Guarded gq(B * Lq * Eq), gk(B * Lk * Ek), gv(B * Lk * Ev), gwq(E * Eq), gwk(E * Ek), gwv(E * Ev),
      gwo(E * E), gbq(E), gbk(E), gbv(E), gbo(E), gs(H);
  mha_tensor dq = rows3(gq, B, Lq, Eq, grads_seq);
  mha_tensor dk = inputs == 2 ? dq : rows3(gk, B, Lk, Ek, grads_seq);
  mha_tensor dv = inputs != 0 ? dk : rows3(gv, B, Lk, Ev, grads_seq);
  mha_tensor dwq = mha_test::describe(gwq.base(), MHA_DTYPE_F32, {E, Eq});
  mha_tensor dwk = mha_test::describe(gwk.base(), MHA_DTYPE_F32, {E, Ek});
  mha_tensor dwv = mha_test::describe(gwv.base(), MHA_DTYPE_F32, {E, Ev});
  mha_tensor dwo = mha_test::describe(gwo.base(), MHA_DTYPE_F32, {E, E});
  mha_tensor dbq = mha_test::describe(gbq.base(), MHA_DTYPE_F32, {E});
  mha_tensor dbk = mha_test::describe(gbk.base(), MHA_DTYPE_F32, {E});
  mha_tensor dbv = mha_test::describe(gbv.base(), MHA_DTYPE_F32, {E});
  mha_tensor dbo = mha_test::describe(gbo.base(), MHA_DTYPE_F32, {E});
  mha_tensor ds = mha_test::describe(gs.base(), MHA_DTYPE_F32, {H});
  mha_module_gradients grads;
  mha_module_gradients_init(&grads);
  const auto maybe = [&](mha_tensor* t) {
    return fdp.ConsumeProbability<float>() < 0.8f ? t : nullptr;
  };
  grads.query = maybe(&dq);
  grads.key = inputs == 2 ? grads.query : maybe(&dk);
  grads.value = inputs != 0 ? grads.key : maybe(&dv);
  grads.q_proj_weight = maybe(&dwq);
  grads.k_proj_weight = maybe(&dwk);
  grads.v_proj_weight = maybe(&dwv);
  grads.out_proj_weight = maybe(&dwo);
  if (bias) {
    grads.q_proj_bias = maybe(&dbq);
    grads.k_proj_bias = maybe(&dbk);
    grads.v_proj_bias = maybe(&dbv);
    grads.out_proj_bias = maybe(&dbo);
  }
  if (with_sinks) grads.sinks = maybe(&ds);

  // At most one way of breaking the call.
  bool broken = true;
  mha_tensor wrong{};
  switch (fdp.ConsumeIntegralInRange<int>(0, 12)) {
    case 0:
      dout.shape[2] += 1;
      note(" broken: dout's features");
      break;
    case 1:
      dwq.shape[1] += 1;
      grads.q_proj_weight = &dwq;
      note(" broken: q_proj_weight's shape");
      break;
    case 2:
      wrong = key;
      grads.key = &wrong;
      note(" broken: grads->key over key");
      break;
    case 3:
      grads.struct_size = 7;
      note(" broken: grads->struct_size");
      break;
    case 4:
      if (bias) {
        broken = false;
        break;
      }
      grads.out_proj_bias = &dbo;
      note(" broken: a bias gradient without biases");
      break;
    case 5:
      grads.out_proj_weight = &dwq;
      grads.q_proj_weight = &dwq;
      note(" broken: one buffer for two weights");
      break;
    default:
      broken = false;
  }
  std::vector<std::vector<float>> before;
  Guarded* buffers[] = {&gq, &gk, &gv, &gwq, &gwk, &gwv, &gwo, &gbq, &gbk, &gbv, &gbo, &gs};
  for (Guarded* g : buffers) before.push_back(g->all);
  const auto untouched = [&] {
    for (size_t n = 0; n < std::size(buffers); ++n) {
      if (!same_bytes(buffers[n]->all, before[n])) return false;
    }
    return true;
  };
  const mha_status status =
      mha_module_backward(module, &query, &key, &value, &dout, &params, &grads);
  const std::string message = mha_last_error();
  if (broken) {
    if (status == MHA_OK) finding("module backward: an invalid call was accepted");
    if (message.empty()) finding("module backward: a refused call left no message");
    if (!untouched()) finding("module backward: a refused call modified a gradient");
    return 0;
  }
  if (status != MHA_OK) finding("module backward: a valid call failed: " + message);
  const mha_test::ModuleBackwardReference ref =
      mha_test::reference_module_backward(m.w, m.in, dout);
  const auto check = [&](const mha_tensor* got, const Guarded& g, size_t index,
                         std::vector<const mha_test::ReferenceGradient*> want, const char* name) {
    if (got == nullptr) {
      if (!same_bytes(g.all, before[index]))
        finding(std::string("module backward: ") + name + " written but not asked for");
      return;
    }
    if (changed_outside(g, *got, before[index]) != 0) {
      finding(std::string("module backward: written outside ") + name);
    }
    std::vector<double> value = want[0]->value;
    double tol = want[0]->tolerance;
    for (size_t n = 1; n < want.size(); ++n) {
      for (size_t i = 0; i < value.size(); ++i) value[i] += want[n]->value[i];
      tol += want[n]->tolerance;
    }
    double error = 0;
    size_t i = 0;
    mha_test::for_each_offset(*got, [&](int64_t at) {
      const double diff =
          std::fabs(static_cast<double>(static_cast<const float*>(got->data)[at]) - value[i++]);
      error = std::isnan(diff) ? kInfD : std::max(error, diff);
    });
    if (!(error <= tol)) {
      char text[160];
      std::snprintf(text, sizeof text, "module backward: %s off by %.3g (tolerance %.3g)", name,
                    error, tol);
      finding(text);
    }
  };
  if (inputs == 2) {
    check(grads.query, gq, 0, {&ref.query, &ref.key, &ref.value}, "dquery (= dkey = dvalue)");
  } else {
    check(grads.query, gq, 0, {&ref.query}, "dquery");
    if (inputs == 1) {
      check(grads.key, gk, 1, {&ref.key, &ref.value}, "dkey (= dvalue)");
    } else {
      check(grads.key, gk, 1, {&ref.key}, "dkey");
      check(grads.value, gv, 2, {&ref.value}, "dvalue");
    }
  }
  check(grads.q_proj_weight, gwq, 3, {&ref.w_q}, "q_proj_weight");
  check(grads.k_proj_weight, gwk, 4, {&ref.w_k}, "k_proj_weight");
  check(grads.v_proj_weight, gwv, 5, {&ref.w_v}, "v_proj_weight");
  check(grads.out_proj_weight, gwo, 6, {&ref.w_o}, "out_proj_weight");
  check(grads.q_proj_bias, gbq, 7, {&ref.b_q}, "q_proj_bias");
  check(grads.k_proj_bias, gbk, 8, {&ref.b_k}, "k_proj_bias");
  check(grads.v_proj_bias, gbv, 9, {&ref.b_v}, "v_proj_bias");
  check(grads.out_proj_bias, gbo, 10, {&ref.b_o}, "out_proj_bias");
  if (with_sinks) check(grads.sinks, gs, 11, {&ref.sinks}, "sinks");
  return 0;
}

// mha_module_forward: the module drawn as for the backward case, the output
// in either layout, the attention weights per head, averaged over the heads,
// or not wanted -- against the module's float64 reference within its error
// bounds, with nothing written outside out and the weights and the inputs
// left alone; or the call broken in one way and refused with nothing written.
int run_module_forward_case(FuzzedDataProvider& fdp) {
  start_case(fdp, "module forward: ");
  ModuleSetup m(fdp, false);
  const int64_t B = m.B, H = m.H, Lq = m.Lq, Lk = m.Lk;
  const bool out_seq_first = fdp.ConsumeBool();
  Guarded out_buf(B * Lq * m.E);
  mha_tensor out = rows3(out_buf, B, Lq, m.E, out_seq_first);
  const int weights_kind = fdp.ConsumeIntegralInRange<int>(0, 2);  // none, per head, averaged
  Guarded weights_buf(weights_kind == 0 ? 0 : (weights_kind == 1 ? B * H : B) * Lq * Lk);
  mha_tensor weights{};
  mha_module_forward_params params = m.params;
  if (weights_kind != 0) {
    weights = weights_kind == 1
                  ? mha_test::describe(weights_buf.base(), MHA_DTYPE_F32, {B, H, Lq, Lk})
                  : mha_test::describe(weights_buf.base(), MHA_DTYPE_F32, {B, Lq, Lk});
    params.attn_weights = &weights;
    params.average_attn_weights = weights_kind == 2 ? 1 : 0;
  }
  note(" out seq %d weights %d", out_seq_first, weights_kind);

  // At most one way of breaking the call.
  bool broken = true;
  mha_module* module = m.module;
  const mha_tensor* query = &m.query;
  mha_tensor wrong{};
  // An optional input one element longer along `dim`: refused; absent, the
  // call stays valid.
  const auto grow = [&](const mha_tensor*& input, int dim, const char* name) {
    if (input == nullptr) {
      broken = false;
      return;
    }
    wrong = *input;
    wrong.shape[dim] += 1;
    input = &wrong;
    note(" broken: %s's shape", name);
  };
  switch (fdp.ConsumeIntegralInRange<int>(0, 20)) {
    case 0:
      out.shape[2] += 1;
      note(" broken: out's features");
      break;
    case 1:
      out.dtype = MHA_DTYPE_BF16;
      note(" broken: out in bf16");
      break;
    case 2:
      wrong = m.query;
      wrong.shape[2] += 1;
      query = &wrong;
      note(" broken: query's features");
      break;
    case 3:
      if (weights_kind == 0) {
        broken = false;
        break;
      }
      weights.shape[weights.ndim - 1] += 1;
      note(" broken: attn_weights' shape");
      break;
    case 4:
      grow(params.key_padding_mask, 1, "key_padding_mask");
      break;
    case 5:
      grow(params.attn_mask, 0, "attn_mask");
      break;
    case 6:
      grow(params.valid_lens, 0, "valid_lens");
      break;
    case 7:
      params.struct_size = 7;
      note(" broken: params->struct_size");
      break;
    case 8:
      out.data = m.query.data;
      note(" broken: out over query");
      break;
    case 9:
      if (weights_kind == 0) {
        broken = false;
        break;
      }
      weights.data = out.data;
      note(" broken: attn_weights over out");
      break;
    case 10:
      params.causal = 3;
      note(" broken: params->causal");
      break;
    case 11:
      params.softcap = -1.0f;
      note(" broken: a negative softcap");
      break;
    case 12:
      module = nullptr;
      note(" broken: no module");
      break;
    case 13:
      query = nullptr;
      note(" broken: no query");
      break;
    default:
      broken = false;
  }

  Guarded* buffers[] = {&out_buf, &weights_buf, &m.xq, &m.xk, &m.xv};
  std::vector<std::vector<float>> before;
  for (Guarded* g : buffers) before.push_back(g->all);
  const mha_status status = mha_module_forward(module, query, &m.key, &m.value, &out, &params);
  const std::string message = mha_last_error();
  for (size_t n = 2; n < std::size(buffers); ++n) {
    if (!same_bytes(buffers[n]->all, before[n])) finding("module forward: an input was modified");
  }
  if (broken) {
    if (status == MHA_OK) finding("module forward: an invalid call was accepted");
    if (message.empty()) finding("module forward: a refused call left no message");
    if (!same_bytes(out_buf.all, before[0]) || !same_bytes(weights_buf.all, before[1])) {
      finding("module forward: a refused call wrote its output");
    }
    return 0;
  }
  if (status != MHA_OK) finding("module forward: a valid call failed: " + message);
  if (changed_outside(out_buf, out, before[0]) != 0) finding("module forward: written outside out");
  if (weights_kind != 0 && changed_outside(weights_buf, weights, before[1]) != 0) {
    finding("module forward: written outside attn_weights");
  }
  check_against_reference("module forward: ", m, out, weights_kind, weights);
  return 0;
}

}  // namespace mha_fuzz
