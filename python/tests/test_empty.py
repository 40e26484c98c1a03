"""Empty dimensions, as PyTorch answers them: a batch, heads or queries of size 0 give an
empty result, no keys a result of zeros (LSE -inf: a row without keys), for NumPy arrays and
torch tensors, into a given out, under autograd (zero gradients of the inputs' shapes); what
PyTorch would refuse is still refused, and mha's own options keep the library's refusal."""
import math

import numpy as np
import pytest

import mha

torch = pytest.importorskip("torch")

# (query, key, value shapes) -> the result's shape.
CASES = {
    "no_batch": ((0, 2, 3, 8), (0, 2, 4, 8), (0, 2, 4, 8), (0, 2, 3, 8)),
    "no_heads": ((2, 0, 3, 8), (2, 0, 4, 8), (2, 0, 4, 6), (2, 0, 3, 6)),
    "no_queries": ((2, 2, 0, 8), (2, 2, 4, 8), (2, 2, 4, 8), (2, 2, 0, 8)),
    "no_keys": ((2, 2, 3, 8), (2, 2, 0, 8), (2, 2, 0, 6), (2, 2, 3, 6)),
    "no_value_features": ((2, 2, 3, 8), (2, 2, 4, 8), (2, 2, 4, 0), (2, 2, 3, 0)),
    "no_keys_3d": ((2, 3, 8), (2, 0, 8), (2, 0, 8), (2, 3, 8)),
    "no_keys_broadcast_batch": ((2, 2, 3, 8), (1, 2, 0, 8), (1, 2, 0, 8), (2, 2, 3, 8)),
    "no_keys_grouped": ((1, 4, 3, 8), (1, 2, 0, 8), (1, 2, 0, 8), (1, 4, 3, 8)),
}


def inputs(rng, case, framework="numpy"):
    arrays = [rng.standard_normal(s).astype(np.float32) for s in CASES[case][:3]]
    return arrays if framework == "numpy" else [torch.from_numpy(x) for x in arrays]


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_results_and_lse(rng, case, framework):
    q, k, v = inputs(rng, case, framework)
    out, lse = mha.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                enable_gqa=case.endswith("grouped"),
                                                return_lse=True)
    want = CASES[case][3]
    assert type(out) is type(q) and tuple(out.shape) == want
    assert tuple(lse.shape) == want[:-1]
    assert not np.asarray(out).any()  # zeros, where there is anything
    assert np.all(np.asarray(lse) == -math.inf)


def test_into_a_given_out(rng):
    q, k, v = inputs(rng, "no_keys")
    out = np.full((2, 2, 3, 6), np.nan, np.float32)
    assert mha.scaled_dot_product_attention(q, k, v, out=out) is out
    assert not out.any()
    with pytest.raises(mha.Error):  # a wrong out: the library's refusal stands
        mha.scaled_dot_product_attention(q, k, v, out=np.empty((2, 2, 3, 5), np.float32))


def test_half_precision_and_a_mask(rng):
    q, k, v = (x.bfloat16() for x in inputs(rng, "no_keys", "torch"))
    mask = torch.zeros(3, 0, dtype=torch.bool)
    out = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.dtype == torch.bfloat16 and not out.any()


@pytest.mark.parametrize("case", ["no_keys", "no_batch", "no_queries"])
def test_gradients_are_zeros_of_the_inputs_shapes(rng, case):
    q, k, v = (x.requires_grad_() for x in inputs(rng, case, "torch"))
    with torch.no_grad():
        q[..., :1, :1] = math.inf if q.numel() else 0.0  # no NaN from any value
    out = mha.scaled_dot_product_attention(q, k, v)
    assert out.requires_grad
    out.sum().backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()


def test_what_pytorch_refuses_is_refused(rng):
    q = np.zeros((2, 2, 3, 8), np.float32)
    with pytest.raises(mha.Error):  # E differs
        mha.scaled_dot_product_attention(q, np.zeros((2, 2, 0, 4), np.float32),
                                         np.zeros((2, 2, 0, 8), np.float32))
    with pytest.raises(mha.Error):  # batches 2 and 3 do not broadcast
        mha.scaled_dot_product_attention(q, np.zeros((3, 2, 0, 8), np.float32),
                                         np.zeros((3, 2, 0, 8), np.float32))
    with pytest.raises(mha.Error):  # a mask that does not broadcast
        mha.scaled_dot_product_attention(q, np.zeros((2, 2, 0, 8), np.float32),
                                         np.zeros((2, 2, 0, 8), np.float32),
                                         attn_mask=np.zeros((4, 0), bool))
    with pytest.raises(mha.Error):  # no features: the default scale would be 1/sqrt(0)
        mha.scaled_dot_product_attention(np.zeros((2, 2, 3, 0), np.float32),
                                         np.zeros((2, 2, 4, 0), np.float32),
                                         np.zeros((2, 2, 4, 8), np.float32))


def test_mhas_own_options_keep_the_librarys_refusal(rng):
    q, k, v = inputs(rng, "no_keys")
    with pytest.raises(mha.Error, match="sizes must be positive"):
        mha.scaled_dot_product_attention(q, k, v, softcap=5.0)
    with pytest.raises(mha.Error, match="sizes must be positive"):
        mha.scaled_dot_product_attention(q, k, v, valid_lens=[0, 0])
