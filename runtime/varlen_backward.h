// The backward pass of a packed variable-length batch
// (mha_attention_varlen_backward).
#pragma once

#include <mha/mha.h>

namespace mha::rt {

// Checks every argument (naming it on failure, writing nothing), then runs
// each sequence's backward as a B = 1 call in one team of threads.
mha_status attention_varlen_backward(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                                     const mha_tensor* out, const mha_tensor* lse,
                                     const mha_tensor* dout, mha_tensor* dq, mha_tensor* dk,
                                     mha_tensor* dv, const mha_varlen_params* varlen,
                                     const mha_attention_params* params,
                                     const mha_backward_params* backward);

}  // namespace mha::rt
