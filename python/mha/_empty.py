"""scaled_dot_product_attention on empty dimensions, as PyTorch computes them: a batch, heads
or queries of size 0 give an empty result, no keys (S = 0) a result of zeros (mha's rule
for a row without keys, whose LSE is -inf) -- what torch's softmax over no keys followed by
a product over them gives.  The library takes positive sizes only, so these calls are
answered here, after the checks the library would have made of PyTorch's arguments (shapes,
dtypes, the mask's broadcast, scale and dropout_p); a call with mha's own options
(valid_lens, sinks, ALiBi, an int8 cache, a window, softcap) keeps the library's refusal.

Only calls the library refuses come here (mha._attention), so the common call pays
nothing for it."""
import math

import numpy as np

from ._arrays import empty_like_framework, is_torch_tensor, mark_written, shape_of

_FLOATS = ("float32", "bfloat16", "float16")


def _dtype(x):
    return str(x.dtype).replace("torch.", "")


def _as_4d(shape):
    return (1,) * (4 - len(shape)) + tuple(shape)


def empty_result(query, key, value, attn_mask, scale, enable_gqa, dropout_p, out, return_lse,
                 mha_options_given):
    """(result,) as scaled_dot_product_attention returns it when query, key or value has an
    empty dimension (and the call is otherwise one the library would take), or None when the
    library's refusal stands."""
    shapes = [tuple(shape_of(x)) for x in (query, key, value)]
    if mha_options_given or not any(0 in s for s in shapes):
        return None
    if any(not 2 <= len(s) <= 4 for s in shapes) or \
            any(_dtype(x) not in _FLOATS for x in (query, key, value)) or \
            _dtype(key) != _dtype(value):
        return None
    (b, h, L, e), (bk, hk, s, ek), (bv, hv, sv, ev) = (_as_4d(x) for x in shapes)
    # E: the scores' inner dimension, positive (torch's default scale 1/sqrt(0) is inf).
    if e == 0 or ek != e or sv != s or hv != hk or bv != bk:
        return None
    if not (hk == h or hk == 1 or (enable_gqa and hk > 0 and h % hk == 0)):
        return None
    try:
        batch = np.broadcast_shapes((b,), (bk,))[0]
    except ValueError:
        return None
    heads = h
    if scale is not None and (not math.isfinite(scale) or scale == 0.0):
        return None
    if not 0.0 <= dropout_p < 1.0:
        return None
    full = (batch, heads, L, s)
    if attn_mask is not None:
        mask_shape = tuple(shape_of(attn_mask))
        if not 1 <= len(mask_shape) <= 4 or _dtype(attn_mask) not in _FLOATS + ("bool",):
            return None
        try:
            if np.broadcast_shapes(_as_4d(mask_shape), full) != full:
                return None
        except ValueError:
            return None
    rank = max(len(x) for x in shapes)
    lead = (batch, heads)[2 - (rank - 2):] if rank > 2 else ()
    result_shape = lead + (L, ev)
    lse_shape = lead + (L,)
    if out is not None:
        if tuple(shape_of(out)) != result_shape or _dtype(out) not in ("float32", _dtype(query)):
            return None
        _fill(out, 0.0)
        mark_written(out)
        result = out
    else:
        result = empty_like_framework(query, result_shape)
        _fill(result, 0.0)
        if is_torch_tensor(result):
            result = _connected(result, query, key, value)
    if not return_lse:
        return (result,)
    lse = empty_like_framework(query, lse_shape, "float32")
    _fill(lse, -math.inf)
    return ((result, lse),)


def _fill(x, value):
    if is_torch_tensor(x):
        x.fill_(value)
    else:
        np.asarray(x)[...] = value


def _connected(result, *inputs):
    """result (zeros) joined to the graph of the inputs that require grad, whose gradients are
    then zeros of their shapes (the result does not depend on them), as torch's own call
    gives."""
    import torch
    if not torch.is_grad_enabled():
        return result
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            # A sum of no elements: exactly 0 whatever x holds (inf and NaN included).
            result = result + x.reshape(-1)[:0].sum().to(result.dtype)
    return result
