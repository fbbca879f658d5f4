"""tdist's grouped GEMM with its heuristic tile and with every shipped tile (TDIST_GEMM_TILE) beside
torch._grouped_mm, on one GPU: how far the tile choice is from the best shipped tile, and the tiles
from torch.

    python bench/grouped_gemm_tiles.py

Shapes: per-rank MoE projections (experts, top-k, tokens, N, K, routing): the lowest rows of
bench/results/h200/moe_random_1gpu.json and the three models' at 4096 tokens. Rows as
tdist.bench_moe builds them (bench_moe._routing; tdist's rows padded per expert to 128, torch's
unpadded); median of 15 alternating rounds of CUDA events; prints torch's time and TFLOP/s and
torch's time over tdist's for each tile ("auto": the heuristic's).
"""

import os
import statistics

import tdist  # noqa: F401  (before torch: tdist's libnccl)
import torch
from tdist import bench_moe, moe

TILES = ["", "128x256x64_s4_c1", "128x224x64_s4_c1", "128x192x64_s5_c1", "128x128x64_s6_c1", "64x256x64_s5_c1",
         "64x128x64_s8_c1"]
SHAPES = [  # experts, top-k, tokens, N, K, routing
    (12, 2, 7661, 2328, 6376, "uniform"), (8, 5, 1832, 1856, 2936, "uniform"), (39, 3, 1717, 1088, 12680, "uniform"),
    (13, 2, 6242, 5136, 8088, "skewed"), (5, 3, 8775, 19488, 7048, "skewed"), (73, 7, 12883, 2128, 1448, "uniform"),
    (50, 6, 8791, 1592, 2296, "uniform"), (15, 2, 11629, 6576, 1336, "skewed"), (56, 4, 194, 560, 1080, "skewed"),
    (8, 2, 4096, 14336, 4096, "uniform"), (128, 8, 4096, 768, 2048, "uniform"), (64, 6, 4096, 2048, 704, "uniform"),
]


def median_us(events):
    return statistics.median(s.elapsed_time(e) * 1000 for s, e in events)


def problem(experts, topk, m, n, k, kind, dev, operands=False):
    """One projection's operands, as tdist.bench_moe builds them: (torch's call, tdist's call, rows of
    tdist's expert order, pairs), and with `operands` tdist's (a, w, offsets). tdist's rows are padded
    per expert to 128, torch's are not."""
    ids, _ = bench_moe._routing(torch, m, topk, experts, kind, 7)
    ref = moe.routing_reference(ids, experts, 1, 0)
    counts = torch.bincount(ids.view(-1).long(), minlength=experts)
    offs = torch.cumsum(counts, 0).to(torch.int32).to(dev)
    pairs = m * topk
    a_sorted = torch.randn((pairs, k), device=dev).to(torch.bfloat16)
    a_pad = torch.zeros((moe.capacity(m, topk, experts), k), dtype=torch.bfloat16, device=dev)
    rows = torch.tensor([r for r in range(ref["offsets"][experts]) if ref["token_of_row"][r] >= 0], device=dev)
    a_pad[rows] = a_sorted
    offsets = torch.tensor(ref["offsets"], dtype=torch.int32, device=dev)
    w = (torch.randn((experts, n, k), device=dev) * k ** -0.5).to(torch.bfloat16)
    w_t = w.transpose(1, 2)
    calls = (lambda: torch._grouped_mm(a_sorted, w_t, offs=offs), lambda: moe.grouped_gemm(a_pad, w, offsets),
             ref["offsets"][experts], pairs)
    return calls + ((a_pad, w, offsets),) if operands else calls


def time_alternating(calls, rounds=15):
    """{name: median us} of `calls` after two untimed calls each, `rounds` rounds alternating."""
    for c in calls.values():
        c()
        c()
    torch.cuda.synchronize()
    events = {name: [] for name in calls}
    for _ in range(rounds):
        for name, c in calls.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            c()
            e.record()
            events[name].append((s, e))
    torch.cuda.synchronize()
    return {name: median_us(ev) for name, ev in events.items()}


def main():
    dev = torch.device("cuda", 0)
    for experts, topk, m, n, k, kind in SHAPES:
        torch_call, tdist_call, rows, pairs = problem(experts, topk, m, n, k, kind, dev)
        calls = {"torch": torch_call}
        for tile in TILES:
            def call(tile=tile):
                if tile:
                    os.environ["TDIST_GEMM_TILE"] = tile
                else:
                    os.environ.pop("TDIST_GEMM_TILE", None)
                return tdist_call()
            calls[tile or "auto"] = call
        times = time_alternating(calls)
        os.environ.pop("TDIST_GEMM_TILE", None)
        t_torch = times["torch"]
        ratios = "  ".join(f"{name.split('x64')[0]}:{t_torch / t:.2f}" for name, t in times.items() if name != "torch")
        print(f"E{experts} k{topk} m{m} N{n} K{k} {kind} rows={rows}/{pairs} torch {t_torch:.0f} us "
              f"({2 * pairs * n * k / t_torch / 1e6:.0f} TF/s) | torch/tdist {ratios}", flush=True)


if __name__ == "__main__":
    main()
