"""tdist's grouped GEMM over the rows per expert, on one GPU: its choice, the 2-CTA cluster forced
off (TDIST_GEMM_CLUSTER=1) and on (=2) in pair order (tdist.moe.grouped_gemm's walk:
kernels/gemm/grouped_pair_order.cuh) and in the plain walk, beside torch._grouped_mm. Shows where
the cluster pays and what the pair order adds when experts hold one to four m-tiles.

    python bench/grouped_gemm_pair_order.py

Operands and timing as bench/grouped_gemm_tiles.py. Prints torch's time and torch's time over each
of tdist's.
"""

import os

import tdist  # noqa: F401  (before torch: tdist's libnccl)
import torch
from grouped_gemm_tiles import problem, time_alternating
from tdist import _C, moe
from tdist._tensors import raw_stream

MODELS = [  # experts, top-k, N, K: K = 8 mod 16 (B's rows not 32-byte aligned), then aligned
    (39, 3, 1088, 12680), (64, 4, 2048, 4104), (24, 2, 4096, 7176), (39, 3, 1088, 12672), (64, 4, 2048, 4096),
]
ROWS_PER_EXPERT = (60, 100, 132, 170, 220, 250, 300, 420)


def plain_walk(a, w, offsets):
    """tdist.moe.grouped_gemm without the order scratch: a clustered walk in the plain m-tile order."""
    s = moe.check_grouped_gemm_args(a, w, offsets)
    d = torch.empty((s["m"], s["n"]), dtype=w.dtype, device=w.device)
    _C.grouped_gemm(a.data_ptr(), w.data_ptr(), d.data_ptr(), offsets.data_ptr(), s["offsets_dtype"], s["m"], s["n"],
                    s["k"], s["groups"], s["dtype"], 0, w.device.index, raw_stream(w.device.index))
    return d


def with_env(call, name, value):
    def run():
        os.environ[name] = value
        try:
            return call()
        finally:
            os.environ.pop(name, None)
    return run


def main():
    dev = torch.device("cuda", 0)
    for experts, topk, n, k in MODELS:
        for rows in ROWS_PER_EXPERT:
            m = rows * experts // topk
            torch_call, tdist_call, _, pairs, (a_pad, w, offsets) = problem(experts, topk, m, n, k, "uniform", dev,
                                                                            operands=True)
            calls = {"torch": torch_call, "auto": tdist_call,
                     "c1": with_env(tdist_call, "TDIST_GEMM_CLUSTER", "1"),
                     "c2 pair order": with_env(tdist_call, "TDIST_GEMM_CLUSTER", "2"),
                     "c2 plain walk": with_env(lambda: plain_walk(a_pad, w, offsets), "TDIST_GEMM_CLUSTER", "2")}
            times = time_alternating(calls)
            t_torch = times.pop("torch")
            ratios = "  ".join(f"{name}:{t_torch / t:.2f}" for name, t in times.items())
            print(f"E{experts} k{topk} N{n} K{k} rows/expert {pairs / experts:.0f} torch {t_torch:.0f} us | "
                  f"torch/tdist {ratios}", flush=True)


if __name__ == "__main__":
    main()
