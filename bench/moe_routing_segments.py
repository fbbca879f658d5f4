"""The MoE routing's GPU time over its segment size, on one GPU: the size the model picks
(kernels/moe/routing.cuh, route_segment_size) beside fixed sizes (TDIST_MOE_ROUTE_SEGMENT), for a
few expert counts and token counts. Shows whether the model's size is near the fastest one.

    python bench/moe_routing_segments.py

tdist.moe.routing (the ops' two routing kernels, plus the compact order and a memset) on uniform
routings; each entry is the median of 5 CUDA-graph replays of 20 calls, per call.
"""

import math
import os

import tdist  # noqa: F401  (before torch: tdist's libnccl)
import torch
from tdist import bench_moe
from tdist.bench import capture_graph

from grouped_gemm_tiles import time_alternating  # this folder's

SIZES = (256, 512, 1024, 2048, 4096)
SHAPES = ((128, 8), (64, 6), (8, 2), (256, 8), (1024, 4))  # experts, top-k
TOKENS = (128, 1024, 4096, 16384, 65536)
VARIABLE = "TDIST_MOE_ROUTE_SEGMENT"


def replay_us(graphs, calls, rounds):
    """{name: median us per call} of the graphs of `calls` calls each, over `rounds` rounds that replay
    every graph once, in turn."""
    per_replay = time_alternating({name: g.replay for name, g in graphs.items()}, rounds)
    return {name: t / calls for name, t in per_replay.items()}


def graph_us(call, calls=20, replays=5):
    """Median GPU time of `call` in us, from CUDA-graph replays of `calls` calls."""
    return replay_us({"call": capture_graph(torch, call, calls)}, calls, replays)["call"]


def model_size(pairs, experts):
    """route_segment_size of routing.cuh: P / floor(sqrt(P / (8 ceil(E / 256)))) rounded up to 256."""
    s = max(1, math.isqrt(pairs // (8 * -(-experts // 256))))
    return max(256, -(-(-(-pairs // s)) // 256) * 256)


def main():
    torch.cuda.set_device(0)
    print(f"{torch.cuda.get_device_name()}; us per call of tdist.moe.routing by segment size")
    print(f"{'experts':>7} {'topk':>4} {'tokens':>6} {'pairs':>7} | " + " ".join(f"{s:>6}" for s in SIZES) +
          " |  model (size)   model / fastest")
    for experts, topk in SHAPES:
        for m in TOKENS:  # ascending: each size's first call makes the router anew, with the variable set
            ids, _ = bench_moe._routing(torch, m, topk, experts, "uniform", 1)
            ids = ids.cuda()
            times = []
            for size in SIZES:
                os.environ[VARIABLE] = str(size)
                times.append(graph_us(lambda: tdist.moe.routing(ids, experts)))
            os.environ.pop(VARIABLE)
            model = graph_us(lambda: tdist.moe.routing(ids, experts))
            pairs = m * topk
            print(f"{experts:>7} {topk:>4} {m:>6} {pairs:>7} | " + " ".join(f"{t:6.1f}" for t in times) +
                  f" | {model:6.1f} ({model_size(pairs, experts):>5})   {model / min(times):.2f}", flush=True)


if __name__ == "__main__":
    main()
