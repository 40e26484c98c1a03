"""mha.torch.MultiheadAttention in bfloat16 and float16 (`module.bfloat16()`, half-precision
inputs): the library's module computes in float32 on the rounded values, and the results
and every gradient come back in their tensors' dtypes, rounded once.

Against test_module_backward.py's reference -- torch's nn.MultiheadAttention in float64 on
the same rounded weights and inputs -- with its float32 tolerances plus one rounding of
each element to its dtype (UNIT_ROUNDOFF of its own |value|)."""
import copy

import numpy as np
import pytest

import mha
from conftest import UNIT_ROUNDOFF
from test_module_backward import expected, make_pair, random_inputs

torch = pytest.importorskip("torch")


@pytest.fixture(params=mha.backends())
def backend(request):
    mha.set_backend(request.param)  # conftest's fixture restores "auto"
    return request.param


def rounded(x, dtype):
    """A float32 array rounded to `dtype` and back: the values both modules take."""
    return torch.from_numpy(np.asarray(x)).to(dtype).float().numpy()


def half_pair(dtype, seed=0, **kwargs):
    """(mha's module in `dtype`, torch's in float64 on the same rounded parameters)."""
    module, ref = make_pair(seed=seed, **kwargs)
    module = module.to(dtype)
    with torch.no_grad():
        for (name, x), (_, y) in zip(module.named_parameters(), ref.named_parameters()):
            y.copy_(x.double())
    return module, ref


def assert_rounded_once(got, want, tolerance, name):
    """got (a tensor of a half dtype or float32) within the fp32 tolerance plus one rounding
    of each element to its dtype."""
    u = UNIT_ROUNDOFF[str(got.dtype).replace("torch.", "")]
    value = got.detach().double().numpy()
    assert np.all(np.isfinite(value)), name
    bound = tolerance + u * (np.abs(want) + tolerance)
    error = np.abs(value - want)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert np.all(error <= bound), (
        f"{name}: |mha - torch| = {error[worst]:.3g} > {bound[worst]:.3g} at {worst}")


def check_half(module, ref, query, key, value, dtype, *, rng, **options):
    """Forward and backward of `module` on `dtype` leaves of query, key, value (one leaf per
    distinct array) against the reference; returns mha's gradients."""
    query, key, value = (rounded(x, dtype) if x is not None else None
                         for x in (query, key, value))
    key = query if key is None else key
    value = key if value is None else value
    grad_out = rounded(rng.standard_normal(query.shape[:-1] + (module.embed_dim,))
                       .astype(np.float32), dtype)
    want_out, want, tolerances = expected(module, ref, query, key, value, grad_out, **options)

    module.zero_grad(set_to_none=True)
    made = {}
    for x in (query, key, value):
        made.setdefault(id(x), torch.from_numpy(x).to(dtype).requires_grad_())
    tq, tk, tv = (made[id(x)] for x in (query, key, value))
    out, _ = module(tq, tk, tv, need_weights=False, **options)
    assert out.dtype == dtype and out.requires_grad
    assert_rounded_once(out, want_out.numpy(), 1e-5 * max(1.0, want_out.abs().max().item()),
                        "output")
    out.backward(torch.from_numpy(grad_out).to(dtype))

    got = {"query": tq.grad, "key": None if tk is tq else tk.grad,
           "value": None if tv is tk or tv is tq else tv.grad}
    got.update({name: x.grad for name, x in module.named_parameters()})
    # Each gradient in its tensor's dtype: the inputs' `dtype`, the parameters' their own.
    dtypes = {name: x.dtype for name, x in module.named_parameters()}
    if query is key is value:
        tolerances["query"] += tolerances["key"] + tolerances["value"]
    for name, grad in got.items():
        if grad is None:
            assert name in ("key", "value"), name  # the same leaf as an earlier input
            continue
        assert grad.dtype == dtypes.get(name, dtype), name
        assert tuple(grad.shape) == want[name].shape, name
        assert_rounded_once(grad, want[name], tolerances[name], name)
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch_first", [False, True])
def test_self_attention(rng, backend, dtype, batch_first):
    module, ref = half_pair(dtype, seed=1, batch_first=batch_first)
    q, _, _ = random_inputs(rng, module, shared="qkv")
    got = check_half(module, ref, q, None, None, dtype, rng=rng, is_causal=True)
    assert set(name for name, g in got.items() if g is not None) == {
        "query", "in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cross_attention_with_kdim_vdim_and_a_padding_mask(rng, backend, dtype):
    module, ref = half_pair(dtype, seed=2, kdim=8, vdim=12, batch_first=True)
    q, k, v = random_inputs(rng, module)
    padding = np.zeros((2, 9), bool)
    padding[1, 6:] = True
    check_half(module, ref, q, k, v, dtype, rng=rng, key_padding_mask=padding)


def test_results_without_grad_are_the_same_bits(rng):
    """Under no_grad the module computes the same bits as under autograd, and returns them
    (and the attention weights) in query's dtype."""
    module, _ = half_pair(torch.bfloat16, seed=3, batch_first=True)
    q, k, v = (torch.from_numpy(x).bfloat16() for x in random_inputs(rng, module))
    out, weights = module(q.requires_grad_(), k, v)
    with torch.no_grad():
        again, weights_again = module(q, k, v)
    assert out.dtype == weights.dtype == again.dtype == torch.bfloat16
    assert torch.equal(out.detach(), again) and torch.equal(weights, weights_again)


def test_a_float32_query_over_a_bfloat16_module(rng):
    """The results follow query's dtype: a float32 query over bfloat16 weights gives float32,
    the weights' gradients come in bfloat16."""
    module, ref = half_pair(torch.bfloat16, seed=4)
    q, k, v = random_inputs(rng, module)
    got = check_half(module, ref, q, k, v, torch.float32, rng=rng)
    assert got["query"].dtype == torch.float32
    assert module.in_proj_weight.grad.dtype == torch.bfloat16


def test_training_steps_in_bfloat16_follow_float32(rng):
    """A few SGD steps of a bfloat16 module track those of the same module in float32."""
    losses = {}
    inputs = None
    for dtype in (torch.float32, torch.bfloat16):
        module, _ = half_pair(dtype, seed=5, batch_first=True)
        inputs = random_inputs(rng, module, shared="qkv")[0] if inputs is None else inputs
        x = torch.from_numpy(inputs).to(dtype)
        target = torch.zeros(x.shape)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
        losses[dtype] = []
        for _ in range(4):
            optimizer.zero_grad()
            out, _ = module(x, x, x, need_weights=False)
            loss = ((out.float() - target) ** 2).mean()
            loss.backward()
            optimizer.step()
            losses[dtype].append(loss.item())
    assert losses[torch.float32][-1] < losses[torch.float32][0]
    np.testing.assert_allclose(losses[torch.bfloat16], losses[torch.float32], rtol=3e-2)


def test_float64_parameters_with_grad_are_still_refused(rng):
    module, _ = half_pair(torch.float64, seed=6)
    q, k, v = (torch.from_numpy(x).double().requires_grad_()
               for x in random_inputs(rng, module))
    with pytest.raises(TypeError, match="float64 and requires grad"):
        module(q, k, v)


def test_backward_function_on_half_tensors(rng):
    """mha.multi_head_attention_backward on bfloat16 tensors: float32 gradients, the sums the
    autograd path rounds."""
    module, _ = half_pair(torch.bfloat16, seed=7)
    q, k, v = (torch.from_numpy(x).bfloat16() for x in random_inputs(rng, module))
    grad_out = torch.from_numpy(rng.standard_normal(tuple(q.shape)).astype(np.float32))
    arguments = (16, 4, module.in_proj_weight.detach(), module.in_proj_bias.detach(), None,
                 None, False, 0.0, module.out_proj.weight.detach(),
                 module.out_proj.bias.detach())
    grads = mha.multi_head_attention_backward(grad_out.bfloat16(), q, k, v, *arguments)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, _ = module(*leaves, need_weights=False)
    out.backward(grad_out.bfloat16())
    for name, leaf in zip(("query", "key", "value"), leaves):
        assert grads[name].dtype == torch.float32
        assert torch.equal(grads[name].bfloat16(), leaf.grad), name
    assert torch.equal(grads["in_proj_weight"].bfloat16(), module.in_proj_weight.grad)


@pytest.mark.parametrize("framework, dtype", [("torch", "bfloat16"), ("torch", "float16"),
                                              ("numpy", "float16")])
def test_inference_module_takes_half_inputs(rng, framework, dtype):
    """mha.MultiheadAttention (inference) and multi_head_attention_forward on half-precision
    inputs: the float32 results on the same values, rounded once to query's dtype (the same
    bits), in query's framework; self-attention's one array stays one."""
    module, _ = half_pair(torch.float32, seed=8)
    inference = mha.MultiheadAttention.from_torch(module)
    q, k, v = random_inputs(rng, module)
    if framework == "torch":
        half = [torch.from_numpy(x).to(getattr(torch, dtype)) for x in (q, k, v)]
        as_float32 = [x.float() for x in half]
    else:
        half = [x.astype(np.float16) for x in (q, k, v)]
        as_float32 = [x.astype(np.float32) for x in half]
    for args in (half, [half[0]] * 3):
        f32_args = as_float32 if args is half else [as_float32[0]] * 3
        out, weights = inference(*args)
        want, want_weights = inference(*f32_args)
        assert type(out) is type(args[0]) and out.dtype == args[0].dtype
        assert weights.dtype == args[0].dtype
        if framework == "torch":
            assert torch.equal(out, want.to(out.dtype))
            assert torch.equal(weights, want_weights.to(out.dtype))
        else:
            np.testing.assert_array_equal(out, want.astype(np.float16))
            np.testing.assert_array_equal(weights, want_weights.astype(np.float16))
        weights_args = (16, 4, module.in_proj_weight.detach(), module.in_proj_bias.detach(),
                        None, None, False, 0.0, module.out_proj.weight.detach(),
                        module.out_proj.bias.detach())
        if framework == "numpy":
            weights_args = tuple(x.numpy() if isinstance(x, torch.Tensor) else x
                                 for x in weights_args)
        got, _ = mha.multi_head_attention_forward(*args, *weights_args, training=False)
        ref, _ = mha.multi_head_attention_forward(*f32_args, *weights_args, training=False)
        assert got.dtype == args[0].dtype
        if framework == "torch":
            assert torch.equal(got, ref.to(got.dtype))
        else:
            np.testing.assert_array_equal(got, ref.astype(np.float16))


def _refuse_conversions(monkeypatch):
    """Makes every way the package had of converting a half-precision input or result raise:
    the helpers of mha._arrays (where mha._functional and mha._module use them) and
    float32_copy, which widened half-precision weights."""
    def refused(*args, **kwargs):
        raise AssertionError("a half-precision array was converted")

    for module in (mha._arrays, mha._functional, mha._module):
        for name in ("widened", "widened_all", "narrowed", "float32_copy"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, refused)
    return refused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shared", [None, "qkv"])
def test_inference_passes_half_tensors_to_the_library(rng, monkeypatch, dtype, shared):
    """Without autograd, half-precision tensors (inputs, a half module's weights) reach
    mha_module_forward as they are and the results come from it in query's dtype: with every
    conversion of the package and torch's Tensor.float/.to refused, the results are the bits
    of the widened path (float32 inputs, the results rounded once)."""
    module, _ = half_pair(dtype, seed=9)
    module.eval()
    inference = mha.MultiheadAttention.from_torch(module)
    q, k, v = (torch.from_numpy(x).to(dtype) for x in random_inputs(rng, module, shared=shared))
    k, v = (q, q) if shared else (k, v)
    weights_args = (16, 4, module.in_proj_weight.detach(), module.in_proj_bias.detach(), None,
                    None, False, 0.0, module.out_proj.weight.detach(),
                    module.out_proj.bias.detach())
    calls = {
        "mha.MultiheadAttention": lambda *x: inference(*x),
        "mha.torch.MultiheadAttention": lambda *x: module(*x),
        "multi_head_attention_forward": lambda *x: mha.multi_head_attention_forward(
            *x, *weights_args, training=False),
    }
    widened = [x.float() for x in (q, k, v)]
    if shared:
        widened = [widened[0]] * 3
    with torch.no_grad():
        want = {name: call(*widened) for name, call in calls.items()}
        refused = _refuse_conversions(monkeypatch)
        for name in ("float", "to", "type"):
            monkeypatch.setattr(torch.Tensor, name, refused)
        try:
            got = {name: call(q, k, v) for name, call in calls.items()}
        finally:
            monkeypatch.undo()
    for name, (out, weights) in got.items():
        want_out, want_weights = want[name]
        assert out.dtype == weights.dtype == dtype, name
        assert torch.equal(out, want_out.to(dtype)), name
        assert torch.equal(weights, want_weights.to(dtype)), name


def test_inference_allocates_no_float32_copy_of_a_numpy_query(rng):
    """A float16 NumPy query is read in place: the call allocates its float16 output and
    nothing the size of a float32 copy of the query (tracemalloc sees NumPy's arrays)."""
    import tracemalloc

    module, _ = half_pair(torch.float32, seed=10)
    inference = mha.MultiheadAttention.from_torch(module)
    x = rng.standard_normal((256, 4, 16)).astype(np.float16)  # [L, B, E]
    want, _ = inference(x.astype(np.float32), x.astype(np.float32), x.astype(np.float32),
                        need_weights=False)
    inference(x, x, x, need_weights=False)  # any first-call allocation of the package
    tracemalloc.start()
    try:
        out, _ = inference(x, x, x, need_weights=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, want.astype(np.float16))
    assert out.nbytes <= peak < 4 * x.size  # the output, and less than a float32 copy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_masks_in_query_dtype(rng, dtype):
    """Additive key_padding_mask and attn_mask in query's half-precision dtype (PyTorch's rule
    for a float mask): the bits of the same masks in float32, without autograd and with it
    (which passes them to the library as they are too)."""
    module, _ = half_pair(dtype, seed=11, batch_first=True)
    q, k, v = (torch.from_numpy(x).to(dtype) for x in random_inputs(rng, module))
    padding = torch.from_numpy(rng.standard_normal((2, 9)).astype(np.float32)).to(dtype)
    padding[1, 6:] = -float("inf")
    attn = torch.from_numpy(rng.standard_normal((6, 9)).astype(np.float32)).to(dtype)
    inference = mha.MultiheadAttention.from_torch(module)
    with torch.no_grad():
        want = module(q, k, v, key_padding_mask=padding.float(), attn_mask=attn.float())
        got = module(q, k, v, key_padding_mask=padding, attn_mask=attn)
        again = inference(q, k, v, key_padding_mask=padding, attn_mask=attn)
    trained = module(q.clone().requires_grad_(), k, v, key_padding_mask=padding,
                     attn_mask=attn)
    assert trained[0].requires_grad
    for out, weights in (got, again, trained):
        assert out.dtype == weights.dtype == dtype
        assert torch.equal(out.detach(), want[0]) and torch.equal(weights, want[1])
    with pytest.raises(mha.Error, match="attn_mask"):  # another half dtype than query's
        with torch.no_grad():
            other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
            module(q, k, v, attn_mask=attn.to(other))


def test_half_weights_written_through_data_are_used(rng):
    """A half-precision module's weights are read in place (not copied at each call), and the
    library's copy still follows them: an in-place change, a write through .data."""
    module, _ = half_pair(torch.bfloat16, seed=12)
    module.eval()
    x = torch.from_numpy(random_inputs(rng, module)[0]).bfloat16()

    def out():
        with torch.no_grad():
            return module(x, x, x, need_weights=False)[0]

    def fresh():
        return mha.MultiheadAttention.from_torch(module)(x, x, x, need_weights=False)[0]

    first = out()
    assert torch.equal(first, fresh())
    with torch.no_grad():
        module.in_proj_weight.mul_(0.5)
    assert not torch.equal(out(), first) and torch.equal(out(), fresh())
    before = out()
    module.out_proj.weight.data.mul_(0.5)
    after = out()
    assert not torch.equal(after, before) and torch.equal(after, fresh())


def twin_leaves(arrays, dtype):
    """A leaf tensor of `dtype` holding each distinct array's values (NumPy's or torch's), one
    array given twice getting one leaf (self-attention stays self-attention)."""
    made = {}
    for x in arrays:
        if id(x) not in made:
            made[id(x)] = torch.as_tensor(x).detach().to(dtype).requires_grad_()
    return [made[id(x)] for x in arrays]


def forward_backward(module, inputs, grad_out, sinks, **options):
    """(out, attention weights, {name: gradient}) of module(*inputs) under autograd: the
    parameters', the inputs' ("query", "key", "value"; a tensor given again only under its
    first name) and the sinks'."""
    module.zero_grad(set_to_none=True)
    sinks = sinks.clone().requires_grad_()
    out, weights = module(*inputs, sinks=sinks, **options)
    out.backward(grad_out)
    grads = {name: x.grad for name, x in module.named_parameters()}
    for i, name in enumerate(("query", "key", "value")):
        if all(inputs[i] is not x for x in inputs[:i]):
            grads[name] = inputs[i].grad
    grads["sinks"] = sinks.grad
    return out, weights, grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shared, kwargs", [
    ("qkv", {"batch_first": True}),   # self-attention: one tensor, the summed gradient
    ("kv", {}),                       # key is value
    (None, {"kdim": 8, "vdim": 12}),  # separate projections
])
def test_autograd_gives_the_float32_bits_rounded_once(rng, backend, dtype, shared, kwargs):
    """Under autograd a half-precision module on half-precision inputs and masks gives the
    bits of its float32 twin on the same values: the output and the attention weights in
    query's dtype, every gradient in its tensor's, rounded once -- self-attention's one
    tensor gets the float32 sum, rounded once -- and the sinks' float32 gradient.  (The
    library widens the half-precision tensors and rounds the results; the package widened
    them itself before: the same bits.)"""
    module, _ = half_pair(dtype, seed=13, **kwargs)
    twin = copy.deepcopy(module).float()
    half = twin_leaves(random_inputs(rng, module, shared=shared), dtype)
    widened = twin_leaves(half, torch.float32)
    batch, length, keys = 2, 6, 6 if shared == "qkv" else 9
    masks = {"key_padding_mask": torch.randn(batch, keys).to(dtype),
             "attn_mask": torch.randn(length, keys).to(dtype)}
    grad_out = torch.randn(half[0].shape).to(dtype)
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0])
    options = {"is_causal": shared == "qkv", "average_attn_weights": False}
    out, weights, grads = forward_backward(module, half, grad_out, sinks, **masks, **options)
    want_out, want_weights, want = forward_backward(
        twin, widened, grad_out.float(), sinks,
        **{name: mask.float() for name, mask in masks.items()}, **options)

    assert out.dtype == weights.dtype == dtype
    assert torch.equal(out.detach(), want_out.detach().to(dtype))
    assert torch.equal(weights, want_weights.to(dtype))
    assert set(grads) == set(want)
    for name, grad in grads.items():
        like = dict(module.named_parameters()).get(name, half[0])
        assert grad.dtype == (torch.float32 if name == "sinks" else like.dtype), name
        assert torch.equal(grad, want[name].to(grad.dtype)), name


def test_autograd_float32_query_beside_half_keys_and_values(rng):
    """Each tensor its own dtype: a float32 query with bfloat16 key and value (and module)
    gives the float32 twin's output and query gradient bit for bit, and the key's, value's
    and parameters' rounded once to bfloat16."""
    module, _ = half_pair(torch.bfloat16, seed=14)
    twin = copy.deepcopy(module).float()
    q, k, v = random_inputs(rng, module)
    inputs = twin_leaves([q], torch.float32) + twin_leaves([k, v], torch.bfloat16)
    widened = twin_leaves(inputs, torch.float32)
    grad_out = torch.randn(q.shape)
    sinks = torch.zeros(4)
    out, _, grads = forward_backward(module, inputs, grad_out, sinks, need_weights=False)
    want_out, _, want = forward_backward(twin, widened, grad_out, sinks, need_weights=False)
    assert out.dtype == grads["query"].dtype == torch.float32
    assert torch.equal(out.detach(), want_out.detach())
    for name, grad in grads.items():
        assert torch.equal(grad, want[name].to(grad.dtype)), name
    assert grads["key"].dtype == module.in_proj_weight.grad.dtype == torch.bfloat16


def _dispatch_mode():
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:  # a torch without it: nothing to observe the operators with
        pytest.skip("torch has no TorchDispatchMode")
    return TorchDispatchMode


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shared", [None, "qkv"])
def test_autograd_makes_no_float32_tensor(rng, dtype, shared):
    """A half-precision module's forward and backward under autograd hand its half-precision
    tensors to the C calls as they are and take the results in their dtypes: no torch
    operator of the two (autograd's own conversions of a gradient to its tensor's dtype
    included, which run as operators) makes a float32 tensor, and the output's graph goes
    from mha's Function straight to the leaves."""
    module, _ = half_pair(dtype, seed=15)
    inputs = twin_leaves(random_inputs(rng, module, shared=shared), dtype)
    grad_out = torch.randn(inputs[0].shape).to(dtype)
    made = []

    class Record(_dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            results = result if isinstance(result, (tuple, list)) else (result,)
            made.extend((str(func), x.dtype) for x in results if isinstance(x, torch.Tensor))
            return result

    with Record():
        out, weights = module(*inputs)
        out.backward(grad_out)
    assert made, "the operators were not recorded"
    assert [op for op, made_dtype in made if made_dtype == torch.float32] == []
    assert out.dtype == weights.dtype == dtype
    assert all(x.grad.dtype == dtype for x in (*inputs, *module.parameters()))
    nodes = [node for node, _ in out.grad_fn.next_functions if node is not None]
    assert nodes and all(type(node).__name__ == "AccumulateGrad" for node in nodes)


def test_activations_input_rounds_as_torch_bf16(backend):
    """activations="input": the projections and heads rounded to bfloat16, as torch's module
    in bfloat16 keeps them -- farther from the float64 module on the same parameters than the
    float32 activations (the roundings are there), and no farther than torch's own bfloat16
    module is (the same roundings, no more)."""
    import mha.torch
    torch.manual_seed(3)
    ref = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
    exact = copy.deepcopy(ref).to(torch.bfloat16).double()
    x = torch.randn(2, 40, 64).to(torch.bfloat16)
    with torch.no_grad():
        want = exact(x.double(), x.double(), x.double(), need_weights=False)[0]
        torch_bf16 = copy.deepcopy(ref).to(torch.bfloat16)(x, x, x, need_weights=False)[0]
        error = {"torch": float((torch_bf16.double() - want).abs().mean())}
        for activations in ("float32", "input"):
            module = mha.torch.MultiheadAttention.from_torch(ref, activations=activations)
            got = module.to(torch.bfloat16).eval()(x, x, x, need_weights=False)[0]
            assert got.dtype == torch.bfloat16
            error[activations] = float((got.double() - want).abs().mean())
    assert error["input"] > 1.3 * error["float32"], error
    assert error["input"] < 1.5 * error["torch"], error


def test_activations_input_gradients_are_the_float32_activations():
    """The backward of activations="input" is the float32 activations' (the roundings'
    derivative taken as 1): the same gradients, bit for bit."""
    import mha.torch
    torch.manual_seed(4)
    ref = torch.nn.MultiheadAttention(64, 4, batch_first=True)
    x = torch.randn(2, 36, 64).to(torch.bfloat16)
    grads = {}
    for activations in ("float32", "input"):
        module = mha.torch.MultiheadAttention.from_torch(ref, activations=activations)
        module = module.to(torch.bfloat16)
        leaf = x.clone().requires_grad_(True)
        module(leaf, leaf, leaf, need_weights=False)[0].float().sum().backward()
        grads[activations] = [leaf.grad] + [p.grad for p in module.parameters()]
    for a, b in zip(grads["float32"], grads["input"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad, error", [("bf16", ValueError), (1, TypeError)])
def test_activations_argument_is_checked(bad, error):
    import mha.torch
    with pytest.raises(error, match="activations"):
        mha.torch.MultiheadAttention(16, 2, activations=bad)
    with pytest.raises(error, match="activations"):
        mha.MultiheadAttention(16, 2, activations=bad)
    w = np.zeros((48, 16), np.float32)
    x = np.zeros((3, 1, 16), np.float32)
    with pytest.raises(error, match="activations"):
        mha.multi_head_attention_forward(x, x, x, 16, 2, w, None, None, None, False, 0.0,
                                         np.zeros((16, 16), np.float32), None,
                                         activations=bad)
