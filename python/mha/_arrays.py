"""The caller's array types: NumPy or PyTorch in, the same out.

Outputs are allocated by the framework of the array they follow (query for
attention), so NumPy in gives NumPy out and torch in gives torch out; a
query of another DLPack framework gives NumPy outputs.  torch is never
imported here: a tensor can only exist when the caller imported it.
"""
import sys
from typing import Any

import numpy as np

# What the public functions take and return as arrays: a NumPy array, a
# PyTorch tensor or any DLPack array on the CPU (the result follows the
# caller's framework), so no narrower static type fits.
Array = Any


def torch_module():
    """PyTorch, when the caller has imported it (None otherwise)."""
    return sys.modules.get("torch")


def is_torch_tensor(x):
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def is_array(x):
    return isinstance(x, np.ndarray) or is_torch_tensor(x) or hasattr(x, "__dlpack__")


def array_argument(x, name):
    """x checked to be an array: TypeError naming the argument when it is not.

    The extension reads it (src/array_view.cpp) and applies PyTorch's rules
    there: a tensor that requires grad is refused while autograd is on (the
    function has no gradient, and a result silently cut from the graph would
    train nothing; under torch.no_grad() it is read as it is --
    scaled_dot_product_attention's autograd.Function calls mha there).  Every call of
    every function checks its arrays here, so the common cases are recognised
    first and cheaply.
    """
    if type(x) is np.ndarray:
        return x
    torch = sys.modules.get("torch")
    if (torch is not None and isinstance(x, torch.Tensor)) or is_array(x):
        return x
    raise TypeError(
        f"{name} must be a NumPy array or a PyTorch tensor (or any DLPack array), "
        f"not {type(x).__name__}"
    )


def mark_written(*arrays):
    """Tells torch's autograd that mha wrote into these caller-given arrays.

    The library writes through their data pointers, which torch does not see:
    each torch tensor's version counter moves on here, as after any in-place
    torch operation, so that a backward which saved one of them raises instead
    of computing with the new values.  None and other frameworks' arrays are
    passed over (they have no such counter), and so are inference tensors.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return
    increment = getattr(getattr(torch.autograd, "graph", None), "increment_version", None)
    for x in arrays:
        if not isinstance(x, torch.Tensor) or x.is_inference():
            continue
        if increment is not None:  # PyTorch 2.1 and later
            increment(x)
        else:  # an in-place operation that changes nothing: it moves the counter, as any does
            with torch.no_grad():
                x.as_strided_(x.size(), x.stride(), x.storage_offset())


def optional_array_argument(x, name):
    return None if x is None else array_argument(x, name)


def shape_of(x):
    if type(x) is np.ndarray:
        return x.shape
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else np.from_dlpack(x).shape


def empty_like_framework(template, shape, dtype=None):
    """An uninitialised array of `shape` from template's framework.

    dtype None: template's dtype; "float32", "int8": that dtype.
    """
    if type(template) is np.ndarray:
        return np.empty(shape, dtype=template.dtype if dtype is None else dtype)
    if is_torch_tensor(template):
        if dtype is None:
            return template.new_empty(shape)
        return template.new_empty(shape, dtype=getattr(torch_module(), dtype))
    return np.empty(shape, dtype=np.from_dlpack(template).dtype if dtype is None else dtype)


def half_dtype(x):
    """x's dtype when x is a bfloat16 or float16 torch tensor or a float16 NumPy array (the
    half types whose module results come in their dtype), else None."""
    if isinstance(x, np.ndarray):
        return x.dtype if x.dtype == np.float16 else None
    torch = torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else None
    return None


def output_dtype(query):
    """The dtype of the module's results for `query`, as empty_like_framework takes it: query's
    own (None) for a half-precision one (half_dtype), which the library writes rounded once,
    else "float32"."""
    return None if half_dtype(query) is not None else "float32"


def widened(x):
    """A half-precision array (half_dtype) as a float32 copy: torch's conversion (which autograd
    records) or NumPy's."""
    return x.astype(np.float32) if isinstance(x, np.ndarray) else x.float()


def zeros_like_array(x):
    """Zeros of x's shape, dtype and framework (a torch tensor that requires grad gets zeros
    joined to its graph with a zero gradient, whatever x holds)."""
    if not is_torch_tensor(x):  # NumPy's, or NumPy's copy of another DLPack array's
        return np.zeros_like(x if isinstance(x, np.ndarray) else np.from_dlpack(x))
    zeros = x.new_zeros(x.shape)
    if x.requires_grad:
        zeros = zeros + x.reshape(-1)[:0].sum()  # a sum of no elements: exactly 0
    return zeros
