"""tdist's grouped GEMM beside torch._grouped_mm on MoE problems with K = 8 mod 16 (rows an odd multiple
of 16 bytes apart, not 32-byte aligned) and the same problems with K rounded to a multiple of 64, on
one GPU.

    python bench/grouped_gemm_alignment.py

Operands and timing as bench/grouped_gemm_tiles.py (tdist's heuristic tile). Prints both times,
TFLOP/s and torch's time over tdist's.
"""

import tdist  # noqa: F401  (before torch: tdist's libnccl)
import torch
from grouped_gemm_tiles import problem, time_alternating

SHAPES = [  # experts, top-k, tokens, N, K, routing: K = 8 mod 16, then K (and N) rounded
    (5, 3, 8775, 19488, 7048, "skewed"), (5, 3, 8775, 19488, 7040, "skewed"),
    (12, 2, 7661, 2328, 6376, "uniform"), (12, 2, 7661, 2328, 6400, "uniform"), (12, 2, 7661, 2304, 6400, "uniform"),
    (73, 7, 12883, 2128, 1448, "uniform"), (73, 7, 12883, 2128, 1472, "uniform"),
    (73, 7, 12883, 2176, 1472, "uniform"),
]


def main():
    dev = torch.device("cuda", 0)
    for experts, topk, m, n, k, kind in SHAPES:
        torch_call, tdist_call, _, pairs = problem(experts, topk, m, n, k, kind, dev)
        t = time_alternating({"torch": torch_call, "tdist": tdist_call})
        tflop = 2 * pairs * n * k / 1e12
        print(f"E{experts} N{n} K{k} (row {2 * k % 128} B past 128): torch {t['torch']:.0f} us "
              f"{tflop / t['torch'] * 1e6:.0f} TF/s, tdist {t['tdist']:.0f} us {tflop / t['tdist'] * 1e6:.0f} TF/s, "
              f"torch/tdist {t['torch'] / t['tdist']:.2f}", flush=True)


if __name__ == "__main__":
    main()
