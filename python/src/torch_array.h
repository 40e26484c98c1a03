// PyTorch tensors read from the at::Tensor behind them by the optional module
// mha._torch_tensors (torch_tensor_api.h), else from their own attributes
// (is_cpu, requires_grad, dtype, shape, stride(), data_ptr()).  With PyTorch
// 1.13 a DLPack export costs more: to_dlpack builds an as_strided view through
// the dispatcher, and Tensor.__dlpack__ (what nanobind's generic import calls)
// adds Python code on top.  On S5 (python/bench/overhead.py, five tensors a
// call) the attributes save about 0.25 us a tensor over to_dlpack and 0.7 us
// over __dlpack__, and the C++ read about 0.45 us more.  PyTorch's rules for
// mha are checked here too.
#pragma once

#include <mha/mha.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>

namespace mha_python {

struct TorchArray {
  const void* data = nullptr;
  mha_dtype dtype = MHA_DTYPE_INVALID;  // invalid: one mha has no name for
  std::string dtype_name;               // "float64", for the message then
  int32_t rank = 0;
  int64_t shape[MHA_MAX_DIMS] = {};  // filled when rank <= MHA_MAX_DIMS
  int64_t strides[MHA_MAX_DIMS] = {};
};

// True, with *array filled, when `object` is a torch.Tensor on the CPU (torch
// being imported); false, with no Python error, for anything else (the
// caller's other ways word the error if there is one).  Throws ValueError
// naming `name` for a tensor that requires grad while autograd is on: the
// functions that reach here compute no gradients, and a result silently cut
// from the graph would train nothing (under torch.no_grad() such tensors are
// read as they are; the autograd.Functions of mha.scaled_dot_product_attention
// and mha.multi_head_attention_forward call the library there).
// The tensor's memory lives as long as the object, which the caller holds.
bool read_torch(nanobind::handle object, const char* name, TorchArray* array);

// A new contiguous tensor for attention's result on torch tensors: query's
// shape with value's last dimension, query's dtype; None when
// mha._torch_tensors cannot make it (the caller allocates through torch).
nanobind::object new_torch_output(nanobind::handle query, nanobind::handle value);

// How tensors are read in this process: "libtorch" (mha._torch_tensors),
// "attributes", or "torch not imported".  For diagnostics and the tests.
const char* torch_tensor_reader();

}  // namespace mha_python
