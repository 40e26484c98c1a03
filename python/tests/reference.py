"""An independent float64 reference for the tests: naive softmax(Q·Kᵀ·scale + mask)·V.

Written from the definitions (PyTorch's scaled_dot_product_attention, mha.h's
masks and dropout formula), sharing no code with mha.  Inputs are float64
NumPy arrays in [B, H, L, E] layout.
"""
import numpy as np

TOP_LEFT, BOTTOM_RIGHT = "top-left", "bottom-right"


def attention(q, k, v, *, mask=None, is_causal=False, alignment=TOP_LEFT, scale=None,
              valid_lens=None, dropout_p=0.0, dropout_seed=0, window=(-1, -1), sinks=None,
              softcap=0.0, alibi_slopes=None):
    """Returns (out [B, H, L, Ev], lse [B, H, L], max |logit| over the keys that take part).

    window (left, right): FlashAttention-2's, bottom-right aligned; sinks [H]:
    logits in the denominator only; softcap: c * tanh(s / c) on the scaled
    scores, then ALiBi's -slope * |i + S - L - j| (slopes [H] or [B, H]),
    then the mask."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, H, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    group = H // Hkv
    k = np.repeat(k, group, axis=1)  # query head h uses key/value head h // group
    v = np.repeat(v, group, axis=1)
    scale = 1.0 / np.sqrt(E) if scale is None else float(np.float32(scale))

    logits = np.einsum("bhle,bhse->bhls", q, k) * scale
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    if softcap > 0.0:
        c = float(np.float32(softcap))
        logits = c * np.tanh(logits / c)
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes, dtype=np.float64), (B, H))
        logits = logits - slopes[:, :, None, None] * np.abs(i + S - L - j)[None, None]
    takes_part = np.ones((B, H, L, S), dtype=bool)
    if mask is not None:
        mask = np.broadcast_to(np.asarray(mask), (B, H, L, S))
        if mask.dtype == bool:
            takes_part &= mask
        else:
            logits = logits + mask.astype(np.float64)
            takes_part &= mask != -np.inf
    left, right = window
    if left >= 0:
        takes_part &= j >= i + S - L - left
    if right >= 0:
        takes_part &= j <= i + S - L + right
    if is_causal:
        takes_part &= (j <= i) if alignment == TOP_LEFT else (j <= i + S - L)
    if valid_lens is not None:
        lens = np.asarray(valid_lens)
        lens = lens[:, None, None, None] if lens.ndim == 1 else lens[:, None, :, None]
        takes_part &= j[None, None] < lens

    logits = np.where(takes_part, logits, -np.inf)
    sink = np.full((B, H, L, 1), -np.inf)
    if sinks is not None:
        sink[:] = np.asarray(sinks, dtype=np.float64)[None, :, None, None]
    row_max = np.maximum(logits.max(axis=-1, keepdims=True), sink)
    empty = ~takes_part.any(axis=-1, keepdims=True) & (sink == -np.inf)
    row_max = np.where(empty, 0.0, row_max)
    weights = np.exp(logits - row_max)  # exp(-inf) = 0 where a key does not take part
    total = weights.sum(axis=-1, keepdims=True) + np.exp(sink - row_max)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(empty, -np.inf, np.log(total) + row_max)[..., 0]
        weights = np.where(empty, 0.0, weights / total)
    if dropout_p > 0.0:
        weights = weights * dropout_keep(dropout_seed, dropout_p, B, H, L, S) / (
            1.0 - float(np.float32(dropout_p)))
    out = np.einsum("bhls,bhse->bhle", weights, v)
    max_logit = np.abs(np.where(takes_part, logits, 0.0)).max(initial=0.0)
    return out, lse, max_logit


def _splitmix64(z):
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _fmix32(x):
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def dropout_keep(seed, p, B, H, L, S):
    """mha.h's dropout formula: 1.0 where the weight (b, h, i, j) is kept, 0.0 where dropped."""
    with np.errstate(over="ignore"):
        rows = np.arange(B * H * L, dtype=np.uint64)  # (b * H + h) * L + i
        mixed = _splitmix64(np.uint64(seed) ^ _splitmix64(rows))
        row_keys = (mixed ^ (mixed >> np.uint64(32))).astype(np.uint32)
        keys = np.arange(S, dtype=np.uint32) * np.uint32(0x9E3779B9)
        hashes = _fmix32(row_keys[:, None] + keys[None, :])
    threshold = float(np.float32(p)) * 4294967296.0
    threshold = 0xFFFFFFFF if threshold >= 4294967295.0 else int(threshold)
    return (hashes >= np.uint32(threshold)).astype(np.float64).reshape(B, H, L, S)
