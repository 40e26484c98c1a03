"""mha.flash_attn_func, FlashAttention-2's call on [B, L, H, D] arrays: the same as
scaled_dot_product_attention on their [B, H, L, D] views (against the float64 reference),
bottom-right causal alignment, GQA, the variants, a contiguous [B, L, H, Dv] result or the
caller's out, FlashAttention-2's return_attn_probs, gradients, bad input refused."""
import numpy as np
import pytest

import mha
from conftest import assert_close
import reference

torch = pytest.importorskip("torch")


def token_major(rng, B=2, L=7, S=11, H=4, Hkv=2, D=16, Dv=24):
    q = rng.standard_normal((B, L, H, D)).astype(np.float32)
    k = rng.standard_normal((B, S, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((B, S, Hkv, Dv)).astype(np.float32)
    return q, k, v


def heads_major(x):
    return np.ascontiguousarray(np.asarray(x).transpose(0, 2, 1, 3))


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_against_the_reference(rng, framework):
    q, k, v = token_major(rng)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    given = (q, k, v) if framework == "numpy" else [torch.from_numpy(x) for x in (q, k, v)]
    out, lse = mha.flash_attn_func(*given, softmax_scale=0.3, causal=True, window_size=(5, 1),
                                   softcap=8.0, alibi_slopes=slopes, return_lse=True)
    assert type(out) is type(given[0]) and tuple(out.shape) == (2, 7, 4, 24)
    assert out.flags["C_CONTIGUOUS"] if framework == "numpy" else out.is_contiguous()
    ref, ref_lse, max_logit = reference.attention(
        heads_major(q), heads_major(k), heads_major(v), is_causal=True,
        alignment=reference.BOTTOM_RIGHT, scale=0.3, window=(5, 1), softcap=8.0,
        alibi_slopes=slopes)
    assert_close(heads_major(out), ref, max_logit)
    assert tuple(lse.shape) == (2, 4, 7)
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


def test_return_attn_probs_and_out(rng):
    q, k, v = token_major(rng)
    out = np.full((2, 7, 4, 24), np.nan, np.float32)
    result, lse, probs = mha.flash_attn_func(q, k, v, causal=True, return_attn_probs=True,
                                             out=out)
    assert result is out and probs is None and lse.shape == (2, 4, 7)
    ref, _, max_logit = reference.attention(heads_major(q), heads_major(k), heads_major(v),
                                            is_causal=True, alignment=reference.BOTTOM_RIGHT)
    assert_close(heads_major(out), ref, max_logit)
    with pytest.raises(NotImplementedError, match="return_attn_probs with dropout_p"):
        mha.flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True)


def test_gradients_are_those_of_the_heads_major_call(rng):
    q, k, v = token_major(rng)
    leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
    out = mha.flash_attn_func(*leaves, causal=True)
    assert out.is_contiguous() and out.requires_grad  # FlashAttention's layout: .view() works
    grad_out = torch.from_numpy(rng.standard_normal(tuple(out.shape)).astype(np.float32))
    out.backward(grad_out)
    views = [torch.from_numpy(heads_major(x)).requires_grad_() for x in (q, k, v)]
    again = mha.scaled_dot_product_attention(*views, is_causal=True, enable_gqa=True,
                                             causal_alignment="bottom-right")
    again.backward(grad_out.transpose(1, 2))
    assert torch.equal(out.detach(), again.detach().transpose(1, 2))
    for leaf, view in zip(leaves, views):
        assert torch.equal(leaf.grad, view.grad.transpose(1, 2))


def test_bad_input(rng):
    q, k, v = token_major(rng)
    with pytest.raises(ValueError, match="q must be \\[B, L, H, D\\]"):
        mha.flash_attn_func(q[0], k, v)
    with pytest.raises(mha.Error):  # 4 heads over 3: not grouped
        mha.flash_attn_func(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))


def test_packed_calls_are_the_unpacked_ones_on_views(rng):
    """flash_attn_qkvpacked_func / kvpacked and their varlen forms: the bits of the unpacked
    call on the same values, and under autograd the gradients land in the packed tensor."""
    qkv = torch.from_numpy(rng.standard_normal((2, 7, 3, 4, 16)).astype(np.float32))
    want = mha.flash_attn_func(qkv[:, :, 0].contiguous(), qkv[:, :, 1].contiguous(),
                               qkv[:, :, 2].contiguous(), causal=True)
    assert torch.equal(mha.flash_attn_qkvpacked_func(qkv, causal=True), want)
    assert torch.equal(mha.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], causal=True),
                       want)
    leaf = qkv.clone().requires_grad_()
    mha.flash_attn_qkvpacked_func(leaf, causal=True).sum().backward()
    parts = [qkv[:, :, i].clone().requires_grad_() for i in range(3)]
    mha.flash_attn_func(*parts, causal=True).sum().backward()
    assert torch.equal(leaf.grad, torch.stack([p.grad for p in parts], dim=2))

    lens = np.array([0, 3, 7], np.int32)  # cu_seqlens of two sequences
    packed = torch.from_numpy(rng.standard_normal((7, 3, 4, 16)).astype(np.float32))
    want = mha.varlen_attention(packed[:, 0], packed[:, 1], packed[:, 2], lens, lens,
                                causal=True)
    assert torch.equal(mha.flash_attn_varlen_qkvpacked_func(packed, lens, 4, causal=True), want)
    assert torch.equal(mha.flash_attn_varlen_kvpacked_func(packed[:, 0], packed[:, 1:], lens,
                                                           lens, 4, 4, causal=True), want)
    with pytest.raises(ValueError, match="qkv has shape .* 3 at dimension 2"):
        mha.flash_attn_qkvpacked_func(qkv[:, :, :2])
