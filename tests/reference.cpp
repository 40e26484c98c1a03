// The float64 reference: naive loops over the caller's descriptors, one row of
// scores at a time.  It calls no mha function (only the header's types).
#include "reference.h"

#include "reference_access.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

namespace mha_test {
using namespace reference_access;

Reference reference_attention(const mha_tensor& q, const mha_tensor& k, const mha_tensor& v,
                              const mha_attention_params* params) {
  require_tensor(q, "q", 4, 4);
  require_tensor(k, "k", 4, 4);
  require_tensor(v, "v", 4, 4);
  require(floating(q.dtype), "q must be f32, bf16 or f16");
  require((floating(k.dtype) || k.dtype == MHA_DTYPE_I8) && v.dtype == k.dtype,
          "k and v must share a floating dtype or i8");
  const int64_t batch = q.shape[0], heads = q.shape[1], lq = q.shape[2], d = q.shape[3];
  const int64_t kv_heads = k.shape[1], lk = k.shape[2], dv = v.shape[3];
  require(k.shape[0] == batch && v.shape[0] == batch, "batch sizes differ");
  require(v.shape[1] == kv_heads && heads % kv_heads == 0, "heads do not match");
  require(v.shape[2] == lk, "k and v lengths differ");
  require(k.shape[3] == d, "q and k head sizes differ");
  const int64_t group = heads / kv_heads;

  double scale = 1.0 / std::sqrt(static_cast<double>(d));
  int32_t causal = MHA_CAUSAL_NONE;
  const mha_tensor* vl = nullptr;
  const mha_tensor* mask = nullptr;
  const mha_tensor* k_scale = nullptr;
  const mha_tensor* v_scale = nullptr;
  int64_t window_left = -1, window_right = -1;
  const mha_tensor* sinks = nullptr;
  const mha_tensor* alibi = nullptr;
  double softcap = 0;
  int64_t query_offset = 0, key_offset = 0, full_lq = 0, full_lk = 0;
  // A field exists when the caller's struct is long enough to hold it.
  const auto has = [params](size_t end) { return params->struct_size >= end; };
  if (params != nullptr) {
    if (params->has_scale != 0) scale = static_cast<double>(params->scale);
    causal = params->causal;
    vl = params->valid_lens;
    mask = params->mask;
    // (Pointer fields end sizeof(void*) after their offset.)
    if (has(offsetof(mha_attention_params, v_scale) + sizeof(void*))) {
      k_scale = params->k_scale;
      v_scale = params->v_scale;
    }
    if (has(offsetof(mha_attention_params, window_right) + sizeof params->window_right)) {
      window_left = params->window_left;
      window_right = params->window_right;
    }
    if (has(offsetof(mha_attention_params, alibi_slopes) + sizeof(void*))) {
      sinks = params->sinks;
      softcap = static_cast<double>(params->softcap);
      alibi = params->alibi_slopes;
    }
    if (has(offsetof(mha_attention_params, full_lk) + sizeof params->full_lk)) {
      query_offset = params->query_offset;
      key_offset = params->key_offset;
      full_lq = params->full_lq;
      full_lk = params->full_lk;
    }
  }
  // A block of a larger problem: positions are the full problem's (query i
  // is row query_offset + i of full_lq, key j is key key_offset + j).
  if (full_lq == 0) full_lq = query_offset + lq;
  if (full_lk == 0) full_lk = key_offset + lk;
  require(query_offset >= 0 && key_offset >= 0 && query_offset + lq <= full_lq &&
              key_offset + lk <= full_lk,
          "the block does not lie inside the full problem");
  // An int8 cache: value = row scale · int8, the scales F32 [B, Hkv, Lk].
  const bool int8 = k.dtype == MHA_DTYPE_I8;
  require(!int8 || (k_scale != nullptr && v_scale != nullptr), "i8 k and v need their scales");
  const auto row_scale = [](const mha_tensor* scales, int64_t b, int64_t h, int64_t j) {
    return static_cast<double>(static_cast<const float*>(
        scales->data)[b * scales->strides[0] + h * scales->strides[1] + j * scales->strides[2]]);
  };
  require(causal == MHA_CAUSAL_NONE || causal == MHA_CAUSAL_TOP_LEFT ||
              causal == MHA_CAUSAL_BOTTOM_RIGHT,
          "unknown causal mode");
  if (vl != nullptr) {
    require_tensor(*vl, "valid_lens", 1, 2);
    require(vl->dtype == MHA_DTYPE_I32 || vl->dtype == MHA_DTYPE_I64, "valid_lens dtype");
    require(vl->shape[0] == batch && (vl->ndim == 1 || vl->shape[1] == lq), "valid_lens shape");
  }
  // Sinks F32 [H]; ALiBi slopes F32 [H] or [B, H].
  if (sinks != nullptr) {
    require_tensor(*sinks, "sinks", 1, 1);
    require(sinks->dtype == MHA_DTYPE_F32 && sinks->shape[0] == heads, "sinks: F32 [H]");
  }
  if (alibi != nullptr) {
    require_tensor(*alibi, "alibi_slopes", 1, 2);
    require(alibi->dtype == MHA_DTYPE_F32 && alibi->shape[alibi->ndim - 1] == heads &&
                (alibi->ndim == 1 || alibi->shape[0] == batch),
            "alibi_slopes: F32 [H] or [B, H]");
  }
  const auto sink_of = [sinks](int64_t h) {
    return sinks == nullptr
               ? -kInf
               : static_cast<double>(static_cast<const float*>(sinks->data)[h * sinks->strides[0]]);
  };
  const auto slope_of = [alibi](int64_t b, int64_t h) {
    if (alibi == nullptr) return 0.0;
    const int64_t at =
        (alibi->ndim == 2 ? b * alibi->strides[0] : 0) + h * alibi->strides[alibi->ndim - 1];
    return static_cast<double>(static_cast<const float*>(alibi->data)[at]);
  };

  const int64_t full[4] = {batch, heads, lq, lk};
  const MaskView mv = make_mask_view(mask, full);
  const bool bool_mask = mv.t != nullptr && mv.t->dtype == MHA_DTYPE_BOOL;
  const bool additive_mask = mv.t != nullptr && floating(mv.t->dtype);

  Reference ref;
  ref.batch = batch;
  ref.heads = heads;
  ref.lq = lq;
  ref.dv = dv;
  ref.out.assign(static_cast<size_t>(batch * heads * lq * dv), 0.0);
  ref.lse.assign(static_cast<size_t>(batch * heads * lq), -kInf);

  std::vector<double> logits(static_cast<size_t>(lk));
  std::vector<int64_t> keys;  // the keys that take part in the current row
  keys.reserve(static_cast<size_t>(lk));
  std::vector<double> acc(static_cast<size_t>(dv));
  // The current query row and its KV head's K and V rows (V times the int8
  // row scales), read into float64 once each: reading every element through
  // its descriptor in the inner loops made the reference most of the test
  // suite's time.  A K row is read when a query first sees it, a V row when
  // its key first takes part, as before (tests check that keys outside every
  // window are never read).
  std::vector<double> q_row(static_cast<size_t>(d));
  std::vector<double> k_rows(static_cast<size_t>(lk * d)), v_rows(static_cast<size_t>(lk * dv));
  std::vector<double> v_row_max(static_cast<size_t>(lk));  // largest finite |value|
  std::vector<char> k_read(static_cast<size_t>(lk)), v_read(static_cast<size_t>(lk));
  int64_t rows_of = -1;  // the (b · kv_heads + hk) whose rows are read
  const auto read_k = [&](int64_t b, int64_t hk, int64_t j) {
    if (rows_of != b * kv_heads + hk) {
      std::fill(k_read.begin(), k_read.end(), 0);
      std::fill(v_read.begin(), v_read.end(), 0);
      rows_of = b * kv_heads + hk;
    }
    if (k_read[static_cast<size_t>(j)] != 0) return;
    k_read[static_cast<size_t>(j)] = 1;
    for (int64_t c = 0; c < d; ++c) k_rows[static_cast<size_t>(j * d + c)] = at4(k, b, hk, j, c);
  };
  const auto read_v = [&](int64_t b, int64_t hk, int64_t j) {  // after read_k(b, hk, j)
    if (v_read[static_cast<size_t>(j)] != 0) return;
    v_read[static_cast<size_t>(j)] = 1;
    const double value_scale = int8 ? row_scale(v_scale, b, hk, j) : 1.0;
    double largest = 0;
    for (int64_t c = 0; c < dv; ++c) {
      const double value = value_scale * at4(v, b, hk, j, c);
      v_rows[static_cast<size_t>(j * dv + c)] = value;
      if (std::isfinite(value)) largest = std::max(largest, std::fabs(value));
    }
    v_row_max[static_cast<size_t>(j)] = largest;
  };

  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < lq; ++i) {
        for (int64_t c = 0; c < d; ++c) q_row[static_cast<size_t>(c)] = at4(q, b, h, i, c);
        // Keys [begin, end) pass the sliding window (FlashAttention-2's,
        // aligned to the bottom-right corner: i + Lk - Lq - left <= j <=
        // i + Lk - Lq + right), causality and the valid length.  A window
        // side wider than Lk + Lq cannot cut anything (and is not computed,
        // so no huge value overflows).
        // All of it on full positions: gi is the query's, keys run from
        // key_offset.
        const int64_t gi = query_offset + i, diagonal = gi + full_lk - full_lq;
        int64_t begin = 0, end = full_lk;
        if (window_left >= 0 && window_left < full_lk + full_lq)
          begin = std::max<int64_t>(0, diagonal - window_left);
        if (window_right >= 0 && window_right < full_lk + full_lq)
          end = std::max<int64_t>(0, diagonal + window_right + 1);
        if (causal == MHA_CAUSAL_TOP_LEFT) end = std::min(end, gi + 1);
        if (causal == MHA_CAUSAL_BOTTOM_RIGHT)
          end = std::min(end, std::max<int64_t>(0, diagonal + 1));
        // ... and back to this call's keys.
        begin = std::max<int64_t>(0, begin - key_offset);
        end = std::min(lk, end - key_offset);
        if (vl != nullptr) {
          const int64_t len = valid_length(vl, b, i);
          require(len >= 0 && len <= lk, "a valid length is outside [0, Lk]");
          end = std::min(end, len);
        }
        keys.clear();
        double row_max = -kInf;
        for (int64_t j = begin; j < end; ++j) {
          const int64_t mask_offset =
              b * mv.strides[0] + h * mv.strides[1] + i * mv.strides[2] + j * mv.strides[3];
          if (bool_mask && static_cast<const uint8_t*>(mv.t->data)[mask_offset] == 0) continue;
          read_k(b, hk, j);
          double dot = 0, terms = 0;
          const double* k_row = &k_rows[static_cast<size_t>(j * d)];
          for (int64_t c = 0; c < d; ++c) {
            const double product = q_row[static_cast<size_t>(c)] * k_row[c];
            dot += product;
            terms += std::fabs(product);
          }
          if (int8) {
            dot *= row_scale(k_scale, b, hk, j);
            terms *= std::fabs(row_scale(k_scale, b, hk, j));
          }
          double logit = scale * dot;
          terms *= std::fabs(scale);
          // Gemma 2's softcap, then ALiBi (FlashAttention-2's distance to the
          // bottom-right diagonal), then the mask.
          if (softcap > 0) logit = softcap * std::tanh(logit / softcap);
          if (alibi != nullptr) {
            const double bias =
                -slope_of(b, h) * static_cast<double>(std::llabs(diagonal - (key_offset + j)));
            logit += bias;
            terms += std::fabs(bias);
          }
          if (additive_mask) {
            logit += value_at(*mv.t, mask_offset);
            terms += std::fabs(value_at(*mv.t, mask_offset));
          }
          if (logit == -kInf) continue;  // -inf removes the key
          logits[static_cast<size_t>(j)] = logit;
          keys.push_back(j);
          // NaN (from NaN inputs) stays in the row and poisons it, as it should.
          if (std::isfinite(logit)) {
            row_max = std::max(row_max, logit);
            ref.max_abs_logit = std::max(ref.max_abs_logit, std::fabs(logit));
            if (std::isfinite(terms)) ref.max_score_terms = std::max(ref.max_score_terms, terms);
          } else {
            row_max = logit > 0 ? logit : std::numeric_limits<double>::quiet_NaN();
          }
        }
        // An attention sink joins the denominator without a value row.
        const double sink = sink_of(h);
        const size_t row = static_cast<size_t>((b * heads + h) * lq + i);
        if (keys.empty()) {  // zeros; lse = the sink (-inf without one)
          ref.lse[row] = sink;
          continue;
        }
        if (sink > row_max) row_max = sink;

        double sum = sink == -kInf ? 0.0 : std::exp(sink - row_max);
        std::fill(acc.begin(), acc.end(), 0.0);
        for (const int64_t j : keys) {
          const double p = std::exp(logits[static_cast<size_t>(j)] - row_max);
          sum += p;
          read_v(b, hk, j);
          const double* v_row = &v_rows[static_cast<size_t>(j * dv)];
          for (int64_t c = 0; c < dv; ++c) acc[static_cast<size_t>(c)] += p * v_row[c];
          ref.max_abs_value = std::max(ref.max_abs_value, v_row_max[static_cast<size_t>(j)]);
        }
        ref.lse[row] = row_max + std::log(sum);
        for (int64_t c = 0; c < dv; ++c) {
          const double value = acc[static_cast<size_t>(c)] / sum;
          ref.out[row * static_cast<size_t>(dv) + static_cast<size_t>(c)] = value;
          ref.max_abs_out = std::max(ref.max_abs_out, std::fabs(value));
        }
      }
    }
  }
  return ref;
}

double logit_rounding(const Reference& ref) {
  return 4.0 * std::ldexp(1.0, -24) * std::max(ref.max_abs_logit, ref.max_score_terms);
}

double tolerance(const Reference& ref) {
  return 1e-5 * std::max(1.0, ref.max_abs_out) +
         logit_rounding(ref) * std::max(1.0, ref.max_abs_value);
}

double lse_tolerance(const Reference& ref, double want) {
  return 1e-5 * std::max(1.0, std::fabs(want)) + logit_rounding(ref);
}

double tolerance(const Reference& ref, int32_t out_dtype) {
  // Rounding the output once to a half type: half an ulp, 2^-8 (bf16: 8
  // significant bits) or 2^-11 (f16: 11) of the largest value.
  const double rounding = out_dtype == MHA_DTYPE_BF16  ? std::ldexp(1.0, -8)
                          : out_dtype == MHA_DTYPE_F16 ? std::ldexp(1.0, -11)
                                                       : 0.0;
  // (An F32 output adds nothing: not even 0 · inf when an output is infinite.)
  return rounding == 0.0 ? tolerance(ref) : tolerance(ref) + rounding * ref.max_abs_out;
}

double bf16_dot_tolerance(const Reference& ref, int32_t out_dtype) {
  return tolerance(ref, out_dtype) + 4.0 * std::ldexp(1.0, -9) * ref.max_abs_value;
}

double max_abs_error(const mha_tensor& out, const Reference& ref) {
  if (out.data == nullptr || !floating(out.dtype) || out.ndim != 4 || out.shape[0] != ref.batch ||
      out.shape[1] != ref.heads || out.shape[2] != ref.lq || out.shape[3] != ref.dv) {
    return kInf;
  }
  double worst = 0;
  for (int64_t b = 0; b < ref.batch; ++b) {
    for (int64_t h = 0; h < ref.heads; ++h) {
      for (int64_t i = 0; i < ref.lq; ++i) {
        for (int64_t c = 0; c < ref.dv; ++c) {
          const double got = at4(out, b, h, i, c);
          const double want =
              ref.out[static_cast<size_t>(((b * ref.heads + h) * ref.lq + i) * ref.dv + c)];
          if (std::isnan(got) && std::isnan(want)) continue;
          if (got == want) continue;  // also equal infinities
          const double error = std::fabs(got - want);
          worst = std::max(worst, std::isnan(error) ? kInf : error);
        }
      }
    }
  }
  return worst;
}

}  // namespace mha_test
