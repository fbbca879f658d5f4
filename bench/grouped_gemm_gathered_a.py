"""The grouped GEMM with gathered A (the MoE AllGather op's, reading its tokens through the routing)
beside the same GEMM on rows loaded by TMA, with every 128-row tile forced and with the heuristic's
choice, on one GPU: what the producer's cp.async gather costs per tile width (docs/gemm.md,
"Gathered A"; kGatheredFedColumns).

    python -m torch.distributed.run --nproc-per-node 1 bench/grouped_gemm_gathered_a.py

Shapes: MoE first projections (K = hidden, N = 2 x the intermediate features per rank) of
DeepSeek-V2-Lite, Qwen3-30B-A3B and Mixtral-8x7B at TP 1, 2 or 4, and four others; uniform routing
(tdist.bench_moe's inputs). Per shape: "op", tdist.moe_ag_group_gemm at world size 1 (method
'baseline': the routing, then one grouped GEMM gathering every token); "gg", tdist.moe.grouped_gemm
on the expert-ordered rows; "routing", tdist.moe.routing alone. Each entry is the median of 7
alternating CUDA-graph replays of 8 calls, per call, in us.
"""

import os

import tdist
import torch
import torch.distributed as dist
from moe_routing_segments import replay_us  # this folder's: the same graph timer
from tdist import bench_moe
from tdist.bench import capture_graph

CALLS, ROUNDS = 8, 7

TILES = ["auto", "128x256x64_s4_c1", "128x224x64_s4_c1", "128x192x64_s5_c1", "128x128x64_s6_c1"]
SHAPES = [  # name, K (hidden), N (2 F per rank), experts, top-k, tokens
    ("dsv2lite-tp2", 2048, 1408, 64, 6, 1024), ("dsv2lite-tp2", 2048, 1408, 64, 6, 4096),
    ("dsv2lite-tp2", 2048, 1408, 64, 6, 16384), ("dsv2lite-tp1", 2048, 2816, 64, 6, 4096),
    ("qwen3-tp2", 2048, 768, 128, 8, 4096), ("qwen3-tp2", 2048, 768, 128, 8, 16384),
    ("qwen3-tp1", 2048, 1536, 128, 8, 4096), ("mixtral-tp2", 4096, 14336, 8, 2, 4096),
    ("mixtral-tp4", 4096, 7168, 8, 2, 4096), ("e16", 5120, 2560, 16, 2, 8192), ("e32", 7168, 4096, 32, 4, 2048),
    ("e40", 3072, 1024, 40, 4, 8192),
]


def main():
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    tdist.init(process_group=dist.group.WORLD, heap_size="8G")
    dev = torch.device("cuda", 0)
    print(f"{torch.cuda.get_device_name()}; us per call; op = routing + gathered-A grouped GEMM, gg = TMA-fed A")
    for si, (name, k, n, experts, topk, m) in enumerate(SHAPES):
        dims = dict(hidden=k, f=n // 2, experts=experts, topk=topk, m=m, world=1, grouped_mm=bench_moe.GROUPED_MM)
        s = bench_moe._Set(torch, tdist.moe, dims, m, "uniform", 11 + si, 1, 0)
        a_pad, _ = bench_moe._op_inputs(torch, "ag", s, dims)
        w = (torch.randn((experts, n, k), device=dev) * k ** -0.5).to(torch.bfloat16)
        graphs = {"routing": capture_graph(torch, lambda: tdist.moe.routing(s.ids, experts), CALLS)}
        for tile in TILES:
            if tile == "auto":
                os.environ.pop("TDIST_GEMM_TILE", None)
            else:
                os.environ["TDIST_GEMM_TILE"] = tile
            op = lambda: tdist.moe_ag_group_gemm(s.x_rows, s.ids, w, method="baseline")  # noqa: E731
            graphs["op " + tile] = capture_graph(torch, op, CALLS)
            graphs["gg " + tile] = capture_graph(torch, lambda: tdist.moe.grouped_gemm(a_pad, w, s.offsets), CALLS)
        os.environ.pop("TDIST_GEMM_TILE", None)
        t = replay_us(graphs, CALLS, ROUNDS)
        print(f"{name} K{k} N{n} E{experts} k{topk} M{m} rows{int(s.offsets[-1])} routing {t['routing']:.1f}")
        for kind in ("op", "gg"):
            print(f"  {kind} " + " ".join(f"{tile.split('x64')[0]}={t[kind + ' ' + tile]:.1f}" for tile in TILES),
                  flush=True)
        del graphs
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
