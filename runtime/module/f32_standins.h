// F32 stand-ins for the bf16 and f16 tensors of a module backward call.
//
// The backward is written for fp32: BLIS's products read and write fp32.  A
// half-precision input (query, key, value, dout) is widened into an fp32 copy
// with the same strides, so that its rows keep their order and the products
// group and sum them as for an f32 call (the same bits); a half-precision
// gradient is computed into an fp32 buffer with its strides and rounded once
// into it after the whole computation has succeeded.  The same tensor (same
// data, dtype, shape and strides) gets the same stand-in, so self-attention's
// shared input and summed gradient stay shared.
#pragma once

#include <mha/mha.h>

#include <cstdint>
#include <deque>
#include <memory>

namespace mha::rt {

class F32Standins {
 public:
  // `t` itself when it is f32 or NULL, else its widened copy.
  const mha_tensor* input(const mha_tensor* t);
  // `t` itself when it is f32 or NULL, else an fp32 buffer of its shape and
  // strides (its contents undefined until the backward writes them).
  mha_tensor* gradient(mha_tensor* t);
  // Every gradient stand-in's values rounded once (to nearest, ties to even)
  // into its bf16 or f16 tensor.
  void round_gradients() const;

 private:
  struct Copy {
    const mha_tensor* original;
    mha_tensor* written;  // the caller's gradient, or nullptr for an input
    mha_tensor f32;
    std::unique_ptr<float[]> values;  // the extent, uninitialised: only elements are read
  };
  Copy* find(const mha_tensor& t);
  Copy& add(const mha_tensor& t, mha_tensor* written);
  std::deque<Copy> copies_;  // a deque: the stand-ins' addresses stay put
};

}  // namespace mha::rt
