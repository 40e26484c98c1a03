"""mha.torch: torch.ops.mha.sdpa and sdpa_with_lse, on CPU tensors (against the float64
reference and bit for bit against mha.scaled_dot_product_attention) and on meta tensors
(shapes and dtypes only)."""
import inspect
import types

import numpy as np
import pytest

import mha
from conftest import assert_close, random_qkv
import reference

torch = pytest.importorskip("torch")
import mha.torch  # noqa: E402  (registers the operators)
from mha.torch import IMPLEMENTATIONS  # noqa: E402


def test_the_api_that_registered_matches_this_torch():
    has_custom_op = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_fake")
    assert mha.torch.API == ("custom_op" if has_custom_op else "Library")


def test_sdpa_through_torch_ops(rng):
    q, k, v = random_qkv(rng, H=4, Hkv=2, L=6, S=10, E=16, Ev=8)
    mask = rng.standard_normal((6, 10)).astype(np.float32)
    tq, tk, tv, tmask = (torch.from_numpy(x) for x in (q, k, v, mask))
    out = torch.ops.mha.sdpa(tq, tk, tv, tmask, 0.0, True, 0.5, True)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 4, 6, 8)
    ref, _, max_logit = reference.attention(q, k, v, mask=mask, is_causal=True, scale=0.5)
    assert_close(out, ref, max_logit)
    same = mha.scaled_dot_product_attention(tq, tk, tv, tmask, is_causal=True, scale=0.5,
                                            enable_gqa=True)
    assert torch.equal(out, same)


def test_keywords_and_defaults(rng):
    tq, tk, tv = (torch.from_numpy(x) for x in random_qkv(rng))
    mask = torch.from_numpy(rng.random((9, 13)) < 0.8)
    out = torch.ops.mha.sdpa(tq, tk, tv, attn_mask=mask)
    assert torch.equal(out, mha.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask))
    assert torch.equal(torch.ops.mha.sdpa(tq, tk, tv),
                       mha.scaled_dot_product_attention(tq, tk, tv))


def test_sdpa_with_lse(rng):
    q, k, v = random_qkv(rng)
    out, lse = torch.ops.mha.sdpa_with_lse(*(torch.from_numpy(x) for x in (q, k, v)),
                                           is_causal=True)
    ref, ref_lse, max_logit = reference.attention(q, k, v, is_causal=True)
    assert_close(out, ref, max_logit)
    assert lse.dtype == torch.float32 and lse.shape == (2, 3, 9)
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_tensors_give_the_shapes(dtype):
    q = torch.empty(2, 8, 5, 64, device="meta", dtype=dtype)
    k = torch.empty(2, 2, 7, 64, device="meta", dtype=dtype)
    v = torch.empty(2, 2, 7, 32, device="meta", dtype=dtype)
    out = torch.ops.mha.sdpa(q, k, v, enable_gqa=True)
    assert out.device.type == "meta" and out.shape == (2, 8, 5, 32) and out.dtype == dtype
    out, lse = torch.ops.mha.sdpa_with_lse(q[0, 0], k[0, 0], v[0, 0])
    assert out.shape == (5, 32) and out.dtype == dtype
    assert lse.device.type == "meta" and lse.shape == (5,) and lse.dtype == torch.float32


def test_errors_come_through_the_operator(rng):
    tq, tk, tv = (torch.from_numpy(x) for x in random_qkv(rng))
    with pytest.raises(mha.Error, match="MHA_ERR_SHAPE_MISMATCH"):
        torch.ops.mha.sdpa(tq, tk[..., :8], tv)
    with pytest.raises(TypeError, match="query is float64 and requires grad"):
        torch.ops.mha.sdpa(tq.double().requires_grad_(), tk.double(), tv.double())


@pytest.mark.skipif(mha.torch.API != "Library", reason="the custom_op operators have no "
                    "autograd formula yet")
def test_gradients_through_the_operators(rng):
    """The operators' Autograd kernel records mha's autograd.Function: the same gradients,
    bit for bit, as mha.scaled_dot_product_attention's (test_backward.py checks those against
    the float64 reference); sdpa_with_lse's LSE has no gradient."""
    for name in IMPLEMENTATIONS:  # its own kernel, not the Autograd key's fallthrough
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"mha::{name}", "Autograd")
    q, k, v = random_qkv(rng, H=4, Hkv=2)
    mask = rng.standard_normal((9, 13)).astype(np.float32)
    grad_out = torch.from_numpy(rng.standard_normal((2, 4, 9, 16)).astype(np.float32))
    grads = []
    for call in (torch.ops.mha.sdpa,
                 lambda *args: torch.ops.mha.sdpa_with_lse(*args)[0],
                 mha.scaled_dot_product_attention):
        leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v, mask)]
        out = call(*leaves, 0.0, True, 0.5, True)
        assert out.grad_fn is not None
        out.backward(grad_out)
        grads.append([x.grad for x in leaves])
    for got in grads[:2]:
        for a, b in zip(got, grads[2]):
            assert torch.equal(a, b)
    leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k[:, :1], v[:, :1])]
    out, lse = torch.ops.mha.sdpa_with_lse(*leaves, enable_gqa=True)
    assert out.requires_grad and not lse.requires_grad
    with torch.no_grad():
        assert not torch.ops.mha.sdpa(*leaves, enable_gqa=True).requires_grad


def test_registration_through_custom_op_on_newer_torch(rng):
    """On torch 2.4+ the operators are made with custom_op and register_fake.  Checked here
    against stand-ins with those functions' signatures: the names, schemas (parsed by this
    torch) and implementations each receives."""
    made, fakes = {}, {}

    def custom_op(name, fn=None, /, *, mutates_args, device_types=None, schema=None):
        assert mutates_args == () and device_types == "cpu"
        made[name] = (fn, schema)
        return name

    def register_fake(op, func=None, /, *, lib=None, _stacklevel=1):
        fakes[op] = func

    api, handles = mha.torch._register(types.SimpleNamespace(custom_op=custom_op,
                                                             register_fake=register_fake))
    assert api == "custom_op" and handles == ["mha::sdpa", "mha::sdpa_with_lse"]
    assert set(made) == set(fakes) == {"mha::sdpa", "mha::sdpa_with_lse"}
    tq, tk, tv = (torch.from_numpy(x) for x in random_qkv(rng))
    for name, (implementation, schema) in made.items():
        parsed = torch._C.parse_schema(name + schema)
        names = [argument.name for argument in parsed.arguments]
        assert names == list(inspect.signature(implementation).parameters)
        assert names == list(inspect.signature(fakes[name]).parameters)
        result = implementation(tq, tk, tv)
        fake = fakes[name](tq.to("meta"), tk.to("meta"), tv.to("meta"))
        for got, shape in zip(result if isinstance(result, tuple) else [result],
                              fake if isinstance(fake, tuple) else [fake]):
            assert got.shape == shape.shape and got.dtype == shape.dtype
