// The ninth case (run_varlen_backward_case), on the bytes the module's
// forward case left: mha_attention_varlen_backward over a packed batch --
// B sequences of random query and key lengths (0 included for either,
// sometimes one with >= 1024 keys, which the backward splits into key
// chunks), GQA, D != Dv, every tensor packed token-major or head-major with
// padded rows (q, k, v and dout sometimes broadcast over the heads), q, k and
// v F32, BF16 or F16, out and dout F32 or q's dtype, each gradient F32 or its
// input's dtype in a layout of its own, the causal mode, a scale, a window,
// softcap, sinks (with dsinks), ALiBi [H] or [B, H], dropout, seqused_k.  The
// forward (mha_attention_varlen with its LSE [H, total_q]) gives out; each
// sequence's rows of dq, dk and dv are checked against the float64 backward
// reference on that sequence alone (its seed dropout_seed + b, its ALiBi
// row), the rows no query reads (keys past seqused_k[b], the keys of a
// sequence without queries, the queries of a sequence without keys) must be
// exact zeros, dsinks the sum of the sequences' reference dsinks, and nothing
// may be written outside dq, dk, dv and dsinks -- or the call is broken in
// one way (a paged cache, dmask, dsinks without sinks, a gradient of the
// wrong shape or dtype or over an input or another gradient, an LSE of the
// wrong shape, a NULL or unversioned varlen or backward, int8 K and V,
// broken offsets or seqused_k, valid_lens or a mask, a bad dout, a NULL
// gradient, a bad dsinks) and must be refused with a message and every
// gradient untouched.  Inputs are never modified.  (Read last, so that the
// corpus's earlier entries keep their meaning.)
#include "fuzz_cases.h"

#include <fuzzer/FuzzedDataProvider.h>
#include <mha/mha.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "fuzz_common.h"
#include "fuzz_packed.h"
#include "reference_backward.h"
#include "test_util.h"

namespace mha_fuzz {
namespace {

using ll = long long;

// The bytes from a tensor's first element to one past its last (padding
// included), taken before a call: an input must hold them after it.
struct InputBytes {
  const unsigned char* at = nullptr;
  std::vector<unsigned char> bytes;
  explicit InputBytes(const mha_tensor& t) {
    int64_t extent = 1;
    for (int32_t d = 0; d < t.ndim; ++d) extent += (t.shape[d] - 1) * t.strides[d];
    at = static_cast<const unsigned char*>(t.data);
    bytes.assign(at, at + extent * mha_test::element_bytes(t.dtype));
  }
  bool unchanged() const {
    return bytes.empty() || std::memcmp(at, bytes.data(), bytes.size()) == 0;
  }
};

// The bits of element (row, head, x) of a packed [total, heads, d] tensor of
// any float dtype (F32: 32 bits, BF16 and F16: 16).
uint32_t bits_at(const mha_tensor& t, int64_t row, int64_t head, int64_t x) {
  const int64_t width = mha_test::element_bytes(t.dtype);
  const int64_t e = row * t.strides[0] + head * t.strides[1] + x * t.strides[2];
  uint32_t bits = 0;
  std::memcpy(&bits, static_cast<const unsigned char*>(t.data) + e * width,
              static_cast<size_t>(width));
  return bits;
}

// Rows [first, end) of a packed gradient: the elements whose bits are not
// those of +0 (what the call writes where no query reads).
int64_t nonzero_in_rows(const mha_tensor& t, int64_t first, int64_t end) {
  int64_t bad = 0;
  for (int64_t r = first; r < end; ++r) {
    for (int64_t h = 0; h < t.shape[1]; ++h) {
      for (int64_t x = 0; x < t.shape[2]; ++x) bad += bits_at(t, r, h, x) != 0 ? 1 : 0;
    }
  }
  return bad;
}

mha_dtype other_half(mha_dtype dtype) {
  return dtype == MHA_DTYPE_BF16 ? MHA_DTYPE_F16 : MHA_DTYPE_BF16;
}

}  // namespace

int run_varlen_backward_case(FuzzedDataProvider& fdp) {
  start_case(fdp, "varlen backward: ");

  // ---- shapes: B sequences of their own lengths
  const int64_t B = fdp.ConsumeIntegralInRange<int64_t>(1, 6);
  const int64_t Hkv = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t H = Hkv * fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t D = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  const int64_t Dv = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  std::vector<int64_t> lens_q(static_cast<size_t>(B)), lens_k(static_cast<size_t>(B));
  bool long_one = false;
  for (int64_t b = 0; b < B; ++b) {
    const int kind = fdp.ConsumeIntegralInRange<int>(0, 15);
    int64_t lq = fdp.ConsumeIntegralInRange<int64_t>(0, 9);
    int64_t lk = fdp.ConsumeIntegralInRange<int64_t>(0, 9);
    if (kind >= 11) lk = fdp.ConsumeIntegralInRange<int64_t>(10, 100);  // several key tiles
    if (kind >= 13) lq = lk;                                            // self-attention
    if (kind == 15 && !long_one) {  // split into key chunks (few KV heads: few items)
      lk = fdp.ConsumeIntegralInRange<int64_t>(1024, 1300);
      lq = std::min<int64_t>(lq, 4);
      long_one = true;
    }
    lens_q[static_cast<size_t>(b)] = lq;
    lens_k[static_cast<size_t>(b)] = lk;
  }
  const PackedOffsets offsets = packed_offsets(H, Hkv, D, Dv, lens_q, lens_k);
  std::vector<int32_t> cu_q = offsets.cu_q, cu_k = offsets.cu_k;
  const int64_t total_q = offsets.total_q, total_k = offsets.total_k;

  // ---- layouts (each gradient one of its own)
  auto layout = [&](int64_t total, int64_t heads, int64_t d, bool input, const char* name) {
    const bool head_major = fdp.ConsumeBool();
    const int64_t pad = fdp.ConsumeIntegralInRange<int64_t>(0, 2);
    const bool zero_heads = input && heads > 1 && fdp.ConsumeIntegralInRange<int>(0, 7) == 0;
    note(" %s(%s pad %lld%s)", name, head_major ? "head-major" : "token-major",
         static_cast<ll>(pad), zero_heads ? " heads broadcast" : "");
    return packed_layout(total, heads, d, head_major, pad, zero_heads);
  };
  const PackedLayout lq_layout = layout(total_q, H, D, true, "q");
  const PackedLayout lk_layout = layout(total_k, Hkv, D, true, "k");
  const PackedLayout lv_layout = layout(total_k, Hkv, Dv, true, "v");
  const PackedLayout lo_layout = layout(total_q, H, Dv, false, "out");
  const PackedLayout ldo_layout = layout(total_q, H, Dv, true, "dout");
  const PackedLayout ldq_layout = layout(total_q, H, D, false, "dq");
  const PackedLayout ldk_layout = layout(total_k, Hkv, D, false, "dk");
  const PackedLayout ldv_layout = layout(total_k, Hkv, Dv, false, "dv");

  // ---- data (no specials: a backward through NaN or an infinity has no
  // reference to be held to)
  mha_test::Rng rng(fdp.ConsumeIntegral<uint64_t>());
  static const float kAmps[] = {0.5f, 1.0f, 3.0f, 8.0f};
  const float qk_amp = kAmps[fdp.ConsumeIntegralInRange<int>(0, 3)];
  std::vector<float> qb(static_cast<size_t>(lq_layout.extent)),
      kb(static_cast<size_t>(lk_layout.extent)), vb(static_cast<size_t>(lv_layout.extent)),
      dob(static_cast<size_t>(ldo_layout.extent));
  for (float& x : qb) x = rng.uniform(-qk_amp, qk_amp);
  for (float& x : kb) x = rng.uniform(-qk_amp, qk_amp);
  for (float& x : vb) x = rng.uniform();
  for (float& x : dob) x = rng.uniform();
  note(" q/k amplitude %g", static_cast<double>(qk_amp));

  // ---- dtypes
  static const mha_dtype kFloatTypes[] = {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F16};
  const mha_dtype q_dtype = kFloatTypes[fdp.ConsumeIntegralInRange<int>(0, 2)];
  const mha_dtype kv_dtype = kFloatTypes[fdp.ConsumeIntegralInRange<int>(0, 2)];
  const mha_dtype out_dtype = fdp.ConsumeBool() ? q_dtype : MHA_DTYPE_F32;
  // dout F32 or q's dtype, whatever out's (mha.h; this case found the
  // runtime refusing q's half dtype under an F32 out, since fixed).
  const mha_dtype dout_dtype = fdp.ConsumeBool() ? q_dtype : MHA_DTYPE_F32;
  const mha_dtype dq_dtype = fdp.ConsumeBool() ? q_dtype : MHA_DTYPE_F32;
  const mha_dtype dk_dtype = fdp.ConsumeBool() ? kv_dtype : MHA_DTYPE_F32;
  const mha_dtype dv_dtype = fdp.ConsumeBool() ? kv_dtype : MHA_DTYPE_F32;
  note(" dtypes q %s kv %s out %s dout %s dq %s dk %s dv %s", mha_types::dtype_name(q_dtype),
       mha_types::dtype_name(kv_dtype), mha_types::dtype_name(out_dtype),
       mha_types::dtype_name(dout_dtype), mha_types::dtype_name(dq_dtype),
       mha_types::dtype_name(dk_dtype), mha_types::dtype_name(dv_dtype));
  mha_test::TypedCopy q_typed(describe3(qb.data(), MHA_DTYPE_F32, lq_layout), q_dtype),
      k_typed(describe3(kb.data(), MHA_DTYPE_F32, lk_layout), kv_dtype),
      v_typed(describe3(vb.data(), MHA_DTYPE_F32, lv_layout), kv_dtype),
      dout_typed(describe3(dob.data(), MHA_DTYPE_F32, ldo_layout), dout_dtype);
  mha_tensor q = q_typed.get(), k = k_typed.get(), v = v_typed.get(), dout = dout_typed.get();
  // out in its dtype in a float vector (a half tensor takes half its bytes).
  std::vector<float> out_buf(static_cast<size_t>(lo_layout.extent), 0.0f);
  mha_tensor out = describe3(out_buf.data(), out_dtype, lo_layout);

  // ---- parameters
  mha_attention_params params;
  mha_attention_params_init(&params);
  params.causal = fdp.ConsumeIntegralInRange<int32_t>(0, 2);
  note(" causal %d", params.causal);
  if (fdp.ConsumeBool()) {
    static const float kScales[] = {0.01f, 0.125f, 0.5f, 1.0f};
    params.has_scale = 1;
    params.scale = kScales[fdp.ConsumeIntegralInRange<int>(0, 3)];
    note(" scale %g", static_cast<double>(params.scale));
  }
  params.window_left = fdp.ConsumeIntegralInRange<int64_t>(-1, 20);
  params.window_right = fdp.ConsumeIntegralInRange<int64_t>(-1, 20);
  if (params.window_left >= 0 || params.window_right >= 0) {
    note(" window %lld,%lld", static_cast<ll>(params.window_left),
         static_cast<ll>(params.window_right));
  }
  DrawnVariants drawn;
  draw_variants(fdp, rng, B, H, B + 1, params, drawn);
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 3) {
    static const float kDrops[] = {0.1f, 0.25f, 0.5f};
    params.dropout_p = kDrops[fdp.ConsumeIntegralInRange<int>(0, 2)];
    params.dropout_seed = fdp.ConsumeIntegral<uint64_t>();
    note(" dropout %g seed %llu", static_cast<double>(params.dropout_p),
         static_cast<unsigned long long>(params.dropout_seed));
  }
  mha_tensor tcu_q = mha_test::describe(cu_q.data(), MHA_DTYPE_I32, {B + 1});
  mha_tensor tcu_k = mha_test::describe(cu_k.data(), MHA_DTYPE_I32, {B + 1});
  mha_varlen_params varlen;
  mha_varlen_params_init(&varlen);
  varlen.cu_seqlens_q = &tcu_q;
  varlen.cu_seqlens_k = &tcu_k;
  // seqused_k: each sequence's keys in [0, its rows] (with slack, as the
  // offsets, for a broken B).
  std::vector<int32_t> used(static_cast<size_t>(B + 3), 0);
  for (int64_t b = 0; b < B; ++b) {
    used[static_cast<size_t>(b)] = static_cast<int32_t>(lens_k[static_cast<size_t>(b)]);
  }
  mha_tensor tused = mha_test::describe(used.data(), MHA_DTYPE_I32, {B});
  if (fdp.ConsumeIntegralInRange<int>(0, 2) == 2) {
    note(" seqused_k");
    for (int64_t b = 0; b < B; ++b) {
      int32_t& u = used[static_cast<size_t>(b)];
      if (fdp.ConsumeBool()) u = static_cast<int32_t>(fdp.ConsumeIntegralInRange<int64_t>(0, u));
      note(" %d", u);
    }
    varlen.seqused_k = &tused;
  }
  const auto keys_used = [&](int64_t b) {
    return varlen.seqused_k != nullptr ? static_cast<int64_t>(used[static_cast<size_t>(b)])
                                       : lens_k[static_cast<size_t>(b)];
  };

  // ---- the forward: out and the LSE [H, total_q]
  const int64_t lse_pad = fdp.ConsumeIntegralInRange<int64_t>(0, 1);
  std::vector<float> lse_buf(static_cast<size_t>(H * (total_q + lse_pad) + 2), 0.0f);
  mha_tensor lse =
      mha_test::describe(lse_buf.data(), MHA_DTYPE_F32, {H, total_q}, {total_q + lse_pad, 1});
  {
    mha_attention_params forward = params;
    forward.lse = &lse;
    if (mha_attention_varlen(&q, &k, &v, &out, &varlen, &forward) != MHA_OK) {
      finding(std::string("varlen backward: the forward failed: ") + mha_last_error());
    }
  }

  // ---- the gradients, in guarded buffers
  Guarded dq_buf(ldq_layout.extent), dk_buf(ldk_layout.extent), dv_buf(ldv_layout.extent);
  mha_tensor dq = describe3(dq_buf.base(), dq_dtype, ldq_layout);
  mha_tensor dk = describe3(dk_buf.base(), dk_dtype, ldk_layout);
  mha_tensor dv = describe3(dv_buf.base(), dv_dtype, ldv_layout);
  const int64_t dsinks_stride = fdp.ConsumeIntegralInRange<int64_t>(1, 2);
  Guarded dsinks_buf(H * dsinks_stride);
  mha_tensor dsinks = mha_test::describe(dsinks_buf.base(), MHA_DTYPE_F32, {H}, {dsinks_stride});
  mha_backward_params backward;
  mha_backward_params_init(&backward);
  if (params.sinks != nullptr && fdp.ConsumeBool()) {
    backward.dsinks = &dsinks;
    note(" dsinks");
  }
  const mha_varlen_params* varlen_arg = &varlen;
  const mha_backward_params* backward_arg = &backward;
  mha_tensor* dq_arg = &dq;
  mha_tensor* dk_arg = &dk;
  mha_tensor* dv_arg = &dv;

  // What the input tensors hold before the call (taken before a descriptor
  // is broken: a broken one may reach past its buffer).
  std::vector<InputBytes> inputs;
  for (const mha_tensor* t : {&q, &k, &v, &out, &lse, &dout}) inputs.emplace_back(*t);

  // ---- at most one way of breaking the call (none, no dropout and no
  // seqused_k where the bytes have run out: those read 0)
  std::vector<int32_t> table(static_cast<size_t>(B + 1), 0);
  std::vector<float> floats(static_cast<size_t>(4 * H + 8), 0.5f);
  std::vector<int8_t> k8, v8;
  std::vector<float> kv_scales;
  mha_tensor wrong{};
  bool expect_invalid = false, lse_null = false;
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 3) {
    const int how = fdp.ConsumeIntegralInRange<int>(0, 17);
    const int sub = fdp.ConsumeIntegralInRange<int>(0, 5);
    bool applied = true;
    mha_tensor* grads[3] = {&dq, &dk, &dv};
    mha_tensor& grad = *grads[sub % 3];
    const char* grad_name = sub % 3 == 0 ? "dq" : (sub % 3 == 1 ? "dk" : "dv");
    switch (how) {
      case 0:  // a paged cache
        wrong = mha_test::describe(table.data(), MHA_DTYPE_I32, {B, 1});
        varlen.block_table = &wrong;
        note(" broken: a block table");
        break;
      case 1:  // dmask (a packed batch has no mask)
        wrong = mha_test::describe(floats.data(), MHA_DTYPE_F32, {1, 1});
        backward.dmask = &wrong;
        note(" broken: dmask");
        break;
      case 2:  // dsinks without sinks
        backward.dsinks = &dsinks;
        params.sinks = nullptr;
        note(" broken: dsinks without sinks");
        break;
      case 3: {  // a gradient of the wrong shape
        const int axis = sub / 3 == 0 ? 0 : 1 + fdp.ConsumeIntegralInRange<int>(0, 1);
        grad.shape[axis] += grad.shape[axis] > 1 && fdp.ConsumeBool() ? -1 : 1;
        note(" broken: %s's axis %d is %lld", grad_name, axis, static_cast<ll>(grad.shape[axis]));
        break;
      }
      case 4: {  // a gradient of a dtype it cannot have
        const mha_dtype input = sub % 3 == 0 ? q_dtype : kv_dtype;
        static const mha_dtype kOthers[] = {MHA_DTYPE_I8, MHA_DTYPE_I32, MHA_DTYPE_BOOL};
        grad.dtype =
            sub / 3 == 0 ? other_half(input) : kOthers[fdp.ConsumeIntegralInRange<int>(0, 2)];
        note(" broken: %s of dtype %s", grad_name, mha_types::dtype_name(grad.dtype));
        break;
      }
      case 5: {  // a gradient over an input
        const mha_tensor* over[] = {&q, &k, &v, &out, &lse, &dout};
        static const char* const kNames[] = {"q", "k", "v", "out", "lse", "dout"};
        const int which = fdp.ConsumeIntegralInRange<int>(0, 5);
        grad.data = over[which]->data;
        note(" broken: %s over %s", grad_name, kNames[which]);
        break;
      }
      case 6:  // a gradient over another (or dsinks over a gradient)
        if (sub == 5 && params.sinks != nullptr) {
          backward.dsinks = &dsinks;
          dsinks.data = dv.data;
          note(" broken: dsinks over dv");
        } else {
          mha_tensor& other = *grads[(sub + 1) % 3];
          grad.data = other.data;
          note(" broken: %s over the next gradient", grad_name);
        }
        break;
      case 7:  // the LSE of the wrong shape
        if (sub == 0 && H != total_q) {
          lse = mha_test::describe(lse.data, MHA_DTYPE_F32, {total_q, H}, {1, total_q + lse_pad});
        } else if (sub <= 2) {
          lse.shape[1] = total_q + 1;
        } else if (sub == 3) {
          lse = mha_test::describe(lse.data, MHA_DTYPE_F32, {1, H, total_q},
                                   {0, total_q + lse_pad, 1});
        } else if (sub == 4) {
          lse.dtype = MHA_DTYPE_BF16;
        } else {
          lse.shape[0] = H + 1;
          lse.strides[0] = total_q;  // inside the buffer's slack: H·(total_q + pad) + 2
          lse.shape[1] = 1;
        }
        note(" broken: lse [%lld, %lld]%s", static_cast<ll>(lse.shape[0]),
             static_cast<ll>(lse.shape[1]), lse.ndim == 3 ? " as 3-D" : "");
        break;
      case 8:
        varlen_arg = nullptr;
        note(" broken: varlen NULL");
        break;
      case 9:
        varlen.struct_size = sub % 2 == 0 ? 0u : 12345u;
        note(" broken: varlen->struct_size %u", varlen.struct_size);
        break;
      case 10:
        backward.struct_size = sub % 2 == 0 ? 5u : 12345u;
        note(" broken: backward->struct_size %u", backward.struct_size);
        break;
      case 11: {  // int8 K and V, with their scales
        k8.assign(static_cast<size_t>(total_k * Hkv * D), 3);
        v8.assign(static_cast<size_t>(total_k * Hkv * Dv), -2);
        kv_scales.assign(static_cast<size_t>(total_k * Hkv), 0.01f);
        k = mha_test::describe(k8.data(), MHA_DTYPE_I8, {total_k, Hkv, D});
        v = mha_test::describe(v8.data(), MHA_DTYPE_I8, {total_k, Hkv, Dv});
        wrong = mha_test::describe(kv_scales.data(), MHA_DTYPE_F32, {total_k, Hkv});
        params.k_scale = &wrong;
        params.v_scale = &wrong;
        note(" broken: k and v i8");
        break;
      }
      case 12: {  // the offsets
        std::vector<int32_t>& cu = sub % 2 == 0 ? cu_q : cu_k;
        mha_tensor& tcu = sub % 2 == 0 ? tcu_q : tcu_k;
        const size_t at = fdp.ConsumeIntegralInRange<size_t>(1, static_cast<size_t>(B));
        const int kind = fdp.ConsumeIntegralInRange<int>(0, 7);
        switch (kind) {
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
            tcu.shape[0] = B + 2;
            break;
          case 4:
            tcu.dtype = MHA_DTYPE_I64;
            break;
          case 5:
            (sub % 2 == 0 ? varlen.cu_seqlens_q : varlen.cu_seqlens_k) = nullptr;
            break;
          case 6:  // beyond every total
            cu[static_cast<size_t>(B)] = std::numeric_limits<int32_t>::max();
            break;
          default:
            tcu = mha_test::describe(cu.data(), MHA_DTYPE_I32, {1, B + 1});
            break;
        }
        note(" broken: cu_seqlens_%s #%d (at %zu)", sub % 2 == 0 ? "q" : "k", kind, at);
        break;
      }
      case 13: {  // seqused_k
        const size_t b = fdp.ConsumeIntegralInRange<size_t>(0, static_cast<size_t>(B - 1));
        varlen.seqused_k = &tused;
        if (sub <= 1) {
          used[b] = static_cast<int32_t>(lens_k[b]) + 1;
        } else if (sub == 2) {
          used[b] = -1;
        } else if (sub == 3) {
          tused.shape[0] = B + 1;
        } else if (sub == 4) {
          tused.dtype = MHA_DTYPE_I64;
        } else {
          tused = mha_test::describe(used.data(), MHA_DTYPE_I32, {1, B});
        }
        note(" broken: seqused_k #%d (sequence %zu)", sub, b);
        break;
      }
      case 14:  // valid_lens or a mask (a packed batch takes neither)
        if (sub % 2 == 0) {
          wrong = mha_test::describe(used.data(), MHA_DTYPE_I32, {B});
          params.valid_lens = &wrong;
          note(" broken: valid_lens");
        } else {
          wrong = mha_test::describe(floats.data(), MHA_DTYPE_F32, {1, 1});
          params.mask = &wrong;
          note(" broken: a mask");
        }
        break;
      case 15:  // dout of a dtype it cannot have, or of the wrong shape
        if (sub <= 2) {
          dout.dtype = q_dtype == MHA_DTYPE_F32 ? MHA_DTYPE_BF16 : other_half(q_dtype);
          note(" broken: dout of dtype %s", mha_types::dtype_name(dout.dtype));
        } else {
          dout.shape[2] = Dv + 1;
          note(" broken: dout's head size %lld", static_cast<ll>(dout.shape[2]));
        }
        break;
      case 16:  // a NULL gradient, a NULL LSE, or a gradient without data
        if (sub == 5) {
          wrong = dq;
          wrong.data = nullptr;
          dq_arg = &wrong;
          note(" broken: dq->data NULL");
        } else if (sub == 4) {
          lse_null = true;
          note(" broken: lse NULL");
        } else {
          (sub % 3 == 0 ? dq_arg : (sub % 3 == 1 ? dk_arg : dv_arg)) = nullptr;
          note(" broken: %s NULL", grad_name);
        }
        break;
      default:  // dsinks of the wrong shape or dtype
        if (params.sinks == nullptr) {
          applied = false;
          break;
        }
        backward.dsinks = &dsinks;
        if (sub <= 2) {
          dsinks.shape[0] = sub == 0 ? H + 1 : H - 1;
          if (dsinks.shape[0] == 0) dsinks.shape[0] = H + 1;
        } else if (sub == 3) {
          dsinks.dtype = MHA_DTYPE_BF16;
        } else {
          dsinks = mha_test::describe(dsinks.data, MHA_DTYPE_F32, {1, H}, {H, dsinks_stride});
        }
        note(" broken: dsinks [%lld] %s%s", static_cast<ll>(dsinks.shape[0]),
             mha_types::dtype_name(dsinks.dtype), dsinks.ndim == 2 ? " 2-D" : "");
        break;
    }
    expect_invalid = applied;
  }

  // ---- the call (the offsets and lengths as the breaking left them)
  const std::vector<int32_t> cu_q_before = cu_q, cu_k_before = cu_k, used_before = used;
  const std::vector<float> sinks_before = drawn.sink_values, slopes_before = drawn.slopes;
  const std::vector<float> dq_before = dq_buf.all, dk_before = dk_buf.all, dv_before = dv_buf.all,
                           dsinks_before = dsinks_buf.all;
  const mha_status status =
      mha_attention_varlen_backward(&q, &k, &v, &out, lse_null ? nullptr : &lse, &dout, dq_arg,
                                    dk_arg, dv_arg, varlen_arg, &params, backward_arg);
  const std::string message = mha_last_error();
  bool inputs_kept = std::all_of(inputs.begin(), inputs.end(),
                                 [](const InputBytes& in) { return in.unchanged(); });
  inputs_kept = inputs_kept && same_bytes(cu_q, cu_q_before) && same_bytes(cu_k, cu_k_before) &&
                same_bytes(used, used_before) && same_bytes(drawn.sink_values, sinks_before) &&
                same_bytes(drawn.slopes, slopes_before);
  if (!inputs_kept) finding("varlen backward: an input was modified");
  if (expect_invalid) {
    if (status == MHA_OK) finding("varlen backward: an invalid call was accepted");
    if (message.empty()) finding("varlen backward: a refused call left no message");
    if (!same_bytes(dq_buf.all, dq_before) || !same_bytes(dk_buf.all, dk_before) ||
        !same_bytes(dv_buf.all, dv_before) || !same_bytes(dsinks_buf.all, dsinks_before)) {
      finding("varlen backward: a refused call modified a gradient");
    }
    return 0;
  }
  if (status != MHA_OK) finding("varlen backward: a valid call failed: " + message);
  if (changed_outside(dq_buf, dq, dq_before) != 0 || changed_outside(dk_buf, dk, dk_before) != 0 ||
      changed_outside(dv_buf, dv, dv_before) != 0) {
    finding("varlen backward: written outside a gradient");
  }
  if (backward.dsinks != nullptr ? changed_outside(dsinks_buf, dsinks, dsinks_before) != 0
                                 : !same_bytes(dsinks_buf.all, dsinks_before)) {
    finding("varlen backward: written outside dsinks");
  }

  // ---- each sequence against the reference on that sequence alone
  // Unless every input is F32, delta is dout · the out given (as
  // run_backward_case: the forward's rounding of a half out is not the
  // backward's error).
  const bool all_f32 = q_dtype == MHA_DTYPE_F32 && kv_dtype == MHA_DTYPE_F32 &&
                       out_dtype == MHA_DTYPE_F32 && dout_dtype == MHA_DTYPE_F32;
  std::vector<double> dsinks_want(static_cast<size_t>(H), 0.0);
  double dsinks_terms = 0.0, max_logit = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q0 = cu_q[static_cast<size_t>(b)], lq = lens_q[static_cast<size_t>(b)];
    const int64_t k0 = cu_k[static_cast<size_t>(b)], rows = lens_k[static_cast<size_t>(b)];
    const int64_t lk = keys_used(b);
    const int64_t reads = lq > 0 ? lk : 0;  // the keys some query reads
    note(" [sequence %lld]", static_cast<ll>(b));
    if (nonzero_in_rows(dk, k0 + reads, k0 + rows) != 0 ||
        nonzero_in_rows(dv, k0 + reads, k0 + rows) != 0) {
      finding("varlen backward: a key row no query reads has a non-zero gradient");
    }
    if (lq == 0) continue;
    if (lk == 0) {
      if (nonzero_in_rows(dq, q0, q0 + lq) != 0) {
        finding("varlen backward: a sequence without keys has a non-zero dq");
      }
      continue;
    }
    mha_attention_params alone = params;
    alone.dropout_seed = params.dropout_seed + static_cast<uint64_t>(b);
    mha_tensor slope_row{};
    if (drawn.alibi_per_sequence) {
      slope_row = mha_test::describe(drawn.slopes.data() + b * H, MHA_DTYPE_F32, {H});
      alone.alibi_slopes = &slope_row;
    }
    const mha_tensor out_alone = sequence_of(out, q0, lq);
    const mha_test::BackwardReference ref = mha_test::reference_backward(
        sequence_of(q, q0, lq), sequence_of(k, k0, lk), sequence_of(v, k0, lk),
        sequence_of(dout, q0, lq), &alone, false, all_f32 ? nullptr : &out_alone);
    // fp32 flushes a weight or softcap's slope below 2^-126 (a saturated
    // cap: 4 scale e^-2|x|), which float64 keeps; where the whole gradient
    // is that small, so is its relative bound.  What such flushes may move
    // an element by here: dS by 2^-126 (|dP| + |delta|) <= 2^-126 · 160
    // (|dout|, |v| <= 1, Dv <= 40, dropout's 1 / (1 - p) <= 2), dscore
    // (scale <= 1, its slope flushed too) by 5 · 160 · 2^-126, dq summed
    // over <= 1300 keys of |k| <= 8 (dk over fewer rows) by < 2^23 · 2^-126.
    // 2^-100 absolute, then.
    const double underflow = std::ldexp(1.0, -100);
    const auto check = [&](const mha_tensor& got, const std::vector<double>& want, double terms,
                           const char* name) {
      const double error = mha_test::gradient_error(got, want, terms, ref.max_abs_logit, underflow);
      if (!(error <= 1.0)) {
        char text[200];
        std::snprintf(text, sizeof text,
                      "varlen backward: sequence %lld's %s off by %.3g times its tolerance",
                      static_cast<ll>(b), name, error);
        finding(text);
      }
    };
    // (product_terms_*: the short sequences here often have one key and one
    // query row, where dS is dP's rounding alone -- reference_backward.h.)
    check(sequence_of(dq, q0, lq), ref.dq, ref.product_terms_dq, "dq");
    check(sequence_of(dk, k0, lk), ref.dk, ref.product_terms_dk, "dk");
    check(sequence_of(dv, k0, lk), ref.dv, ref.product_terms_dv, "dv");
    for (size_t h = 0; h < ref.dsinks.size(); ++h) dsinks_want[h] += ref.dsinks[h];
    dsinks_terms += ref.product_terms_dsinks;
    max_logit = std::max(max_logit, ref.max_abs_logit);
  }
  if (backward.dsinks != nullptr) {
    // dsinks[h] = -sum over rows of P_sink · delta, each P_sink an fp32
    // exp(sink - lse) that is 0 (or subnormal) below 2^-126, where float64
    // still has a value (a sink 1e4 below the logits: 1e-97): so each row
    // may be off by 2^-126 · |delta|, and |delta| = |dout · out| <= 2 Dv
    // (|dout| <= 1, |out| <= 2 with dropout's 1 / (1 - p)).  The relative
    // bound holds everywhere else.
    const double underflow =
        static_cast<double>(total_q) * 2.0 * static_cast<double>(Dv) * std::ldexp(1.0, -126);
    const double tol =
        mha_test::gradient_tolerance(dsinks_want, dsinks_terms, max_logit) + underflow;
    for (int64_t h = 0; h < H; ++h) {
      const double got = static_cast<double>(dsinks_buf.base()[h * dsinks_stride]);
      const double want = dsinks_want[static_cast<size_t>(h)];
      if (!(std::fabs(got - want) <= tol)) {
        char text[200];
        std::snprintf(text, sizeof text,
                      "varlen backward: dsinks[%lld] = %.9g, reference %.9g (tolerance %.3g)",
                      static_cast<ll>(h), got, want, tol);
        finding(text);
      }
    }
  }
  return 0;
}

}  // namespace mha_fuzz
