"""Side-by-side collectives benchmark from Python: tdist beside torch.distributed (NCCL) and, for
AllReduce, torch's symmetric-memory ops (torch.ops.symm_mem) where this torch has them.

    torchrun --nproc-per-node 2 -m tdist.bench [--sizes 4K,64K,1M,16M,64M] [--dtype bf16]

Sizes follow nccl-tests: the AllReduce buffer, the AllGather output, the ReduceScatter input.
Each cell is the median over --iters launches of one call timed with CUDA events (after --warmup
calls), the slowest rank's median. Bus bandwidth as nccl-tests: AllReduce 2(n-1)/n x size / time,
AllGather and ReduceScatter (n-1)/n x size / time. NVLink multicast stays off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


def _size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def _fmt_size(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m tdist.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="4K,64K,256K,1M,4M,16M,64M", help="comma-separated bytes, K/M/G suffixes")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="element type")
    p.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter", help="comma-separated ops")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls first")
    p.add_argument("--iters", type=int, default=50, help="timed calls")
    p.add_argument("--heap-size", default="2G", help="tdist's symmetric heap per rank")
    return p.parse_args(argv)


def _time_us(fn, warmup: int, iters: int, torch, dist) -> float:
    """Median of per-call CUDA-event times (us), the slowest rank's."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    med = statistics.median(s.elapsed_time(e) * 1000.0 for s, e in events)
    t = torch.tensor([med], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _symm_mem(torch, dist):
    """torch's symmetric memory module and the group name, or None."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
        ops = torch.ops.symm_mem
        getattr(ops, "one_shot_all_reduce")
        getattr(ops, "two_shot_all_reduce_")
    except (ImportError, AttributeError, RuntimeError):
        return None
    name = dist.group.WORLD.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        try:
            enable(name)
        except Exception:  # noqa: BLE001 - older/newer torch variations
            pass
    return symm_mem, name


def main(argv=None) -> int:
    """Run the benchmark (under torchrun); rank 0 prints the table."""
    args = _parse(argv)
    # Shared hosts: no NVLink multicast, in NCCL or in torch's symmetric memory.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

    import tdist  # before torch (NCCL >= 2.28)
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    tdist.init(process_group=dist.group.WORLD, heap_size=args.heap_size)
    n, me = dist.get_world_size(), dist.get_rank()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    symm = _symm_mem(torch, dist)
    rows = []
    try:
        for op in [o.strip() for o in args.ops.split(",") if o.strip()]:
            for size in [_size(s) for s in args.sizes.split(",")]:
                count = max(n, size // elem // n * n)  # divisible by the world size
                bytes_ = count * elem
                cells = {}
                if op == "all_reduce":
                    x = torch.randn(count, device="cuda").to(dtype)
                    out = torch.empty_like(x)
                    y = x.clone()
                    cells["tdist"] = _time_us(lambda: tdist.all_reduce(x, output=out), args.warmup, args.iters, torch, dist)
                    cells["nccl"] = _time_us(lambda: dist.all_reduce(y), args.warmup, args.iters, torch, dist)
                    if symm is not None:
                        symm_mem, group = symm
                        try:
                            buf = symm_mem.empty(count, dtype=dtype, device="cuda")
                            symm_mem.rendezvous(buf, group)
                            buf.copy_(x)
                            cells["symm_mem 1-shot"] = _time_us(
                                lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group),
                                args.warmup, args.iters, torch, dist)
                            cells["symm_mem 2-shot"] = _time_us(
                                lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group),
                                args.warmup, args.iters, torch, dist)
                        except Exception as e:  # noqa: BLE001 - report, keep benchmarking
                            if me == 0:
                                print(f"symm_mem all_reduce at {_fmt_size(bytes_)}: {type(e).__name__}: {e}",
                                      file=sys.stderr)
                    busbw_factor = 2 * (n - 1) / n
                elif op == "all_gather":
                    x = torch.randn(count // n, device="cuda").to(dtype)
                    out = torch.empty(count, device="cuda", dtype=dtype)
                    cells["tdist"] = _time_us(lambda: tdist.all_gather(x, out), args.warmup, args.iters, torch, dist)
                    cells["nccl"] = _time_us(lambda: dist.all_gather_into_tensor(out, x), args.warmup, args.iters,
                                             torch, dist)
                    busbw_factor = (n - 1) / n
                elif op == "reduce_scatter":
                    x = torch.randn(count, device="cuda").to(dtype)
                    out = torch.empty(count // n, device="cuda", dtype=dtype)
                    cells["tdist"] = _time_us(lambda: tdist.reduce_scatter(x, out), args.warmup, args.iters,
                                              torch, dist)
                    cells["nccl"] = _time_us(lambda: dist.reduce_scatter_tensor(out, x), args.warmup, args.iters,
                                             torch, dist)
                    busbw_factor = (n - 1) / n
                else:
                    raise tdist.Error(f"tdist.bench: unknown op '{op}' (all_reduce, all_gather, reduce_scatter)")
                rows.append((op, bytes_, cells, busbw_factor))
                torch.cuda.synchronize()
        if me == 0:
            _print_table(rows, n, args)
    finally:
        tdist.finalize()
        dist.destroy_process_group()
    return 0


def _print_table(rows, n, args) -> None:
    cols = ["tdist", "nccl", "symm_mem 1-shot", "symm_mem 2-shot"]
    cols = [c for c in cols if any(c in r[2] for r in rows)]
    head = f"{'op':<15}{'size':>8}" + "".join(f"{c + ' us':>18}" for c in cols) + f"{'nccl/tdist':>12}{'tdist busbw GB/s':>18}"
    print(f"tdist.bench: {n} ranks, {args.dtype}, median of {args.iters} after {args.warmup} warm-up, slowest rank")
    print(head)
    print("-" * len(head))
    for op, bytes_, cells, factor in rows:
        line = f"{op:<15}{_fmt_size(bytes_):>8}"
        for c in cols:
            line += f"{cells[c]:>18.1f}" if c in cells else f"{'-':>18}"
        ratio = cells["nccl"] / cells["tdist"]
        busbw = bytes_ * factor / (cells["tdist"] * 1e-6) / 1e9
        line += f"{ratio:>11.2f}x{busbw:>18.1f}"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
