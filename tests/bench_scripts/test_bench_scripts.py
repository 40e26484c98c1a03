#!/usr/bin/env python3
"""Tests of scripts/bench.sh's two readers of mha_bench's JSON: the table
(bench/print_table.py) and the picture (bench/plot_bench.py).

    test_bench_scripts.py BENCH_DIR table|plot

A made-up run with known counters goes through them: the table must show each
percentage where it belongs, the picture must pick the same percentages (of
the read bandwidth for decode shapes, of the peak otherwise, none for S5) and
write a PNG.  `plot` exits 77 (skipped) when matplotlib is missing.
"""

import contextlib
import io
import json
import os
import re
import sys
import tempfile


def entry(name, **counters):
    return dict(name=name + "/real_time", run_name=name + "/real_time", run_type="iteration",
                real_time=1.0, cpu_time=1.0, time_unit="ms", iterations=1, **counters)


RUN = {
    "context": {"date": "2026-11-24T00:00:00", "num_cpus": 2, "mha_version": "0.1.0",
                "mha_cpu": "AMD EPYC (family 26, model 2)"},
    "benchmarks": [
        entry("peak/fma/avx512/threads:1", GFLOPS=100.0),
        entry("peak/fma/avx512/threads:2", GFLOPS=200.0),
        entry("peak/read_bw/threads:1/iterations:8", GBps=20.0),
        entry("peak/read_bw/threads:2/iterations:8", GBps=30.0),
        entry("attention/avx512/S1/threads:1", GFLOPS=81.0, pct_peak=81.0),
        entry("attention/avx512/S1/threads:2", GFLOPS=158.0, pct_peak=79.0),
        entry("attention/avx512/S3/threads:1", GBps=14.0, GFLOPS=7.0, pct_bw=70.0, pct_peak=7.0),
        entry("attention/avx512/S3/threads:2", GBps=27.0, GFLOPS=13.5, pct_bw=90.0, pct_peak=6.75),
        entry("attention/avx512/S5/threads:1", us_per_call=1.5, GFLOPS=1.0, pct_peak=1.0),
        entry("blis_unfused/S1/threads:1", GFLOPS=45.0, pct_peak=45.0),
        entry("module/avx512/S1/threads:1", GFLOPS=85.0, pct_peak=85.0, parts_pct=86.5,
              blis_pct=88.25, attention_share=0.25),
        # bf16 products: pct_peak against their own peak (bf16_peak 1).
        entry("module/avx512/S1:bf16act/threads:1", GFLOPS=170.0, pct_peak=42.5, bf16_peak=1,
              parts_pct=90.0, blis_pct=88.25, attention_share=0.3),
    ],
}


def check(condition, message):
    if not condition:
        print("FAIL: " + message)
        sys.exit(1)


def main():
    bench_dir, part = sys.argv[1], sys.argv[2]
    sys.path.insert(0, bench_dir)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(RUN, f)
        if part == "table":
            import print_table
            sys.argv = ["print_table.py", path]
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                check(print_table.main() == 0, "print_table.main() failed")
            text = out.getvalue()
            row = next((line for line in text.splitlines()
                        if "| avx512 " in line and "| S3 " in line and "| 2 " in line), "")
            check("90.0 % bw" in row and "27.0" in row, "S3 at 2 threads: " + repr(row))
            row = next((line for line in text.splitlines()
                        if "| avx512 " in line and "| S1 " in line and "| 1 " in line), "")
            check("81.0 %" in row and "x1.80" in row, "S1 at 1 thread against BLIS: " + repr(row))
            check("x1.95" in text, "S1's scaling from 1 to 2 threads")
            check("CPU: AMD EPYC (family 26, model 2)" in text, "the CPU the figures come from")
            row = next((line for line in text.splitlines()
                        if "| avx512 " in line and "| S1 " in line
                        and re.search(r"GFLOP/s \|\s+85\.0 %", line)), "")
            check("86.5 %" in row and "88.2 %" in row and "25.0 %" in row,
                  "the module's row: " + repr(row))
            row = next((line for line in text.splitlines() if "| S1:bf16act " in line), "")
            check("42.5 % (bf16)" in row and "90.0 %" in row and "(bf16)" not in row.split("42.5")[0],
                  "the module's bf16 row, against the bf16 products' peak: " + repr(row))
        elif part == "plot":
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                print("skipped: matplotlib is not installed (scripts/install-deps.sh plot)")
                sys.exit(77)
            import plot_bench
            _, runs, _ = plot_bench.load(path)
            values, impls = plot_bench.percentages(runs)
            check(impls == ["avx512", "blis_unfused"], "implementations: " + repr(impls))
            check(values[2][("avx512", "S3")] == 90.0, "S3 is a percentage of the bandwidth")
            check(values[1][("avx512", "S1")] == 81.0, "S1 is a percentage of the peak")
            check(("avx512", "S5") not in values[1], "S5 (microseconds per call) is left out")
            check(values[1][("avx512", "module S1")] == 85.0, "the module's S1")
            png = os.path.join(tmp, "bench.png")
            sys.argv = ["plot_bench.py", path, png]
            with contextlib.redirect_stdout(io.StringIO()):
                check(plot_bench.main() == 0, "plot_bench.main() failed")
            with open(png, "rb") as f:
                check(f.read(8) == b"\x89PNG\r\n\x1a\n", "the picture is not a PNG")
        else:
            check(False, "unknown part " + part)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
