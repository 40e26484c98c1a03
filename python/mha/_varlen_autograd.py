"""varlen_attention under torch's autograd, as FlashAttention-2's flash_attn_varlen_func is:
a torch.autograd.Function whose forward is mha_attention_varlen (the LSE kept) and whose
backward is one mha_attention_varlen_backward call over the packed tensors.

A packed sequence is computed as a call of its own with B = 1 (mha.h), so its gradients are
that call's: the C call gives each sequence the bits of mha_attention_backward on it alone
(its own lengths, ALiBi row and dropout seed dropout_seed + b), written straight into its
rows of the packed gradients, with every sequence's work balanced over the threads together.
Key rows no query sees (beyond seqused_k, or of a sequence without queries) get zeros, as do
the query rows of a sequence without keys; the sinks' gradient is the sum of the sequences'
(in float64, rounded once), so the results are the same bits for any thread count.  A paged
KV cache (inference) has no gradient.

Imported by mha._varlen only when a tensor that requires grad reaches it while autograd is
on, so torch is imported only where the caller already has.
"""
import torch

from . import _mha
from ._grad_checks import refuse_out, requiring_grad
from ._once import once_differentiable
from ._saved import keep_for_backward, saved_inputs

_GRADIENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class VarlenOptions:
    """varlen_attention's other arguments, as the extension takes them."""

    __slots__ = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q", "max_seqlen_k",
                 "scale", "causal", "dropout_p", "dropout_seed", "window_left", "window_right",
                 "softcap", "alibi_slopes", "backend", "threads")

    def __init__(self, **values):
        for name, value in values.items():
            setattr(self, name, value)


def varlen_with_grad(q, k, v, sinks, block_table, k_scale, v_scale, out, options):
    """(out, lse) of varlen_attention recorded for autograd, after the checks that only a call
    with gradients needs (ValueError or TypeError naming the argument)."""
    tensors = {"q": q, "k": k, "v": v, "sinks": sinks}
    # One of them requires grad: mha._varlen came here for it.
    culprit = requiring_grad(
        tensors, {"alibi_slopes": options.alibi_slopes, "k_scale": k_scale,
                  "v_scale": v_scale}, "q, k, v and sinks")
    if block_table is not None:
        raise ValueError(f"{culprit} requires grad, but a paged KV cache (block_table) has no "
                         "gradient: pack k and v with cu_seqlens_k, or call under "
                         "torch.no_grad()")
    refuse_out(out, culprit)
    for name in ("q", "k", "v"):
        x = tensors[name]
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor when {culprit} requires grad (the "
                            f"gradients flow through torch's autograd), not "
                            f"{type(x).__name__}")
        if x.dtype not in _GRADIENT_DTYPES:
            because = "requires grad" if name == culprit else f"{culprit} requires grad"
            raise TypeError(f"{name} is {str(x.dtype).replace('torch.', '')} and {because}: "
                            "mha's gradients take float32, bfloat16 and float16 q, k and v (an "
                            "int8 KV cache has none); convert it, or call under "
                            "torch.no_grad()")
    return _Varlen.apply(q, k, v, sinks, options)


class _Varlen(torch.autograd.Function):
    """(out, lse) = varlen attention of q, k, v (and sinks) with the options; lse is not
    differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, options):
        o = options
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        _mha.varlen_attention(q, k, v, out, o.cu_seqlens_q, o.cu_seqlens_k, o.seqused_k, None,
                              o.max_seqlen_q, o.max_seqlen_k, lse, None, None, o.scale,
                              o.causal, o.dropout_p, o.dropout_seed, o.window_left,
                              o.window_right, sinks, o.softcap, o.alibi_slopes, o.backend,
                              o.threads)
        # Every array the backward reads, the lengths and the ALiBi slopes too.
        keep_for_backward(ctx, out, lse, (q, k, v, sinks, o.cu_seqlens_q, o.cu_seqlens_k,
                                          o.seqused_k, o.alibi_slopes), options)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        out, lse, q, k, v, sinks, cu_q, cu_k, used, slopes = saved_inputs(ctx, 2)
        o = ctx.options
        wants = ctx.needs_input_grad
        # Every row is written by the call, zeros where no query reads a key and for query
        # rows without keys.
        grad_q, grad_k, grad_v = (torch.empty(x.shape, dtype=x.dtype) for x in (q, k, v))
        grad_sinks = torch.empty(sinks.shape, dtype=torch.float32) if wants[3] else None
        _mha.attention_varlen_backward(
            grad_out, q, k, v, out, lse, grad_q, grad_k, grad_v, cu_q, cu_k, used, sinks,
            grad_sinks, o.scale, o.causal, o.dropout_p, o.dropout_seed, o.window_left,
            o.window_right, o.softcap, slopes, o.backend, o.threads)
        return (grad_q if wants[0] else None, grad_k if wants[1] else None,
                grad_v if wants[2] else None, grad_sinks, None)
