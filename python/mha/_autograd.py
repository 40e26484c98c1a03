"""scaled_dot_product_attention under torch's autograd: a torch.autograd.Function whose
forward is mha_attention (with the LSE kept) and whose backward is mha_attention_backward.

Imported by mha._attention only when a tensor that requires grad reaches it while
autograd is on, so torch is imported only where the caller already has.
"""
import torch

from . import _mha
from ._arrays import zeros_like_array
from ._broadcast import broadcast_leading
from ._empty import empty_result
from ._grad_checks import refuse_out, requiring_grad
from ._once import once_differentiable
from ._saved import keep_for_backward, saved_inputs

# The arguments that have a gradient, in the order _Attention.apply takes them.
_DIFFERENTIABLE = ("query", "key", "value", "attn_mask", "sinks")

# The dtypes of query, key and value that the backward takes (mha_attention_backward widens
# half-precision ones to fp32 as it reads them and rounds each gradient once, at the end).
_GRADIENT_DTYPES = ("float32", "bfloat16", "float16")


class _Options:
    """The forward's other arguments, as the extension takes them (kept for the backward)."""

    __slots__ = ("valid_lens", "k_scale", "v_scale", "scale", "causal", "enable_gqa",
                 "dropout_p", "dropout_seed", "window_left", "window_right", "softcap",
                 "alibi_slopes", "backend", "threads")

    def __init__(self, **values):
        for name, value in values.items():
            setattr(self, name, value)


def attention_with_grad(query, key, value, attn_mask, valid_lens, k_scale, v_scale, scale, causal,
                        enable_gqa, dropout_p, dropout_seed, window_left, window_right, sinks,
                        softcap, alibi_slopes, backend, threads, out, return_lse):
    """scaled_dot_product_attention's arguments, checked and resolved (dropout_seed drawn), on
    the path that records the call for autograd; returns what it returns."""
    inputs = dict(zip(_DIFFERENTIABLE, (query, key, value, attn_mask, sinks)))
    # One of them requires grad: mha._attention came here for it.
    culprit = requiring_grad(
        inputs, {"alibi_slopes": alibi_slopes, "k_scale": k_scale, "v_scale": v_scale},
        "query, key, value, a float attn_mask and sinks")
    refuse_out(out, culprit)
    if not isinstance(query, torch.Tensor):  # the result follows query's framework
        raise TypeError(f"query must be a torch tensor when {culprit} requires grad (the "
                        f"gradients flow through torch's autograd), not {type(query).__name__}")
    for name in ("query", "key", "value"):
        dtype = str(getattr(inputs[name], "dtype", "")).replace("torch.", "")
        if dtype not in _GRADIENT_DTYPES:
            because = "requires grad" if name == culprit else f"{culprit} requires grad"
            raise TypeError(
                f"{name} is {dtype} and {because}: mha's gradients take float32, bfloat16 "
                "and float16 query, key and value (an int8 KV cache has no gradient); "
                "convert it, or call under torch.no_grad()")
    views = broadcast_leading(query, key, value, enable_gqa)
    if views is not None:  # expand's backward sums the gradients over what it broadcast
        query, key, value = views
    if scale == 0.0:  # PyTorch's: every score 0 (query's gradient 0, key's too)
        query, scale = zeros_like_array(query), 1.0
    if any(0 in x.shape for x in (query, key, value)):  # PyTorch's empty or zero result
        from ._attention import _mhas_own_options
        empty = empty_result(query, key, value, attn_mask, scale, enable_gqa, dropout_p, None,
                             return_lse, _mhas_own_options(valid_lens, k_scale, v_scale,
                                                           window_left, window_right, sinks,
                                                           softcap, alibi_slopes))
        if empty is not None:
            return empty[0]
    options = _Options(valid_lens=valid_lens, k_scale=k_scale, v_scale=v_scale, scale=scale,
                       causal=causal, enable_gqa=enable_gqa, dropout_p=dropout_p,
                       dropout_seed=dropout_seed, window_left=window_left,
                       window_right=window_right, softcap=softcap, alibi_slopes=alibi_slopes,
                       backend=backend, threads=threads)
    out, lse = _Attention.apply(query, key, value, attn_mask, sinks, options)
    return (out, lse) if return_lse else out


class _Attention(torch.autograd.Function):
    """(out, lse) = attention(query, key, value, attn_mask, sinks; options); lse is not
    differentiable.  The backward regenerates dropout's mask from the saved seed."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, sinks, options):
        out = query.new_empty(query.shape[:-1] + value.shape[-1:])
        lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
        o = options
        _mha.attention(query, key, value, out, attn_mask, o.valid_lens, lse, o.k_scale,
                       o.v_scale, o.scale, o.causal, o.enable_gqa, o.dropout_p, o.dropout_seed,
                       o.window_left, o.window_right, sinks, o.softcap, o.alibi_slopes,
                       o.backend, o.threads)
        # Every array the backward reads, the valid lengths and the ALiBi slopes too.
        keep_for_backward(ctx, out, lse, (query, key, value, attn_mask, sinks, o.valid_lens,
                                          o.alibi_slopes), options)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        out, lse, query, key, value, attn_mask, sinks, valid_lens, alibi_slopes = \
            saved_inputs(ctx, 2)
        wants = ctx.needs_input_grad
        o = ctx.options

        def gradient(x, dtype=None):
            if dtype is None:  # a NumPy array's (which gets none back) in float32
                dtype = x.dtype if isinstance(x, torch.Tensor) else torch.float32
            return torch.empty(tuple(x.shape), dtype=dtype)

        # query's, key's and value's in their own dtypes, as autograd hands them on (a
        # half-precision gradient is the library's fp32 sum rounded once); a float mask's
        # and the sinks' in float32, the dtype the library writes them in.
        grad_query, grad_key, grad_value = gradient(query), gradient(key), gradient(value)
        grad_mask = gradient(attn_mask, torch.float32) if wants[3] else None
        grad_sinks = gradient(sinks, torch.float32) if wants[4] else None
        _mha.attention_backward(grad_out, query, key, value, out, lse, grad_query, grad_key,
                                grad_value, attn_mask, valid_lens, grad_mask, sinks,
                                grad_sinks, o.scale, o.causal, o.enable_gqa, o.dropout_p,
                                o.dropout_seed, o.window_left, o.window_right, o.softcap,
                                alibi_slopes, o.backend, o.threads)
        if grad_mask is not None and grad_mask.dtype != attn_mask.dtype:
            grad_mask = grad_mask.to(attn_mask.dtype)  # a half-precision mask's own dtype
        return (grad_query if wants[0] else None, grad_key if wants[1] else None,
                grad_value if wants[2] else None, grad_mask, grad_sinks, None)
