#!/usr/bin/env python3
"""The random-shape summary: how `auto` does against the best of tdist's methods and the baseline on
sizes and shapes nobody tuned on, from the result files (schema tdist.bench/1) of

    tdistrun -n W tdist-bench --op all --sizes random:60 --seed S --method all --json coll.json
    tdistrun -n W bench_gemm_overlap --shapes random:40 --seed S \\
        --methods auto,fused,chunked,sequential,baseline --json gemm.json
    torchrun --nproc-per-node W -m tdist.bench --sizes random:60 --seed S --json py_coll.json
    torchrun --nproc-per-node W -m tdist.bench --ops ag_gemm,gemm_rs,gemm_ar --shapes random:40 --seed S \\
        --json py_gemm.json

Writes one row per measured case,
    {"op", "m", "n", "k", "bytes", "auto_us", "best_us", "best_method", "baseline_us", "gemm_us"}
plus "torch_fused_us" where torch's symmetric-memory op was timed (null where a field does not
apply; m is the whole M, n and k this rank's GEMM). What each field reads, by producer (the rows'
"impl"):
  auto_us, best_us  "tdist" rows (every producer): auto (method auto or auto:<picked>), and the
                    fastest tdist method, auto's own row included; best_method names it
  baseline_us       collectives: NCCL ("nccl"); overlapped GEMMs: the NCCL collective and cuBLAS in
                    sequence ("nccl+cublas" of bench_gemm_overlap, "nccl+mm" of tdist.bench)
  gemm_us           the cuBLAS GEMM alone on this rank's problem ("cublas" of bench_gemm_overlap,
                    "mm" of tdist.bench: torch.matmul); tdist's own GEMM ("gemm") only without one
  torch_fused_us    "symm_mem" rows of tdist.bench: torch.ops.symm_mem's fused AllGather-matmul or
                    matmul-ReduceScatter, for AllReduce the faster of its one-shot and two-shot
A case timed by several files takes each figure's best. The summary prints the goals below with the
measured value of each and draws auto / best and auto / baseline against size.

Goals:
  collectives   auto <= 1.03 x NCCL at every size; auto <= 1.05 x best for >= 95 % of sizes
  GEMMs         auto <= 1.03 x NCCL + cuBLAS at every shape (where torch's fused op was timed too,
                the faster of the two); auto <= 1.05 x best for >= 95 % of shapes;
                at M >= 2048, median auto / GEMM alone <= 1.06 (ag_gemm), 1.10 (gemm_rs)
  counts        at least 60 collective sizes and 40 shapes per overlapped op

    python3 bench/random_summary.py coll.json gemm.json --out summary.json [--plot summary.png]
        [--goals goals.txt] [--check]

--goals also writes the goal table there; --check exits 1 when a goal is missed (2 on unreadable
input).
"""
import argparse
import json
import math
import statistics
import sys
from collections import OrderedDict

SCHEMA = "tdist.bench/1"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
OVERLAPS = ("ag_gemm", "gemm_rs", "gemm_ar")
# Median of auto / GEMM alone at M >= 2048 (the overlapped ops whose goal names one).
GEMM_RATIO_GOALS = {"ag_gemm": 1.06, "gemm_rs": 1.10}
BASELINE_SLACK, BEST_SLACK, BEST_SHARE = 1.03, 1.05, 0.95
MIN_SIZES, MIN_SHAPES = 60, 40
# "impl" names of the baselines, by role, as the producers write them (tools/tdist-bench,
# bench/gemm_overlap.cu, python/tdist/bench.py). bench_gemm_overlap's "nccl" rows (its collective
# alone) are not a baseline of an overlapped GEMM.
COLLECTIVE_BASELINE = ("nccl",)
OVERLAP_BASELINE = ("nccl+cublas", "nccl+mm")
CUBLAS_ALONE = ("cublas", "mm")  # torch.matmul is cuBLAS too
TDIST_GEMM_ALONE = ("gemm",)
TORCH_FUSED = ("symm_mem",)


def _us(row):
    us = row.get("us")
    return us if isinstance(us, (int, float)) and not isinstance(us, bool) and math.isfinite(us) and us > 0 else None


def load(path):
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a result file of schema {SCHEMA}")
    return doc


def _best(rows, impls):
    times = [_us(r) for r in rows if r.get("impl") in impls and _us(r) is not None]
    return min(times) if times else None


def _method(row):
    """A tdist row's method; auto with the method it picked where the row says (auto:<method>)."""
    method = row.get("method") or ""
    resolved = row.get("resolved")
    return f"auto:{resolved}" if method == "auto" and isinstance(resolved, str) and resolved else method


def summarise(docs):
    """Summary rows of the cases of every document, in the order first seen."""
    cases = OrderedDict()
    for doc in docs:
        for r in doc.get("rows", []):
            op = r.get("op")
            if op in COLLECTIVES:
                key = (op, None, None, None, r.get("bytes"))
            elif op in OVERLAPS:
                key = (op, r.get("m"), r.get("n"), r.get("k"), None)
            else:
                continue
            cases.setdefault(key, []).append(r)
    out = []
    for (op, m, n, k, nbytes), rows in cases.items():
        tdist = [(_method(r), _us(r)) for r in rows if r.get("impl") == "tdist" and _us(r) is not None]
        auto = [us for method, us in tdist if method == "auto" or method.startswith("auto:")]
        # on a tie the method itself, not auto's row of it
        best_method, best_us = min(tdist, key=lambda t: (t[1], t[0].startswith("auto"))) if tdist else (None, None)
        collective = op in COLLECTIVES
        gemm = None if collective else _best(rows, CUBLAS_ALONE)
        if gemm is None and not collective:
            gemm = _best(rows, TDIST_GEMM_ALONE)
        row = {"op": op, "m": m, "n": n, "k": k, "bytes": nbytes,
               "auto_us": min(auto) if auto else None,
               "best_us": best_us, "best_method": best_method,
               "baseline_us": _best(rows, COLLECTIVE_BASELINE if collective else OVERLAP_BASELINE),
               "gemm_us": gemm}
        fused = _best(rows, TORCH_FUSED)
        if fused is not None:  # an extra field: baseline_us keeps its meaning
            row["torch_fused_us"] = fused
        out.append(row)
    return out


def goal_baseline_us(row):
    """What auto must stay within 3 % of: NCCL for a collective; for an overlapped GEMM the best of
    the non-tdist ways to run it, NCCL + cuBLAS or torch's fused op."""
    if row["op"] in COLLECTIVES:
        return row["baseline_us"]
    times = [t for t in (row["baseline_us"], row.get("torch_fused_us")) if t is not None]
    return min(times) if times else None


def _ratio(a, b):
    return a / b if a is not None and b is not None else None


def goals(rows):
    """(goal, measured, met) for each goal that the rows bear on."""
    result = []

    def add(text, measured, met):
        result.append((text, measured, bool(met)))

    for family, ops, what, minimum in (("collectives", COLLECTIVES, "sizes", MIN_SIZES),
                                       ("overlapped GEMMs", OVERLAPS, "shapes", MIN_SHAPES)):
        fam = [r for r in rows if r["op"] in ops]
        if not fam:
            continue
        base = [_ratio(r["auto_us"], goal_baseline_us(r)) for r in fam]
        base = [x for x in base if x is not None]
        best = [_ratio(r["auto_us"], r["best_us"]) for r in fam]
        best = [x for x in best if x is not None]
        name = "NCCL" if family == "collectives" else "NCCL + cuBLAS"
        if family != "collectives" and any(r.get("torch_fused_us") is not None for r in fam):
            name = "the best of NCCL + cuBLAS and torch's fused op"
        if base:
            worst = max(base)
            add(f"{family}: auto <= {BASELINE_SLACK:.2f} x {name} at every one of {len(base)} {what}",
                f"worst {worst:.3f}", worst <= BASELINE_SLACK)
        if best:
            share = sum(x <= BEST_SLACK for x in best) / len(best)
            add(f"{family}: auto <= {BEST_SLACK:.2f} x the best method for >= {BEST_SHARE:.0%} of {what}",
                f"{share:.1%} of {len(best)}", share >= BEST_SHARE)
        counts = {op: sum(r["op"] == op for r in fam) for op in ops if any(r["op"] == op for r in fam)}
        for op, count in counts.items():
            add(f"{op}: at least {minimum} {what}", str(count), count >= minimum)
    for op, limit in GEMM_RATIO_GOALS.items():
        ratios = [_ratio(r["auto_us"], r["gemm_us"]) for r in rows if r["op"] == op and (r["m"] or 0) >= 2048]
        ratios = [x for x in ratios if x is not None]
        if ratios:
            med = statistics.median(ratios)
            add(f"{op}: median auto / GEMM alone at M >= 2048 <= {limit:.2f} ({len(ratios)} shapes)", f"{med:.3f}",
                med <= limit)
    return result


def format_goals(results):
    """The goal table: one line per goal, met or MISSED, the goal, the measured value."""
    width = max((len(g) for g, _, _ in results), default=0)
    return "".join(f"{'met   ' if met else 'MISSED'}  {goal:<{width}}  {measured}\n" for goal, measured, met in results)


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("collectives", [r for r in rows if r["op"] in COLLECTIVES], "bytes", "size (bytes)"),
              ("overlapped GEMMs", [r for r in rows if r["op"] in OVERLAPS], "flop", "2 M N K (whole layer)")]
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, (name, fam, x_kind, x_label) in zip(axes[0], panels):
        for index, op in enumerate(sorted({r["op"] for r in fam})):
            pts = [r for r in fam if r["op"] == op]
            color = f"C{index}"  # one colour per op; the marker tells the two ratios apart
            xs = [r["bytes"] if x_kind == "bytes" else 2.0 * r["m"] * r["n"] * r["k"] for r in pts]
            for of, marker, label in ((lambda r: r["best_us"], "o", "auto / best"),
                                      (goal_baseline_us, "x", "auto / baseline")):
                ys = [_ratio(r["auto_us"], of(r)) for r in pts]
                keep = [(x, y) for x, y in zip(xs, ys) if y is not None]
                if keep:
                    ax.scatter([x for x, _ in keep], [y for _, y in keep], marker=marker, s=18, color=color,
                               label=f"{op}: {label}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(BASELINE_SLACK, color="red", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel(x_label)
        ax.set_ylabel("time ratio (lower is better)")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description="auto against the best method and the baseline, from random sweeps")
    p.add_argument("files", nargs="+", help="result files of tdist-bench, bench_gemm_overlap or python -m tdist.bench (schema tdist.bench/1)")
    p.add_argument("--out", help="write the summary rows here (JSON)")
    p.add_argument("--plot", help="draw auto / best and auto / baseline against size here (PNG; needs matplotlib)")
    p.add_argument("--goals", help="also write the goal table here (text)")
    p.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    a = p.parse_args(argv)
    try:
        docs = [load(f) for f in a.files]
    except (OSError, ValueError) as e:
        print(f"random_summary: {e}", file=sys.stderr)
        return 2
    rows = summarise(docs)
    if not rows:
        print("random_summary: no collective or overlapped-GEMM rows in the input", file=sys.stderr)
        return 2
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
            f.write("\n")
    results = goals(rows)
    table = format_goals(results)
    print(table, end="")
    if a.goals:
        with open(a.goals, "w") as f:
            f.write(table)
    if a.plot:
        head = docs[0]
        plot(rows, a.plot, f"auto on random sizes and shapes: {head.get('gpu', '?')} x {head.get('world_size', '?')}")
    return 1 if a.check and not all(met for _, _, met in results) else 0


if __name__ == "__main__":
    sys.exit(main())
