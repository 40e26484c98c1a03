"""Backends, threads, concurrency, the version and the package's layout."""
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import mha
from conftest import assert_close, random_qkv
import reference

PACKAGE_DIR = os.path.dirname(os.path.realpath(mha.__file__))


def test_version_is_the_librarys():
    assert re.fullmatch(r"\d+\.\d+\.\d+", mha.__version__)
    assert mha.__version__ == mha.info()["version"]


def test_info_has_mha_info_json_keys():
    info = mha.info()
    assert list(info) == ["version", "cpu_features", "caches", "backends", "selected", "threads"]
    assert all(isinstance(f, str) for f in info["cpu_features"])
    assert list(info["caches"]) == ["l1d", "l2", "l3"]
    assert all(size is None or size > 0 for size in info["caches"].values())
    names = [b["name"] for b in info["backends"]]
    assert "scalar" in names
    for b in info["backends"]:
        assert list(b) == ["name", "usable", "reason", "priority", "tiles", "bf16_dot",
                           "bf16_amx"]
        assert b["usable"] == (b["reason"] == "")
        assert isinstance(b["bf16_dot"], bool)
        assert not b["bf16_dot"] or b["usable"]
        assert isinstance(b["bf16_amx"], bool)
        assert not b["bf16_amx"] or b["bf16_dot"]
        if b["usable"]:
            assert list(b["tiles"]) == ["query", "key", "decode_key", "decode_streams"]
            assert b["tiles"]["query"] > 0 and b["tiles"]["key"] > 0
            assert b["tiles"]["decode_streams"] >= 1
        else:
            assert b["tiles"] is None
    assert info["selected"] in mha.backends()
    assert info["threads"] == mha.get_num_threads() >= 1


def test_backends_are_the_usable_ones_best_first():
    usable = [b for b in mha.info()["backends"] if b["usable"]]
    by_priority = [b["name"] for b in sorted(usable, key=lambda b: -b["priority"])]
    assert mha.backends() == by_priority
    assert "scalar" in mha.backends()
    assert mha.info()["selected"] == by_priority[0]  # auto takes the best


@pytest.mark.parametrize("backend", mha.backends())
def test_every_usable_backend_per_call(rng, backend):
    q, k, v = random_qkv(rng, B=2, H=4, L=70, S=300, E=32, Hkv=2)
    mask = rng.random((70, 300)) < 0.9
    selected = mha.info()["selected"]
    out, lse = mha.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True,
                                                causal_alignment="bottom-right",
                                                enable_gqa=True, return_lse=True,
                                                backend=backend)
    ref, ref_lse, max_logit = reference.attention(q, k, v, mask=mask, is_causal=True,
                                                  alignment="bottom-right")
    assert_close(out, ref, max_logit)
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-6, atol=1e-5)
    assert mha.info()["selected"] == selected  # in force for that call only


@pytest.mark.parametrize("backend", mha.backends())
def test_set_backend(rng, backend):
    mha.set_backend(backend)
    assert mha.info()["selected"] == backend
    q, k, v = random_qkv(rng)
    out = mha.scaled_dot_product_attention(q, k, v)
    np.testing.assert_array_equal(out, mha.scaled_dot_product_attention(q, k, v,
                                                                        backend=backend))
    mha.set_backend("auto")
    assert mha.info()["selected"] == mha.backends()[0]


def test_threads_per_call_give_the_same_bits(rng):
    q, k, v = random_qkv(rng, B=2, H=4, L=200, S=700, E=64)
    one = mha.scaled_dot_product_attention(q, k, v, threads=1)
    two = mha.scaled_dot_product_attention(q, k, v, threads=2)
    np.testing.assert_array_equal(one, two)
    ref, _, max_logit = reference.attention(q, k, v)
    assert_close(one, ref, max_logit)


def test_set_num_threads():
    before = mha.get_num_threads()
    mha.set_num_threads(3)
    assert mha.get_num_threads() == 3
    q = np.ones((1, 1, 4, 8), dtype=np.float32)
    mha.scaled_dot_product_attention(q, q, q, threads=1)
    assert mha.get_num_threads() == 3  # a call's threads= does not stay
    mha.set_num_threads(0)
    assert mha.get_num_threads() == before


def child_thread_counts(results):
    """In a forked child: the thread count before and after a call with threads=2."""
    q = np.ones((1, 1, 4, 8), dtype=np.float32)
    before = mha.get_num_threads()
    mha.scaled_dot_product_attention(q, q, q, threads=2)
    results.put((before, mha.get_num_threads()))


def test_forked_child_keeps_one_thread_after_a_call_with_threads():
    """A forked child computes on one thread until it chooses a count; a call's
    threads= is not such a choice, nor is the parent's set_num_threads."""
    mha.set_num_threads(2)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=child_thread_counts, args=(results,))
    child.start()
    counts = results.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0 and counts == (1, 1)


def test_two_python_threads_call_at_once(rng):
    """The GIL is released during a call: while one thread is inside a long call,
    another runs Python and calls mha itself, and both results are right."""
    big = random_qkv(rng, B=1, H=8, L=4096, S=4096, E=64)
    small = random_qkv(rng)
    entering, done = threading.Event(), threading.Event()
    results = {}

    def long_call():
        entering.set()
        results["big"] = mha.scaled_dot_product_attention(*big)
        done.set()

    worker = threading.Thread(target=long_call)
    worker.start()
    try:
        entering.wait()
        time.sleep(0.02)  # the worker is inside its call now (0.3 s on Zen 4, more elsewhere)
        results["small"] = mha.scaled_dot_product_attention(*small)
        small_finished_first = not done.is_set()
    finally:
        worker.join()
    assert small_finished_first, "the second thread waited for the first one's call"
    ref, _, max_logit = reference.attention(*small)
    assert_close(results["small"], ref, max_logit)
    q, k, v = big
    rows = slice(4000, 4096)  # the reference over a few rows of the long call
    ref, _, max_logit = reference.attention(q[:, :, rows], k, v)
    assert_close(results["big"][:, :, rows], ref, max_logit)


def test_backend_per_call_keeps_an_unusable_environment_choice_failing():
    """MHA_BACKEND naming no backend makes every call fail; a call with backend= works
    and leaves that so (no silent fallback) until set_backend chooses one."""
    script = """
import numpy as np, mha
q = np.ones((1, 1, 4, 8), dtype=np.float32)
def fails():
    try:
        mha.scaled_dot_product_attention(q, q, q)
    except mha.Error as e:
        return e.status
print(fails(), mha.info()["selected"])
mha.scaled_dot_product_attention(q, q, q, backend="scalar")
print(fails(), mha.info()["selected"])
mha.set_backend("scalar")
print(fails(), mha.info()["selected"])
"""
    env = dict(os.environ, MHA_BACKEND="no-such-backend")
    lines = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    assert lines == ["MHA_ERR_BACKEND_UNAVAILABLE None", "MHA_ERR_BACKEND_UNAVAILABLE None",
                     "None scalar"]


def test_library_and_plugins_come_from_the_package_directory(rng):
    q, k, v = random_qkv(rng)
    mha.scaled_dot_product_attention(q, k, v)
    if os.environ.get("MHA_PLUGIN_DIR"):
        pytest.skip("MHA_PLUGIN_DIR names another plugin directory")
    with open("/proc/self/maps") as maps:
        mapped = {line.split()[-1] for line in maps if "/" in line}
    libmha = [p for p in mapped if re.search(r"/libmha\.so", p)]
    plugins = [p for p in mapped if "/libmha-backend-" in p]
    assert libmha == [os.path.join(PACKAGE_DIR, "libmha.so.0")]
    assert plugins and all(os.path.dirname(p) == PACKAGE_DIR for p in plugins)
    assert os.path.join(PACKAGE_DIR, f"libmha-backend-{mha.info()['selected']}.so") in plugins


def test_extension_finds_libmha_beside_itself():
    extension = mha._mha.__file__
    assert os.path.dirname(os.path.realpath(extension)) == PACKAGE_DIR
    dynamic = subprocess.run(["readelf", "-d", extension], capture_output=True, text=True,
                             check=True).stdout
    assert re.search(r"\(RUNPATH\)\s+Library runpath: \[\$ORIGIN\]", dynamic)
    assert "[libmha.so.0]" in dynamic
