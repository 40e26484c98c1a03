"""Shared helpers: random inputs, the tolerances, array conversion."""
import numpy as np
import pytest

import mha

try:
    import torch
except ImportError:  # the NumPy tests still run
    torch = None

# Unit roundoff of the half types' significands (8 and 11 bits).
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 0.0}


def to_float64(x):
    """Any NumPy array or torch tensor as a float64 NumPy array (a copy)."""
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def dtype_name(x):
    return str(x.dtype).replace("torch.", "")


def assert_close(out, ref, max_logit, *, out_dtype="float32", max_v=0.0, bf16_dot=False):
    """mha's tolerance (docs/decisions.md) against the float64 reference.

    fp32: 1e-5 · max(1, max|ref|) + 4 · 2⁻²⁴ · max|logit| (rounding the scores
    to fp32).  A half-precision output adds one rounding of each element; a
    bf16 Q·Kᵀ/P·V path (avx512bf16) adds 4 · 2⁻⁹ · max|V|.
    """
    out = to_float64(out)
    assert out.shape == ref.shape
    bound = 1e-5 * max(1.0, np.abs(ref).max(initial=0.0)) + 4 * 2.0**-24 * max_logit
    if bf16_dot:
        bound += 4 * 2.0**-9 * max_v
    bound = bound + UNIT_ROUNDOFF[out_dtype] * np.abs(ref)
    error = np.abs(out - ref)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert np.all(error <= bound), (
        f"|out - ref| = {error[worst]:.3g} > {bound[worst]:.3g} at {worst}")


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)


def random_qkv(rng, B=2, H=3, L=9, S=13, E=16, Ev=None, Hkv=None, dtype=np.float32):
    Ev = E if Ev is None else Ev
    Hkv = H if Hkv is None else Hkv
    q = rng.standard_normal((B, H, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, Ev)).astype(dtype)
    return q, k, v


@pytest.fixture(autouse=True)
def process_settings_restored():
    """Tests that change the process's backend or thread count do not leak it to others."""
    yield
    mha.set_backend("auto")
    mha.set_num_threads(0)
