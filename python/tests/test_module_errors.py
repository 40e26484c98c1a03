"""mha.MultiheadAttention's answers to bad arguments: each names the argument, and a
refused load_state_dict loads nothing."""
import numpy as np
import pytest

import mha

torch = pytest.importorskip("torch")


@pytest.fixture
def module():
    return mha.MultiheadAttention(16, 4, batch_first=True)


@pytest.fixture
def x(rng):
    return rng.standard_normal((2, 5, 16)).astype(np.float32)


@pytest.mark.parametrize("kwargs,error,words", [
    ({"embed_dim": 10, "num_heads": 3}, ValueError, "embed_dim .10. must be a multiple"),
    ({"embed_dim": 0, "num_heads": 1}, ValueError, "embed_dim must be >= 1"),
    ({"embed_dim": 16.0, "num_heads": 4}, TypeError, "embed_dim must be an int"),
    ({"embed_dim": 16, "num_heads": True}, TypeError, "num_heads must be an int"),
    ({"embed_dim": 16, "num_heads": 4, "dropout": 1.0}, ValueError, r"dropout must be in \[0, 1\)"),
    ({"embed_dim": 16, "num_heads": 4, "dropout": "0"}, TypeError, "dropout must be a real"),
    ({"embed_dim": 16, "num_heads": 4, "bias": 1}, TypeError, "bias must be a bool"),
    ({"embed_dim": 16, "num_heads": 4, "add_bias_kv": True}, NotImplementedError, "add_bias_kv"),
    ({"embed_dim": 16, "num_heads": 4, "add_zero_attn": True}, NotImplementedError,
     "add_zero_attn"),
    ({"embed_dim": 16, "num_heads": 4, "kdim": 0}, ValueError, "kdim must be >= 1"),
    ({"embed_dim": 16, "num_heads": 4, "vdim": 2.5}, TypeError, "vdim must be an int"),
    ({"embed_dim": 16, "num_heads": 4, "batch_first": None}, TypeError, "batch_first must be"),
    ({"embed_dim": 16, "num_heads": 4, "device": "cuda"}, ValueError, "device must be"),
    ({"embed_dim": 16, "num_heads": 4, "dtype": "float64"}, ValueError, "dtype must be"),
])
def test_constructor_refuses(kwargs, error, words):
    with pytest.raises(error, match=words):
        mha.MultiheadAttention(**kwargs)


def test_constructor_takes_cpu_and_float32_in_every_spelling():
    mha_torch = pytest.importorskip("mha.torch")
    for device in ("cpu", "cpu:0", torch.device("cpu"), torch.device("cpu:0")):
        for dtype in (torch.float32, np.float32, "float32"):
            mha.MultiheadAttention(8, 2, device=device, dtype=dtype)
        mha_torch.MultiheadAttention(8, 2, device=device, dtype=torch.float32)
    with pytest.raises(ValueError, match="device must be"):
        mha.MultiheadAttention(8, 2, device="cuda:0")
    with pytest.raises(ValueError, match="dtype must be"):
        mha.MultiheadAttention(8, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="device must be"):
        mha.MultiheadAttention(8, 2, device=torch.device("meta"))


def test_from_torch_refuses_other_objects_and_unsupported_modules():
    with pytest.raises(TypeError, match="module must be a torch.nn.MultiheadAttention"):
        mha.MultiheadAttention.from_torch(torch.nn.Linear(4, 4))
    with pytest.raises(NotImplementedError, match="add_bias_kv"):
        mha.MultiheadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(NotImplementedError, match="add_zero_attn"):
        mha.MultiheadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, add_zero_attn=True))


@pytest.mark.parametrize("position", ["query", "key", "value"])
@pytest.mark.parametrize("bad", [[[1.0]], None, 2.0])
def test_forward_inputs_that_are_not_arrays(module, x, position, bad):
    args = {"query": x, "key": x, "value": x, position: bad}
    with pytest.raises(TypeError, match=position):
        module(**args)


@pytest.mark.parametrize("name", ["need_weights", "average_attn_weights", "is_causal"])
def test_forward_flags_must_be_bools(module, x, name):
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        module(x, x, x, **{name: 1})


def test_forward_shapes(module, x):
    with pytest.raises(ValueError, match="query must be 2-D .* or 3-D"):
        module(x[None], x, x)
    with pytest.raises(ValueError, match="key must have 3 dimensions like query"):
        module(x, x[0], x)
    with pytest.raises(ValueError, match="value has 8 features"):
        module(x, x, x[..., :8])
    with pytest.raises(ValueError, match="key and value must have the same length"):
        module(x, x, x[:, :4])
    with pytest.raises(ValueError, match="same batch size"):
        module(x, x[:1], x[:1])


def test_sequence_first_shapes_are_read_as_such(x):
    module = mha.MultiheadAttention(16, 4)  # [L, B, E]
    with pytest.raises(ValueError, match="same batch size"):
        module(x, x[:, :4], x[:, :4])  # key has batch 4, query 5
    with pytest.raises(ValueError,
                       match=r"key_padding_mask has shape \[2, 5\]; it must be \[5, 2\]"):
        module(x, x, x, key_padding_mask=np.zeros((2, 5), dtype=bool))


def test_mask_shapes(module, x):
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \[5\]; it must be \[2, 5\]"):
        module(x, x, x, key_padding_mask=np.zeros(5, dtype=bool))
    with pytest.raises(ValueError, match=r"attn_mask has shape \[2, 5, 5\]; it must be \[5, 5\] "
                                         r"or \[8, 5, 5\]"):
        module(x, x, x, attn_mask=np.zeros((2, 5, 5), dtype=bool))
    with pytest.raises(TypeError, match="attn_mask must be"):
        module(x, x, x, attn_mask=[[True]])


def test_dtypes_the_library_refuses(module, x):
    with pytest.raises(TypeError, match="query has dtype float64, which mha does not take"):
        module(x.astype(np.float64), x, x)
    # (float16 is computed in float32 on its values: tests/test_module_half.py.)
    with pytest.raises(mha.Error, match="value has dtype i32; it must be f32") as caught:
        module(x, x, x.astype(np.int32))
    assert caught.value.status == "MHA_ERR_INVALID_DTYPE"
    with pytest.raises(mha.Error, match="key_padding_mask has dtype i32"):
        module(x, x, x, key_padding_mask=np.zeros((2, 5), dtype=np.int32))
    with pytest.raises(TypeError, match="attn_mask has dtype uint8"):
        module(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.uint8))


def test_tensors_that_require_grad(module, x):
    q = torch.from_numpy(x).requires_grad_()
    with pytest.raises(ValueError, match="query requires grad"):
        module(q, q, q)
    with torch.no_grad():
        module(q, q, q)


@pytest.mark.parametrize("state,error,words", [
    ([], TypeError, "state_dict must be a mapping"),
    ({"in_proj_weight": np.zeros((48, 16))}, ValueError, "missing keys .*in_proj_bias"),
    ({"bias_k": np.zeros((1, 1, 16))}, NotImplementedError, "bias_k"),
])
def test_load_state_dict_refuses(module, state, error, words):
    with pytest.raises(error, match=words):
        module.load_state_dict(state)


def complete_state(**replaced):
    state = {"in_proj_weight": np.ones((48, 16)), "in_proj_bias": np.ones(48),
             "out_proj.weight": np.ones((16, 16)), "out_proj.bias": np.ones(16)}
    state.update(replaced)
    return state


@pytest.mark.parametrize("replaced,error,words", [
    ({"out_proj.bias": np.ones(15)}, ValueError,
     r"state_dict\['out_proj.bias'\] has shape \[15\]; this module's is \[16\]"),
    ({"in_proj_weight": np.ones((16, 48))}, ValueError, r"state_dict\['in_proj_weight'\]"),
    ({"in_proj_bias": np.ones(48, dtype=np.int64)}, TypeError, "in_proj_bias.*floating point"),
    ({"in_proj_bias": torch.ones(48, dtype=torch.int32)}, TypeError, "floating point"),
    ({"out_proj.weight": [[1.0] * 16] * 16}, TypeError, "must be a PyTorch tensor or a NumPy"),
    ({"extra": np.ones(2)}, ValueError, r"unexpected keys \['extra'\]"),
])
def test_refused_load_changes_nothing(module, replaced, error, words):
    with pytest.raises(error, match=words):
        module.load_state_dict(complete_state(**replaced))
    assert not any(np.any(value) for value in module.state_dict().values())
