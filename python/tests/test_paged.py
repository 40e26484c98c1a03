"""A paged KV cache from Python: mha.varlen_attention / flash_attn_varlen_func with a
block_table (seqused_k, or FlashAttention-2's cu_seqlens_k), mha.kv_cache_write (vLLM's
reshape_and_cache, in place) and mha.flash_attn_with_kvcache (FlashAttention-2's decoding
call).  Each sequence is checked against the float64 NumPy reference on its keys gathered
from the pages through the table; blocks are shuffled, a prefix is shared, blocks no
sequence uses hold NaN and the table's unused entries garbage, so reading either is
caught."""
import numpy as np
import pytest

import mha
from conftest import assert_close, dtype_name, to_float64
import reference

GARBAGE = (-1, 2**31 - 1)  # unused table entries: never read


def paged_cache(rng, lens_k, Hkv=2, D=16, Dv=12, block_size=16, dtype=np.float32, spare=2):
    """k_cache [num_blocks, block_size, Hkv, D], v_cache [.., Dv] and the int32 table
    [B, max_blocks]: each sequence's blocks drawn from a shuffled order, sequence 1 starting
    with sequence 0's first block when both need two or more (a shared prefix), `spare`
    blocks nobody uses full of NaN, unused entries garbage."""
    need = [-(-n // block_size) for n in lens_k]
    share = len(lens_k) > 1 and need[0] > 1 and need[1] > 1
    num_blocks = sum(need) + spare - (1 if share else 0)
    order = iter(rng.permutation(num_blocks))
    table = np.empty((len(lens_k), max(need) + 1), dtype=np.int32)
    for b, blocks in enumerate(need):
        table[b] = GARBAGE[b % 2]
        for n in range(blocks):
            table[b, n] = table[0, 0] if (share and b == 1 and n == 0) else next(order)
    k_cache = rng.standard_normal((num_blocks, block_size, Hkv, D)).astype(dtype)
    v_cache = rng.standard_normal((num_blocks, block_size, Hkv, Dv)).astype(dtype)
    for block in order:  # the spare ones
        k_cache[block] = np.nan
        v_cache[block] = np.nan
    return k_cache, v_cache, table


def gather(cache, table, b, length):
    """Sequence b's first `length` rows of a paged cache as float64 [1, Hkv, length, D]."""
    cache = to_float64(cache)
    table = np.asarray(table)
    j = np.arange(length)
    rows = cache[table[b, j // cache.shape[1]], j % cache.shape[1]]  # [length, Hkv, D]
    return rows.transpose(1, 0, 2)[None]


def check_paged(q, k_cache, v_cache, table, cu_q, used, out, lse, *, out_dtype="float32",
                sinks=None, alibi_slopes=None, k_values=None, v_values=None, **ref_kwargs):
    """Each sequence's rows of out [total_q, H, Dv] and lse [H, total_q] (None: not
    checked) against the reference on its keys gathered from the pages (k_values, v_values:
    the caches' values when they are not the caches themselves, e.g. int8 times the
    scales)."""
    q, out = to_float64(q), to_float64(out)
    lse = None if lse is None else to_float64(lse)
    cu_q, used = np.asarray(cu_q), np.asarray(used)
    k_values = k_cache if k_values is None else k_values
    v_values = v_cache if v_values is None else v_values
    H = out.shape[1]
    for b in range(len(used)):
        q0, lq, lk = int(cu_q[b]), int(cu_q[b + 1] - cu_q[b]), int(used[b])
        if lq == 0:
            continue
        rows_out = out[q0:q0 + lq].transpose(1, 0, 2)[None]
        rows_lse = None if lse is None else lse[:, q0:q0 + lq][None]
        if lk == 0:
            assert np.all(rows_out == 0.0), f"sequence {b}"
            if rows_lse is None:
                continue
            want = np.full((1, H, lq), -np.inf) if sinks is None else np.broadcast_to(
                np.asarray(sinks, dtype=np.float64)[None, :, None], (1, H, lq))
            assert np.array_equal(rows_lse, want), f"sequence {b}"
            continue
        slopes = alibi_slopes
        if slopes is not None and np.ndim(slopes) == 2:
            slopes = np.asarray(slopes)[b]
        ref, ref_lse, max_logit = reference.attention(
            q[q0:q0 + lq].transpose(1, 0, 2)[None], gather(k_values, table, b, lk),
            gather(v_values, table, b, lk), sinks=sinks, alibi_slopes=slopes, **ref_kwargs)
        assert_close(rows_out, ref, max_logit, out_dtype=out_dtype)
        if rows_lse is None:
            continue
        finite = np.isfinite(ref_lse)
        assert np.array_equal(np.isfinite(rows_lse), finite), f"sequence {b}"
        np.testing.assert_allclose(rows_lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5,
                                   err_msg=f"sequence {b}")


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


# Lengths 0 and 1, a block +-1 (for 8 and 16), long ones over several decode tiles.
DECODE_LENS = [33, 0, 1, 7, 8, 9, 15, 16, 17, 100, 1025]


@pytest.mark.parametrize("block_size", [8, 16, 256])
def test_decode(rng, block_size):
    k_cache, v_cache, table = paged_cache(rng, DECODE_LENS, block_size=block_size)
    used = np.array(DECODE_LENS, dtype=np.int32)
    cu_q = offsets([1] * len(used))
    q = rng.standard_normal((len(used), 8, 16)).astype(np.float32)  # H 8, Hkv 2
    out, lse = mha.varlen_attention(q, k_cache, v_cache, cu_q, block_table=table,
                                    seqused_k=used, return_lse=True)
    assert out.shape == (len(used), 8, 12) and lse.shape == (8, len(used))
    check_paged(q, k_cache, v_cache, table, cu_q, used, out, lse)


def test_chunked_prefill_with_the_variants(rng):
    lens_q, lens_k = [5, 1, 17, 0, 9, 40], [40, 300, 17, 9, 9, 700]
    k_cache, v_cache, table = paged_cache(rng, lens_k, block_size=24, D=32, Dv=8)
    used, cu_q = np.array(lens_k, dtype=np.int32), offsets(lens_q)
    q = rng.standard_normal((cu_q[-1], 4, 32)).astype(np.float32)
    out, lse = mha.varlen_attention(q, k_cache, v_cache, cu_q, block_table=table, seqused_k=used,
                                    causal=True, return_lse=True)
    check_paged(q, k_cache, v_cache, table, cu_q, used, out, lse, is_causal=True,
                alignment="bottom-right")
    slopes = rng.uniform(0.0, 0.3, (len(lens_q), 4)).astype(np.float32)
    sinks = np.array([0.5, -np.inf, 2.0, -1.0], dtype=np.float32)
    out, lse = mha.varlen_attention(q, k_cache, v_cache, cu_q, block_table=table, seqused_k=used,
                                    causal=True, softmax_scale=0.2, window_size=(30, 0),
                                    softcap=4.0, alibi_slopes=slopes, sinks=sinks,
                                    return_lse=True)
    check_paged(q, k_cache, v_cache, table, cu_q, used, out, lse, sinks=sinks,
                alibi_slopes=slopes, scale=0.2, is_causal=True, alignment="bottom-right",
                window=(30, 0), softcap=4.0)


def test_cu_seqlens_k_as_flash_attention_2_gives_it(rng):
    # FlashAttention-2 takes a paged cache's lengths as cu_seqlens_k's differences: the
    # same bits as seqused_k, by keyword and in its positions.
    lens_q, lens_k = [1, 3, 1, 6], [20, 64, 0, 7]
    k_cache, v_cache, table = paged_cache(rng, lens_k, block_size=16)
    cu_q, cu_k, used = offsets(lens_q), offsets(lens_k), np.array(lens_k, dtype=np.int32)
    q = rng.standard_normal((cu_q[-1], 4, 16)).astype(np.float32)
    want, want_lse = mha.varlen_attention(q, k_cache, v_cache, cu_q, block_table=table,
                                          seqused_k=used, causal=True, return_lse=True)
    check_paged(q, k_cache, v_cache, table, cu_q, used, want, want_lse, is_causal=True,
                alignment="bottom-right")
    by_keyword = mha.varlen_attention(q, k_cache, v_cache, cu_q, cu_k, block_table=table,
                                      causal=True)
    # flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    #     dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
    #     return_attn_probs, block_table)
    out, lse, probs = mha.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 6, 64, 0.0,
                                                 None, True, (-1, -1), 0.0, None, False, True,
                                                 table)
    assert np.array_equal(by_keyword, want) and np.array_equal(out, want)
    assert np.array_equal(lse, want_lse) and probs is None
    # max_seqlen_k bounds the lengths however they come.
    with pytest.raises(ValueError, match="max_seqlen_k = 63 but sequence 1 of seqused_k uses 64"):
        mha.varlen_attention(q, k_cache, v_cache, cu_q, block_table=table, seqused_k=used,
                             max_seqlen_k=63)
    with pytest.raises(ValueError, match="max_seqlen_k = 63 but sequence 1 of cu_seqlens_k has"):
        mha.varlen_attention(q, k_cache, v_cache, cu_q, cu_k, None, 63, block_table=table)


def test_seqused_k_with_packed_keys(rng):
    lens_q, lens_k, used = [2, 1, 4], [10, 30, 5], np.array([7, 30, 0], dtype=np.int32)
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    q = rng.standard_normal((cu_q[-1], 4, 16)).astype(np.float32)
    k = rng.standard_normal((cu_k[-1], 2, 16)).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], 2, 12)).astype(np.float32)
    out, lse = mha.varlen_attention(q, k, v, cu_q, cu_k, causal=True, seqused_k=used,
                                    return_lse=True)
    # The packed keys as a "cache" of one block per row, through an identity table.
    one_row = k[:, None], v[:, None]
    table = np.stack([cu_k[b] + np.arange(30) for b in range(3)]).astype(np.int32)
    check_paged(q, *one_row, table, cu_q, used, out, lse, is_causal=True,
                alignment="bottom-right")


def test_bad_paged_arguments(rng):
    lens_k = [20, 35]
    k_cache, v_cache, table = paged_cache(rng, lens_k, block_size=16)
    used, cu_q, cu_k = np.array(lens_k, dtype=np.int32), offsets([1, 2]), offsets(lens_k)
    q = rng.standard_normal((3, 4, 16)).astype(np.float32)
    out = np.full((3, 4, 12), 7.0, dtype=np.float32)
    with pytest.raises(ValueError, match="block_table needs .* not neither"):
        mha.varlen_attention(q, k_cache, v_cache, cu_q, block_table=table)
    with pytest.raises(ValueError, match="block_table needs .* not both"):
        mha.varlen_attention(q, k_cache, v_cache, cu_q, cu_k, block_table=table, seqused_k=used)
    with pytest.raises(TypeError, match="cu_seqlens_k is None: without a block_table"):
        mha.varlen_attention(q, k_cache, v_cache, cu_q, seqused_k=used)
    with pytest.raises(TypeError, match="block_table must be a NumPy array"):
        mha.varlen_attention(q, k_cache, v_cache, cu_q, block_table=[[0, 1]], seqused_k=used)
    with pytest.raises(ValueError, match="block_table must have 2 dimensions"):
        mha.varlen_attention(q, k_cache, v_cache, cu_q, block_table=table[0], seqused_k=used,
                             out=out)
    bad_table = table.copy()
    bad_table[1, 2] = k_cache.shape[0]
    spread = np.ascontiguousarray(np.repeat(table, 2, axis=1))[:, ::2]  # rows not contiguous
    cases = [
        ("block_table\\[1\\]\\[2\\] = ", dict(block_table=bad_table, seqused_k=used)),
        ("seqused_k\\[0\\] = 1000; it must be in \\[0, ",
         dict(block_table=table, seqused_k=np.array([1000, 35], np.int32))),
        ("seqused_k has dtype i64", dict(block_table=table, seqused_k=used.astype(np.int64))),
        ("block_table has dtype i64", dict(block_table=table.astype(np.int64), seqused_k=used)),
        ("block_table has stride", dict(block_table=spread, seqused_k=used)),
        ("block_size", dict(k=k_cache[:, :12], v=v_cache[:, :12], block_table=table,
                            seqused_k=used)),
        # FlashAttention-2's cu_seqlens_k, checked before its differences become seqused_k.
        ("cu_seqlens_k\\[2\\] = 10 is below cu_seqlens_k\\[1\\] = 20",
         dict(cu_seqlens_k=np.array([0, 20, 10], np.int32), block_table=table)),
        ("cu_seqlens_k\\[0\\] = 5; it must be 0",
         dict(cu_seqlens_k=np.array([5, 20, 30], np.int32), block_table=table)),
        ("cu_seqlens_k has dtype i64", dict(cu_seqlens_k=cu_k.astype(np.int64),
                                            block_table=table)),
        ("cu_seqlens_k has shape \\[4\\] but cu_seqlens_q has 3 entries",
         dict(cu_seqlens_k=offsets([1, 2, 3]), block_table=table)),
        ("k_scale", dict(block_table=table, seqused_k=used,
                         k_scale=np.ones((3, 16, 2), np.float32),
                         v_scale=np.ones((3, 16, 2), np.float32))),
    ]
    for message, change in cases:
        args = dict(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu_q, out=out)
        args.update(change)
        with pytest.raises(mha.Error, match=message):
            mha.varlen_attention(**args)
        assert np.all(out == 7.0), message


# --------------------------------------------------------------- kv_cache_write


def test_kv_cache_write_in_place(rng):
    T, Hkv, D, Dv = 9, 2, 16, 12
    key = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    value = rng.standard_normal((T, Hkv, Dv)).astype(np.float32)
    slots = rng.permutation(4 * 8)[:T].astype(np.int64)
    slots[4] = -1  # padding: skipped
    k_cache = np.full((4, 8, Hkv, D), 5.0, dtype=np.float32)
    v_cache = np.full((4, 8, Hkv, Dv), 5.0, dtype=np.float32)
    k_data = k_cache.__array_interface__["data"][0]
    assert mha.kv_cache_write(key, value, k_cache, v_cache, slots) is None
    assert k_cache.__array_interface__["data"][0] == k_data  # the caller's array, in place
    flat_k, flat_v = k_cache.reshape(32, Hkv, D), v_cache.reshape(32, Hkv, Dv)
    for t, slot in enumerate(slots):
        if slot >= 0:
            assert np.array_equal(flat_k[slot], key[t]) and np.array_equal(flat_v[slot], value[t])
    untouched = np.setdiff1d(np.arange(32), slots)
    assert np.all(flat_k[untouched] == 5.0) and np.all(flat_v[untouched] == 5.0)
    # int32 slots and strided rows (a [T, D, Hkv] buffer seen as [T, Hkv, D]) do the same.
    strided = np.ascontiguousarray(key.transpose(0, 2, 1)).transpose(0, 2, 1)
    again = np.full_like(k_cache, 5.0)
    mha.kv_cache_write(strided, value, again, np.full_like(v_cache, 5.0), slots.astype(np.int32))
    assert np.array_equal(again, k_cache)


def test_kv_cache_write_int8_then_attend(rng):
    # A server's steps: prefill then two decode steps, each sequence's tokens written into
    # its pages of an int8 cache; then attention over the pages against the reference on the
    # quantised values, which are within half a step of the tokens written.
    lens = [19, 1, 40]
    H, Hkv, D, block = 8, 2, 16, 8
    need = [-(-(n + 2) // block) for n in lens]
    num_blocks = sum(need) + 1
    order = iter(rng.permutation(num_blocks))
    table = np.full((3, max(need)), -1, dtype=np.int32)
    for b, n in enumerate(need):
        table[b, :n] = [next(order) for _ in range(n)]
    k8 = np.zeros((num_blocks, block, Hkv, D), np.int8)
    v8 = np.zeros((num_blocks, block, Hkv, D), np.int8)
    k_scale = np.full((num_blocks, block, Hkv), np.nan, np.float32)
    v_scale = np.full((num_blocks, block, Hkv), np.nan, np.float32)
    tokens_k = [np.zeros((0, Hkv, D), np.float32) for _ in lens]
    tokens_v = [np.zeros((0, Hkv, D), np.float32) for _ in lens]
    steps = [lens, [1, 1, 1], [1, 0, 1]]  # new tokens per sequence and step
    for step in steps:
        keys, values, slots = [], [], []
        for b, n in enumerate(step):
            start = len(tokens_k[b])
            new_k = rng.standard_normal((n, Hkv, D)).astype(np.float32)
            new_v = rng.standard_normal((n, Hkv, D)).astype(np.float32)
            tokens_k[b] = np.concatenate([tokens_k[b], new_k])
            tokens_v[b] = np.concatenate([tokens_v[b], new_v])
            keys.append(new_k)
            values.append(new_v)
            j = start + np.arange(n)
            slots.append(table[b, j // block].astype(np.int64) * block + j % block)
        mha.kv_cache_write(np.concatenate(keys), np.concatenate(values), k8, v8,
                           np.concatenate(slots), k_scale, v_scale)
    used = np.array([len(t) for t in tokens_k], dtype=np.int32)
    k_values = k8.astype(np.float64) * k_scale[..., None]
    v_values = v8.astype(np.float64) * v_scale[..., None]
    for b in range(3):
        written = gather(k_values, table, b, used[b])[0].transpose(1, 0, 2)
        step = gather(k_scale[..., None], table, b, used[b])[0].transpose(1, 0, 2)
        assert np.all(np.abs(written - tokens_k[b]) <= 0.5 * step * (1 + 1e-6)), b
    cu_q = offsets([1, 1, 3])
    q = rng.standard_normal((5, H, D)).astype(np.float32)
    out, lse = mha.varlen_attention(q, k8, v8, cu_q, block_table=table, seqused_k=used,
                                    causal=True, k_scale=k_scale, v_scale=v_scale,
                                    return_lse=True)
    check_paged(q, k8, v8, table, cu_q, used, out, lse, k_values=k_values, v_values=v_values,
                is_causal=True, alignment="bottom-right")


def test_kv_cache_write_bad_input(rng):
    key = rng.standard_normal((4, 2, 16)).astype(np.float32)
    value = rng.standard_normal((4, 2, 16)).astype(np.float32)
    k_cache = np.full((2, 8, 2, 16), 5.0, np.float32)
    v_cache = np.full((2, 8, 2, 16), 5.0, np.float32)
    slots = np.array([3, 9, 0, 15], np.int64)
    cases = [
        ("slot_mapping\\[2\\]", dict(slot_mapping=np.array([3, 9, 16, 15], np.int64))),
        ("slot_mapping\\[1\\] and slot_mapping\\[3\\]",
         dict(slot_mapping=np.array([3, 9, 0, 9], np.int64))),
        ("slot_mapping", dict(slot_mapping=slots[:3])),
        ("slot_mapping has dtype f32", dict(slot_mapping=slots.astype(np.float32))),
        ("value_cache", dict(value_cache=np.full((2, 8, 2, 16), 5.0, np.float16))),
        ("key_cache", dict(key_cache=np.full((2, 8, 2, 12), 5.0, np.float32))),
        ("block_size", dict(key_cache=np.full((4, 4, 2, 16), 5.0, np.float32),
                            value_cache=np.full((4, 4, 2, 16), 5.0, np.float32))),
        ("key_scale_cache", dict(key_scale_cache=np.zeros((2, 8, 2), np.float32),
                                 value_scale_cache=np.zeros((2, 8, 2), np.float32))),
    ]
    for message, change in cases:
        args = dict(key=key, value=value, key_cache=k_cache, value_cache=v_cache,
                    slot_mapping=slots)
        args.update(change)
        with pytest.raises(mha.Error, match=message):
            mha.kv_cache_write(**args)
        assert np.all(k_cache == 5.0) and np.all(v_cache == 5.0), message
    # An int8 cache: the scale caches are required, and a NaN is refused before any write.
    k8, v8 = np.zeros((2, 8, 2, 16), np.int8), np.zeros((2, 8, 2, 16), np.int8)
    ks, vs = np.full((2, 8, 2), -1.0, np.float32), np.full((2, 8, 2), -1.0, np.float32)
    with pytest.raises(mha.Error, match="scale_cache"):
        mha.kv_cache_write(key, value, k8, v8, slots)
    spoiled = value.copy()
    spoiled[3, 1, 2] = np.nan
    with pytest.raises(mha.Error, match="value\\[3\\]\\[1\\]\\[2\\]"):
        mha.kv_cache_write(key, spoiled, k8, v8, slots, ks, vs)
    assert np.all(k8 == 0) and np.all(v8 == 0) and np.all(ks == -1.0) and np.all(vs == -1.0)
    # Python-level refusals name the argument too.
    read_only = k_cache.copy()
    read_only.flags.writeable = False
    with pytest.raises(TypeError, match="key_cache"):
        mha.kv_cache_write(key, value, read_only, v_cache, slots)
    with pytest.raises(TypeError, match="slot_mapping must be a NumPy array"):
        mha.kv_cache_write(key, value, k_cache, v_cache, [3, 9, 0, 15])
    with pytest.raises(ValueError, match="key must have 3 dimensions"):
        mha.kv_cache_write(key[None], value, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="value_scale_cache must have 3 dimensions"):
        mha.kv_cache_write(key, value, k8, v8, slots, ks, vs[0])


def test_torch_tensors():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(7)
    rng = np.random.default_rng(7)
    lens_k = [30, 5, 64]
    k_np, v_np, table_np = paged_cache(rng, lens_k, block_size=16, D=16, Dv=16)
    # A bf16 cache filled through kv_cache_write from float32 tokens (rounded to nearest).
    k_cache = torch.zeros(k_np.shape, dtype=torch.bfloat16)
    v_cache = torch.zeros(v_np.shape, dtype=torch.bfloat16)
    slots = torch.randperm(k_np.shape[0] * 16, generator=gen)[:40]
    key, value = torch.randn(40, 2, 16, generator=gen), torch.randn(40, 2, 16, generator=gen)
    mha.kv_cache_write(key, value, k_cache, v_cache, slots)
    flat = k_cache.reshape(-1, 2, 16)
    assert torch.equal(flat[slots], key.to(torch.bfloat16))
    assert torch.equal(v_cache.reshape(-1, 2, 16)[slots], value.to(torch.bfloat16))
    # Attention over it with torch offsets and table.
    k_cache = torch.from_numpy(k_np).to(torch.bfloat16)
    v_cache = torch.from_numpy(v_np).to(torch.bfloat16)
    table = torch.from_numpy(table_np)
    cu_q = torch.tensor([0, 1, 3, 4], dtype=torch.int32)
    used = torch.tensor(lens_k, dtype=torch.int32)
    q = torch.randn(4, 4, 16, generator=gen).to(torch.bfloat16)
    # Not avx512bf16, whose bf16 dot products round P (test_half.py has their tolerance).
    out, lse = mha.varlen_attention(q, k_cache, v_cache, cu_q, block_table=table, seqused_k=used,
                                    causal=True, return_lse=True,
                                    backend="avx512" if "avx512" in mha.backends() else None)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    check_paged(q, k_cache, v_cache, table_np, cu_q.numpy(), used.numpy(), out, lse,
                out_dtype=dtype_name(out), is_causal=True, alignment="bottom-right")
    grad_cache = torch.zeros(k_np.shape, requires_grad=True)
    with pytest.raises(ValueError, match="key_cache requires grad"):
        mha.kv_cache_write(key, value, grad_cache, v_cache.float(), slots)


# --------------------------------------------------------------- flash_attn_with_kvcache


def with_kvcache_reference(q, k_values, v_values, table, lengths, out, lse=None, **kwargs):
    """out [B, Lq, H, Dv] (and lse [B, H, Lq]) of flash_attn_with_kvcache against the
    reference per sequence: its Lq queries over its lengths[b] keys."""
    B, Lq, H = q.shape[0], q.shape[1], q.shape[2]
    q, out = to_float64(q), to_float64(out)
    assert out.shape[:3] == (B, Lq, H)
    packed_lse = None
    if lse is not None:
        lse = to_float64(lse)
        assert lse.shape == (B, H, Lq)
        packed_lse = lse.transpose(1, 0, 2).reshape(H, B * Lq)
    check_paged(q.reshape(B * Lq, H, q.shape[3]), k_values, v_values, table,
                np.arange(B + 1) * Lq, lengths, out.reshape(B * Lq, H, out.shape[3]), packed_lse,
                **kwargs)


@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_flash_attn_with_kvcache_paged(rng, seqlen_q):
    lens = [40, 3, 17, 64]
    k_cache, v_cache, table = paged_cache(rng, lens, block_size=16)
    B, H = len(lens), 8
    q = rng.standard_normal((B, seqlen_q, H, 16)).astype(np.float32)
    lengths = np.array(lens, dtype=np.int32)
    out, lse = mha.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                           block_table=table, causal=True,
                                           return_softmax_lse=True)
    assert out.shape == (B, seqlen_q, H, 12) and lse.shape == (B, H, seqlen_q)
    with_kvcache_reference(q, k_cache, v_cache, table, lengths, out, lse, is_causal=True,
                           alignment="bottom-right")
    # The same bits as varlen_attention on the packed queries.
    packed = mha.varlen_attention(q.reshape(B * seqlen_q, H, 16), k_cache, v_cache,
                                  np.arange(B + 1, dtype=np.int32) * seqlen_q, block_table=table,
                                  seqused_k=lengths, causal=True)
    assert np.array_equal(out.reshape(packed.shape), packed)


def test_flash_attn_with_kvcache_appends_new_tokens(rng):
    # Decoding with k and v: the new rows land after cache_seqlens[b] keys of each sequence's
    # pages, in place, and the attention covers them.
    lens = [31, 0, 16]
    k_cache, v_cache, table = paged_cache(rng, [n + 2 for n in lens], block_size=8)
    before_k = k_cache.copy()
    B, H, new = 3, 4, 2
    q = rng.standard_normal((B, new, H, 16)).astype(np.float32)
    k = rng.standard_normal((B, new, 2, 16)).astype(np.float32)
    v = rng.standard_normal((B, new, 2, 12)).astype(np.float32)
    lengths = np.array(lens, dtype=np.int32)
    out = mha.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                      block_table=table, causal=True)
    for b in range(B):
        assert np.array_equal(gather(k_cache, table, b, lens[b] + new)[0, :, lens[b]:],
                              k[b].transpose(1, 0, 2))
        assert np.array_equal(gather(v_cache, table, b, lens[b] + new)[0, :, lens[b]:],
                              v[b].transpose(1, 0, 2))
        # The old keys are unchanged.
        assert np.array_equal(gather(k_cache, table, b, lens[b]),
                              gather(before_k, table, b, lens[b]))
    with_kvcache_reference(q, k_cache, v_cache, table, lengths + new, out, is_causal=True,
                           alignment="bottom-right")
    # Only the new slots changed.
    expected = {(int(table[b, j // 8]), j % 8) for b in range(B)
                for j in range(lens[b], lens[b] + new)}
    changed = {(int(n), int(r)) for n, r in np.argwhere(
        np.any((k_cache != before_k) & ~np.isnan(before_k), axis=(2, 3)))}
    assert changed == expected


def test_flash_attn_with_kvcache_int8_pages(rng):
    lens = [20, 9]
    num_blocks, block = 6, 8
    table = np.array([[4, 0, 2, -1], [5, 3, 1, -1]], dtype=np.int32)
    k8 = np.zeros((num_blocks, block, 2, 16), np.int8)
    v8 = np.zeros((num_blocks, block, 2, 16), np.int8)
    ks = np.zeros((num_blocks, block, 2), np.float32)
    vs = np.zeros((num_blocks, block, 2), np.float32)
    q = rng.standard_normal((2, 1, 4, 16)).astype(np.float32)
    keys = rng.standard_normal((2, max(lens), 2, 16)).astype(np.float32)
    values = rng.standard_normal((2, max(lens), 2, 16)).astype(np.float32)
    # The prompt through kv_cache_write, the new token through flash_attn_with_kvcache.
    for b, n in enumerate(lens):
        j = np.arange(n - 1)
        mha.kv_cache_write(keys[b, :n - 1], values[b, :n - 1], k8, v8,
                           table[b, j // block] * block + j % block, ks, vs)
    new_k = np.stack([keys[b, n - 1:n] for b, n in enumerate(lens)])
    new_v = np.stack([values[b, n - 1:n] for b, n in enumerate(lens)])
    out = mha.flash_attn_with_kvcache(q, k8, v8, new_k, new_v,
                                      cache_seqlens=np.array(lens, np.int32) - 1,
                                      block_table=table, k_scale=ks, v_scale=vs)
    k_values = k8 * ks[..., None].astype(np.float64)
    v_values = v8 * vs[..., None].astype(np.float64)
    for b, n in enumerate(lens):
        step = gather(ks[..., None], table, b, n)
        error = np.abs(gather(k_values, table, b, n) - keys[b, :n].transpose(1, 0, 2)[None])
        assert np.all(error <= 0.5 * step * (1 + 1e-6)), b
    with_kvcache_reference(q, k_values, v_values, table, np.array(lens), out)


def test_flash_attn_with_kvcache_dense_cache(rng):
    # Without a block table: [B_c, S, Hkv, D] with B_c > B and S = 13 (not a multiple of 8).
    B, S = 3, 13
    k_cache = rng.standard_normal((B + 1, S, 2, 16)).astype(np.float32)
    v_cache = rng.standard_normal((B + 1, S, 2, 12)).astype(np.float32)
    q = rng.standard_normal((B, 2, 4, 16)).astype(np.float32)
    identity = np.arange(B)[:, None].astype(np.int32)  # sequence b is "block" b of S rows
    for lengths in (np.array([13, 0, 5], np.int32), 7, None):
        out, lse = mha.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                               causal=True, return_softmax_lse=True)
        full = np.broadcast_to(S if lengths is None else lengths, (B,))
        with_kvcache_reference(q, k_cache, v_cache, identity, full, out, lse, is_causal=True,
                               alignment="bottom-right")
    # Appending needs S to be a multiple of 8 (the cache is written as blocks of S rows).
    k_cache16 = np.zeros((B, 16, 2, 16), np.float32)
    v_cache16 = np.zeros((B, 16, 2, 12), np.float32)
    k = rng.standard_normal((B, 1, 2, 16)).astype(np.float32)
    v = rng.standard_normal((B, 1, 2, 12)).astype(np.float32)
    lengths = np.array([3, 15, 0], np.int32)
    out = mha.flash_attn_with_kvcache(q[:, :1], k_cache16, v_cache16, k, v,
                                      cache_seqlens=lengths)
    for b in range(B):
        assert np.array_equal(k_cache16[b, lengths[b]], k[b, 0])
    with_kvcache_reference(q[:, :1], k_cache16, v_cache16, identity, lengths + 1, out)
    with pytest.raises(ValueError, match="S = 13 to be a multiple of 8"):
        mha.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, k, v, cache_seqlens=lengths)


def test_flash_attn_with_kvcache_torch():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(3)
    rng = np.random.default_rng(3)
    lens = [17, 40]
    k_np, v_np, table_np = paged_cache(rng, lens, block_size=16, Dv=16)
    k_cache, v_cache = torch.from_numpy(k_np).half(), torch.from_numpy(v_np).half()
    table = torch.from_numpy(table_np)
    q = torch.randn(2, 3, 4, 16, generator=gen).half()
    out, lse = mha.flash_attn_with_kvcache(q, k_cache, v_cache,
                                           cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                           block_table=table, causal=True,
                                           return_softmax_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    assert out.shape == (2, 3, 4, 16) and lse.shape == (2, 4, 3) and lse.is_contiguous()
    with_kvcache_reference(q, k_cache, v_cache, table_np, np.array(lens), out, lse,
                           out_dtype="float16", is_causal=True, alignment="bottom-right")
    # Appending into torch caches in place.
    k_new = torch.randn(2, 1, 2, 16, generator=gen).half()
    v_new = torch.randn(2, 1, 2, 16, generator=gen).half()
    lengths = torch.tensor([16, 3], dtype=torch.int32)
    mha.flash_attn_with_kvcache(q[:, :1], k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                block_table=table)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(k_cache[table_np[b, n // 16], n % 16], k_new[b, 0])


def test_flash_attn_with_kvcache_refusals(rng):
    k_cache, v_cache, table = paged_cache(rng, [20, 30], block_size=8)
    q = rng.standard_normal((2, 1, 4, 16)).astype(np.float32)
    k = rng.standard_normal((2, 1, 2, 16)).astype(np.float32)
    v = rng.standard_normal((2, 1, 2, 12)).astype(np.float32)
    lengths = np.array([20, 30], np.int32)
    kept_k, kept_v = k_cache.copy(), v_cache.copy()

    def call(**change):
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=lengths,
                    block_table=table)
        args.update(change)
        return mha.flash_attn_with_kvcache(**args)

    for name in ("rotary_cos", "rotary_sin"):
        with pytest.raises(NotImplementedError, match="rotary embedding"):
            call(**{name: np.zeros((40, 8), np.float32)})
    with pytest.raises(NotImplementedError, match="cache_batch_idx"):
        call(cache_batch_idx=np.array([1, 0], np.int32))
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        call(cache_leftpad=np.array([1, 0], np.int32))
    capacity = table.shape[1] * 8
    with pytest.raises(ValueError, match=f"cache_seqlens\\[1\\] = {capacity + 1} does not fit"):
        call(cache_seqlens=np.array([3, capacity + 1], np.int32))
    with pytest.raises(ValueError, match=f"cache_seqlens = {capacity} plus 1 new tokens"):
        call(k=k, v=v, cache_seqlens=capacity)
    with pytest.raises(ValueError, match="cache_seqlens has shape \\[3\\]"):
        call(cache_seqlens=np.array([1, 2, 3], np.int32))
    with pytest.raises(TypeError, match="cache_seqlens must hold integers"):
        call(cache_seqlens=np.array([1.0, 2.0], np.float32))
    with pytest.raises(ValueError, match="k and v: give both"):
        call(k=k)
    with pytest.raises(ValueError, match="k and v need cache_seqlens"):
        call(k=k, v=v, cache_seqlens=None)
    with pytest.raises(ValueError, match="v has shape \\[2, 2, 2, 12\\]"):
        call(k=k, v=np.concatenate([v, v], axis=1))
    with pytest.raises(ValueError, match="q must be \\[B, seqlen_q, H, D\\]"):
        call(q=q[0])
    with pytest.raises(ValueError, match="k_cache must be \\[num_blocks, block_size, Hkv, D\\]"):
        call(k_cache=k_cache[0])
    bad = table.copy()
    bad[1, lengths[1] // 8] = k_cache.shape[0]  # where the new token of sequence 1 would go
    with pytest.raises(ValueError, match=f"block_table\\[1\\]\\[{lengths[1] // 8}\\] = "):
        call(k=k, v=v, block_table=bad)
    with pytest.raises(TypeError, match="num_splits must be an int"):
        call(num_splits=1.0)
    assert np.array_equal(k_cache, kept_k, equal_nan=True)
    assert np.array_equal(v_cache, kept_v, equal_nan=True)
    # The library's refusals, with a note saying how the arguments reached it.
    with pytest.raises(mha.Error, match="alibi_slopes.*flash_attn_with_kvcache passes k_cache"):
        call(alibi_slopes=np.zeros(3, np.float32))
    with pytest.raises(mha.Error, match="flash_attn_with_kvcache writes k and v as key and value"):
        call(k=k.astype(np.float16), v=v)
    with pytest.raises(mha.Error) as raised:
        call(q=q.astype(np.float16), k_cache=k_cache.astype(np.float16))
    assert raised.value.status.startswith("MHA_ERR_")
