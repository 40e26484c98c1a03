"""Strided and non-contiguous arrays are read and written in place, NumPy and torch alike."""
import tracemalloc

import numpy as np
import pytest

import mha
from conftest import assert_close, random_qkv, to_float64
import reference

torch = pytest.importorskip("torch")


def blhe(rng, B, L, H, E):
    """A [B, L, H, E] buffer, as projections produce it."""
    return rng.standard_normal((B, L, H, E)).astype(np.float32)


def test_numpy_transposed_views_are_read_in_place(rng):
    q, k, v = (np.swapaxes(blhe(rng, 2, L, 3, 16), 1, 2) for L in (9, 13, 13))
    assert not q.flags.c_contiguous
    out = mha.scaled_dot_product_attention(q, k, v)
    ref, _, max_logit = reference.attention(q, k, v)
    assert_close(out, ref, max_logit)


def test_torch_transpose_1_2_views_are_read_in_place(rng):
    q, k, v = (torch.from_numpy(blhe(rng, 2, L, 3, 16)).transpose(1, 2) for L in (9, 13, 13))
    assert not q.is_contiguous()
    out = mha.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert out.shape == (2, 3, 9, 16)
    ref, _, max_logit = reference.attention(to_float64(q), to_float64(k), to_float64(v),
                                            is_causal=True)
    assert_close(out, ref, max_logit)


def test_out_as_a_transposed_view_fills_the_callers_buffer(rng):
    q, k, v = random_qkv(rng)
    buffer = torch.full((2, 9, 3, 16), float("nan"))  # [B, L, H, Ev]: heads merged for W_o
    out = buffer.transpose(1, 2)
    pointer = buffer.data_ptr()
    result = mha.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(k),
                                              torch.from_numpy(v), out=out)
    assert result is out and buffer.data_ptr() == pointer
    ref, _, max_logit = reference.attention(q, k, v)
    assert_close(buffer.transpose(1, 2), ref, max_logit)


def test_packed_qkv_buffer(rng):
    """Q, K and V as three views of one [B, L, 3, H, E] buffer (inputs may overlap)."""
    packed = rng.standard_normal((2, 11, 3, 4, 8)).astype(np.float32)
    q, k, v = (np.transpose(packed[:, :, i], (0, 2, 1, 3)) for i in range(3))
    assert np.may_share_memory(q, k)
    out = mha.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref, _, max_logit = reference.attention(q, k, v, is_causal=True)
    assert_close(out, ref, max_logit)


def test_broadcast_views_with_zero_strides(rng):
    """K and V shared by every head through a stride of 0 (read-only NumPy views)."""
    q, k, v = random_qkv(rng, Hkv=1)
    k_all = np.broadcast_to(k, (2, 3, 13, 16))
    v_all = np.broadcast_to(v, (2, 3, 13, 16))
    assert k_all.strides[1] == 0 and not k_all.flags.writeable
    out = mha.scaled_dot_product_attention(q, k_all, v_all)
    ref, _, max_logit = reference.attention(q, k, v)
    assert_close(out, ref, max_logit)


def test_read_only_inputs(rng):
    q, k, v = random_qkv(rng)
    for x in (q, k, v):
        x.flags.writeable = False
    mha.scaled_dot_product_attention(q, k, v)


def test_strided_inputs_are_not_copied(rng):
    """A large strided query costs no allocation of its size: it is read where it is."""
    big = rng.standard_normal((1, 2048, 8, 2, 64)).astype(np.float32)  # 8 MiB
    q = np.transpose(big[:, :, :, 0], (0, 2, 1, 3))  # [1, 8, 2048, 64], every other row
    k = v = np.ascontiguousarray(q[:, :, :64])
    out = np.empty((1, 8, 2048, 64), dtype=np.float32)

    def peak_bytes(work):
        tracemalloc.start()
        try:
            work()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    # The measurement sees a copy (NumPy reports its buffers to tracemalloc) ...
    assert peak_bytes(lambda: np.ascontiguousarray(q)) >= q.nbytes
    # ... and the call makes none.
    peak = peak_bytes(lambda: mha.scaled_dot_product_attention(q, k, v, out=out))
    assert peak < q.nbytes // 4, f"{peak} bytes allocated for a {q.nbytes}-byte query"


def test_torch_in_torch_out_numpy_in_numpy_out(rng):
    q, k, v = random_qkv(rng)
    assert isinstance(mha.scaled_dot_product_attention(q, k, v), np.ndarray)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    out, lse = mha.scaled_dot_product_attention(tq, tk, tv, return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert lse.dtype == torch.float32
    np.testing.assert_array_equal(out.numpy(), mha.scaled_dot_product_attention(q, k, v))


def test_mixed_frameworks_follow_the_query(rng):
    q, k, v = random_qkv(rng)
    out = mha.scaled_dot_product_attention(torch.from_numpy(q), k, torch.from_numpy(v))
    assert isinstance(out, torch.Tensor)
    out = mha.scaled_dot_product_attention(q, torch.from_numpy(k), v)
    assert isinstance(out, np.ndarray)


def test_torch_masks_bool_and_float(rng):
    q, k, v = (torch.from_numpy(x) for x in random_qkv(rng))
    keep = torch.from_numpy(rng.random((9, 13)) < 0.7)
    additive = torch.from_numpy(rng.standard_normal((2, 1, 9, 13)).astype(np.float32))
    for mask in (keep, additive):
        out = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        ref, _, max_logit = reference.attention(to_float64(q), to_float64(k), to_float64(v),
                                                mask=mask.numpy())
        assert_close(out, ref, max_logit)


def test_torch_valid_lens(rng):
    q, k, v = (torch.from_numpy(x) for x in random_qkv(rng))
    lens = torch.tensor([5, 13])
    out = mha.scaled_dot_product_attention(q, k, v, valid_lens=lens)
    ref, _, max_logit = reference.attention(q.numpy(), k.numpy(), v.numpy(),
                                            valid_lens=lens.numpy())
    assert_close(out, ref, max_logit)


def test_torch_tensors_with_an_offset_into_their_storage(rng):
    whole = torch.from_numpy(rng.standard_normal((3, 3, 9, 16)).astype(np.float32))
    q = whole[1:]  # starts one batch into the storage
    assert q.storage_offset() > 0
    out = mha.scaled_dot_product_attention(q, q, q)
    ref, _, max_logit = reference.attention(q.numpy(), q.numpy(), q.numpy())
    assert_close(out, ref, max_logit)


def test_requires_grad_under_no_grad(rng):
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in random_qkv(rng))
    with torch.no_grad():
        out = mha.scaled_dot_product_attention(q, k, v)
    ref, _, max_logit = reference.attention(to_float64(q), to_float64(k), to_float64(v))
    assert_close(out, ref, max_logit)
