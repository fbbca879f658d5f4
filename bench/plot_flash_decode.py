#!/usr/bin/env python3
"""Scaling plot of decode attention from the summary JSON of `python -m tdist.bench_flash_decode --json`:
time per decode step against KV length (log-log), one panel per (model, batch), tdist and the
baselines on 1 GPU and on the run's world size, with the HBM floor.

    python3 bench/plot_flash_decode.py bench/results/h200x2/flash_decode_summary.json \
        [-o flash_decode_scaling.png] [--page-size 16]

Needs only matplotlib: the plotting function is read from python/tdist/bench_flash_decode.py
without importing the tdist package (no GPU, no build).
"""

import argparse
import importlib.util
import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench_module():
    path = os.path.join(_ROOT, "python", "tdist", "bench_flash_decode.py")
    spec = importlib.util.spec_from_file_location("tdist_bench_flash_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="summary JSON written by tdist.bench_flash_decode --json")
    p.add_argument("-o", "--out", default=None, help="image file (default: the JSON's name with .png)")
    p.add_argument("--page-size", type=int, default=None, help="page size plotted (default: the smallest)")
    args = p.parse_args(argv)
    with open(args.json) as f:
        doc = json.load(f)
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not rows:
        p.error(f"{args.json}: expected a summary of tdist.bench_flash_decode (an object with 'rows')")
    sizes = sorted({r["page_size"] for r in rows})
    if args.page_size is not None and args.page_size not in sizes:
        p.error(f"--page-size {args.page_size}: not in {args.json} (page sizes {sizes})")
    out = args.out or os.path.splitext(args.json)[0] + ".png"
    title = None
    if doc.get("gpu"):
        ps = args.page_size if args.page_size is not None else sizes[0]
        title = (f"decode attention on {doc['gpu']}, bf16, head dim {doc.get('head_dim', 128)}, page size {ps}; "
                 f"baseline {doc.get('baseline', '?')}")
    _bench_module().plot_summary(rows, out, page_size=args.page_size, title=title)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
