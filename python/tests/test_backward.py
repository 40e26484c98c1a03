"""Gradients: mha.scaled_dot_product_attention under torch's autograd (a torch.autograd.Function
over mha_attention_backward) and mha.scaled_dot_product_attention_backward, against torch's
autograd through an independent float64 implementation written with torch ops -- softmax(Q·Kᵀ
· scale + mask)·V with the variants, the sinks in the denominator and dropout's keep-mask by
reference.py's copy of mha.h's rule -- for every option alone and combined, GQA, fully masked
rows (zero gradients, never NaN), on every usable backend; mha's backward against finite
differences of mha's own forward; bad input refused by name."""
import math
import random

import numpy as np
import pytest

import mha
from conftest import random_qkv
import reference

torch = pytest.importorskip("torch")


@pytest.fixture(params=mha.backends())
def backend(request):
    return request.param


# ---------------------------------------------------------------- the float64 reference

def reference_forward(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *,
                      valid_lens=None, causal_alignment="top-left", dropout_seed=0,
                      window_size=(-1, -1), sinks=None, softcap=0.0, alibi_slopes=None):
    """out [B, H, L, Ev] from float64 tensors [B, H, L, E] (differentiable in q, k, v, a float
    attn_mask and sinks), and what the tolerances need: the weights P, dropout's factor Z,
    the scaled scores before the softcap, the sinks' shares of the rows, the largest |logit|
    of a pair that takes part."""
    B, H, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    group = H // Hkv
    k = k.repeat_interleave(group, dim=1)  # query head h uses key/value head h // group
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(E) if scale is None else float(np.float32(scale))
    scores = q @ k.transpose(-1, -2) * scale
    logits = scores
    if softcap > 0.0:
        cap = float(np.float32(softcap))
        logits = cap * torch.tanh(logits / cap)
    i = torch.arange(L)[:, None]
    j = torch.arange(S)[None, :]
    if alibi_slopes is not None:
        slopes = torch.as_tensor(np.asarray(alibi_slopes), dtype=torch.float64)
        slopes = slopes.broadcast_to((B, H))[:, :, None, None]
        logits = logits - slopes * (i + S - L - j).abs()
    takes_part = torch.ones((B, H, L, S), dtype=torch.bool)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            takes_part &= attn_mask
        else:
            logits = logits + attn_mask
            takes_part &= attn_mask.detach() != -math.inf
    left, right = window_size
    if left >= 0:
        takes_part &= j >= i + S - L - left
    if right >= 0:
        takes_part &= j <= i + S - L + right
    if is_causal:
        takes_part &= (j <= i) if causal_alignment == "top-left" else (j <= i + S - L)
    if valid_lens is not None:
        lens = torch.as_tensor(np.asarray(valid_lens))
        lens = lens[:, None, None, None] if lens.dim() == 1 else lens[:, None, :, None]
        takes_part &= j < lens

    logits = logits.masked_fill(~takes_part, -math.inf)
    sink = torch.full((B, H, L, 1), -math.inf, dtype=torch.float64)
    if sinks is not None:
        sink = sinks[None, :, None, None].expand(B, H, L, 1)
    # The row maximum only keeps exp() in range: the weights do not depend on it.
    row_max = torch.maximum(logits.detach().amax(dim=-1, keepdim=True), sink.detach())
    empty = row_max == -math.inf  # no key and no sink: a row of zeros
    row_max = row_max.masked_fill(empty, 0.0)
    weights = torch.exp(logits - row_max)  # 0 (and no gradient) where a key does not take part
    sink_weight = torch.exp(sink - row_max)
    total = torch.where(empty, torch.ones_like(row_max), weights.sum(-1, keepdim=True)
                        + sink_weight)
    p = weights / total
    factor = torch.ones(())
    if dropout_p > 0.0:
        keep = torch.from_numpy(reference.dropout_keep(dropout_seed, dropout_p, B, H, L, S))
        factor = keep / (1.0 - float(np.float32(dropout_p)))
    out = (p * factor) @ v
    max_logit = logits.detach().abs().masked_fill(~takes_part, 0.0).max().item()
    aux = {"p": p.detach(), "factor": factor, "scores": scores.detach(), "scale": scale,
           "softcap": float(np.float32(softcap)), "sink_share": (sink_weight / total).detach(),
           "max_logit": max_logit, "group": group, "k": k.detach(), "v": v.detach()}
    return out, aux


def reference_gradients(q, k, v, grad_out, attn_mask=None, sinks=None, *, mask_grad=False,
                        **options):
    """Torch autograd through reference_forward in float64: ({name: gradient},
    {name: tolerance}) for query, key, value (and attn_mask, sinks when asked for).

    A gradient's tolerance is the C++ tests' (tests/test_backward.cpp): 2e-5 of its largest
    |value|, plus 2⁻¹⁸ (64 fp32 ulps) of the largest sum of its terms' magnitudes -- where
    terms cancel (dS = P ∘ (Z·dP − delta) of one key is exactly 0) fp32 leaves that much --
    plus what rounding the logits to fp32 costs the weights, relatively (decisions.md's
    4 · 2⁻²⁴ · max|logit|, twice: P and dS) of those sums."""
    f64 = torch.float64
    leaves = {"query": torch.tensor(np.asarray(q), dtype=f64, requires_grad=True),
              "key": torch.tensor(np.asarray(k), dtype=f64, requires_grad=True),
              "value": torch.tensor(np.asarray(v), dtype=f64, requires_grad=True)}
    mask = None
    if attn_mask is not None:
        attn_mask = np.asarray(attn_mask)
        if attn_mask.dtype == bool:
            mask = torch.from_numpy(attn_mask)
        else:
            mask = torch.tensor(attn_mask, dtype=f64, requires_grad=mask_grad)
            if mask_grad:
                leaves["attn_mask"] = mask
    sink_tensor = None
    if sinks is not None:
        sink_tensor = leaves["sinks"] = torch.tensor(np.asarray(sinks), dtype=f64,
                                                     requires_grad=True)
    out, aux = reference_forward(leaves["query"], leaves["key"], leaves["value"], mask,
                                 sinks=sink_tensor, **options)
    dout = torch.tensor(np.asarray(grad_out), dtype=f64)
    out.backward(dout)
    grads = {name: x.grad.numpy() for name, x in leaves.items()}

    # The sums of the terms' magnitudes, per element of each gradient.
    p, factor, group = aux["p"], aux["factor"], aux["group"]
    dp = dout @ aux["v"].transpose(-1, -2)
    delta_terms = (p * factor * dp).abs().sum(-1, keepdim=True)
    ds_terms = p * ((factor * dp).abs() + delta_terms)
    slope = torch.tensor(aux["scale"], dtype=f64)
    if aux["softcap"] > 0.0:
        slope = slope / torch.cosh(aux["scores"] / aux["softcap"]) ** 2
    dscore_terms = ds_terms * slope.abs()

    def per_kv_head(x):  # [B, H, S, .] summed over each key/value head's query heads
        return x.reshape(x.shape[0], x.shape[1] // group, group, *x.shape[2:]).sum(2)

    query = leaves["query"].detach()
    terms = {"query": (dscore_terms @ aux["k"].abs()).max().item(),
             "key": per_kv_head(dscore_terms.transpose(-1, -2) @ query.abs()).max().item(),
             "value": per_kv_head((p * factor).transpose(-1, -2) @ dout.abs()).max().item()}
    if "attn_mask" in leaves:
        shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
        terms["attn_mask"] = ds_terms.sum_to_size(shape).max().item()
    if "sinks" in leaves:
        terms["sinks"] = (aux["sink_share"] * delta_terms).sum((0, 2, 3)).max().item()
    tolerances = {
        name: 2e-5 * np.abs(grads[name]).max(initial=0.0) + 2.0**-18 * terms[name]
        + 8 * 2.0**-24 * aux["max_logit"] * terms[name]
        for name in grads}
    return grads, tolerances


# ---------------------------------------------------------------- mha under autograd

def mha_gradients(q, k, v, grad_out, attn_mask=None, sinks=None, *, mask_grad=False, **kwargs):
    """mha.scaled_dot_product_attention on float32 leaf tensors, out.backward(grad_out):
    {name: gradient} of those that require grad."""
    leaves = {name: torch.from_numpy(np.array(x)).requires_grad_()
              for name, x in (("query", q), ("key", k), ("value", v))}
    mask = None
    if attn_mask is not None:
        mask = torch.from_numpy(np.array(attn_mask))
        if mask_grad:
            leaves["attn_mask"] = mask.requires_grad_()
    sink_tensor = None
    if sinks is not None:
        sink_tensor = leaves["sinks"] = torch.from_numpy(np.array(sinks)).requires_grad_()
    out = mha.scaled_dot_product_attention(leaves["query"], leaves["key"], leaves["value"],
                                           mask, sinks=sink_tensor, **kwargs)
    assert out.requires_grad and out.dtype == torch.float32
    out.backward(torch.from_numpy(np.asarray(grad_out)))
    return {name: x.grad for name, x in leaves.items()}


def check(rng, backend=None, *, B=2, H=3, Hkv=None, L=9, S=13, E=16, Ev=None, attn_mask=None,
          sinks=None, mask_grad=False, **kwargs):
    """mha's gradients against the reference's for random inputs; returns both."""
    q, k, v = random_qkv(rng, B=B, H=H, L=L, S=S, E=E, Ev=Ev, Hkv=Hkv)
    grad_out = rng.standard_normal(q.shape[:-1] + v.shape[-1:]).astype(np.float32)
    got = mha_gradients(q, k, v, grad_out, attn_mask, sinks, mask_grad=mask_grad,
                        enable_gqa=Hkv is not None, backend=backend, **kwargs)
    want, tolerance = reference_gradients(q, k, v, grad_out, attn_mask, sinks,
                                          mask_grad=mask_grad, **kwargs)
    assert set(got) == set(want)
    for name, grad in got.items():
        assert grad.dtype == torch.float32 and tuple(grad.shape) == want[name].shape, name
        grad = grad.numpy().astype(np.float64)
        assert np.all(np.isfinite(grad)), name
        error = np.abs(grad - want[name]).max(initial=0.0)
        assert error <= tolerance[name], (
            f"{name}: |mha - ref| = {error:.3g} > {tolerance[name]:.3g}")
    return got, want


def test_plain_with_lq_lk_and_dv_d_differing(rng, backend):
    check(rng, backend, L=9, S=13, E=16, Ev=24)


def test_square_self_attention(rng, backend):
    check(rng, backend, L=16, S=16, E=8)


@pytest.mark.parametrize("H, Hkv", [(6, 2), (4, 1)])
def test_grouped_and_multi_query(rng, backend, H, Hkv):
    """dK and dV are summed over each key/value head's query heads."""
    got, _ = check(rng, backend, H=H, Hkv=Hkv)
    assert got["key"].shape == (2, Hkv, 13, 16)


@pytest.mark.parametrize("L, S", [(9, 13), (13, 9)])
@pytest.mark.parametrize("alignment", ["top-left", "bottom-right"])
def test_causal(rng, backend, L, S, alignment):
    check(rng, backend, L=L, S=S, is_causal=True, causal_alignment=alignment)


def test_valid_lens_per_batch_and_per_query(rng, backend):
    check(rng, backend, valid_lens=[13, 4])
    check(rng, backend, valid_lens=rng.integers(1, 14, size=(2, 9)))


def test_bool_mask(rng, backend):
    check(rng, backend, attn_mask=rng.random((2, 1, 9, 13)) < 0.7)


def test_scale_zero(rng, backend):
    """PyTorch's scale=0.0: the scores do not depend on query or key, whose gradients are
    zeros; value's and the mask's are those of softmax(mask)."""
    mask = (2 * rng.standard_normal((9, 13))).astype(np.float32)
    got, _ = check(rng, backend, attn_mask=mask, mask_grad=True, scale=0.0, is_causal=True)
    assert not got["query"].any() and not got["key"].any()


@pytest.mark.parametrize("shape", [(9, 13), (2, 1, 9, 13), (2, 3, 9, 13), (2, 1, 1, 13), (13,)])
def test_additive_mask_and_its_gradient(rng, backend, shape):
    """dL/d(attn_mask) has the mask's shape: summed over the axes it broadcasts, 0 where a key
    does not take part (-inf)."""
    mask = (2 * rng.standard_normal(shape)).astype(np.float32)
    mask[rng.random(shape) < 0.15] = -np.inf
    got, _ = check(rng, backend, attn_mask=mask, mask_grad=True)
    assert np.all(got["attn_mask"].numpy()[mask == -np.inf] == 0.0)


def test_additive_mask_without_its_gradient(rng, backend):
    check(rng, backend, attn_mask=rng.standard_normal((9, 13)).astype(np.float32))


def test_fully_masked_rows_have_zero_gradients(rng, backend):
    """Rows without keys (a bool mask's row, a valid length of 0, causal bottom-right with more
    queries than keys) are zeros in the forward and give zero gradients, never NaN."""
    mask = rng.random((9, 13)) < 0.8
    mask[[2, 5]] = False
    got, _ = check(rng, backend, attn_mask=mask, valid_lens=[0, 13])
    dq = got["query"].numpy()
    assert np.all(dq[:, :, [2, 5]] == 0.0) and np.all(dq[0] == 0.0)
    assert np.all(got["key"].numpy()[0] == 0.0) and np.all(got["value"].numpy()[0] == 0.0)
    got, _ = check(rng, backend, L=13, S=5, is_causal=True, causal_alignment="bottom-right")
    assert np.all(got["query"].numpy()[:, :, :8] == 0.0)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_with_a_seed(rng, backend, p):
    """The backward drops the forward's weights (mha's counter-based rule, regenerated): the
    reference is given the same keep-mask."""
    check(rng, backend, L=17, S=23, dropout_p=p, dropout_seed=0x1234_5678_9ABC_DEF0)


def test_dropout_without_a_seed_uses_the_forwards_draw(rng):
    """With dropout_seed=None the forward draws a seed from Python's random; the backward
    regenerates the mask of that seed, not of a new draw."""
    state = random.getstate()
    random.seed(99)
    seed = random.getrandbits(64)  # what the call below draws
    random.seed(99)
    q, k, v = random_qkv(rng, L=17, S=23)
    grad_out = rng.standard_normal(q.shape).astype(np.float32)
    leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
    out = mha.scaled_dot_product_attention(*leaves, dropout_p=0.4)
    random.seed(12345)  # a draw between forward and backward changes nothing
    out.backward(torch.from_numpy(grad_out))
    random.setstate(state)
    want, tolerance = reference_gradients(q, k, v, grad_out, dropout_p=0.4, dropout_seed=seed)
    for x, name in zip(leaves, ("query", "key", "value")):
        assert np.abs(x.grad.numpy() - want[name]).max() <= tolerance[name], name


@pytest.mark.parametrize("window", [(0, 0), (3, 1), (-1, 2)])
def test_window(rng, backend, window):
    check(rng, backend, window_size=window)


@pytest.mark.parametrize("softcap", [1.0, 20.0])
def test_softcap(rng, backend, softcap):
    check(rng, backend, E=32, softcap=softcap)


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi(rng, backend, per_batch):
    slopes = 2.0 ** (-8.0 * np.arange(1, 4) / 3)
    slopes = (np.stack([slopes, 2 * slopes]) if per_batch else slopes).astype(np.float32)
    check(rng, backend, alibi_slopes=slopes)


def test_sinks_and_their_gradient(rng, backend):
    """A head without a sink (-inf) gets a zero gradient for it; rows without keys get the
    sink as their whole denominator and no gradient."""
    sinks = np.array([0.5, -np.inf, 2.0, -1.0], dtype=np.float32)
    got, _ = check(rng, backend, H=4, Hkv=2, sinks=sinks)
    assert got["sinks"][1] == 0.0
    check(rng, backend, H=4, L=13, S=5, sinks=sinks, is_causal=True,
          causal_alignment="bottom-right")


def test_every_option_together(rng, backend):
    mask = (rng.standard_normal((2, 1, 17, 23))).astype(np.float32)
    mask[rng.random(mask.shape) < 0.1] = -np.inf
    sinks = np.array([1.0, 0.0, -np.inf, 0.5, -1.0, 2.0], dtype=np.float32)
    check(rng, backend, H=6, Hkv=3, L=17, S=23, E=16, Ev=8, attn_mask=mask, mask_grad=True,
          sinks=sinks, is_causal=True, causal_alignment="bottom-right", valid_lens=[20, 9],
          window_size=(12, 3), softcap=15.0, alibi_slopes=np.full(6, 0.0625, np.float32),
          dropout_p=0.2, dropout_seed=5, scale=0.3)


def test_same_bits_for_any_thread_count(rng):
    q, k, v = random_qkv(rng, B=1, H=2, L=64, S=200)
    grad_out = rng.standard_normal(q.shape).astype(np.float32)
    runs = [mha_gradients(q, k, v, grad_out, threads=n, is_causal=True) for n in (1, 3)]
    for name in ("query", "key", "value"):
        assert torch.equal(runs[0][name], runs[1][name]), name


# ---------------------------------------------------------------- layouts and autograd rules

def test_transposed_views_are_read_in_place_and_get_their_gradients(rng, monkeypatch):
    """Q, K, V as x.transpose(1, 2) of [B, L, H, E] leaves: the forward reads them where they
    are (no copy), and the gradients reach the leaves in their own layout."""
    bases = [torch.from_numpy(rng.standard_normal((2, L, 3, 16)).astype(np.float32))
             .requires_grad_() for L in (9, 13, 13)]
    views = [x.transpose(1, 2) for x in bases]
    assert not views[0].is_contiguous()
    seen = []
    original = mha._mha.attention

    def spy(query, key, value, *args):
        # The calls that compute: a first try that finds a tensor requiring
        # grad raises mha._mha.GradRequired before reading anything else.
        result = original(query, key, value, *args)
        seen.append([(x.data_ptr(), x.stride()) for x in (query, key, value)])
        return result

    monkeypatch.setattr(mha._mha, "attention", spy)
    out = mha.scaled_dot_product_attention(*views, is_causal=True)
    assert seen == [[(base.data_ptr(), view.stride()) for base, view in zip(bases, views)]]
    grad_out = rng.standard_normal(out.shape).astype(np.float32)
    out.backward(torch.from_numpy(grad_out))
    want, tolerance = reference_gradients(*(x.detach().numpy() for x in views), grad_out,
                                          is_causal=True)
    for base, name in zip(bases, ("query", "key", "value")):
        assert base.grad.shape == base.shape
        got = base.grad.transpose(1, 2).numpy()
        assert np.abs(got - want[name]).max() <= tolerance[name], name


def test_broadcast_key_and_value_with_zero_strides(rng):
    """K and V of one head expanded over the heads (a stride of 0): torch sums the gradient
    over the expansion."""
    q, k, v = random_qkv(rng, Hkv=1)
    grad_out = rng.standard_normal(q.shape).astype(np.float32)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    out = mha.scaled_dot_product_attention(tq, tk.expand(2, 3, 13, 16), tv.expand(2, 3, 13, 16))
    out.backward(torch.from_numpy(grad_out))
    want, tolerance = reference_gradients(q, k, v, grad_out)  # GQA with one KV head: the same
    for x, name in zip((tq, tk, tv), ("query", "key", "value")):
        assert x.grad.shape == x.shape
        assert np.abs(x.grad.numpy() - want[name]).max() <= tolerance[name], name


@pytest.mark.parametrize("rank", [2, 3])
def test_fewer_dimensions(rng, rank):
    q, k, v = random_qkv(rng, B=1, H=1 if rank == 2 else 3)
    lead = (0,) * (4 - rank)
    leaves = [torch.from_numpy(x[lead]).requires_grad_() for x in (q, k, v)]
    mha.scaled_dot_product_attention(*leaves, is_causal=True).sum().backward()
    want, tolerance = reference_gradients(q, k, v, np.ones(q.shape), is_causal=True)
    for x, name in zip(leaves, ("query", "key", "value")):
        assert x.grad.shape == x.shape
        assert np.abs(x.grad.numpy() - want[name][lead]).max() <= tolerance[name], name


def test_sum_backward_and_only_some_inputs_requiring_grad(rng):
    """.sum().backward() (a gradient of stride 0) fills the grad of what requires grad only."""
    q, k, v = random_qkv(rng)
    tq, tk, tv = torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v).requires_grad_()
    mha.scaled_dot_product_attention(tq, tk, tv).sum().backward()
    assert tq.grad is None and tk.grad is None
    want, tolerance = reference_gradients(q, k, v, np.ones(q.shape))
    assert np.abs(tv.grad.numpy() - want["value"]).max() <= tolerance["value"]


def test_return_lse_is_not_differentiable(rng):
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in random_qkv(rng))
    out, lse = mha.scaled_dot_product_attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    with torch.no_grad():
        plain_out, plain_lse = mha.scaled_dot_product_attention(q, k, v, return_lse=True)
    assert torch.equal(out, plain_out) and torch.equal(lse, plain_lse)
    (out.sum() + lse.sum()).backward()
    assert q.grad is not None


def test_no_grad_and_inference_mode_record_nothing(rng):
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in random_qkv(rng))
    with torch.no_grad():
        assert not mha.scaled_dot_product_attention(q, k, v).requires_grad
    with torch.inference_mode():
        plain = [torch.from_numpy(x) for x in random_qkv(rng)]
        assert not mha.scaled_dot_product_attention(*plain).requires_grad


def test_a_saved_input_changed_in_place_is_caught(rng):
    """The inputs are saved with save_for_backward, whose version check sees the change."""
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in random_qkv(rng))
    scaled = q * 2.0
    out = mha.scaled_dot_product_attention(scaled, k, v)
    scaled.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("changed", ["valid_lens", "alibi_slopes"])
def test_saved_valid_lens_and_slopes_changed_in_place_are_caught(rng, changed):
    """The valid lengths and the ALiBi slopes go through save_for_backward too: a change
    between the forward and the backward raises, as for the inputs (it used to give other
    gradients without a word)."""
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in random_qkv(rng, H=4, Hkv=4))
    arguments = {"valid_lens": torch.tensor([13, 7], dtype=torch.int32),
                 "alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])}
    out = mha.scaled_dot_product_attention(q, k, v, **arguments)
    arguments[changed].add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_writes_into_given_tensors_move_their_version(rng):
    """mha writes through data pointers torch does not see: every tensor given to be written
    (out=, gradients, caches, quantised rows) has its version counter moved on, so that a
    backward which saved it raises, as after torch's own out= functions."""
    q, k, v = (torch.from_numpy(x) for x in random_qkv(rng, H=4, Hkv=4))

    def saved_then_written(buffer, write):
        weight = torch.ones(buffer.shape, dtype=torch.float32, requires_grad=True)
        product = (weight * buffer).sum()  # saves buffer for the backward
        before = buffer._version
        write(buffer)
        assert buffer._version > before
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            product.backward()

    out, lse = mha.scaled_dot_product_attention(q, k, v, return_lse=True)
    saved_then_written(torch.empty_like(out),
                       lambda b: mha.scaled_dot_product_attention(q, k, v, out=b))
    saved_then_written(torch.empty_like(out), lambda b: mha.merge_partials([out], [lse], out=b))
    saved_then_written(torch.empty_like(q), lambda b: mha.scaled_dot_product_attention_backward(
        torch.ones_like(out), q, k, v, out, lse, grad_query=b))
    scale = torch.empty(k.shape[:-1], dtype=torch.float32)
    saved_then_written(scale, lambda b: mha.quantize_kv(k, scale=b))
    cache = torch.zeros(2, 8, 4, 16)  # [num_blocks, block_size, Hkv, D]
    rows = k[0].transpose(0, 1)[:3].contiguous()  # [T = 3, Hkv, D]
    saved_then_written(cache, lambda b: mha.kv_cache_write(
        rows, rows, b, torch.zeros_like(cache), torch.tensor([0, 5, 9])))
    packed = q[0].transpose(0, 1).contiguous()  # [total = 9, H, D]
    saved_then_written(torch.empty_like(packed), lambda b: mha.varlen_attention(
        packed, packed, packed, torch.tensor([0, 9], dtype=torch.int32),
        torch.tensor([0, 9], dtype=torch.int32), 9, 9, out=b))


def test_numpy_inputs_under_grad_mode_compute_the_forward(rng):
    """NumPy arrays never involve autograd: the plain forward, as before."""
    q, k, v = random_qkv(rng)
    assert torch.is_grad_enabled()
    out = mha.scaled_dot_product_attention(q, k, v, attn_mask=rng.random((9, 13)) < 0.8)
    assert isinstance(out, np.ndarray)


# ---------------------------------------------------------------- the low-level function

@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_backward_function_on_arrays(rng, framework):
    """scaled_dot_product_attention_backward from the forward's out and LSE, on NumPy arrays
    and on tensors, into given (strided) gradient arrays, with the mask's and sinks' too."""
    q, k, v = random_qkv(rng, H=4, Hkv=2, Ev=8)
    mask = rng.standard_normal((2, 1, 9, 13)).astype(np.float32)
    sinks = np.array([0.5, -1.0, 1.0, 0.0], dtype=np.float32)
    grad_out = rng.standard_normal((2, 4, 9, 8)).astype(np.float32)
    options = {"is_causal": True, "causal_alignment": "bottom-right", "dropout_p": 0.3,
               "dropout_seed": 77, "softcap": 10.0, "window_size": (6, 0)}
    convert = (lambda x: x) if framework == "numpy" else torch.from_numpy
    q, k, v, mask, sinks, grad_out = map(convert, (q, k, v, mask, sinks, grad_out))
    out, lse = mha.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, sinks=sinks,
                                                return_lse=True, **options)
    grad_key = np.full((2, 13, 2, 16), np.nan, np.float32).transpose(0, 2, 1, 3)  # strided
    grad_mask = np.full(mask.shape, np.nan, np.float32)
    grad_sinks = np.full(4, np.nan, np.float32)
    grads = mha.scaled_dot_product_attention_backward(
        grad_out, q, k, v, out, lse, mask, enable_gqa=True, sinks=sinks,
        grad_key=convert(grad_key), grad_attn_mask=convert(grad_mask),
        grad_sinks=convert(grad_sinks), **options)
    assert all(type(x) is type(q) for x in grads)
    assert grads[1] is not None and np.shares_memory(np.asarray(grads[1]), grad_key)
    want, tolerance = reference_gradients(np.asarray(q), np.asarray(k), np.asarray(v),
                                          np.asarray(grad_out), np.asarray(mask),
                                          np.asarray(sinks), mask_grad=True, **options)
    got = dict(zip(("query", "key", "value"), grads), attn_mask=grad_mask, sinks=grad_sinks)
    for name, grad in got.items():
        grad = np.asarray(grad)
        assert grad.shape == want[name].shape
        assert np.abs(grad - want[name]).max() <= tolerance[name], name


def test_backward_function_equals_autograd(rng):
    """The autograd path and the low-level function are one library call: the same bits."""
    q, k, v = random_qkv(rng)
    grad_out = rng.standard_normal(q.shape).astype(np.float32)
    got = mha_gradients(q, k, v, grad_out, is_causal=True, scale=0.5)
    out, lse = mha.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5,
                                                return_lse=True)
    grads = mha.scaled_dot_product_attention_backward(grad_out, q, k, v, out, lse,
                                                      is_causal=True, scale=0.5)
    for grad, name in zip(grads, ("query", "key", "value")):
        assert isinstance(grad, np.ndarray)
        np.testing.assert_array_equal(grad, got[name].numpy())


# ---------------------------------------------------------------- finite differences

def test_finite_differences_of_mhas_own_forward():
    """torch.autograd.gradcheck of float64 -> float32 -> mha -> float64: mha's backward is the
    derivative of mha's forward (not only of the reference's).  mha computes in fp32, so
    the tolerances are fp32's: with eps = 1e-2 the central difference's truncation error is
    about eps²/6 · |f'''| (~2e-5 for these O(1) inputs) and fp32's rounding of the outputs
    contributes about 2⁻²⁴ · |out| / eps (~1e-5); atol = rtol = 1e-3 leaves a margin of 10
    and still catches any wrong term (the gradients here are O(0.1) to O(1))."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(3, 3, generator=gen, dtype=torch.float64)
    sinks = torch.tensor([0.3, -0.5], dtype=torch.float64)
    inputs = tuple(x.requires_grad_() for x in (q, k, v, mask, sinks))

    def attention(q, k, v, mask, sinks):
        out = mha.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask.float(),
                                               sinks=sinks.float(), softcap=3.0,
                                               is_causal=True)
        return out.double()

    assert torch.autograd.gradcheck(attention, inputs, eps=1e-2, atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------- refused

def test_int8_cache_with_grad_is_refused(rng):
    q, k, v = random_qkv(rng)
    k8, k_scale = mha.quantize_kv(k)
    v8, v_scale = mha.quantize_kv(v)
    with pytest.raises(TypeError, match="key is int8 and query requires grad"):
        mha.scaled_dot_product_attention(torch.from_numpy(q).requires_grad_(),
                                         torch.from_numpy(k8), torch.from_numpy(v8),
                                         k_scale=k_scale, v_scale=v_scale)


def test_out_with_grad_is_refused(rng):
    q, k, v = (torch.from_numpy(x) for x in random_qkv(rng))
    with pytest.raises(ValueError, match="out cannot be given while key requires grad"):
        mha.scaled_dot_product_attention(q, k.requires_grad_(), v, out=torch.empty(2, 3, 9, 16))


def test_an_out_that_requires_grad_is_refused_by_name(rng):
    """Only query, key, value, attn_mask and sinks take the autograd path: an out that
    requires grad (the extension's GradRequired, a ValueError) is refused, nothing written."""
    q, k, v = (torch.from_numpy(x) for x in random_qkv(rng))
    out = torch.zeros(2, 3, 9, 16, requires_grad=True)
    with pytest.raises(ValueError, match="out requires grad, but this mha function has no"):
        mha.scaled_dot_product_attention(q, k, v, out=out)
    assert not out.detach().any()
    assert issubclass(mha._mha.GradRequired, ValueError)


def test_tensors_without_grad_take_no_autograd_path(rng, monkeypatch):
    """Tensors that do not require grad (or under no_grad) are computed by one call of the
    extension, never through the autograd.Function: the result has no grad_fn."""
    q, k, v = random_qkv(rng)
    want = mha.scaled_dot_product_attention(q, k, v, is_causal=True)
    import mha._autograd as autograd

    def refuse(*args):
        raise AssertionError("the autograd path was taken")

    monkeypatch.setattr(autograd, "attention_with_grad", refuse)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    got = mha.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    assert got.grad_fn is None and got.is_contiguous()
    assert np.array_equal(got.numpy(), want)
    with torch.no_grad():
        got = mha.scaled_dot_product_attention(tq.requires_grad_(), tk, tv, is_causal=True)
    assert got.grad_fn is None and np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("name", ["alibi_slopes", "k_scale"])
def test_arguments_without_a_gradient_are_refused(rng, name):
    q, k, v = (torch.from_numpy(x) for x in random_qkv(rng))
    with pytest.raises(ValueError, match=f"{name} requires grad, but mha has no gradient"):
        mha.scaled_dot_product_attention(
            q.requires_grad_(), k, v, **{name: torch.ones(3, requires_grad=True)})


def test_a_numpy_query_with_a_tensor_that_requires_grad(rng):
    q, k, v = random_qkv(rng)
    with pytest.raises(TypeError, match="query must be a torch tensor when key requires grad"):
        mha.scaled_dot_product_attention(q, torch.from_numpy(k).requires_grad_(), v)


def test_numpy_key_value_and_mask_beside_a_query_that_requires_grad(rng):
    """Arrays of other frameworks are kept as they are for the backward: the query's grad."""
    q, k, v = random_qkv(rng)
    mask = rng.standard_normal((9, 13)).astype(np.float32)
    grad_out = rng.standard_normal(q.shape).astype(np.float32)
    tq = torch.from_numpy(q).requires_grad_()
    mha.scaled_dot_product_attention(tq, k, v, mask).backward(torch.from_numpy(grad_out))
    want, tolerance = reference_gradients(q, k, v, grad_out, mask)
    assert np.abs(tq.grad.numpy() - want["query"]).max() <= tolerance["query"]
    with pytest.raises(TypeError, match="key is float64 and query requires grad"):
        mha.scaled_dot_product_attention(tq, k.astype(np.float64), v)


def test_half_precision_mask_gets_a_gradient_of_its_dtype(rng):
    """An additive bfloat16 mask: mha's float32 dmask rounded to bfloat16 (the mask's own
    values are the reference's input)."""
    q, k, v = random_qkv(rng)
    mask = torch.from_numpy(rng.standard_normal((9, 13)).astype(np.float32)).bfloat16()
    grad_out = rng.standard_normal(q.shape).astype(np.float32)
    leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
    mask.requires_grad_()
    mha.scaled_dot_product_attention(*leaves, mask).backward(torch.from_numpy(grad_out))
    assert mask.grad.dtype == torch.bfloat16
    want, tolerance = reference_gradients(q, k, v, grad_out, mask.detach().float().numpy(),
                                          mask_grad=True)
    got = mask.grad.float().numpy()
    bound = tolerance["attn_mask"] + 2.0**-8 * np.abs(want["attn_mask"])  # bfloat16's rounding
    assert np.all(np.abs(got - want["attn_mask"]) <= bound)


def test_second_derivatives_are_refused(rng):
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in random_qkv(rng))
    out = mha.scaled_dot_product_attention(q, k, v)
    grad_out = torch.ones_like(out, requires_grad=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        torch.autograd.grad(out, q, grad_out, create_graph=True)


def test_second_derivatives_with_plain_grad_outputs_are_refused(rng):
    """create_graph=True with grad_outputs that do not require grad (a Hessian, a gradient
    penalty): torch's once_differentiable let these through, the second derivatives
    silently 0."""
    q, k, v = (torch.from_numpy(x) for x in random_qkv(rng))
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.functional.hessian(
            lambda x: mha.scaled_dot_product_attention(x, k, v).pow(2).sum(), q)
    leaf = q.clone().requires_grad_()
    out = mha.scaled_dot_product_attention(leaf, k, v)
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(out.sum(), leaf, create_graph=True)
    (grad_q,) = torch.autograd.grad(out.sum(), leaf)  # first derivatives as before
    assert grad_q.shape == leaf.shape


@pytest.fixture
def forward(rng):
    """A forward call's arrays: (grad_out, q, k, v, out, lse)."""
    q, k, v = random_qkv(rng)
    out, lse = mha.scaled_dot_product_attention(q, k, v, return_lse=True)
    return rng.standard_normal(out.shape).astype(np.float32), q, k, v, out, lse


@pytest.mark.parametrize("change, error, message", [
    (lambda a: a.update(grad_out=a["grad_out"][..., :8]), mha.Error, "dout"),
    (lambda a: a.update(grad_out="x"), TypeError, "grad_out"),
    (lambda a: a.update(lse=a["lse"][..., None]), ValueError, "lse must have 1 to 3 dimensions"),
    (lambda a: a.update(lse=a["lse"][..., :4]), mha.Error, "lse"),
    (lambda a: a.update(out=a["out"].astype(np.float16)), mha.Error, "out"),
    (lambda a: a.update(grad_query=np.empty((2, 3, 9, 8), np.float32)), mha.Error, "dq"),
    (lambda a: a.update(grad_key=np.empty((2, 3, 13, 16), np.float16)), mha.Error, "dk"),
    (lambda a: a.update(key=a["key"][:, :2], value=a["value"][:, :2]), ValueError,
     "enable_gqa"),
    (lambda a: a.update(dropout_p=0.1), ValueError, "dropout_seed is required"),
    (lambda a: a.update(grad_sinks=np.empty(3, np.float32)), mha.Error, "dsinks"),
    (lambda a: a.update(attn_mask=np.ones((9, 13), bool),
                        grad_attn_mask=np.empty((9, 13), np.float32)), mha.Error, "dmask"),
])
def test_backward_function_refuses_bad_input_by_name(forward, change, error, message):
    names = ("grad_out", "query", "key", "value", "out", "lse")
    arguments = dict(zip(names, forward))
    change(arguments)
    with pytest.raises(error, match=message):
        mha.scaled_dot_product_attention_backward(**arguments)
