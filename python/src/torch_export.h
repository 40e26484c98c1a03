// PyTorch tensors exported through torch.utils.dlpack.to_dlpack, a C
// function.  nanobind's generic import calls Tensor.__dlpack__, which wraps
// the same export in Python code: about half a microsecond more per tensor
// with PyTorch 1.13 (python/bench/overhead.py).
#pragma once

#include <nanobind/nanobind.h>

namespace mha_python {

// The DLPack capsule of `object` when it is a torch.Tensor (torch being
// imported), or an invalid object -- with no Python error set -- when it is
// not or the export fails: the caller then imports `object` itself, which
// words the error if there is one.
nanobind::object torch_capsule(nanobind::handle object);

}  // namespace mha_python
