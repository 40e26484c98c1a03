"""The two ways the extension reads torch tensors agree.

torch.Tensor and nn.Parameter are read through libtorch's C++ API when the
package has mha._torch_tensors (src/torch_tensors_module.cpp); a subclass of
torch.Tensor always through its Python attributes.  The same data through
both ways must give the same bits, the same errors and the same outputs.
"""
import importlib
import os

import numpy as np
import pytest

import mha
from conftest import assert_close, to_float64
import reference

torch = pytest.importorskip("torch")


class Subclass(torch.Tensor):
    """Read through its attributes (a subclass may redefine what they say)."""


def through_attributes(x):
    return None if x is None else x.as_subclass(Subclass)


def fast_reader_present():
    try:
        importlib.import_module("mha._torch_tensors")
    except ImportError:
        return False
    return True


def test_the_fast_reader_is_built_where_expected():
    # scripts/test.sh installs libtorch's headers and sets this: the tests must
    # go through the C++ reader there, not silently through the attributes.
    if os.environ.get("MHA_EXPECT_TORCH_TENSORS") != "1":
        pytest.skip("MHA_EXPECT_TORCH_TENSORS=1 not set (scripts/test.sh sets it)")
    assert fast_reader_present()
    mha.scaled_dot_product_attention(*(torch.zeros((1, 1, 2, 8)) for _ in range(3)))
    assert mha._mha.torch_tensor_reader() == "libtorch"


def layouts(rng):
    """(name, q, k, v, extra keyword arguments) of tensors in various layouts and dtypes."""
    def t(shape, dtype=torch.float32):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)

    blhe = [t((2, L, 3, 16)).transpose(1, 2) for L in (5, 7, 7)]
    yield "transposed views", *blhe, {}
    base = t((2, 3, 9, 24))
    yield "offset and sliced", base[:, :, 1:6, 4:20], base[:, :, :, :16], t((2, 3, 9, 8)), {}
    yield "bfloat16", *(t((1, 2, L, 32), torch.bfloat16) for L in (4, 6, 6)), {}
    yield "float16", *(t((1, 2, L, 32), torch.float16) for L in (4, 6, 6)), {}
    yield "rank 2", t((4, 8)), t((6, 8)), t((6, 8)), {}
    q, k, v = t((2, 4, 3, 8)), t((2, 2, 5, 8)), t((2, 2, 5, 8))
    mask = torch.from_numpy(rng.random((1, 1, 3, 5)) < 0.7).expand(2, 4, 3, 5)
    lens = torch.tensor([5, 2], dtype=torch.int32)
    yield "gqa, expanded bool mask, valid_lens", q, k, v, {
        "enable_gqa": True, "attn_mask": mask, "valid_lens": lens}
    params = [torch.nn.Parameter(t((1, 2, 3, 8)), requires_grad=False) for _ in range(3)]
    yield "nn.Parameter", *params, {}
    yield "expanded key and value", t((1, 2, 3, 8)), *(t((1, 1, 4, 8)).expand(1, 2, 4, 8)
                                                       for _ in range(2)), {}


@pytest.mark.parametrize("index", range(8))
def test_both_ways_give_the_same_bits(rng, index):
    name, q, k, v, extra = list(layouts(rng))[index]
    fast = mha.scaled_dot_product_attention(q, k, v, **extra)
    slow_extra = {key: through_attributes(x) if isinstance(x, torch.Tensor) else x
                  for key, x in extra.items()}
    slow = mha.scaled_dot_product_attention(*map(through_attributes, (q, k, v)), **slow_extra)
    assert type(fast) is torch.Tensor, name
    assert fast.dtype == q.dtype and fast.shape == q.shape[:-1] + v.shape[-1:], name
    assert fast.is_contiguous(), name
    assert torch.equal(fast, slow.as_subclass(torch.Tensor)), name
    if q.dtype == torch.float32 and q.dim() == 4 and "attn_mask" not in extra:
        ref, _, max_logit = reference.attention(to_float64(q), to_float64(k), to_float64(v))
        assert_close(fast, ref, max_logit)


def test_the_output_follows_query_dtype_and_values_last_dimension(rng):
    q = torch.zeros((2, 3, 4, 16), dtype=torch.bfloat16)
    k = torch.zeros((2, 3, 5, 16), dtype=torch.bfloat16)
    v = torch.ones((2, 3, 5, 40), dtype=torch.bfloat16)
    out = mha.scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 3, 4, 40) and out.dtype == torch.bfloat16
    assert not out.requires_grad
    assert torch.equal(out, torch.ones_like(out))


def test_out_that_requires_grad_is_refused_either_way(rng):
    q, k, v = (torch.zeros((1, 1, 2, 8)) for _ in range(3))
    for out in (torch.zeros((1, 1, 2, 8), requires_grad=True),
                through_attributes(torch.zeros((1, 1, 2, 8))).requires_grad_()):
        with pytest.raises(ValueError, match="out requires grad"):
            mha.scaled_dot_product_attention(q, k, v, out=out)
        with torch.no_grad():
            assert mha.scaled_dot_product_attention(q, k, v, out=out) is out


def test_tensors_it_cannot_read_are_refused_the_general_way():
    q = torch.zeros((1, 1, 2, 8))
    for bad, message in ((torch.zeros((1, 1, 2, 8), dtype=torch.float64), "float64"),
                         (torch.zeros((1, 1, 2, 8), device="meta"), "query"),
                         (torch.zeros((1, 1, 2, 8)).to_sparse(), "query"),
                         (torch.zeros((1,) * 9), "query")):
        with pytest.raises((TypeError, ValueError), match=message):
            mha.scaled_dot_product_attention(bad, q, q)


def test_a_lazily_negated_view_is_refused_not_read_as_its_memory():
    q = torch.ones((1, 1, 2, 8))
    v = torch._neg_view(torch.arange(24.0).reshape(1, 1, 3, 8))
    assert v.is_neg()
    for value in (v, through_attributes(v)):
        with pytest.raises(TypeError, match="value is a lazily negated view"):
            mha.scaled_dot_product_attention(q, torch.ones((1, 1, 3, 8)), value)
    out = mha.scaled_dot_product_attention(q, torch.ones((1, 1, 3, 8)), v.resolve_neg())
    assert torch.allclose(out[0, 0, 0], -torch.arange(8.0, 16.0), rtol=1e-5, atol=0)
