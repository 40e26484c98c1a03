"""The weights of mha.MultiheadAttention as PyTorch's state_dict names them.

nn.MultiheadAttention has one stacked in_proj_weight [3E, E] when
kdim = vdim = embed_dim, else q_proj_weight [E, E], k_proj_weight [E, kdim]
and v_proj_weight [E, vdim]; with bias, in_proj_bias [3E] and out_proj.bias
[E]; always out_proj.weight [E, E].  Values are PyTorch tensors or NumPy (or
DLPack) arrays of a floating dtype, taken as float32 copies (rounded, as
PyTorch's load_state_dict copies into float32 parameters).
"""
import collections
from collections.abc import Mapping
from typing import List, NamedTuple

import numpy as np

from ._arrays import is_array, is_torch_tensor, torch_module

# nn.MultiheadAttention's entries that mha's module does not have.
UNSUPPORTED = {
    "bias_k": "add_bias_kv",
    "bias_v": "add_bias_kv",
}

class IncompatibleKeys(NamedTuple):
    """What MultiheadAttention.load_state_dict returns, as PyTorch's: the module's weights
    the state_dict lacked and the names it had that the module has not."""
    missing_keys: List[str]
    unexpected_keys: List[str]


def weight_shapes(embed_dim, kdim, vdim, bias):
    """{name: shape} of a module's weights, in nn.MultiheadAttention's state_dict order."""
    e = embed_dim
    shapes = collections.OrderedDict()
    if kdim == e and vdim == e:
        shapes["in_proj_weight"] = (3 * e, e)
    else:
        shapes["q_proj_weight"] = (e, e)
        shapes["k_proj_weight"] = (e, kdim)
        shapes["v_proj_weight"] = (e, vdim)
    if bias:
        shapes["in_proj_bias"] = (3 * e,)
    shapes["out_proj.weight"] = (e, e)
    if bias:
        shapes["out_proj.bias"] = (e,)
    return shapes


def float32_copy(value, name):
    """value (a tensor or array of a floating dtype) as a new C-order float32 NumPy array."""
    if is_torch_tensor(value):
        if not value.is_floating_point():
            raise TypeError(f"{name} has dtype {value.dtype}; weights must be floating point")
        value = value.detach().to(device="cpu", dtype=torch_module().float32)
        return np.array(value.numpy(), dtype=np.float32, order="C", copy=True)
    if not is_array(value):
        raise TypeError(f"{name} must be a PyTorch tensor or a NumPy array, "
                        f"not {type(value).__name__}")
    array = value if isinstance(value, np.ndarray) else np.from_dlpack(value)
    if not np.issubdtype(array.dtype, np.floating):
        raise TypeError(f"{name} has dtype {array.dtype}; weights must be floating point")
    return np.array(array, dtype=np.float32, order="C", copy=True)


def checked_weights(state_dict, shapes, strict):
    """The entries of state_dict this module takes, as float32 copies, and the keys it lacks
    and has in excess.  Raises before anything is loaded: TypeError for a value of the wrong
    type, ValueError for a wrong shape or (strict) missing or unexpected keys,
    NotImplementedError for entries of a feature mha's module does not have."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to arrays (a PyTorch "
                        f"state_dict), not {type(state_dict).__name__}")
    for key, feature in UNSUPPORTED.items():
        if state_dict.get(key) is not None:
            raise NotImplementedError(
                f"state_dict has '{key}' ({feature}=True in PyTorch), which mha's module does "
                "not have")
    missing = [key for key in shapes if key not in state_dict]
    unexpected = [key for key in state_dict if key not in shapes]
    if strict and (missing or unexpected):
        raise ValueError(f"state_dict does not match the module: missing keys {missing}, "
                         f"unexpected keys {unexpected} (this module's are {list(shapes)})")
    weights = {}
    for key, shape in shapes.items():
        if key not in state_dict:
            continue
        name = f"state_dict['{key}']"
        weight = float32_copy(state_dict[key], name)
        if weight.shape != shape:
            raise ValueError(f"{name} has shape {list(weight.shape)}; this module's is "
                             f"{list(shape)}")
        weights[key] = weight
    return weights, IncompatibleKeys(missing, unexpected)
