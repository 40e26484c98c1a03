"""The int8 KV cache: mha.quantize_kv against mha.h's definition, and attention over int8
key/value with k_scale/v_scale against the float64 reference computed from the
dequantised values (scale · int8): the int8 rounding is the cache's, not the kernel's
error, so the fp32 tolerance applies (plus one rounding of a half-precision output)."""
import numpy as np
import pytest

import mha
from conftest import assert_close, dtype_name, random_qkv, to_float64
import reference

torch = pytest.importorskip("torch")


def dequantised(rows, scale):
    """scale · int8, in float64: the values an int8 cache stands for."""
    return to_float64(scale)[..., None] * to_float64(rows)


def expected_quantisation(src):
    """mha.h's rule in float32 arithmetic: scale = max|row| / 127, round(x / scale) to
    nearest even (NumPy's float32 division and rint are IEEE's)."""
    x = to_float64(src).astype(np.float32)
    scale = np.abs(x).max(axis=-1) / np.float32(127)
    with np.errstate(invalid="ignore", divide="ignore"):
        rows = np.where(scale[..., None] == 0, 0, np.rint(x / scale[..., None]))
    return rows.astype(np.int8), scale


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_quantize_kv_follows_the_definition(rng, dtype):
    x = torch.from_numpy((rng.standard_normal((2, 3, 11, 24)) * 5).astype(np.float32))
    x = x.to(getattr(torch, dtype))
    x[0, 1, 4] = 0  # a row of zeros: scale 0, zeros
    rows, scale = mha.quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    want_rows, want_scale = expected_quantisation(x)
    np.testing.assert_array_equal(scale.numpy(), want_scale)
    np.testing.assert_array_equal(rows.numpy(), want_rows)
    assert scale[0, 1, 4] == 0 and not torch.any(rows[0, 1, 4])
    # mha.h's bound, scale / 2, up to the float32 rounding of x / scale (a quotient just
    # below a tie such as 63.49999987 rounds to 63.5, then away from x).
    error = np.abs(to_float64(x) - dequantised(rows, scale))
    assert np.all(error <= to_float64(scale)[..., None] / 2 + 2.0**-23 * np.abs(to_float64(x)))


def test_quantize_kv_numpy_in_numpy_out_and_fewer_dimensions(rng):
    x = rng.standard_normal((7, 16)).astype(np.float32)  # [L, D]
    rows, scale = mha.quantize_kv(x)
    assert isinstance(rows, np.ndarray) and rows.dtype == np.int8 and scale.shape == (7,)
    want_rows, want_scale = expected_quantisation(x)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(scale, want_scale)


def test_quantize_kv_into_views_of_a_cache(rng):
    """New tokens quantised in place into a preallocated cache ([B, L, H, D] memory)."""
    cache = np.zeros((1, 32, 2, 16), dtype=np.int8)
    scales = np.zeros((1, 32, 2), dtype=np.float32)
    new = rng.standard_normal((1, 2, 5, 16)).astype(np.float32)  # [B, H, 5 tokens, D]
    dst = cache.transpose(0, 2, 1, 3)[:, :, 10:15]
    scale = scales.transpose(0, 2, 1)[:, :, 10:15]
    rows, got_scale = mha.quantize_kv(new, dst=dst, scale=scale)
    assert rows is dst and got_scale is scale
    want_rows, want_scale = expected_quantisation(new)
    np.testing.assert_array_equal(cache[:, 10:15].transpose(0, 2, 1, 3), want_rows)
    np.testing.assert_array_equal(scales[:, 10:15].transpose(0, 2, 1), want_scale)
    assert not np.any(cache[:, :10]) and not np.any(cache[:, 15:]) and not np.any(scales[:, 15:])


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_attention_over_an_int8_cache(rng, framework):
    q, k, v = random_qkv(rng, H=4, Hkv=2, L=5, S=19, E=32)
    k8, ks = mha.quantize_kv(k)
    v8, vs = mha.quantize_kv(v)
    mask = rng.standard_normal((5, 19)).astype(np.float32)
    args = (q, k8, v8, mask)
    if framework == "torch":
        args = tuple(torch.from_numpy(x) for x in args)
        ks, vs = torch.from_numpy(ks), torch.from_numpy(vs)
    out, lse = mha.scaled_dot_product_attention(
        *args, is_causal=True, enable_gqa=True, causal_alignment="bottom-right",
        k_scale=ks, v_scale=vs, return_lse=True)
    assert isinstance(out, type(args[0])) and out.dtype == args[0].dtype
    ref, ref_lse, max_logit = reference.attention(
        q, dequantised(k8, ks), dequantised(v8, vs), mask=mask, is_causal=True,
        alignment=reference.BOTTOM_RIGHT)
    assert_close(out, ref, max_logit)
    np.testing.assert_allclose(to_float64(lse), ref_lse, rtol=1e-5, atol=1e-5)


def test_int8_cache_read_in_place_with_its_strides(rng):
    """A [B, L, Hkv, D] cache and [B, L, Hkv] scales, viewed as [B, Hkv, L, ...]."""
    q = rng.standard_normal((2, 2, 3, 16)).astype(np.float32)
    cache_k = rng.integers(-127, 128, (2, 9, 2, 16), dtype=np.int8)
    cache_v = rng.integers(-127, 128, (2, 9, 2, 16), dtype=np.int8)
    scales = rng.random((2, 9, 2, 2), dtype=np.float32) / 64  # [..., k or v]
    k, v = cache_k.transpose(0, 2, 1, 3), cache_v.transpose(0, 2, 1, 3)
    ks, vs = scales[..., 0].transpose(0, 2, 1), scales[..., 1].transpose(0, 2, 1)
    out = mha.scaled_dot_product_attention(q, k, v, k_scale=ks, v_scale=vs)
    ref, _, max_logit = reference.attention(q, dequantised(k, ks), dequantised(v, vs))
    assert_close(out, ref, max_logit)


def test_one_scale_for_every_head_through_a_zero_stride(rng):
    q, k, v = random_qkv(rng, L=4, S=6)
    k8 = np.clip(np.rint(k * 20), -127, 127).astype(np.int8)
    v8 = np.clip(np.rint(v * 20), -127, 127).astype(np.int8)
    scale = np.broadcast_to(np.float32(0.05), (2, 3, 6))
    assert scale.strides == (0, 0, 0)
    out = mha.scaled_dot_product_attention(q, k8, v8, k_scale=scale, v_scale=scale)
    ref, _, max_logit = reference.attention(q, dequantised(k8, scale), dequantised(v8, scale))
    assert_close(out, ref, max_logit)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_query_over_an_int8_cache(rng, dtype):
    q, k, v = random_qkv(rng)
    tq = torch.from_numpy(q).to(getattr(torch, dtype))
    (k8, ks), (v8, vs) = mha.quantize_kv(torch.from_numpy(k)), mha.quantize_kv(torch.from_numpy(v))
    out = mha.scaled_dot_product_attention(tq, k8, v8, k_scale=ks, v_scale=vs)
    assert out.dtype == tq.dtype
    ref, _, max_logit = reference.attention(to_float64(tq), dequantised(k8, ks),
                                            dequantised(v8, vs))
    assert_close(out, ref, max_logit, out_dtype=dtype_name(out))


@pytest.fixture
def cache(rng):
    q, k, v = random_qkv(rng)
    return q, mha.quantize_kv(k), mha.quantize_kv(v), (k, v)


def test_int8_key_and_value_need_both_scales(cache):
    q, (k8, ks), (v8, vs), _ = cache
    with pytest.raises(mha.Error, match="k_scale is NULL; k and v are i8") as caught:
        mha.scaled_dot_product_attention(q, k8, v8)
    assert caught.value.status == "MHA_ERR_NULL_POINTER"
    with pytest.raises(mha.Error, match="v_scale is NULL"):
        mha.scaled_dot_product_attention(q, k8, v8, k_scale=ks)


def test_scales_of_the_wrong_shape_dtype_or_type(cache):
    q, (k8, ks), (v8, vs), _ = cache
    with pytest.raises(mha.Error, match=r"v_scale has shape \[2, 3, 12\]; it must be "
                                        r"\[B, Hkv, Lk\] = \[2, 3, 13\]"):
        mha.scaled_dot_product_attention(q, k8, v8, k_scale=ks, v_scale=vs[..., 1:])
    with pytest.raises(TypeError, match="k_scale has dtype float64"):
        mha.scaled_dot_product_attention(q, k8, v8, k_scale=ks.astype(np.float64), v_scale=vs)
    with pytest.raises(TypeError, match="v_scale must be a NumPy array"):
        mha.scaled_dot_product_attention(q, k8, v8, k_scale=ks, v_scale=0.5)
    with pytest.raises(ValueError, match="k_scale must have 1 to 3 dimensions"):
        mha.scaled_dot_product_attention(q, k8, v8, k_scale=ks[..., None], v_scale=vs)


def test_scales_with_a_float_cache_and_an_int8_query(cache):
    q, (k8, ks), (v8, vs), (k, v) = cache
    with pytest.raises(mha.Error, match="k_scale is given but k and v are not i8"):
        mha.scaled_dot_product_attention(q, k, v, k_scale=ks, v_scale=vs)
    with pytest.raises(mha.Error, match="q has dtype i8; it must be f32, bf16 or f16"):
        mha.scaled_dot_product_attention(mha.quantize_kv(q)[0], k8, v8, k_scale=ks, v_scale=vs)


def test_quantize_kv_refuses(rng):
    x = rng.standard_normal((2, 3, 4, 8)).astype(np.float32)
    with pytest.raises(TypeError, match="src must be a NumPy array"):
        mha.quantize_kv([[1.0]])
    with pytest.raises(ValueError, match="src must have 2 to 4 dimensions"):
        mha.quantize_kv(x[None])
    bad = x.copy()
    bad[1, 2, 3, 4] = np.inf
    with pytest.raises(mha.Error, match=r"src\[1\]\[2\]\[3\]\[4\] = inf; int8 rows need finite"):
        mha.quantize_kv(bad)
    with pytest.raises(mha.Error, match="src has dtype i32"):
        mha.quantize_kv(x.astype(np.int32))
    with pytest.raises(mha.Error, match="dst has dtype f32; it must be i8"):
        mha.quantize_kv(x, dst=np.empty_like(x))
    with pytest.raises(mha.Error, match=r"scale has shape \[2, 3, 5\]"):
        mha.quantize_kv(x, scale=np.empty((2, 3, 5), dtype=np.float32))
