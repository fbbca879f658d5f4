#!/usr/bin/env python3
"""Plots benchmark result files: any file of schema "tdist.bench/1" (tdist-bench, bench_gemm_overlap,
bench_put_bandwidth, bench_gemm_vs_cublas, python -m tdist.bench), and the older layouts committed
under bench/results/, which are read into that schema first.

Rows indexed by size (collectives, puts): bus bandwidth and time against size, one line per
implementation and method, one row of panels per op (a bar chart when every series has one size).
Rows indexed by shape (GEMMs): time per call, grouped bars per shape, one panel per op.

    python3 bench/plot.py results.json [more.json ...] [-o out.png | --out-dir DIR]
"""
import argparse
import json
import math
import os
import sys
from collections import defaultdict

SCHEMA = "tdist.bench/1"


def human(n):
    for unit in ("B", "K", "M", "G"):
        if n < 1024:
            return f"{n:g}{unit}"
        n /= 1024
    return f"{n:g}T"


def _num(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


# --- reading: every layout into schema tdist.bench/1 ------------------------------------------------

def _from_old_tdist_bench(d):
    rows, seen = [], set()
    for r in d["rows"]:
        rows.append({"op": r["op"], "bytes": r["bytes"], "impl": "tdist", "method": r["method"],
                     "pdl": r.get("pdl"), "us": r.get("tdist_us"), "busbw_gbps": r.get("tdist_busbw_gbps")})
        if (r["op"], r["bytes"]) not in seen:
            seen.add((r["op"], r["bytes"]))
            rows.append({"op": r["op"], "bytes": r["bytes"], "impl": "nccl", "method": "nccl", "us": r.get("nccl_us"),
                         "busbw_gbps": r.get("nccl_busbw_gbps")})
    return rows


def _from_old_gemm_overlap(d):
    rows, seen = [], set()
    for r in d["rows"]:
        shape = {"op": r["op"], "m": r["m"], "n": r["n"], "k": r["k"]}
        rows.append(dict(shape, impl="tdist", method=r["method"], resolved=r.get("resolved"), us=r.get("tdist_us"),
                         max_rel_diff=r.get("max_rel_diff")))
        key = (r["op"], r["m"], r["n"], r["k"])
        if key in seen:
            continue
        seen.add(key)
        for impl, field in (("gemm", "gemm_us"), ("nccl+cublas", "baseline_us"), ("nccl", "nccl_us"),
                            ("cublas", "cublas_us")):
            if field in r:
                rows.append(dict(shape, impl=impl, method=impl, us=r[field]))
    return rows


def _from_old_put_bandwidth(d):
    rows = []
    for r in d["rows"]:
        for impl, field in (("tdist", "tdist_gbps"), ("baseline", "baseline_gbps")):
            gbps = _num(r.get(field))
            rows.append({"op": "put", "bytes": d.get("bytes", 0), "impl": impl, "method": r["method"],
                         "algbw_gbps": gbps, "us": d.get("bytes", 0) / gbps * 1e-3 if gbps else None})
    return rows


def _from_old_gemm_vs_cublas(d):
    rows, seen = [], set()
    for r in d["rows"]:
        shape = {"op": "gemm", "m": r["m"], "n": r["n"], "k": r["k"]}
        rows.append(dict(shape, impl="tdist", method=r.get("tile", ""), us=r.get("tdist_us")))
        if (r["m"], r["n"], r["k"]) not in seen:
            seen.add((r["m"], r["n"], r["k"]))
            rows.append(dict(shape, impl="cublas", method="cublas", us=r.get("cublas_us")))
    return rows


def _from_old_python(d):
    rows = []
    for r in d.get("collectives", []):
        for name, us in r["us"].items():
            impl, _, method = name.partition(" ")
            rows.append({"op": r["op"], "bytes": r["bytes"], "impl": impl, "method": method or impl, "us": us})
    for r in d.get("gemm", []):
        for name, us in r["us"].items():
            impl, _, method = name.partition(" ")
            rows.append({"op": r["op"], "m": r["m"], "n": r["n"], "k": r["k"], "impl": impl,
                         "method": method or impl, "us": us})
    return rows


# Python model-level benchmarks (bench_layers, bench_moe, bench_triton, bench_flash_decode, bench_ep
# --summary): one row per case, a time per method in fields "<method>_us" (or "method" and "ms").
_CASE_KEYS = ("op", "model", "mode", "layer", "pass", "routing", "dispatch_dtype", "hidden", "experts", "topk",
              "batch", "page_size", "world", "n", "k")
_SIZE_KEYS = ("m", "tokens", "tokens_per_rank", "kv_len")


def _is_case_rows(rows):
    r = rows[0] if rows and isinstance(rows[0], dict) else {}
    return any(k in r for k in _SIZE_KEYS) and (any(k.endswith("_us") for k in r) or ("ms" in r and "method" in r))


def _from_case_rows(rows):
    out = []
    for r in rows:
        size = next(r[k] for k in _SIZE_KEYS if k in r)
        case = " ".join(str(r[k]) for k in _CASE_KEYS if k in r and k not in ("n", "k"))
        times = {key[:-3]: us for key, us in r.items() if key.endswith("_us")}
        if "ms" in r and "method" in r:
            times[r["method"]] = r["ms"] * 1e3 if _num(r["ms"]) is not None else None
        for impl, us in times.items():
            out.append({"op": case, "m": size, "n": r.get("n", "-"), "k": r.get("k", "-"), "impl": impl,
                        "method": impl, "us": _num(us)})
    return out


def normalise(d):
    """(meta, rows) of a result file of any layout, rows in schema tdist.bench/1."""
    if isinstance(d, list):  # a summary: rows alone
        d = {"rows": d}
    if d.get("schema") == SCHEMA and not _is_case_rows(d.get("rows")):
        return d, list(d["rows"])
    meta = {k: v for k, v in d.items() if k not in ("rows", "collectives", "gemm")}
    meta.setdefault("world_size", d.get("ranks"))
    bench = d.get("bench")
    if bench == "tdist-bench":
        return meta, _from_old_tdist_bench(d)
    if bench == "gemm_overlap":
        return meta, _from_old_gemm_overlap(d)
    if bench == "put_bandwidth":
        return meta, _from_old_put_bandwidth(d)
    if "collectives" in d or "gemm" in d:
        meta["bench"] = "python"
        return meta, _from_old_python(d)
    if "rows" in d and d["rows"] and "cublas_us" in d["rows"][0]:
        meta["bench"] = "gemm_vs_cublas"
        return meta, _from_old_gemm_vs_cublas(d)
    if _is_case_rows(d.get("rows")):
        meta["bench"] = meta.get("bench") or "cases"
        return meta, _from_case_rows(d["rows"])
    raise ValueError("unknown result layout (neither schema tdist.bench/1 nor an older tdist benchmark's)")


# --- drawing ----------------------------------------------------------------------------------------

def _label(r):
    impl, method = r.get("impl", "?"), r.get("method", "")
    name = impl if not method or method == impl else f"{impl} {method}"
    if r.get("pdl") is False:
        name += " (no pdl)"
    return name


def _bandwidth(r):
    return _num(r.get("busbw_gbps")) or _num(r.get("algbw_gbps"))


def _title(meta):
    parts = [str(meta.get("bench", "")), f"{meta.get('world_size', '?')} x {meta.get('gpu', '?')}"]
    if meta.get("dtype"):
        parts.append(str(meta["dtype"]))
    if meta.get("buffers"):
        parts.append(f"tdist {meta['buffers']} buffers")
    return ", ".join(p for p in parts if p)


def plot_sizes(plt, meta, rows, out):
    by_op = defaultdict(lambda: defaultdict(list))  # op -> series -> rows
    for r in rows:
        if _num(r.get("us")) is not None or _bandwidth(r) is not None:
            by_op[r["op"]][_label(r)].append(r)
    ops = sorted(by_op)
    fig, axes = plt.subplots(len(ops), 2, figsize=(13, 4 * len(ops)), squeeze=False)
    for (ax_bw, ax_lat), op in zip(axes, ops):
        series = by_op[op]
        single = all(len({r["bytes"] for r in rs}) == 1 for rs in series.values())
        if single:  # one size: bars per series
            names = sorted(series)
            ax_bw.bar(range(len(names)), [_bandwidth(series[n][0]) or 0 for n in names], color="tab:blue")
            ax_lat.bar(range(len(names)), [_num(series[n][0].get("us")) or 0 for n in names], color="tab:gray")
            for ax in (ax_bw, ax_lat):
                ax.set_xticks(range(len(names)))
                ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
            size = human(series[names[0]][0]["bytes"])
            ax_bw.set_ylabel("bandwidth (GB/s)")
            ax_lat.set_ylabel("time (us)")
            ax_bw.set_title(f"{op} {size}: bandwidth")
            ax_lat.set_title(f"{op} {size}: time")
            continue
        sizes = sorted({r["bytes"] for rs in series.values() for r in rs})
        for name, rs in sorted(series.items()):
            rs = sorted(rs, key=lambda r: r["bytes"])
            style = "k--o" if name.startswith("nccl") else "-o"
            bw = [(r["bytes"], _bandwidth(r)) for r in rs if _bandwidth(r) is not None]
            lat = [(r["bytes"], _num(r.get("us"))) for r in rs if _num(r.get("us")) is not None]
            if bw:
                ax_bw.plot(*zip(*bw), style, label=name, markersize=3)
            if lat:
                ax_lat.plot(*zip(*lat), style, label=name, markersize=3)
        for ax, ylabel in ((ax_bw, "bus bandwidth (GB/s)"), (ax_lat, "time per op (us)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes)
            ax.set_xticklabels([human(s) for s in sizes], rotation=60, fontsize=7)
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        ax_lat.set_yscale("log")
        ax_bw.set_title(f"{op}: bus bandwidth")
        ax_lat.set_title(f"{op}: latency")
    fig.suptitle(_title(meta))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_shapes(plt, meta, rows, out):
    by_op = defaultdict(list)
    for r in rows:
        by_op[r["op"]].append(r)
    ops = sorted(by_op)
    fig, axes = plt.subplots(len(ops), 1, figsize=(12, 3.8 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        shapes = []
        for r in by_op[op]:
            key = (r["m"], r["n"], r["k"])
            if key not in shapes:
                shapes.append(key)
        names = []
        for r in by_op[op]:
            if _label(r) not in names:
                names.append(_label(r))
        width = 0.8 / max(1, len(names))
        for j, name in enumerate(names):
            t = {(r["m"], r["n"], r["k"]): _num(r.get("us")) for r in by_op[op] if _label(r) == name}
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(shapes))]
            ax.bar(xs, [t.get(s) or 0 for s in shapes], width, label=name)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([f"M={m}\nN={n} K={k}" for m, n, k in shapes], fontsize=7)
        ax.set_ylabel("us per call (per-rank N, K)")
        ax.set_title(f"{op}, {_title(meta)}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_file(path, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        meta, rows = normalise(json.load(f))
    sized = [r for r in rows if "bytes" in r]
    shaped = [r for r in rows if "bytes" not in r and "m" in r]
    if not sized and not shaped:
        raise ValueError(f"{path}: no rows to draw")
    if sized:
        plot_sizes(plt, meta, sized, out)
    if shaped:
        plot_shapes(plt, meta, shaped, out if not sized else out.rsplit(".", 1)[0] + "_gemm.png")
    print(f"wrote {out}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="result files")
    ap.add_argument("-o", "--output", help="PNG path (one input; default: the JSON path with .png)")
    ap.add_argument("--out-dir", help="write each PNG into this folder")
    args = ap.parse_args(argv)
    if args.output and len(args.json) > 1:
        ap.error("-o takes one input file; use --out-dir for several")
    failed = 0
    for path in args.json:
        base = os.path.basename(path).rsplit(".", 1)[0] + ".png"
        out = args.output or (os.path.join(args.out_dir, base) if args.out_dir else path.rsplit(".", 1)[0] + ".png")
        try:
            plot_file(path, out)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"plot.py: error: {path}: {type(e).__name__}: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
