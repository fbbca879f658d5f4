"""Benchmark of the Triton AG-GEMM and GEMM-RS (tdist.triton) beside tdist's C++ ops, NCCL + cuBLAS and
PyTorch's fused_all_gather_matmul / fused_matmul_reduce_scatter, from one run (torchrun, one process
per GPU). Default shapes: LLaMA-3-70B MLP, AG: K = 8192, N = 28672 / world; RS: N = 8192,
K = 28672 / world; M (all rows) = 1024 ... 8192.

    python -m torch.distributed.run --nproc-per-node 2 -m tdist.bench_triton --json out.json

Rank 0 prints one line per (op, M, method): median ms over --iters timed calls (CUDA events, after
--warmup calls), TFLOP/s and the time relative to the Triton op; --json writes the same rows with the
GPU, world size and command; --summary writes one flat row per (op, M, N, K, world) as a JSON list:
{"op", "m", "n", "k", "world", "triton_us", "cpp_us", "torch_fused_us", "baseline_us"} (baseline:
NCCL + cuBLAS), null where a method did not run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import tdist  # before torch: tdist's NCCL is the one the process loads

from . import _bench_world


# --summary's field for each method's time
SUMMARY_FIELDS = {"triton": "triton_us", "tdist_cpp": "cpp_us", "torch_fused": "torch_fused_us",
                  "nccl_cublas": "baseline_us"}


def summary_rows(rows) -> list:
    """The --summary rows of the benchmark's rows (one per method, times in ms): one row per (op, m, n,
    k, world), in the order first seen, each method's time in us, None where it has no time or no row."""
    out, seen = {}, set()
    for r in rows:
        key = (r["op"], r["m"], r["n"], r["k"], r["world"])
        field = SUMMARY_FIELDS.get(r["method"])
        if field is None:
            raise ValueError(f"bench_triton: unknown method {r['method']!r} (expected {', '.join(SUMMARY_FIELDS)})")
        if (key, field) in seen:
            raise ValueError(f"bench_triton: two {r['method']} rows for {key}")
        seen.add((key, field))
        row = out.setdefault(key, dict(zip(("op", "m", "n", "k", "world"), key),
                                       **dict.fromkeys(SUMMARY_FIELDS.values())))
        ms = r.get("ms")
        row[field] = None if ms is None else ms * 1e3
    return list(out.values())


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m tdist.bench_triton", description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=("ag_gemm", "gemm_rs", "all"), default="all")
    p.add_argument("--rows", dest="m", default="1024,2048,4096,8192",
                   help="total rows M, comma-separated (default %(default)s; not --m, which torchrun takes for its own)")
    p.add_argument("--k", type=int, default=8192, help="AG K (default %(default)s)")
    p.add_argument("--n-total", type=int, default=28672, help="AG N before the split over ranks (default %(default)s)")
    p.add_argument("--rs-n", type=int, default=8192, help="RS N (default %(default)s)")
    p.add_argument("--rs-k-total", type=int, default=28672, help="RS K before the split (default %(default)s)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None, help="write the rows to this file (rank 0)")
    p.add_argument("--summary", default=None, metavar="FILE",
                   help="write one row per shape, every method's time in us, as a JSON list (rank 0)")
    args = p.parse_args(argv)
    try:
        args.m = list(dict.fromkeys(int(v) for v in args.m.split(",")))  # a repeat would be timed twice
    except ValueError:
        p.error(f"--rows must be comma-separated integers, got {args.m!r}")
    if any(v <= 0 for v in args.m) or args.warmup < 0 or args.iters < 1:
        p.error("--rows values and --iters must be positive, --warmup >= 0")
    return args


def _time_alternating(fns: dict, torch, dist, warmup, iters) -> dict:
    """{name: (ms, error)}: every method warmed up, then timed once per round, round after round, so that
    clock and temperature drift falls on every method alike. A method that raises is reported and leaves
    the rotation; the others go on."""
    errors = {}

    def failed(name, e):
        errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        torch.cuda.synchronize()

    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
            failed(name, e)
    torch.cuda.synchronize()
    dist.barrier()
    times = {name: [] for name in fns if name not in errors}
    for _ in range(iters):
        for name in list(times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            try:
                start.record()
                fns[name]()
                end.record()
                end.synchronize()
            except Exception as e:  # noqa: BLE001
                failed(name, e)
                del times[name]
                continue
            times[name].append(start.elapsed_time(end))
    # Every rank's median, then the slowest rank: a collective op is as fast as its slowest member. Every
    # rank reduces every method (a method that failed here reports -1), so the collectives stay in step.
    out = {}
    for name in fns:
        mine = statistics.median(times[name]) if name in times and times[name] else -1.0
        t = torch.tensor([mine], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        low = torch.tensor([mine], device="cuda")
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        ok = low.item() >= 0
        out[name] = (t.item(), None) if ok else (None, errors.get(name, "failed on another rank"))
    return out


def _methods(op, torch, dist, world, group_name):
    import tdist.triton

    if op == "ag_gemm":
        def nccl_cublas(x, w):
            full = torch.empty((x.shape[0] * world, x.shape[1]), device=x.device, dtype=x.dtype)
            dist.all_gather_into_tensor(full, x)
            return full @ w.T

        def torch_fused(x, w):
            return torch.ops.symm_mem.fused_all_gather_matmul(x, [w.T], 0, group_name)[1][0]

        return {"triton": tdist.triton.ag_gemm, "tdist_cpp": tdist.ag_gemm, "nccl_cublas": nccl_cublas,
                "torch_fused": torch_fused}

    def nccl_cublas_rs(a, b):
        full = a @ b.T
        out = torch.empty((a.shape[0] // world, b.shape[0]), device=a.device, dtype=a.dtype)
        dist.reduce_scatter_tensor(out, full)
        return out

    def torch_fused_rs(a, b):
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b.T, "sum", 0, group_name)

    return {"triton": tdist.triton.gemm_rs, "tdist_cpp": tdist.gemm_rs, "nccl_cublas": nccl_cublas_rs,
            "torch_fused": torch_fused_rs}


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    torch, dist = _bench_world.start("tdist.bench_triton")
    tdist.init(process_group=dist.group.WORLD, heap_size=os.environ.get("TDIST_SYMMETRIC_HEAP_SIZE", "16G"))
    rank, world = dist.get_rank(), dist.get_world_size()
    group_name = dist.group.WORLD.group_name
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(group_name)
        fused_error = None
    except Exception as e:  # noqa: BLE001 - reported, the other methods still run
        fused_error = f"{type(e).__name__}: {e}"
    rows = []
    ops = ("ag_gemm", "gemm_rs") if args.op == "all" else (args.op,)
    g = torch.Generator(device="cuda").manual_seed(1 + rank)
    for op in ops:
        for m in args.m:
            if m % world:
                continue
            if op == "ag_gemm":
                k, n = args.k, args.n_total // world
                a = torch.randn((m // world, k), generator=g, device="cuda").to(torch.bfloat16)
            else:
                k, n = args.rs_k_total // world, args.rs_n
                a = torch.randn((m, k), generator=g, device="cuda").to(torch.bfloat16)
            b = (torch.randn((n, k), generator=g, device="cuda") / k ** 0.5).to(torch.bfloat16)
            flops = 2.0 * m * n * k  # per rank (AG: all rows x this rank's N; RS: all rows x this rank's K)
            methods = _methods(op, torch, dist, world, group_name)
            runnable = {name: (lambda fn=fn: fn(a, b)) for name, fn in methods.items()
                        if not (name == "torch_fused" and fused_error)}
            timed = _time_alternating(runnable, torch, dist, args.warmup, args.iters)
            results = {name: timed[name] if name in timed else (None, fused_error) for name in methods}
            base = results["triton"][0]
            for name, (ms, err) in results.items():
                row = {"op": op, "m": m, "n": n, "k": k, "world": world, "method": name, "ms": ms,
                       "tflops": flops / (ms * 1e-3) / 1e12 if ms else None,
                       "vs_triton": ms / base if ms and base else None, "error": err}
                rows.append(row)
                if rank == 0:
                    if ms is None:
                        print(f"{op:8s} M={m:6d} N={n:6d} K={k:6d} {name:12s} unavailable: {err}", flush=True)
                    else:
                        ratio = f"{row['vs_triton']:.3f}x" if row["vs_triton"] else "-"
                        print(f"{op:8s} M={m:6d} N={n:6d} K={k:6d} {name:12s} {ms:8.3f} ms {row['tflops']:7.1f} "
                              f"TFLOP/s  time vs triton {ratio}", flush=True)
    if rank == 0 and args.json:
        header = {"gpu": torch.cuda.get_device_name(), "world": world, "command": " ".join(sys.argv),
                  "torch": torch.__version__}
        try:
            import triton

            header["triton"] = triton.__version__
        except ImportError:
            pass
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    if rank == 0 and args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary_rows(rows), f, indent=1)
    _bench_world.finish(dist)
    return 0


if __name__ == "__main__":
    sys.exit(main())
