"""The attention variants -- window_size, sinks, softcap, alibi_slopes -- against the float64
reference, on NumPy arrays and torch tensors, in scaled_dot_product_attention and in
mha.MultiheadAttention's forward (its reference: the projections in float64 around the
attention reference); bad values are refused by name."""
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


# ---------------------------------------------------------------- mha.MultiheadAttention

def make_module(rng, embed_dim=16, num_heads=4, batch_first=True):
    """A module with random weights (of size 0.3, as test_module.py's) loaded from NumPy."""
    module = mha.MultiheadAttention(embed_dim, num_heads, batch_first=batch_first)
    module.load_state_dict({
        name: (0.3 * rng.standard_normal(value.shape)).astype(np.float32)
        for name, value in module.state_dict().items()})
    return module


def module_reference(module, query, key, value, *, is_causal=False, **variants):
    """The module in float64 from its state_dict, on [B, L, E] inputs: the projections, the
    heads through reference.attention (value = the identity gives the weights), out_proj.
    Returns (out [B, L, E], weights [B, H, L, S], max |logit|)."""
    w = {name: x.astype(np.float64) for name, x in module.state_dict().items()}
    heads, d = module.num_heads, module.head_dim

    def split(x, weight, bias):  # [B, L, E] -> [B, H, L, D]
        y = np.asarray(x, dtype=np.float64) @ weight.T + bias
        return y.reshape(y.shape[0], y.shape[1], heads, d).transpose(0, 2, 1, 3)

    w_q, w_k, w_v = np.split(w["in_proj_weight"], 3)
    b_q, b_k, b_v = np.split(w["in_proj_bias"], 3)
    q, k, v = split(query, w_q, b_q), split(key, w_k, b_k), split(value, w_v, b_v)
    o, _, max_logit = reference.attention(q, k, v, is_causal=is_causal, **variants)
    batch, length = q.shape[0], k.shape[2]
    eye = np.broadcast_to(np.eye(length), (batch, heads, length, length))
    weights, _, _ = reference.attention(q, k, eye, is_causal=is_causal, **variants)
    concat = o.transpose(0, 2, 1, 3).reshape(batch, q.shape[2], heads * d)
    return concat @ w["out_proj.weight"].T + w["out_proj.bias"], weights, max_logit


@pytest.mark.parametrize("need_weights, average", [(False, True), (True, False), (True, True)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_module_variants_match_the_reference(rng, need_weights, average, is_causal):
    module = make_module(rng)
    query = rng.standard_normal((2, 9, 16)).astype(np.float32)
    key = rng.standard_normal((2, 12, 16)).astype(np.float32)
    sinks = np.array([0.5, -np.inf, 2.0, -1.0], dtype=np.float32)
    slopes = np.array([[0.5, 0.25, 0.125, 1.0], [1.0, 0.5, 0.25, 2.0]], dtype=np.float32)
    out, weights = module(query, key, key, need_weights=need_weights,
                          average_attn_weights=average, is_causal=is_causal,
                          window_size=(3, 1), sinks=sinks, softcap=1.0, alibi_slopes=slopes)
    want, want_weights, max_logit = module_reference(
        module, query, key, key, is_causal=is_causal, window=(3, 1), sinks=sinks, softcap=1.0,
        alibi_slopes=slopes)
    assert_close(out, want, max_logit)
    if not need_weights:
        assert weights is None
        return
    if average:
        want_weights = want_weights.mean(axis=1)
    assert_close(weights, want_weights, max_logit)
    if not average:
        # The weights are the true probabilities: a sink takes its share of each row (every
        # row has a key here); head 1's sink is -inf, none.
        sums = weights.sum(axis=-1, dtype=np.float64)
        assert np.all(sums[:, [0, 2, 3]] < 0.999)
        np.testing.assert_allclose(sums[:, 1], 1.0, rtol=1e-5)


def test_module_variants_sequence_first_and_unbatched(rng):
    module = make_module(rng, batch_first=False)
    x = rng.standard_normal((7, 2, 16)).astype(np.float32)  # [L, B, E]
    sinks = np.array([1.0, 0.0, -1.0, 3.0], dtype=np.float32)
    kwargs = {"sinks": sinks, "softcap": 2.0, "alibi_slopes": np.full(4, 0.5, np.float32)}
    out, weights = module(x, x, x, window_size=(2, 0), average_attn_weights=False, **kwargs)
    batch_first = x.transpose(1, 0, 2)
    want, want_weights, max_logit = module_reference(module, batch_first, batch_first,
                                                     batch_first, window=(2, 0), **kwargs)
    assert_close(out, want.transpose(1, 0, 2), max_logit)
    assert_close(weights, want_weights, max_logit)
    out, weights = module(x[:, 1], x[:, 1], x[:, 1], window_size=(2, 0), **kwargs)  # unbatched
    assert_close(out, want[1], max_logit)
    assert_close(weights, want_weights[1].mean(axis=0), max_logit)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"window_size": (-2, 0)}, mha.Error, "params->window_left = -2"),
    ({"window_size": (0, -3)}, mha.Error, "params->window_right = -3"),
    ({"window_size": 5}, TypeError, "window_size"),
    ({"softcap": -1.0}, mha.Error, "params->softcap"),
    ({"softcap": float("inf")}, mha.Error, "params->softcap"),
    ({"softcap": "1"}, TypeError, "softcap"),
    ({"sinks": np.zeros(3, np.float32)}, mha.Error, r"params->sinks has shape \[3\]"),
    ({"sinks": np.array([0, np.nan, 0, 0], np.float32)}, mha.Error, r"params->sinks\[1\]"),
    ({"sinks": np.zeros(4, np.int32)}, mha.Error, "params->sinks has dtype i32"),
    ({"alibi_slopes": np.zeros(5, np.float32)}, mha.Error, "params->alibi_slopes has shape"),
    ({"alibi_slopes": np.zeros((3, 4), np.float32)}, mha.Error, "params->alibi_slopes has shape"),
    ({"alibi_slopes": np.array([0, np.inf, 0, 0], np.float32)}, mha.Error,
     "params->alibi_slopes holds inf"),
])
def test_module_variants_refused_by_name(rng, kwargs, error, message):
    module = make_module(rng)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    with pytest.raises(error, match=message):
        module(x, x, x, **kwargs)
