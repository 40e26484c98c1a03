// The fourth case (run_backward_case), on the bytes the paged-cache case
// left: mha_attention_backward, its gradients against the float64 backward
// reference, or a broken call refused with the gradients untouched.
#include "fuzz_cases.h"

#include <fuzzer/FuzzedDataProvider.h>
#include <mha/mha.h>

#include <cstdio>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "fuzz_common.h"
#include "reference_backward.h"
#include "test_util.h"

namespace mha_fuzz {

// mha_attention_backward on a small case: shapes (GQA, Lq != Lk, Dv != D),
// the causal mode, a window, a bool or additive mask (with dmask), valid
// lengths, dropout, softcap, ALiBi, sinks (with dsinks), inputs sometimes
// holding large values, and dtypes: q, k and v each F32, BF16 or F16, out
// and dout F32 or q's, the gradients F32 or their inputs' (drawn last, from
// bytes older corpus entries did not have: those stay all F32).  The
// forward gives out and LSE; the gradients are checked against the float64
// backward reference of the same stored values, nothing may be written
// outside dq, dk, dv -- or the call is broken in one way (a gradient of a
// dtype it cannot have among them) and must be refused with a message and
// the gradients untouched.
int run_backward_case(FuzzedDataProvider& fdp) {
  const std::string backend = start_case(fdp, "backward: ");
  const int64_t hkv = fdp.ConsumeIntegralInRange<int64_t>(1, 2);
  const int64_t B = fdp.ConsumeIntegralInRange<int64_t>(1, 2);
  const int64_t H = hkv * fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t Lq = fdp.ConsumeIntegralInRange<int64_t>(1, 80);
  const int64_t Lk = fdp.ConsumeIntegralInRange<int64_t>(1, 150);
  const int64_t D = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  const int64_t Dv = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  note(" B %lld H %lld/%lld Lq %lld Lk %lld D %lld Dv %lld", static_cast<long long>(B),
       static_cast<long long>(H), static_cast<long long>(hkv), static_cast<long long>(Lq),
       static_cast<long long>(Lk), static_cast<long long>(D), static_cast<long long>(Dv));
  mha_test::Rng rng(fdp.ConsumeIntegral<uint32_t>());
  const float amplitude = fdp.ConsumeBool() ? 1.0f : 8.0f;
  std::vector<float> q(static_cast<size_t>(B * H * Lq * D)),
      k(static_cast<size_t>(B * hkv * Lk * D)), v(static_cast<size_t>(B * hkv * Lk * Dv)),
      dout(static_cast<size_t>(B * H * Lq * Dv)), out(dout.size()),
      lse(static_cast<size_t>(B * H * Lq));
  for (auto* x : {&q, &k}) {
    for (float& f : *x) f = rng.uniform(-amplitude, amplitude);
  }
  for (auto* x : {&v, &dout}) {
    for (float& f : *x) f = rng.uniform(-1.0f, 1.0f);
  }
  const mha_tensor q32 = mha_test::describe(q.data(), MHA_DTYPE_F32, {B, H, Lq, D});
  const mha_tensor k32 = mha_test::describe(k.data(), MHA_DTYPE_F32, {B, hkv, Lk, D});
  const mha_tensor v32 = mha_test::describe(v.data(), MHA_DTYPE_F32, {B, hkv, Lk, Dv});
  const mha_tensor dout32 = mha_test::describe(dout.data(), MHA_DTYPE_F32, {B, H, Lq, Dv});
  mha_tensor tlse = mha_test::describe(lse.data(), MHA_DTYPE_F32, {B, H, Lq});

  mha_attention_params params;
  mha_attention_params_init(&params);
  params.causal = fdp.ConsumeIntegralInRange<int32_t>(0, 2);
  if (fdp.ConsumeBool()) params.window_left = fdp.ConsumeIntegralInRange<int64_t>(0, 60);
  if (fdp.ConsumeBool()) params.window_right = fdp.ConsumeIntegralInRange<int64_t>(0, 60);
  const int mask_kind = fdp.ConsumeIntegralInRange<int>(0, 2);
  std::vector<uint8_t> mask_bool;
  std::vector<float> mask_add, dmask;
  mha_tensor tmask{}, tdmask{};
  if (mask_kind == 1) {
    mask_bool.resize(static_cast<size_t>(Lq * Lk));
    for (auto& m : mask_bool) m = rng.chance(0.8) ? 1 : 0;
    tmask = mha_test::describe(mask_bool.data(), MHA_DTYPE_BOOL, {Lq, Lk});
    params.mask = &tmask;
  } else if (mask_kind == 2) {
    mask_add.resize(static_cast<size_t>(B * Lq * Lk));
    for (auto& m : mask_add) m = rng.chance(0.1) ? -kInf : rng.uniform(-2.0f, 2.0f);
    tmask = mha_test::describe(mask_add.data(), MHA_DTYPE_F32, {B, 1, Lq, Lk});
    params.mask = &tmask;
    dmask.assign(mask_add.size(), 0.0f);
    tdmask = mha_test::describe(dmask.data(), MHA_DTYPE_F32, {B, 1, Lq, Lk});
  }
  std::vector<int32_t> lens(static_cast<size_t>(B));
  mha_tensor tlens{};
  if (fdp.ConsumeBool()) {
    for (auto& l : lens) l = static_cast<int32_t>(rng.integer(0, Lk));
    tlens = mha_test::describe(lens.data(), MHA_DTYPE_I32, {B});
    params.valid_lens = &tlens;
  }
  if (fdp.ConsumeBool()) {
    params.dropout_p = 0.25f;
    params.dropout_seed = fdp.ConsumeIntegral<uint64_t>();
  }
  if (fdp.ConsumeBool()) params.softcap = fdp.ConsumeBool() ? 1.5f : 30.0f;
  std::vector<float> slopes(static_cast<size_t>(H)), sinks(static_cast<size_t>(H)),
      dsinks(static_cast<size_t>(H), 0.0f);
  mha_tensor tslopes{}, tsinks{}, tdsinks{};
  if (fdp.ConsumeBool()) {
    for (auto& s : slopes) s = rng.uniform(0.0f, 0.5f);
    tslopes = mha_test::describe(slopes.data(), MHA_DTYPE_F32, {H});
    params.alibi_slopes = &tslopes;
  }
  const bool with_sinks = fdp.ConsumeBool();
  if (with_sinks) {
    for (auto& s : sinks) s = rng.chance(0.2) ? -kInf : rng.uniform(-2.0f, 3.0f);
    tsinks = mha_test::describe(sinks.data(), MHA_DTYPE_F32, {H});
    params.sinks = &tsinks;
    tdsinks = mha_test::describe(dsinks.data(), MHA_DTYPE_F32, {H});
  }
  note(" causal %d window %lld,%lld mask %d lens %d dropout %g softcap %g alibi %d sinks %d",
       params.causal, static_cast<long long>(params.window_left),
       static_cast<long long>(params.window_right), mask_kind, params.valid_lens != nullptr,
       static_cast<double>(params.dropout_p), static_cast<double>(params.softcap),
       params.alibi_slopes != nullptr, with_sinks);
  mha_backward_params backward;
  mha_backward_params_init(&backward);
  if (mask_kind == 2 && fdp.ConsumeBool()) backward.dmask = &tdmask;
  if (with_sinks && fdp.ConsumeBool()) backward.dsinks = &tdsinks;
  const int breaking = fdp.ConsumeIntegralInRange<int>(0, 15);

  // The dtypes (0, all an older entry has left: every tensor F32).
  const uint8_t pick = fdp.ConsumeIntegral<uint8_t>();
  static const mha_dtype kFloatTypes[] = {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16};
  const mha_dtype q_dtype = kFloatTypes[pick % 3], kv_dtype = kFloatTypes[pick / 3 % 3];
  const mha_dtype out_dtype = pick / 9 % 2 != 0 ? q_dtype : MHA_DTYPE_F32;
  const mha_dtype dout_dtype = pick / 18 % 2 != 0 ? q_dtype : MHA_DTYPE_F32;
  const bool half_grads = pick / 36 % 2 != 0;
  const mha_dtype dq_dtype = half_grads ? q_dtype : MHA_DTYPE_F32;
  const mha_dtype dkv_dtype = half_grads ? kv_dtype : MHA_DTYPE_F32;
  note(" dtypes q %s kv %s out %s dout %s grads %s", mha_types::dtype_name(q_dtype),
       mha_types::dtype_name(kv_dtype), mha_types::dtype_name(out_dtype),
       mha_types::dtype_name(dout_dtype), half_grads ? "as inputs" : "f32");
  mha_test::TypedCopy q_typed(q32, q_dtype), k_typed(k32, kv_dtype), v_typed(v32, kv_dtype),
      dout_typed(dout32, dout_dtype);
  mha_tensor tq = q_typed.get(), tk = k_typed.get(), tv = v_typed.get(), tdout = dout_typed.get();
  // out in its dtype in the float vector (a half tensor takes half its bytes).
  mha_tensor tout = mha_test::describe(out.data(), out_dtype, {B, H, Lq, Dv});

  params.lse = &tlse;
  if (mha_attention(&tq, &tk, &tv, &tout, &params) != MHA_OK) {
    finding(std::string("the forward failed: ") + mha_last_error());
  }
  params.lse = nullptr;

  Guarded dq(B * H * Lq * D), dk(B * hkv * Lk * D), dv(B * hkv * Lk * Dv);
  mha_tensor tdq = mha_test::describe(dq.base(), dq_dtype, {B, H, Lq, D});
  mha_tensor tdk = mha_test::describe(dk.base(), dkv_dtype, {B, hkv, Lk, D});
  mha_tensor tdv = mha_test::describe(dv.base(), dkv_dtype, {B, hkv, Lk, Dv});

  // At most one way of breaking the call.
  bool broken = true;
  mha_tensor wrong{};
  switch (breaking) {
    case 0:
      tdq.shape[3] += 1;
      note(" broken: dq's head size");
      break;
    case 1:
      tdk.shape[1] += 1;
      note(" broken: dk's KV heads");
      break;
    case 2:
      tdv = tdk;
      note(" broken: dv over dk");
      break;
    case 3:
      tlse.shape[2] += 1;
      note(" broken: lse's length");
      break;
    case 4:
      wrong = tq;
      wrong.data = nullptr;
      tq = wrong;
      note(" broken: q->data NULL");
      break;
    case 5:
      backward.struct_size = 5;
      note(" broken: backward->struct_size");
      break;
    case 6:
      tdq = tq;
      note(" broken: dq over q");
      break;
    default:
      broken = false;
  }
  if (!broken && pick >= 216) {  // 40 of 256: a gradient of a dtype it cannot have
    mha_tensor& grad = pick % 2 != 0 ? tdq : tdv;
    const mha_dtype input = pick % 2 != 0 ? q_dtype : kv_dtype;
    grad.dtype = input == MHA_DTYPE_BF16 ? MHA_DTYPE_F16 : MHA_DTYPE_BF16;
    broken = true;
    note(" broken: %s of dtype %s", pick % 2 != 0 ? "dq" : "dv", mha_types::dtype_name(grad.dtype));
  }
  const std::vector<float> dq_before = dq.all, dk_before = dk.all, dv_before = dv.all;
  const mha_status status = mha_attention_backward(&tq, &tk, &tv, &tout, &tlse, &tdout, &tdq, &tdk,
                                                   &tdv, &params, &backward);
  const std::string message = mha_last_error();
  if (broken) {
    if (status == MHA_OK) finding("backward: an invalid call was accepted");
    if (message.empty()) finding("backward: a refused call left no message");
    if (!same_bytes(dq.all, dq_before) || !same_bytes(dk.all, dk_before) ||
        !same_bytes(dv.all, dv_before)) {
      finding("backward: a refused call modified a gradient");
    }
    return 0;
  }
  if (status != MHA_OK) finding("backward: a valid call failed: " + message);
  if (changed_outside(dq, tdq, dq_before) != 0 || changed_outside(dk, tdk, dk_before) != 0 ||
      changed_outside(dv, tdv, dv_before) != 0) {
    finding("backward: written outside a gradient");
  }
  // Unless every input is F32, delta is dout · the out given (the forward's
  // rounding of a half out, or of P on avx512bf16, is not the backward's
  // error: reference_backward.h, test_backward's reference_of).
  const bool all_f32 = q_dtype == MHA_DTYPE_F32 && kv_dtype == MHA_DTYPE_F32 &&
                       out_dtype == MHA_DTYPE_F32 && dout_dtype == MHA_DTYPE_F32;
  const mha_test::BackwardReference ref = mha_test::reference_backward(
      tq, tk, tv, tdout, &params, backward.dmask != nullptr, all_f32 ? nullptr : &tout);
  const auto check = [&](const mha_tensor& got, const std::vector<double>& want, double terms,
                         const char* name) {
    const double error = mha_test::gradient_error(got, want, terms, ref.max_abs_logit);
    if (!(error <= 1.0)) {
      char text[160];
      std::snprintf(text, sizeof text, "backward: %s off by %.3g times its tolerance", name, error);
      finding(text);
    }
  };
  check(tdq, ref.dq, ref.terms_dq, "dq");
  check(tdk, ref.dk, ref.terms_dk, "dk");
  check(tdv, ref.dv, ref.terms_dv, "dv");
  return 0;
}

}  // namespace mha_fuzz
