"""Gradients of mha.varlen_attention (FlashAttention-2's flash_attn_varlen_func is
differentiable): each packed sequence against test_backward.py's float64 reference run on it
alone, with its own lengths, ALiBi row and dropout seed (dropout_seed + b); rows no query
reads get zeros; the sinks' gradient is the sequences' sum; the same bits for any thread
count; bad input refused by name."""
import numpy as np
import pytest

import mha
from test_backward import reference_gradients

torch = pytest.importorskip("torch")


@pytest.fixture(params=mha.backends())
def backend(request):
    return request.param


def cumulative(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed(rng, lens_q, lens_k, H=4, Hkv=2, D=16, Dv=None):
    Dv = D if Dv is None else Dv
    q = rng.standard_normal((sum(lens_q), H, D)).astype(np.float32)
    k = rng.standard_normal((sum(lens_k), Hkv, D)).astype(np.float32)
    v = rng.standard_normal((sum(lens_k), Hkv, Dv)).astype(np.float32)
    return q, k, v


def unpacked(x, start, stop):
    """Rows start..stop-1 of a packed [total, H, D] array as [1, H, L, D]."""
    return np.ascontiguousarray(x[start:stop].transpose(1, 0, 2)[None])


def check(rng, backend, lens_q, lens_k, *, H=4, Hkv=2, D=16, Dv=None, seqused_k=None,
          sinks=None, alibi_slopes=None, dropout_p=0.0, dropout_seed=None, causal=False,
          causal_alignment="bottom-right", threads=None, **options):
    """mha's gradients of a packed batch under autograd against the reference, sequence by
    sequence; returns them."""
    q, k, v = packed(rng, lens_q, lens_k, H, Hkv, D, Dv)
    cu_q, cu_k = cumulative(lens_q), cumulative(lens_k)
    leaves = {name: torch.from_numpy(x).requires_grad_() for name, x in
              (("q", q), ("k", k), ("v", v))}
    if sinks is not None:
        leaves["sinks"] = torch.from_numpy(sinks).requires_grad_()
    out = mha.varlen_attention(leaves["q"], leaves["k"], leaves["v"], cu_q, cu_k,
                               dropout_p=dropout_p, causal=causal, alibi_slopes=alibi_slopes,
                               sinks=leaves.get("sinks"), causal_alignment=causal_alignment,
                               seqused_k=seqused_k, dropout_seed=dropout_seed, backend=backend,
                               threads=threads, **options)
    assert out.requires_grad
    grad_out = rng.standard_normal(tuple(out.shape)).astype(np.float32)
    out.backward(torch.from_numpy(grad_out))

    got = {name: x.grad.numpy().astype(np.float64) for name, x in leaves.items()}
    want = {name: np.zeros_like(x) for name, x in got.items()}
    bound = {name: np.zeros_like(x) for name, x in got.items()}
    sink_bound = 0.0
    used = np.diff(cu_k) if seqused_k is None else np.asarray(seqused_k)
    window = options.pop("window_size", (-1, -1))
    for b in range(len(lens_q)):
        q0, q1, k0 = cu_q[b], cu_q[b + 1], cu_k[b]
        k1 = k0 + used[b]
        if q1 == q0 or k1 == k0:
            continue
        slopes = alibi_slopes
        if slopes is not None and slopes.ndim == 2:
            slopes = slopes[b]
        grads, tolerance = reference_gradients(
            unpacked(q, q0, q1), unpacked(k, k0, k1), unpacked(v, k0, k1),
            unpacked(grad_out, q0, q1), None, sinks, is_causal=causal,
            causal_alignment=causal_alignment, dropout_p=dropout_p,
            dropout_seed=(dropout_seed + b) % 2**64 if dropout_p > 0 else 0,
            window_size=window, alibi_slopes=slopes, **options)
        for name, rows in (("q", (q0, q1)), ("k", (k0, k1)), ("v", (k0, k1))):
            key = {"q": "query", "k": "key", "v": "value"}[name]
            want[name][rows[0]:rows[1]] = grads[key][0].transpose(1, 0, 2)
            bound[name][rows[0]:rows[1]] = tolerance[key]
        if sinks is not None:
            want["sinks"] += grads["sinks"]
            sink_bound += tolerance["sinks"]
    if sinks is not None:
        bound["sinks"][:] = sink_bound
    for name in got:
        error = np.abs(got[name] - want[name])
        worst = np.unravel_index(np.argmax(error - bound[name]), error.shape)
        assert np.all(error <= bound[name]), (
            f"{name}: |mha - ref| = {error[worst]:.3g} > {bound[name][worst]:.3g} at {worst}")
    return {name: x.grad for name, x in leaves.items()}


def test_lengths_zero_one_and_tile_edges(rng, backend):
    """Sequences without queries, without keys, of one row, around tile boundaries: rows no
    query reads get zero gradients, rows without keys too."""
    check(rng, backend, [5, 0, 1, 63, 65, 3], [7, 4, 1, 64, 66, 0], causal=True)


def test_one_long_among_short(rng, backend):
    check(rng, backend, [3, 300, 2, 1], [5, 310, 2, 9], H=4, Hkv=1, causal=True)


def test_top_left_and_no_mask(rng, backend):
    check(rng, backend, [6, 9], [9, 6], causal=True, causal_alignment="top-left")
    check(rng, backend, [6, 9], [9, 6], Dv=24)


def test_seqused_k_leaves_the_unused_rows_at_zero(rng, backend):
    grads = check(rng, backend, [4, 6], [10, 8], seqused_k=np.array([7, 8], np.int32),
                  causal=True)
    assert not grads["k"][7:10].any() and not grads["v"][7:10].any()


def test_variants_dropout_and_sinks(rng, backend):
    """Window, softcap, ALiBi per sequence, sinks (their gradient summed over the
    sequences), dropout with each sequence's seed."""
    check(rng, backend, [7, 12, 5], [9, 12, 11], causal=True, window_size=(6, 0),
          softcap=12.0, alibi_slopes=(np.array([[0.25, 0.5, 0.125, 0.0625]] * 3)
                                      * [[1], [2], [0.5]]).astype(np.float32),
          sinks=np.array([0.5, -1.0, 2.0, -np.inf], np.float32), dropout_p=0.2,
          dropout_seed=2**64 - 2)


def test_same_bits_for_any_thread_count(rng):
    runs = [check(np.random.default_rng(5), None, [40, 3, 130], [50, 8, 140], causal=True,
                  sinks=np.array([0.5, 1.0, -1.0, 0.0], np.float32), threads=t)
            for t in (1, 2, 3)]
    for other in runs[1:]:
        for name in runs[0]:
            assert torch.equal(runs[0][name], other[name]), name


def test_gradients_are_those_of_each_sequence_alone(rng):
    """A packed sequence's gradients are the bits of the same sequence given alone to
    scaled_dot_product_attention (B = 1), as mha.h defines a packed batch."""
    lens_q, lens_k = [5, 9], [7, 9]
    q, k, v = packed(rng, lens_q, lens_k)
    cu_q, cu_k = cumulative(lens_q), cumulative(lens_k)
    leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
    out = mha.varlen_attention(*leaves, cu_q, cu_k, causal=True)
    grad_out = torch.from_numpy(rng.standard_normal(tuple(out.shape)).astype(np.float32))
    out.backward(grad_out)
    for b in range(2):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        alone = [torch.from_numpy(unpacked(x, s, e)).requires_grad_()
                 for x, s, e in ((q, q0, q1), (k, k0, k1), (v, k0, k1))]
        mha.scaled_dot_product_attention(*alone, is_causal=True, enable_gqa=True,
                                         causal_alignment="bottom-right").backward(
            grad_out[q0:q1].transpose(0, 1)[None])
        for leaf, x, (s, e) in zip(leaves, alone, ((q0, q1), (k0, k1), (k0, k1))):
            assert torch.equal(leaf.grad[s:e], x.grad[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_in_their_dtype(rng, dtype):
    """Half-precision q, k, v: gradients in their dtype, the float32 sums rounded once."""
    q, k, v = (torch.from_numpy(x).to(dtype) for x in packed(rng, [6, 9], [8, 9]))
    cu_q, cu_k = cumulative([6, 9]), cumulative([8, 9])
    grad_out = torch.from_numpy(rng.standard_normal((15, 4, 16)).astype(np.float32)).to(dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = mha.varlen_attention(*leaves, cu_q, cu_k, causal=True, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    out.backward(grad_out)
    for b in range(2):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        grads = mha.scaled_dot_product_attention_backward(
            grad_out[q0:q1].transpose(0, 1)[None], q[q0:q1].transpose(0, 1)[None],
            k[k0:k1].transpose(0, 1)[None], v[k0:k1].transpose(0, 1)[None],
            out.detach()[q0:q1].transpose(0, 1)[None], lse[:, q0:q1][None], is_causal=True,
            causal_alignment="bottom-right", enable_gqa=True)
        for leaf, grad, (s, e) in zip(leaves, grads, ((q0, q1), (k0, k1), (k0, k1))):
            assert leaf.grad.dtype == dtype
            assert torch.equal(leaf.grad[s:e], grad[0].transpose(0, 1).to(dtype))


def test_the_call_writes_every_row(rng):
    """The extension's one call over the batch, on NumPy arrays: gradients allocated full of
    NaN come back all written -- zeros for the key rows past seqused_k, of a sequence without
    queries, and for the query rows of a sequence without keys -- the same bits as
    gradients allocated as zeros, and the same as autograd's."""
    lens_q, lens_k = [5, 0, 3, 4], [7, 4, 0, 6]
    used = np.array([5, 4, 0, 6], np.int32)
    q, k, v = packed(rng, lens_q, lens_k)
    cu_q, cu_k = cumulative(lens_q), cumulative(lens_k)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    out, lse = mha.varlen_attention(q, k, v, cu_q, cu_k, causal=True, seqused_k=used,
                                    sinks=sinks, return_lse=True)
    grad_out = rng.standard_normal(out.shape).astype(np.float32)

    def gradients(fill):
        grads = [np.full(x.shape, fill, np.float32) for x in (q, k, v, sinks)]
        mha._mha.attention_varlen_backward(
            grad_out, q, k, v, out, lse, *grads[:3], cu_q, cu_k, used, sinks, grads[3], None,
            2, 0.0, 0, -1, -1, 0.0, None, None, None)  # causal 2: bottom-right
        return grads

    written, zeroed = gradients(np.nan), gradients(0.0)
    for got, want in zip(written, zeroed):
        assert np.array_equal(got, want)
    dq, dk, dv, _ = written
    assert not dq[5:8].any()  # sequence 2 has no keys
    for rows in (slice(5, 7), slice(7, 11)):  # past seqused_k; sequence 1 has no queries
        assert not dk[rows].any() and not dv[rows].any()
    leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v, sinks)]
    mha.varlen_attention(*leaves[:3], cu_q, cu_k, causal=True, seqused_k=used,
                         sinks=leaves[3]).backward(torch.from_numpy(grad_out))
    for leaf, got in zip(leaves, written):
        assert np.array_equal(leaf.grad.numpy(), got)


def test_what_has_no_gradient_is_refused(rng):
    q, k, v = (torch.from_numpy(x) for x in packed(rng, [4], [4]))
    cu = cumulative([4])
    with pytest.raises(ValueError, match="out cannot be given while q requires grad"):
        mha.varlen_attention(q.requires_grad_(), k, v, cu, cu, out=torch.empty(4, 4, 16))
    slopes = torch.ones(4, requires_grad=True)
    with pytest.raises(ValueError, match="alibi_slopes requires grad"):
        mha.varlen_attention(q, k, v, cu, cu, alibi_slopes=slopes)
    cache = torch.zeros(2, 8, 2, 16)
    with pytest.raises(ValueError, match="paged KV cache"):
        mha.varlen_attention(q, cache, cache, cu, block_table=np.zeros((1, 2), np.int32),
                             seqused_k=np.array([4], np.int32))
    k8, k_scale = mha.quantize_kv(k.detach().numpy())
    v8, v_scale = mha.quantize_kv(v.detach().numpy())
    with pytest.raises(TypeError, match="k is int8 and q requires grad"):
        mha.varlen_attention(q, torch.from_numpy(k8), torch.from_numpy(v8), cu, cu,
                             k_scale=k_scale, v_scale=v_scale)
    with torch.no_grad():  # without autograd every layout works as before
        mha.varlen_attention(q, k, v, cu, cu)
