#!/usr/bin/env python3
"""The speed goals of the committed 2 x H200 results, checked from their summary files: one table,
one line per goal, met or MISSED, with the worst case measured (or "not measured" where no row bears
on it). The summaries and who writes them:

    flash_decode_summary.json   python -m tdist.bench_flash_decode --json   (decode attention)
    moe_summary.json            python -m tdist.bench_moe --json            (MoE tensor-parallel ops)
    triton_summary.json         python -m tdist.bench_triton --summary      (Triton overlap kernels)
    layers_summary.json         python -m tdist.bench_layers --summary      (tensor-parallel layers)
    random_shapes_summary.json  bench/random_summary.py --out                (any shape and size)

    bench/goals.py [--dir bench/results/h200x2] [--suffix _1gpu] [--check]

--suffix names the files NAME<suffix>.json (bench/results/h200 keeps one-GPU runs as *_1gpu.json).
--check exits 1 when a goal is missed (2 when a file cannot be read). A file may hold the rows as a
list or under "rows". Python's standard library only.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import random_summary  # noqa: E402  (bench/: the random-shape goals and the table's format)

# Decode attention (one GPU: FlashInfer / tdist and the copy-bandwidth share; two GPUs: against
# FlashInfer on one GPU and per rank + NCCL + merge).
FD_VS_BASELINE, FD_HBM_SHARE, FD_HBM_FROM = 0.95, 0.85, 32768
FD_SCALE, FD_SCALE_FROM, FD_VS_PER_RANK, FD_SHORT, FD_SHORT_LEN = 0.55, 131072, 1.3, 1.10, 4096
# MoE: the grouped GEMM against torch._grouped_mm; each op over the grouped GEMM alone and against
# the PyTorch sequence (from 4096 tokens); at 1024 tokens never slower than the sequence.
MOE_GG_VS_TORCH, MOE_OVERHEAD, MOE_SPEEDUP, MOE_LARGE_M, MOE_SMALL_M = 0.95, {"ag": 1.10, "rs": 1.12}, 1.25, 4096, 1024
MOE_OPS = {"moe_ag_group_gemm": "ag", "moe_group_gemm_rs": "rs"}
# Triton ops against the C++ ones and torch's fused ops, from 4096 rows.
TRITON_VS_CPP, TRITON_FROM_M = 1.10, 4096
# Layers (the Llama layers; MoE rows are reported beside, with no goal of their own).
LAYER_VS_NO_COMM, LAYER_VS_EAGER = 1.03, 1.10
LLAMA_LAYERS = ("decoder", "attention", "mlp")


def load_rows(path):
    with open(path) as f:
        doc = json.load(f)
    rows = doc.get("rows") if isinstance(doc, dict) else doc
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a list of rows or {{\"rows\": [...]}}")
    return rows


def _worst(pairs, larger_is_worse):
    """(value, case) of the worst of (value, case) pairs, None where there are none."""
    pairs = [p for p in pairs if p[0] is not None]
    if not pairs:
        return None
    return max(pairs, key=lambda p: p[0]) if larger_is_worse else min(pairs, key=lambda p: p[0])


def _ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


class Table:
    """The (goal, measured, met) lines, in random_summary's format."""

    def __init__(self):
        self.lines = []

    def at_least(self, goal, pairs, limit):
        self._add(goal, _worst(pairs, False), lambda v: v >= limit)

    def at_most(self, goal, pairs, limit):
        self._add(goal, _worst(pairs, True), lambda v: v <= limit)

    def _add(self, goal, worst, ok):
        if worst is None:
            self.lines.append((goal, "not measured", None))
        else:
            self.lines.append((goal, f"worst {worst[0]:.3f} ({worst[1]})", ok(worst[0])))

    def format(self):
        width = max((len(g) for g, _, _ in self.lines), default=0)
        tag = {True: "met   ", False: "MISSED", None: "-     "}
        return "".join(f"{tag[met]}  {goal:<{width}}  {measured}\n" for goal, measured, met in self.lines)


def flash_decode_goals(rows, t):
    one = [r for r in rows if r["world"] == 1]
    many = [r for r in rows if r["world"] > 1]

    def case(r):
        return f"{r['model']} batch {r['batch']} kv {r['kv_len']} page {r['page_size']} world {r['world']}"

    t.at_least(f"decode attention, one GPU: baseline / tdist >= {FD_VS_BASELINE}",
               [(_ratio(r["baseline_1gpu_us"], r["tdist_us"]), case(r)) for r in one], FD_VS_BASELINE)
    t.at_least(f"decode attention, one GPU: HBM floor / tdist >= {FD_HBM_SHARE} from {FD_HBM_FROM} tokens",
               [(_ratio(r["hbm_floor_us"], r["tdist_us"]), case(r)) for r in one if r["kv_len"] >= FD_HBM_FROM],
               FD_HBM_SHARE)
    t.at_most(f"decode attention, several GPUs: tdist / one-GPU baseline <= {FD_SCALE} from {FD_SCALE_FROM} tokens",
              [(_ratio(r["tdist_us"], r["baseline_1gpu_us"]), case(r)) for r in many if r["kv_len"] >= FD_SCALE_FROM],
              FD_SCALE)
    t.at_least(f"decode attention, several GPUs: per rank + NCCL + merge / tdist >= {FD_VS_PER_RANK}",
               [(_ratio(r["per_rank_nccl_us"], r["tdist_us"]), case(r)) for r in many], FD_VS_PER_RANK)
    t.at_most(f"decode attention, several GPUs: tdist / one-GPU baseline <= {FD_SHORT} at {FD_SHORT_LEN} tokens",
              [(_ratio(r["tdist_us"], r["baseline_1gpu_us"]), case(r)) for r in many if r["kv_len"] == FD_SHORT_LEN],
              FD_SHORT)


def moe_goals(rows, t):
    def case(r):
        return f"{r['op']} {r['model']} m {r['m']} {r['routing']}"

    t.at_least(f"MoE grouped GEMM: torch._grouped_mm / tdist >= {MOE_GG_VS_TORCH}",
               [(_ratio(r.get("torch_grouped_mm_us"), r.get("group_gemm_us")), case(r)) for r in rows],
               MOE_GG_VS_TORCH)
    for op, short in MOE_OPS.items():
        large = [r for r in rows if r["op"] == op and r["m"] >= MOE_LARGE_M]
        t.at_most(f"MoE {short}: tdist / grouped GEMM alone <= {MOE_OVERHEAD[short]} from {MOE_LARGE_M} tokens",
                  [(_ratio(r["tdist_us"], r.get("group_gemm_us")), case(r)) for r in large], MOE_OVERHEAD[short])
        t.at_least(f"MoE {short}: PyTorch sequence / tdist >= {MOE_SPEEDUP} from {MOE_LARGE_M} tokens",
                   [(_ratio(r.get("baseline_us"), r["tdist_us"]), case(r)) for r in large], MOE_SPEEDUP)
    t.at_least(f"MoE, every op: PyTorch sequence / tdist >= 1 at {MOE_SMALL_M} tokens",
               [(_ratio(r.get("baseline_us"), r["tdist_us"]), case(r)) for r in rows if r["m"] == MOE_SMALL_M], 1.0)


def triton_goals(rows, t):
    large = [r for r in rows if r["m"] >= TRITON_FROM_M]

    def case(r):
        return f"{r['op']} {r['m']} x {r['n']} x {r['k']}"

    t.at_most(f"Triton / C++ <= {TRITON_VS_CPP} from {TRITON_FROM_M} rows",
              [(_ratio(r["triton_us"], r.get("cpp_us")), case(r)) for r in large], TRITON_VS_CPP)
    t.at_most(f"Triton / torch's fused op < 1 from {TRITON_FROM_M} rows",
              [(_ratio(r["triton_us"], r.get("torch_fused_us")), case(r)) for r in large], 1.0 - 1e-9)


def layers_goals(rows, t):
    llama = [r for r in rows if r["layer"] in LLAMA_LAYERS]
    moe = [r for r in rows if r["layer"] == "moe"]

    def case(r):
        return f"{r['layer']} {r['model']} {r['tokens']} {r['pass']}"

    t.at_most(f"layers: tdist / no communication <= {LAYER_VS_NO_COMM}",
              [(_ratio(r["tdist_us"], r.get("no_comm_us")), case(r)) for r in llama], LAYER_VS_NO_COMM)
    t.at_least(f"layers: PyTorch eager TP / tdist >= {LAYER_VS_EAGER}",
               [(_ratio(r.get("torch_eager_tp_us"), r["tdist_us"]), case(r)) for r in llama], LAYER_VS_EAGER)
    t.at_most("layers: tdist / PyTorch async TP < 1",
              [(_ratio(r["tdist_us"], r.get("torch_async_tp_us")), case(r)) for r in llama], 1.0 - 1e-9)
    if moe:  # no goal of its own: shown beside (eager / tdist, the larger the better)
        t.at_least("    MoE layer (no goal): PyTorch eager TP / tdist",
                   [(_ratio(r.get("torch_eager_tp_us"), r["tdist_us"]), case(r)) for r in moe], float("-inf"))


def random_goals(rows, t):
    for goal, measured, met in random_summary.goals(rows):
        t.lines.append((f"random shapes, {goal}", measured, met))


CHECKS = (("flash_decode_summary.json", flash_decode_goals), ("moe_summary.json", moe_goals),
          ("triton_summary.json", triton_goals), ("layers_summary.json", layers_goals),
          ("random_shapes_summary.json", random_goals))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "h200x2"),
                   help="the folder of the summary files")
    p.add_argument("--suffix", default="", help="read NAME<suffix>.json for each summary NAME.json")
    p.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    a = p.parse_args(argv)
    t = Table()
    for name, check in CHECKS:
        path = os.path.join(a.dir, name.replace(".json", a.suffix + ".json"))
        if not os.path.exists(path):
            t.lines.append((f"{os.path.basename(path)}: no such file", "not measured", None))
            continue
        try:
            check(load_rows(path), t)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"goals: {path}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    print(t.format(), end="")
    return 1 if a.check and any(met is False for _, _, met in t.lines) else 0


if __name__ == "__main__":
    sys.exit(main())
