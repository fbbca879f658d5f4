"""Table of new / old time per benchmark row from bench/compare_trees.sh's output folder.

Rows are matched by their identifying fields (op, shape, method); each tree's time is the median of
its runs. The baselines measured in the same runs (cuBLAS, NCCL) are shown as new / old too: they
did not change, so their spread is the machine's noise.

  python3 bench/compare_trees.py OUT_DIR
"""

import glob
import json
import os
import statistics
import sys

KEYS = ("op", "m", "n", "k", "n_total", "k_total", "method", "dtype")
TIMES = ("tdist_us", "time_us")
BASELINES = ("cublas_us", "baseline_us", "nccl_us")


def rows(path):
    with open(path) as f:
        data = json.load(f)
    return data["rows"] if isinstance(data, dict) else data


def key(row):
    return tuple((k, row[k]) for k in KEYS if k in row)


def collect(out, bench, tree):
    by_key = {}
    for path in sorted(glob.glob(os.path.join(out, f"{bench}_{tree}_*.json"))):
        try:
            for r in rows(path):
                by_key.setdefault(key(r), []).append(r)
        except (OSError, ValueError, KeyError) as e:
            print(f"{path}: unreadable ({e})")
    return by_key


def median_of(rs, names):
    for name in names:
        values = [r[name] for r in rs if isinstance(r.get(name), (int, float))]
        if values:
            return statistics.median(values)
    return None


def main(out):
    worst = 0.0
    for bench in ("gemm", "overlap"):
        old, new = collect(out, bench, "old"), collect(out, bench, "new")
        print(f"\n{bench}: new / old (median of each tree's runs; > 1 is slower)")
        print(f"{'row':<60} {'old us':>9} {'new us':>9} {'new/old':>8} {'baseline new/old':>17}")
        for k in sorted(set(old) & set(new), key=str):
            o, n = median_of(old[k], TIMES), median_of(new[k], TIMES)
            if not o or not n:
                continue
            ob, nb = median_of(old[k], BASELINES), median_of(new[k], BASELINES)
            base = f"{nb / ob:17.3f}" if ob and nb else f"{'-':>17}"
            name = " ".join(f"{v}" for _, v in k)
            print(f"{name:<60} {o:9.1f} {n:9.1f} {n / o:8.3f} {base}")
            worst = max(worst, n / o)
    print(f"\nslowest new/old: {worst:.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
