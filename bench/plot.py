#!/usr/bin/env python3
"""Plots benchmark JSON. tdist-bench (collectives): bus bandwidth and latency against size, tdist
beside NCCL, one row per op. bench_gemm_overlap: time of each overlapped GEMM layer (tdist's
automatic method) beside the GEMM alone and the NCCL + cuBLAS baseline, one panel per op.

    python3 bench/plot.py results.json [-o results.png]
"""
import argparse
import json
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def human(n):
    for unit in ("B", "K", "M", "G"):
        if n < 1024:
            return f"{n:g}{unit}"
        n /= 1024
    return f"{n:g}T"


def plot_gemm_overlap(data, out):
    """Grouped bars per shape: tdist (auto, with the method it ran), GEMM alone, baseline."""
    rows = [r for r in data["rows"] if r["method"] == "auto"]
    ops = [op for op in ("ag_gemm", "gemm_rs", "gemm_ar") if any(r["op"] == op for r in rows)]
    fig, axes = plt.subplots(len(ops), 1, figsize=(12, 3.6 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        sel = [r for r in rows if r["op"] == op]
        labels = [f"M={r['m']}\nN={r['n']} K={r['k']}" for r in sel]
        x = range(len(sel))
        width = 0.27
        series = (("tdist", "tdist_us", "tab:blue"), ("GEMM alone (tdist)", "gemm_us", "tab:gray"),
                  ("NCCL + cuBLAS", "baseline_us", "tab:red"))
        for j, (name, key, color) in enumerate(series):
            ax.bar([i + (j - 1) * width for i in x], [r[key] for r in sel], width, label=name, color=color)
        for i, r in enumerate(sel):
            ax.annotate(f"{r['ratio_baseline']:.2f}x\n{r['resolved']}", (i - width, r["tdist_us"]),
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("us per call (per-rank N, K)")
        ax.set_title(f"{op}, {data['ranks']} x {data['gpu']}, {data['dtype']} (label: tdist / baseline time)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("json")
    ap.add_argument("-o", "--output", help="PNG path (default: the JSON path with .png)")
    args = ap.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    out = args.output or args.json.rsplit(".", 1)[0] + ".png"
    if data.get("bench") == "gemm_overlap":
        plot_gemm_overlap(data, out)
        return

    by_op = defaultdict(lambda: defaultdict(list))  # op -> method -> rows
    nccl = defaultdict(dict)  # op -> bytes -> (us, busbw)
    for r in data["rows"]:
        by_op[r["op"]][r["method"]].append(r)
        nccl[r["op"]][r["bytes"]] = (r["nccl_us"], r["nccl_busbw_gbps"])
    ops = sorted(by_op)
    fig, axes = plt.subplots(len(ops), 2, figsize=(13, 4 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        ax_bw, ax_lat = axes[i]
        sizes = sorted(nccl[op])
        ax_bw.plot(sizes, [nccl[op][s][1] for s in sizes], "k--o", label="NCCL", markersize=3)
        ax_lat.plot(sizes, [nccl[op][s][0] for s in sizes], "k--o", label="NCCL", markersize=3)
        for method, rows in sorted(by_op[op].items()):
            rows = sorted(rows, key=lambda r: r["bytes"])
            xs = [r["bytes"] for r in rows]
            ax_bw.plot(xs, [r["tdist_busbw_gbps"] for r in rows], "-o", label=f"tdist {method}", markersize=3)
            ax_lat.plot(xs, [r["tdist_us"] for r in rows], "-o", label=f"tdist {method}", markersize=3)
        for ax, ylabel in ((ax_bw, "bus bandwidth (GB/s)"), (ax_lat, "time per op (us)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes)
            ax.set_xticklabels([human(s) for s in sizes], rotation=60, fontsize=7)
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        ax_lat.set_yscale("log")
        ax_bw.set_title(f"{op}: bus bandwidth")
        ax_lat.set_title(f"{op}: latency")
    fig.suptitle(f"{data.get('gpu', '?')} x {data.get('world_size', '?')}, {data.get('dtype', '')}, "
                 f"tdist {data.get('buffers', '')} buffers")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
