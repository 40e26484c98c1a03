"""mha.varlen_attention: FlashAttention-2's flash_attn_varlen_func, computed by mha."""
from typing import Any, Optional, Tuple, Union

from . import _mha
from ._arguments import call_settings, flag, integer, real
from ._arrays import (Array, array_argument, empty_like_framework, mark_written,
                      optional_array_argument, shape_of)
from ._attention import _causal_mode, _dropout_seed, _grad_wanted, _window_argument


def varlen_attention(
        q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Optional[Array] = None,
        max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
        dropout_p: float = 0.0, softmax_scale: Optional[float] = None, causal: bool = False,
        window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
        alibi_slopes: Optional[Array] = None, deterministic: bool = False,
        return_attn_probs: bool = False, block_table: Optional[Array] = None, *,
        sinks: Optional[Array] = None, causal_alignment: str = "bottom-right",
        return_lse: bool = False, out: Optional[Array] = None, backend: Optional[str] = None,
        threads: Optional[int] = None, dropout_seed: Optional[int] = None,
        k_scale: Optional[Array] = None, v_scale: Optional[Array] = None,
        seqused_k: Optional[Array] = None,
) -> Union[Array, Tuple[Array, Array], Tuple[Array, Array, Any]]:
    """A packed batch of sequences of different lengths, as FlashAttention-2's flash_attn_varlen_func.

    Sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 of q
    (and of the result), its keys and values rows cu_seqlens_k[b] ..
    cu_seqlens_k[b+1]-1 of k and v -- or, with a block_table, the first keys
    of its pages in a paged KV cache; each is computed as
    mha.scaled_dot_product_attention would compute it alone, with its own
    lengths (the causal rule, the window and ALiBi are aligned per sequence).
    Nothing is padded: no work is spent on rows or keys of other sequences.

    Arguments as FlashAttention-2's (same names, positions and meaning):

    q: [total_q, H, D]; k: [total_k, Hkv, D]; v: [total_k, Hkv, Dv] -- NumPy
        arrays or PyTorch tensors (or any DLPack array) on the CPU, float32,
        bfloat16 or float16 (k and v share one dtype, which may also be int8
        with k_scale and v_scale), with any strides.  H must be a multiple of
        Hkv (grouped-query attention: query head h uses key/value head
        h // (H // Hkv)).  With a block_table, k and v are a paged cache
        [num_blocks, block_size, Hkv, D] and [num_blocks, block_size, Hkv,
        Dv], block_size a multiple of 8 (FlashAttention-2 wants 256).
    cu_seqlens_q, cu_seqlens_k: int32 [B + 1], the cumulative lengths: 0, then
        non-decreasing, ending at total_q (total_k).  A sequence may have no
        queries (it gives nothing) or no keys (its rows are zeros).  Required
        without a block table.  With one, cu_seqlens_k is FlashAttention-2's
        way to give each sequence's number of keys: sequence b uses the
        first cu_seqlens_k[b+1] - cu_seqlens_k[b] keys of its pages (mha
        passes these differences to the library as seqused_k); give it or
        seqused_k, not both.
    max_seqlen_q, max_seqlen_k: the longest sequence's length, which
        FlashAttention-2 needs to size its work; mha does not, and None is
        accepted.  When given, a longer sequence (in cu_seqlens_q,
        cu_seqlens_k or seqused_k) raises ValueError.
    dropout_p: probability of zeroing an attention weight (the kept ones are
        scaled by 1 / (1 - dropout_p)); 0 computes exactly.  Sequence b draws
        its weights with the seed dropout_seed + b (mha's counter-based hash,
        not FlashAttention-2's generator).
    softmax_scale: the factor of the scores; None is 1 / sqrt(D).
    causal: query i of a sequence sees keys j <= i + Lk - Lq of that sequence:
        aligned to the bottom-right corner, as FlashAttention-2 (>= 2.1) does
        (`causal_alignment` below chooses the other corner).  With Lq = Lk
        (self-attention) both corners are j <= i.
    window_size: (left, right), a sliding window: key j takes part in query
        i's row iff i + Lk - Lq - left <= j <= i + Lk - Lq + right; -1 leaves
        a side unbounded.
    softcap: scores become softcap * tanh(score / softcap); 0 is off.
    alibi_slopes: float32 [H] or [B, H]: adds -slope * |i + Lk - Lq - j| to
        the scores.
    deterministic: accepted for FlashAttention-2's callers; mha's results are
        the same bits for any thread count whatever its value (the option
        concerns FlashAttention-2's backward pass).
    return_attn_probs: FlashAttention-2's (out, softmax_lse, S_dmask): the
        LSE as return_lse gives it and None, which is what FlashAttention-2
        returns as S_dmask without dropout; with dropout_p > 0 it raises
        NotImplementedError (mha never materialises the probabilities).
    block_table: int32 [B, max_blocks], a paged KV cache (vLLM's and
        FlashAttention-2's layout; None: packed k and v): key j of sequence b
        is row j % block_size of block block_table[b][j // block_size].  Only
        the entries a sequence's keys address are read, and must be in
        [0, num_blocks); blocks may be shared (a common prefix).  Decoding is
        one query per sequence; chunked prefill (several new queries at the
        end of each cache) wants causal=True (bottom-right).

    mha's own, keyword-only:

    sinks: float32 [H], per-head logits that join each row's softmax
        denominator without a value row (gpt-oss); -inf is no sink.
    causal_alignment: "bottom-right" (the default, FlashAttention-2's) or
        "top-left" (PyTorch's is_causal: j <= i).
    return_lse: also return the log-sum-exp of each row's scaled, masked
        scores, float32 [H, total_q] (FlashAttention-2's softmax_lse layout).
        A row in which no key takes part is zeros with LSE -inf (its sink
        with sinks); FlashAttention-2 gives +inf there.
    out: an array of shape [total_q, H, Dv] to write the result into (float32
        or q's dtype); it is returned.
    backend, threads: for this call only (see mha.scaled_dot_product_attention).
    dropout_seed: the 64-bit seed of dropout (None draws one from `random`).
    k_scale, v_scale: the float32 row scales of an int8 k and v, [total_k, Hkv]
        each: mha.quantize_kv(k) on the packed k gives both (one scale per row
        of D values); [num_blocks, block_size, Hkv] for a paged cache, as
        mha.kv_cache_write fills them.
    seqused_k: int32 [B], the number of keys sequence b uses (vLLM's and
        FlashAttention-3's argument): with a block table the keys of its
        pages (give this or cu_seqlens_k); with packed keys the first
        seqused_k[b] of its rows in cu_seqlens_k (optional).

    Gradients: on torch tensors, while autograd is on, the call is recorded
    for torch's autograd when q, k, v or sinks requires grad (packed k and v,
    float32, bfloat16 or float16); backward() runs mha's backward on each
    sequence as a call of its own (its views of the packed tensors, its
    ALiBi row, its dropout seed), writing its rows of the gradients; key
    rows no query reads get zeros, sinks' gradient is the sequences' sum.
    The results are the same bits for any thread count.  A paged cache, an
    int8 cache, out= and alibi_slopes, k_scale or v_scale that require grad
    are refused then (ValueError or TypeError).

    Returns the result [total_q, H, Dv] in q's framework and dtype -- or
    `out` --, `(out, lse)` with return_lse, `(out, lse, None)` with
    return_attn_probs.  Raises mha.Error (a RuntimeError) when the library
    refuses the call, with its message (naming varlen->cu_seqlens_q,
    varlen->block_table[b][n], lse, ...); TypeError or ValueError for
    arguments of the wrong Python type or rank, and ValueError for a
    block_table without exactly one of cu_seqlens_k and seqused_k.
    """
    q = array_argument(q, "q")
    k = array_argument(k, "k")
    v = array_argument(v, "v")
    cu_seqlens_q = array_argument(cu_seqlens_q, "cu_seqlens_q")
    cu_seqlens_k = optional_array_argument(cu_seqlens_k, "cu_seqlens_k")
    block_table = optional_array_argument(block_table, "block_table")
    seqused_k = optional_array_argument(seqused_k, "seqused_k")
    if block_table is None and cu_seqlens_k is None:
        raise TypeError("cu_seqlens_k is None: without a block_table, k and v are packed and "
                        "cu_seqlens_k (int32 [B + 1]) says where each sequence's keys are")
    if block_table is not None and (cu_seqlens_k is None) == (seqused_k is None):
        raise ValueError("block_table needs each sequence's number of keys from exactly one of "
                         "cu_seqlens_k (FlashAttention-2: its differences) and seqused_k "
                         "(vLLM), not " + ("both" if seqused_k is not None else "neither"))
    limit = 2**31 - 1
    max_seqlen_q = None if max_seqlen_q is None else integer(max_seqlen_q, "max_seqlen_q", 0, limit)
    max_seqlen_k = None if max_seqlen_k is None else integer(max_seqlen_k, "max_seqlen_k", 0, limit)
    dropout_p = real(dropout_p, "dropout_p")
    softmax_scale = None if softmax_scale is None else real(softmax_scale, "softmax_scale")
    causal_mode = _causal_mode(flag(causal, "causal"), causal_alignment)
    window_left, window_right = _window_argument(window_size)
    softcap = real(softcap, "softcap")
    alibi_slopes = optional_array_argument(alibi_slopes, "alibi_slopes")
    flag(deterministic, "deterministic")
    return_attn_probs = flag(return_attn_probs, "return_attn_probs")
    if return_attn_probs and dropout_p > 0.0:
        raise NotImplementedError("return_attn_probs with dropout_p > 0: mha never materialises "
                                  "the attention probabilities (return_lse=True gives the LSE)")
    sinks = optional_array_argument(sinks, "sinks")
    return_lse = flag(return_lse, "return_lse") or return_attn_probs
    dropout_seed = _dropout_seed(dropout_seed, dropout_p)
    k_scale = optional_array_argument(k_scale, "k_scale")
    v_scale = optional_array_argument(v_scale, "v_scale")
    backend, threads = call_settings(backend, threads)

    q_shape = shape_of(q)
    if len(q_shape) != 3:
        raise ValueError(f"q must be packed [total_q, H, D] (3 dimensions), not {len(q_shape)}")
    v_shape = shape_of(v)
    rank = 3 if block_table is None else 4
    for name, shape in (("k", shape_of(k)), ("v", v_shape)):
        if len(shape) != rank:
            layout = "packed [total_k, Hkv, D] (a paged cache needs a block_table)" \
                if block_table is None else "a paged cache [num_blocks, block_size, Hkv, D]"
            raise ValueError(f"{name} must have {rank} dimensions, has {len(shape)}: with"
                             f"{'out' if block_table is None else ''} a block_table it is "
                             f"{layout}")
    if _grad_wanted(q, k, v, sinks, alibi_slopes, k_scale, v_scale):
        # Training (FlashAttention-2's varlen function is differentiable): through mha's
        # torch.autograd.Function (mha/_varlen_autograd.py).
        from ._varlen_autograd import VarlenOptions, varlen_with_grad
        options = VarlenOptions(
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=softmax_scale,
            causal=causal_mode, dropout_p=dropout_p, dropout_seed=dropout_seed,
            window_left=window_left, window_right=window_right, softcap=softcap,
            alibi_slopes=alibi_slopes, backend=backend, threads=threads)
        out, lse = varlen_with_grad(q, k, v, sinks, block_table, k_scale, v_scale, out, options)
        if return_attn_probs:
            return out, lse, None
        return (out, lse) if return_lse else out
    if out is None:
        out = empty_like_framework(q, tuple(q_shape[:-1]) + tuple(v_shape[-1:]))
    else:
        out = array_argument(out, "out")
    lse = empty_like_framework(q, (q_shape[1], q_shape[0]), "float32") if return_lse else None

    _mha.varlen_attention(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                          max_seqlen_q, max_seqlen_k, lse, k_scale, v_scale, softmax_scale,
                          causal_mode, dropout_p, dropout_seed, window_left, window_right, sinks,
                          softcap, alibi_slopes, backend, threads)
    mark_written(out)
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


# FlashAttention-2's name, for code written against it.
flash_attn_varlen_func = varlen_attention
