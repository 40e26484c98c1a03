"""Gradients of bfloat16 and float16 inputs under torch's autograd: each gradient in its
input's dtype, against the float64 reference of test_backward.py on the same rounded inputs.

The backward widens half-precision inputs to fp32 as it reads them and rounds each gradient
once; its delta = rowsum(grad_out ∘ out) reads the forward's out as given, rounded to the
output's dtype (mha.h), so the reference takes the same delta: the exact gradients minus
P · (delta_given - delta_exact) in dS.  A gradient's tolerance is then the fp32 one of
test_backward.py plus one rounding of each element to its dtype (UNIT_ROUNDOFF of its own
|value|, so a gradient rounded twice or truncated fails)."""
import math

import numpy as np
import pytest

import mha
from conftest import UNIT_ROUNDOFF, assert_close, dtype_name, random_qkv, to_float64
from test_backward import reference_forward, reference_gradients

torch = pytest.importorskip("torch")


@pytest.fixture(params=mha.backends())
def backend(request):
    return request.param


def rounded(x, dtype):
    """A float32 array as a torch tensor of `dtype` (the values mha and the reference share)."""
    return torch.from_numpy(x).to(getattr(torch, dtype))


def given_delta_correction(q, k, v, out, grad_out, mask, group, **options):
    """What reading the forward's rounded out changes in dS = P ∘ (dP - delta): -P ·
    (delta_given - delta_exact), [B, H, L, S] float64, and what it needs beside."""
    f64 = [torch.from_numpy(to_float64(x)) for x in (q, k, v)]
    exact, aux = reference_forward(*f64, mask, **options)
    dout = torch.from_numpy(to_float64(grad_out))
    given = torch.from_numpy(to_float64(out))
    shift = (dout * (given - exact)).sum(-1, keepdim=True)
    assert group == aux["group"]
    return -aux["p"] * shift, aux, f64[0]


def check_half(rng, backend, *, q_dtype, kv_dtype, B=2, H=4, Hkv=None, L=21, S=27, E=16,
               Ev=None, attn_mask=None, mask_grad=False, **options):
    """mha's gradients of half-precision (or mixed) inputs under autograd against the
    reference; returns them."""
    q, k, v = random_qkv(rng, B=B, H=H, L=L, S=S, E=E, Ev=Ev, Hkv=Hkv)
    tq, tk, tv = rounded(q, q_dtype), rounded(k, kv_dtype), rounded(v, kv_dtype)
    leaves = {"query": tq.requires_grad_(), "key": tk.requires_grad_(),
              "value": tv.requires_grad_()}
    mask = None
    if attn_mask is not None:
        mask = rounded(attn_mask, q_dtype)
        if mask_grad:
            leaves["attn_mask"] = mask.requires_grad_()
    out = mha.scaled_dot_product_attention(tq, tk, tv, mask, enable_gqa=Hkv is not None,
                                           backend=backend, **options)
    assert out.dtype == tq.dtype and out.requires_grad
    # grad_out in out's dtype, as autograd hands it over: the reference takes its values.
    grad_out = rounded(rng.standard_normal(tuple(out.shape)).astype(np.float32), q_dtype)
    out.backward(grad_out)

    mask64 = None if mask is None else to_float64(mask)
    want, tolerance = reference_gradients(to_float64(tq), to_float64(tk), to_float64(tv),
                                          to_float64(grad_out), mask64, mask_grad=mask_grad,
                                          **options)
    ref_out, _ = reference_forward(*(torch.from_numpy(to_float64(x)) for x in (tq, tk, tv)),
                                   None if mask is None else torch.from_numpy(mask64),
                                   **options)
    info = mha.info()
    name = info["selected"] if backend is None else backend
    bf16_dot = (next(b for b in info["backends"] if b["name"] == name)["bf16_dot"]
                and q_dtype == kv_dtype == "bfloat16")
    assert_close(out, ref_out.numpy(), 30.0, out_dtype=q_dtype,
                 max_v=np.abs(to_float64(tv)).max(), bf16_dot=bf16_dot)

    group = H // (Hkv or H)
    correction, aux, query64 = given_delta_correction(
        tq, tk, tv, out, grad_out, None if mask is None else torch.from_numpy(mask64), group,
        **options)
    # dS reaches the scores through the scale (and softcap's tanh': 1 / cosh²).
    slope = torch.tensor(aux["scale"], dtype=torch.float64)
    if aux["softcap"] > 0.0:
        slope = slope / torch.cosh(aux["scores"] / aux["softcap"]) ** 2
    want["query"] = want["query"] + (slope * correction @ aux["k"]).numpy()
    dk = (slope * correction).transpose(-1, -2) @ query64
    want["key"] = want["key"] + dk.reshape(B, H // group, group, S, E).sum(2).numpy()
    if "attn_mask" in want:
        shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
        want["attn_mask"] = want["attn_mask"] + correction.sum_to_size(shape).reshape(
            want["attn_mask"].shape).numpy()

    got = {name: x.grad for name, x in leaves.items()}
    assert set(got) == set(want)
    for name, grad in got.items():
        # query's, key's and value's gradients in their dtypes; a mask's in its own.
        assert grad.dtype == leaves[name].dtype, name
        assert tuple(grad.shape) == want[name].shape, name
        value = to_float64(grad)
        assert np.all(np.isfinite(value)), name
        e = tolerance[name]
        bound = e + UNIT_ROUNDOFF[dtype_name(grad)] * (np.abs(want[name]) + e)
        error = np.abs(value - want[name])
        worst = np.unravel_index(np.argmax(error - bound), error.shape)
        assert np.all(error <= bound), (
            f"{name}: |mha - ref| = {error[worst]:.3g} > {bound[worst]:.3g} at {worst}")
    return got


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_plain_with_dv_differing(rng, backend, dtype):
    check_half(rng, backend, q_dtype=dtype, kv_dtype=dtype, Ev=24)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("alignment", ["top-left", "bottom-right"])
def test_causal_grouped_query(rng, backend, dtype, alignment):
    check_half(rng, backend, q_dtype=dtype, kv_dtype=dtype, H=6, Hkv=2, is_causal=True,
               causal_alignment=alignment)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_additive_mask_and_its_gradient(rng, backend, dtype):
    """The mask in the inputs' dtype: its gradient is the library's float32 one rounded."""
    mask = (2 * rng.standard_normal((21, 27))).astype(np.float32)
    mask[3, :5] = -math.inf
    check_half(rng, backend, q_dtype=dtype, kv_dtype=dtype, attn_mask=mask, mask_grad=True)


@pytest.mark.parametrize("q_dtype, kv_dtype", [("float32", "bfloat16"), ("bfloat16", "float32"),
                                               ("float16", "bfloat16")])
def test_mixed_dtypes(rng, backend, q_dtype, kv_dtype):
    """A float32 query over a bfloat16 cache and the other ways round: each gradient in its
    input's dtype (a float32 one with the fp32 tolerance)."""
    check_half(rng, backend, q_dtype=q_dtype, kv_dtype=kv_dtype, H=4, Hkv=2, is_causal=True)


def test_variants(rng, backend):
    check_half(rng, backend, q_dtype="bfloat16", kv_dtype="bfloat16", window_size=(6, 2),
               softcap=8.0, valid_lens=[27, 11])


def test_long_rows_across_key_tiles(rng):
    """More keys than one tile of the backward holds, in float16."""
    check_half(rng, None, q_dtype="float16", kv_dtype="float16", B=1, H=2, L=70, S=600, E=32,
               is_causal=True, causal_alignment="bottom-right")


def test_autograd_gives_the_bits_of_the_backward_function(rng):
    """The autograd path and scaled_dot_product_attention_backward with half-precision
    gradients given are the same call: the same bits."""
    q, k, v = (rounded(x, "bfloat16") for x in random_qkv(rng, H=4, Hkv=2, L=17, S=23))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = mha.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    grad_out = torch.from_numpy(rng.standard_normal(tuple(out.shape)).astype(np.float32))
    out.backward(grad_out.bfloat16())

    out2, lse = mha.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                 return_lse=True)
    assert torch.equal(out2, out.detach())
    grads = [torch.full(tuple(x.shape), math.nan, dtype=torch.bfloat16) for x in (q, k, v)]
    mha.scaled_dot_product_attention_backward(grad_out.bfloat16(), q, k, v, out2, lse,
                                              is_causal=True, enable_gqa=True,
                                              grad_query=grads[0], grad_key=grads[1],
                                              grad_value=grads[2])
    for leaf, grad in zip(leaves, grads):
        assert leaf.grad.dtype == torch.bfloat16
        assert torch.equal(leaf.grad, grad)
    # float32 gradients by default there: the same sums before their one rounding.
    f32 = mha.scaled_dot_product_attention_backward(grad_out.bfloat16(), q, k, v, out2, lse,
                                                    is_causal=True, enable_gqa=True)
    for leaf, grad in zip(leaves, f32):
        assert grad.dtype == torch.float32
        assert torch.equal(leaf.grad, grad.bfloat16())


def test_training_steps_in_bfloat16_follow_float32(rng):
    """A few SGD steps on bfloat16 parameters track the same steps in float32 (what a user of
    CPU autocast trains with): the losses agree to bfloat16's precision."""
    q, k, v = random_qkv(rng, B=1, H=2, L=16, S=16, E=16)
    target = torch.from_numpy(rng.standard_normal((1, 2, 16, 16)).astype(np.float32))
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.from_numpy(x).to(dtype).requires_grad_() for x in (q, k, v)]
        losses[dtype] = []
        for _ in range(4):
            out = mha.scaled_dot_product_attention(*params, is_causal=True)
            loss = ((out.float() - target) ** 2).mean()
            loss.backward()
            losses[dtype].append(loss.item())
            with torch.no_grad():
                for p in params:
                    p -= 0.5 * p.grad
                    p.grad = None
    assert losses[torch.float32][-1] < losses[torch.float32][0]
    np.testing.assert_allclose(losses[torch.bfloat16], losses[torch.float32], rtol=3e-2)


def test_int8_cache_still_has_no_gradient(rng):
    q, k, v = random_qkv(rng)
    k8, k_scale = mha.quantize_kv(k)
    v8, v_scale = mha.quantize_kv(v)
    with pytest.raises(TypeError, match="key is int8 and query requires grad.*int8 KV cache"):
        mha.scaled_dot_product_attention(rounded(q, "bfloat16").requires_grad_(),
                                         torch.from_numpy(k8), torch.from_numpy(v8),
                                         k_scale=k_scale, v_scale=v_scale)
