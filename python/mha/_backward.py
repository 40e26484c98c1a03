"""mha.scaled_dot_product_attention_backward: the gradients of one attention call."""
from typing import Optional, Sequence, Tuple, Union

from . import _mha
from ._arguments import call_settings, flag, integer, real
from ._arrays import (Array, array_argument, empty_like_framework, mark_written,
                      optional_array_argument, shape_of)
from ._attention import (_NO_WINDOW, _causal_mode, _qkv_arguments, _valid_lens_argument,
                         _window_argument)


def scaled_dot_product_attention_backward(
        grad_out: Array, query: Array, key: Array, value: Array, out: Array, lse: Array,
        attn_mask: Optional[Array] = None, dropout_p: float = 0.0, is_causal: bool = False,
        scale: Optional[float] = None, enable_gqa: bool = False, *,
        valid_lens: Union[Array, Sequence[int], Sequence[Sequence[int]], None] = None,
        causal_alignment: str = "top-left", dropout_seed: Optional[int] = None,
        window_size: Tuple[int, int] = _NO_WINDOW, sinks: Optional[Array] = None,
        softcap: float = 0.0, alibi_slopes: Optional[Array] = None,
        grad_query: Optional[Array] = None, grad_key: Optional[Array] = None,
        grad_value: Optional[Array] = None, grad_attn_mask: Optional[Array] = None,
        grad_sinks: Optional[Array] = None, backend: Optional[str] = None,
        threads: Optional[int] = None) -> Tuple[Array, Array, Array]:
    """The gradients of scaled_dot_product_attention(query, key, value, ...) from grad_out.

    What torch's autograd calls for mha.scaled_dot_product_attention (which
    needs no call of this by hand); here for NumPy arrays and for code that
    keeps its own graph.  FlashAttention-2's backward: the weights are
    recomputed tile by tile from query, key and the forward's LSE, so memory
    does not grow with L * S.

    grad_out: dL/d(result), [B, Hq, L, Ev].
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa and
        the keywords valid_lens, causal_alignment, window_size, sinks,
        softcap, alibi_slopes: exactly the forward call's (see
        scaled_dot_product_attention).
    out, lse: that call's result and its float32 [B, Hq, L] log-sum-exp
        (return_lse=True).
    dropout_seed: the forward's seed; required when dropout_p > 0 (the same
        weights are dropped: mha regenerates its counter-based mask, it never
        stores one).

    query, key and value: float32, bfloat16 or float16, as the forward took
    them (half-precision ones are widened to fp32 as they are read; every sum
    is fp32); out and grad_out float32 or query's dtype.  An int8 KV cache
    has no gradient.

    grad_query, grad_key, grad_value: optional arrays of query's, key's and
        value's shapes to write the gradients into (any strides), each float32
        or its input's dtype (a half-precision gradient is the fp32 sum
        rounded once); float32 arrays in query's framework when None.  With
        enable_gqa, grad_key and grad_value are summed over each key/value
        head's query heads.
    grad_attn_mask: optional float32 array of attn_mask's own shape (a float
        mask): written with dL/d(attn_mask), summed over the axes the mask
        broadcasts, 0 where a key does not take part.
    grad_sinks: optional float32 [Hq] array: written with dL/d(sinks).
    backend, threads: as in scaled_dot_product_attention, for this call.

    A row in which no key takes part contributes zero gradients.  The results
    are the same bits for any thread count.  Returns (grad_query, grad_key,
    grad_value).  Raises mha.Error when the library refuses the call, with
    its message (which calls query, key, value, out, lse, grad_out, grad_query,
    grad_key, grad_value, attn_mask and grad_attn_mask q, k, v, out, lse, dout,
    dq, dk, dv, mask and dmask); TypeError or ValueError for arguments of the
    wrong Python type or rank.
    """
    grad_out = array_argument(grad_out, "grad_out")
    query, key, value, _ = _qkv_arguments(query, key, value)
    out = array_argument(out, "out")
    lse = array_argument(lse, "lse")
    attn_mask = optional_array_argument(attn_mask, "attn_mask")
    valid_lens = _valid_lens_argument(valid_lens)
    dropout_p = real(dropout_p, "dropout_p")
    if scale is not None:
        scale = real(scale, "scale")
    causal = _causal_mode(flag(is_causal, "is_causal"), causal_alignment)
    enable_gqa = flag(enable_gqa, "enable_gqa")
    if dropout_seed is None:
        if dropout_p > 0.0:
            raise ValueError("dropout_seed is required with dropout_p > 0: pass the forward "
                             "call's seed, so that the same weights are dropped")
        dropout_seed = 0
    else:
        dropout_seed = integer(dropout_seed, "dropout_seed", 0, 2**64 - 1)
    window_left, window_right = _window_argument(window_size)
    sinks = optional_array_argument(sinks, "sinks")
    softcap = real(softcap, "softcap")
    alibi_slopes = optional_array_argument(alibi_slopes, "alibi_slopes")
    backend, threads = call_settings(backend, threads)

    def gradient(given, of, name):
        if given is None:
            return empty_like_framework(query, shape_of(of), "float32")
        return array_argument(given, name)

    grad_query = gradient(grad_query, query, "grad_query")
    grad_key = gradient(grad_key, key, "grad_key")
    grad_value = gradient(grad_value, value, "grad_value")
    grad_attn_mask = optional_array_argument(grad_attn_mask, "grad_attn_mask")
    grad_sinks = optional_array_argument(grad_sinks, "grad_sinks")

    _mha.attention_backward(grad_out, query, key, value, out, lse, grad_query, grad_key,
                            grad_value, attn_mask, valid_lens, grad_attn_mask, sinks, grad_sinks,
                            scale, causal, enable_gqa, dropout_p, dropout_seed, window_left,
                            window_right, softcap, alibi_slopes, backend, threads)
    mark_written(grad_query, grad_key, grad_value, grad_attn_mask, grad_sinks)
    return grad_query, grad_key, grad_value
