"""tdist's grouped GEMM beside torch._grouped_mm on MoE problems with K = 8 mod 16 (rows an odd multiple
of 16 bytes apart, not 32-byte aligned) and the same problems with K rounded to a multiple of 64, on
one GPU; tdist with its choice (a 2-CTA cluster multicasting B where B's rows are unaligned) and with
the cluster forced off and on (TDIST_GEMM_CLUSTER).

    python bench/grouped_gemm_alignment.py

Operands and timing as bench/grouped_gemm_tiles.py (tdist's heuristic tile). Prints the times,
TFLOP/s and torch's time over each of tdist's.
"""

import os

import tdist  # noqa: F401  (before torch: tdist's libnccl)
import torch
from grouped_gemm_tiles import problem, time_alternating

SHAPES = [  # experts, top-k, tokens, N, K, routing: K = 8 mod 16, then K (and N) rounded
    (5, 3, 8775, 19488, 7048, "skewed"), (5, 3, 8775, 19488, 7040, "skewed"),
    (12, 2, 7661, 2328, 6376, "uniform"), (12, 2, 7661, 2328, 6400, "uniform"), (12, 2, 7661, 2304, 6400, "uniform"),
    (73, 7, 12883, 2128, 1448, "uniform"), (73, 7, 12883, 2128, 1472, "uniform"),
    (73, 7, 12883, 2176, 1472, "uniform"),
]


def with_cluster(call, cluster):
    """`call` with TDIST_GEMM_CLUSTER set to `cluster` ("" leaves tdist's choice)."""
    def run():
        if cluster:
            os.environ["TDIST_GEMM_CLUSTER"] = cluster
        else:
            os.environ.pop("TDIST_GEMM_CLUSTER", None)
        return call()
    return run


def main():
    dev = torch.device("cuda", 0)
    for experts, topk, m, n, k, kind in SHAPES:
        torch_call, tdist_call, _, pairs = problem(experts, topk, m, n, k, kind, dev)
        t = time_alternating({"torch": torch_call, "tdist": with_cluster(tdist_call, ""),
                              "c1": with_cluster(tdist_call, "1"), "c2": with_cluster(tdist_call, "2")})
        os.environ.pop("TDIST_GEMM_CLUSTER", None)
        tflop = 2 * pairs * n * k / 1e12
        print(f"E{experts} N{n} K{k} (row {2 * k % 128} B past 128): torch {t['torch']:.0f} us "
              f"{tflop / t['torch'] * 1e6:.0f} TF/s, tdist {t['tdist']:.0f} us {tflop / t['tdist'] * 1e6:.0f} TF/s, "
              f"torch/tdist {t['torch'] / t['tdist']:.2f} | cluster 1: {t['c1']:.0f} us ({t['torch'] / t['c1']:.2f}), "
              f"cluster 2: {t['c2']:.0f} us ({t['torch'] / t['c2']:.2f})", flush=True)


if __name__ == "__main__":
    main()
