#!/usr/bin/env python3
"""The Python binding's overhead on S5, the d2l.ai example (bench-shapes: B = 2, H = 5,
Lq = 4, Lk = 6, D = 20, valid_lens [3, 2]), where a call costs little more than its
fixed costs.

The C call is timed by mha_bench (attention/<backend>/S5/threads:<n>, a loop of
mha_attention calls over the same problem, built from the same source); the Python call
by this script, with the same backend and thread count, on NumPy arrays and on torch
tensors, with the output allocated per call and into `out`.  A round times the C call
(mha_bench's repetitions) and then each Python call (--samples samples, each the mean of
--calls calls).  Two figures for each: the best over all rounds -- on a shared machine
the noise only ever adds time, so the fastest sample is the most repeatable measure of a
fixed cost -- and the median over the rounds of each round's median.  The overhead is the
Python figure minus the C one, best against best.
Run it from the venv the package is installed in:

    python python/bench/overhead.py --mha-bench build/native/bench/mha_bench

Without --mha-bench the C call is not timed and only the Python figures are printed.
"""
import argparse
import json
import platform
import statistics
import subprocess
import time

import numpy as np

import mha

B, H, LQ, LK, D = 2, 5, 4, 6, 20
VALID_LENS = [3, 2]


def per_call_us(call, calls, samples):
    """(best, median) over `samples` of the mean time of `calls` calls, in microseconds."""
    for _ in range(max(calls // 10, 10)):
        call()
    means = []
    for _ in range(samples):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            call()
        means.append((time.perf_counter_ns() - t0) / calls / 1e3)
    return min(means), statistics.median(means)


def python_variants():
    """(name, call) for each way of calling mha.scaled_dot_product_attention on S5."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((B, H, LQ, D)).astype(np.float32)
    k = rng.standard_normal((B, H, LK, D)).astype(np.float32)
    v = rng.standard_normal((B, H, LK, D)).astype(np.float32)
    lens = np.array(VALID_LENS, dtype=np.int32)
    out = np.empty((B, H, LQ, D), dtype=np.float32)
    sdpa = mha.scaled_dot_product_attention
    # The extension's own call, without the Python function around it (internal:
    # its arguments as mha/_attention.py passes them), to tell the two apart.
    extension = mha._mha.attention

    def extension_call(q, k, v, out, lens):
        return extension(q, k, v, out, None, lens, None, None, None, None, 0, False, 0.0, 0,
                         -1, -1, None, 0.0, None, None, None)

    variants = [
        ("numpy", lambda: sdpa(q, k, v, valid_lens=lens)),
        ("numpy, out=", lambda: sdpa(q, k, v, valid_lens=lens, out=out)),
        ("numpy, valid_lens as a list", lambda: sdpa(q, k, v, valid_lens=VALID_LENS)),
        ("numpy, the extension alone", lambda: extension_call(q, k, v, out, lens)),
    ]
    try:
        import torch
    except ImportError:
        return variants
    tq, tk, tv, tlens, tout = (torch.from_numpy(x) for x in (q, k, v, lens, out))
    variants += [
        ("torch", lambda: sdpa(tq, tk, tv, valid_lens=tlens)),
        ("torch, out=", lambda: sdpa(tq, tk, tv, valid_lens=tlens, out=tout)),
        ("torch, the extension alone", lambda: extension_call(tq, tk, tv, tout, tlens)),
    ]
    return variants


def c_call_us(mha_bench, backend, threads, repetitions):
    """(best, median) over mha_bench's repetitions of attention/<backend>/S5/threads:<threads>,
    in µs per call."""
    name = f"attention/{backend}/S5/threads:{threads}"
    result = subprocess.run(
        [mha_bench, f"--benchmark_filter=^{name}(/real_time)?$", "--benchmark_format=json",
         f"--benchmark_repetitions={repetitions}"],
        check=True, capture_output=True, text=True)
    times = [row["us_per_call"] for row in json.loads(result.stdout)["benchmarks"]
             if row.get("run_type") == "iteration"]
    if not times:
        raise SystemExit(f"{mha_bench} reported no repetition of {name}")
    return min(times), statistics.median(times)


def cpu_name():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            fields = {key.strip(): value for key, value in
                      (line.split(":", 1) for line in f if ":" in line)}
        return (f"{fields['model name'].strip()} (family {fields['cpu family'].strip()}, "
                f"model {fields['model'].strip()})")
    except (OSError, KeyError):
        return platform.processor() or "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mha-bench", help="path of mha_bench, to time the C call")
    parser.add_argument("--backend", default=None, help="default: the best usable")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=2000, help="calls per sample")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repetitions", type=int, default=10, help="mha_bench's, per round")
    args = parser.parse_args()

    backend = args.backend or mha.backends()[0]
    mha.set_backend(backend)
    mha.set_num_threads(args.threads)
    print(f"S5 on {backend}, {args.threads} thread(s); {cpu_name()}; mha {mha.__version__}")
    variants = python_variants()
    c_rounds, python_rounds = [], {name: [] for name, _ in variants}
    for _ in range(args.rounds):
        if args.mha_bench:
            c_rounds.append(c_call_us(args.mha_bench, backend, args.threads, args.repetitions))
        for name, call in variants:
            python_rounds[name].append(per_call_us(call, args.calls, args.samples))

    def summary(rounds):
        """(best of all, median of the rounds' medians)."""
        return min(r[0] for r in rounds), statistics.median(r[1] for r in rounds)

    c_us = summary(c_rounds) if c_rounds else None
    print(f"{'µs per call':36s} {'best':>8s} {'median':>8s}")
    if c_us is not None:
        print(f"{'C call (mha_bench)':36s} {c_us[0]:8.3f} {c_us[1]:8.3f}")
    for name, rounds in python_rounds.items():
        best, median = summary(rounds)
        overhead = "" if c_us is None else f"   overhead {best - c_us[0]:+7.3f} (best)"
        print(f"{'Python: ' + name:36s} {best:8.3f} {median:8.3f}{overhead}")


if __name__ == "__main__":
    main()
