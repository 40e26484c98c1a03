"""Every kind of bad argument: TypeError for a wrong Python type, ValueError for a wrong
rank or a PyTorch rule, mha.Error (a RuntimeError) with the library's message otherwise;
each message names the argument, and a failed call leaves `out` untouched."""
import contextlib

import numpy as np
import pytest

import mha
from conftest import random_qkv

torch = pytest.importorskip("torch")


@pytest.fixture
def qkv(rng):
    return random_qkv(rng)


def sdpa(q, k, v, **kwargs):
    return mha.scaled_dot_product_attention(q, k, v, **kwargs)


def test_error_class():
    assert issubclass(mha.Error, RuntimeError)
    with pytest.raises(mha.Error) as caught:
        mha.set_backend("no-such-backend")
    assert caught.value.status == "MHA_ERR_BACKEND_UNAVAILABLE"
    assert str(caught.value).startswith("MHA_ERR_BACKEND_UNAVAILABLE: ")
    assert "no-such-backend" in str(caught.value)


@pytest.mark.parametrize("position", ["query", "key", "value"])
@pytest.mark.parametrize("bad", [[[1.0, 2.0]], None, 3.0, "array"])
def test_inputs_that_are_not_arrays(qkv, position, bad):
    args = dict(zip(["query", "key", "value"], qkv))
    args[position] = bad
    with pytest.raises(TypeError, match=position):
        mha.scaled_dot_product_attention(**args)


@pytest.mark.parametrize("name", ["attn_mask", "out", "valid_lens"])
def test_optional_arrays_of_the_wrong_type(qkv, name):
    with pytest.raises(TypeError, match=name):
        sdpa(*qkv, **{name: "not an array"})


def test_read_only_out(qkv):
    out = np.empty((2, 3, 9, 16), dtype=np.float32)
    out.flags.writeable = False
    with pytest.raises(TypeError, match="out must be a writable array"):
        sdpa(*qkv, out=out)


@pytest.mark.parametrize("shape", [(), (16,), (1, 2, 3, 9, 16)])
def test_query_of_the_wrong_rank(qkv, shape):
    q = np.zeros(shape, dtype=np.float32)
    with pytest.raises(ValueError, match="query must have 2 to 4 dimensions"):
        sdpa(q, *qkv[1:])
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="query must have 2 to 4 dimensions"):
        sdpa(torch.zeros(shape), *(torch.from_numpy(x) for x in qkv[1:]))


def test_dtype_mha_has_no_name_for(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="query has dtype float64"):
        sdpa(q.astype(np.float64), k, v)


@contextlib.contextmanager
def expect_library_error(status, *words):
    """mha.Error with this status, its message holding every word."""
    with pytest.raises(mha.Error) as caught:
        yield
    assert caught.value.status == status, str(caught.value)
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_library_refuses_dtypes(qkv):
    q, k, v = qkv
    with expect_library_error("MHA_ERR_INVALID_DTYPE", "q has dtype i32"):
        sdpa(q.astype(np.int32), k, v)
    with expect_library_error("MHA_ERR_INVALID_DTYPE", "v has dtype f16 but k has f32"):
        sdpa(q, k, v.astype(np.float16))
    with expect_library_error("MHA_ERR_INVALID_DTYPE", "mask"):
        sdpa(q, k, v, attn_mask=np.zeros((9, 13), dtype=np.int32))
    with expect_library_error("MHA_ERR_INVALID_DTYPE", "valid_lens"):
        sdpa(q, k, v, valid_lens=np.array([1.0, 2.0], dtype=np.float32))


def test_library_refuses_shapes(qkv):
    q, k, v = qkv
    with expect_library_error("MHA_ERR_SHAPE_MISMATCH"):
        sdpa(q, k[..., :8], v)  # head sizes differ
    with expect_library_error("MHA_ERR_SHAPE_MISMATCH"):
        sdpa(q, k, v[:, :, :5])  # key and value lengths differ
    with expect_library_error("MHA_ERR_SHAPE_MISMATCH", "mask"):
        sdpa(q, k, v, attn_mask=np.zeros((9, 12), dtype=bool))
    with expect_library_error("MHA_ERR_SHAPE_MISMATCH", "valid_lens"):
        sdpa(q, k, v, valid_lens=np.array([1, 2, 3]))
    with expect_library_error("MHA_ERR_SHAPE_MISMATCH"):
        sdpa(q, k, v, out=np.empty((2, 3, 9, 15), dtype=np.float32))


def test_failed_call_leaves_out_untouched(qkv):
    q, k, v = qkv
    out = np.full((2, 3, 9, 16), 7.0, dtype=np.float32)
    with pytest.raises(mha.Error):
        sdpa(q, k, v, out=out, valid_lens=np.array([1, 99]))  # 99 > Lk
    assert np.all(out == 7.0)


def test_library_refuses_values(qkv):
    q, k, v = qkv
    with expect_library_error("MHA_ERR_INVALID_VALUE", "valid_lens"):
        sdpa(q, k, v, valid_lens=np.array([1, 99]))
    for scale in (float("inf"), float("nan"), float("-inf")):  # (0.0: PyTorch's uniform weights)
        with expect_library_error("MHA_ERR_INVALID_VALUE", "scale"):
            sdpa(q, k, v, scale=scale)
    for p in (1.0, -0.1):
        with expect_library_error("MHA_ERR_INVALID_VALUE", "dropout_p"):
            sdpa(q, k, v, dropout_p=p)


def test_out_overlapping_an_input(qkv):
    q, k, v = qkv
    with expect_library_error("MHA_ERR_OVERLAP", "out"):
        sdpa(q, k, v, out=q)


def test_negative_strides(qkv):
    q, k, v = qkv
    with pytest.raises((TypeError, mha.Error), match="query|q->strides"):
        sdpa(q[..., ::-1], k, v)


@pytest.mark.parametrize("name,value,error", [
    ("scale", "0.5", TypeError), ("dropout_p", "0.1", TypeError), ("dropout_p", None, TypeError),
    ("is_causal", "yes", TypeError), ("is_causal", 1, TypeError), ("enable_gqa", None, TypeError),
    ("return_lse", 1, TypeError), ("causal_alignment", "bottom", ValueError),
    ("causal_alignment", 2, TypeError), ("dropout_seed", -1, ValueError),
    ("dropout_seed", 2**64, ValueError), ("dropout_seed", 1.5, TypeError),
    ("backend", 3, TypeError), ("threads", 0, ValueError), ("threads", 5000, ValueError),
    ("threads", "2", TypeError), ("valid_lens", [1.5, 2], TypeError),
])
def test_python_arguments_of_the_wrong_type_or_value(qkv, name, value, error):
    with pytest.raises(error, match=name):
        sdpa(*qkv, **{name: value})


def test_gqa_needs_enable_gqa_as_in_pytorch(rng):
    q, k, v = random_qkv(rng, H=6, Hkv=3)
    with pytest.raises(ValueError, match="enable_gqa"):
        sdpa(q, k, v)
    with expect_library_error("MHA_ERR_SHAPE_MISMATCH"):
        sdpa(*random_qkv(rng, H=6, Hkv=4), enable_gqa=True)  # 6 is no multiple of 4


def test_unknown_backend_per_call_changes_nothing(qkv):
    selected = mha.info()["selected"]
    with expect_library_error("MHA_ERR_BACKEND_UNAVAILABLE", "no-such-backend"):
        sdpa(*qkv, backend="no-such-backend")
    assert mha.info()["selected"] == selected


def test_runtime_functions_refuse_bad_arguments():
    with expect_library_error("MHA_ERR_INVALID_VALUE"):
        mha.set_num_threads(-1)
    with pytest.raises(TypeError):
        mha.set_num_threads("4")
    with pytest.raises(TypeError):
        mha.set_backend(None)


def test_torch_tensor_requiring_grad_without_a_gradient(qkv):
    """Query, key, value, a float mask and sinks have gradients (test_backward.py); the ALiBi
    slopes do not: refused by name while autograd is on, read as they are under no_grad."""
    q, k, v = (torch.from_numpy(x) for x in qkv)
    slopes = torch.tensor([0.5, 0.25, 0.125], requires_grad=True)
    with pytest.raises(ValueError, match="alibi_slopes requires grad"):
        sdpa(q, k, v, alibi_slopes=slopes)
    with torch.no_grad():
        sdpa(q, k, v, alibi_slopes=slopes)


def test_merge_partials_bad_arguments(rng):
    q, k, v = random_qkv(rng)
    out, lse = sdpa(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="lists"):
        mha.merge_partials(out, lse)
    with pytest.raises(ValueError, match="empty"):
        mha.merge_partials([], [])
    with pytest.raises(ValueError, match="pair up"):
        mha.merge_partials([out, out], [lse])
    with pytest.raises(TypeError, match=r"lses\[0\]"):
        mha.merge_partials([out], ["lse"])
    with expect_library_error("MHA_ERR_SHAPE_MISMATCH"):
        mha.merge_partials([out], [lse[:, :, :4]])


def test_arrays_that_cannot_be_read_in_place(qkv):
    """NumPy arrays the library cannot describe as they are: refused with the reason,
    never copied."""
    q, k, v = qkv
    with pytest.raises(TypeError, match="query cannot be read in place: its bytes are not in "
                                        "the machine's order"):
        sdpa(q.astype(">f4"), k, v)
    fields = np.zeros(k.shape, dtype=[("x", np.float32), ("tag", np.int8)])
    fields["x"] = k
    with pytest.raises(TypeError, match="key cannot be read in place: its strides are not "
                                        "whole elements"):
        sdpa(q, fields["x"], v)


def test_torch_tensors_mha_cannot_read(qkv):
    q, k, v = (torch.from_numpy(x) for x in qkv)
    with pytest.raises(TypeError, match="key has dtype float64, which mha does not take"):
        sdpa(q, k.double(), v)
    with pytest.raises(TypeError, match="query must be an array on the CPU"):
        sdpa(q.to("meta"), k, v)
    with pytest.raises(TypeError, match="out must be a writable array on the CPU"):
        sdpa(q, k, v, out=torch.empty(2, 3, 9, 16, device="meta"))
