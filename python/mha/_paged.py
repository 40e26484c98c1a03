"""A paged KV cache: mha.kv_cache_write (vLLM's reshape_and_cache) and
mha.flash_attn_with_kvcache (FlashAttention-2's decoding call), over mha_kv_cache_write and
mha_attention_varlen."""
from typing import Optional, Tuple, Union

import numpy as np

from . import _mha
from ._arguments import call_settings, flag, integer, real
from ._arrays import (Array, array_argument, empty_like_framework, is_torch_tensor,
                      mark_written, optional_array_argument, shape_of)
from ._attention import _causal_mode, _window_argument


def kv_cache_write(key: Array, value: Array, key_cache: Array, value_cache: Array,
                   slot_mapping: Array, key_scale_cache: Optional[Array] = None,
                   value_scale_cache: Optional[Array] = None) -> None:
    """Writes a step's new keys and values into their slots of a paged KV cache, in place.

    vLLM's reshape_and_cache (its flash layout): token t's rows go to row
    slot % block_size of block slot // block_size, slot = slot_mapping[t].

    key: [T, Hkv, D]; value: [T, Hkv, Dv] -- float32, bfloat16 or float16 (one
        dtype), NumPy arrays or PyTorch tensors (or any DLPack array) on the
        CPU, any strides.
    key_cache: [num_blocks, block_size, Hkv, D]; value_cache: [num_blocks,
        block_size, Hkv, Dv] -- float32, bfloat16, float16 or int8 (one dtype),
        writable (a read-only NumPy array raises TypeError), block_size a
        multiple of 8.  Written in place: the rows are converted to the
        cache's dtype (rounded to nearest, ties to even); for an int8 cache
        each row is quantised as mha.quantize_kv does it (scale = max|row| /
        127) and its scale written to the scale cache.
    slot_mapping: int32 or int64 [T]; a negative slot skips its token
        (padding).  Slots must be below num_blocks * block_size and must not
        repeat.
    key_scale_cache, value_scale_cache: float32 [num_blocks, block_size, Hkv],
        writable: required with an int8 cache (pass them to
        mha.varlen_attention as k_scale and v_scale), refused otherwise.

    Returns None.  Every check -- finite values for an int8 cache included --
    runs before anything is written: a refused call leaves the caches as they
    were.  Raises mha.Error (naming key, value, key_cache, value_cache,
    slot_mapping[t], key_scale_cache or value_scale_cache) when the library
    refuses the arrays; TypeError or ValueError for arguments of the wrong
    Python type or rank.
    """
    key = array_argument(key, "key")
    value = array_argument(value, "value")
    key_cache = array_argument(key_cache, "key_cache")
    value_cache = array_argument(value_cache, "value_cache")
    slot_mapping = array_argument(slot_mapping, "slot_mapping")
    key_scale_cache = optional_array_argument(key_scale_cache, "key_scale_cache")
    value_scale_cache = optional_array_argument(value_scale_cache, "value_scale_cache")
    _mha.kv_cache_write(key, value, key_cache, value_cache, slot_mapping, key_scale_cache,
                        value_scale_cache)
    mark_written(key_cache, value_cache, key_scale_cache, value_scale_cache)


def _reshaped(x, shape):
    """x with a new shape: a view when its strides allow it (else a copy), in its framework."""
    if type(x) is np.ndarray or is_torch_tensor(x):
        return x.reshape(shape)
    return np.from_dlpack(x).reshape(shape)


def _integer_values(x, name):
    """The values of an integer array (NumPy, torch or DLPack) as a NumPy array."""
    if type(x) is np.ndarray:
        values = x
    elif is_torch_tensor(x):
        values = x.detach().numpy()
    else:
        values = np.from_dlpack(x)
    if values.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32), not {values.dtype}")
    return values


def _first(x, count):
    """The first `count` entries of x along its first dimension, in its framework."""
    if type(x) is np.ndarray or is_torch_tensor(x):
        return x[:count]
    return np.from_dlpack(x)[:count]


def _renamed(error, note):
    """The same error (mha.Error with its status, TypeError, ValueError) with a note on how
    this function's arguments reached the extension, whose message names them as it knows
    them."""
    renamed = type(error)(f"{error} ({note})")
    if isinstance(error, _mha.Error):
        renamed.status = error.status
    return renamed


def _cache_lengths(cache_seqlens, batch, capacity, capacity_is, new):
    """cache_seqlens as int64 [B], checked: each length plus the new tokens fits the cache."""
    scalar = cache_seqlens is None or (isinstance(cache_seqlens, (int, np.integer))
                                       and not isinstance(cache_seqlens, bool))
    if cache_seqlens is None:
        lengths = np.full(batch, capacity, dtype=np.int64)
    elif scalar:
        lengths = np.full(batch, int(cache_seqlens), dtype=np.int64)
    else:
        lengths = _integer_values(array_argument(cache_seqlens, "cache_seqlens"), "cache_seqlens")
        if lengths.shape != (batch,):
            raise ValueError(f"cache_seqlens has shape {list(lengths.shape)}; it must be [B] = "
                             f"[{batch}] (or an int)")
        lengths = lengths.astype(np.int64)
    wrong = np.flatnonzero((lengths < 0) | (lengths + new > capacity))
    if wrong.size:
        b = int(wrong[0])
        at = "cache_seqlens" if scalar else f"cache_seqlens[{b}]"
        raise ValueError(f"{at} = {lengths[b]}" + (f" plus {new} new tokens (k, v)" if new else "")
                         + f" does not fit the cache: it must be in [0, {capacity - new}] "
                         f"({capacity_is}" + (f" - {new}" if new else "") + ")")
    return lengths


def _append(k, v, k_cache, v_cache, k_scale, v_scale, lengths, table, block_size):
    """Writes k and v [B, Lnew, Hkv, D] at positions lengths[b] + t of each sequence."""
    k_shape, v_shape = shape_of(k), shape_of(v)
    batch, new = len(lengths), k_shape[1] if len(k_shape) == 4 else -1
    for name, shape in (("k", k_shape), ("v", v_shape)):
        if len(shape) != 4 or shape[0] != batch or shape[1] != new:
            also = "" if name == "k" else " and k's seqlen_new"
            raise ValueError(f"{name} has shape {list(shape)}; it must be [B, seqlen_new, Hkv, "
                             f"D] with q's B = {batch}{also}")
    positions = lengths[:, None] + np.arange(new)[None, :]  # [B, Lnew]
    if table is None:  # a dense cache [B_c, S, Hkv, D]: block b is sequence b
        rows = np.arange(batch)[:, None]
    else:
        columns = positions // block_size
        rows = table[np.arange(batch)[:, None], columns]
    slots = (rows.astype(np.int64) * block_size + positions % block_size).reshape(-1)
    try:
        _mha.kv_cache_write(_reshaped(k, (batch * new,) + tuple(k_shape[2:])),
                            _reshaped(v, (batch * new,) + tuple(v_shape[2:])), k_cache, v_cache,
                            slots, k_scale, v_scale)
    except (_mha.Error, TypeError, ValueError) as error:
        raise _renamed(error, "flash_attn_with_kvcache writes k and v as key and value into "
                       "k_cache and v_cache as key_cache and value_cache, k_scale and v_scale "
                       "as the scale caches, at the slots cache_seqlens[b] + t"
                       + ("" if table is None else " of block_table's blocks")) from None
    mark_written(k_cache, v_cache, k_scale, v_scale)


def flash_attn_with_kvcache(
        q: Array, k_cache: Array, v_cache: Array, k: Optional[Array] = None,
        v: Optional[Array] = None, rotary_cos: Optional[Array] = None,
        rotary_sin: Optional[Array] = None, cache_seqlens: Union[int, Array, None] = None,
        cache_batch_idx: Optional[Array] = None, cache_leftpad: Optional[Array] = None,
        block_table: Optional[Array] = None, softmax_scale: Optional[float] = None,
        causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
        rotary_interleaved: bool = True, alibi_slopes: Optional[Array] = None,
        num_splits: int = 0, return_softmax_lse: bool = False, *,
        sinks: Optional[Array] = None, causal_alignment: str = "bottom-right",
        backend: Optional[str] = None, threads: Optional[int] = None,
        k_scale: Optional[Array] = None, v_scale: Optional[Array] = None,
) -> Union[Array, Tuple[Array, Array]]:
    """Attention of new queries over a KV cache, as FlashAttention-2's flash_attn_with_kvcache.

    The queries q [B, seqlen_q, H, D] of each sequence b are the last tokens
    of its cache, which holds cache_seqlens[b] keys (plus the seqlen_new
    tokens of k and v, when given, which are first written into the cache in
    place).  mha computes it as mha.varlen_attention over a packed batch of B
    sequences of seqlen_q queries each: with a block_table over the paged
    cache (the library's seqused_k = cache_seqlens + seqlen_new), without one
    over the dense cache [B, S, Hkv, D] seen as packed keys [B * S, Hkv, D]
    (read in place when its first two dimensions merge, as in a contiguous
    cache; copied otherwise).

    Arguments as FlashAttention-2's (same names, positions and meaning):

    q: [B, seqlen_q, H, D], float32, bfloat16 or float16, any strides (read in
        place when its first two dimensions merge, copied otherwise).
    k_cache, v_cache: [B_c, S, Hkv, D] and [B_c, S, Hkv, Dv] (B_c >= B; the
        first B are used), or with a block_table a paged cache [num_blocks,
        block_size, Hkv, D / Dv] (block_size a multiple of 8; FlashAttention-2
        wants 256).  float32, bfloat16, float16, or int8 with k_scale and
        v_scale.  H must be a multiple of Hkv.
    k, v: optional [B, seqlen_new, Hkv, D / Dv] new keys and values, written
        into the cache at positions cache_seqlens[b] .. cache_seqlens[b] +
        seqlen_new - 1 (mha.kv_cache_write: converted to the cache's dtype,
        quantised for an int8 cache) before the attention, which then covers
        them.  Needs cache_seqlens; without a block table, S must be a multiple
        of 8 (the dense cache is written as one block of S rows per sequence).
        The write happens first: should the attention then refuse an argument
        the checks here cannot see, the new rows are in the cache already.
    rotary_cos, rotary_sin, rotary_interleaved: mha applies no rotary
        embedding; rotary_cos or rotary_sin raise NotImplementedError (rotate q
        and k before the call).
    cache_seqlens: int, or int32 [B]: the number of keys each sequence has in
        the cache before k and v are added.  None: the whole cache (S, or
        max_blocks * block_size).
    cache_batch_idx: NotImplementedError (index the cache yourself, or use a
        block_table: a dense cache with S a multiple of 8 is the paged cache
        of block_size S with block_table = cache_batch_idx[:, None]).
    cache_leftpad: NotImplementedError (a cache's keys start at row 0).
    block_table: int32 [B, max_blocks], a paged KV cache: key j of sequence b is
        row j % block_size of block block_table[b][j // block_size].
    softmax_scale, causal, window_size, softcap, alibi_slopes: as in
        mha.varlen_attention; causal is aligned to the bottom-right corner
        (query i of seqlen_q sees keys j <= i + seqlen_k - seqlen_q).
    num_splits: FlashAttention-2's split of the keys; mha splits long caches by
        their shape alone (the same bits for any thread count), so the value
        is checked (an int >= 0) and otherwise ignored.
    return_softmax_lse: also return the LSE, float32 [B, H, seqlen_q].

    mha's own, keyword-only: sinks, causal_alignment, backend, threads as in
    mha.varlen_attention; k_scale, v_scale: the float32 row scales of an int8
    cache, [B_c, S, Hkv] or, paged, [num_blocks, block_size, Hkv] (the scale
    caches mha.kv_cache_write fills).

    Returns out [B, seqlen_q, H, Dv] in q's framework and dtype, or (out, lse)
    with return_softmax_lse.  Raises ValueError naming cache_seqlens[b] when
    a sequence's keys do not fit the cache, ValueError or TypeError for
    arguments of the wrong shape or type, and mha.Error with the library's
    message (k_cache and v_cache reach it as k and v, the lengths as
    seqused_k; the message says so).
    """
    q = array_argument(q, "q")
    k_cache = array_argument(k_cache, "k_cache")
    v_cache = array_argument(v_cache, "v_cache")
    k = optional_array_argument(k, "k")
    v = optional_array_argument(v, "v")
    if rotary_cos is not None or rotary_sin is not None:
        raise NotImplementedError("rotary_cos, rotary_sin: mha applies no rotary embedding; "
                                  "rotate q and k before the call")
    flag(rotary_interleaved, "rotary_interleaved")
    if cache_batch_idx is not None:
        raise NotImplementedError(
            "cache_batch_idx: index the cache yourself, or pass a block_table (a dense cache "
            "[B_c, S, Hkv, D] with S a multiple of 8 is the paged cache of block_size S with "
            "block_table = cache_batch_idx[:, None])")
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad: mha's cache rows start at row 0 of each "
                                  "sequence")
    block_table = optional_array_argument(block_table, "block_table")
    softmax_scale = None if softmax_scale is None else real(softmax_scale, "softmax_scale")
    causal_mode = _causal_mode(flag(causal, "causal"), causal_alignment)
    window_left, window_right = _window_argument(window_size)
    softcap = real(softcap, "softcap")
    alibi_slopes = optional_array_argument(alibi_slopes, "alibi_slopes")
    integer(num_splits, "num_splits", 0)
    return_softmax_lse = flag(return_softmax_lse, "return_softmax_lse")
    sinks = optional_array_argument(sinks, "sinks")
    k_scale = optional_array_argument(k_scale, "k_scale")
    v_scale = optional_array_argument(v_scale, "v_scale")
    backend, threads = call_settings(backend, threads)

    q_shape = shape_of(q)
    if len(q_shape) != 4:
        raise ValueError(f"q must be [B, seqlen_q, H, D] (4 dimensions), not {len(q_shape)}")
    batch, seqlen_q, heads = q_shape[0], q_shape[1], q_shape[2]
    k_shape, v_shape = shape_of(k_cache), shape_of(v_cache)
    for name, shape in (("k_cache", k_shape), ("v_cache", v_shape)):
        if len(shape) != 4:
            what = "[num_blocks, block_size, Hkv, D]" if block_table is not None \
                else "[B_c, S, Hkv, D]"
            raise ValueError(f"{name} must be {what} (4 dimensions), not {len(shape)}")
    if (k is None) != (v is None):
        raise ValueError("k and v: give both (the new keys and values) or neither")
    new = shape_of(k)[1] if k is not None and len(shape_of(k)) == 4 else 0
    if k is not None and cache_seqlens is None:
        raise ValueError("k and v need cache_seqlens: the new tokens go after each sequence's "
                         "cache_seqlens[b] keys")
    table = None
    if block_table is not None:
        table_shape = shape_of(block_table)
        if len(table_shape) != 2:
            raise ValueError(f"block_table must be [B, max_blocks] (2 dimensions), not "
                             f"{len(table_shape)}")
        capacity, block_size = table_shape[1] * k_shape[1], k_shape[1]
        capacity_is = f"max_blocks * block_size = {table_shape[1]} * {block_size}"
    else:
        if k_shape[0] < batch:
            raise ValueError(f"k_cache has {k_shape[0]} sequences ([B_c, S, Hkv, D]); q has "
                             f"B = {batch}")
        capacity = block_size = k_shape[1]
        capacity_is = "S, k_cache's shape[1]"
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None and len(shape_of(scale)) != 3:
                raise ValueError(f"{name} must be [B_c, S, Hkv] (3 dimensions), not "
                                 f"{len(shape_of(scale))}")
        if k is not None and block_size % 8 != 0:
            raise ValueError(f"k, v: appending into a dense k_cache [B_c, S, Hkv, D] needs S = "
                             f"{block_size} to be a multiple of 8 (mha's block size); pass a "
                             "block_table, or write the rows yourself")
    lengths = _cache_lengths(cache_seqlens, batch, capacity, capacity_is, new)

    if k is not None:
        if block_table is not None:
            table = _integer_values(block_table, "block_table")
            if table.shape[0] != batch:
                raise ValueError(f"block_table has {table.shape[0]} rows; q has B = {batch}")
            # The entries the new tokens' slots come from (the attention checks the rest).
            needed = (-(-(lengths + new) // block_size))[:, None]
            columns = np.arange(table.shape[1])[None, :]
            wrong = np.argwhere((columns < needed) & ((table < 0) | (table >= k_shape[0])))
            if wrong.size:
                b, n = (int(i) for i in wrong[0])
                raise ValueError(f"block_table[{b}][{n}] = {table[b, n]}; sequence {b}'s keys "
                                 f"need it in [0, {k_shape[0]}) (num_blocks)")
        _append(k, v, k_cache, v_cache, k_scale, v_scale, lengths, table, block_size)

    seqused = (lengths + new).astype(np.int32)
    cu_q = np.arange(batch + 1, dtype=np.int32) * np.int32(seqlen_q)
    packed_q = _reshaped(q, (batch * seqlen_q,) + tuple(q_shape[2:]))
    out = empty_like_framework(q, (batch, seqlen_q, heads, v_shape[-1]))
    packed_out = _reshaped(out, (batch * seqlen_q, heads, v_shape[-1]))  # a view: out is new
    lse = empty_like_framework(q, (heads, batch * seqlen_q), "float32") \
        if return_softmax_lse else None
    if block_table is not None:
        keys, values, cu_k, scales = k_cache, v_cache, None, (k_scale, v_scale)
    else:  # the first B sequences of the dense cache as packed keys
        stored = k_shape[1]
        keys = _reshaped(_first(k_cache, batch), (batch * stored,) + tuple(k_shape[2:]))
        values = _reshaped(_first(v_cache, batch), (batch * stored,) + tuple(v_shape[2:]))
        cu_k = np.arange(batch + 1, dtype=np.int32) * np.int32(stored)
        scales = tuple(None if s is None else _reshaped(_first(s, batch), (batch * stored,)
                                                        + tuple(shape_of(s)[2:]))
                       for s in (k_scale, v_scale))
    try:
        _mha.varlen_attention(packed_q, keys, values, packed_out, cu_q, cu_k, seqused,
                              block_table, None, None, lse, scales[0], scales[1], softmax_scale,
                              causal_mode, 0.0, 0, window_left, window_right, sinks, softcap,
                              alibi_slopes, backend, threads)
    except (_mha.Error, TypeError, ValueError) as error:
        raise _renamed(error, "flash_attn_with_kvcache passes k_cache and v_cache as the "
                       "library's k and v, q as [B * seqlen_q, H, D], cache_seqlens (plus "
                       "seqlen_new) as seqused_k, k_scale and v_scale as k_scale and v_scale"
                       ) from None
    if lse is None:
        return out
    lse = _reshaped(lse, (heads, batch, seqlen_q))
    if is_torch_tensor(lse):
        return out, lse.permute(1, 0, 2).contiguous()
    return out, np.ascontiguousarray(lse.transpose(1, 0, 2))
