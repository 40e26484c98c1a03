"""bfloat16 and float16: the reference computes from the same rounded inputs, and one
rounding of a half-precision output is allowed (plus the bf16 dot-product path's
4·2⁻⁹·max|V| when the backend has it)."""
import numpy as np
import pytest

import mha
from conftest import assert_close, dtype_name, random_qkv, to_float64
import reference

torch = pytest.importorskip("torch")


def bf16_dot_possible(q, k):
    """Whether the call takes the bf16 dot-product path: the selected backend
    computes bf16 products so on this CPU (avx512bf16, unless the runtime
    widens bf16 here: ``bf16_dot`` in mha.info()), and Q and K are bf16."""
    info = mha.info()
    selected = next(b for b in info["backends"] if b["name"] == info["selected"])
    return selected["bf16_dot"] and q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kv_dtype", ["same", "float32"])
def test_torch_half_inputs(rng, dtype, kv_dtype):
    q, k, v = random_qkv(rng, L=37, S=41, E=32)
    tq = torch.from_numpy(q).to(getattr(torch, dtype))
    kv = getattr(torch, dtype if kv_dtype == "same" else kv_dtype)
    tk, tv = torch.from_numpy(k).to(kv), torch.from_numpy(v).to(kv)
    mask = torch.from_numpy(rng.standard_normal((37, 41)).astype(np.float32)).to(tq.dtype)
    out, lse = mha.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, is_causal=True,
                                                return_lse=True)
    assert out.dtype == tq.dtype and lse.dtype == torch.float32
    # The reference's inputs are the rounded values mha was given.
    ref, ref_lse, max_logit = reference.attention(to_float64(tq), to_float64(tk), to_float64(tv),
                                                  mask=to_float64(mask), is_causal=True)
    assert_close(out, ref, max_logit, out_dtype=dtype, max_v=np.abs(to_float64(tv)).max(),
                 bf16_dot=bf16_dot_possible(tq, tk))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse.numpy()[finite], ref_lse[finite], rtol=1e-5, atol=1e-4)


def test_torch_bf16_query_into_float32_out(rng):
    q, k, v = random_qkv(rng)
    tq, tk, tv = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v))
    out = torch.empty(2, 3, 9, 16, dtype=torch.float32)
    mha.scaled_dot_product_attention(tq, tk, tv, out=out)
    ref, _, max_logit = reference.attention(to_float64(tq), to_float64(tk), to_float64(tv))
    assert_close(out, ref, max_logit, max_v=np.abs(to_float64(tv)).max(),
                 bf16_dot=bf16_dot_possible(tq, tk))


def test_numpy_float16(rng):
    q, k, v = random_qkv(rng, dtype=np.float16)
    out = mha.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert out.dtype == np.float16
    ref, _, max_logit = reference.attention(q, k, v, scale=0.3)
    assert_close(out, ref, max_logit, out_dtype=dtype_name(out))


def test_torch_bf16_transposed_views(rng):
    bf = torch.from_numpy(rng.standard_normal((2, 19, 4, 32)).astype(np.float32)).bfloat16()
    q = k = v = bf.transpose(1, 2)
    out = mha.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref, _, max_logit = reference.attention(to_float64(q), to_float64(k), to_float64(v),
                                            is_causal=True)
    assert_close(out, ref, max_logit, out_dtype="bfloat16", max_v=np.abs(to_float64(v)).max(),
                 bf16_dot=bf16_dot_possible(q, k))
