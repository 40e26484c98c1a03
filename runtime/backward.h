// The backward pass of scaled dot-product attention (mha_attention_backward,
// and per sequence mha_attention_varlen_backward).
#pragma once

#include <mha/mha.h>
#include <mha/plugin_abi.h>

#include <cstdint>

#include "validate.h"

namespace mha::rt {

// Validates every argument and runs the selected backend's backward kernels
// over the current thread count.  Fails, writing nothing, on bad input, when
// the backend has no backward pass, or when memory runs out.
mha_status attention_backward(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                              const mha_tensor* out, const mha_tensor* lse, const mha_tensor* dout,
                              mha_tensor* dq, mha_tensor* dk, mha_tensor* dv,
                              const mha_attention_params* params,
                              const mha_backward_params* backward);

// A validated backward call: the forward's problem, the backward's, and the
// gradients it writes.
struct BackwardCall {
  KernelCall forward;  // the forward's problem (and its out, as a tensor below)
  mha_backward_problem problem;
  const mha_tensor* out;
  const mha_tensor* dout;
  mha_tensor dq, dk, dv;
  const mha_tensor* dsinks;  // nullptr: not wanted
  const mha_tensor* dmask;
  const mha_tensor* mask;
};

// A gradient's (or dout's) checks against the tensor it goes with: the same
// shape (t's rank), and F32 or `like`'s dtype; each names t.
mha_status check_same_shape(const mha_tensor& t, const char* name, const mha_tensor& like,
                            const char* like_name);
mha_status check_f32_or_like(const mha_tensor& t, const char* name, const mha_tensor& like,
                             const char* like_name);

// backward->dsinks (nullptr: not wanted): only with params->sinks, F32 [heads].
mha_status check_dsinks(const mha_tensor* dsinks, const mha_tensor* sinks, int64_t heads);

// mha_attention_backward's checks (naming the argument on failure), filling
// *call.
mha_status validate_backward(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                             const mha_tensor* out, const mha_tensor* lse, const mha_tensor* dout,
                             mha_tensor* dq, mha_tensor* dk, mha_tensor* dv,
                             const mha_attention_params* params,
                             const mha_backward_params* backward, BackwardCall* call);

// Runs `count` validated calls -- one, or the sequences of a packed batch of
// varlen_batch sequences (-1: not packed) -- as one team on the selected
// backend: their items in one list, the costliest first.  Each call gets the
// bits it gets alone, on any number of threads.  Calls that want dsinks share
// one tensor: it receives the sum of their shares, in call order.
// MHA_VERBOSE=2: one line for all of them.
mha_status run_backward_calls(BackwardCall* calls, int64_t count, int64_t varlen_batch);

}  // namespace mha::rt
