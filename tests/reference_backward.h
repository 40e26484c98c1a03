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
};

// The gradients of L = Σ dout ∘ mha_attention(q, k, v, params) for F32, BF16
// or F16 q, k, v and dout (params may be nullptr).  Dropout is modelled: the
// weights mha.h's counter-based rule drops are the forward's.
BackwardReference reference_backward(const mha_tensor& q, const mha_tensor& k, const mha_tensor& v,
                                     const mha_tensor& dout, const mha_attention_params* params,
                                     bool want_dlogit = false);

// A gradient's tolerance: 2e-5 of its largest value, plus 2^-18 (64 fp32
// ulps) of the largest sum of its terms' magnitudes -- where terms cancel
// (dS = P ∘ (dP - delta) of one key is exactly 0) fp32 leaves that much --
// and what rounding the logits to fp32 costs the weights, relatively
// (decisions.md's 4 · 2^-24 · max|logit|, twice: P and dS).
double backward_tolerance(const std::vector<double>& ref, double terms, double max_abs_logit);

// Largest |got - want| over a 4-d F32 descriptor against C-ordered values.
double max_abs_diff(const mha_tensor& got, const std::vector<double>& want);
double max_abs(const std::vector<double>& values);

}  // namespace mha_test
