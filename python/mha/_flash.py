"""mha.flash_attn_func: FlashAttention-2's flash_attn_func, computed by mha."""
from typing import Any, Optional, Tuple, Union

from ._arguments import flag, real
from ._arrays import Array, array_argument, empty_like_framework, is_torch_tensor, shape_of
from ._attention import _grad_wanted, scaled_dot_product_attention


def _heads_major(x):
    """A [B, L, H, D] array as its [B, H, L, D] view (nothing copied)."""
    return x.transpose(1, 2) if is_torch_tensor(x) else x.transpose(0, 2, 1, 3)


def flash_attn_func(
        q: Array, k: Array, v: Array, dropout_p: float = 0.0,
        softmax_scale: Optional[float] = None, causal: bool = False,
        window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
        alibi_slopes: Optional[Array] = None, deterministic: bool = False,
        return_attn_probs: bool = False, *, sinks: Optional[Array] = None,
        causal_alignment: str = "bottom-right", return_lse: bool = False,
        out: Optional[Array] = None, backend: Optional[str] = None,
        threads: Optional[int] = None, dropout_seed: Optional[int] = None,
) -> Union[Array, Tuple[Array, Array], Tuple[Array, Array, Any]]:
    """FlashAttention-2's flash_attn_func: a batch of sequences of one length, token-major.

    Arguments as FlashAttention-2's (same names, positions and meaning):

    q: [B, L, H, D]; k: [B, S, Hkv, D]; v: [B, S, Hkv, Dv] -- NumPy arrays or
        PyTorch tensors on the CPU, float32, bfloat16 or float16, any strides
        (read in place: mha reads the [B, H, L, D] views, never a copy).  H
        must be a multiple of Hkv (grouped-query attention).
    dropout_p: probability of zeroing a weight (mha's counter-based hash with
        dropout_seed, not FlashAttention-2's generator); 0 computes exactly.
    softmax_scale: the factor of the scores; None is 1 / sqrt(D).
    causal: query i sees keys j <= i + S - L, aligned to the bottom-right
        corner as FlashAttention-2 (>= 2.1) does (causal_alignment below).
    window_size: (left, right), the sliding window aligned the same way; -1
        leaves a side unbounded.
    softcap: scores become softcap * tanh(score / softcap); 0 is off.
    alibi_slopes: float32 [H] or [B, H]: adds -slope * |i + S - L - j|.
    deterministic: accepted; mha's results are the same bits for any thread
        count, forward and backward.
    return_attn_probs: FlashAttention-2's (out, softmax_lse, S_dmask): the LSE
        float32 [B, H, L] and None (what FlashAttention-2 returns as S_dmask
        without dropout); with dropout_p > 0 NotImplementedError (mha never
        materialises the probabilities).

    mha's own, keyword-only, as in scaled_dot_product_attention: sinks,
    causal_alignment ("bottom-right" or PyTorch's "top-left"), return_lse,
    out (a [B, L, H, Dv] array to write into), backend, threads, dropout_seed.

    Returns the result [B, L, H, Dv] in q's framework and dtype (a new
    contiguous array, or `out`; under autograd a contiguous copy of the
    differentiable result), `(out, lse)` with return_lse, `(out, lse, None)`
    with return_attn_probs.  Differentiable on torch tensors as
    scaled_dot_product_attention is.  Raises as scaled_dot_product_attention
    does (its messages name the [B, H, L, D] views q, k and v).
    """
    q = array_argument(q, "q")
    k = array_argument(k, "k")
    v = array_argument(v, "v")
    for name, x in (("q", q), ("k", k), ("v", v)):
        rank = len(shape_of(x))
        if rank != 4:
            raise ValueError(f"{name} must be [B, L, H, D] (4 dimensions), not {rank}")
    flag(deterministic, "deterministic")
    return_attn_probs = flag(return_attn_probs, "return_attn_probs")
    if return_attn_probs and real(dropout_p, "dropout_p") > 0.0:
        raise NotImplementedError("return_attn_probs with dropout_p > 0: mha never materialises "
                                  "the attention probabilities (return_lse=True gives the LSE)")
    want_lse = flag(return_lse, "return_lse") or return_attn_probs
    if out is None and not _grad_wanted(q, k, v, sinks, alibi_slopes):
        b, length, heads, _ = shape_of(q)
        out = empty_like_framework(q, (b, length, heads, shape_of(v)[-1]))
    elif out is not None:
        out = array_argument(out, "out")
    result = scaled_dot_product_attention(
        _heads_major(q), _heads_major(k), _heads_major(v), None, dropout_p, causal,
        softmax_scale, True, causal_alignment=causal_alignment, return_lse=want_lse,
        out=None if out is None else _heads_major(out), backend=backend, threads=threads,
        dropout_seed=dropout_seed, window_size=window_size, sinks=sinks, softcap=softcap,
        alibi_slopes=alibi_slopes)
    lse = None
    if want_lse:
        result, lse = result
    if out is None:  # the differentiable result, [B, L, H, Dv] and contiguous as FlashAttention's
        out = _heads_major(result).contiguous()
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if want_lse else out
