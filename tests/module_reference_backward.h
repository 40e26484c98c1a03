// A float64 reference of the module's backward pass, with a tolerance per
// gradient.  It composes the suite's independent references -- the module's
// forward (module_reference.h: projections, heads, PyTorch's masks, dropout,
// the concatenated heads C) and the attention's analytic gradients
// (reference_backward.h) -- with the chain rule of the projections written
// out here:
//   dC = dout·W_o, dW_o = doutᵀ·C, db_o = Σ_rows dout,
//   dP_x = the attention's dQ, dK, dV of the projected heads,
//   dW_x = dP_xᵀ·X_x, db_x = Σ_rows dP_x, dX_x = dP_x·W_x.
// The projections and dC reach reference_backward rounded to fp32 once (its
// inputs are mha_tensors): a relative change of 2^-24, far below the
// tolerances.  It calls no mha function.
//
// The tolerances.  An fp32 dot product of K terms is off by at most
// g(K)·Σ|a||b| with g(K) = 4·sqrt(K)·2^-24 (module_reference.h's bound).
//   - dP_x (the attention's gradients), element by element:
//     reference_backward's tolerance; plus 2ρ of its terms' magnitudes,
//     ρ = g(E) + g(max(Eq, Ek, Ev)), the relative error of its inputs dC and
//     Q, K, V, each term being a product of two; plus twice the first-order
//     bound (reference_backward.h's InputErrors) of what moves them beyond
//     ρ: an fp32 projection is off by g(F + 1) times the magnitudes it sums
//     (F features and the bias; dC by g(E) times its own), and where those
//     cancel the value is far smaller than they are -- a projected q of
//     3.4e-4 summed from magnitudes of 1.8 moved every dK by 4e-5 of itself,
//     past a bound relative to q alone (found by the fuzzer);
//   - a gradient G = Σ_r A_r·B_r with A's element r off by at most ε_r and
//     B exact: Σ_r ε_r·|B_r| + g(rows)·Σ_r|A_r||B_r|, its largest value over
//     G's elements (A = dP, B = X for dW_x; A = dP, B = 1 for db_x; A = dP,
//     B = W_x for dX_x; A = C with module_reference's per-element bound,
//     B = dout for dW_o);
//   - db_o is dout's column sums, exact in double: one rounding, 2^-24·|db_o|.
#pragma once

#include <mha/mha.h>

#include <vector>

#include "module_reference.h"

namespace mha_test {

struct ReferenceGradient {
  std::vector<double> value;  // C order of the gradient's shape
  double tolerance = 0;       // on max |got - value|
};

struct ModuleBackwardReference {
  ReferenceGradient query, key, value;  // [B, L, Eq / Ek / Ev]
  ReferenceGradient w_q, w_k, w_v;      // [E, Eq / Ek / Ev]
  ReferenceGradient b_q, b_k, b_v;      // [E]
  ReferenceGradient w_o, b_o;           // [E, E], [E]
  ReferenceGradient sinks;              // [H] (empty without sinks)
};

// max |got - want| over an F32 gradient's elements in C order (infinite
// where got holds a NaN).
double worst_difference(const mha_tensor& got, const std::vector<double>& want);

// The gradients of L = Σ dout ∘ module(inputs), dout F32 [B, Lq, E].
ModuleBackwardReference reference_module_backward(const ModuleWeights& weights,
                                                  const ModuleInputs& inputs,
                                                  const mha_tensor& dout);

}  // namespace mha_test
