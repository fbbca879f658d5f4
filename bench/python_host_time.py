"""Host time per call of tdist's Python ops beside torch.mm (and the grouped GEMM beside
torch._grouped_mm): problems small enough that the GPU is never the limit, so the time a call takes
on the host is what bounds a short layer run eagerly.

    python -m torch.distributed.run --nproc-per-node 1 bench/python_host_time.py     # any world size

Prints, per op, the host time of 300 back-to-back calls (and with the GPU drained), then the same op
through torch.ops.tdist.* (the dispatcher's path, which autograd, torch.compile and the profiler
take), then a cProfile of the Python side. A call behind ~50 ms of queued GPU work shows whether the
op ever waits on the GPU from the host (it must not).
"""

import cProfile
import io
import os
import pstats
import time

import tdist  # before torch: tdist's libnccl (>= 2.28) is then the one the process loads

import torch
import torch.distributed as dist

CALLS = 300


def host_time(fn, calls=CALLS):
    """(host us a call, us a call including the GPU's drain) of `calls` back-to-back calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return 1e6 * (t1 - t0) / calls, 1e6 * (t2 - t0) / calls


def main():
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    tdist.init(process_group=dist.group.WORLD, heap_size="2G")
    w, r = dist.get_world_size(), dist.get_rank()
    m, n, k = 512 * w, 512, 512
    bf = torch.bfloat16
    a_local = torch.randn(m // w, k, device="cuda", dtype=bf)
    a_full = torch.randn(m, k, device="cuda", dtype=bf)
    b = torch.randn(n, k, device="cuda", dtype=bf)
    x = torch.randn(1 << 16, device="cuda", dtype=bf)
    # decode attention, batch 1, 4K tokens of Llama-3-8B heads (16-token pages)
    kc = torch.randn(256, 16, 8, 128, device="cuda", dtype=bf)
    vc = torch.randn_like(kc)
    table = torch.arange(256, device="cuda", dtype=torch.int32).view(1, 256)
    lens = torch.full((1,), 4096, device="cuda", dtype=torch.int32)
    q = torch.randn(1, 32, 128, device="cuda", dtype=bf)
    # grouped GEMM: 8 groups of 64 rows (tdist's padded to 128 each; torch's unpadded)
    groups, rows = 8, 64
    align = tdist.moe.grouped_gemm_alignment()
    a_groups = torch.randn(groups * align, k, device="cuda", dtype=bf)
    w_groups = torch.randn(groups, n, k, device="cuda", dtype=bf)
    offsets = torch.arange(groups + 1, device="cuda", dtype=torch.int32) * align
    a_sorted = torch.randn(groups * rows, k, device="cuda", dtype=bf)
    offs = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * rows
    w_groups_t = w_groups.transpose(1, 2)
    ops = torch.ops.tdist
    cases = {
        "torch.mm (M x N x K)": lambda: torch.mm(a_full, b.t()),
        "tdist.ag_gemm": lambda: tdist.ag_gemm(a_local, b),
        "tdist.gemm_rs": lambda: tdist.gemm_rs(a_full, b),
        "tdist.gemm_ar": lambda: tdist.gemm_ar(a_full, b),
        "tdist.all_reduce (64K bf16)": lambda: tdist.all_reduce(x),
        "tdist.flash_decode (b1, 4K)": lambda: tdist.flash_decode(q, kc, vc, lens, table),
        "torch._grouped_mm (8 x 64 rows)": lambda: torch._grouped_mm(a_sorted, w_groups_t, offs=offs),
        "tdist.moe.grouped_gemm (8 x 64 rows)": lambda: tdist.moe.grouped_gemm(a_groups, w_groups, offsets),
        "torch.ops.tdist.ag_gemm": lambda: ops.ag_gemm.default(a_local, b, None, "auto"),
        "torch.ops.tdist.gemm_rs": lambda: ops.gemm_rs.default(a_full, b, "auto"),
        "torch.ops.tdist.all_reduce_inplace": lambda: ops.all_reduce_inplace.default(x, "auto"),
        "torch.ops.tdist.flash_decode": lambda: ops.flash_decode.default(q, kc, vc, lens, table, 0.0, 0.0, 0),
    }
    if r == 0:
        print(f"world size {w}, {torch.cuda.get_device_name()}, M x N x K = {m} x {n} x {k} bf16, {CALLS} calls")
        print(f"{'call':<36} {'host us':>9} {'with GPU us':>12}")
    for name, fn in cases.items():
        host, total = host_time(fn)
        if r == 0:
            print(f"{name:<36} {host:9.1f} {total:12.1f}", flush=True)
    for name in ("torch.mm (M x N x K)", "tdist.ag_gemm", "tdist.gemm_rs", "tdist.all_reduce (64K bf16)"):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU work queued ahead
        t0 = time.perf_counter()
        for _ in range(10):
            cases[name]()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if r == 0:
            print(f"{name:<36} 10 calls behind ~50 ms of GPU work: {1e3 * (t1 - t0):.2f} ms of host time", flush=True)
    if r == 0:
        prof = cProfile.Profile()
        prof.enable()
    for _ in range(200):
        tdist.ag_gemm(a_local, b)
        tdist.gemm_rs(a_full, b)
    torch.cuda.synchronize()
    if r == 0:
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        print(out.getvalue()[:4000])
    tdist.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
