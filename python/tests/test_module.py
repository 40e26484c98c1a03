"""mha.MultiheadAttention against PyTorch's own nn.MultiheadAttention (eval mode).

The reference is the same torch module (random weights and biases) converted to
float64, fed the float32 inputs widened to float64: mha computes in float32, so
both the output and the attention weights must agree within
    1e-5 · max(1, max |ref|)
(fp32 rounding of the projections and scores on these sizes, with weights of
size 0.3 and inputs of size 1, is about 1e-6 of the output's scale).
"""
import copy
import pickle
import threading
import time

import numpy as np
import pytest

import mha
from conftest import to_float64

torch = pytest.importorskip("torch")

TORCH_HAS_IS_CAUSAL = "is_causal" in torch.nn.MultiheadAttention.forward.__code__.co_varnames


def make_pair(seed=0, embed_dim=16, num_heads=4, **kwargs):
    """A torch module with random weights and biases, and mha's copy of it; the torch one
    is returned in float64 (the reference)."""
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(embed_dim, num_heads, **kwargs).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    module = mha.MultiheadAttention.from_torch(ref)
    return module, ref.double()


def reference(ref, query, key, value, **kwargs):
    """The float64 torch module's (output, weights), as float64 NumPy arrays (or None)."""
    def widen(x):
        if x is None:
            return None
        if np.asarray(x).dtype == bool:  # NumPy bool, or a torch bool tensor's view
            return torch.as_tensor(np.asarray(x))
        return torch.as_tensor(to_float64(x))
    masks = {name: widen(kwargs.pop(name)) for name in ("key_padding_mask", "attn_mask")
             if name in kwargs}
    with torch.no_grad():
        out, weights = ref(widen(query), widen(key), widen(value), **masks, **kwargs)
    return out.numpy(), None if weights is None else weights.numpy()


def assert_close(got, want):
    """1e-5 of the reference's scale (the module docstring's tolerance)."""
    got = to_float64(got)
    assert got.shape == want.shape
    bound = 1e-5 * max(1.0, np.abs(want).max())
    error = np.abs(got - want).max()
    assert error <= bound, f"max |mha - torch| = {error:.3g} > {bound:.3g}"


def tensors(rng, *shapes):
    return [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in shapes]


def check(module, ref, query, key, value, **kwargs):
    """Runs mha's module and the reference with the same arguments and compares them."""
    out, weights = module(query, key, value, **kwargs)
    want_out, want_weights = reference(ref, query, key, value, **kwargs)
    assert_close(out, want_out)
    if want_weights is None:
        assert weights is None
    else:
        assert_close(weights, want_weights)
    return out, weights


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("average_attn_weights", [True, False])
def test_self_attention_matches_torch(rng, batch_first, need_weights, average_attn_weights):
    module, ref = make_pair(batch_first=batch_first)
    (x,) = tensors(rng, (3, 7, 16) if batch_first else (7, 3, 16))
    out, weights = check(module, ref, x, x, x, need_weights=need_weights,
                         average_attn_weights=average_attn_weights)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert out.shape == x.shape
    if need_weights:
        assert weights.shape == ((3, 7, 7) if average_attn_weights else (3, 4, 7, 7))


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_cross_attention_with_kdim_and_vdim(rng, batch_first, bias):
    module, ref = make_pair(seed=1, embed_dim=24, num_heads=3, kdim=10, vdim=6, bias=bias,
                            batch_first=batch_first)
    assert module.kdim == 10 and module.vdim == 6 and module.head_dim == 8
    shapes = [(2, 5, 24), (2, 9, 10), (2, 9, 6)]
    if not batch_first:
        shapes = [(s[1], s[0], s[2]) for s in shapes]
    q, k, v = tensors(rng, *shapes)
    check(module, ref, q, k, v)
    check(module, ref, q, k, v, need_weights=False)


def test_key_equal_to_value_and_separate_copies_of_one_tensor(rng):
    """The library projects one tensor passed as key and value (or as all three) at once;
    equal data in separate tensors takes the separate path: both as torch."""
    module, ref = make_pair(seed=2)
    q, kv = tensors(rng, (6, 2, 16), (8, 2, 16))
    check(module, ref, q, kv, kv)
    check(module, ref, q, kv, kv.clone())
    check(module, ref, q, q.clone(), q.clone(), need_weights=False)


@pytest.mark.parametrize("batch_first", [False, True])
def test_unbatched_inputs(rng, batch_first):
    module, ref = make_pair(seed=3, batch_first=batch_first)
    q, k = tensors(rng, (5, 16), (7, 16))
    out, weights = check(module, ref, q, k, k)
    assert out.shape == (5, 16) and weights.shape == (5, 7)
    _, weights = check(module, ref, q, k, k, average_attn_weights=False)
    assert weights.shape == (4, 5, 7)
    padding = torch.tensor([False, True, False, False, True, False, False])
    mask = torch.from_numpy(rng.standard_normal((4, 5, 7)).astype(np.float32))
    check(module, ref, q, k, k, key_padding_mask=padding, attn_mask=mask)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_key_padding_mask(rng, kind, need_weights):
    module, ref = make_pair(seed=4)
    q, k = tensors(rng, (6, 3, 16), (9, 3, 16))
    ignored = torch.from_numpy(rng.random((3, 9)) < 0.3)
    ignored[:, 0] = False  # no row without keys: torch gives NaN there (see below)
    if kind == "bool":
        padding = ignored
    else:
        padding = torch.from_numpy(rng.standard_normal((3, 9)).astype(np.float32))
        padding[ignored] = -float("inf")
    check(module, ref, q, k, k, key_padding_mask=padding, need_weights=need_weights)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("need_weights", [True, False])
def test_attn_mask(rng, kind, rank, need_weights):
    module, ref = make_pair(seed=5)
    q, k = tensors(rng, (6, 2, 16), (9, 2, 16))
    shape = (6, 9) if rank == 2 else (2 * 4, 6, 9)
    if kind == "bool":
        mask = torch.from_numpy(rng.random(shape) < 0.3)  # True = not allowed
        mask[..., 0] = False
    else:
        mask = torch.from_numpy(2 * rng.standard_normal(shape).astype(np.float32))
    check(module, ref, q, k, k, attn_mask=mask, need_weights=need_weights)


@pytest.mark.parametrize("kinds", [("bool", "bool"), ("bool", "float"), ("float", "bool")])
def test_both_masks(rng, kinds):
    module, ref = make_pair(seed=6, batch_first=True)
    q, k = tensors(rng, (2, 6, 16), (2, 9, 16))
    padding = torch.tensor([[False] * 7 + [True] * 2, [False] * 9])
    mask = torch.from_numpy(rng.random((8, 6, 9)) < 0.3)
    mask[..., 0] = False
    if kinds[0] == "float":
        padding = torch.zeros(2, 9).masked_fill(padding, -float("inf"))
    if kinds[1] == "float":
        mask = torch.zeros(8, 6, 9).masked_fill(mask, -float("inf")) + 0.5
    check(module, ref, q, k, k, key_padding_mask=padding, attn_mask=mask)
    check(module, ref, q, k, k, key_padding_mask=padding, attn_mask=mask, need_weights=False)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("with_mask", [False, True])
def test_is_causal(rng, need_weights, with_mask):
    """is_causal applies the causal mask (torch 1.13's module has no is_causal: its
    reference is the explicit mask; torch 2 needs that mask with the flag)."""
    module, ref = make_pair(seed=7)
    (x,) = tensors(rng, (8, 2, 16))
    causal = torch.ones(8, 8, dtype=torch.bool).triu(1)  # True = not allowed
    out, weights = module(x, x, x, need_weights=need_weights, is_causal=True,
                          attn_mask=causal if with_mask else None)
    extra = {"is_causal": True} if TORCH_HAS_IS_CAUSAL else {}
    want_out, want_weights = reference(ref, x, x, x, attn_mask=causal, need_weights=need_weights,
                                       **extra)
    assert_close(out, want_out)
    if need_weights:
        assert_close(weights, want_weights)
        assert np.all(weights.numpy()[np.broadcast_to(causal.numpy(), weights.shape)] == 0)


def test_numpy_in_numpy_out(rng):
    module, ref = make_pair(seed=8, batch_first=True)
    q, k = (t.numpy() for t in tensors(rng, (2, 5, 16), (2, 6, 16)))
    out, weights = check(module, ref, q, k, k)
    assert isinstance(out, np.ndarray) and isinstance(weights, np.ndarray)
    assert out.dtype == weights.dtype == np.float32
    padding = np.zeros((2, 6), dtype=bool)
    padding[1, 4:] = True
    check(module, ref, q, k, k, key_padding_mask=padding,
          attn_mask=rng.standard_normal((5, 6)).astype(np.float32))


def test_strided_inputs(rng):
    """Views with other strides than the layout's are read in place, as torch reads them."""
    module, ref = make_pair(seed=9, batch_first=True)
    (big,) = tensors(rng, (7, 3, 32))
    q = big[:, :, ::2].transpose(0, 1)  # [3, 7, 16], every other feature, sequence-first memory
    assert not q.is_contiguous()
    check(module, ref, q, q, q)
    check(module, ref, q, q, q, need_weights=False)


def test_fully_masked_row_gives_zero_weights_and_the_bias():
    """Where torch computes NaN (no key takes part), mha's row is zeros: the output is
    out_proj.bias."""
    module, _ = make_pair(seed=10)
    x = torch.ones(3, 1, 16)
    mask = torch.zeros(3, 3, dtype=torch.bool)
    mask[1] = True
    out, weights = module(x, x, x, attn_mask=mask)
    assert torch.all(weights[0, 1] == 0)
    bias = module.state_dict()["out_proj.bias"]
    np.testing.assert_array_equal(out[1, 0].numpy(), bias)


def test_state_dict_round_trips_through_torch(rng):
    module, ref = make_pair(seed=11, kdim=8, vdim=8)
    state = module.state_dict()
    assert list(state) == list(ref.state_dict())
    fresh = torch.nn.MultiheadAttention(16, 4, kdim=8, vdim=8).eval()
    fresh.load_state_dict({name: torch.from_numpy(value) for name, value in state.items()})
    for name, value in fresh.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), ref.state_dict()[name].float().numpy())
    state["out_proj.bias"][:] = 7.0  # a copy: the module's weights stay as they are
    assert not np.any(module.state_dict()["out_proj.bias"] == 7.0)


def test_deepcopy_and_pickle_keep_the_configuration_and_weights(rng):
    """copy.deepcopy (nn.TransformerEncoder clones its layers with it) and pickle make a
    module of the same configuration and weights, with a library module of its own."""
    module, ref = make_pair(seed=13, kdim=8, vdim=8, batch_first=True, bias=False)
    query = rng.standard_normal((2, 5, 16)).astype(np.float32)
    key = rng.standard_normal((2, 7, 8)).astype(np.float32)
    want, _ = module(query, key, key)
    for clone in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert clone is not module and clone.batch_first and clone.kdim == 8
        got, _ = clone(query, key, key)
        np.testing.assert_array_equal(got, want)
        clone.load_state_dict({"out_proj.weight": np.zeros((16, 16), np.float32)}, strict=False)
        np.testing.assert_array_equal(module(query, key, key)[0], want)  # not shared


def test_eval_returns_the_module_and_train_is_refused():
    module = mha.MultiheadAttention(16, 4)
    assert module.eval() is module and module.train(False) is module
    with pytest.raises(NotImplementedError, match="mha.torch.MultiheadAttention"):
        module.train()


def test_load_state_dict_from_numpy_and_float64(rng):
    module, ref = make_pair(seed=12)
    copy = mha.MultiheadAttention(16, 4)
    result = copy.load_state_dict({name: value.numpy() for name, value in ref.state_dict().items()})
    assert result.missing_keys == [] and result.unexpected_keys == []
    (x,) = tensors(rng, (5, 2, 16))
    np.testing.assert_array_equal(copy(x, x, x)[0].numpy(), module(x, x, x)[0].numpy())


def test_non_strict_load_keeps_what_is_missing(rng):
    module, _ = make_pair(seed=13)
    state = module.state_dict()
    fresh = mha.MultiheadAttention(16, 4)
    result = fresh.load_state_dict({"out_proj.weight": state["out_proj.weight"],
                                    "extra": np.zeros(3)}, strict=False)
    assert result.missing_keys == ["in_proj_weight", "in_proj_bias", "out_proj.bias"]
    assert result.unexpected_keys == ["extra"]
    loaded = fresh.state_dict()
    np.testing.assert_array_equal(loaded["out_proj.weight"], state["out_proj.weight"])
    assert not np.any(loaded["in_proj_weight"])  # still the initial zeros


def test_new_module_has_zero_weights(rng):
    module = mha.MultiheadAttention(8, 2, batch_first=True)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    out, weights = module(x, x, x)
    assert not np.any(out)
    np.testing.assert_allclose(weights, np.full((2, 3, 3), 1 / 3), rtol=1e-6)


def test_two_python_threads_call_one_module_at_once(rng):
    """The GIL is released during forward: while one thread is in a long call, another
    calls the same module, finishes first, and both results are right."""
    module, ref = make_pair(seed=14, embed_dim=64, num_heads=4)
    big, small = tensors(rng, (8192, 1, 64), (5, 1, 64))
    entering, done = threading.Event(), threading.Event()
    results = {}

    def long_call():
        entering.set()
        results["big"] = module(big, big, big, need_weights=False)[0]
        done.set()

    worker = threading.Thread(target=long_call)
    worker.start()
    try:
        entering.wait()
        time.sleep(0.02)  # the worker is inside its call now (0.12 s on Zen 4)
        results["small"] = module(small, small, small)[0]
        small_finished_first = not done.is_set()
    finally:
        worker.join()
    assert small_finished_first, "the second thread waited for the first one's call"
    assert_close(results["small"], reference(ref, small, small, small)[0])
    rows = slice(8100, 8192)  # the reference over a few rows of the long call
    want = reference(ref, big[rows], big, big, need_weights=False)[0]
    assert_close(results["big"][rows], want)
