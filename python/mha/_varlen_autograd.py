"""varlen_attention under torch's autograd, as FlashAttention-2's flash_attn_varlen_func is:
a torch.autograd.Function whose forward is mha_attention_varlen (the LSE kept) and whose
backward runs mha_attention_backward on each sequence's views of the packed tensors.

A packed sequence is computed as a call of its own with B = 1 (mha.h), so its gradients are
that call's: sequence b's rows of q, k, v, out, grad_out and its columns of the LSE are
read in place as [1, H, L, D] views, its gradients written straight into its rows of the
packed gradients, with its own lengths, ALiBi row and dropout seed (dropout_seed + b).  Key
rows no query sees (beyond seqused_k, or of a sequence without queries) get zeros; the
sinks' gradient is the sum of the sequences', in their order, so the results are the same
bits for any thread count.  A paged KV cache (inference) has no gradient.

Imported by mha._varlen only when a tensor that requires grad reaches it while autograd is
on, so torch is imported only where the caller already has.
"""
import numpy as np
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


def _host_ints(x):
    """An int32 array or tensor of the call as a NumPy int64 array (a copy)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.array(x, dtype=np.int64)


def _sequence(x, start, stop):
    """Rows start..stop-1 of a packed [total, H, D] tensor as a [1, H, L, D] view."""
    return x[start:stop].unsqueeze(0).transpose(1, 2)


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
        starts_q, starts_k = _host_ints(cu_q), _host_ints(cu_k)
        lengths_k = starts_k[1:] - starts_k[:-1]
        if used is not None:
            lengths_k = np.minimum(lengths_k, _host_ints(used))
        per_sequence_slopes = slopes is not None and len(slopes.shape) == 2
        # Zeros where no query reads a key, and for rows without keys.
        grad_q, grad_k, grad_v = (torch.zeros(x.shape, dtype=x.dtype) for x in (q, k, v))
        grad_sinks = torch.zeros(sinks.shape, dtype=torch.float32) if wants[3] else None
        for b in range(len(starts_q) - 1):
            q0, q1 = int(starts_q[b]), int(starts_q[b + 1])
            k0, k1 = int(starts_k[b]), int(starts_k[b]) + int(lengths_k[b])
            if q1 == q0 or k1 == k0:
                continue
            sequence_sinks = torch.empty(sinks.shape, dtype=torch.float32) if wants[3] else None
            _mha.attention_backward(
                _sequence(grad_out, q0, q1), _sequence(q, q0, q1), _sequence(k, k0, k1),
                _sequence(v, k0, k1), _sequence(out, q0, q1), lse[:, q0:q1].unsqueeze(0),
                _sequence(grad_q, q0, q1), _sequence(grad_k, k0, k1),
                _sequence(grad_v, k0, k1), None, None, None, sinks, sequence_sinks, o.scale,
                o.causal, True, o.dropout_p, (o.dropout_seed + b) % 2**64, o.window_left,
                o.window_right, o.softcap, slopes[b] if per_sequence_slopes else slopes,
                o.backend, o.threads)
            if grad_sinks is not None:
                grad_sinks += sequence_sinks
        return (grad_q if wants[0] else None, grad_k if wants[1] else None,
                grad_v if wants[2] else None, grad_sinks, None)
