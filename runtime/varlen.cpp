// mha_attention_varlen: a packed batch of sequences, checked once as a whole,
// then run as one B = 1 call per sequence -- views of the packed tensors, so
// every option of mha_attention applies per sequence unchanged -- with all
// the sequences' work items in one team (scheduler.h).
#include "varlen.h"

#include <limits>
#include <vector>

#include "attention.h"
#include "common/dtype.h"
#include "varlen_layout.h"

namespace mha::rt {
namespace {

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
  mha_varlen_params varlen;
  if (mha_status s = read_varlen_params(varlen_given, &varlen); s != MHA_OK) return s;
  mha_attention_params params;
  if (mha_status s = read_attention_params(params_given, &params); s != MHA_OK) return s;
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
    const bool paged = varlen.block_table != nullptr;
    const int64_t k0 = paged ? 0 : offset_at(*varlen.cu_seqlens_k, b);
    const int64_t lk = keys_used(varlen, b);
    if (lq == 0) continue;
    if (lk == 0) {
      keyless.push_back(b);
      continue;
    }
    const mha_tensor qv = sequence_view(*q, q0, lq), ov = sequence_view(*out, q0, lq);
    const mha_tensor kv = paged ? paged_view(*k, lk) : sequence_view(*k, k0, lk);
    const mha_tensor vv = paged ? paged_view(*v, lk) : sequence_view(*v, k0, lk);
    mha_attention_params sp = params;
    sp.dropout_seed = params.dropout_seed + static_cast<uint64_t>(b);
    mha_tensor lse_rows{}, alibi_row{}, k_scale_view{}, v_scale_view{};
    if (params.lse != nullptr) {
      lse_rows = lse_view(*params.lse, q0, lq);
      sp.lse = &lse_rows;
    }
    if (params.alibi_slopes != nullptr && params.alibi_slopes->ndim == 2) {  // row b of [B, H]
      alibi_row = alibi_row_view(*params.alibi_slopes, b);
      sp.alibi_slopes = &alibi_row;
    }
    if (params.k_scale != nullptr) {
      k_scale_view = scales_view(*params.k_scale, paged, k0, lk);
      v_scale_view = scales_view(*params.v_scale, paged, k0, lk);
      sp.k_scale = &k_scale_view;
      sp.v_scale = &v_scale_view;
    }
    KernelCall call;
    describe_attention(qv, kv, vv, ov, sp, &call);
    if (paged) {  // row b of the table
      const mha_tensor& table = *varlen.block_table;
      call.problem.block_table = static_cast<const int32_t*>(table.data) + b * table.strides[0];
      call.problem.block_table_stride = 0;  // (batch 0 only)
      call.problem.block_size = k->shape[1];
    }
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
