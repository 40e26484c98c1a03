"""The module's gradients: mha.torch.MultiheadAttention and mha.multi_head_attention_forward
under torch's autograd (a torch.autograd.Function over mha_module_backward), and
mha.multi_head_attention_backward, against the autograd of PyTorch's own
nn.MultiheadAttention in float64 on the same weights (PyTorch's default initialisation,
seeded; the biases, which that makes zero, drawn small so that a bias the backward's
recomputed forward dropped would show).  Dropout is compared with torch's module whose
dropout is given mha's keep-mask (reference.py's copy of mha.h's rule).  Every gradient is
checked against a tolerance derived from its terms (gradient_tolerances), on every usable
backend; bad input is refused by name; a few SGD steps train both modules alike.

torch 1.13's nn.MultiheadAttention has no is_causal: its reference is the explicit causal
mask.  Unlike torch, mha gives zeros (not NaN) for a row in which no key takes part, so the
masks here leave every row a key.
"""
import copy
import math
import pickle

import numpy as np
import pytest

import mha
import reference

torch = pytest.importorskip("torch")
import mha.torch  # noqa: E402  (needs torch)

F = torch.nn.functional
U = 2.0**-24  # fp32's unit roundoff


@pytest.fixture(params=mha.backends())
def backend(request):
    mha.set_backend(request.param)  # conftest's fixture restores "auto"
    return request.param


# ---------------------------------------------------------------- the modules

def make_pair(seed=0, embed_dim=16, num_heads=4, **kwargs):
    """(mha's module, torch's in float64) with the same weights: torch's default
    initialisation after torch.manual_seed(seed), then biases ~ 0.1·N(0, 1) (PyTorch
    initialises them to zero)."""
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(embed_dim, num_heads, **kwargs)
    with torch.no_grad():
        for name, parameter in ref.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.1)
    module = mha.torch.MultiheadAttention.from_torch(ref)
    return module, ref.double()


def sequence_shapes(batch_first, B, L, S, E, kdim, vdim, batched=True):
    shapes = [(B, L, E), (B, S, kdim), (B, S, vdim)]
    if not batched:
        return [s[1:] for s in shapes]
    return shapes if batch_first else [(s[1], s[0], s[2]) for s in shapes]


def random_inputs(rng, module, L=6, S=9, B=2, shared=None, batched=True):
    """(query, key, value) float32 NumPy arrays for `module`; shared: "qkv" (one array
    three times: self-attention) or "kv" (key is value)."""
    shapes = sequence_shapes(module.batch_first, B, L, L if shared == "qkv" else S,
                             module.embed_dim, module.kdim, module.vdim, batched)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    if shared == "qkv":
        return q, q, q
    if shared == "kv":
        return q, k, k
    return q, k, v


def leaves(arrays, dtype):
    """Leaf tensors of `dtype` that require grad, one per distinct array (identity kept)."""
    made = {}
    for x in arrays:
        if id(x) not in made:
            made[id(x)] = torch.tensor(x, dtype=dtype, requires_grad=True)
    return [made[id(x)] for x in arrays]


def mask_tensor(mask, dtype):
    if mask is None or mask.dtype == bool:
        return None if mask is None else torch.from_numpy(mask)
    return torch.tensor(mask, dtype=dtype)


# ---------------------------------------------------------------- the tolerance

def gradient_tolerances(ref, query, key, value, grad_out, *, attn_mask=None, keep=None,
                        dropout_p=0.0):
    """{gradient name: tolerance} for mha's fp32 gradients against the float64 reference.

    test_backward.py's rule (the C++ tests'), carried through the module: 2e-5 of the
    gradient's largest |value|, plus 2⁻¹⁸ (64 fp32 ulps) of the largest sum of its terms'
    magnitudes, plus 8·2⁻²⁴·Λ of the same (the weights' error from rounding the logits, Λ
    the largest magnitude a logit is summed from).  Each stage of the backward is a sum of
    products, whose fp32 error is a few ulps of the sum of its terms' magnitudes; an error
    coming from an earlier stage is carried linearly, so it is bounded by the same
    magnitudes carried through |·| products:
        dC = dout·W_o                        T_dC = |dout|·|W_o|
        dW_o = doutᵀ·C, db_o = Σ dout        |dout|ᵀ·|C|, Σ |dout|   (C the heads' output)
        the attention's (test_backward.py's terms with T_dC for dout):
        dP = dC_h·V_hᵀ                       T_dP = T_dC_h·|V_h|ᵀ
        dS = P∘(Z·dP − rowsum(P·Z·dP))       T_dS = P∘(Z·T_dP + rowsum(P·Z·T_dP))
        dQ_h = s·dS·K_h, dK_h = s·dSᵀ·Q_h    s·T_dS·|K_h|, s·T_dSᵀ·|Q_h|
        dV_h = (P∘Z)ᵀ·dC_h                   (P∘Z)ᵀ·T_dC_h
        dx_q = dQ·W_q                        T_dQ·|W_q|   (k and v alike)
        dW_q = dQᵀ·x_q, db_q = Σ dQ          T_dQᵀ·|x_q|, Σ T_dQ
    The weights' terms are summed over the B·L (or B·S) rows, so their bounds grow with the
    batch as their sums do.  Λ: the recomputed projections are rounded too, so a logit's
    error is bounded by s·(A_Q·|K|ᵀ + |Q|·A_Kᵀ) (A_Q = |x_q|·|W_q|ᵀ + |b_q|, the sum of
    magnitudes Q is computed from) plus a float mask's |value|; Λ is its largest over the
    pairs that take part.  Inputs are [B, L, E] float64 tensors (detached), masks
    [B, H, L, S] (bool: True = takes part; float: added), keep the dropout keep-mask."""
    e, h = ref.embed_dim, ref.num_heads
    d = e // h
    s = 1.0 / math.sqrt(d)
    p = {name: x.detach() for name, x in ref.named_parameters()}
    if "in_proj_weight" in p:
        w_q, w_k, w_v = p["in_proj_weight"].chunk(3)
    else:
        w_q, w_k, w_v = p["q_proj_weight"], p["k_proj_weight"], p["v_proj_weight"]
    zeros = torch.zeros(e, dtype=torch.float64)
    b_q, b_k, b_v = p["in_proj_bias"].chunk(3) if "in_proj_bias" in p else (zeros,) * 3
    w_o = p["out_proj.weight"]

    def heads(x):  # [B, L, E] -> [B, H, L, d]
        return x.reshape(x.shape[0], x.shape[1], h, d).transpose(1, 2)

    def merged(x):  # [B, H, L, d] -> [B, L, E]
        return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], e)

    projected = {}
    for name, x, w, b in (("q", query, w_q, b_q), ("k", key, w_k, b_k), ("v", value, w_v, b_v)):
        projected[name] = (heads(x @ w.T + b), heads(x.abs() @ w.abs().T + b.abs()))
    (q, a_q), (k, a_k), (v, _) = projected["q"], projected["k"], projected["v"]
    B, _, L, _ = q.shape
    S = k.shape[2]
    logits = q @ k.transpose(-1, -2) * s
    takes_part = torch.ones(B, h, L, S, dtype=torch.bool)
    logit_bound = s * (a_q @ k.abs().transpose(-1, -2) + q.abs() @ a_k.transpose(-1, -2))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            takes_part &= attn_mask
        else:
            logits = logits + attn_mask
            takes_part &= attn_mask != -math.inf
            logit_bound = logit_bound + attn_mask.abs().nan_to_num(posinf=0.0)
    weights = torch.softmax(logits.masked_fill(~takes_part, -math.inf), dim=-1)
    factor = torch.ones(()) if keep is None else keep / (1.0 - float(np.float32(dropout_p)))
    dropped = weights * factor
    concat = merged(dropped @ v)
    lam = logit_bound.masked_fill(~takes_part, 0.0).max().item()

    t_dc = grad_out.abs() @ w_o.abs()
    t_dc_h = heads(t_dc)
    t_dp = t_dc_h @ v.abs().transpose(-1, -2)
    t_ds = weights * (factor * t_dp + (dropped * t_dp).sum(-1, keepdim=True))
    t_dq = merged(s * t_ds @ k.abs())
    t_dk = merged(s * t_ds.transpose(-1, -2) @ q.abs())
    t_dv = merged(dropped.transpose(-1, -2) @ t_dc_h)

    def rows(x):  # [B, L, n] -> [B·L, n]
        return x.reshape(-1, x.shape[-1])

    terms = {"out_proj.weight": rows(grad_out.abs()).T @ rows(concat.abs()),
             "out_proj.bias": rows(grad_out.abs()).sum(0)}
    by_input = {}
    for name, t, x, w in (("q", t_dq, query, w_q), ("k", t_dk, key, w_k), ("v", t_dv, value, w_v)):
        by_input[name] = t @ w.abs()
        terms[f"{name}_proj_weight"] = rows(t).T @ rows(x.abs())
        terms[f"{name}_proj_bias"] = rows(t).sum(0)
    terms["query"], terms["key"], terms["value"] = by_input["q"], by_input["k"], by_input["v"]
    terms["in_proj_weight"] = torch.cat([terms.pop(f"{n}_proj_weight") for n in "qkv"]) \
        if "in_proj_weight" in p else None
    terms["in_proj_bias"] = torch.cat([terms.pop(f"{n}_proj_bias") for n in "qkv"])
    coefficient = 2.0**-18 + 8 * U * lam
    return {name: coefficient * t.max().item() for name, t in terms.items() if t is not None}


# ---------------------------------------------------------------- the comparison

def reference_gradients(ref, query, key, value, grad_out, *, keep=None, **kwargs):
    """Torch's float64 module under autograd: (output, {name: gradient}) for the inputs
    (as leaves, one per distinct array) and every parameter.  keep: dropout's keep-mask
    [B·H, L, S], given to torch's dropout in place of its own draw."""
    ref.zero_grad(set_to_none=True)
    tq, tk, tv = leaves((query, key, value), torch.float64)
    masks = {name: mask_tensor(kwargs.pop(name, None), torch.float64)
             for name in ("key_padding_mask", "attn_mask")}
    original = F.dropout
    if keep is not None:
        def dropout(x, p=0.5, training=True, inplace=False):
            assert x.shape == keep.shape and training
            return x * keep / (1.0 - float(np.float32(p)))
        F.dropout = dropout
    try:
        out, _ = ref(tq, tk, tv, need_weights=False, **masks, **kwargs)
    finally:
        F.dropout = original
    out.backward(torch.from_numpy(grad_out).double())
    grads = {"query": tq.grad, "key": tk.grad, "value": tv.grad}
    grads.update({name: x.grad for name, x in ref.named_parameters()})
    return out.detach(), {name: None if g is None else g.numpy() for name, g in grads.items()}


def mha_gradients(module, query, key, value, grad_out, **kwargs):
    """mha's module under autograd: (output, weights, {name: gradient}) as above."""
    module.zero_grad(set_to_none=True)
    tq, tk, tv = leaves((query, key, value), torch.float32)
    for name in ("key_padding_mask", "attn_mask"):
        if name in kwargs:
            kwargs[name] = mask_tensor(kwargs[name], torch.float32)
    out, weights = module(tq, tk, tv, **kwargs)
    assert out.requires_grad and out.dtype == torch.float32
    out.backward(torch.from_numpy(grad_out))
    grads = {"query": tq.grad, "key": None if tk is tq else tk.grad,
             "value": None if tv is tk or tv is tq else tv.grad}
    grads.update({name: x.grad for name, x in module.named_parameters()})
    return out.detach(), weights, grads


def library_layout(x, module, batched=True):
    """A float64 [B, L, E] tensor of an input in the module's layout."""
    x = torch.from_numpy(np.asarray(x)).double()
    if not batched:
        return x[None]
    return x if module.batch_first else x.transpose(0, 1)


def expected(module, ref, query, key, value, grad_out, *, dropout_seed=None, attn_mask=None,
             key_padding_mask=None, is_causal=False):
    """The reference's (output, {name: gradient}) and {name: tolerance} for mha's call with
    these arguments (query, key, value, grad_out and the masks as NumPy arrays)."""
    batched = len(query.shape) == 3
    H = module.num_heads
    qb, kb, vb = (library_layout(x, module, batched) for x in (query, key, value))
    B, L, S = qb.shape[0], qb.shape[1], kb.shape[1]
    # The reference's masks: is_causal as the explicit mask (torch 1.13 has no flag).
    ref_mask = attn_mask
    if is_causal:
        causal = np.triu(np.ones((L, S), bool), 1)
        ref_mask = causal if attn_mask is None else (
            attn_mask | causal if attn_mask.dtype == bool else
            np.where(causal, -np.inf, attn_mask).astype(np.float32))
    keep = None
    if dropout_seed is not None and module.training and module.dropout > 0.0:
        keep = torch.from_numpy(reference.dropout_keep(dropout_seed, module.dropout, B, H, L, S)
                                ).reshape(B * H, L, S)
    want_out, want = reference_gradients(ref, query, key, value, grad_out, keep=keep,
                                         attn_mask=ref_mask, key_padding_mask=key_padding_mask)

    # The tolerances' mask [B, H, L, S]: the float values, -inf where a key does not take
    # part (torch's bool masks: True = not allowed).
    additive = torch.zeros(B, H, L, S, dtype=torch.float64)
    for mask, per_key in ((ref_mask, False), (key_padding_mask, True)):
        if mask is None:
            continue
        m = torch.from_numpy(np.asarray(mask))
        m = m.reshape(B, 1, 1, S) if per_key else (m.reshape(B, H, L, S) if m.dim() == 3 else m)
        additive = additive.masked_fill(m, -math.inf) if m.dtype == torch.bool else \
            additive + m.double()
    tolerances = gradient_tolerances(
        ref, qb, kb, vb, library_layout(grad_out, module, batched), attn_mask=additive,
        keep=None if keep is None else keep.reshape(B, H, L, S), dropout_p=module.dropout)
    # An input given as several arguments gets the sum: its terms are summed as well.
    if query is key is value:
        tolerances["query"] += tolerances["key"] + tolerances["value"]
    elif key is value:
        tolerances["key"] += tolerances["value"]
    return want_out, want, tolerances


def check(module, ref, query, key, value, *, rng=None, **kwargs):
    """mha's gradients (and output) against the reference's, each within its tolerance
    (need_weights=False, the fused path, unless kwargs say otherwise); returns
    ({name: mha's gradient}, {name: (error, tolerance)})."""
    rng = rng or np.random.default_rng(7)
    grad_out = rng.standard_normal(query.shape[:-1] + (module.embed_dim,)).astype(np.float32)
    options = {name: kwargs.pop(name) for name in ("dropout_seed", "attn_mask",
                                                   "key_padding_mask", "is_causal")
               if name in kwargs}
    want_out, want, tolerances = expected(module, ref, query, key, value, grad_out, **options)
    kwargs.setdefault("need_weights", False)
    out, _, got = mha_gradients(module, query, key, value, grad_out, **options, **kwargs)
    assert_within(out.numpy(), want_out.numpy(), 1e-5 * max(1.0, want_out.abs().max().item()),
                  "output")
    errors = {}
    for name, grad in got.items():
        if name == "key" and key is query or name == "value" and (value is key or
                                                                  value is query):
            assert grad is None, name  # the same leaf as an earlier input
            continue
        assert grad is not None, name
        assert grad.dtype == torch.float32 and tuple(grad.shape) == want[name].shape, name
        grad = grad.numpy().astype(np.float64)
        assert np.all(np.isfinite(grad)), name
        errors[name] = assert_within(grad, want[name], tolerances[name], name)
    return got, errors


def assert_within(got, want, tolerance, name):
    error = np.abs(got - want).max(initial=0.0)
    assert error <= tolerance, f"{name}: |mha - torch| = {error:.3g} > {tolerance:.3g}"
    return error, tolerance


# ---------------------------------------------------------------- against torch's module

def test_default_initialisation_is_torchs():
    """The same constructor and parameters as torch's class, initialised alike."""
    torch.manual_seed(3)
    ref = torch.nn.MultiheadAttention(16, 4, kdim=8, vdim=12, batch_first=True)
    torch.manual_seed(3)
    module = mha.torch.MultiheadAttention(16, 4, kdim=8, vdim=12, batch_first=True)
    assert isinstance(module, torch.nn.MultiheadAttention)
    assert list(module.state_dict()) == list(ref.state_dict())
    for (name, x), (_, y) in zip(module.named_parameters(), ref.named_parameters()):
        assert isinstance(x, torch.nn.Parameter) and torch.equal(x, y), name


@pytest.mark.parametrize("batch_first", [False, True])
def test_self_attention(rng, backend, batch_first):
    """One tensor as query, key and value: its gradient is the sum of the three."""
    module, ref = make_pair(seed=1, batch_first=batch_first)
    q, k, v = random_inputs(rng, module, shared="qkv")
    got, _ = check(module, ref, q, k, v)
    assert set(got) == {"query", "key", "value", "in_proj_weight", "in_proj_bias",
                        "out_proj.weight", "out_proj.bias"}


@pytest.mark.parametrize("batch_first", [False, True])
def test_cross_attention(rng, backend, batch_first):
    module, ref = make_pair(seed=2, batch_first=batch_first)
    check(module, ref, *random_inputs(rng, module, L=5, S=11))


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_kdim_and_vdim(rng, backend, batch_first, bias):
    """Separate q/k/v_proj_weight [E, E], [E, kdim], [E, vdim] with their own gradients."""
    module, ref = make_pair(seed=3, embed_dim=24, num_heads=3, kdim=10, vdim=6, bias=bias,
                            batch_first=batch_first)
    got, _ = check(module, ref, *random_inputs(rng, module, L=5, S=8))
    assert got["k_proj_weight"].shape == (24, 10) and got["v_proj_weight"].shape == (24, 6)
    assert ("in_proj_bias" in got) == bias


def test_without_bias(rng, backend):
    module, ref = make_pair(seed=4, bias=False)
    got, _ = check(module, ref, *random_inputs(rng, module))
    assert module.in_proj_bias is None and "in_proj_bias" not in got


@pytest.mark.parametrize("batch_first", [False, True])
def test_key_is_value(rng, backend, batch_first):
    module, ref = make_pair(seed=5, batch_first=batch_first)
    q, k, v = random_inputs(rng, module, shared="kv")
    got, _ = check(module, ref, q, k, v)
    assert got["value"] is None  # the same leaf as key, which has the sum


def test_equal_copies_are_separate_inputs(rng):
    """Equal data in separate tensors is not self-attention: each gets its own gradient."""
    module, ref = make_pair(seed=6)
    q, _, _ = random_inputs(rng, module)
    got, _ = check(module, ref, q, q.copy(), q.copy())
    assert got["key"] is not None and got["value"] is not None


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_key_padding_mask(rng, backend, kind):
    module, ref = make_pair(seed=7)
    q, k, v = random_inputs(rng, module, L=6, S=9, B=3)
    ignored = rng.random((3, 9)) < 0.3
    ignored[:, 0] = False  # every row keeps a key (torch: NaN otherwise)
    if kind == "bool":
        padding = ignored
    else:
        padding = rng.standard_normal((3, 9)).astype(np.float32)
        padding[ignored] = -np.inf
    got, _ = check(module, ref, q, k, v, key_padding_mask=padding)
    if kind == "bool":  # an ignored key has no gradient
        assert np.all(got["key"].numpy().transpose(1, 0, 2)[ignored] == 0)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("rank", [2, 3])
def test_attn_mask(rng, backend, kind, rank):
    module, ref = make_pair(seed=8)
    q, k, v = random_inputs(rng, module, L=6, S=9)
    shape = (6, 9) if rank == 2 else (2 * 4, 6, 9)
    if kind == "bool":
        mask = rng.random(shape) < 0.3  # True = not allowed
        mask[..., 0] = False
    else:
        mask = (2 * rng.standard_normal(shape)).astype(np.float32)
        mask[rng.random(shape) < 0.2] = -np.inf
        mask[..., 0] = 0.0
    check(module, ref, q, k, v, attn_mask=mask)


def test_both_masks(rng, backend):
    module, ref = make_pair(seed=9, batch_first=True)
    q, k, v = random_inputs(rng, module, L=6, S=9)
    padding = np.array([[False] * 7 + [True] * 2, [False] * 9])
    mask = (rng.standard_normal((8, 6, 9)) + 0.5).astype(np.float32)
    check(module, ref, q, k, v, key_padding_mask=padding, attn_mask=mask)


@pytest.mark.parametrize("with_mask", [False, True])
def test_is_causal(rng, backend, with_mask):
    """is_causal applies the causal mask itself (the reference: torch with the explicit
    mask), alone and with a float attn_mask."""
    module, ref = make_pair(seed=10)
    q, k, v = random_inputs(rng, module, L=8, shared="qkv")
    mask = (rng.standard_normal((8, 8))).astype(np.float32) if with_mask else None
    check(module, ref, q, k, v, is_causal=True, attn_mask=mask)


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("batch_first", [False, True])
def test_dropout(rng, backend, p, batch_first):
    """Training mode drops the weights by mha's rule with the seed; the backward drops the
    same ones (the reference: torch's module whose dropout is given that keep-mask)."""
    module, ref = make_pair(seed=11, dropout=p, batch_first=batch_first)
    assert module.training and ref.training
    q, k, v = random_inputs(rng, module, L=7, S=10)
    check(module, ref, q, k, v, dropout_seed=0x1234_5678_9ABC_DEF0)


def test_dropout_without_a_seed_uses_the_forwards_draw(rng):
    """dropout_seed=None: the forward draws a seed from Python's random; the backward
    regenerates that seed's mask, not a new draw's."""
    import random
    module, ref = make_pair(seed=12, dropout=0.3)
    q, k, v = random_inputs(rng, module, shared="qkv")
    state = random.getstate()
    try:
        random.seed(99)
        seed = random.getrandbits(64)  # what the forward draws
        random.seed(99)
        grad_out = rng.standard_normal(q.shape).astype(np.float32)
        (x,) = leaves((q,), torch.float32)
        out, _ = module(x, x, x, need_weights=False)
        random.seed(12345)  # a draw between forward and backward changes nothing
        out.backward(torch.from_numpy(grad_out))
    finally:
        random.setstate(state)
    module.zero_grad()
    (y,) = leaves((q,), torch.float32)
    module(y, y, y, need_weights=False, dropout_seed=seed)[0].backward(
        torch.from_numpy(grad_out))
    assert torch.equal(x.grad, y.grad)


def test_eval_mode_does_not_drop(rng):
    module, ref = make_pair(seed=13, dropout=0.5)
    module.eval()
    ref.eval()
    check(module, ref, *random_inputs(rng, module))


@pytest.mark.parametrize("average", [True, False])
def test_need_weights_returns_weights_without_a_gradient(rng, average):
    """need_weights=True (torch's default): the weights come from the path that computes
    them and are not differentiable; the output's gradients are the fused backward's."""
    module, ref = make_pair(seed=14, dropout=0.2)
    q, k, v = random_inputs(rng, module, L=5, S=7)
    _, errors = check(module, ref, q, k, v, need_weights=True, average_attn_weights=average,
                      dropout_seed=5)
    assert errors
    (x,) = leaves((q,), torch.float32)
    out, weights = module(x, x, x, average_attn_weights=average, dropout_seed=5)
    assert out.requires_grad and not weights.requires_grad
    assert weights.shape == ((2, 5, 5) if average else (2, 4, 5, 5))
    with torch.no_grad():  # the same weights as without autograd
        _, plain = module(x, x, x, average_attn_weights=average, dropout_seed=5)
    assert torch.equal(weights, plain)


@pytest.mark.parametrize("batch_first", [False, True])
def test_unbatched(rng, batch_first):
    module, ref = make_pair(seed=15, batch_first=batch_first)
    q, k, v = random_inputs(rng, module, L=5, S=7, batched=False)
    got, _ = check(module, ref, q, k, v)
    assert got["query"].shape == (5, 16)


def test_strided_views_get_their_gradients(rng):
    """Inputs that are views with other strides are read in place; the leaves get the
    gradients in their own layout."""
    module, ref = make_pair(seed=16, batch_first=True)
    base = torch.from_numpy(rng.standard_normal((7, 2, 32)).astype(np.float32))
    base.requires_grad_()
    x = base[:, :, ::2].transpose(0, 1)  # [2, 7, 16], sequence-first memory
    grad_out = rng.standard_normal((2, 7, 16)).astype(np.float32)
    module(x, x, x, need_weights=False)[0].backward(torch.from_numpy(grad_out))
    q = x.detach().numpy()
    _, want, tolerances = expected(module, ref, q, q, q, grad_out)
    assert base.grad.shape == base.shape and torch.all(base.grad[:, :, 1::2] == 0)
    got = base.grad[:, :, ::2].transpose(0, 1).numpy()
    assert_within(got, want["query"], tolerances["query"], "query")


def test_sum_backward_and_frozen_parameters(rng):
    """.sum().backward() (a gradient of stride 0); parameters and inputs that do not require
    grad get none, the others theirs."""
    module, ref = make_pair(seed=17)
    module.in_proj_weight.requires_grad_(False)
    module.out_proj.bias.requires_grad_(False)
    q, k, v = random_inputs(rng, module)
    tq = torch.from_numpy(q).requires_grad_()
    module(tq, torch.from_numpy(k), torch.from_numpy(v), need_weights=False)[0].sum().backward()
    assert module.in_proj_weight.grad is None and module.out_proj.bias.grad is None
    _, want, tolerances = expected(module, ref, q, k, v, np.ones(q.shape, np.float32))
    for name, x in (("query", tq), ("in_proj_bias", module.in_proj_bias),
                    ("out_proj.weight", module.out_proj.weight)):
        assert_within(x.grad.numpy(), want[name], tolerances[name], name)


def test_same_bits_for_any_thread_count(rng):
    module, _ = make_pair(seed=18, embed_dim=32, num_heads=2)
    q, k, v = random_inputs(rng, module, L=40, S=70)
    grad_out = rng.standard_normal(q.shape[:-1] + (32,)).astype(np.float32)
    runs = []
    for threads in (1, 3):
        mha.set_num_threads(threads)
        runs.append(mha_gradients(module, q, k, v, grad_out, need_weights=False)[2])
    for name, grad in runs[0].items():
        assert torch.equal(grad, runs[1][name]), name


# ---------------------------------------------------------------- the functional form

def test_functional_matches_torchs_functional(rng):
    """mha.multi_head_attention_forward with torch's arguments, separate weights and only
    in_proj_bias (out_proj_bias None: the library's is zeros, without a gradient), against
    torch's F.multi_head_attention_forward in float64; the tolerances of a module with
    those weights (and a zero out_proj.bias)."""
    e, kdim, vdim = 16, 6, 10
    module, ref = make_pair(seed=19, num_heads=2, kdim=kdim, vdim=vdim)
    with torch.no_grad():
        ref.out_proj.bias.zero_()
    names = ("q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
             "out_proj.weight")
    weights = {n: module.get_parameter(n).detach().clone().requires_grad_() for n in names}
    weights64 = {n: ref.get_parameter(n).detach().clone().requires_grad_() for n in names}
    q, k, v = random_inputs(rng, module, L=5, S=8)
    grad_out = rng.standard_normal((5, 2, e)).astype(np.float32)
    results = {}
    for function, dtype, w in ((mha.multi_head_attention_forward, torch.float32, weights),
                               (F.multi_head_attention_forward, torch.float64, weights64)):
        inputs = leaves((q, k, v), dtype)
        out, _ = function(*inputs, e, 2, None, w["in_proj_bias"], None, None, False, 0.0,
                          w["out_proj.weight"], None, training=True, need_weights=False,
                          use_separate_proj_weight=True, q_proj_weight=w["q_proj_weight"],
                          k_proj_weight=w["k_proj_weight"], v_proj_weight=w["v_proj_weight"])
        out.backward(torch.from_numpy(grad_out).to(dtype))
        results[dtype] = dict(zip(("query", "key", "value"), (x.grad for x in inputs)))
        results[dtype].update({n: w[n].grad for n in names})
    _, _, tolerances = expected(module, ref, q, k, v, grad_out)
    for name, want in results[torch.float64].items():
        got = results[torch.float32][name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        assert_within(got.numpy(), want.numpy(), tolerances[name], name)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_backward_function_equals_autograd(rng, framework):
    """multi_head_attention_backward takes the forward's own arguments (dropout_seed too)
    and gives what autograd gives: one library call, the same bits; self-attention's three
    entries are one array.  The forward on arrays without autograd: autograd's output."""
    module, _ = make_pair(seed=20, dropout=0.25)
    q, _, _ = random_inputs(rng, module)
    grad_out = rng.standard_normal(q.shape).astype(np.float32)
    (x,) = leaves((q,), torch.float32)
    args = (16, 4, module.in_proj_weight, module.in_proj_bias, None, None, False, 0.25,
            module.out_proj.weight, module.out_proj.bias)
    out, _ = mha.multi_head_attention_forward(x, x, x, *args, dropout_seed=41,
                                              need_weights=False)
    out.backward(torch.from_numpy(grad_out))
    convert = (lambda t: t.detach().numpy()) if framework == "numpy" else (lambda t: t.detach())
    plain = tuple(convert(a) if isinstance(a, torch.Tensor) else a for a in args)
    xs = convert(x)
    plain_out, _ = mha.multi_head_attention_forward(xs, xs, xs, *plain, dropout_seed=41,
                                                    need_weights=False)
    assert isinstance(plain_out, np.ndarray if framework == "numpy" else torch.Tensor)
    np.testing.assert_array_equal(np.asarray(plain_out), out.detach().numpy())
    grads = mha.multi_head_attention_backward(convert(torch.from_numpy(grad_out)), xs, xs, xs,
                                              *plain, dropout_seed=41, need_weights=False)
    assert set(grads) == {"query", "key", "value", "in_proj_weight", "in_proj_bias",
                          "out_proj_weight", "out_proj_bias"}
    assert grads["query"] is grads["key"] is grads["value"]
    kind = np.ndarray if framework == "numpy" else torch.Tensor
    assert all(isinstance(g, kind) for g in grads.values())
    np.testing.assert_array_equal(np.asarray(grads["query"]), x.grad.numpy())
    for name, parameter in (("in_proj_weight", module.in_proj_weight),
                            ("in_proj_bias", module.in_proj_bias),
                            ("out_proj_weight", module.out_proj.weight),
                            ("out_proj_bias", module.out_proj.bias)):
        np.testing.assert_array_equal(np.asarray(grads[name]), parameter.grad.numpy())


def test_sinks_and_variants_against_finite_differences():
    """torch.autograd.gradcheck of float64 -> float32 -> mha -> float64 with sinks (their
    gradient too), softcap, a window and ALiBi: the backward is the derivative of mha's own
    forward.  As test_backward.py's: eps = 1e-2 leaves a truncation error of about
    eps²/6·|f'''| (~2e-5 here) and fp32's rounding of the outputs about 2⁻²⁴·|out|/eps
    (~1e-5); atol = rtol = 1e-3 catches any wrong term (the gradients are O(0.1) to O(1))."""
    gen = torch.Generator().manual_seed(21)
    e, h = 8, 2

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_()

    x = randn(4, 2, e)
    w_in, b_in, w_out, b_out = randn(3 * e, e, scale=0.4), randn(3 * e, scale=0.1), \
        randn(e, e, scale=0.4), randn(e, scale=0.1)
    sinks = torch.tensor([0.3, -0.5], dtype=torch.float64, requires_grad=True)

    def attention(x, w_in, b_in, w_out, b_out, sinks):
        out, _ = mha.multi_head_attention_forward(
            x.float(), x.float(), x.float(), e, h, w_in.float(), b_in.float(), None, None,
            False, 0.0, w_out.float(), b_out.float(), need_weights=False, is_causal=True,
            sinks=sinks.float(), softcap=3.0, window_size=(2, 0),
            alibi_slopes=torch.tensor([0.25, 0.5]))
        return out.double()

    assert torch.autograd.gradcheck(attention, (x, w_in, b_in, w_out, b_out, sinks), eps=1e-2,
                                    atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------- training

def test_a_few_sgd_steps_train_both_modules_alike(rng):
    """Five SGD steps (lr 1, a regression loss near 1) of mha's module in float32 and of
    torch's in float64 from the same weights: the losses agree within 1e-4 relative.  The
    forward's output is within 1e-5·max(1, |out|) (the module tests' bound), which moves
    the mean squared error (|out - target| ~ 1) by about 2e-5; each step's gradients are
    within their tolerances (~1e-5 of their scale), so the weights drift by ~1e-5 of a
    step's change and the loss by ~1e-5 of its change per step (~0.05).  Measured: ~1e-7.
    A stale copy of the weights in the library (a step not seen) would repeat the first
    loss: 7 % off."""
    module, ref = make_pair(seed=22, batch_first=True)
    x = torch.from_numpy(rng.standard_normal((3, 6, 16)).astype(np.float32))
    target = torch.from_numpy(rng.standard_normal((3, 6, 16)).astype(np.float32))
    optimizers = [torch.optim.SGD(m.parameters(), lr=1.0) for m in (module, ref)]
    losses = {0: [], 1: []}
    for _ in range(5):
        for i, (m, dtype) in enumerate(((module, torch.float32), (ref, torch.float64))):
            xs = x.to(dtype)
            out, _ = m(xs, xs, xs, need_weights=False)
            loss = ((out - target.to(dtype)) ** 2).mean()
            optimizers[i].zero_grad()
            loss.backward()
            optimizers[i].step()
            losses[i].append(loss.item())
    assert losses[1][-1] < 0.85 * losses[1][0]  # it trains
    for step, (got, want) in enumerate(zip(losses[0], losses[1])):
        assert abs(got - want) <= 1e-4 * want, (step, got, want)


def test_weights_changed_in_place_or_replaced_are_used(rng):
    """The library's copy follows the parameters: an in-place change (their version), a new
    .data (their memory), load_state_dict."""
    module, _ = make_pair(seed=23)
    q, _, _ = random_inputs(rng, module)
    x = torch.from_numpy(q)

    def out():
        with torch.no_grad():
            return module(x, x, x, need_weights=False)[0]

    def fresh():
        return mha.MultiheadAttention.from_torch(module)(x, x, x, need_weights=False)[0]

    first = out()
    with torch.no_grad():
        module.in_proj_weight.mul_(0.5)
    assert not torch.equal(out(), first) and torch.equal(out(), fresh())
    module.out_proj.weight.data = torch.randn(16, 16)
    assert torch.equal(out(), fresh())
    state = {name: 2 * value for name, value in module.state_dict().items()}
    module.load_state_dict(state)
    assert torch.equal(out(), fresh())
    # Writes through .data bypass the version counter: most of a weight changed is seen
    # by the sampled elements, a few elements after reload_weights().
    for parameter in module.parameters():
        parameter.data.mul_(0.5)
    assert torch.equal(out(), fresh())
    module.out_proj.bias.data.copy_(torch.randn(16))
    assert torch.equal(out(), fresh())
    before = out()
    module.in_proj_weight.data[3, 5] += 1.0
    module.reload_weights()
    after = out()
    assert not torch.equal(after, before) and torch.equal(after, fresh())


def test_a_step_between_forward_and_backward_is_caught(rng):
    module, _ = make_pair(seed=24)
    x = torch.from_numpy(random_inputs(rng, module)[0]).requires_grad_()
    out, _ = module(x, x, x)
    with torch.no_grad():
        module.out_proj.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_copies_and_pickles(rng):
    module, _ = make_pair(seed=25)
    x = torch.from_numpy(random_inputs(rng, module)[0])
    with torch.no_grad():
        want = module(x, x, x)[0]
        for other in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
            assert isinstance(other, mha.torch.MultiheadAttention)
            assert torch.equal(other(x, x, x)[0], want)


def test_second_derivatives_are_refused(rng):
    module, _ = make_pair(seed=26)
    x = torch.from_numpy(random_inputs(rng, module)[0]).requires_grad_()
    out, _ = module(x, x, x)
    grad_out = torch.ones_like(out, requires_grad=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        torch.autograd.grad(out, x, grad_out, create_graph=True)
    # Plain grad_outputs as well (torch's once_differentiable let them through, and a
    # gradient penalty on the result added nothing).
    out, _ = module(x, x, x)
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


# ---------------------------------------------------------------- refused

def functional_arguments(rng):
    """multi_head_attention_forward's arguments for self-attention on float32 tensors (the
    weights require grad)."""
    torch.manual_seed(27)
    ref = torch.nn.MultiheadAttention(16, 4)
    x = torch.from_numpy(rng.standard_normal((5, 2, 16)).astype(np.float32))
    return {"query": x, "key": x, "value": x, "embed_dim_to_check": 16, "num_heads": 4,
            "in_proj_weight": ref.in_proj_weight, "in_proj_bias": ref.in_proj_bias,
            "bias_k": None, "bias_v": None, "add_zero_attn": False, "dropout_p": 0.0,
            "out_proj_weight": ref.out_proj.weight, "out_proj_bias": ref.out_proj.bias}


@pytest.mark.parametrize("change, error, message", [
    ({"attn_mask": torch.zeros(5, 5, requires_grad=True)}, ValueError,
     "attn_mask requires grad, but mha's module has no gradient"),
    ({"key_padding_mask": torch.zeros(2, 5, requires_grad=True)}, ValueError,
     "key_padding_mask requires grad"),
    ({"alibi_slopes": torch.ones(4, requires_grad=True)}, ValueError, "alibi_slopes requires"),
    ({"query": torch.zeros(5, 2, 16, dtype=torch.float64)}, TypeError,
     "query is float64 and in_proj_weight requires grad.*convert it"),
    ({"out_proj_bias": torch.zeros(16, dtype=torch.float64, requires_grad=True)}, TypeError,
     "out_proj_bias is float64 and in_proj_weight requires grad.*convert it"),
    ({"query": np.zeros((5, 2, 16), np.float32)}, TypeError,
     "query must be a torch tensor when in_proj_weight requires grad"),
    ({"in_proj_weight": torch.zeros(48, 8)}, ValueError,
     r"in_proj_weight has shape \[48, 8\]; it must be \[3E, E\]"),
    ({"out_proj_weight": None}, ValueError, "out_proj_weight is None"),
    ({"in_proj_weight": None}, ValueError,
     "use_separate_proj_weight is False but in_proj_weight is None"),
    ({"use_separate_proj_weight": True}, ValueError,
     "use_separate_proj_weight is True but q_proj_weight is None"),
    ({"use_separate_proj_weight": True, "q_proj_weight": torch.zeros(16, 16),
      "k_proj_weight": torch.zeros(16, 8), "v_proj_weight": torch.zeros(16, 16)}, ValueError,
     r"k_proj_weight has shape \[16, 8\]; it must be \[E, key's features\] = \[16, 16\]"),
    ({"embed_dim_to_check": 8, "num_heads": 2}, ValueError,
     "query has 16 features .* but embed_dim_to_check is 8"),
    ({"num_heads": 3}, ValueError, r"embed_dim_to_check \(16\) must be a multiple of num_heads"),
    ({"key": torch.zeros(6, 2, 16)}, ValueError, "key shape .* does not match value shape"),
    ({"bias_k": torch.zeros(1, 1, 16)}, NotImplementedError, "bias_k must be None"),
    ({"static_v": torch.zeros(8, 5, 4)}, NotImplementedError, "static_v must be None"),
    ({"add_zero_attn": True}, NotImplementedError, "add_zero_attn"),
    ({"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\)"),
    ({"training": 1}, TypeError, "training must be a bool"),
    ({"attn_mask": torch.zeros(5, 6)}, ValueError, r"attn_mask has shape \[5, 6\]"),
    ({"key_padding_mask": torch.zeros(3, 5, dtype=torch.bool)}, ValueError,
     "key_padding_mask has shape"),
    ({"attn_mask": torch.zeros(5, 5, dtype=torch.int32)}, mha.Error, "params->attn_mask"),
    ({"dropout_seed": -1}, ValueError, "dropout_seed must be in"),
    ({"sinks": torch.zeros(3)}, mha.Error, "sinks"),
])
def test_functional_refuses_bad_input_by_name(rng, change, error, message):
    arguments = functional_arguments(rng)
    arguments.update(change)
    with pytest.raises(error, match=message):
        mha.multi_head_attention_forward(**arguments)


@pytest.mark.parametrize("change, error, message", [
    ({"dropout_p": 0.1}, ValueError, "dropout_seed is required when training"),
    ({"grad_output": torch.zeros(5, 2, 8)}, ValueError, r"grad_output has shape \[5, 2, 8\]"),
    ({"grad_output": "x"}, TypeError, "grad_output must be"),
])
def test_backward_function_refuses_bad_input_by_name(rng, change, error, message):
    arguments = functional_arguments(rng)
    arguments["grad_output"] = torch.zeros(5, 2, 16)
    arguments.update(change)
    with torch.no_grad():
        with pytest.raises(error, match=message):
            mha.multi_head_attention_backward(**arguments)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"add_bias_kv": True}, NotImplementedError, "add_bias_kv"),
    ({"add_zero_attn": True}, NotImplementedError, "add_zero_attn"),
    ({"device": "meta"}, ValueError, "device must be None or the CPU"),
])
def test_module_constructor_refuses(kwargs, error, message):
    with pytest.raises(error, match=message):
        mha.torch.MultiheadAttention(16, 4, **kwargs)


def test_module_in_float64_computes_without_autograd_only(rng):
    module, ref = make_pair(seed=28)
    module.double()
    x = torch.from_numpy(random_inputs(rng, module)[0])
    with pytest.raises(TypeError, match="query is float32 and in_proj_weight requires grad|"
                                        "in_proj_weight is float64 and requires grad"):
        module(x, x, x)
    with torch.no_grad():  # the weights rounded to float32
        out, _ = module(x, x, x)
        want, _ = ref(x.double(), x.double(), x.double())
    assert (out.double() - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_from_torch_refuses_other_modules():
    with pytest.raises(TypeError, match="module must be a torch.nn.MultiheadAttention"):
        mha.torch.MultiheadAttention.from_torch(torch.nn.Linear(4, 4))
