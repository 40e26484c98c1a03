"""FlashAttention-2's packed-input calls -- q, k and v (or k and v) stacked in one array --
as views of that array given to flash_attn_func and varlen_attention: nothing is copied,
and under autograd the gradients flow back into the packed array."""
from typing import Any, Optional, Tuple

from ._arrays import Array, array_argument, shape_of
from ._flash import flash_attn_func
from ._varlen import varlen_attention


def _unstack(x, name, axis, count):
    """The `count` arrays stacked along `axis` of x, as views."""
    x = array_argument(x, name)
    shape = shape_of(x)
    if len(shape) <= axis or shape[axis] != count:
        raise ValueError(f"{name} has shape {list(shape)}; it must have {count} at dimension "
                         f"{axis} (FlashAttention-2's packed layout)")
    index = (slice(None),) * axis
    return tuple(x[index + (i,)] for i in range(count))


def flash_attn_qkvpacked_func(
        qkv: Array, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
        causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
        alibi_slopes: Optional[Array] = None, deterministic: bool = False,
        return_attn_probs: bool = False, **mha_keywords: Any) -> Any:
    """FlashAttention-2's flash_attn_qkvpacked_func: qkv [B, L, 3, H, D] (self-attention),
    computed as flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], ...) on views;
    mha's keywords (sinks, return_lse, out, backend, threads, dropout_seed, ...) as there."""
    q, k, v = _unstack(qkv, "qkv", 2, 3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, **mha_keywords)


def flash_attn_kvpacked_func(
        q: Array, kv: Array, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
        causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
        alibi_slopes: Optional[Array] = None, deterministic: bool = False,
        return_attn_probs: bool = False, **mha_keywords: Any) -> Any:
    """FlashAttention-2's flash_attn_kvpacked_func: q [B, L, H, D], kv [B, S, 2, Hkv, D],
    computed as flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], ...) on views."""
    k, v = _unstack(kv, "kv", 2, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, **mha_keywords)


def flash_attn_varlen_qkvpacked_func(
        qkv: Array, cu_seqlens: Array, max_seqlen: Optional[int] = None,
        dropout_p: float = 0.0, softmax_scale: Optional[float] = None, causal: bool = False,
        window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
        alibi_slopes: Optional[Array] = None, deterministic: bool = False,
        return_attn_probs: bool = False, **mha_keywords: Any) -> Any:
    """FlashAttention-2's flash_attn_varlen_qkvpacked_func: qkv [total, 3, H, D], one
    cu_seqlens for queries and keys, computed as varlen_attention on views."""
    q, k, v = _unstack(qkv, "qkv", 1, 3)
    return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                            softmax_scale, causal, window_size, softcap, alibi_slopes,
                            deterministic, return_attn_probs, **mha_keywords)


def flash_attn_varlen_kvpacked_func(
        q: Array, kv: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
        max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
        dropout_p: float = 0.0, softmax_scale: Optional[float] = None, causal: bool = False,
        window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
        alibi_slopes: Optional[Array] = None, deterministic: bool = False,
        return_attn_probs: bool = False, **mha_keywords: Any) -> Any:
    """FlashAttention-2's flash_attn_varlen_kvpacked_func: q [total_q, H, D], kv [total_k, 2,
    Hkv, D], computed as varlen_attention on views."""
    k, v = _unstack(kv, "kv", 1, 2)
    return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            dropout_p, softmax_scale, causal, window_size, softcap,
                            alibi_slopes, deterministic, return_attn_probs, **mha_keywords)
