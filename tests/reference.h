// An independent float64 reference for scaled dot-product attention.
//
// Naive loops over the caller's tensor descriptors (any strides), one row of
// scores at a time, so long sequences can be checked without an Lq x Lk matrix.
// It shares no code with the runtime or the backends.
#pragma once

#include <mha/mha.h>

#include <cstdint>
#include <string>
#include <vector>

#include "test_util.h"

namespace mha_test {

struct Reference {
  int64_t batch = 0, heads = 0, lq = 0, dv = 0;
  std::vector<double> out;   // [B, H, Lq, Dv], C order
  std::vector<double> lse;   // [B, H, Lq]; -inf for rows where no key takes part
  double max_abs_out = 0;    // max |out| over all rows
  double max_abs_logit = 0;  // max |scaled score + additive mask| over keys that take part
  // max |scale| · Σ_c |q_c · k_c| (+ |additive mask|) over keys that take
  // part: the magnitude a logit's fp32 rounding scales with.  Equal to
  // |logit| when its terms do not cancel; when they do (a logit of 0 made of
  // terms of 600), the rounding of the terms remains.
  double max_score_terms = 0;
  double max_abs_value = 0;  // max finite |v| over keys that take part
};

// Same arguments and semantics as mha_attention (params may be nullptr):
// q, k, v of any dtype mha_attention takes (bf16/f16 values exactly as
// stored, int8 times its row scale), additive masks of f32/bf16/f16.
// Dropout is not modelled here.
Reference reference_attention(const mha_tensor& q, const mha_tensor& k, const mha_tensor& v,
                              const mha_attention_params* params);

// What rounding the logits to fp32 may cost, 4 · 2^-24 · M: the decisions'
// M is max|logit|; here it is max(max|logit|, max_score_terms), the bound
// of a dot product's rounding (Higham: |fl(x·y) - x·y| <= γ_n Σ|x_i y_i|),
// which is max|logit| unless the terms of a logit cancel.
double logit_rounding(const Reference& ref);

// The tolerance of docs/decisions.md:
//   1e-5 * max(1, max|ref|) + logit_rounding(ref) * max(1, max|v|)
// The second term perturbs the weights relatively, so the output moves by
// that much times |v| (the decision's form, written for |v| <= 1, is the
// same there).
double tolerance(const Reference& ref);

// An LSE value's tolerance: 1e-5 * max(1, |want|) + logit_rounding(ref).
double lse_tolerance(const Reference& ref, double want);

// tolerance(ref) plus what rounding the output once to out_dtype costs (half
// an ulp of the largest value for BF16 and F16; nothing for F32).
double tolerance(const Reference& ref, int32_t out_dtype);

// The bf16 dot-product path (docs/decisions.md): tolerance(ref, out_dtype)
// plus 4 · 2^-9 · max|V|, what rounding P to bf16 once for P·V may cost
// (each weight moves by at most 2^-8 of itself, the denominator stays fp32:
// the output by at most 2^-8 · max|V|, half this allowance).
double bf16_dot_tolerance(const Reference& ref, int32_t out_dtype);

// Whether `backend` rounds P to bf16 for these input dtypes: a backend that
// takes bf16 dot products on this CPU (mha_backend_get_bf16_dot: avx512bf16
// unless the runtime widens bf16 here) with bf16 Q and bf16 K and V (its
// prefill layout runs Q·Kᵀ and P·V on vdpbf16ps; its decode layout, which
// widens to fp32, is held to the same allowance here unless a test says
// otherwise).
// Inline (and so emitted only where used): the reference library itself does
// not link libmha.  The reference's arithmetic shares no code with the
// runtime; only this question goes to the library.
inline bool rounds_p_to_bf16(const std::string& backend, int32_t q_dtype, int32_t kv_dtype) {
  if (q_dtype != MHA_DTYPE_BF16 || kv_dtype != MHA_DTYPE_BF16) return false;
  const std::vector<BackendEntry> backends = list_backends();
  const BackendEntry* entry = find_backend(backends, backend);
  return entry != nullptr && entry->bf16_dot;
}

// The tolerance `backend`'s result must meet for these dtypes:
// bf16_dot_tolerance where it rounds P to bf16, tolerance(ref, out_dtype)
// otherwise.
inline double tolerance_for(const std::string& backend, int32_t q_dtype, int32_t kv_dtype,
                            const Reference& ref, int32_t out_dtype) {
  return rounds_p_to_bf16(backend, q_dtype, kv_dtype) ? bf16_dot_tolerance(ref, out_dtype)
                                                      : tolerance(ref, out_dtype);
}

// Largest |out - ref| over all elements; out is an F32, BF16 or F16
// [B, H, Lq, Dv] descriptor.
// NaN in either side where the other is not NaN counts as +inf.
double max_abs_error(const mha_tensor& out, const Reference& ref);

}  // namespace mha_test
