"""The attention variants -- window_size, sinks, softcap, alibi_slopes -- against the float64
reference, on NumPy arrays and torch tensors; bad values are refused by name."""
import numpy as np
import pytest

import mha
from conftest import assert_close, random_qkv
import reference


def check(q, k, v, ref_kwargs, **kwargs):
    out, lse = mha.scaled_dot_product_attention(q, k, v, return_lse=True, **kwargs)
    ref, ref_lse, max_logit = reference.attention(q, k, v, **ref_kwargs)
    assert_close(out, ref, max_logit)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    return out, lse


@pytest.mark.parametrize("window", [(0, 0), (3, 0), (2, 5), (-1, 1), (100, 100)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_window(rng, window, is_causal):
    q, k, v = random_qkv(rng, L=9, S=13)
    check(q, k, v, {"window": window, "is_causal": is_causal, "alignment": "bottom-right"},
          window_size=window, is_causal=is_causal, causal_alignment="bottom-right")


def test_sinks_join_the_denominator(rng):
    q, k, v = random_qkv(rng, H=4, Hkv=2, L=9, S=13)
    sinks = np.array([0.5, -np.inf, 3.0, -2.0], dtype=np.float32)
    check(q, k, v, {"sinks": sinks}, sinks=sinks, enable_gqa=True)


def test_rows_without_keys_get_the_sink_as_lse(rng):
    q, k, v = random_qkv(rng, L=13, S=5)
    sinks = np.array([0.5, 1.0, 2.0], dtype=np.float32)
    out, lse = check(q, k, v, {"sinks": sinks, "is_causal": True, "alignment": "bottom-right"},
                     sinks=sinks, is_causal=True, causal_alignment="bottom-right")
    # Rows 0..7 see no key: zeros, and the sink as their LSE.
    assert np.all(out[:, :, :8] == 0.0)
    np.testing.assert_allclose(lse[:, :, :8], np.broadcast_to(sinks[None, :, None], (2, 3, 8)))


@pytest.mark.parametrize("softcap", [1.0, 5.0, 50.0])
def test_softcap(rng, softcap):
    q, k, v = random_qkv(rng, E=32)
    q *= 4.0
    check(q, k, v, {"softcap": softcap}, softcap=softcap)


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi(rng, per_batch):
    q, k, v = random_qkv(rng, L=9, S=13)
    slopes = 2.0 ** (-8.0 * np.arange(1, 4) / 3)
    slopes = (np.stack([slopes, 2 * slopes]) if per_batch else slopes).astype(np.float32)
    check(q, k, v, {"alibi_slopes": slopes}, alibi_slopes=slopes)


def test_all_together_with_mask_and_valid_lens(rng):
    q, k, v = random_qkv(rng, L=9, S=13)
    mask = rng.random((9, 13)) < 0.8
    slopes = np.array([0.25, 0.5, 1.0], dtype=np.float32)
    sinks = np.array([1.0, 0.0, -1.0], dtype=np.float32)
    check(q, k, v,
          {"mask": mask, "valid_lens": [11, 7], "window": (4, 1), "sinks": sinks, "softcap": 20.0,
           "alibi_slopes": slopes},
          attn_mask=mask, valid_lens=[11, 7], window_size=(4, 1), sinks=sinks, softcap=20.0,
          alibi_slopes=slopes)


def test_torch_tensors():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))
    sinks = torch.tensor([0.5, 1.5])
    slopes = torch.tensor([0.5, 0.25])
    out = mha.scaled_dot_product_attention(q, k, v, sinks=sinks, softcap=10.0,
                                           alibi_slopes=slopes, window_size=(2, 0))
    ref, _, max_logit = reference.attention(q.numpy(), k.numpy(), v.numpy(), sinks=sinks.numpy(),
                                            softcap=10.0, alibi_slopes=slopes.numpy(),
                                            window=(2, 0))
    assert isinstance(out, torch.Tensor)
    assert_close(out.numpy(), ref, max_logit)


@pytest.mark.parametrize("kwargs, message", [
    ({"window_size": (-2, 0)}, "window_left"),
    ({"softcap": -1.0}, "softcap"),
    ({"softcap": float("nan")}, "softcap"),
    ({"sinks": np.zeros(4, np.float32)}, "sinks"),
    ({"sinks": np.array([0, np.nan, 0], np.float32)}, "sinks"),
    ({"alibi_slopes": np.zeros(5, np.float32)}, "alibi_slopes"),
    ({"alibi_slopes": np.array([0, np.inf, 0], np.float32)}, "alibi_slopes"),
])
def test_bad_values_are_refused_by_name(rng, kwargs, message):
    q, k, v = random_qkv(rng)
    with pytest.raises(mha.Error, match=message):
        mha.scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("window", [5, (1,), (1, 2, 3), (1.5, 0), ("a", 0)])
def test_window_size_must_be_a_pair_of_ints(rng, window):
    q, k, v = random_qkv(rng)
    with pytest.raises((TypeError, ValueError), match="window_size"):
        mha.scaled_dot_product_attention(q, k, v, window_size=window)
