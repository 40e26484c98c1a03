#!/usr/bin/env python3
"""Draws mha_bench's results as one picture: what this CPU reaches.

    python3 bench/plot_bench.py build/release/bench.json build/release/bench.png

One row of bars per shape, one bar per implementation (every backend that ran,
and blis_unfused, the textbook method on BLIS; "module S1": the whole
nn.MultiheadAttention module on S1): the percentage of the FMA peak
of the backend's own ISA (blis_unfused: of the widest ISA's), or for the
decode shapes of the read bandwidth -- both measured in the same run.  Two
panels: 1 thread and all threads.  S5 (microseconds per call) has no
percentage and is left out.  Reads the JSON the way print_table.py does;
needs matplotlib (Debian's python3-matplotlib: scripts/install-deps.sh plot).
"""

import argparse
import re
import sys

import matplotlib

matplotlib.use("Agg")  # no display: write the file only
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from print_table import (DECODE_SHAPES, FIXED_COST_SHAPES, base_shape, load,  # noqa: E402
                         median_counter, threads_of)


def percentages(runs):
    """{threads: {(impl, shape): percent}} and the implementations in run order."""
    values, impls = {}, []
    for name, entries in runs.items():
        parts = name.split("/")
        if parts[0] == "attention" and len(parts) >= 3:
            impl, shape = parts[1], parts[2]
        elif parts[0] == "blis_unfused" and len(parts) >= 2:
            impl, shape = "blis_unfused", parts[1]
        elif parts[0] == "module" and len(parts) >= 3:  # projections and attention
            impl, shape = parts[1], "module " + parts[2]
        else:
            continue
        base = base_shape(shape)
        if base in FIXED_COST_SHAPES:
            continue
        pct = median_counter(entries, "pct_bw" if base in DECODE_SHAPES else "pct_peak")
        if pct is None:
            continue
        values.setdefault(threads_of(parts), {})[(impl, shape)] = pct
        if impl not in impls:
            impls.append(impl)
    impls.sort(key=lambda i: i == "blis_unfused")  # the baseline last, beside the backends
    return values, impls


def shape_key(shape):
    """S1 < S2 < S3 < S3b4 < S3b16 < ... < S9 < S9pad, each shape's variants after
    it; the module's shapes after them."""
    head, _, variant = shape.partition(":")
    return ([int(p) if p.isdigit() else p for p in re.split(r"(\d+)", head)], variant)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="mha_bench's JSON output")
    ap.add_argument("png", help="the picture to write")
    args = ap.parse_args()
    ctx, runs, _ = load(args.json)
    values, impls = percentages(runs)
    if not values:
        print("plot_bench: no percentages in " + args.json, file=sys.stderr)
        return 1
    panels = sorted(n for n in values if n is not None)
    panels = [panels[0], panels[-1]] if len(panels) > 1 else panels
    shapes = sorted({s for n in panels for (_, s) in values[n]}, key=shape_key, reverse=True)
    bar = 0.8 / len(impls)
    right = max([110.0] + [v + 5 for n in panels for v in values[n].values()])
    fig, axes = plt.subplots(1, len(panels), sharey=True, squeeze=False,
                             figsize=(6 * len(panels), 1.5 + 0.12 * len(shapes) * len(impls)))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, n in zip(axes[0], panels):
        for k, impl in enumerate(impls):
            ys = [y + (len(impls) - 1 - k) * bar - 0.4 + bar / 2 for y in range(len(shapes))]
            xs = [values[n].get((impl, s), 0.0) for s in shapes]
            ax.barh(ys, xs, height=bar, label=impl, color=colors[k % len(colors)],
                    hatch="//" if impl == "blis_unfused" else None)
        ax.set_title(f"{n} thread{'s' if n != 1 else ''}")
        ax.set_xlabel("% of the FMA peak (decode shapes: % of the read bandwidth)")
        ax.set_xlim(0, right)
        ax.axvline(100, color="grey", linewidth=0.5)
        ax.grid(axis="x", linewidth=0.3)
    axes[0][0].set_yticks(range(len(shapes)))
    axes[0][0].set_yticklabels(shapes)
    axes[0][0].set_ylim(-0.6, len(shapes) - 0.4)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=len(impls),
               fontsize="small")
    fig.suptitle(f"mha {ctx.get('mha_version', '')}, {ctx.get('num_cpus', '?')} CPUs "
                 f"({ctx.get('mha_cpu', 'CPU not recorded')}), {ctx.get('date', '')[:10]}:\n"
                 "each bar against the peak or the bandwidth measured in the same run",
                 fontsize="medium")
    # Room for the legend below and for the two title lines above (in inches,
    # whatever the figure's height; this matplotlib's tight_layout does not
    # count the figure's title).
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1 - 0.45 / height))
    fig.savefig(args.png, dpi=100)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
