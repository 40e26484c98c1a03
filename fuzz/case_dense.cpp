// The first case (run_case): mha_attention on 4-D tensors.
//
// The fuzzer's bytes choose a problem -- shapes (dims up to 9, head sizes up to
// 40, and sometimes a key range long enough for split-KV), memory layouts
// ([B,H,L,D], [B,L,H,D], others, padded rows, zero strides that broadcast an
// input, arbitrary strides on dimensions of size 1), a mask (bool, or additive
// with -inf, NaN, +inf, ±1e4), valid lengths (per batch or per query, i32 or
// i64, sometimes out of range), the causal mode, the scale, a sliding window,
// a softcap, sinks and ALiBi slopes, whether the LSE is wanted, the backend
// and the thread count -- and the data, with NaN, ±Inf,
// zeros and subnormals planted anywhere (row padding included).  Some inputs
// then break the call in one way that must be refused (stride-0 giants among
// them: a head size or key length past the limits); some split the keys
// into parts and merge them with mha_merge_partials.
//
// A call that must be valid has to succeed and match the float64 reference
// within mha_test::tolerance (NaN where the reference has NaN, the same
// infinities), write nothing but out and lse, and leave the inputs alone.  A
// call that must be refused has to return an error and leave every buffer as
// it was.  Anything else aborts with a description of the case.
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
#include "reference.h"
#include "test_util.h"

namespace mha_fuzz {

int run_case(FuzzedDataProvider& fdp) {
  const std::string backend = start_case(fdp, "");

  // ---- shapes
  const int64_t B = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t Hkv = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t H = Hkv * fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int length_kind = fdp.ConsumeIntegralInRange<int>(0, 15);
  int64_t Lq = fdp.ConsumeIntegralInRange<int64_t>(1, 9);
  int64_t Lk = fdp.ConsumeIntegralInRange<int64_t>(1, 9);
  if (length_kind >= 10) Lk = fdp.ConsumeIntegralInRange<int64_t>(10, 140);  // several key tiles
  if (length_kind == 15) {  // long enough for the runtime to split the keys (split-KV)
    Lk = fdp.ConsumeIntegralInRange<int64_t>(1024, 1300);
    Lq = std::min<int64_t>(Lq, 3);
  }
  const int64_t D = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  const int64_t Dv = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  note(" B=%lld H=%lld Hkv=%lld Lq=%lld Lk=%lld D=%lld Dv=%lld", static_cast<long long>(B),
       static_cast<long long>(H), static_cast<long long>(Hkv), static_cast<long long>(Lq),
       static_cast<long long>(Lk), static_cast<long long>(D), static_cast<long long>(Dv));

  // mode 0: one call; 1: the keys split into parts, merged by mha_merge_partials
  const bool merge_mode = fdp.ConsumeIntegralInRange<int>(0, 7) == 0 && Lk >= 2;

  // ---- layouts
  const int64_t q_shape[4] = {B, H, Lq, D}, k_shape[4] = {B, Hkv, Lk, D},
                v_shape[4] = {B, Hkv, Lk, Dv}, o_shape[4] = {B, H, Lq, Dv};
  auto input_layout = [&](const int64_t shape[4], const char* name) {
    const int order = fdp.ConsumeIntegralInRange<int>(0, kOrderCount - 1);
    const int64_t pad = fdp.ConsumeIntegralInRange<int64_t>(0, 3);
    // Zero strides broadcast an input: rarely, and never the sequence axis of
    // k and v in merge mode (the parts are slices along it).
    unsigned zero =
        fdp.ConsumeIntegralInRange<int>(0, 3) == 0 ? fdp.ConsumeIntegral<uint8_t>() & 15u : 0u;
    if (merge_mode) zero &= ~4u;
    const bool odd = fdp.ConsumeBool();
    note(" %s(order %d pad %lld zero-strides %x%s)", name, order, static_cast<long long>(pad), zero,
         odd ? " odd-unit-strides" : "");
    return make_layout(shape, order, pad, zero, odd);
  };
  const Layout lq_layout = input_layout(q_shape, "q");
  const Layout lk_layout = input_layout(k_shape, "k");
  const Layout lv_layout = input_layout(v_shape, "v");
  const int out_order = fdp.ConsumeIntegralInRange<int>(0, kOrderCount - 1);
  const int64_t out_pad = fdp.ConsumeIntegralInRange<int64_t>(0, 2);
  const Layout lo_layout = make_layout(o_shape, out_order, out_pad, 0u, fdp.ConsumeBool());
  note(" out(order %d pad %lld)", out_order, static_cast<long long>(out_pad));

  // ---- data
  mha_test::Rng rng(fdp.ConsumeIntegral<uint64_t>());
  static const float kAmps[] = {0.5f, 1.0f, 3.0f, 30.0f};
  const float qk_amp = kAmps[fdp.ConsumeIntegralInRange<int>(0, 3)];
  std::vector<float> qb(static_cast<size_t>(lq_layout.extent)),
      kb(static_cast<size_t>(lk_layout.extent)), vb(static_cast<size_t>(lv_layout.extent));
  for (float& x : qb) x = rng.uniform(-qk_amp, qk_amp);
  for (float& x : kb) x = rng.uniform(-qk_amp, qk_amp);
  for (float& x : vb) x = rng.uniform();
  note(" q/k amplitude %g", static_cast<double>(qk_amp));

  // ---- mask
  const int mask_kind = merge_mode ? 0 : fdp.ConsumeIntegralInRange<int>(0, 2);
  std::vector<uint8_t> mask_bool;
  std::vector<float> mask_f32;
  mha_tensor mask{};
  if (mask_kind != 0) {
    const int32_t rank = fdp.ConsumeIntegralInRange<int32_t>(2, 4);
    const int64_t full[4] = {B, H, Lq, Lk};
    std::vector<int64_t> shape;
    for (int axis = 4 - rank; axis < 4; ++axis) shape.push_back(fdp.ConsumeBool() ? full[axis] : 1);
    std::vector<int64_t> strides = mha_test::c_strides(shape);
    const int64_t count = mha_test::element_count(shape);
    if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {  // broadcast one axis by a zero stride
      strides[fdp.ConsumeIntegralInRange<size_t>(0, shape.size() - 1)] = 0;
    }
    const int density = fdp.ConsumeIntegralInRange<int>(0, 4);  // 0: all keys masked ... 4: none
    if (mask_kind == 1) {
      mask_bool.resize(static_cast<size_t>(count));
      for (auto& m : mask_bool) {
        m = rng.integer(0, 3) < density ? static_cast<uint8_t>(rng.integer(1, 255)) : 0;
      }
      mask = mha_test::describe(mask_bool.data(), MHA_DTYPE_BOOL, shape, strides);
    } else {
      static const float kMaskValues[] = {0.0f, 0.5f, -1.0f, 2.0f, -kInf, 1e4f, -1e4f, kNaN, kInf};
      const int chaos = fdp.ConsumeIntegralInRange<int>(0, 8);  // values drawn from [0, chaos]
      mask_f32.resize(static_cast<size_t>(count));
      for (auto& m : mask_f32) {
        m = rng.integer(0, 3) < density ? kMaskValues[rng.integer(0, std::min(chaos, 3))]
                                        : kMaskValues[rng.integer(0, chaos)];
      }
      mask = mha_test::describe(mask_f32.data(), MHA_DTYPE_F32, shape, strides);
    }
    note(" mask %s rank %d density %d/4", mask_kind == 1 ? "bool" : "f32", rank, density);
  }

  // ---- valid lengths (a slack buffer: a broken shape must not make a
  // refusing runtime read outside it)
  const int lens_kind = merge_mode ? 0 : fdp.ConsumeIntegralInRange<int>(0, 2);
  const bool lens_i64 = fdp.ConsumeBool();
  bool expect_invalid = false;
  std::vector<int32_t> lens32(static_cast<size_t>(2 * (B + 1) * (Lq + 1)), 0);
  std::vector<int64_t> lens64(lens32.size(), 0);
  mha_tensor lens{};
  if (lens_kind != 0) {
    const int64_t count = lens_kind == 1 ? B : B * Lq;
    const bool transposed = lens_kind == 2 && fdp.ConsumeBool();
    const bool out_of_range = fdp.ConsumeIntegralInRange<int>(0, 15) == 0;
    for (int64_t n = 0; n < count; ++n) {
      const int64_t len = rng.integer(0, Lk);
      lens32[static_cast<size_t>(n)] = static_cast<int32_t>(len);
      lens64[static_cast<size_t>(n)] = len;
    }
    if (out_of_range) {
      const int64_t bad = fdp.ConsumeBool() ? Lk + 1 : -1;
      const size_t at = fdp.ConsumeIntegralInRange<size_t>(0, static_cast<size_t>(count - 1));
      lens32[at] = static_cast<int32_t>(bad);
      lens64[at] = bad;
      expect_invalid = true;
    }
    void* data = lens_i64 ? static_cast<void*>(lens64.data()) : static_cast<void*>(lens32.data());
    const mha_dtype dtype = lens_i64 ? MHA_DTYPE_I64 : MHA_DTYPE_I32;
    if (lens_kind == 1) {
      lens = mha_test::describe(data, dtype, {B});
    } else {
      lens = transposed ? mha_test::describe(data, dtype, {B, Lq}, {1, B})
                        : mha_test::describe(data, dtype, {B, Lq});
    }
    note(" valid_lens %s%s%s",
         lens_kind == 1 ? "per-batch" : (transposed ? "per-query/T" : "per-query"),
         lens_i64 ? "/i64" : "/i32", out_of_range ? "/out-of-range" : "");
  }

  // ---- parameters
  mha_attention_params params;
  mha_attention_params_init(&params);
  int32_t causal = merge_mode ? 0 : fdp.ConsumeIntegralInRange<int32_t>(0, 2);
  if (!merge_mode && fdp.ConsumeIntegralInRange<int>(0, 31) == 0) {
    causal = fdp.ConsumeBool() ? 3 : -1;
    expect_invalid = true;
  }
  params.causal = causal;
  if (fdp.ConsumeBool()) {
    static const float kScales[] = {1e-3f, 0.01f, 0.125f, 0.5f, 1.0f, 2.0f, 10.0f,
                                    1e3f,  -0.5f, -1e3f,  0.0f, kNaN, kInf};
    const int which = fdp.ConsumeIntegralInRange<int>(0, 12);
    params.has_scale = 1;
    params.scale = kScales[which];
    if (which >= 10) expect_invalid = true;
    note(" scale %g", static_cast<double>(params.scale));
  }
  note(" causal %d", causal);
  if (mask_kind != 0) params.mask = &mask;
  if (lens_kind != 0) params.valid_lens = &lens;
  const bool want_lse = merge_mode || fdp.ConsumeBool();
  const int64_t lse_pad = fdp.ConsumeIntegralInRange<int64_t>(0, 1);

  // ---- specials planted in the data (padding included)
  const int specials =
      fdp.ConsumeIntegralInRange<int>(0, 3) == 0 ? fdp.ConsumeIntegralInRange<int>(1, 6) : 0;
  bool v_has_inf = false;
  for (int n = 0; n < specials; ++n) {
    const int target = fdp.ConsumeIntegralInRange<int>(0, 2);
    std::vector<float>& buf = target == 0 ? qb : (target == 1 ? kb : vb);
    const size_t at = fdp.ConsumeIntegral<uint32_t>() % buf.size();
    buf[at] = special_value(fdp.ConsumeIntegral<uint8_t>());
    note(" %c[%zu] = %g", "qkv"[target], at, static_cast<double>(buf[at]));
  }
  {
    // With an infinity in q or k, a subnormal there can flush differently in
    // fp32 (a pre-scaled q) than in float64: 0 * inf is NaN but 1e-40 * inf
    // is inf.  Such pairs are not compared; make them zeros instead.
    bool qk_inf = false;
    for (const float x : qb) qk_inf = qk_inf || std::isinf(x);
    for (const float x : kb) qk_inf = qk_inf || std::isinf(x);
    if (qk_inf) {
      for (float& x : qb) x = is_subnormal(x) ? 0.0f : x;
      for (float& x : kb) x = is_subnormal(x) ? 0.0f : x;
    }
    for (const float x : vb) v_has_inf = v_has_inf || std::isinf(x);
  }

  mha_tensor q = describe4(qb.data(), MHA_DTYPE_F32, lq_layout);
  mha_tensor k = describe4(kb.data(), MHA_DTYPE_F32, lk_layout);
  mha_tensor v = describe4(vb.data(), MHA_DTYPE_F32, lv_layout);

  // ---- dtypes: Q in f32/bf16/f16, K and V in those or int8 (quantised by
  // mha_quantize_kv, which must refuse non-finite rows), an additive mask in
  // f32/bf16/f16.  The reference reads the same stored values.
  static const mha_dtype kFloatTypes[] = {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16};
  const mha_dtype q_dtype =
      merge_mode ? MHA_DTYPE_F32 : kFloatTypes[fdp.ConsumeIntegralInRange<int>(0, 2)];
  const int kv_pick = merge_mode ? 0 : fdp.ConsumeIntegralInRange<int>(0, 3);
  const mha_dtype mask_dtype = kFloatTypes[fdp.ConsumeIntegralInRange<int>(0, 2)];
  mha_test::TypedCopy q_typed(q, q_dtype);
  std::vector<mha_test::TypedCopy> kv_typed;
  std::vector<int8_t> k8, v8;
  std::vector<float> k_scales(static_cast<size_t>(B * Hkv * Lk)), v_scales(k_scales.size());
  mha_tensor k_scale{}, v_scale{};
  q = q_typed.get();
  if (kv_pick == 3) {
    // Dense int8 copies (the fuzzed layouts may broadcast, which an output
    // cannot).
    k8.assign(static_cast<size_t>(B * Hkv * Lk * D), 0);
    v8.assign(static_cast<size_t>(B * Hkv * Lk * Dv), 0);
    mha_tensor k_int8 = mha_test::describe(k8.data(), MHA_DTYPE_I8, {B, Hkv, Lk, D});
    mha_tensor v_int8 = mha_test::describe(v8.data(), MHA_DTYPE_I8, {B, Hkv, Lk, Dv});
    k_scale = mha_test::describe(k_scales.data(), MHA_DTYPE_F32, {B, Hkv, Lk});
    v_scale = mha_test::describe(v_scales.data(), MHA_DTYPE_F32, {B, Hkv, Lk});
    bool finite = true;
    for (const mha_tensor* t : {&k, &v}) {
      mha_test::for_each_offset(*t, [&](int64_t at) {
        finite = finite && std::isfinite(static_cast<const float*>(t->data)[at]);
      });
    }
    const mha_status sk = mha_quantize_kv(&k, &k_int8, &k_scale);
    const mha_status sv = mha_quantize_kv(&v, &v_int8, &v_scale);
    if (finite && (sk != MHA_OK || sv != MHA_OK)) {
      finding(std::string("mha_quantize_kv refused finite rows: ") + mha_last_error());
    }
    if (!finite && (sk == MHA_OK && sv == MHA_OK)) finding("mha_quantize_kv took a non-finite row");
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
  std::vector<mha_test::TypedCopy> mask_typed;
  if (mask_kind == 2 && mask_dtype != MHA_DTYPE_F32) {
    mask_typed.emplace_back(mask, mask_dtype);
    mask = mask_typed.back().get();
    note(" mask %s", mha_types::dtype_name(mask_dtype));
  }

  // ---- outputs
  Guarded out_buf(lo_layout.extent);
  mha_tensor out = describe4(out_buf.base(), MHA_DTYPE_F32, lo_layout);
  const int64_t lse_strides[3] = {H * (Lq + lse_pad), Lq + lse_pad, 1};
  Guarded lse_buf(B * H * (Lq + lse_pad) + 2);
  mha_tensor lse = mha_test::describe(lse_buf.base(), MHA_DTYPE_F32, {B, H, Lq},
                                      {lse_strides[0], lse_strides[1], lse_strides[2]});
  if (want_lse) params.lse = &lse;

  // ---- merge mode: the keys in parts, each its own call, merged
  if (merge_mode) {
    const int32_t parts =
        static_cast<int32_t>(std::min<int64_t>(Lk, fdp.ConsumeIntegralInRange<int>(2, 4)));
    std::vector<int64_t> cuts = {0, Lk};
    while (static_cast<int32_t>(cuts.size()) < parts + 1) {
      const int64_t cut = fdp.ConsumeIntegralInRange<int64_t>(1, Lk - 1);
      if (std::find(cuts.begin(), cuts.end(), cut) == cuts.end()) {
        cuts.push_back(cut);
      } else if (fdp.remaining_bytes() == 0) {
        break;
      }
    }
    std::sort(cuts.begin(), cuts.end());
    const int32_t n = static_cast<int32_t>(cuts.size()) - 1;
    note(" merged from %d parts", n);
    std::vector<std::vector<float>> part_out(static_cast<size_t>(n)),
        part_lse(static_cast<size_t>(n));
    std::vector<mha_tensor> outs(static_cast<size_t>(n)), lses(static_cast<size_t>(n));
    for (int32_t c = 0; c < n; ++c) {
      const int64_t a = cuts[static_cast<size_t>(c)], len = cuts[static_cast<size_t>(c) + 1] - a;
      mha_tensor kc = k, vc = v;
      kc.data = kb.data() + a * k.strides[2];
      vc.data = vb.data() + a * v.strides[2];
      kc.shape[2] = vc.shape[2] = len;
      part_out[static_cast<size_t>(c)].assign(static_cast<size_t>(B * H * Lq * Dv), kNaN);
      part_lse[static_cast<size_t>(c)].assign(static_cast<size_t>(B * H * Lq), kNaN);
      outs[static_cast<size_t>(c)] = mha_test::describe(part_out[static_cast<size_t>(c)].data(),
                                                        MHA_DTYPE_F32, {B, H, Lq, Dv});
      lses[static_cast<size_t>(c)] =
          mha_test::describe(part_lse[static_cast<size_t>(c)].data(), MHA_DTYPE_F32, {B, H, Lq});
      mha_attention_params pp = params;
      pp.lse = &lses[static_cast<size_t>(c)];
      const mha_status s = mha_attention(&q, &kc, &vc, &outs[static_cast<size_t>(c)], &pp);
      if (s != MHA_OK && !expect_invalid) {
        finding(std::string("a part's valid call failed: ") + mha_last_error());
      }
      if (s != MHA_OK) return 0;
    }
    if (expect_invalid) finding("an invalid scale was accepted");
    const std::vector<float> out_before = out_buf.all, lse_before = lse_buf.all;
    const mha_status s = mha_merge_partials(n, outs.data(), lses.data(), &out, &lse);
    if (s != MHA_OK) finding(std::string("a valid mha_merge_partials failed: ") + mha_last_error());
    if (changed_outside(out_buf, out, out_before) != 0) finding("merge wrote outside out");
    if (changed_outside(lse_buf, lse, lse_before) != 0) finding("merge wrote outside lse");
    mha_attention_params rp = params;
    rp.lse = nullptr;
    const Reference ref = mha_test::reference_attention(q, k, v, &rp);
    compare(out, static_cast<const float*>(lse.data), lse_strides, ref,
            v_has_inf && ref.max_abs_logit > 40.0, mha_test::tolerance(ref));
    return 0;
  }

  // ---- at most one way of breaking the call
  const bool broken = fdp.ConsumeIntegralInRange<int>(0, 3) == 0;
  if (broken) {
    const int how = fdp.ConsumeIntegralInRange<int>(0, 21);
    bool applied = true;
    switch (how) {
      case 0:
        q.dtype = MHA_DTYPE_I32;
        break;
      case 1:
        out.dtype = MHA_DTYPE_BOOL;
        break;
      case 2:
        k.shape[0] = B + 1;
        break;
      case 3:
        v.shape[2] = Lk + 1;
        break;
      case 4:
        out.strides[3] = -1;
        break;
      case 5:
        q.ndim = 3;
        break;
      case 6:
        params.struct_size = 12345;
        break;
      case 7:
        out.data = q.data;
        break;
      case 8: {
        int axis = -1;
        for (const int a : {2, 1, 0, 3}) {
          if (axis < 0 && out.shape[a] > 1) axis = a;
        }
        if (axis < 0)
          applied = false;
        else
          out.strides[axis] = 0;
        break;
      }
      case 9:
        if (mask_kind == 0)
          applied = false;
        else
          mask.shape[mask.ndim - 1] = Lk + 1;
        break;
      case 10:
        if (lens_kind == 0)
          applied = false;
        else
          lens.shape[0] = B + 1;
        break;
      case 11:
        if (!want_lse)
          applied = false;
        else
          lse.shape[2] = Lq + 1;
        break;
      case 12:
        k.data = nullptr;
        break;
      case 13:
        k.shape[1] = v.shape[1] = H + 1;
        break;
      case 14:
        if (mask_kind == 0)
          applied = false;
        else
          mask.dtype = MHA_DTYPE_I32;
        break;
      case 15:
        if (!want_lse)
          applied = false;
        else
          lse.data = out.data;
        break;
      case 16:
        params.dropout_p = 1.5f;
        break;
      case 17: {
        int axis = -1;
        for (const int a : {0, 2, 3}) {
          if (axis < 0 && k.shape[a] > 1) axis = a;
        }
        if (axis < 0)
          applied = false;
        else
          k.strides[axis] = std::numeric_limits<int64_t>::max();
        break;
      }
      case 18:
        q.shape[3] = D + 1;
        break;
      case 19: {
        // A stride-0 giant: Q and K broadcast along every axis with a head
        // size past MHA_MAX_HEAD_DIM (the element count stays tiny).
        const int64_t giant = fdp.ConsumeIntegralInRange<int64_t>(
            int64_t{MHA_MAX_HEAD_DIM} + 1, std::numeric_limits<int64_t>::max());
        q.shape[3] = k.shape[3] = giant;
        for (int a = 0; a < 4; ++a) q.strides[a] = k.strides[a] = 0;
        note(" D=%lld", static_cast<long long>(giant));
        break;
      }
      case 20: {
        // K and V broadcast along every axis with a key length past
        // MHA_MAX_EXTENT (up to INT64_MAX).
        const int64_t giant = fdp.ConsumeIntegralInRange<int64_t>(
            MHA_MAX_EXTENT + 1, std::numeric_limits<int64_t>::max());
        k.shape[2] = v.shape[2] = giant;
        for (int a = 0; a < 4; ++a) k.strides[a] = v.strides[a] = 0;
        note(" Lk=%lld", static_cast<long long>(giant));
        break;
      }
      default:
        params.has_scale = 1;
        params.scale = 0.0f;
        break;
    }
    if (applied) {
      expect_invalid = true;
      note(" broken by #%d", how);
    }
  }

  // ---- a sliding window (read last, so that older corpus entries, which end
  // before it, keep their meaning: no bytes left means -1, no window)
  params.window_left = fdp.ConsumeIntegralInRange<int64_t>(-1, Lk + Lq);
  params.window_right = fdp.ConsumeIntegralInRange<int64_t>(-1, Lk + Lq);
  if (params.window_left >= 0 || params.window_right >= 0) {
    note(" window %lld,%lld", static_cast<long long>(params.window_left),
         static_cast<long long>(params.window_right));
  }

  // ---- the score variants (read after the window, likewise): a softcap,
  // sinks (finite, ±1e4 or -inf), ALiBi slopes per head or per batch.
  const int variants = fdp.ConsumeIntegralInRange<int>(0, 7);
  static const float kCaps[] = {1.0f, 5.0f, 50.0f, 1e4f};
  static const float kSinks[] = {-std::numeric_limits<float>::infinity(), -1e4f, 1e4f, 0.0f};
  std::vector<float> sink_values(static_cast<size_t>(H)), slopes(static_cast<size_t>(B * H));
  mha_tensor sinks{}, alibi{};
  if (variants & 1) {
    params.softcap = kCaps[fdp.ConsumeIntegralInRange<int>(0, 3)];
    note(" softcap %g", static_cast<double>(params.softcap));
  }
  if (variants & 2) {
    for (float& x : sink_values) {
      const int pick = fdp.ConsumeIntegralInRange<int>(0, 4);
      x = pick < 4 ? kSinks[pick] : rng.uniform(-3.0f, 5.0f);
    }
    sinks = mha_test::describe(sink_values.data(), MHA_DTYPE_F32, {H});
    params.sinks = &sinks;
    note(" sinks");
  }
  if (variants & 4) {
    const bool per_batch = fdp.ConsumeBool(), zero = fdp.ConsumeIntegralInRange<int>(0, 3) == 0;
    for (float& x : slopes) x = zero ? 0.0f : rng.uniform(0.0f, 1.0f);
    alibi = per_batch ? mha_test::describe(slopes.data(), MHA_DTYPE_F32, {B, H})
                      : mha_test::describe(slopes.data(), MHA_DTYPE_F32, {H});
    params.alibi_slopes = &alibi;
    note(" alibi%s%s", per_batch ? " per batch" : "", zero ? " (slopes 0)" : "");
  }

  // ---- the call
  const std::vector<float> q_before = qb, k_before = kb, v_before = vb, mf_before = mask_f32;
  const std::vector<uint8_t> mb_before = mask_bool;
  const std::vector<int32_t> l32_before = lens32;
  const std::vector<int64_t> l64_before = lens64;
  const std::vector<float> out_before = out_buf.all, lse_before = lse_buf.all;
  Reference ref;
  if (!expect_invalid) ref = mha_test::reference_attention(q, k, v, &params);

  const mha_status status = mha_attention(&q, &k, &v, &out, &params);
  const std::string message = mha_last_error();

  if (!same_bytes(qb, q_before) || !same_bytes(kb, k_before) || !same_bytes(vb, v_before) ||
      !same_bytes(mask_f32, mf_before) || !same_bytes(mask_bool, mb_before) ||
      !same_bytes(lens32, l32_before) || !same_bytes(lens64, l64_before)) {
    finding("an input was modified");
  }
  if (!outputs_keep_contract("", status, message, expect_invalid, out_buf, out, out_before, lse_buf,
                             lse, lse_before, want_lse)) {
    return 0;
  }
  // avx512bf16 rounds P to bf16 for bf16 Q with bf16 K/V: its allowance.
  compare(out, want_lse ? static_cast<const float*>(lse.data) : nullptr, lse_strides, ref,
          v_has_inf && ref.max_abs_logit > 40.0,
          mha_test::tolerance_for(backend, q_dtype, k.dtype, ref, MHA_DTYPE_F32));
  return 0;
}

}  // namespace mha_fuzz
