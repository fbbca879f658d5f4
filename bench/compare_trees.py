"""Table of new / old time per benchmark row from bench/compare_trees.sh's output folder.

Rows are matched by op, shape, implementation and method; each tree's time is the median of its
runs. Both result layouts are read: schema tdist.bench/1 (one row per implementation, "us") and the
older one (one row per shape with "tdist_us", "cublas_us", ...), so a tree from before the schema
can be compared with one after it. The rows of the baselines measured in the same runs (cuBLAS,
NCCL) did not change between the trees: their spread is the machine's noise.

  python3 bench/compare_trees.py OUT_DIR
"""

import glob
import json
import os
import statistics
import sys

SHAPE = ("op", "m", "n", "k", "groups", "mean_rows")
# Older layout: per-shape time fields -> (impl, method) of schema tdist.bench/1.
OLD_FIELDS = {"gemm_us": ("gemm", "tdist::Gemm"), "baseline_us": ("nccl+cublas", "baseline"),
              "nccl_us": ("nccl", "nccl"), "cublas_us": ("cublas", "cublas"),
              "cublas_loop_us": ("cublas", "cublas_loop")}


def normalised(row, bench):
    """(key, us) pairs of one row, whatever its layout."""
    if "us" in row:
        impl, method = row.get("impl", "tdist"), row.get("method", "")
        if bench == "gemm" and impl == "tdist":
            method = "tdist"  # the tile in the method field may differ between trees
        shape = tuple(row.get(k) for k in SHAPE)
        yield shape + (impl, method), row["us"]
        return
    base = dict(row)
    base.setdefault("op", "gemm" if bench == "gemm" else None)
    shape = tuple(base.get(k) for k in SHAPE)
    yield shape + ("tdist", "tdist" if bench == "gemm" else row.get("method", "")), row.get("tdist_us")
    for field, (impl, method) in OLD_FIELDS.items():
        if field in row:
            yield shape + (impl, method), row[field]


def collect(out, bench, tree):
    by_key = {}
    for path in sorted(glob.glob(os.path.join(out, f"{bench}_{tree}_*.json"))):
        try:
            with open(path) as f:
                data = json.load(f)
            for r in data["rows"] if isinstance(data, dict) else data:
                for k, us in normalised(r, bench):
                    if isinstance(us, (int, float)) and us > 0:
                        by_key.setdefault(k, set()).add((path, us))
        except (OSError, ValueError, KeyError) as e:
            print(f"{path}: unreadable ({e})")
    return {k: statistics.median(us for _, us in v) for k, v in by_key.items()}


def main(out):
    worst = {}
    for bench in ("gemm", "overlap"):
        old, new = collect(out, bench, "old"), collect(out, bench, "new")
        print(f"\n{bench}: new / old (median of each tree's runs; > 1 is slower)")
        print(f"{'row':<72} {'old us':>9} {'new us':>9} {'new/old':>8}")
        for k in sorted(set(old) & set(new), key=str):
            name = " ".join(str(v) for v in k if v is not None)
            print(f"{name:<72} {old[k]:9.1f} {new[k]:9.1f} {new[k] / old[k]:8.3f}")
            impl = k[len(SHAPE)]
            worst[impl] = max(worst.get(impl, 0.0), new[k] / old[k])
    print("\nslowest new/old per implementation: " +
          ", ".join(f"{impl} {w:.3f}" for impl, w in sorted(worst.items())))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
