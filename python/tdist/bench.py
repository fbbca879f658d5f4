"""Side-by-side benchmark from Python: tdist's collectives and overlapped GEMMs beside
torch.distributed (NCCL) and torch's symmetric-memory ops (torch.ops.symm_mem) where this torch has
them.

    torchrun --nproc-per-node 2 -m tdist.bench [--ops all_reduce,all_gather,reduce_scatter]
        [--sizes 4K,64K,1M,16M,64M] [--dtype bf16] [--json FILE]
    torchrun --nproc-per-node 2 -m tdist.bench --ops ag_gemm,gemm_rs,gemm_ar [--rows 1024,4096,8192,16384]
        [--methods auto,chunked] [--json FILE]
    torchrun --nproc-per-node 2 -m tdist.bench --sizes random:40 --seed 7          (random sweeps: sizes
    torchrun --nproc-per-node 2 -m tdist.bench --ops gemm_rs --shapes random:12    and shapes nobody tuned
                                                                  on, every method beside auto)

Collectives: sizes follow nccl-tests (the AllReduce buffer, the AllGather output, the ReduceScatter
input); bus bandwidth as nccl-tests: AllReduce 2(n-1)/n x size / time, AllGather and ReduceScatter
(n-1)/n x size / time; tdist with each method of --methods (default auto; "all": auto and every
method of the op, the default of a random sweep; a method the size refuses is left out) beside NCCL
and, for AllReduce, symm_mem one-shot / two-shot.

Overlapped GEMMs, shapes as bench/gemm_overlap.cu (LLaMA-3-70B at TP = world size): ag_gemm
M x 14336 (total, N = 14336 / world per rank) x 8192, gemm_rs / gemm_ar M x 8192 x 14336 (total,
K = 14336 / world per rank), each also M = 4096 with an 8192 x 8192 weight; beside
"nccl+mm" (the torch.distributed collective and torch.matmul in sequence), "mm" (this rank's GEMM
alone, the floor an overlap approaches) and "symm_mem" (torch.ops.symm_mem.fused_all_gather_matmul /
fused_matmul_reduce_scatter; none for AllReduce). Outputs are compared with nccl+mm's ("diff": max
|x - ref| / max |ref|, the worst rank).

Flags, defaults and the JSON file are shared with the C++ benchmarks (tdist-bench, bench_gemm_overlap):
--op/--ops, --method/--methods, --sizes MIN:MAX or a list or random:N, --shapes random:N or
MxNxK,..., --seed 1 (the same random lists as the C++ benches for the same seed), --iters 20, --json
FILE of schema "tdist.bench/1" (one row per op, size or shape, and implementation; the header records
the seed; bench/plot.py draws it).

Each cell is the median over --iters launches of one call timed with CUDA events (after --warmup
calls), the slowest rank's median. A size's collectives, and a shape's overlapped GEMMs, take turns,
--rounds times (3), each turn timing its share of the --iters calls, so that tdist's methods, the
NCCL (+ matmul) baseline, the GEMM alone and symm_mem see the same clocks and neighbours; the median
is over all of a variant's calls. Collectives up to --graph-max
bytes are timed as CUDA-graph replays instead, --ops-per-graph calls per graph, as tdist-bench does:
the per-call time without the launch floor that event timing of single calls keeps. NVLink
multicast stays off.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import warnings

SCHEMA = "tdist.bench/1"

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
GEMMS = ("ag_gemm", "gemm_rs", "gemm_ar")
# --methods all: auto and then every method of the op, as tdist-bench --method all and the
# --methods of scripts/bench-random's bench_gemm_overlap. "nccl" (tdist's call of NCCL) only when named.
COLLECTIVE_METHODS = {
    "all_reduce": ("auto", "ll", "ll128", "one_shot", "two_shot", "ce"),
    "all_gather": ("auto", "ll", "sm", "sm_push", "ce_push", "ce_pull"),
    "reduce_scatter": ("auto", "ll", "fused", "ce"),
}
GEMM_METHODS = ("auto", "fused", "chunked", "sequential", "baseline")


def _size(text: str) -> int:
    """'4096', '64K', '1M', '2G', '8MiB' (binary multiples, as the C++ tools read them)."""
    m = re.fullmatch(r"(\d+)([KMGT]?)(?:I?B)?", text.strip().upper())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 4096, 64K, 1M or 2G, got '{text}'")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m.group(2)]


# --- random sweeps: a port of include/tdist/common/random_sweep.hpp, the same lists for the same seed
# (integer arithmetic only; tests/cpu/test_random_sweep.cpp compares the two) ----------------------

_MASK64 = (1 << 64) - 1
RANDOM_MAX_COUNT = 100000


class SplitMix64:
    """splitmix64, as tdist::sweep::SplitMix64."""

    def __init__(self, seed: int):
        self.state = seed & _MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n


def _check_count(count: int) -> None:
    if not 1 <= count <= RANDOM_MAX_COUNT:
        raise ValueError(f"random sweep: count expects [1, {RANDOM_MAX_COUNT}], got {count}")


def random_sizes(count: int, seed: int, elem_size: int):
    """`count` collective sizes in bytes in [1 KB, 1 GB], log-uniform by octave, multiples of
    `elem_size`: a third with an odd element count (not a multiple of 16 bytes), a third multiples of
    16 bytes, a third any multiple of `elem_size`; sorted. The same list as tdist-bench's
    --sizes random:N --seed S."""
    _check_count(count)
    if elem_size <= 0 or 16 % elem_size:
        raise ValueError(f"random sweep: elem_size expects 1, 2, 4, 8 or 16, got {elem_size}")
    r = SplitMix64(seed)
    out = []
    for _ in range(count):
        lo = (1 << 10) << r.below(20)
        size = lo + r.below(lo)
        kind = r.below(3)
        if kind == 0:
            size = (size // elem_size | 1) * elem_size
        elif kind == 1:
            size = size // elem_size * elem_size
        else:
            size = size // 16 * 16
        out.append(size)
    return sorted(out)


def _random_nk(r: SplitMix64) -> int:
    lo = 1024 << r.below(5)
    hi = min(2 * lo, 28672 + 8)
    return lo + 8 * r.below((hi - lo) // 8)


def random_gemm_shapes(count: int, seed: int):
    """`count` (M, N, K) of whole layers: M in [128, 16384) log-uniform by octave (a quarter rounded
    down to a multiple of 128), N and K multiples of 8 in [1024, 28672]; sorted. The same list as
    bench_gemm_overlap's --shapes random:N --seed S."""
    _check_count(count)
    r = SplitMix64(seed)
    out = []
    for _ in range(count):
        lo = 128 << r.below(7)
        m = lo + r.below(lo)
        if r.below(4) == 0:
            m = m // 128 * 128
        n = _random_nk(r)
        k = _random_nk(r)
        out.append((m, n, k))
    return sorted(out)


class _Random:
    """A parsed 'random:N', drawn once the seed and the element size are known."""

    def __init__(self, count: int):
        self.count = count


def _random_count(text: str, what: str) -> _Random:
    body = text[len("random:"):]
    if not re.fullmatch(r"\d+", body) or not 1 <= int(body) <= RANDOM_MAX_COUNT:
        raise argparse.ArgumentTypeError(
            f"{what} expects random:N with N an integer in [1, {RANDOM_MAX_COUNT}], got '{text}'")
    return _Random(int(body))


def _shapes(text: str):
    """'random:N' or 'MxNxK,...' (whole-layer N and K, as bench_gemm_overlap reads --shapes)."""
    if text.startswith("random:"):
        return _random_count(text, "--shapes")
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"(\d+)[xX](\d+)[xX](\d+)", item.strip())
        if m is None or int(m.group(1)) < 1 or any(int(g) < 8 or int(g) % 8 for g in m.groups()[1:]):
            raise argparse.ArgumentTypeError(
                f"--shapes expects random:N or MxNxK,... with M >= 1 and N, K positive multiples of 8, got '{text}'")
        out.append(tuple(int(g) for g in m.groups()))
    return out


def _sizes(text: str):
    """'MIN:MAX' (every power of two from MIN), 'A,B,C' or 'random:N', as tdist-bench reads --sizes."""
    if text.startswith("random:"):
        return _random_count(text, "--sizes")
    if ":" in text:
        lo, hi = (_size(x) for x in text.split(":", 1))
        if lo <= 0 or lo > hi:
            raise argparse.ArgumentTypeError(f"expected MIN:MAX with 0 < MIN <= MAX, got '{text}'")
        out = []
        while lo <= hi:
            out.append(lo)
            lo *= 2
        return out
    items = text.split(",")
    if any(not x.strip() for x in items):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list without empty items, got '{text}'")
    return [_size(x) for x in items]


def _fmt_size(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def _op_methods(op: str, spec: str):
    """The tdist methods of `op` that --methods `spec` names, in its order ("all": every method of
    the op, auto first); auto when it names none of them. ValueError on a name no op has."""
    every = COLLECTIVE_METHODS[op] if op in COLLECTIVES else GEMM_METHODS
    own = every + ("nccl",) if op in COLLECTIVES else every
    known = {m for ms in COLLECTIVE_METHODS.values() for m in ms} | set(GEMM_METHODS) | {"nccl", "all"}
    names = [x.strip() for x in spec.split(",") if x.strip()]
    for name in names:
        if name not in known:
            raise ValueError(f"--methods: unknown method '{name}' (expected all or a method of "
                             f"{', '.join(COLLECTIVES + GEMMS)}; see --help)")
    out = []
    for name in names:
        for m in every if name == "all" else (name,):
            if m in own and m not in out:
                out.append(m)
    return out or ["auto"]


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m tdist.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ops", "--op", default="all_reduce,all_gather,reduce_scatter",
                   help="comma-separated ops: " + ", ".join(COLLECTIVES + GEMMS))
    p.add_argument("--sizes", default="4K,64K,256K,1M,4M,16M,64M", type=_sizes,
                   help="collectives: bytes, MIN:MAX (powers of two), a comma list (K/M/G suffixes) or random:N "
                   "(1K..1G, odd element counts among them; see --seed)")
    p.add_argument("--rows", default=None,
                   help="overlapped GEMMs: comma-separated M (all ranks' rows; not --m, which torchrun would take); "
                   "default 1024,4096,8192,16384")
    p.add_argument("--shapes", default=None, type=_shapes,
                   help="overlapped GEMMs instead of --rows: random:N (M 128..16384, N and K multiples of 8 in "
                   "1024..28672) or MxNxK,... (whole-layer N and K)")
    p.add_argument("--seed", type=int, default=1, help="seed of --sizes random:N and --shapes random:N")
    each = "; ".join(f"{op}: {', '.join(ms)}" for op, ms in COLLECTIVE_METHODS.items())
    p.add_argument("--methods", "--method", default=None,
                   help="tdist methods to time beside the baselines, comma-separated, or all (auto and every method "
                   f"of the op); each op takes the names it has ({each}; collectives also nccl; GEMMs: "
                   f"{', '.join(GEMM_METHODS)}) and auto when it has none; default auto, all for a random sweep")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "f16", "fp32", "f32"),
                   help="element type (the overlapped GEMMs: bf16 or fp16)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls first")
    p.add_argument("--iters", type=int, default=20, help="timed calls (graph replays below --graph-max)")
    p.add_argument("--rounds", type=int, default=3,
                   help="the variants of a size or shape take turns this many times, each timing its share of --iters")
    p.add_argument("--graph-max", default="0",
                   help="collectives up to this many bytes are timed as CUDA-graph replays (0: none)")
    p.add_argument("--ops-per-graph", type=int, default=50, help="calls captured per graph (--graph-max)")
    p.add_argument("--heap-size", "--heap", default=None,
                   help="tdist's symmetric heap per rank (default 8G with an overlapped GEMM, else 2G)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON (rank 0)")
    args = p.parse_args(argv)
    args.dtype = {"f16": "fp16", "f32": "fp32"}.get(args.dtype, args.dtype)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for op in args.ops:
        if op not in COLLECTIVES + GEMMS:
            p.error(f"unknown op '{op}' (expected {', '.join(COLLECTIVES + GEMMS)})")
    if args.dtype == "fp32" and any(op in GEMMS for op in args.ops):
        p.error("the overlapped GEMMs take bf16 or fp16, not fp32")
    try:
        args.graph_max = _size(args.graph_max) if args.graph_max != "0" else 0
    except argparse.ArgumentTypeError as e:
        p.error(f"--graph-max: {e}")
    if args.ops_per_graph < 1:
        p.error("--ops-per-graph must be at least 1")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if not 0 <= args.seed < 1 << 63:
        p.error(f"--seed expects an integer in [0, {(1 << 63) - 1}], got {args.seed}")
    if args.shapes is not None and args.rows is not None:
        p.error("--shapes and --rows are exclusive: --shapes gives M too")
    if args.rows is None:
        args.rows = "1024,4096,8192,16384"
    # A random sweep compares auto with every method in the same run (bench/random_summary.py's best).
    default = {op: "auto" for op in args.ops}
    for op in args.ops:
        if isinstance(args.sizes if op in COLLECTIVES else args.shapes, _Random):
            default[op] = "all"
    try:
        args.op_methods = {op: _op_methods(op, args.methods or default[op]) for op in args.ops}
        args.op_all = {op: "all" in [x.strip() for x in (args.methods or default[op]).split(",")] for op in args.ops}
    except ValueError as e:
        p.error(str(e))
    if isinstance(args.sizes, _Random):
        args.sizes = random_sizes(args.sizes.count, args.seed, 4 if args.dtype == "fp32" else 2)
    if isinstance(args.shapes, _Random):
        args.shapes = random_gemm_shapes(args.shapes.count, args.seed)
    if args.heap_size is None:
        args.heap_size = "8G" if any(op in GEMMS for op in args.ops) else "2G"
    return args


def capture_graph(torch, fn, calls: int, warmup: int = 1):
    """A CUDA graph of `calls` calls of `fn`, after `warmup` (at least one) calls on a side stream, so
    that lazy initialisation and allocations stay out of the capture; replayed once before it returns."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    return graph


def _time_rounds(fns, warmup: int, iters: int, rounds: int, torch, dist, ops_per_graph: int = 0):
    """{name: median per-call time (us), the slowest rank's} of the callables of `fns`, which take turns
    round by round, each round timing its share of `iters` calls: a clock or a neighbour that drifts
    during the run weighs on every variant alike. The median is over all of a variant's calls, as one
    run of `iters` calls gives it. ops_per_graph > 0: each callable captured that many times in one
    CUDA graph (after its warm-up, off the capture), a timed call being one replay / ops_per_graph."""
    names = list(fns)
    runs = {}
    for name in names:
        fn = fns[name]
        if not ops_per_graph:
            for _ in range(warmup):
                fn()
            runs[name] = fn
            continue
        runs[name] = capture_graph(torch, fn, ops_per_graph, warmup).replay
    rounds = max(1, min(rounds, iters))
    events = {name: [] for name in names}
    for r in range(rounds):
        share = iters // rounds + (r < iters % rounds)
        for name in names:
            torch.cuda.synchronize()
            dist.barrier()  # ranks start each variant's turn together
            pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(share)]
            for start, end in pairs:
                start.record()
                runs[name]()
                end.record()
            events[name] += pairs
    torch.cuda.synchronize()
    per = ops_per_graph or 1
    medians = [statistics.median(s.elapsed_time(e) * 1000.0 for s, e in events[name]) / per for name in names]
    t = torch.tensor(medians, device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(names, (float(x) for x in t.tolist())))


def _runnable(fns, me: int, what: str, quiet=()):
    """The callables of `fns` that run once without an error (a method the size refuses: every rank
    refuses alike); the others named on rank 0's stderr unless their name is in `quiet`."""
    out = {}
    for name, fn in fns.items():
        try:
            fn()
            out[name] = fn
        except Exception as e:  # noqa: BLE001 - report, keep benchmarking
            if me == 0 and name not in quiet:
                print(f"{what} {name}: {type(e).__name__}: {e}", file=sys.stderr)
    return out


def _symm_mem(torch, dist, *ops):
    """torch's symmetric memory module and the group name when this torch has every op of `ops`
    in torch.ops.symm_mem, else None."""
    try:
        import torch.distributed._symmetric_memory as symm_mem  # also defines the fused GEMM ops
        for op in ops:
            getattr(torch.ops.symm_mem, op)
    except (ImportError, AttributeError, RuntimeError):
        return None
    name = dist.group.WORLD.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed up to torch 2.9, deprecated (a no-op warning) after
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
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
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        print(f"python -m tdist.bench: error: needs PyTorch with CUDA ({e}); install it with "
              "'pip install torch' (or 'pip install tdist[torch]'), then run it under torchrun, "
              "e.g. torchrun --nproc-per-node 2 -m tdist.bench", file=sys.stderr)
        return 2

    local = tdist._runtime._launcher_device()  # LOCAL_RANK (modulo the GPUs under TDIST_SHARE_GPUS)
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    tdist.init(process_group=dist.group.WORLD, heap_size=args.heap_size)
    n, me = dist.get_world_size(), dist.get_rank()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    symm = _symm_mem(torch, dist, "one_shot_all_reduce", "two_shot_all_reduce_")
    rows = []
    gemm_rows = []
    try:
        for op in args.ops:
            if op in GEMMS:
                gemm_rows += _bench_gemm(op, args, dtype, tdist, torch, dist)
                continue
            methods = args.op_methods[op]
            cols = [f"tdist {m}" for m in methods] + ["nccl"]
            if op == "all_reduce" and symm is not None:
                cols += ["symm_mem 1-shot", "symm_mem 2-shot"]
            # the methods of "all" that a size refuses are left out quietly, as tdist-bench does
            quiet = {f"tdist {m}" for m in methods if m != "auto"} if args.op_all[op] else set()
            printed = False
            for size in args.sizes:
                # AllReduce: every element (odd counts stay odd, as tdist-bench); AllGather and
                # ReduceScatter: divisible by the world size.
                count = max(1, size // elem) if op == "all_reduce" else max(n, size // elem // n * n)
                bytes_ = count * elem
                fns = {}
                if op == "all_reduce":
                    x = torch.randn(count, device="cuda").to(dtype)
                    out = torch.empty_like(x)
                    y = x.clone()
                    for m in methods:
                        fns[f"tdist {m}"] = lambda m=m: tdist.all_reduce(x, output=out, method=m)
                    fns["nccl"] = lambda: dist.all_reduce(y)
                    if symm is not None:
                        symm_mem, group = symm
                        try:
                            buf = symm_mem.empty(count, dtype=dtype, device="cuda")
                            symm_mem.rendezvous(buf, group)
                            buf.copy_(x)
                            fns["symm_mem 1-shot"] = lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group)
                            fns["symm_mem 2-shot"] = lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group)
                        except Exception as e:  # noqa: BLE001 - report, keep benchmarking
                            if me == 0:
                                print(f"symm_mem all_reduce at {_fmt_size(bytes_)}: {type(e).__name__}: {e}",
                                      file=sys.stderr)
                    busbw_factor = 2 * (n - 1) / n
                elif op == "all_gather":
                    x = torch.randn(count // n, device="cuda").to(dtype)
                    out = torch.empty(count, device="cuda", dtype=dtype)
                    for m in methods:
                        fns[f"tdist {m}"] = lambda m=m: tdist.all_gather(x, out, method=m)
                    fns["nccl"] = lambda: dist.all_gather_into_tensor(out, x)
                    busbw_factor = (n - 1) / n
                elif op == "reduce_scatter":
                    x = torch.randn(count, device="cuda").to(dtype)
                    out = torch.empty(count // n, device="cuda", dtype=dtype)
                    for m in methods:
                        fns[f"tdist {m}"] = lambda m=m: tdist.reduce_scatter(x, out, method=m)
                    fns["nccl"] = lambda: dist.reduce_scatter_tensor(out, x)
                    busbw_factor = (n - 1) / n
                fns = _runnable(fns, me, f"{op} at {_fmt_size(bytes_)}:", quiet)
                cells = _time_rounds(fns, args.warmup, args.iters, args.rounds, torch, dist,
                                     args.ops_per_graph if bytes_ <= args.graph_max else 0)
                rows.append((op, bytes_, cells, busbw_factor))
                if me == 0:  # as it is measured
                    if not printed:
                        _print_header(cols, n, args)
                        printed = True
                    _print_row(rows[-1], cols)
                del fns
                torch.cuda.synchronize()
        if me == 0:
            if gemm_rows:
                _print_gemm_table(gemm_rows, n, args)
            if args.json:
                _write_json(args, n, rows, gemm_rows)
    finally:
        tdist.finalize()
        dist.destroy_process_group()
    return 0


# --- overlapped GEMMs -------------------------------------------------------------------------------

def _gemm_shapes(op: str, ms, world: int, layers=None):
    """(M, N, K of this rank's GEMM, note) as bench/gemm_overlap.cu: ag_gemm splits N over the ranks,
    gemm_rs / gemm_ar split K (per rank rounded down to a multiple of 8). `layers`: (M, N, K) of
    whole layers (--shapes) instead of the default shapes at each M of `ms`."""
    def per_rank(total):
        return max(8, total // world // 8 * 8)

    shapes = []
    if layers is not None:
        for m, n, k in layers:
            note = f"--shapes: N={n}, K={k} total"
            if op == "ag_gemm":
                shapes.append((m, per_rank(n), k, note))
            else:
                shapes.append((m, n, per_rank(k), note))
        return shapes
    for m in ms:
        if op == "ag_gemm":
            shapes.append((m, per_rank(14336), 8192, "LLaMA-3-70B MLP up: N=14336 total, K=8192"))
        else:
            shapes.append((m, 8192, per_rank(14336), "LLaMA-3-70B MLP down: N=8192, K=14336 total"))
    if 4096 in ms:
        if op == "ag_gemm":
            shapes.append((4096, per_rank(8192), 8192, "8192 x 8192 weight: N=8192 total"))
        else:
            shapes.append((4096, 8192, per_rank(8192), "8192 x 8192 weight: K=8192 total"))
    return shapes


def _rel_diff(x, ref, torch, dist) -> float:
    """max |x - ref| / max |ref| on this rank (NaN counts as infinite), the maximum over ranks."""
    d = (x.float() - ref.float()).abs().nan_to_num(nan=float("inf")).max() if x.numel() else torch.zeros((), device="cuda")
    scale = ref.float().abs().max() if ref.numel() else torch.ones((), device="cuda")
    t = (d / scale.clamp_min(1e-30)).reshape(1).double()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _bench_gemm(op: str, args, dtype, tdist, torch, dist):
    """One row per (shape, tdist method): every variant's time, the resolved method, diffs."""
    from . import _torch_ops

    world, me = dist.get_world_size(), dist.get_rank()
    methods = args.op_methods[op]
    ms = [int(_size(x)) for x in args.rows.split(",") if x.strip()]
    group = dist.group.WORLD
    symm = _symm_mem(torch, dist, "fused_all_gather_matmul" if op == "ag_gemm" else "fused_matmul_reduce_scatter")
    out = []
    for m, n, k, note in _gemm_shapes(op, ms, world, args.shapes):
        gen = torch.Generator(device="cuda").manual_seed(1234 + me)
        rows = m // world + (me < m % world)  # RowChunks
        a_rows = rows if op == "ag_gemm" else m
        a = (torch.rand(a_rows, k, device="cuda", generator=gen) * 2 - 1).to(dtype)
        b = ((torch.rand(n, k, device="cuda", generator=gen) * 2 - 1) / k ** 0.5).to(dtype)
        equal = m % world == 0
        variants = {}
        if op == "ag_gemm":
            for method in methods:
                variants[f"tdist {method}"] = lambda method=method: tdist.ag_gemm(a, b, m=m, method=method)
            if equal:
                gathered = torch.empty(m, k, device="cuda", dtype=dtype)

                def nccl_mm():
                    dist.all_gather_into_tensor(gathered, a, group=group)
                    return torch.matmul(gathered, b.t())

                variants["nccl+mm"] = nccl_mm
                full = (torch.rand(m, k, device="cuda", generator=gen) * 2 - 1).to(dtype)
                variants["mm"] = lambda: torch.matmul(full, b.t())
            if symm is not None and equal:
                variants["symm_mem"] = lambda: torch.ops.symm_mem.fused_all_gather_matmul(
                    a, [b.t()], 0, symm[1], return_A=False)[1][0]
        else:
            for method in methods:
                fn = tdist.gemm_rs if op == "gemm_rs" else tdist.gemm_ar
                variants[f"tdist {method}"] = lambda fn=fn, method=method: fn(a, b, method=method)
            if op == "gemm_rs" and equal:
                scattered = torch.empty(rows, n, device="cuda", dtype=dtype)

                def nccl_mm():
                    dist.reduce_scatter_tensor(scattered, torch.matmul(a, b.t()), group=group)
                    return scattered

                variants["nccl+mm"] = nccl_mm
            elif op == "gemm_ar":
                def nccl_mm():
                    y = torch.matmul(a, b.t())
                    dist.all_reduce(y, group=group)
                    return y

                variants["nccl+mm"] = nccl_mm
            variants["mm"] = lambda: torch.matmul(a, b.t())
            if symm is not None and op == "gemm_rs" and equal:
                variants["symm_mem"] = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(
                    a, b.t(), "sum", 0, symm[1])
        row = {"op": op, "m": m, "n": n, "k": k, "shape": note, "world_size": world, "dtype": args.dtype,
               "us": {}, "diff": {}, "resolved": {}}
        ref = variants["nccl+mm"]().clone() if "nccl+mm" in variants else None
        timed = {}  # the variants that ran once, checked: they take turns, --rounds times, as the collectives
        for name, fn in variants.items():
            try:
                if name.startswith("tdist "):
                    method = name.split(" ", 1)[1]
                    row["resolved"][method] = _torch_ops.gemm_method(op, a, b, m if op == "ag_gemm" else None, method)
                result = fn()
                if ref is not None and name not in ("mm", "nccl+mm"):
                    row["diff"][name] = _rel_diff(result, ref, torch, dist)
                timed[name] = fn
            except Exception as e:  # noqa: BLE001 - report, keep benchmarking (e.g. a method the shape refuses)
                row.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
                if me == 0:
                    print(f"{op} M={m} N={n} K={k} {name}: {type(e).__name__}: {e}", file=sys.stderr)
        if timed:
            row["us"] = _time_rounds(timed, args.warmup, args.iters, args.rounds, torch, dist)
        row["tflops_per_gpu"] = {name: 2.0 * m * n * k / (t * 1e-6) / 1e12 for name, t in row["us"].items()}
        out.append(row)
        del variants, ref
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return out


def _print_gemm_table(rows, n, args) -> None:
    cols = []
    for r in rows:
        cols += [c for c in r["us"] if c not in cols]
    print(f"tdist.bench overlapped GEMMs: {n} ranks, {args.dtype}, median of {args.iters} after {args.warmup} "
          "warm-up, slowest rank; M N K of this rank's GEMM; nccl+mm/t: nccl+mm time / the first tdist method's; "
          "diff: vs nccl+mm")
    head = f"{'op':<9}{'M':>7}{'N':>7}{'K':>7}" + "".join(f"{c + ' us':>17}" for c in cols)
    head += f"{'resolved':>12}{'nccl+mm/t':>11}{'TFLOP/s':>9}{'diff':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        line = f"{r['op']:<9}{r['m']:>7}{r['n']:>7}{r['k']:>7}"
        for c in cols:
            line += f"{r['us'][c]:>17.1f}" if c in r["us"] else f"{'-':>17}"
        first = next((c for c in r["us"] if c.startswith("tdist ")), None)
        resolved = ",".join(r["resolved"].values())
        ratio = r["us"]["nccl+mm"] / r["us"][first] if first and "nccl+mm" in r["us"] else float("nan")
        tflops = r["tflops_per_gpu"].get(first, float("nan")) if first else float("nan")
        diff = r["diff"].get(first, float("nan")) if first else float("nan")
        line += f"{resolved:>12}{ratio:>10.2f}x{tflops:>9.1f}{diff:>10.1e}"
        print(line)


def _finite(x):
    """JSON has no NaN or infinity: they are written as null."""
    return x if isinstance(x, (int, str, bool)) or x is None or math.isfinite(x) else None


def _impl(name: str):
    """(impl, method) of a column name: 'tdist auto' -> ('tdist', 'auto'), 'symm_mem 1-shot' ->
    ('symm_mem', '1-shot'), 'nccl' -> ('nccl', 'nccl')."""
    impl, _, method = name.partition(" ")
    return impl, method or impl


def result_document(args, n, rows, gemm_rows, gpu="", command=None):
    """The results as schema tdist.bench/1 (tools/common/bench_report.hpp): one row per op, size or
    shape, and implementation."""
    try:
        from . import __version__ as version
    except ImportError:
        version = None
    doc = {
        "schema": SCHEMA, "bench": "python", "tdist_version": version, "gpu": gpu, "world_size": n,
        "dtype": args.dtype, "command": command if command is not None else " ".join(sys.argv),
        "iters": args.iters, "warmup": args.warmup, "seed": args.seed,
        "statistic": "median of per-call CUDA-event times, max over ranks (us)",
        "collective_rounds": args.rounds, "gemm_rounds": args.rounds,
        "graph_max_bytes": args.graph_max, "ops_per_graph": args.ops_per_graph,
        "graph_statistic": "up to graph_max_bytes: median per-replay time / ops_per_graph, max over ranks (us)",
        "rows": [],
    }
    for op, bytes_, cells, factor in rows:
        for name, us in cells.items():
            impl, method = _impl(name)
            doc["rows"].append({
                "op": op, "bytes": bytes_, "impl": impl, "method": "auto" if name == "tdist" else method,
                "timing": "graph" if bytes_ <= args.graph_max else "events", "us": _finite(us),
                "algbw_gbps": _finite(bytes_ / (us * 1e3)) if us else None,
                "busbw_gbps": _finite(bytes_ * factor / (us * 1e3)) if us else None,
            })
    for r in gemm_rows:
        for name, us in r["us"].items():
            impl, method = _impl(name)
            row = {"op": r["op"], "m": r["m"], "n": r["n"], "k": r["k"], "note": r["shape"], "impl": impl,
                   "method": method, "us": _finite(us), "tflops": _finite(r["tflops_per_gpu"].get(name))}
            if impl == "tdist" and method in r["resolved"]:
                row["resolved"] = r["resolved"][method]
            if name in r["diff"]:
                row["max_rel_diff"] = _finite(r["diff"][name])
            doc["rows"].append(row)
        for name, err in r.get("errors", {}).items():
            impl, method = _impl(name)
            doc["rows"].append({"op": r["op"], "m": r["m"], "n": r["n"], "k": r["k"], "impl": impl,
                                "method": method, "us": None, "error": err})
    return doc


def _write_json(args, n, rows, gemm_rows) -> None:
    import torch

    doc = result_document(args, n, rows, gemm_rows, gpu=torch.cuda.get_device_name())
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, args.json)
    print(f"tdist.bench: wrote {args.json}")


def _print_header(cols, n, args) -> None:
    print(f"tdist.bench: {n} ranks, {args.dtype}, median of {args.iters} after {args.warmup} warm-up, slowest rank"
          + (f", variants alternating in {min(args.rounds, args.iters)} rounds" if args.rounds > 1 and len(cols) > 1
             else "")
          + (f"; graph replays of {args.ops_per_graph} calls up to {_fmt_size(args.graph_max)}" if args.graph_max else ""))
    head = (f"{'op':<15}{'size':>8}" + "".join(f"{c + ' us':>18}" for c in cols)
            + f"{'nccl/tdist':>12}{'tdist busbw GB/s':>18}")
    print(head)
    print("-" * len(head), flush=True)


def _auto_cell(cells):
    """The time the nccl/tdist column compares: auto's ("tdist" in rows of before the methods were
    named), else the first method's."""
    for name in ("tdist auto", "tdist"):
        if name in cells:
            return cells[name]
    return next((us for name, us in cells.items() if name.startswith("tdist ")), None)


def _print_row(row, cols) -> None:
    op, bytes_, cells, factor = row
    line = f"{op:<15}{_fmt_size(bytes_):>8}"
    for c in cols:
        line += f"{cells[c]:>18.1f}" if c in cells else f"{'-':>18}"
    auto = _auto_cell(cells)
    ratio = cells["nccl"] / auto if auto and "nccl" in cells else float("nan")
    busbw = bytes_ * factor / (auto * 1e-6) / 1e9 if auto else float("nan")
    line += f"{ratio:>11.2f}x{busbw:>18.1f}"
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
