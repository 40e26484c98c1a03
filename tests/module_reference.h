// An independent float64 reference of the multi-head attention module
// (PyTorch's nn.MultiheadAttention, d2l.ai's MultiHeadAttention), with an
// error bound for every element it computes.
//
// Naive loops over the caller's descriptors (any strides): projections, heads,
// masks in PyTorch's conventions (key_padding_mask and attn_mask bool true =
// the key is NOT used), softmax, dropout by the hash mha.h documents
// (implemented here from that text, not from the library's code), the output
// projection.  A row in which no key takes part gives zero attention output
// (mha's convention; PyTorch would give NaN).  It calls no mha function.
//
// The bound.  mha computes in fp32; the reference is exact to float64.  For
// every element the reference also propagates a first-order bound of what
// honest fp32 arithmetic can be off by (u = 2^-24, g(K) = 4·sqrt(K)·u):
//   - a K-term dot product (a projection, Q·Kᵀ, P·V, the output projection):
//     g(K)·Σ|a_k||b_k|.  This is the probabilistic bound of Higham & Mary
//     ("A new approach to probabilistic rounding error analysis", 2019) with
//     λ = 4, for any summation order: it fails with probability below
//     2·exp(-8) ≈ 7e-4 per element even when every rounding error is
//     maximal in size and independent in sign -- and Σ|a||b| already
//     over-estimates the partial sums that errors scale with (by about
//     sqrt(K) for random signs), so in practice it does not fail.  Biases and
//     the final rounding add u·|result|.
//   - a projection error δq, δk feeds the logit x = scale·q·k as
//     scale·Σ(δq|k| + |q|δk); rounding the logit (and adding a mask) in fp32
//     costs 4u·|logit|, as in the attention suite's tolerance (docs/decisions.md).
//   - the variants (mha.h's semantics: softcap, then ALiBi, then the window,
//     causal, valid-length and mask rules; the sink in the denominator):
//     softcap c = C·tanh(x/C) has the derivative 1 - tanh²(x/C) <= 1, which
//     carries x's error (δx plus its rounding, 4u·|x|) without amplifying it;
//     its own fp32 evaluation (the division, tanh, the product) adds 6u·|c|,
//     the relative error README states for the kernels' softcap (glibc's
//     tanhf, used by the weights path, is within 2 ulp).  ALiBi's bias
//     b = -slope·|i + Lk - Lq - j| (the distance is exact in fp32 up to 2^24,
//     the product is rounded once) is added before any mask: the product and
//     the sum are covered by 4u·(|c| + |b|), the magnitudes before they
//     cancel.  A sink is an fp32 input read exactly, without error of its
//     own; it is one more term of the softmax denominator.  Without variants
//     these terms are 0 and the bound is as before.
//   - softmax: δp_j ≤ p_j·(|δs_j| + Σ_k p_k|δs_k|) + p_j·u·(4 + 2|s_j - max s|)
//     (the exponent's argument and the normalisation, rounded; max s includes
//     the sink, and p the sink's share of the denominator), plus, with a
//     sink, p_j·2u·p_sink·(1 + |sink - max s|) (the sink's term of the
//     denominator, its exponent rounded);
//   - attention output o = Σ p̃_j v_j (p̃ after dropout):
//     Σ p̃_j δv_j + Σ κ_j δp_j |v_j| + g(Lk)·(Σ p̃_j|v_j| + |o|) + 1e-5·max(1, max|o|)
//     (the sum over the keys, the softmax denominator's sum),
//     κ_j = 1/(1-p) for kept weights (0 for dropped), the last term the
//     attention kernels' own tolerance (docs/decisions.md);
//   - out = Σ_e o_e W_o[n, e] + b_o[n]: Σ δo_e|W_o[n, e]| + g(E)·(Σ|o_e||W_o[n, e]|
//     + |b_o[n]|) + u·|out|.
// Second-order terms (products of two errors) are left out: they are smaller
// by a factor of about u.
#pragma once

#include <mha/mha.h>

#include "dropout_rule.h"

#include <cstdint>
#include <string>
#include <vector>

namespace mha_test {

// The module's parameters in float64, row-major; the biases are zero vectors
// when the module has none.
struct ModuleWeights {
  int64_t embed_dim = 0, num_heads = 0, query_dim = 0, key_dim = 0, value_dim = 0;
  std::vector<double> w_q, w_k, w_v, w_o;  // [E, Eq], [E, Ek], [E, Ev], [E, E]
  std::vector<double> b_q, b_k, b_v, b_o;  // [E] each
};

struct ModuleInputs {
  const mha_tensor* query = nullptr;             // F32 [B, Lq, Eq]
  const mha_tensor* key = nullptr;               // F32 [B, Lk, Ek]
  const mha_tensor* value = nullptr;             // F32 [B, Lk, Ev]
  const mha_tensor* valid_lens = nullptr;        // I32/I64 [B] or [B, Lq]
  const mha_tensor* key_padding_mask = nullptr;  // [B, Lk] BOOL (true = ignore) or F32
  const mha_tensor* attn_mask =
      nullptr;  // [Lq, Lk] or [B*H, Lq, Lk], BOOL (true = not allowed) or F32
  int32_t causal = MHA_CAUSAL_NONE;
  double dropout_p = 0.0;  // 0: no dropout (inference)
  uint64_t dropout_seed = 0;
  // The attention variants (mha.h's mha_attention_params): a sliding window
  // (-1: that side unbounded), sinks F32 [H] (-inf: none), a softcap (0:
  // off), ALiBi slopes F32 [H] or [B, H].
  int64_t window_left = -1, window_right = -1;
  const mha_tensor* sinks = nullptr;
  double softcap = 0.0;
  const mha_tensor* alibi_slopes = nullptr;
  // MHA_ACTIVATIONS_INPUT (mha.h): BF16 or F16 rounds the projections Q, K, V
  // and the heads' outputs to that dtype (through fp32, as mha rounds its
  // fp32 sums).  The bound of a rounded value: 0 where every value within
  // the bound before rounds to the same one, else the distance to the
  // farthest such rounded value.  BF16 also adds 2^-8·Σ_j p_j|v_j| to each
  // head output's bound (P rounded to bf16 for P·V, the bf16 dot path's
  // rounding), F16 2^-11·Σ_j p_j|v_j|.  F32: none of this.
  int32_t activations = MHA_DTYPE_F32;
};

struct ModuleReference {
  int64_t batch = 0, heads = 0, lq = 0, lk = 0, embed_dim = 0;
  std::vector<double> out, out_bound;          // [B, Lq, E]
  std::vector<double> concat, concat_bound;    // [B, Lq, E]: the heads' attention outputs
  std::vector<double> weights, weights_bound;  // [B, H, Lq, Lk], after dropout
  std::vector<double> average, average_bound;  // [B, Lq, Lk], the mean over heads
  std::vector<double> weights_before_dropout;  // [B, H, Lq, Lk]
  std::vector<double> sink_share;              // [B, H, Lq]: the sink's probability (0 without)
  int64_t dead_rows = 0;                       // (b, h, i) rows in which no key takes part
};

// PyTorch's masks of `in` at (b, h, i, j): false when a bool mask says "not
// allowed"; *add gets the f32 masks' sum.
bool pytorch_masks_allow(const ModuleInputs& in, int64_t heads, int64_t b, int64_t h, int64_t i,
                         int64_t j, double* add);

// Throws std::invalid_argument when the inputs do not fit the weights.
ModuleReference reference_module(const ModuleWeights& weights, const ModuleInputs& inputs);

// got (an F32 descriptor of the logical shape of `want`) against want ± bound:
// the number of elements outside, the largest |got - want| / bound, and the
// first offender described.  NaN where want is not NaN is an offender.
struct BoundCheck {
  int64_t outside = 0;
  int64_t elements = 0;
  double worst_ratio = 0.0;  // max |got - want| / bound (0 / 0 counts as 0)
  std::string first;
};
BoundCheck check_within(const mha_tensor& got, const std::vector<double>& want,
                        const std::vector<double>& bound);

}  // namespace mha_test
