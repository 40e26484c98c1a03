#!/usr/bin/env python3
"""Prints mha_bench's results as one table.

    python3 bench/print_table.py build/release/bench.json

Reads the JSON that mha_bench writes (--benchmark_out=FILE
--benchmark_out_format=json, or --benchmark_format=json) and prints, per
implementation x shape x threads: the speed (GFLOP/s of useful work; GB/s of K
and V read for S3; microseconds per call for S5), the percentage of the
backend's ISA FMA peak (its bf16 dot-product peak where a bf16 call takes that
path; S3: of the read bandwidth), and the speed relative to blis_unfused, to
the scalar backend and -- for the dtype variants ("S1:bf16", "S3:i8kv") -- to
the fp32 shape on the same backend and threads (x2.0 = twice as fast); S9pad
(S9's packed batch padded, with valid lengths) against S9.  Then the scaling from 1 thread to all threads.  The peaks and
the bandwidth are the ones measured in the same run.  Python 3 standard library
only.
"""

import argparse
import json
import re
import statistics
import sys

# Parts Google Benchmark appends to a registered name.
GB_SUFFIX = re.compile(
    r"^(real_time|manual_time|process_time|iterations:\d+|repeats:\d+|"
    r"min_time:[\d.]+s?|min_warmup_time:[\d.]+s?)$")
DECODE_SHAPES = {"S3", "S3b4", "S3b16", "S7d", "S8", "S8dense"}  # reported in GB/s against the read bandwidth
FIXED_COST_SHAPES = {"S5"}   # reported in microseconds per call
# Shapes compared with another one in the "vs f32" column, besides the dtype and
# variant suffixes ("S1:bf16" against "S1"): the padded batch against the packed one.
COMPARED_WITH = {"S9pad": "S9"}


def base_shape(shape):
    """The shape a variant is compared with: 'S1:bf16' -> 'S1', 'S9pad' -> 'S9'."""
    return COMPARED_WITH.get(shape, shape.split(":")[0])


def base_name(name):
    return "/".join(p for p in name.split("/") if not GB_SUFFIX.match(p))


def threads_of(parts):
    for p in parts:
        if p.startswith("threads:"):
            return int(p.split(":", 1)[1])
    return None


def load(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    runs = {}      # base name -> list of benchmark entries
    errors = {}    # base name -> message
    for b in data.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration":
            continue  # aggregates: recomputed below as the median of repetitions
        name = base_name(b.get("run_name") or b["name"])
        if b.get("error_occurred"):
            errors[name] = b.get("error_message", "error")
            continue
        runs.setdefault(name, []).append(b)
    return data.get("context", {}), runs, errors


def median_counter(entries, key):
    values = [e[key] for e in entries if key in e]
    return statistics.median(values) if values else None


def fmt(x, digits=1):
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.{digits}f}"
    return f"{x:.{digits + 1}f}" if abs(x) >= 0.1 else f"{x:.3g}"


def ratio(a, b):
    if a is None or b is None or b == 0:
        return "-"
    return f"x{a / b:.2f}"


def table(header, rows, align):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]

    def line(cells):
        out = []
        for c, w, a in zip(cells, widths, align):
            out.append(str(c).rjust(w) if a == "r" else str(c).ljust(w))
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2))
                         for w, a in zip(widths, align)) + "|"
    return "\n".join([line(header), sep] + [line(r) for r in rows])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="mha_bench's JSON output")
    args = ap.parse_args()
    ctx, runs, errors = load(args.json)

    # The measured references.
    fma = {}   # "<kind>/<isa>" -> threads -> GFLOP/s
    bw = {}    # threads -> GB/s
    results = {}  # (impl, shape) -> threads -> entries
    modules = {}  # (backend, shape) -> threads -> entries: module/<backend>/<shape>
    impl_order = []
    for name, entries in runs.items():
        parts = name.split("/")
        n = threads_of(parts)
        if parts[0] == "peak" and parts[1] != "read_bw" and len(parts) >= 3:
            fma.setdefault(parts[1] + "/" + parts[2], {})[n] = median_counter(entries, "GFLOPS")
        elif parts[:2] == ["peak", "read_bw"]:
            bw[n] = median_counter(entries, "GBps")
        elif parts[0] == "attention" and len(parts) >= 3:
            impl = parts[1]
            results.setdefault((impl, parts[2]), {})[n] = entries
            if impl not in impl_order:
                impl_order.append(impl)
        elif parts[0] == "blis_unfused" and len(parts) >= 2:
            results.setdefault(("blis_unfused", parts[1]), {})[n] = entries
        elif parts[0] == "module" and len(parts) >= 3:
            modules.setdefault((parts[1], parts[2]), {})[n] = entries
    if any(k[0] == "blis_unfused" for k in results):
        impl_order.append("blis_unfused")

    # Header: where and against what.
    print("mha_bench — " + ctx.get("date", ""))
    print(f"host {ctx.get('host_name', '?')}: {ctx.get('num_cpus', '?')} CPUs at "
          f"{ctx.get('mhz_per_cpu', '?')} MHz; mha {ctx.get('mha_version', '?')}; "
          f"usable backends: {ctx.get('mha_usable_backends', '?')}")
    print(f"CPU: {ctx.get('mha_cpu', '?')}")
    print(f"CPU features: {ctx.get('mha_cpu_features', '?')}")
    print(f"BLIS kernels: {ctx.get('blis_arch', '?')}")
    print(f"BLIS threads: {ctx.get('blis_threading', '?')}")
    if ctx.get("library_build_type") == "debug":
        print("(Google Benchmark itself was built without NDEBUG, as Debian ships it: this "
              "touches only its own bookkeeping, not the timed calls)")
    all_threads = sorted({n for d in fma.values() for n in d} | set(bw))
    print()
    ref_rows = []
    for key, d in fma.items():
        label = peak_label(key)
        ref_rows.append([label] + [fmt(d.get(n)) + " GFLOP/s" if d.get(n) else "-"
                                   for n in all_threads])
    if bw:
        ref_rows.append(["read bandwidth, 1 GiB"] +
                        [fmt(bw.get(n)) + " GB/s" if bw.get(n) else "-" for n in all_threads])
    if ref_rows:
        print(table(["measured in this run"] + [f"threads:{n}" for n in all_threads], ref_rows,
                    "l" + "r" * len(all_threads)))
        print()

    # The main table.
    shapes = sorted({k[1] for k in results})
    header = ["implementation", "shape", "threads", "speed", "unit", "% of peak", "vs blis",
              "vs scalar", "vs f32"]
    rows = []

    def gflops_of(impl, shape, n):
        e = results.get((impl, shape), {}).get(n)
        return median_counter(e, "GFLOPS") if e else None

    for impl in impl_order:
        for shape in shapes:
            per_thread = results.get((impl, shape), {})
            for n in sorted(per_thread):
                e = per_thread[n]
                g = median_counter(e, "GFLOPS")
                base = base_shape(shape)
                if base in DECODE_SHAPES:
                    speed, unit = median_counter(e, "GBps"), "GB/s"
                    pct = median_counter(e, "pct_bw")
                    pct_s = (fmt(pct) + " % bw") if pct is not None else "-"
                elif base in FIXED_COST_SHAPES:
                    speed, unit = median_counter(e, "us_per_call"), "us/call"
                    pct = median_counter(e, "pct_peak")
                    pct_s = (fmt(pct) + " %") if pct is not None else "-"
                else:
                    speed, unit = g, "GFLOP/s"
                    pct = median_counter(e, "pct_peak")
                    pct_s = (fmt(pct) + " %") if pct is not None else "-"
                vs_blis = "-" if impl == "blis_unfused" else ratio(g, gflops_of("blis_unfused", base, n))
                vs_scalar = "-" if impl == "scalar" else ratio(g, gflops_of("scalar", shape, n))
                vs_f32 = "-" if base == shape else ratio(g, gflops_of(impl, base, n))
                rows.append([impl, shape, n, fmt(speed), unit, pct_s, vs_blis, vs_scalar, vs_f32])
    for name, msg in sorted(errors.items()):
        rows.append([name, "", "", "error", msg, "", "", "", ""])
    print(table(header, rows, "lllrlrrrr"))
    print()
    print("speed: GFLOP/s of useful work (causal: only the pairs that take part); S3: GB/s of K and "
          "V read; S5: microseconds per call.")
    print("% of peak: of the FMA peak of the backend's ISA at the same thread count (bf16 Q with "
          "bf16 K/V on a backend that takes its bf16 dot-product path on this CPU: of its bf16dot "
          "peak, or bf16amx on AMX tiles; mha-info says which do); "
          f"blis_unfused against the peak of {ctx.get('blis_peak_isa', 'the widest ISA')}.")
    print("vs f32: a dtype variant's speed relative to the fp32 shape -- or a variant shape's "
          "(S2:softcap, S2:alibi, S3:sinks, S1:blhd) relative to the plain one, and S9pad's (S9's batch "
          "padded to 1024 with valid lengths) relative to S9 (packed, mha_attention_varlen) --, "
          "same backend and threads (decode: tokens per second).")
    print("S9, S9pad: the same useful FLOPs (each sequence's causal pairs), so the speeds "
          "compare directly.")
    print("vs blis / vs scalar: speed relative to blis_unfused / the scalar backend, same shape and "
          "threads (x2.00 = twice as fast).")

    # The module (nn.MultiheadAttention): its speed, and what bounds it here.
    module_rows = []
    for (backend, shape), per_thread in sorted(modules.items()):
        for n in sorted(per_thread):
            e = per_thread[n]
            us = median_counter(e, "us_per_call")
            if us is not None:
                speed, unit = fmt(us, 2), "us/call"
            else:
                speed, unit = fmt(median_counter(e, "GFLOPS")), "GFLOP/s"
            cells = []
            bf16 = " (bf16)" if median_counter(e, "bf16_peak") else ""
            for key in ("pct_peak", "parts_pct", "blis_pct"):
                v = median_counter(e, key)
                cells.append((fmt(v) + " %" + (bf16 if key == "pct_peak" else ""))
                             if v is not None else "-")
            share = median_counter(e, "attention_share")
            cells.append(fmt(share * 100) + " %" if share is not None else "-")
            module_rows.append([backend, shape, n, speed, unit] + cells)
    if module_rows:
        print()
        print(table(["module", "shape", "threads", "speed", "unit", "% of peak", "parts alone",
                     "BLIS products", "attention"], module_rows, "lllrlrrrr"))
        print("module: mha_module_forward (projections with biases, attention, output "
              "projection), % of the widest ISA's FMA peak, or (bf16) of the peak of the "
              "bf16 products (vdpbf16ps or AMX tiles) where the backend runs the bf16 "
              "shapes' projections as those (parts alone and BLIS products stay against the "
              "FMA peak: BLIS's products are fp32); parts alone: its FLOPs over the "
              "time BLIS alone takes for its products (no biases) plus mha_attention alone on "
              "its views -- what the module reaches if it adds nothing of its own; BLIS "
              "products: their speed alone; attention: mha_attention alone as a share of the "
              "module's time.")

    # Scaling: all threads over 1 thread.
    scale_rows = []
    for impl in impl_order:
        for shape in shapes:
            per_thread = results.get((impl, shape), {})
            if 1 not in per_thread or len(per_thread) < 2:
                continue
            top = max(per_thread)
            one = gflops_of(impl, shape, 1)
            many = gflops_of(impl, shape, top)
            scale_rows.append([impl, shape, f"{top} / 1", ratio(many, one)])
    if scale_rows:
        print()
        print(table(["implementation", "shape", "threads", "scaling"], scale_rows, "lllr"))
    for key, d in fma.items():
        if 1 in d and len(d) > 1:
            top = max(d)
            print(f"{peak_label(key)}: threads:{top} / threads:1 = {ratio(d[top], d[1])}")
    if 1 in bw and len(bw) > 1:
        top = max(bw)
        print(f"read bandwidth: threads:{top} / threads:1 = {ratio(bw[top], bw[1])}")
    return 0


def peak_label(key):
    """'fma/avx512' -> 'FMA peak avx512'; 'bf16dot/avx512bf16' -> 'bf16 dot peak ...'; 'bf16amx/...'."""
    kind, isa = key.split("/", 1)
    if kind == "bf16dot":
        return f"bf16 dot peak {isa} (vdpbf16ps)"
    if kind == "bf16amx":
        return f"bf16 AMX peak {isa} (tdpbf16ps on AMX tiles)"
    return f"FMA peak {isa}" + (" (128-bit mul+add, baseline ISA)" if isa == "scalar" else "")


if __name__ == "__main__":
    sys.exit(main())
