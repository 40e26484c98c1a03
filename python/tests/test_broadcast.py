"""Leading dimensions broadcast as PyTorch broadcasts them: a key and value of batch 1 for a
batch of queries (or one query batch entry over several keys), fewer dimensions, one
key/value head for every query head without enable_gqa -- computed on stride-0 views, the
results against the float64 reference on the broadcast arrays, the gradients of the
broadcast inputs summed over what was broadcast (as torch's expand's backward sums them)."""
import numpy as np
import pytest

import mha
from conftest import assert_close, random_qkv
import reference
from test_backward import reference_gradients

torch = pytest.importorskip("torch")

# (query, key, value shapes, enable_gqa): each broadcasts to [2, 4, 5, 8] queries.
CASES = {
    "key_value_batch_1": ((2, 4, 5, 8), (1, 4, 7, 8), (1, 4, 7, 8), False),
    "query_batch_1": ((1, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8), False),
    "key_value_without_batch": ((2, 4, 5, 8), (4, 7, 8), (4, 7, 8), False),
    "key_value_2d": ((2, 4, 5, 8), (7, 8), (7, 8), False),
    "one_head_without_gqa": ((2, 4, 5, 8), (2, 1, 7, 8), (2, 1, 7, 8), False),
    "grouped_heads_batch_1": ((2, 4, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8), True),
    "key_batch_1_value_not": ((2, 4, 5, 8), (1, 4, 7, 8), (2, 4, 7, 8), False),
}


def arrays(rng, case):
    return [rng.standard_normal(shape).astype(np.float32) for shape in CASES[case][:3]]


def broadcast(q, k, v, gqa):
    """The arrays as [B, H, L, E] the reference reads: leading dimensions broadcast, key's
    and value's heads kept where gqa groups them."""
    B, H = 2, 4
    hkv = k.shape[-3] if gqa and k.ndim >= 3 else H
    return (np.broadcast_to(q, (B, H) + q.shape[-2:]),
            np.broadcast_to(k, (B, hkv) + k.shape[-2:]),
            np.broadcast_to(v, (B, hkv) + v.shape[-2:]))


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward(rng, case, framework):
    q, k, v = arrays(rng, case)
    gqa = CASES[case][3]
    given = (q, k, v) if framework == "numpy" else [torch.from_numpy(x) for x in (q, k, v)]
    out, lse = mha.scaled_dot_product_attention(*given, is_causal=True, enable_gqa=gqa,
                                                return_lse=True)
    assert tuple(out.shape) == (2, 4, 5, 8) and tuple(lse.shape) == (2, 4, 5)
    ref, ref_lse, max_logit = reference.attention(*broadcast(q, k, v, gqa), is_causal=True)
    assert_close(out, ref, max_logit)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)


def test_into_a_given_out(rng):
    q, k, v = arrays(rng, "key_value_batch_1")
    out = np.full((2, 4, 5, 8), np.nan, np.float32)
    result = mha.scaled_dot_product_attention(q, k, v, out=out)
    assert result is out
    ref, _, max_logit = reference.attention(*broadcast(q, k, v, False))
    assert_close(out, ref, max_logit)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_are_summed_over_what_was_broadcast(rng, case):
    q, k, v = arrays(rng, case)
    gqa = CASES[case][3]
    leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
    out = mha.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=gqa)
    grad_out = rng.standard_normal((2, 4, 5, 8)).astype(np.float32)
    out.backward(torch.from_numpy(grad_out))
    full = [np.ascontiguousarray(x) for x in broadcast(q, k, v, gqa)]
    want, tolerance = reference_gradients(*full, grad_out, is_causal=True)
    for name, leaf, x in zip(("query", "key", "value"), leaves, (q, k, v)):
        assert leaf.grad.shape == leaf.shape, name
        # The broadcast dimensions summed back to the input's shape: so are the bounds.
        summed = torch.from_numpy(want[name]).sum_to_size(x.shape).numpy()
        copies = want[name].size // x.size
        error = np.abs(leaf.grad.numpy() - summed).max()
        assert error <= copies * tolerance[name], f"{name}: {error:.3g}"


def test_what_does_not_broadcast_is_refused_as_before(rng):
    q, _, _ = random_qkv(rng, B=2, H=4)
    k, v = (rng.standard_normal((3, 4, 7, 16)).astype(np.float32) for _ in range(2))
    with pytest.raises(mha.Error, match="MHA_ERR_SHAPE_MISMATCH"):
        mha.scaled_dot_product_attention(q, k, v)
    k2, v2 = (rng.standard_normal((2, 2, 7, 16)).astype(np.float32) for _ in range(2))
    with pytest.raises(ValueError, match="enable_gqa"):
        mha.scaled_dot_product_attention(q, k2, v2)
    with pytest.raises(mha.Error, match="MHA_ERR_SHAPE_MISMATCH"):  # E differs: no broadcast
        mha.scaled_dot_product_attention(q, k[:1, ..., :8], v[:1])
