// mha_attention_varlen_backward: a packed batch's gradients, checked once as a
// whole, then run as one B = 1 backward call per sequence -- views of the
// packed tensors, validated as mha_attention_backward's arguments -- with all
// the sequences' items in one team (backward.h).  So each sequence gets the
// bits of mha_attention_backward on it alone.
#include "varlen_backward.h"

#include <cstring>
#include <vector>

#include "backward.h"
#include "common/dtype.h"
#include "error.h"
#include "validate.h"
#include "varlen_layout.h"
#include "versioned.h"

namespace mha::rt {
namespace {

using ll = long long;

// A gradient of the packed layout: rank 3, F32 or its input's dtype, its
// input's shape.
mha_status check_gradient(const mha_tensor* t, const char* name, const mha_tensor& like,
                          const char* like_name) {
  if (mha_status s = check_tensor(t, name, 3, 3); s != MHA_OK) return s;
  if (mha_status s = check_f32_or_like(*t, name, like, like_name); s != MHA_OK) return s;
  return check_same_shape(*t, name, like, like_name);
}

// The checks that concern the packed batch as a whole (the forward's, then
// the backward's own arguments); each sequence's views are then valid by
// construction.  *batch is B.
mha_status check_varlen_backward(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                                 const mha_tensor* out, const mha_tensor* lse,
                                 const mha_tensor* dout, const mha_tensor* dq, const mha_tensor* dk,
                                 const mha_tensor* dv, const mha_varlen_params& varlen,
                                 const mha_attention_params& params,
                                 const mha_backward_params& extra, int64_t* batch) {
  if (varlen.block_table != nullptr) {
    return fail(MHA_ERR_UNSUPPORTED,
                "varlen->block_table is given: a paged KV cache has no backward pass (train on "
                "packed keys, varlen->cu_seqlens_k)");
  }
  if (mha_status s = check_tensor(lse, "lse", 2, 2); s != MHA_OK) return s;
  // The forward's checks, with the LSE given here as its LSE ([H, total_q]).
  // (check_varlen only reads it: the cast never leads to a write.)
  mha_attention_params forward = params;
  forward.lse = const_cast<mha_tensor*>(lse);  // NOLINT(cppcoreguidelines-pro-type-const-cast)
  if (mha_status s = check_varlen(q, k, v, out, varlen, forward, batch); s != MHA_OK) return s;
  if (k->dtype == MHA_DTYPE_I8) {
    return fail(MHA_ERR_UNSUPPORTED, "k and v are I8: an int8 KV cache has no backward pass");
  }
  // dout: out's shape, and out's dtypes (F32 or q's), whatever out has.
  if (mha_status s = check_tensor(dout, "dout", 3, 3); s != MHA_OK) return s;
  if (mha_status s = check_same_shape(*dout, "dout", *out, "out"); s != MHA_OK) return s;
  if (mha_status s = check_f32_or_like(*dout, "dout", *q, "q"); s != MHA_OK) return s;
  if (mha_status s = check_gradient(dq, "dq", *q, "q"); s != MHA_OK) return s;
  if (mha_status s = check_gradient(dk, "dk", *k, "k"); s != MHA_OK) return s;
  if (mha_status s = check_gradient(dv, "dv", *v, "v"); s != MHA_OK) return s;
  if (extra.dmask != nullptr) {
    return fail(MHA_ERR_INVALID_VALUE,
                "backward->dmask is given; a packed batch takes no mask, so there is no mask "
                "gradient");
  }
  if (mha_status s = check_dsinks(extra.dsinks, params.sinks, q->shape[1]); s != MHA_OK) {
    return s;
  }
  // Every output against every input and every other output.
  const mha_tensor* inputs[] = {q,
                                k,
                                v,
                                out,
                                lse,
                                dout,
                                varlen.cu_seqlens_q,
                                varlen.cu_seqlens_k,
                                varlen.seqused_k,
                                params.sinks,
                                params.alibi_slopes};
  const char* input_names[] = {"q",
                               "k",
                               "v",
                               "out",
                               "lse",
                               "dout",
                               "varlen->cu_seqlens_q",
                               "varlen->cu_seqlens_k",
                               "varlen->seqused_k",
                               "sinks",
                               "alibi_slopes"};
  constexpr int kInputs = 11;
  const mha_tensor* outputs[] = {dq, dk, dv, extra.dsinks};
  const char* output_names[] = {"dq", "dk", "dv", "backward->dsinks"};
  constexpr int kOutputs = 4;
  for (int o = 0; o < kOutputs; ++o) {
    if (outputs[o] == nullptr) continue;
    if (mha_status s = check_no_overlap(*outputs[o], output_names[o], inputs, input_names, kInputs);
        s != MHA_OK) {
      return s;
    }
    if (mha_status s = check_no_overlap(*outputs[o], output_names[o], outputs + o + 1,
                                        output_names + o + 1, kOutputs - 1 - o);
        s != MHA_OK) {
      return s;
    }
  }
  return MHA_OK;
}

// Rows [first, end) of a packed [total, heads, D] gradient set to zero.
void zero_rows(const mha_tensor& t, int64_t first, int64_t end) {
  for (int64_t r = first; r < end; ++r) {
    for (int64_t h = 0; h < t.shape[1]; ++h) {
      for (int64_t x = 0; x < t.shape[2]; ++x) {
        mha_types::store_float(t.data, t.dtype,
                               r * t.strides[0] + h * t.strides[1] + x * t.strides[2], 0.0f);
      }
    }
  }
}

// One sequence's views of the packed tensors, as the B = 1 call's arguments
// (BackwardCall keeps pointers to some of them: they live until the run ends).
struct SequenceViews {
  mha_tensor q, k, v, out, dout, dq, dk, dv, lse, alibi;
  mha_attention_params params;
};

}  // namespace

mha_status attention_varlen_backward(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                                     const mha_tensor* out, const mha_tensor* lse,
                                     const mha_tensor* dout, mha_tensor* dq, mha_tensor* dk,
                                     mha_tensor* dv, const mha_varlen_params* varlen_given,
                                     const mha_attention_params* params_given,
                                     const mha_backward_params* backward_given) {
  mha_varlen_params varlen;
  if (mha_status s = read_varlen_params(varlen_given, &varlen); s != MHA_OK) return s;
  mha_attention_params params;
  if (mha_status s = read_attention_params(params_given, &params); s != MHA_OK) return s;
  params.lse = nullptr;  // the forward's output slot; the backward reads `lse`
  mha_backward_params extra;
  mha_backward_params_init(&extra);
  if (backward_given != nullptr) {
    const mha_backward_params defaults = extra;
    if (mha_status s = read_versioned(backward_given, defaults, kBackwardParamsSizes, "backward",
                                      "mha_backward_params_init", &extra);
        s != MHA_OK) {
      return s;
    }
  }
  int64_t batch = 0;
  if (mha_status s =
          check_varlen_backward(q, k, v, out, lse, dout, dq, dk, dv, varlen, params, extra, &batch);
      s != MHA_OK) {
    return s;
  }

  // One B = 1 backward call per sequence with queries and keys.
  std::vector<SequenceViews> views;
  std::vector<BackwardCall> calls;
  views.reserve(static_cast<size_t>(batch));  // no reallocation: calls point into it
  calls.reserve(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q0 = offset_at(*varlen.cu_seqlens_q, b);
    const int64_t lq = offset_at(*varlen.cu_seqlens_q, b + 1) - q0;
    const int64_t k0 = offset_at(*varlen.cu_seqlens_k, b);
    const int64_t lk = keys_used(varlen, b);
    if (lq == 0 || lk == 0) continue;
    SequenceViews& sv = views.emplace_back();
    sv.q = sequence_view(*q, q0, lq);
    sv.k = sequence_view(*k, k0, lk);
    sv.v = sequence_view(*v, k0, lk);
    sv.out = sequence_view(*out, q0, lq);
    sv.dout = sequence_view(*dout, q0, lq);
    sv.dq = sequence_view(*dq, q0, lq);
    sv.dk = sequence_view(*dk, k0, lk);
    sv.dv = sequence_view(*dv, k0, lk);
    sv.lse = lse_view(*lse, q0, lq);
    sv.params = params;
    sv.params.dropout_seed = params.dropout_seed + static_cast<uint64_t>(b);
    if (params.alibi_slopes != nullptr && params.alibi_slopes->ndim == 2) {  // row b of [B, H]
      sv.alibi = alibi_row_view(*params.alibi_slopes, b);
      sv.params.alibi_slopes = &sv.alibi;
    }
    BackwardCall& call = calls.emplace_back();
    if (mha_status s = validate_backward(&sv.q, &sv.k, &sv.v, &sv.out, &sv.lse, &sv.dout, &sv.dq,
                                         &sv.dk, &sv.dv, &sv.params, &extra, &call);
        s != MHA_OK) {
      // The whole batch's checks above cover what a view can break; a
      // sequence refused here says which.
      const std::string why = last_error();
      return fail(s, "sequence %lld (queries %lld, keys %lld): %s", static_cast<ll>(b),
                  static_cast<ll>(lq), static_cast<ll>(lk), why.c_str());
    }
  }
  if (mha_status s = run_backward_calls(calls.data(), static_cast<int64_t>(calls.size()), batch);
      s != MHA_OK) {
    return s;
  }
  // What no item writes: zeros.
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q0 = offset_at(*varlen.cu_seqlens_q, b);
    const int64_t q1 = offset_at(*varlen.cu_seqlens_q, b + 1);
    const int64_t k0 = offset_at(*varlen.cu_seqlens_k, b);
    const int64_t k1 = offset_at(*varlen.cu_seqlens_k, b + 1);
    const int64_t used = q1 > q0 ? keys_used(varlen, b) : 0;
    if (used == 0) zero_rows(*dq, q0, q1);
    zero_rows(*dk, k0 + used, k1);
    zero_rows(*dv, k0 + used, k1);
  }
  if (calls.empty() && extra.dsinks != nullptr) {
    for (int64_t h = 0; h < extra.dsinks->shape[0]; ++h) {
      static_cast<float*>(extra.dsinks->data)[h * extra.dsinks->strides[0]] = 0.0f;
    }
  }
  return MHA_OK;
}

}  // namespace mha::rt
