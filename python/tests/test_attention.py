"""Every argument of scaled_dot_product_attention against the float64 reference (float32)."""
import numpy as np
import pytest

import mha
from conftest import assert_close, random_qkv
import reference


def check(q, k, v, ref_kwargs=None, **kwargs):
    """Runs mha and the reference with the same arguments and compares them."""
    out = mha.scaled_dot_product_attention(q, k, v, **kwargs)
    ref, _, max_logit = reference.attention(q, k, v, **(ref_kwargs or {}))
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert_close(out, ref, max_logit)
    return out


def test_plain_call_matches_reference(rng):
    q, k, v = random_qkv(rng, E=16, Ev=24)
    check(q, k, v)


def test_positional_arguments_follow_pytorch(rng):
    q, k, v = random_qkv(rng, L=7, S=7)
    mask = rng.standard_normal((7, 7)).astype(np.float32)
    # query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
    out = mha.scaled_dot_product_attention(q, k, v, mask, 0.0, True, 0.5, False)
    ref, _, max_logit = reference.attention(q, k, v, mask=mask, is_causal=True, scale=0.5)
    assert_close(out, ref, max_logit)


@pytest.mark.parametrize("shape", [(9, 13), (1, 13), (9, 1), (2, 1, 9, 13), (1, 3, 9, 13),
                                   (2, 3, 9, 13), (2, 1, 1, 13), (13,), (3, 1, 13)])
def test_bool_mask_true_takes_part(rng, shape):
    q, k, v = random_qkv(rng)
    mask = rng.random(shape) < 0.7
    check(q, k, v, {"mask": mask}, attn_mask=mask)


@pytest.mark.parametrize("shape", [(9, 13), (2, 1, 9, 13), (1, 3, 9, 13), (2, 3, 9, 13),
                                   (2, 1, 1, 13)])
def test_float_mask_is_added(rng, shape):
    q, k, v = random_qkv(rng)
    mask = (3 * rng.standard_normal(shape)).astype(np.float32)
    mask[rng.random(shape) < 0.2] = -np.inf
    check(q, k, v, {"mask": mask}, attn_mask=mask)


def test_fully_masked_rows_are_zero_with_lse_minus_inf(rng):
    q, k, v = random_qkv(rng, L=4, S=5)
    mask = np.ones((4, 5), dtype=bool)
    mask[2] = False
    out, lse = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert np.all(out[:, :, 2] == 0) and np.all(lse[:, :, 2] == -np.inf)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("L,S", [(9, 9), (5, 13), (13, 5)])
@pytest.mark.parametrize("alignment", ["top-left", "bottom-right"])
def test_is_causal_with_alignment(rng, L, S, alignment):
    q, k, v = random_qkv(rng, L=L, S=S)
    check(q, k, v, {"is_causal": True, "alignment": alignment}, is_causal=True,
          causal_alignment=alignment)


def test_default_alignment_is_pytorchs_top_left(rng):
    q, k, v = random_qkv(rng, L=5, S=9)
    check(q, k, v, {"is_causal": True, "alignment": "top-left"}, is_causal=True)


def test_alignment_without_is_causal_changes_nothing(rng):
    q, k, v = random_qkv(rng, L=5, S=9)
    check(q, k, v, causal_alignment="bottom-right")


def test_is_causal_combines_with_mask(rng):
    q, k, v = random_qkv(rng, L=9, S=9)
    mask = rng.random((9, 9)) < 0.8
    check(q, k, v, {"mask": mask, "is_causal": True}, attn_mask=mask, is_causal=True)


@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0, -0.5])
def test_scale(rng, scale):
    q, k, v = random_qkv(rng)
    check(q, k, v, {"scale": scale}, scale=scale)


def test_scale_none_is_one_over_sqrt_e(rng):
    q, k, v = random_qkv(rng, E=64)
    a = mha.scaled_dot_product_attention(q, k, v, scale=None)
    b = mha.scaled_dot_product_attention(q, k, v, scale=0.125)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("H,Hkv", [(6, 3), (4, 1), (6, 2)])
def test_enable_gqa(rng, H, Hkv):
    q, k, v = random_qkv(rng, H=H, Hkv=Hkv)
    check(q, k, v, enable_gqa=True)


def test_enable_gqa_with_equal_heads_is_plain_attention(rng):
    q, k, v = random_qkv(rng)
    check(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("as_list", [False, True])
def test_valid_lens_per_batch(rng, as_list):
    q, k, v = random_qkv(rng, B=3, S=13)
    lens = np.array([13, 4, 0], dtype=np.int32)
    check(q, k, v, {"valid_lens": lens}, valid_lens=lens.tolist() if as_list else lens)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_valid_lens_per_query(rng, dtype):
    q, k, v = random_qkv(rng, B=2, L=9, S=13)
    lens = rng.integers(0, 14, size=(2, 9)).astype(dtype)
    check(q, k, v, {"valid_lens": lens}, valid_lens=lens)


def test_valid_lens_with_causal_and_mask(rng):
    q, k, v = random_qkv(rng, B=2, L=9, S=13)
    lens = np.array([10, 6])
    mask = rng.random((2, 1, 9, 13)) < 0.8
    check(q, k, v, {"valid_lens": lens, "mask": mask, "is_causal": True,
                    "alignment": "bottom-right"},
          valid_lens=lens, attn_mask=mask, is_causal=True, causal_alignment="bottom-right")


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_scale_zero_gives_the_masks_softmax(rng, framework):
    """scale=0.0 as PyTorch computes it: every score 0 before the mask (uniform weights over
    the keys that take part), ALiBi still added."""
    q, k, v = random_qkv(rng)
    mask = rng.random((9, 13)) < 0.7
    slopes = np.full(3, 0.25, np.float32)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    out, lse = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.0,
                                                alibi_slopes=slopes, return_lse=True)
    ref, ref_lse, max_logit = reference.attention(np.asarray(q), np.asarray(k), np.asarray(v),
                                                  mask=mask, scale=0.0, alibi_slopes=slopes)
    assert_close(out, ref, max_logit)
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=1e-6, atol=1e-5)


def test_return_lse(rng):
    q, k, v = random_qkv(rng)
    mask = rng.random((9, 13)) < 0.8
    out, lse = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.7,
                                                return_lse=True)
    ref, ref_lse, max_logit = reference.attention(q, k, v, mask=mask, scale=0.7)
    assert_close(out, ref, max_logit)
    assert lse.dtype == np.float32 and lse.shape == (2, 3, 9)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-6, atol=1e-5)


def test_dropout_zero_is_exact(rng):
    q, k, v = random_qkv(rng)
    plain = mha.scaled_dot_product_attention(q, k, v)
    np.testing.assert_array_equal(
        mha.scaled_dot_product_attention(q, k, v, dropout_p=0.0, dropout_seed=7), plain)
    np.testing.assert_array_equal(mha.scaled_dot_product_attention(q, k, v, None, 0.0), plain)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_follows_the_documented_formula(rng, p):
    q, k, v = random_qkv(rng, L=17, S=23)
    seed = 0x1234_5678_9ABC_DEF0
    out = mha.scaled_dot_product_attention(q, k, v, dropout_p=p, dropout_seed=seed)
    ref, _, max_logit = reference.attention(q, k, v, dropout_p=p, dropout_seed=seed)
    assert_close(out, ref, max_logit)


def test_dropout_seed_reproduces_and_differs(rng):
    q, k, v = random_qkv(rng, L=17, S=23)
    a = mha.scaled_dot_product_attention(q, k, v, dropout_p=0.3, dropout_seed=1)
    b = mha.scaled_dot_product_attention(q, k, v, dropout_p=0.3, dropout_seed=1)
    c = mha.scaled_dot_product_attention(q, k, v, dropout_p=0.3, dropout_seed=2)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_dropout_without_seed_draws_one(rng):
    q, k, v = random_qkv(rng, L=17, S=23)
    a = mha.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    b = mha.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert not np.array_equal(a, b)


def test_lse_is_before_dropout(rng):
    q, k, v = random_qkv(rng)
    _, plain = mha.scaled_dot_product_attention(q, k, v, return_lse=True)
    _, dropped = mha.scaled_dot_product_attention(q, k, v, dropout_p=0.5, dropout_seed=3,
                                                  return_lse=True)
    np.testing.assert_array_equal(plain, dropped)


def test_out_is_written_in_place_and_returned(rng):
    q, k, v = random_qkv(rng, Ev=24)
    out = np.full((2, 3, 9, 24), np.nan, dtype=np.float32)
    address = out.ctypes.data
    result = mha.scaled_dot_product_attention(q, k, v, out=out)
    assert result is out and out.ctypes.data == address
    ref, _, max_logit = reference.attention(q, k, v)
    assert_close(out, ref, max_logit)


def test_out_with_return_lse(rng):
    q, k, v = random_qkv(rng)
    out = np.empty((2, 3, 9, 16), dtype=np.float32)
    result, lse = mha.scaled_dot_product_attention(q, k, v, out=out, return_lse=True)
    assert result is out and lse.shape == (2, 3, 9)


@pytest.mark.parametrize("rank", [2, 3])
def test_fewer_dimensions_are_leading_ones(rng, rank):
    q, k, v = random_qkv(rng, B=1, H=1 if rank == 2 else 3)
    lead = (0,) * (4 - rank)
    q, k, v = q[lead], k[lead], v[lead]
    out, lse = mha.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    assert out.shape == q.shape[:-1] + (16,) and lse.shape == q.shape[:-1]
    expand = (None,) * (4 - rank)
    ref, _, max_logit = reference.attention(q[expand], k[expand], v[expand], is_causal=True)
    assert_close(out, ref[lead], max_logit)


def test_merge_partials_of_two_key_ranges_is_the_whole(rng):
    q, k, v = random_qkv(rng, S=20)
    parts = [mha.scaled_dot_product_attention(q, k[:, :, s], v[:, :, s], return_lse=True)
             for s in (slice(0, 7), slice(7, 20))]
    out, lse = mha.merge_partials([p[0] for p in parts], [p[1] for p in parts])
    ref, ref_lse, max_logit = reference.attention(q, k, v)
    assert_close(out, ref, max_logit)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-5)


def test_merge_partials_into_given_arrays(rng):
    q, k, v = random_qkv(rng, S=20)
    part, part_lse = mha.scaled_dot_product_attention(q, k, v, return_lse=True)
    out = np.empty_like(part)
    lse = np.empty_like(part_lse)
    result = mha.merge_partials((part,), (part_lse,), out=out, lse=lse)
    assert result[0] is out and result[1] is lse
    np.testing.assert_array_equal(out, part)
