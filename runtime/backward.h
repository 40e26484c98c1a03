// The backward pass of scaled dot-product attention (mha_attention_backward).
#pragma once

#include <mha/mha.h>

namespace mha::rt {

// Validates every argument and runs the selected backend's backward kernels
// over the current thread count.  Fails, writing nothing, on bad input, when
// the backend has no backward pass, or when memory runs out.
mha_status attention_backward(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                              const mha_tensor* out, const mha_tensor* lse, const mha_tensor* dout,
                              mha_tensor* dq, mha_tensor* dk, mha_tensor* dv,
                              const mha_attention_params* params,
                              const mha_backward_params* backward);

}  // namespace mha::rt
