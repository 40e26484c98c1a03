"""mha.varlen_attention (and its alias flash_attn_varlen_func): each sequence of a packed
batch against the float64 reference run on that sequence alone, with FlashAttention-2's
arguments and conventions (causal aligned to the bottom-right corner, LSE [H, total_q]),
on NumPy arrays and torch tensors; what FlashAttention-2 has and mha does not is refused
by name.  The paged KV cache is test_paged.py's."""
import numpy as np
import pytest

import mha
from conftest import assert_close, dtype_name, to_float64
import reference


def packed_batch(rng, lens_q, lens_k, H=4, Hkv=2, D=16, Dv=12, dtype=np.float32):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], H, D)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], Hkv, D)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], Hkv, Dv)).astype(dtype)
    return q, k, v, cu_q, cu_k


def sequence(x, first, length):
    """Rows [first, first + length) of a packed [total, H, D] array as [1, H, length, D]."""
    return to_float64(x)[first:first + length].transpose(1, 0, 2)[None]


def check_per_sequence(q, k, v, cu_q, cu_k, out, lse, *, out_dtype="float32", sinks=None,
                       alibi_slopes=None, dropout_seed=0, **ref_kwargs):
    """Each sequence's rows of out [total_q, H, Dv] and lse [H, total_q] against the
    reference on that sequence alone (its ALiBi row, its dropout seed dropout_seed + b)."""
    out, lse = to_float64(out), to_float64(lse)
    H = out.shape[1]
    for b in range(len(cu_q) - 1):
        q0, lq = int(cu_q[b]), int(cu_q[b + 1] - cu_q[b])
        k0, lk = int(cu_k[b]), int(cu_k[b + 1] - cu_k[b])
        if lq == 0:
            continue
        rows_out = out[q0:q0 + lq].transpose(1, 0, 2)[None]
        rows_lse = lse[:, q0:q0 + lq][None]
        if lk == 0:  # zeros; the LSE is the sink or -inf
            assert np.all(rows_out == 0.0), f"sequence {b}"
            want = np.full((1, H, lq), -np.inf) if sinks is None else np.broadcast_to(
                np.asarray(sinks, dtype=np.float64)[None, :, None], (1, H, lq))
            assert np.array_equal(rows_lse, want), f"sequence {b}"
            continue
        slopes = alibi_slopes
        if slopes is not None and np.ndim(slopes) == 2:
            slopes = np.asarray(slopes)[b]
        ref, ref_lse, max_logit = reference.attention(
            sequence(q, q0, lq), sequence(k, k0, lk), sequence(v, k0, lk), sinks=sinks,
            alibi_slopes=slopes, dropout_seed=dropout_seed + b, **ref_kwargs)
        assert_close(rows_out, ref, max_logit, out_dtype=out_dtype)
        finite = np.isfinite(ref_lse)
        assert np.array_equal(np.isfinite(rows_lse), finite), f"sequence {b}"
        assert np.array_equal(rows_lse[~finite], ref_lse[~finite]), f"sequence {b}"
        np.testing.assert_allclose(rows_lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5,
                                   err_msg=f"sequence {b}")


# Lengths 0 and 1, more queries than keys (bottom-right causal leaves rows empty), one
# sequence without keys, one without queries, a long one among short ones (several key
# tiles), decode-like rows over many keys.
LENS_Q = [5, 0, 17, 9, 6, 1, 130, 2]
LENS_K = [7, 3, 17, 30, 0, 1, 130, 700]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("alignment", ["bottom-right", "top-left"])
def test_each_sequence_as_alone(rng, causal, alignment):
    q, k, v, cu_q, cu_k = packed_batch(rng, LENS_Q, LENS_K)
    out, lse = mha.varlen_attention(q, k, v, cu_q, cu_k, causal=causal,
                                    causal_alignment=alignment, return_lse=True)
    assert out.shape == (q.shape[0], 4, 12) and out.dtype == np.float32
    assert lse.shape == (4, q.shape[0]) and lse.dtype == np.float32
    check_per_sequence(q, k, v, cu_q, cu_k, out, lse, is_causal=causal, alignment=alignment)


def test_causal_is_bottom_right_by_default(rng):
    # FlashAttention-2 (>= 2.1): with Lq = 2, Lk = 5 the first query sees keys 0..3.
    q, k, v, cu_q, cu_k = packed_batch(rng, [2, 3], [5, 3])
    default = mha.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    bottom_right = mha.varlen_attention(q, k, v, cu_q, cu_k, causal=True,
                                        causal_alignment="bottom-right")
    top_left = mha.varlen_attention(q, k, v, cu_q, cu_k, causal=True, causal_alignment="top-left")
    assert np.array_equal(default, bottom_right)
    assert not np.array_equal(default[:2], top_left[:2])
    # Lq = Lk (the second sequence): both corners are j <= i.
    assert np.array_equal(default[2:], top_left[2:])


@pytest.mark.parametrize("window", [(4, 0), (2, 3), (-1, 1)])
def test_variants_per_sequence(rng, window):
    q, k, v, cu_q, cu_k = packed_batch(rng, LENS_Q, LENS_K)
    slopes = rng.uniform(0.0, 0.5, (len(LENS_Q), 4)).astype(np.float32)
    sinks = np.array([0.5, -np.inf, 2.0, -1.0], dtype=np.float32)
    out, lse = mha.varlen_attention(q, k, v, cu_q, cu_k, softmax_scale=0.3, causal=True,
                                    window_size=window, softcap=5.0, alibi_slopes=slopes,
                                    sinks=sinks, return_lse=True)
    check_per_sequence(q, k, v, cu_q, cu_k, out, lse, sinks=sinks, alibi_slopes=slopes,
                       scale=0.3, is_causal=True, alignment="bottom-right", window=window,
                       softcap=5.0)
    # Slopes per head apply to every sequence.
    out, lse = mha.varlen_attention(q, k, v, cu_q, cu_k, alibi_slopes=slopes[0],
                                    return_lse=True)
    check_per_sequence(q, k, v, cu_q, cu_k, out, lse, alibi_slopes=slopes[0])


def test_dropout_seeds_each_sequence(rng):
    q, k, v, cu_q, cu_k = packed_batch(rng, [70, 3, 1, 20], [70, 30, 64, 20])
    out, lse = mha.varlen_attention(q, k, v, cu_q, cu_k, dropout_p=0.25, causal=True,
                                    dropout_seed=1234, return_lse=True)
    check_per_sequence(q, k, v, cu_q, cu_k, out, lse, dropout_seed=1234, dropout_p=0.25,
                       is_causal=True, alignment="bottom-right")
    again = mha.varlen_attention(q, k, v, cu_q, cu_k, dropout_p=0.25, causal=True,
                                 dropout_seed=1234)
    assert np.array_equal(out, again)


def test_flash_attention_positions_and_alias(rng):
    q, k, v, cu_q, cu_k = packed_batch(rng, [4, 9], [6, 9])
    assert mha.flash_attn_varlen_func is mha.varlen_attention
    by_keyword = mha.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=9, max_seqlen_k=9,
                                      softmax_scale=0.2, causal=True, window_size=(3, 1),
                                      softcap=2.0)
    # flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    #     dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
    #     return_attn_probs, block_table)
    by_position = mha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, 0.0, 0.2, True, (3, 1),
                                             2.0, None, True, False, None)
    assert np.array_equal(by_keyword, by_position)
    # return_attn_probs: FlashAttention-2's (out, softmax_lse, S_dmask), S_dmask None
    # without dropout.
    out, lse, probs = mha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, softmax_scale=0.2,
                                                 causal=True, window_size=(3, 1), softcap=2.0,
                                                 return_attn_probs=True)
    assert probs is None and np.array_equal(out, by_keyword) and lse.shape == (4, 13)
    _, lse2 = mha.varlen_attention(q, k, v, cu_q, cu_k, softmax_scale=0.2, causal=True,
                                   window_size=(3, 1), softcap=2.0, return_lse=True)
    assert np.array_equal(lse, lse2)


def test_what_mha_does_not_do_is_refused(rng):
    q, k, v, cu_q, cu_k = packed_batch(rng, [4, 9], [6, 9])
    with pytest.raises(NotImplementedError, match="return_attn_probs with dropout_p > 0"):
        mha.varlen_attention(q, k, v, cu_q, cu_k, dropout_p=0.1, return_attn_probs=True)
    # A paged cache (test_paged.py) is 4-D: packed k and v with a block table are refused.
    with pytest.raises(ValueError, match="k must have 4 dimensions, has 3: with a block_table"):
        mha.varlen_attention(q, k, v, cu_q, block_table=np.zeros((2, 1), np.int32),
                             seqused_k=np.array([6, 9], np.int32))


def test_max_seqlen(rng):
    q, k, v, cu_q, cu_k = packed_batch(rng, [4, 9], [6, 8])
    want = mha.varlen_attention(q, k, v, cu_q, cu_k)
    assert np.array_equal(mha.varlen_attention(q, k, v, cu_q, cu_k, 9, 8), want)
    assert np.array_equal(mha.varlen_attention(q, k, v, cu_q, cu_k, 100, 100), want)
    out = np.full((13, 4, 12), 7.0, dtype=np.float32)
    with pytest.raises(ValueError, match="max_seqlen_q = 8 but sequence 1 of cu_seqlens_q has 9 "
                                         "queries"):
        mha.varlen_attention(q, k, v, cu_q, cu_k, 8, 8, out=out)
    with pytest.raises(ValueError, match="max_seqlen_k = 7 but sequence 1 of cu_seqlens_k has 8 "
                                         "keys"):
        mha.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_k=7, out=out)
    assert np.all(out == 7.0)
    with pytest.raises(ValueError, match="max_seqlen_q must be in"):
        mha.varlen_attention(q, k, v, cu_q, cu_k, -1)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        mha.varlen_attention(q, k, v, cu_q, cu_k, 9, 8.0)


@pytest.mark.parametrize("backend", mha.backends())
def test_every_backend_and_thread_count(rng, backend):
    q, k, v, cu_q, cu_k = packed_batch(rng, LENS_Q, LENS_K)
    out, lse = mha.varlen_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True,
                                    backend=backend, threads=2)
    check_per_sequence(q, k, v, cu_q, cu_k, out, lse, is_causal=True, alignment="bottom-right")
    one = mha.varlen_attention(q, k, v, cu_q, cu_k, causal=True, backend=backend, threads=1)
    assert np.array_equal(out, one)


def test_out_argument_and_strided_inputs(rng):
    q, k, v, cu_q, cu_k = packed_batch(rng, LENS_Q, LENS_K)
    # Head-major storage seen as [total, H, D]: read in place through its strides.
    q_strided = np.ascontiguousarray(q.transpose(1, 0, 2)).transpose(1, 0, 2)
    out = np.empty((q.shape[0], 4, 12), dtype=np.float32)
    result = mha.varlen_attention(q_strided, k, v, cu_q, cu_k, causal=True, out=out)
    assert result is out
    assert np.array_equal(out, mha.varlen_attention(q, k, v, cu_q, cu_k, causal=True))


def test_int8_cache(rng):
    q, k, v, cu_q, cu_k = packed_batch(rng, [3, 40, 1], [50, 40, 300])
    k8, k_scale = mha.quantize_kv(k)
    v8, v_scale = mha.quantize_kv(v)
    assert k8.shape == k.shape and k_scale.shape == (k.shape[0], 2)
    out, lse = mha.varlen_attention(q, k8, v8, cu_q, cu_k, causal=True, k_scale=k_scale,
                                    v_scale=v_scale, return_lse=True)
    k_values = k8.astype(np.float64) * k_scale[..., None]
    v_values = v8.astype(np.float64) * v_scale[..., None]
    check_per_sequence(q, k_values, v_values, cu_q, cu_k, out, lse, is_causal=True,
                       alignment="bottom-right")


def test_torch_tensors_and_half_precision():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(5)
    lens_q, lens_k = [3, 0, 12, 5], [7, 2, 12, 1]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32)
    q = torch.randn(20, 6, 16, generator=gen)
    k = torch.randn(22, 2, 16, generator=gen)
    v = torch.randn(22, 2, 16, generator=gen)
    out, lse = mha.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, causal=True,
                                          return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert isinstance(lse, torch.Tensor) and lse.shape == (6, 20) and lse.dtype == torch.float32
    check_per_sequence(q, k, v, cu_q.numpy(), cu_k.numpy(), out, lse, is_causal=True,
                       alignment="bottom-right")
    for dtype in (torch.bfloat16, torch.float16):
        qh, kh, vh = q.to(dtype), k.to(dtype), v.to(dtype)
        out, lse = mha.varlen_attention(qh, kh, vh, cu_q, cu_k, causal=True, return_lse=True,
                                        backend="avx512" if "avx512" in mha.backends() else None)
        assert out.dtype == dtype
        # The inputs as rounded are the reference's; the output is rounded once.
        check_per_sequence(qh, kh, vh, cu_q.numpy(), cu_k.numpy(), out, lse,
                           out_dtype=dtype_name(out), is_causal=True, alignment="bottom-right")


def test_bad_arguments_are_named(rng):
    q, k, v, cu_q, cu_k = packed_batch(rng, [4, 9], [6, 9])
    out = np.full((13, 4, 12), 7.0, dtype=np.float32)
    with pytest.raises(TypeError, match="cu_seqlens_q must be a NumPy array"):
        mha.varlen_attention(q, k, v, [0, 4, 13], cu_k)
    with pytest.raises(ValueError, match="q must be packed \\[total_q, H, D\\]"):
        mha.varlen_attention(q[None], k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match="k must have 3 dimensions"):
        mha.varlen_attention(q, k[None], v, cu_q, cu_k, out=out)
    cases = [
        ("cu_seqlens_q has dtype i64", dict(cu_seqlens_q=cu_q.astype(np.int64))),
        ("cu_seqlens_k\\[2\\] = 7 is below", dict(cu_seqlens_k=np.array([0, 9, 7], np.int32))),
        ("cu_seqlens_q\\[2\\] = 12 but q has 13 rows",
         dict(cu_seqlens_q=np.array([0, 4, 12], np.int32))),
        ("cu_seqlens_k has shape \\[2\\] but varlen->cu_seqlens_q has 3 entries",
         dict(cu_seqlens_k=np.array([0, 15], np.int32))),
        ("window_left", dict(window_size=(-2, 0))),
        ("alibi_slopes", dict(alibi_slopes=np.zeros((3, 4), np.float32))),
        ("k_scale", dict(k_scale=np.zeros((15, 2), np.float32),
                         v_scale=np.zeros((15, 2), np.float32))),
    ]
    for message, change in cases:
        args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out)
        args.update(change)
        with pytest.raises(mha.Error, match=message):
            mha.varlen_attention(**args)
        assert np.all(out == 7.0), message
    with pytest.raises(ValueError, match="causal_alignment must be"):
        mha.varlen_attention(q, k, v, cu_q, cu_k, causal=True, causal_alignment="diagonal")
    with pytest.raises(TypeError, match="causal must be a bool"):
        mha.varlen_attention(q, k, v, cu_q, cu_k, causal=1)
