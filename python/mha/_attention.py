"""mha.scaled_dot_product_attention: PyTorch's call, computed by mha."""
import numbers
import random
from typing import Optional, Sequence, Tuple, Union

import numpy as np

from . import _mha
from ._arguments import call_settings, flag, integer, real
from ._arrays import (Array, array_argument, empty_like_framework, is_array, mark_written,
                      shape_of, torch_module, zeros_like_array)
from ._broadcast import broadcast_leading
from ._empty import empty_result

# mha.h's mha_causal.
_CAUSAL = {"top-left": 1, "bottom-right": 2}


# The default window_size, recognised by identity (a caller's (-1, -1) is
# checked like any other pair).
_NO_WINDOW = (-1, -1)


def scaled_dot_product_attention(
        query: Array, key: Array, value: Array, attn_mask: Optional[Array] = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *,
        valid_lens: Union[Array, Sequence[int], Sequence[Sequence[int]], None] = None,
        causal_alignment: str = "top-left", return_lse: bool = False,
        out: Optional[Array] = None, backend: Optional[str] = None,
        threads: Optional[int] = None, dropout_seed: Optional[int] = None,
        k_scale: Optional[Array] = None,
        v_scale: Optional[Array] = None,
        window_size: Tuple[int, int] = _NO_WINDOW,
        sinks: Optional[Array] = None,
        softcap: float = 0.0,
        alibi_slopes: Optional[Array] = None) -> Union[Array, Tuple[Array, Array]]:
    """softmax(query @ key^T * scale + mask) @ value, as torch.nn.functional.scaled_dot_product_attention.

    Arguments as PyTorch's (same names, positions and meaning):

    query: [B, Hq, L, E]; key: [B, Hkv, S, E]; value: [B, Hkv, S, Ev] -- NumPy
        arrays or PyTorch tensors (or any DLPack array) on the CPU, float32,
        bfloat16 or float16 (key and value share one dtype, which may also be
        int8 with k_scale and v_scale), with any strides:
        a view such as x.transpose(1, 2) of a [B, L, H, E] tensor is read in
        place, never copied.  Fewer than four dimensions mean leading ones of
        size 1 ([L, E], [H, L, E]).  Leading dimensions broadcast as in
        PyTorch (a key and value of batch 1 for a batch of queries; one
        key/value head for every query head): read through stride-0 views,
        never copied; a broadcast input's gradient is summed over them.
        Empty dimensions give PyTorch's empty result (no keys: zeros, LSE
        -inf), with PyTorch's arguments only.
    attn_mask: optional, broadcastable to [B, Hq, L, S]: bool (True = the key
        takes part, as in PyTorch) or float (added to the scaled scores; -inf
        removes a key).
    dropout_p: probability of zeroing an attention weight (the kept ones are
        scaled by 1 / (1 - dropout_p)); 0 computes exactly.
    is_causal: query i sees keys j <= i (aligned as `causal_alignment` says).
        Unlike PyTorch, it may be combined with attn_mask: all masks apply.
    scale: the factor of the scores; None is 1 / sqrt(E); 0 makes every score
        0 before the mask and the variants (uniform weights), as in PyTorch.
    enable_gqa: must be True when Hq != Hkv (grouped-query attention: query
        head h uses key/value head h // (Hq // Hkv)), as in PyTorch.

    mha's own, keyword-only:

    valid_lens: int32/int64 [B] or [B, L] (a list of ints is taken too): key j
        takes part in a row iff j < the row's valid length (d2l.ai's valid_lens).
    causal_alignment: "top-left" (PyTorch's is_causal: j <= i) or
        "bottom-right" (j <= i + S - L: the queries are the last tokens of a
        KV cache).
    return_lse: also return the log-sum-exp of each row's scaled, masked
        scores, float32 [B, Hq, L] (before dropout).
    out: an array of shape [B, Hq, L, Ev] to write the result into (float32 or
        query's dtype); it is returned.
    backend: a name from mha.backends() for this call only (default: the
        process's, see mha.set_backend).
    threads: the number of threads for this call only (default: the
        process's, see mha.set_num_threads).  A call with backend= or threads=
        runs while no other mha call does.
    dropout_seed: the 64-bit seed of dropout's counter-based hash: the same
        seed gives the same weights dropped, for any thread count and backend.
        None draws one from Python's `random`.
    k_scale, v_scale: the float32 row scales of an int8 KV cache, [B, Hkv, S]
        each (a stride of 0 broadcasts): key and value of dtype int8 mean
        k_scale * key and v_scale * value (mha.quantize_kv makes such a
        cache).  Required with int8 key and value, refused otherwise.
    window_size: (left, right), FlashAttention-2's sliding window aligned to
        the bottom-right corner: key j takes part in query i's row iff
        i + S - L - left <= j <= i + S - L + right; -1 leaves a side
        unbounded.  Keys outside the window are never read.
    sinks: float32 [Hq], per-head logits that join each row's softmax
        denominator without a value row (gpt-oss); -inf is no sink.  The LSE
        includes them; a row without keys is zeros with LSE = its sink.
    softcap: scores become softcap * tanh(score / softcap) before ALiBi and
        the mask (Gemma 2); 0 is off.
    alibi_slopes: float32 [Hq] or [B, Hq]: adds -slope * |i + S - L - j| to
        the scores (FlashAttention-2's convention).

    A row in which no key takes part is zeros (its LSE -inf), never NaN.

    Gradients: on torch tensors, while autograd is on, the call is recorded
    for torch's autograd when query, key, value, a float attn_mask or sinks
    requires grad; backward() computes their gradients with mha's backward
    (FlashAttention-2's: the weights are recomputed from the saved LSE),
    regenerating dropout's mask from the seed the forward used (drawn here
    when dropout_seed is None).  The gradients have the inputs' shapes and
    dtypes; with enable_gqa, key's and value's are summed over each head's
    group.  The LSE of return_lse has no gradient.  The backward takes float32,
    bfloat16 and float16 query, key and value (widened to fp32 as they are
    read, every sum fp32, a half-precision gradient rounded once); an int8 KV
    cache is refused with TypeError while a tensor requires grad; out= is
    refused then (ValueError, as PyTorch's out= functions have no autograd),
    and so are alibi_slopes, k_scale and v_scale that require grad (they have
    no gradient).  Second derivatives are not computed.
    scaled_dot_product_attention_backward is the same backward on arrays,
    NumPy ones included.

    Returns the result in query's framework and dtype (NumPy in, NumPy out;
    torch in, torch out) -- or `out` -- and `(result, lse)` with return_lse.
    Raises mha.Error (a RuntimeError) when the library refuses the call, with
    its message (which calls query, key, value and attn_mask q, k, v and mask);
    TypeError or ValueError for arguments of the wrong Python type or rank.
    """
    # Every call runs this, so each check is skipped inline when the argument is
    # of the type (or the default) the extension takes as it is: S5, the d2l
    # example, costs a few microseconds in C, and a Python function call about
    # 0.1 (python/bench/overhead.py measures the whole binding).
    ndarray = np.ndarray
    numpy_qkv = type(query) is ndarray and type(key) is ndarray and type(value) is ndarray
    torch_qkv = False  # query, key and value are torch.Tensor (not a subclass)
    if not numpy_qkv:
        query, key, value, torch_qkv = _qkv_arguments(query, key, value)
    if attn_mask is not None:
        attn_mask = array_argument(attn_mask, "attn_mask")
    if valid_lens is not None and type(valid_lens) is not ndarray and not (
            torch_qkv and type(valid_lens) is type(query)):
        valid_lens = _valid_lens_argument(valid_lens)
    if type(dropout_p) is not float:
        dropout_p = real(dropout_p, "dropout_p")
    if scale is not None and type(scale) is not float:
        scale = real(scale, "scale")
    if is_causal is not False or causal_alignment != "top-left":
        causal = _causal_mode(flag(is_causal, "is_causal"), causal_alignment)
    else:
        causal = 0
    if enable_gqa is not False and enable_gqa is not True:
        enable_gqa = flag(enable_gqa, "enable_gqa")
    if return_lse is not False and return_lse is not True:
        return_lse = flag(return_lse, "return_lse")
    dropout_seed = 0 if dropout_seed is None and dropout_p == 0.0 else \
        _dropout_seed(dropout_seed, dropout_p)
    if k_scale is not None:
        k_scale = array_argument(k_scale, "k_scale")
    if v_scale is not None:
        v_scale = array_argument(v_scale, "v_scale")
    window_left, window_right = (-1, -1) if window_size is _NO_WINDOW else \
        _window_argument(window_size)
    if sinks is not None:
        sinks = array_argument(sinks, "sinks")
    if type(softcap) is not float:
        softcap = real(softcap, "softcap")
    if alibi_slopes is not None:
        alibi_slopes = array_argument(alibi_slopes, "alibi_slopes")
    if not ((backend is None or type(backend) is str) and
            (threads is None or (type(threads) is int and 1 <= threads <= 4096))):
        backend, threads = call_settings(backend, threads)

    # Training: a tensor that requires grad while autograd is on goes through mha's
    # torch.autograd.Function (mha/_autograd.py), whose backward is the library's.
    # The extension reads requires_grad of every tensor anyway and raises
    # GradRequired for one (a ValueError), so the common calls -- NumPy arrays,
    # or tensors without grad -- pay nothing for the check here; arrays of other
    # kinds (a tensor subclass, which the extension may read through DLPack) are
    # checked first.
    if not (numpy_qkv or torch_qkv) and _grad_wanted(
            query, key, value, attn_mask, sinks, alibi_slopes, k_scale, v_scale):
        return _attention_with_grad(
            query, key, value, attn_mask, valid_lens, k_scale, v_scale, scale, causal,
            enable_gqa, dropout_p, dropout_seed, window_left, window_right, sinks, softcap,
            alibi_slopes, backend, threads, out, return_lse)

    given_out = out
    if out is not None:
        if type(out) is not ndarray and not (torch_qkv and type(out) is type(query)):
            out = array_argument(out, "out")
    elif torch_qkv:
        # libtorch's C++ API when the package has mha._torch_tensors: about 0.8 us
        # less than torch.empty_like with PyTorch 1.13.
        out = _mha.torch_output(query, value)
        if out is None:
            out = _torch_output(query, value)
    else:
        out = empty_like_framework(query, shape_of(query)[:-1] + shape_of(value)[-1:])
    lse = empty_like_framework(query, shape_of(query)[:-1], "float32") if return_lse else None

    try:
        _mha.attention(query, key, value, out, attn_mask, valid_lens, lse, k_scale, v_scale,
                       scale, causal, enable_gqa, dropout_p, dropout_seed, window_left,
                       window_right, sinks, softcap, alibi_slopes, backend, threads)
    except _mha.GradRequired:
        if not _grad_wanted(query, key, value, attn_mask, sinks, alibi_slopes, k_scale, v_scale):
            raise  # out, lse or valid_lens requires grad: refused, as by any mha function
        return _attention_with_grad(
            query, key, value, attn_mask, valid_lens, k_scale, v_scale, scale, causal,
            enable_gqa, dropout_p, dropout_seed, window_left, window_right, sinks, softcap,
            alibi_slopes, backend, threads, given_out, return_lse)
    except _mha.Error:
        # Leading dimensions that differ but broadcast (PyTorch's rule): again on views
        # that agree; empty dimensions: PyTorch's empty or zero result.  Nothing was
        # written: the library checks before it computes.
        views = broadcast_leading(query, key, value, enable_gqa)
        if views is None and scale == 0.0:
            # PyTorch's scale=0: every score 0 before the mask and the variants, which is
            # the library's call on a query of zeros with a scale of 1.
            views = (zeros_like_array(query), key, value)
            scale = 1.0
        if views is None:
            empty = empty_result(query, key, value, attn_mask, scale, enable_gqa, dropout_p,
                                 given_out, return_lse, _mhas_own_options(
                                     valid_lens, k_scale, v_scale, window_left, window_right,
                                     sinks, softcap, alibi_slopes))
            if empty is None:
                raise
            return empty[0]
        return scaled_dot_product_attention(
            *views, attn_mask, dropout_p, is_causal, scale, enable_gqa, valid_lens=valid_lens,
            causal_alignment=causal_alignment, return_lse=return_lse, out=given_out,
            backend=backend, threads=threads, dropout_seed=dropout_seed, k_scale=k_scale,
            v_scale=v_scale, window_size=window_size, sinks=sinks, softcap=softcap,
            alibi_slopes=alibi_slopes)
    if given_out is not None:
        mark_written(out)
    return (out, lse) if return_lse else out


def _torch_output(query, value):
    """A new tensor for the result of query and value, made through torch."""
    torch = torch_module()
    if query.layout is not torch.strided:  # sparse: torch would raise a RuntimeError
        raise TypeError(f"query must be a strided tensor, not a {query.layout} one")
    for name, x in (("query", query), ("value", value)):
        if x.dim() == 0:  # size(-1) would raise an IndexError
            raise ValueError(f"{name} must have 2 to 4 dimensions, has 0")
    if query.size(-1) == value.size(-1):
        # Half the cost of new_empty(shape) with PyTorch 1.13 (no shape to build).
        return torch.empty_like(query, memory_format=torch.contiguous_format)
    return query.new_empty(query.shape[:-1] + value.shape[-1:])


def _mhas_own_options(valid_lens, k_scale, v_scale, window_left, window_right, sinks, softcap,
                      alibi_slopes):
    """Whether the call uses an option of mha's own (beyond PyTorch's arguments)."""
    return (valid_lens is not None or k_scale is not None or v_scale is not None
            or (window_left, window_right) != (-1, -1) or sinks is not None or softcap != 0.0
            or alibi_slopes is not None)


def _attention_with_grad(*arguments):
    from ._autograd import attention_with_grad
    return attention_with_grad(*arguments)


def _grad_wanted(*arrays):
    """True when torch's autograd is on and one of the arrays is a tensor that requires grad."""
    torch = torch_module()
    if torch is None or not torch.is_grad_enabled():
        return False
    tensor = torch.Tensor
    for x in arrays:
        if x is not None and isinstance(x, tensor) and x.requires_grad:
            return True
    return False


def _qkv_arguments(query, key, value):
    """(query, key, value, all three are torch.Tensor): checked to be arrays (array_argument)."""
    torch = torch_module()
    if torch is not None:
        tensor = torch.Tensor
        if type(query) is tensor and type(key) is tensor and type(value) is tensor:
            return query, key, value, True
        if isinstance(query, tensor) and isinstance(key, tensor) and isinstance(value, tensor):
            return query, key, value, False
    return (array_argument(query, "query"), array_argument(key, "key"),
            array_argument(value, "value"), False)


def _window_argument(window_size):
    """(left, right) as two ints (the library refuses values below -1 by name)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError("window_size must be a pair (left, right) of ints, -1 for an unbounded "
                        f"side, not {window_size!r}")
    left, right = window_size
    limit = 2**62
    return (integer(left, "window_size[0]", -limit, limit),
            integer(right, "window_size[1]", -limit, limit))


def _valid_lens_argument(valid_lens):
    """An integer array as it is, or a (nested) list of ints as a small int64 array."""
    if valid_lens is None or type(valid_lens) is np.ndarray:
        return valid_lens
    if type(valid_lens) is list:
        # The common case, [B] lengths as Python ints, in one conversion: NumPy
        # makes int64 of ints only (bools, floats, big or mixed values give
        # another dtype, ragged lists an error: the checks below word those).
        try:
            lens = np.array(valid_lens)
        except (ValueError, OverflowError):
            lens = None
        if lens is not None and lens.dtype == np.int64:
            return lens
    if not isinstance(valid_lens, (list, tuple)):
        if is_array(valid_lens):
            return array_argument(valid_lens, "valid_lens")
        raise TypeError("valid_lens must be an integer array or a list of ints, "
                        f"not {type(valid_lens).__name__}")
    if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool)
               for n in _flatten(valid_lens)):
        raise TypeError("valid_lens must hold ints")
    return np.asarray(valid_lens, dtype=np.int64)


def _flatten(items):
    for item in items:
        if isinstance(item, (list, tuple)):
            yield from _flatten(item)
        else:
            yield item


def _causal_mode(is_causal, causal_alignment):
    if causal_alignment == "top-left":
        return _CAUSAL["top-left"] if is_causal else 0
    if not isinstance(causal_alignment, str):
        raise TypeError(f"causal_alignment must be a str, not {type(causal_alignment).__name__}")
    if causal_alignment not in _CAUSAL:
        raise ValueError(f"causal_alignment must be 'top-left' or 'bottom-right', "
                         f"not {causal_alignment!r}")
    return _CAUSAL[causal_alignment] if is_causal else 0


def _dropout_seed(dropout_seed, dropout_p):
    if dropout_seed is None:
        return random.getrandbits(64) if dropout_p > 0.0 else 0
    return integer(dropout_seed, "dropout_seed", 0, 2**64 - 1)
