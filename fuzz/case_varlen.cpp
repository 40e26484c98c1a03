// The second case (run_varlen_case), on the bytes the first case left: a
// packed variable-length batch (mha_attention_varlen): B sequences of random
// query and key lengths (0 included, sometimes long enough for several key
// tiles or split-KV), packed token-major or head-major with padded rows, Q in
// f32/bf16/f16, K and V in those or int8 (row scales [total_k, Hkv]), the
// causal mode, scale, window, softcap, sinks, ALiBi [H] or [B, H], the LSE
// [H, total_q], specials in the data -- each sequence checked against the
// reference on that sequence alone, a sequence without keys against zeros
// and its sink -- or broken in one way (offsets that do not start at 0,
// decrease, miss the total or disagree on B; wrong dtypes or ranks;
// valid_lens or a mask; a NULL or unversioned varlen; overlapping outputs;
// missing int8 scales ...) that must be refused with nothing written.  (Read
// after the first case, so that the corpus's earlier entries keep their
// meaning.)
#include "fuzz_cases.h"

#include <fuzzer/FuzzedDataProvider.h>
#include <mha/mha.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "fuzz_common.h"
#include "fuzz_packed.h"
#include "reference.h"
#include "test_util.h"

namespace mha_fuzz {

int run_varlen_case(FuzzedDataProvider& fdp) {
  const std::string backend = start_case(fdp, "varlen: ");

  // ---- shapes: B sequences of their own lengths
  const int64_t B = fdp.ConsumeIntegralInRange<int64_t>(1, 6);
  const int64_t Hkv = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t H = Hkv * fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t D = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  const int64_t Dv = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  std::vector<int64_t> lens_q(static_cast<size_t>(B)), lens_k(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int kind = fdp.ConsumeIntegralInRange<int>(0, 15);
    int64_t lq = fdp.ConsumeIntegralInRange<int64_t>(0, 9);
    int64_t lk = fdp.ConsumeIntegralInRange<int64_t>(0, 9);
    if (kind >= 11) lk = fdp.ConsumeIntegralInRange<int64_t>(10, 140);  // several key tiles
    if (kind >= 13) lq = lk;                                            // self-attention
    if (kind == 15) {                                                   // long enough for split-KV
      lk = fdp.ConsumeIntegralInRange<int64_t>(1024, 1300);
      lq = std::min<int64_t>(lq, 3);
    }
    lens_q[static_cast<size_t>(b)] = lq;
    lens_k[static_cast<size_t>(b)] = lk;
  }
  const PackedOffsets offsets = packed_offsets(H, Hkv, D, Dv, lens_q, lens_k);
  std::vector<int32_t> cu_q = offsets.cu_q, cu_k = offsets.cu_k;
  const int64_t total_q = offsets.total_q, total_k = offsets.total_k;

  // ---- layouts
  auto layout = [&](int64_t total, int64_t heads, int64_t d, bool input, const char* name) {
    const bool head_major = fdp.ConsumeBool();
    const int64_t pad = fdp.ConsumeIntegralInRange<int64_t>(0, 2);
    const bool zero_heads = input && heads > 1 && fdp.ConsumeIntegralInRange<int>(0, 7) == 0;
    note(" %s(%s pad %lld%s)", name, head_major ? "head-major" : "token-major",
         static_cast<long long>(pad), zero_heads ? " heads broadcast" : "");
    return packed_layout(total, heads, d, head_major, pad, zero_heads);
  };
  const PackedLayout lq_layout = layout(total_q, H, D, true, "q");
  const PackedLayout lk_layout = layout(total_k, Hkv, D, true, "k");
  const PackedLayout lv_layout = layout(total_k, Hkv, Dv, true, "v");
  const PackedLayout lo_layout = layout(total_q, H, Dv, false, "out");

  // ---- data, with specials planted (padding included)
  mha_test::Rng rng(fdp.ConsumeIntegral<uint64_t>());
  static const float kAmps[] = {0.5f, 1.0f, 3.0f, 30.0f};
  const float qk_amp = kAmps[fdp.ConsumeIntegralInRange<int>(0, 3)];
  std::vector<float> qb(static_cast<size_t>(lq_layout.extent)),
      kb(static_cast<size_t>(lk_layout.extent)), vb(static_cast<size_t>(lv_layout.extent));
  for (float& x : qb) x = rng.uniform(-qk_amp, qk_amp);
  for (float& x : kb) x = rng.uniform(-qk_amp, qk_amp);
  for (float& x : vb) x = rng.uniform();
  note(" q/k amplitude %g", static_cast<double>(qk_amp));
  const int specials =
      fdp.ConsumeIntegralInRange<int>(0, 3) == 0 ? fdp.ConsumeIntegralInRange<int>(1, 4) : 0;
  for (int n = 0; n < specials; ++n) {
    const int target = fdp.ConsumeIntegralInRange<int>(0, 2);
    std::vector<float>& buf = target == 0 ? qb : (target == 1 ? kb : vb);
    const size_t at = fdp.ConsumeIntegral<uint32_t>() % buf.size();
    buf[at] = special_value(fdp.ConsumeIntegral<uint8_t>());
    note(" %c[%zu] = %g", "qkv"[target], at, static_cast<double>(buf[at]));
  }
  bool v_has_inf = false;
  {
    bool qk_inf = false;  // as in run_case: no subnormals next to an infinity
    for (const float x : qb) qk_inf = qk_inf || std::isinf(x);
    for (const float x : kb) qk_inf = qk_inf || std::isinf(x);
    if (qk_inf) {
      for (float& x : qb) x = is_subnormal(x) ? 0.0f : x;
      for (float& x : kb) x = is_subnormal(x) ? 0.0f : x;
    }
    for (const float x : vb) v_has_inf = v_has_inf || std::isinf(x);
  }

  // ---- dtypes
  static const mha_dtype kFloatTypes[] = {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16};
  const mha_dtype q_dtype = kFloatTypes[fdp.ConsumeIntegralInRange<int>(0, 2)];
  const int kv_pick = fdp.ConsumeIntegralInRange<int>(0, 3);
  mha_tensor q = describe3(qb.data(), MHA_DTYPE_F32, lq_layout);
  mha_tensor k = describe3(kb.data(), MHA_DTYPE_F32, lk_layout);
  mha_tensor v = describe3(vb.data(), MHA_DTYPE_F32, lv_layout);
  mha_test::TypedCopy q_typed(q, q_dtype);
  q = q_typed.get();
  std::vector<mha_test::TypedCopy> kv_typed;
  std::vector<int8_t> k8, v8;
  std::vector<float> k_scales(static_cast<size_t>(total_k * Hkv)), v_scales(k_scales.size());
  mha_tensor k_scale{}, v_scale{};
  mha_attention_params params;
  mha_attention_params_init(&params);
  if (kv_pick == 3) {
    // Dense int8 copies [total_k, Hkv, D] and their scales [total_k, Hkv],
    // quantised through [1, Hkv, total_k, D] views.
    k8.assign(static_cast<size_t>(total_k * Hkv * D), 0);
    v8.assign(static_cast<size_t>(total_k * Hkv * Dv), 0);
    const auto as4 = [](const mha_tensor& t) {
      return mha_test::describe(t.data, static_cast<mha_dtype>(t.dtype),
                                {1, t.shape[1], t.shape[0], t.shape[2]},
                                {0, t.strides[1], t.strides[0], t.strides[2]});
    };
    mha_tensor k_int8 = mha_test::describe(k8.data(), MHA_DTYPE_I8, {total_k, Hkv, D});
    mha_tensor v_int8 = mha_test::describe(v8.data(), MHA_DTYPE_I8, {total_k, Hkv, Dv});
    k_scale = mha_test::describe(k_scales.data(), MHA_DTYPE_F32, {total_k, Hkv});
    v_scale = mha_test::describe(v_scales.data(), MHA_DTYPE_F32, {total_k, Hkv});
    const auto scale4 = [&](std::vector<float>& scales) {
      return mha_test::describe(scales.data(), MHA_DTYPE_F32, {1, Hkv, total_k}, {0, 1, Hkv});
    };
    bool finite = true;
    for (const mha_tensor* t : {&k, &v}) {
      mha_test::for_each_offset(*t, [&](int64_t at) {
        finite = finite && std::isfinite(static_cast<const float*>(t->data)[at]);
      });
    }
    mha_tensor k4 = as4(k), v4 = as4(v), k84 = as4(k_int8), v84 = as4(v_int8);
    mha_tensor ks4 = scale4(k_scales), vs4 = scale4(v_scales);
    const mha_status sk = mha_quantize_kv(&k4, &k84, &ks4);
    const mha_status sv = mha_quantize_kv(&v4, &v84, &vs4);
    if (finite && (sk != MHA_OK || sv != MHA_OK)) {
      finding(std::string("mha_quantize_kv refused finite rows: ") + mha_last_error());
    }
    if (finite) {
      k = k_int8;
      v = v_int8;
      params.k_scale = &k_scale;
      params.v_scale = &v_scale;
      note(" kv i8");
    }
  } else if (kv_pick != 0) {
    kv_typed.emplace_back(k, kFloatTypes[kv_pick]);
    kv_typed.emplace_back(v, kFloatTypes[kv_pick]);
    k = kv_typed[0].get();
    v = kv_typed[1].get();
    note(" kv %s", mha_types::dtype_name(kFloatTypes[kv_pick]));
  }
  if (q_dtype != MHA_DTYPE_F32) note(" q %s", mha_types::dtype_name(q_dtype));

  // ---- parameters
  params.causal = fdp.ConsumeIntegralInRange<int32_t>(0, 2);
  note(" causal %d", params.causal);
  bool expect_invalid = false;
  if (fdp.ConsumeBool()) {
    static const float kScales[] = {0.01f, 0.125f, 0.5f, 1.0f, 10.0f, -0.5f, 0.0f, kNaN};
    const int which = fdp.ConsumeIntegralInRange<int>(0, 7);
    params.has_scale = 1;
    params.scale = kScales[which];
    if (which >= 6) expect_invalid = true;
    note(" scale %g", static_cast<double>(params.scale));
  }
  params.window_left = fdp.ConsumeIntegralInRange<int64_t>(-1, 20);
  params.window_right = fdp.ConsumeIntegralInRange<int64_t>(-1, 20);
  if (params.window_left >= 0 || params.window_right >= 0) {
    note(" window %lld,%lld", static_cast<long long>(params.window_left),
         static_cast<long long>(params.window_right));
  }
  DrawnVariants drawn;
  draw_variants(fdp, rng, B, H, B + 1, params, drawn);

  // ---- outputs
  Guarded out_buf(lo_layout.extent);
  mha_tensor out = describe3(out_buf.base(), MHA_DTYPE_F32, lo_layout);
  const bool want_lse = fdp.ConsumeBool();
  const int64_t lse_pad = fdp.ConsumeIntegralInRange<int64_t>(0, 1);
  Guarded lse_buf(H * (total_q + lse_pad) + 2);
  mha_tensor lse =
      mha_test::describe(lse_buf.base(), MHA_DTYPE_F32, {H, total_q}, {total_q + lse_pad, 1});
  if (want_lse) params.lse = &lse;
  mha_tensor tcu_q = mha_test::describe(cu_q.data(), MHA_DTYPE_I32, {B + 1});
  mha_tensor tcu_k = mha_test::describe(cu_k.data(), MHA_DTYPE_I32, {B + 1});
  mha_varlen_params varlen;
  mha_varlen_params_init(&varlen);
  varlen.cu_seqlens_q = &tcu_q;
  varlen.cu_seqlens_k = &tcu_k;
  const mha_varlen_params* varlen_arg = &varlen;

  // ---- at most one way of breaking the call
  std::vector<int64_t> lens64(static_cast<size_t>(B + 3), 0);
  mha_tensor wrong{};
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
    const int how = fdp.ConsumeIntegralInRange<int>(0, 19);
    std::vector<int32_t>& cu = fdp.ConsumeBool() ? cu_q : cu_k;
    const char* which = &cu == &cu_q ? "q" : "k";
    const size_t at = fdp.ConsumeIntegralInRange<size_t>(1, static_cast<size_t>(B));
    bool applied = true;
    switch (how) {
      case 0:
        cu[0] = fdp.ConsumeBool() ? 1 : -1;
        break;
      case 1:  // decreasing
        cu[at] = cu[at - 1] - 1;
        break;
      case 2:  // the last offset is not the total
        cu[static_cast<size_t>(B)] += fdp.ConsumeBool() ? 1 : -1;
        break;
      case 3:  // the two disagree on B
        (&cu == &cu_q ? tcu_q : tcu_k).shape[0] = B + 2;
        break;
      case 4:
        (&cu == &cu_q ? tcu_q : tcu_k).dtype = MHA_DTYPE_I64;
        break;
      case 5:
        (&cu == &cu_q ? varlen.cu_seqlens_q : varlen.cu_seqlens_k) = nullptr;
        break;
      case 6:
        varlen_arg = nullptr;
        break;
      case 7:
        varlen.struct_size = fdp.ConsumeBool() ? 0u : 12345u;
        break;
      case 8:
        wrong = mha_test::describe(lens64.data(), MHA_DTYPE_I64, {B});
        params.valid_lens = &wrong;
        break;
      case 9:
        wrong = mha_test::describe(lens64.data(), MHA_DTYPE_BOOL, {1, 1});
        params.mask = &wrong;
        break;
      case 10:  // the LSE as [total_q, H] or one row too long
        if (want_lse && H != total_q) {
          lse.shape[0] = total_q;
          lse.shape[1] = H;
          lse.strides[0] = 1;
          lse.strides[1] = total_q;
        } else if (want_lse) {
          lse.shape[1] = total_q + 1;
        } else {
          applied = false;
        }
        break;
      case 11:
        wrong = mha_test::describe(drawn.slopes.data(), MHA_DTYPE_F32, {B + 1, H});
        params.alibi_slopes = &wrong;
        break;
      case 12:
        v.shape[0] = total_k + 1;
        break;
      case 13:
        out.data = q.data;
        break;
      case 14:
        if (params.k_scale != nullptr) {
          params.v_scale = nullptr;
        } else {
          params.k_scale = &tcu_q;
        }
        break;
      case 15:
        (&cu == &cu_q ? tcu_q : tcu_k) = mha_test::describe(cu.data(), MHA_DTYPE_I32, {1, B + 1});
        break;
      case 16:
        q = mha_test::describe(q.data, static_cast<mha_dtype>(q.dtype),
                               {1, q.shape[0], q.shape[1], q.shape[2]},
                               {0, q.strides[0], q.strides[1], q.strides[2]});
        break;
      case 17:  // offsets beyond every total
        cu[static_cast<size_t>(B)] = std::numeric_limits<int32_t>::max();
        break;
      case 18:
        if (H % (Hkv + 1) == 0) {
          applied = false;
        } else {
          k.shape[1] = v.shape[1] = Hkv + 1;
        }
        break;
      default:
        params.window_left = -2;
        break;
    }
    if (applied) {
      expect_invalid = true;
      note(" broken by #%d (cu_seqlens_%s, at %zu)", how, which, at);
    }
  }

  // ---- the call
  const std::vector<float> q_before = qb, k_before = kb, v_before = vb;
  const std::vector<int32_t> cu_q_before = cu_q, cu_k_before = cu_k;
  const std::vector<float> out_before = out_buf.all, lse_before = lse_buf.all;
  const mha_status status = mha_attention_varlen(&q, &k, &v, &out, varlen_arg, &params);
  const std::string message = mha_last_error();
  if (!same_bytes(qb, q_before) || !same_bytes(kb, k_before) || !same_bytes(vb, v_before) ||
      !same_bytes(cu_q, cu_q_before) || !same_bytes(cu_k, cu_k_before)) {
    finding("varlen: an input was modified");
  }
  if (!outputs_keep_contract("varlen: ", status, message, expect_invalid, out_buf, out, out_before,
                             lse_buf, lse, lse_before, want_lse)) {
    return 0;
  }

  // ---- each sequence against the reference on that sequence alone
  const float* lse_data = static_cast<const float*>(lse.data);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q0 = cu_q[static_cast<size_t>(b)], lq = lens_q[static_cast<size_t>(b)];
    const int64_t k0 = cu_k[static_cast<size_t>(b)], lk = lens_k[static_cast<size_t>(b)];
    if (lq == 0) continue;
    if (lk == 0) {  // zeros, LSE its sink or -inf
      for (int64_t i = q0; i < q0 + lq; ++i) {
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t c = 0; c < Dv; ++c) {
            const float got = static_cast<const float*>(
                out.data)[i * out.strides[0] + h * out.strides[1] + c * out.strides[2]];
            if (got != 0.0f) finding("varlen: a sequence without keys has a non-zero output");
          }
          if (!want_lse) continue;
          const float want =
              params.sinks != nullptr ? drawn.sink_values[static_cast<size_t>(h)] : -kInf;
          const float got = lse_data[h * lse.strides[0] + i * lse.strides[1]];
          if (!(got == want)) {  // the sinks are never NaN
            finding("varlen: a sequence without keys has an LSE other than its sink");
          }
        }
      }
      continue;
    }
    mha_attention_params alone = params;
    alone.lse = nullptr;
    mha_tensor slope_row{}, ks{}, vs{};
    if (drawn.alibi_per_sequence) {
      slope_row = mha_test::describe(drawn.slopes.data() + b * H, MHA_DTYPE_F32, {H});
      alone.alibi_slopes = &slope_row;
    }
    if (params.k_scale != nullptr) {
      ks = mha_test::describe(k_scales.data() + k0 * Hkv, MHA_DTYPE_F32, {1, Hkv, lk}, {0, 1, Hkv});
      vs = mha_test::describe(v_scales.data() + k0 * Hkv, MHA_DTYPE_F32, {1, Hkv, lk}, {0, 1, Hkv});
      alone.k_scale = &ks;
      alone.v_scale = &vs;
    }
    const Reference ref = mha_test::reference_attention(
        sequence_of(q, q0, lq), sequence_of(k, k0, lk), sequence_of(v, k0, lk), &alone);
    note(" [sequence %lld]", static_cast<long long>(b));
    const int64_t lse_strides[3] = {0, lse.strides[0], lse.strides[1]};
    compare(sequence_of(out, q0, lq), want_lse ? lse_data + q0 * lse.strides[1] : nullptr,
            lse_strides, ref, v_has_inf && ref.max_abs_logit > 40.0,
            mha_test::tolerance_for(backend, q_dtype, k.dtype, ref, MHA_DTYPE_F32));
  }
  return 0;
}

}  // namespace mha_fuzz
