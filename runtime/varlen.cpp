// mha_attention_varlen: a packed batch of sequences, checked once as a whole,
// then run as one B = 1 call per sequence -- views of the packed tensors, so
// every option of mha_attention applies per sequence unchanged -- with all
// the sequences' work items in one team (scheduler.h).
#include "varlen.h"

#include <cstring>
#include <limits>
#include <vector>

#include "attention.h"
#include "common/dtype.h"
#include "error.h"
#include "validate.h"
#include "versioned.h"

namespace mha::rt {
namespace {

using ll = long long;

int32_t offset_at(const mha_tensor& cu, int64_t b) {
  return static_cast<const int32_t*>(cu.data)[b * cu.strides[0]];
}

// cu_seqlens: I32 [B + 1], B >= 1, from 0, non-decreasing, ending at `total`
// (the rows of `rows_of`).  *batch is B (set by the first, checked by the
// second).
mha_status check_cu_seqlens(const mha_tensor* cu, const char* name, const char* rows_of,
                            int64_t total, int64_t* batch) {
  if (cu == nullptr) {
    return fail(MHA_ERR_NULL_POINTER, "varlen->%s is NULL; it must be I32 [B + 1]", name);
  }
  const std::string full = std::string("varlen->") + name;
  if (mha_status s = check_tensor(cu, full.c_str(), 1, 1); s != MHA_OK) return s;
  if (cu->dtype != MHA_DTYPE_I32) {
    return fail(MHA_ERR_INVALID_DTYPE, "%s has dtype %s; it must be i32", full.c_str(),
                dtype_name(cu->dtype));
  }
  const int64_t n = cu->shape[0];
  if (n < 2) {
    return fail(MHA_ERR_INVALID_SIZE,
                "%s has shape %s; it must be [B + 1] with at least one sequence", full.c_str(),
                shape_text(*cu).c_str());
  }
  if (*batch != 0 && n != *batch + 1) {
    return fail(MHA_ERR_SHAPE_MISMATCH,
                "%s has shape %s but varlen->cu_seqlens_q has %lld entries: both are [B + 1]",
                full.c_str(), shape_text(*cu).c_str(), static_cast<ll>(*batch) + 1);
  }
  *batch = n - 1;
  if (offset_at(*cu, 0) != 0) {
    return fail(MHA_ERR_INVALID_VALUE, "%s[0] = %d; it must be 0", full.c_str(), offset_at(*cu, 0));
  }
  for (int64_t b = 0; b + 1 < n; ++b) {
    if (offset_at(*cu, b + 1) < offset_at(*cu, b)) {
      return fail(MHA_ERR_INVALID_VALUE,
                  "%s[%lld] = %d is below %s[%lld] = %d; the offsets must not decrease",
                  full.c_str(), static_cast<ll>(b) + 1, offset_at(*cu, b + 1), name,
                  static_cast<ll>(b), offset_at(*cu, b));
    }
  }
  if (offset_at(*cu, n - 1) != total) {
    return fail(MHA_ERR_SHAPE_MISMATCH,
                "%s[%lld] = %d but %s has %lld rows; the last offset is the total", full.c_str(),
                static_cast<ll>(n - 1), offset_at(*cu, n - 1), rows_of, static_cast<ll>(total));
  }
  return MHA_OK;
}

// An int8 cache's row scales: F32 [total_k, Hkv], both, exactly when K and V
// are I8.
mha_status check_varlen_scales(const mha_attention_params& params, bool int8_kv, int64_t total_k,
                               int64_t kv_heads) {
  const mha_tensor* scales[2] = {params.k_scale, params.v_scale};
  const char* names[2] = {"k_scale", "v_scale"};
  for (int i = 0; i < 2; ++i) {
    const mha_tensor* t = scales[i];
    if (!int8_kv) {
      if (t != nullptr) {
        return fail(MHA_ERR_INVALID_VALUE,
                    "params->%s is given but k and v are not i8 (scales belong to an int8 KV "
                    "cache)",
                    names[i]);
      }
      continue;
    }
    if (t == nullptr) {
      return fail(MHA_ERR_NULL_POINTER,
                  "params->%s is NULL; k and v are i8 and need their row scales, F32 "
                  "[total_k, Hkv]",
                  names[i]);
    }
    if (mha_status s = check_tensor(t, names[i], 2, 2); s != MHA_OK) return s;
    if (mha_status s = check_f32(t, names[i]); s != MHA_OK) return s;
    if (t->shape[0] != total_k || t->shape[1] != kv_heads) {
      return fail(MHA_ERR_SHAPE_MISMATCH,
                  "%s has shape %s; it must be [total_k, Hkv] = [%lld, %lld]", names[i],
                  shape_text(*t).c_str(), static_cast<ll>(total_k), static_cast<ll>(kv_heads));
    }
  }
  return MHA_OK;
}

// Every check of mha_attention_varlen's arguments; *batch is B.
mha_status check_varlen(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                        const mha_tensor* out, const mha_varlen_params& varlen,
                        const mha_attention_params& params, int64_t* batch) {
  const mha_tensor* tensors[4] = {q, k, v, out};
  const char* names[4] = {"q", "k", "v", "out"};
  for (int i = 0; i < 4; ++i) {
    if (mha_status s = check_tensor(tensors[i], names[i], 3, 3); s != MHA_OK) return s;
  }
  if (mha_status s = check_dtypes(*q, *k, *v, *out); s != MHA_OK) return s;
  const int64_t total_q = q->shape[0], heads = q->shape[1], d = q->shape[2];
  const int64_t total_k = k->shape[0], kv_heads = k->shape[1], dv = v->shape[2];
  const struct {
    const char* what;
    const char* a;
    int64_t va;
    const char* b;
    int64_t vb;
  } agreements[] = {
      {"total_q", "q", total_q, "out", out->shape[0]},
      {"total_k", "k", total_k, "v", v->shape[0]},
      {"KV heads", "k", kv_heads, "v", v->shape[1]},
      {"heads", "q", heads, "out", out->shape[1]},
      {"head size", "q", d, "k", k->shape[2]},
      {"value head size", "v", dv, "out", out->shape[2]},
  };
  for (const auto& a : agreements) {
    if (mha_status s = check_shape_equal(a.what, a.a, a.va, a.b, a.vb); s != MHA_OK) return s;
  }
  const struct {
    const char* what;
    int64_t value;
  } head_sizes[] = {{"q->shape[2] (the head size D)", d}, {"v->shape[2] (the head size Dv)", dv}};
  for (const auto& h : head_sizes) {
    if (h.value > MHA_MAX_HEAD_DIM) {
      return fail(MHA_ERR_INVALID_SIZE, "%s = %lld exceeds MHA_MAX_HEAD_DIM = %d", h.what,
                  static_cast<ll>(h.value), MHA_MAX_HEAD_DIM);
    }
  }
  if (heads % kv_heads != 0) {
    return fail(MHA_ERR_SHAPE_MISMATCH,
                "q has %lld heads, not a multiple of the %lld KV heads of k and v",
                static_cast<ll>(heads), static_cast<ll>(kv_heads));
  }
  *batch = 0;
  if (mha_status s = check_cu_seqlens(varlen.cu_seqlens_q, "cu_seqlens_q", "q", total_q, batch);
      s != MHA_OK) {
    return s;
  }
  if (mha_status s = check_cu_seqlens(varlen.cu_seqlens_k, "cu_seqlens_k", "k", total_k, batch);
      s != MHA_OK) {
    return s;
  }

  if (mha_status s = check_call_values(params); s != MHA_OK) return s;
  if (params.valid_lens != nullptr) {
    return fail(MHA_ERR_INVALID_VALUE,
                "params->valid_lens is given; mha_attention_varlen takes each sequence's length "
                "from varlen->cu_seqlens_q and cu_seqlens_k");
  }
  if (params.mask != nullptr) {
    return fail(MHA_ERR_INVALID_VALUE,
                "params->mask is given; mha_attention_varlen takes no mask (causal, windows "
                "and the other variants apply per sequence)");
  }
  if (mha_status s = check_varlen_scales(params, k->dtype == MHA_DTYPE_I8, total_k, kv_heads);
      s != MHA_OK) {
    return s;
  }
  if (mha_status s =
          check_variants(params.sinks, params.softcap, params.alibi_slopes, *batch, heads, "");
      s != MHA_OK) {
    return s;
  }
  const mha_tensor* lse = params.lse;
  if (lse != nullptr) {
    if (mha_status s = check_tensor(lse, "lse", 2, 2); s != MHA_OK) return s;
    if (mha_status s = check_f32(lse, "lse"); s != MHA_OK) return s;
    if (lse->shape[0] != heads || lse->shape[1] != total_q) {
      return fail(MHA_ERR_SHAPE_MISMATCH,
                  "lse has shape %s; it must be [H, total_q] = [%lld, %lld]",
                  shape_text(*lse).c_str(), static_cast<ll>(heads), static_cast<ll>(total_q));
    }
  }
  // (lse last: it is checked against the others, not itself.)
  const mha_tensor* inputs[] = {q,
                                k,
                                v,
                                varlen.cu_seqlens_q,
                                varlen.cu_seqlens_k,
                                params.k_scale,
                                params.v_scale,
                                params.sinks,
                                params.alibi_slopes,
                                lse};
  const char* input_names[] = {
      "q",       "k",       "v",     "varlen->cu_seqlens_q", "varlen->cu_seqlens_k",
      "k_scale", "v_scale", "sinks", "alibi_slopes",         "lse"};
  if (mha_status s = check_no_overlap(*out, "out", inputs, input_names, 10); s != MHA_OK) return s;
  if (lse != nullptr) {
    if (mha_status s = check_no_overlap(*lse, "lse", inputs, input_names, 9); s != MHA_OK) {
      return s;
    }
  }
  return MHA_OK;
}

// Rows [first, first + rows) of a packed [total, heads, D] tensor as the
// [1, heads, rows, D] tensor of a one-sequence call.
mha_tensor sequence_view(const mha_tensor& t, int64_t first, int64_t rows) {
  mha_tensor view{};
  view.data = static_cast<char*>(t.data) + first * t.strides[0] * dtype_size(t.dtype);
  view.dtype = t.dtype;
  view.ndim = 4;
  const int64_t shape[4] = {1, t.shape[1], rows, t.shape[2]};
  const int64_t strides[4] = {0, t.strides[1], t.strides[0], t.strides[2]};
  std::memcpy(view.shape, shape, sizeof shape);
  std::memcpy(view.strides, strides, sizeof strides);
  return view;
}

// The rows of a sequence without keys: zeros, LSE its sink (or -inf).
void write_keyless_rows(const mha_tensor& out, const mha_attention_params& params, int64_t first,
                        int64_t rows) {
  const int64_t heads = out.shape[1], dv = out.shape[2];
  for (int64_t i = first; i < first + rows; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t x = 0; x < dv; ++x) {
        mha_types::store_float(out.data, out.dtype,
                               i * out.strides[0] + h * out.strides[1] + x * out.strides[2], 0.0f);
      }
      if (const mha_tensor* lse = params.lse; lse != nullptr) {
        float sink = -std::numeric_limits<float>::infinity();
        if (params.sinks != nullptr) {
          sink = static_cast<const float*>(params.sinks->data)[h * params.sinks->strides[0]];
        }
        static_cast<float*>(lse->data)[h * lse->strides[0] + i * lse->strides[1]] = sink;
      }
    }
  }
}

}  // namespace

mha_status attention_varlen(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                            mha_tensor* out, const mha_varlen_params* varlen_given,
                            const mha_attention_params* params_given) {
  if (varlen_given == nullptr) {
    return fail(MHA_ERR_NULL_POINTER,
                "varlen is NULL; it holds cu_seqlens_q and cu_seqlens_k (mha_varlen_params_init)");
  }
  mha_varlen_params varlen;
  mha_varlen_params_init(&varlen);
  {
    const mha_varlen_params defaults = varlen;
    if (mha_status s = read_versioned(varlen_given, defaults, kVarlenParamsSizes, "varlen",
                                      "mha_varlen_params_init", &varlen);
        s != MHA_OK) {
      return s;
    }
  }
  mha_attention_params params;
  mha_attention_params_init(&params);
  if (params_given != nullptr) {
    const mha_attention_params defaults = params;
    if (mha_status s = read_versioned(params_given, defaults, kAttentionParamsSizes, "params",
                                      "mha_attention_params_init", &params);
        s != MHA_OK) {
      return s;
    }
  }
  int64_t batch = 0;
  if (mha_status s = check_varlen(q, k, v, out, varlen, params, &batch); s != MHA_OK) return s;

  // One B = 1 call per sequence with queries and keys.  The views' lifetimes
  // end here; describe_attention copies what the kernels read.
  std::vector<KernelCall> calls;
  calls.reserve(static_cast<size_t>(batch));
  std::vector<int64_t> keyless;  // sequences with queries but no keys
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q0 = offset_at(*varlen.cu_seqlens_q, b);
    const int64_t lq = offset_at(*varlen.cu_seqlens_q, b + 1) - q0;
    const int64_t k0 = offset_at(*varlen.cu_seqlens_k, b);
    const int64_t lk = offset_at(*varlen.cu_seqlens_k, b + 1) - k0;
    if (lq == 0) continue;
    if (lk == 0) {
      keyless.push_back(b);
      continue;
    }
    const mha_tensor qv = sequence_view(*q, q0, lq), kv = sequence_view(*k, k0, lk);
    const mha_tensor vv = sequence_view(*v, k0, lk), ov = sequence_view(*out, q0, lq);
    mha_attention_params sp = params;
    sp.dropout_seed = params.dropout_seed + static_cast<uint64_t>(b);
    mha_tensor lse_view{}, alibi_view{}, k_scale_view{}, v_scale_view{};
    if (params.lse != nullptr) {  // [H, total_q] -> [1, H, lq]
      const mha_tensor& l = *params.lse;
      lse_view = l;
      lse_view.data = static_cast<float*>(l.data) + q0 * l.strides[1];
      lse_view.ndim = 3;
      const int64_t shape[3] = {1, l.shape[0], lq}, strides[3] = {0, l.strides[0], l.strides[1]};
      std::memcpy(lse_view.shape, shape, sizeof shape);
      std::memcpy(lse_view.strides, strides, sizeof strides);
      sp.lse = &lse_view;
    }
    if (params.alibi_slopes != nullptr && params.alibi_slopes->ndim == 2) {  // row b of [B, H]
      const mha_tensor& a = *params.alibi_slopes;
      alibi_view = a;
      alibi_view.data = static_cast<float*>(a.data) + b * a.strides[0];
      alibi_view.ndim = 1;
      alibi_view.shape[0] = a.shape[1];
      alibi_view.strides[0] = a.strides[1];
      sp.alibi_slopes = &alibi_view;
    }
    const mha_tensor* scales[2] = {params.k_scale, params.v_scale};
    mha_tensor* scale_views[2] = {&k_scale_view, &v_scale_view};
    for (int i = 0; i < 2; ++i) {
      if (scales[i] == nullptr) continue;  // [total_k, Hkv] -> [1, Hkv, lk]
      const mha_tensor& s = *scales[i];
      mha_tensor& view = *scale_views[i];
      view = s;
      view.data = static_cast<float*>(s.data) + k0 * s.strides[0];
      view.ndim = 3;
      const int64_t shape[3] = {1, s.shape[1], lk}, strides[3] = {0, s.strides[1], s.strides[0]};
      std::memcpy(view.shape, shape, sizeof shape);
      std::memcpy(view.strides, strides, sizeof strides);
    }
    sp.k_scale = params.k_scale != nullptr ? &k_scale_view : nullptr;
    sp.v_scale = params.v_scale != nullptr ? &v_scale_view : nullptr;
    KernelCall call;
    describe_attention(qv, kv, vv, ov, sp, &call);
    calls.push_back(call);
  }
  if (mha_status s = attend(calls.data(), static_cast<int64_t>(calls.size()), batch); s != MHA_OK) {
    return s;
  }
  for (const int64_t b : keyless) {
    const int64_t q0 = offset_at(*varlen.cu_seqlens_q, b);
    write_keyless_rows(*out, params, q0, offset_at(*varlen.cu_seqlens_q, b + 1) - q0);
  }
  return MHA_OK;
}

}  // namespace mha::rt
