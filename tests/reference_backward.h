// An independent float64 reference for the backward pass: the analytic
// gradients of mha_attention, written from the forward's definition (each
// row's weights recomputed in float64, no LSE or output taken from the
// library), one row at a time.  It shares no code with the runtime or the
// backends; tests/test_reference.cpp checks it against finite differences of
// reference_attention.
#pragma once

#include <mha/mha.h>

#include <cstdint>
#include <vector>

namespace mha_test {

struct BackwardReference {
  std::vector<double> dq;      // [B, H, Lq, D], C order
  std::vector<double> dk;      // [B, Hkv, Lk, D]
  std::vector<double> dv;      // [B, Hkv, Lk, Dv]
  std::vector<double> dsinks;  // [H] (empty without sinks)
  std::vector<double> dlogit;  // [B, H, Lq, Lk] dL/dlogit (only when asked for)
  double max_abs_logit = 0;    // over the pairs that take part
  // Per gradient, the largest sum of its terms' magnitudes over its elements
  // (dS = P ∘ (Z ∘ dP - delta) counted as P · (|Z ∘ dP| + |delta|)): what
  // fp32 rounding scales with where the terms cancel (one key: dS is 0, made
  // of terms near 1).
  double terms_dq = 0, terms_dk = 0, terms_dv = 0, terms_dsinks = 0, terms_dlogit = 0;
  // The same sums with each dP_j = dO · V_j (and delta through it) counted by
  // its products' magnitudes, Σ_c |dO_c V_jc|, not by |dP_j|: fp32 rounds dP
  // relative to its products, so where dP itself cancels (one key and few
  // rows: dS = P (dP - delta) is rounding alone, dq exactly 0) terms_* can be
  // 10 times too tight.  Never smaller than terms_*.  (The fuzzer's packed
  // backward case uses these; the other callers keep terms_*.)
  double product_terms_dq = 0, product_terms_dk = 0, product_terms_dv = 0, product_terms_dsinks = 0;
  // With InputErrors: per element of each gradient (C order, as dq, dk, dv,
  // dsinks), the first-order bound of how far those input errors move it
  // (empty without them).
  std::vector<double> propagated_dq, propagated_dk, propagated_dv, propagated_dsinks;
};

// Absolute error bounds of the inputs, element by element, C order of q's,
// k's, v's and dout's shapes: what a caller that computed them in fp32 may
// have left (the module's projections, whose sums can cancel: a projected
// value far smaller than the magnitudes it was summed from carries an error
// relative to those magnitudes, not to itself).  reference_backward then
// bounds, to first order, how far they move each gradient:
//   s_j = q·k_j (one row i), δs_j = Σ_c δq_c |k_jc| + |q_c| δk_jc;
//   logit x_j: δx_j = |dx_j/ds_j| δs_j;  weights: δP_j = P_j (δx_j + Σ_l P_l δx_l);
//   dP_j = dout·v_j: δdP_j = Σ_c δdout_c |v_jc| + |dout_c| δv_jc;
//   delta = Σ_j P_j Z_j dP_j: δdelta = Σ_j Z_j (δP_j |dP_j| + P_j δdP_j)
//     (given out: Σ_c δdout_c |out_c|);
//   dS_j = P_j (Z_j dP_j - delta): δdS_j = δP_j |Z_j dP_j - delta| + P_j (Z_j δdP_j + δdelta);
//   dscore_j = dS_j · dx_j/ds_j, the slope's own change under a softcap at
//     most scale²/softcap · δs_j;
// and the chain rule's products (dq = Σ_j dscore_j k_j, dk_j = Σ_i dscore_ij q_i,
// dv_j = Σ_i P_ij Z_ij dout_i, dsinks = -Σ_i P_sink delta) term by term.
struct InputErrors {
  std::vector<double> q, k, v, dout;
};

// The gradients of L = Σ dout ∘ mha_attention(q, k, v, params) for F32, BF16
// or F16 q, k, v and dout (params may be nullptr).  Dropout is modelled: the
// weights mha.h's counter-based rule drops are the forward's.
//
// out: nullptr, or the forward's output as it is handed to the backward.
// Each row's delta = Σ_j P_j Z_j dP_j equals dout · out for the exact out;
// mha_attention_backward computes it from the out it is given (FlashAttention
// -2's rule), so a half-precision out -- rounded by the forward, 2^-8 of
// each value for bf16 -- moves delta by far more than fp32 does.  Given out,
// delta is dout · out from those values, as the backward defines it, and
// only the backward's own error is left to the tolerance.
BackwardReference reference_backward(const mha_tensor& q, const mha_tensor& k, const mha_tensor& v,
                                     const mha_tensor& dout, const mha_attention_params* params,
                                     bool want_dlogit = false, const mha_tensor* out = nullptr,
                                     const InputErrors* input_errors = nullptr);

// The largest |gradient - reference| an fp32 backward may leave:
//   2e-5 · max|ref| + 2^-18 · terms + 8 · 2^-24 · max|logit| · terms:
// 2e-5 of the largest value; 64 fp32 ulps (2^-18) of the largest sum of the
// terms' magnitudes (where terms cancel -- dS = P ∘ (dP - delta) of one key
// is exactly 0 -- fp32 leaves that much); and what rounding the logits to
// fp32 costs the weights (decisions.md's 4 · 2^-24 · max|logit|, twice: P
// and dS).
double gradient_tolerance(const std::vector<double>& ref, double terms, double max_abs_logit);

// A gradient (4-d, F32, BF16 or F16) against the reference: the worst ratio
// of an element's error to its tolerance (<= 1 passes; infinite for NaN).
// An F32 element's tolerance is gradient_tolerance's fp32 bound e.  A BF16
// or F16 element is the backward's fp32 value y rounded once to nearest:
//   |round(y) - y| <= u · |y| <= u · (|ref| + e),
// u = 2^-p for p significant bits (half an ulp relative to the value, the
// worst just above a power of two): 2^-8 for bf16 (p = 8), 2^-11 for f16
// (p = 11).  Below the smallest normal the spacing is fixed and half of it
// is absolute: 2^-25 for f16 (subnormals 2^-24 apart), 2^-134 for bf16.  So
// each element may be off by e + u · (|ref| + e) + that floor -- its own
// |ref|, not the largest: a gradient rounded the wrong way (truncated, or
// twice) fails.  An infinity is right where |ref| + e reaches the dtype's
// overflow threshold (rounding to nearest gives it there).  `underflow`: an
// absolute allowance added to every element's tolerance, for a caller whose
// fp32 intermediates (weights, softcap's slope) may fall below 2^-126 where
// the whole gradient is that small (0 by default: none).
double gradient_error(const mha_tensor& got, const std::vector<double>& want, double terms,
                      double max_abs_logit, double underflow = 0.0);

// Largest |got - want| over a 4-d F32 descriptor against C-ordered values.
double max_abs_diff(const mha_tensor& got, const std::vector<double>& want);
double max_abs(const std::vector<double>& values);

}  // namespace mha_test
