"""Benchmark of tdist's tensor-parallel MoE ops beside the PyTorch sequences that do the same work
(torch._grouped_mm + NCCL), and of tdist's grouped GEMM beside torch._grouped_mm, from one run.

    torchrun --nproc-per-node 2 -m tdist.bench_moe [--models mixtral,qwen3,dsv2lite] [--tokens 1024,4096,16384]
        [--routing uniform,skewed] [--ops ag,rs] [--fp8] [--tp N] [--iters 20] [--json FILE]

Shapes (every rank holds every expert's shard of the intermediate features, TP = the world size, or
--tp; F = intermediate / TP): Mixtral-8x7B (hidden 4096, intermediate 14336, 8 experts, top-2), Qwen3-30B-A3B
(2048, 768, 128, top-8), DeepSeek-V2-Lite (2048, 1408, 64, top-6); bf16. M: tokens of all ranks.
Routing: uniform (top-k distinct experts drawn uniformly per token) or skewed (a random half of the
tokens sends one of its k slots to one hot expert, the rest uniform).

Ops and what each row times (median us, slowest rank):
  ag  tdist_us             tdist.moe_ag_group_gemm(x_rows [M / W, H], topk_ids, w13 [E, 2 F, H])
      baseline_us          NCCL all_gather_into_tensor, rows sorted by expert (stable sort of the ids,
                           offsets by searchsorted, index_select), torch._grouped_mm with offsets
  rs  tdist_us             tdist.moe_group_gemm_rs(h [capacity, F] in expert order, w2 [E, H, F], ...)
      baseline_us          torch._grouped_mm on the expert-sorted rows, un-permute (index_select),
                           weight by the router and sum over top-k (one bmm), NCCL reduce_scatter_tensor
                           (the sort is the first projection's, not timed here)
  ar  like rs with tdist.moe_group_gemm_ar and NCCL all_reduce (decode; not in the default sweep)
  every row:
      group_gemm_us        tdist.moe.grouped_gemm alone on that projection's expert-ordered rows (rows
                           padded per expert to 128, as the op computes them)
      torch_grouped_mm_us  torch._grouped_mm alone on the same rows, unpadded, int32 offsets
  with --fp8, also (the operands quantised once per input set, outside the timing: e4m3 with 1 x 128
  scales for the tokens or h, 128 x 128 for the weights; bf16 out):
      tdist_fp8_us         the op's FP8 form (tdist.moe_ag_group_gemm_fp8 / moe_group_gemm_rs_fp8 / _ar_fp8)
      group_gemm_fp8_us    tdist.moe.grouped_gemm_fp8 alone on the quantised expert-ordered rows
      checked against the bf16 op and grouped GEMM (max |diff| / max |bf16| <= 0.1: FP8 rounding)

Where this torch has no torch._grouped_mm that runs bf16 on this GPU and matches a loop of per-expert
matmuls on a small problem (checked once, on every rank), the baseline and torch_grouped_mm_us use
that loop instead (grouped_mm_loop: one torch.matmul per non-empty expert; the AllGather baseline
reads the experts' row counts to the host, a synchronisation any loop over experts needs). The
table's header and the JSON's grouped_mm_baseline field (with grouped_mm_fallback_reason) say which
ran. The loop leaves the GPU idle, so the method timed after it also counts its own launch time.

Goals checked in the table (2 x H200): grouped GEMM >= 0.95x torch._grouped_mm's throughput (same
useful rows); at M >= 4096 tdist_us <= 1.10x (ag) / 1.12x (rs) group_gemm_us and >= 1.25x faster than
the baseline; at smaller M never slower than the baseline.

Method: every input set (--sets, default 3) has fresh routing and tokens drawn from the same seed on
every rank; every output is cross-checked before timing (tdist's op against the PyTorch sequence,
tdist's grouped GEMM against torch._grouped_mm: max |diff| / max |reference|, worst rank); then
--warmup calls of each method, and --iters rounds each calling every method once in an order that
rotates from round to round, round r on set r mod --sets; CUDA events around each call; the median per
method, the slowest rank's. A method that cannot run (a shape it refuses) is reported as null with its
error, and the others go on. NVLink multicast stays off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from . import _bench_world
from .moe import AG_METHODS, rs_method

MODELS = {
    # key: (name, hidden, intermediate, experts, topk)
    "mixtral": ("Mixtral-8x7B", 4096, 14336, 8, 2),
    "qwen3": ("Qwen3-30B-A3B", 2048, 768, 128, 8),
    "dsv2lite": ("DeepSeek-V2-Lite", 2048, 1408, 64, 6),
}
OPS = {"ag": "moe_ag_group_gemm", "rs": "moe_group_gemm_rs", "ar": "moe_group_gemm_ar"}
ROUTINGS = ("uniform", "skewed")
METHODS = ("tdist", "group_gemm", "baseline", "torch_grouped_mm")
FP8_METHODS = ("tdist_fp8", "group_gemm_fp8")  # --fp8
COLLECTIVE = ("tdist", "baseline")
# Goals (docs/moe.md, "Benchmark"): grouped GEMM throughput vs torch._grouped_mm; op time over the
# grouped GEMM alone at M >= kLargeM; baseline time over the op's, at M >= kLargeM and below it.
kGroupGemmVsTorch = 0.95
kOverhead = {"ag": 1.10, "rs": 1.12}
kSpeedupLarge, kSpeedupSmall = 1.25, 1.0
kLargeM = 4096
kCheckTol = 2e-2  # max |diff| / max |ref| between two bf16 results of fp32 accumulation
kFp8CheckTol = 0.1  # an FP8 result against the bf16 one: e4m3 rounding of both operands (2^-4 each at most)
GROUPED_MM = "torch._grouped_mm"
GROUPED_MM_LOOP = "loop of per-expert torch.matmul"


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m tdist.bench_moe", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--tokens", dest="m", default="1024,4096,16384",
                   help="comma-separated token counts M (all ranks); not --m, which torchrun takes for its own")
    p.add_argument("--routing", default=",".join(ROUTINGS), help="comma-separated: " + ", ".join(ROUTINGS))
    p.add_argument("--ops", default="ag,rs", help="comma-separated: " + ", ".join(OPS))
    p.add_argument("--fp8", action="store_true",
                   help="also time the FP8 forms of the op and of the grouped GEMM (tdist_fp8_us, group_gemm_fp8_us)")
    p.add_argument("--tdist-method", default="auto", choices=AG_METHODS,
                   help="method of moe_ag_group_gemm (moe_group_gemm_rs runs chunked for fused)")
    p.add_argument("--sets", type=int, default=3, help="input sets rotated over (fresh routing each)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls of every method first")
    p.add_argument("--iters", type=int, default=20, help="timed rounds (one call of every method each)")
    p.add_argument("--seed", type=int, default=0, help="base seed (routing and tokens: the same on every rank)")
    p.add_argument("--heap-size", default="8G", help="tdist's symmetric heap per rank")
    p.add_argument("--random", type=int, default=0, metavar="N",
                   help="N model shapes and token counts drawn from --seed (see random_cases) instead of "
                        "--models x --tokens x --routing")
    p.add_argument("--tp", type=int, default=0, metavar="N",
                   help="shards of the intermediate features (0: the world size; else a multiple of it). Above the "
                        "world size each rank computes one rank's share of a TP = N layer, without the other "
                        "ranks' communication: on one GPU, the per-rank problem of a larger layer")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON (rank 0)")
    args = p.parse_args(argv)

    args.models = _bench_world.pick(p, args.models, tuple(MODELS), "models")
    args.routing = _bench_world.pick(p, args.routing, ROUTINGS, "routing")
    args.ops = _bench_world.pick(p, args.ops, tuple(OPS), "ops")
    try:
        args.m = [int(x) for x in args.m.split(",") if x.strip()]
    except ValueError:
        p.error(f"--tokens must be comma-separated integers, got '{args.m}'")
    if not args.m or any(v <= 0 for v in args.m):
        p.error(f"--tokens values must be positive, got {args.m}")
    if args.sets < 1 or args.iters < 1 or args.warmup < 0:
        p.error("--sets and --iters must be at least 1, --warmup at least 0")
    if not 0 <= args.random <= 10000:
        p.error(f"--random: expected 0 (off) to 10000 cases, got {args.random}")
    if not 0 <= args.tp <= 64:
        p.error(f"--tp: expected 0 (the world size) to 64 shards, got {args.tp}")
    return args


# A drawn shape's weights (w13 and w2, bf16, one rank's shard of every expert) stay under this.
kRandomWeightBytes = 6 << 30


def random_cases(count, seed, world=1):
    """`count` cases (name, hidden, intermediate, experts, topk, m, routing) off the models' shapes,
    drawn from `seed` (splitmix64, as tdist.bench's random sweeps), log-uniform by octave: experts in
    [4, 256), top-k in [1, min(8, experts)], hidden in [1024, 8192) and intermediate in [256, 16384)
    as multiples of 8 (odd multiples included) with intermediate / world one as well, tokens in
    [128, 16384) as multiples of `world` (NCCL's equal parts), routing uniform or skewed; the experts
    halved until one rank's weights fit in kRandomWeightBytes. In the order drawn."""
    from .bench import SplitMix64, _check_count

    _check_count(count)
    if world < 1:
        raise ValueError(f"random_cases: world expects >= 1, got {world}")
    r = SplitMix64(seed)

    def octave(lo_min, octaves):
        lo = lo_min << r.below(octaves)
        return lo + r.below(lo)

    cases = []
    for _ in range(count):
        experts = octave(4, 6)
        topk = 1 + r.below(min(8, experts))
        hidden = max(1024, octave(1024, 3) // 8 * 8)
        inter = max(8 * world, octave(256, 6) // (8 * world) * (8 * world))
        m = max(world, octave(128, 7) // world * world)
        routing = ROUTINGS[r.below(len(ROUTINGS))]
        while experts > topk and experts * 3 * (inter // world) * hidden * 2 > kRandomWeightBytes:
            experts = max(topk, experts // 2)
        cases.append((f"E{experts}/k{topk}/{hidden}x{inter}", hidden, inter, experts, topk, m, routing))
    return cases


def _routing(torch, m, topk, experts, kind, seed):
    """(topk_ids int32 [m, topk], topk_weights float32 [m, topk]) on the host, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand((m, experts), generator=g)
    if kind == "skewed":
        hot = int(torch.randint(experts, (1,), generator=g))
        half = torch.randperm(m, generator=g)[:m // 2]
        scores[half, hot] = 2.0  # above every uniform score: one of these tokens' slots
    ids = scores.topk(topk, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn((m, topk), generator=g), dim=1)
    return ids, weights


def grouped_mm_loop(torch, a, w_t, counts, out=None):
    """torch._grouped_mm(a, w_t, offs) as a loop: rows [start(e), start(e) + counts[e]) of a times
    w_t[e] for every expert e (counts: ints on the host, adding up to a's rows; w_t [E, K, N]), into
    `out` [rows, N] (a new tensor when None)."""
    counts = [int(c) for c in counts]
    if len(counts) != w_t.shape[0] or any(c < 0 for c in counts) or sum(counts) != a.shape[0]:
        raise ValueError(f"grouped_mm_loop: counts {counts} do not split {a.shape[0]} rows over "
                         f"{w_t.shape[0]} experts")
    if out is None:
        out = a.new_empty((a.shape[0], w_t.shape[2]))
    start = 0
    for e, c in enumerate(counts):
        if c:  # an empty expert launches nothing
            torch.matmul(a[start:start + c], w_t[e], out=out[start:start + c])
        start += c
    return out


def counts_of_ends(ends):
    """Rows per expert from the end offsets torch._grouped_mm takes (ints, non-decreasing)."""
    ends = [int(v) for v in ends]
    return [b - a for a, b in zip([0] + ends[:-1], ends)]


def pick_grouped_mm(torch, grouped_mm, device):
    """(GROUPED_MM or GROUPED_MM_LOOP, reason or None): torch._grouped_mm (passed in, None when this
    torch lacks it) if it runs bf16 on `device` and agrees with grouped_mm_loop on a small problem
    with an empty expert, otherwise the loop and why."""
    if grouped_mm is None:
        return GROUPED_MM_LOOP, f"torch {torch.__version__} has no torch._grouped_mm"
    g = torch.Generator(device="cpu").manual_seed(5)
    counts = [40, 0, 88, 128]  # rows of each expert: one empty, one not a multiple of 16
    a = torch.randn((sum(counts), 64), generator=g).to(device=device, dtype=torch.bfloat16)
    w = torch.randn((len(counts), 48, 64), generator=g).to(device=device, dtype=torch.bfloat16)
    w_t = w.transpose(1, 2)  # as the benchmark passes it: [E, K, N], column-major per expert
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    try:
        got = grouped_mm(a, w_t, offs=ends)
    except Exception as e:  # noqa: BLE001 - any refusal means: not usable here
        return GROUPED_MM_LOOP, f"torch._grouped_mm fails on bf16 here: {_error_text(e)}"
    ref = grouped_mm_loop(torch, a, w_t, counts).float()
    if tuple(got.shape) != tuple(ref.shape) or got.dtype != torch.bfloat16:
        return GROUPED_MM_LOOP, (f"torch._grouped_mm gave {got.dtype} {tuple(got.shape)}, expected bf16 "
                                 f"{tuple(ref.shape)}")
    err = _rel_err(torch, got, ref)
    if not err <= kCheckTol:
        return GROUPED_MM_LOOP, f"torch._grouped_mm differs from the per-expert loop (max rel. error {err:.2g})"
    return GROUPED_MM, None


class _Set:
    """One input set of a (model, M, routing): the routing as both sides lay it out, and its tokens.

    ids / wts      int32 / float32 [M, topk] on the device (every rank alike)
    order          int64 [P = M topk]: the pairs (t k + slot) sorted by expert, stable (PyTorch's rows)
    offs           int32 [E]: the end of each expert's rows in that order (torch._grouped_mm's offs)
    counts         [E] ints on the host: each expert's rows in that order (the loop's split)
    offsets        int32 [E + 1]: tdist's expert-ordered rows, each expert padded to 128 (this rank's)
    perm           int64 [P]: tdist's row of PyTorch's row i (row_of_pair[order[i]])
    x_all, x_rows  bf16 [M, H] every token (every rank alike) and [M / W, H] this rank's
    capacity       rows of tdist's expert-ordered matrices
    """

    def __init__(self, torch, moe, dims, m, kind, seed, world, rank):
        hidden, experts, topk = dims["hidden"], dims["experts"], dims["topk"]
        dev = torch.device("cuda", torch.cuda.current_device())
        ids, wts = _routing(torch, m, topk, experts, kind, seed)
        ref = moe.routing_reference(ids, experts, world, rank)
        self.counts = torch.bincount(ids.view(-1).long(), minlength=experts).tolist()
        self.ids, self.wts = ids.to(dev), wts.to(dev)
        sorted_ids, self.order = torch.sort(self.ids.view(-1), stable=True)
        ends = torch.arange(1, experts + 1, dtype=torch.int32, device=dev)
        self.offs = torch.searchsorted(sorted_ids, ends, out_int32=True)
        self.offsets = torch.tensor(ref["offsets"], dtype=torch.int32, device=dev)
        row_of_pair = torch.tensor(ref["row_of_pair"], dtype=torch.int64, device=dev).view(-1)
        self.perm = row_of_pair[self.order]
        self.capacity = moe.capacity(m, topk, experts)
        g = torch.Generator(device=dev).manual_seed(seed)
        self.x_all = torch.randn((m, hidden), generator=g, device=dev).to(torch.bfloat16)
        self.x_rows = self.x_all[rank * (m // world):(rank + 1) * (m // world)]
        self.hseed = seed * 64 + 1 + rank  # this rank's h (rs, ar): its own shard's partial products


def _op_inputs(torch, op, s, dims):
    """(a_pad [capacity, K] in tdist's expert order, a_sorted [P, K] in PyTorch's) of op's grouped GEMM."""
    dev = s.ids.device
    if op == "ag":  # the gathered tokens: row i of PyTorch's is token order[i] // topk
        a_sorted = s.x_all.index_select(0, s.order // dims["topk"])
        a_pad = torch.zeros((s.capacity, dims["hidden"]), dtype=torch.bfloat16, device=dev)  # padding rows 0
        a_pad[s.perm] = a_sorted
    else:  # this rank's activations h; its padding rows hold numbers too (the op must not read them)
        g = torch.Generator(device=dev).manual_seed(s.hseed)
        a_pad = torch.randn((s.capacity, dims["f"]), generator=g, device=dev).to(torch.bfloat16)
        a_sorted = a_pad[s.perm]
    return a_pad, a_sorted


def _methods(torch, dist, tdist, op, sets, w, dims, args):
    """{method: call(i)} of one op on set i; the weights w [E, N, K] (w13 for ag, w2 otherwise)."""
    moe = tdist.moe
    world, m, topk, experts = dims["world"], dims["m"], dims["topk"], dims["experts"]
    w_t = w.transpose(1, 2)  # [E, K, N], column-major per expert: torch._grouped_mm's mat_b
    ends = torch.arange(1, experts + 1, dtype=torch.int32, device=w.device)

    def grouped_mm(a, offs, counts=None):
        """PyTorch's grouped GEMM of the sorted rows: torch._grouped_mm, or the loop (counts: the
        host's split; None: read from offs, a synchronisation)."""
        if dims["grouped_mm"] == GROUPED_MM:
            return torch._grouped_mm(a, w_t, offs=offs)
        return grouped_mm_loop(torch, a, w_t, counts if counts is not None else counts_of_ends(offs.tolist()))

    def group_gemm(i):
        return moe.grouped_gemm(sets[i]["a_pad"], w, sets[i]["s"].offsets)

    def torch_grouped_mm(i):
        s = sets[i]["s"]
        return grouped_mm(sets[i]["a_sorted"], s.offs, s.counts)

    if op == "ag":
        def tdist_op(i):
            s = sets[i]["s"]
            return tdist.moe_ag_group_gemm(s.x_rows, s.ids, w, method=args.tdist_method)

        def baseline(i):
            s = sets[i]["s"]
            full = torch.empty((m, dims["hidden"]), dtype=w.dtype, device=w.device)
            dist.all_gather_into_tensor(full, s.x_rows)
            sorted_ids, order = torch.sort(s.ids.view(-1), stable=True)
            offs = torch.searchsorted(sorted_ids, ends, out_int32=True)
            return grouped_mm(full.index_select(0, order // topk), offs)
    else:
        def tdist_op(i):
            s = sets[i]
            if op == "ar":
                return tdist.moe_group_gemm_ar(s["a_pad"], w, s["s"].ids, s["s"].wts)
            return tdist.moe_group_gemm_rs(s["a_pad"], w, s["s"].ids, s["s"].wts,
                                           method=rs_method(args.tdist_method))

        def baseline(i):
            s = sets[i]
            y = grouped_mm(s["a_sorted"], s["s"].offs, s["s"].counts)        # [P, H] in expert order
            y = y.index_select(0, s["inverse"])                                # pair order: t topk + slot
            out = torch.bmm(s["s"].wts.to(w.dtype).view(m, 1, topk), y.view(m, topk, -1)).view(m, -1)
            if op == "ar":
                dist.all_reduce(out)
                return out
            rows = torch.empty((m // world, out.shape[1]), dtype=w.dtype, device=w.device)
            dist.reduce_scatter_tensor(rows, out)
            return rows

    calls = {"tdist": tdist_op, "group_gemm": group_gemm, "baseline": baseline, "torch_grouped_mm": torch_grouped_mm}
    if args.fp8:
        calls.update(_fp8_methods(tdist, op, sets, moe.quantize_fp8_blocks(w), args))
    return calls


def _fp8_methods(tdist, op, sets, w_fp8, args):
    """{tdist_fp8, group_gemm_fp8: call(i)} of one op on set i, with its operands quantised (set i's
    "x_fp8" (this rank's tokens, ag) and "a_fp8" (the expert-ordered rows), w_fp8 the weights')."""
    moe = tdist.moe
    w_q, w_s = w_fp8
    for entry in sets:
        entry["a_fp8"] = moe.quantize_fp8_rows(entry["a_pad"], column_major=True)  # as ParallelMoE's h
        if op == "ag":
            entry["x_fp8"] = moe.quantize_fp8_rows(entry["s"].x_rows)

    def group_gemm_fp8(i):
        return moe.grouped_gemm_fp8(*sets[i]["a_fp8"], w_q, w_s, sets[i]["s"].offsets)

    def tdist_fp8(i):
        s = sets[i]
        if op == "ag":
            return tdist.moe_ag_group_gemm_fp8(*s["x_fp8"], s["s"].ids, w_q, w_s, method=args.tdist_method)
        if op == "ar":
            return tdist.moe_group_gemm_ar_fp8(*s["a_fp8"], w_q, w_s, s["s"].ids, s["s"].wts)
        return tdist.moe_group_gemm_rs_fp8(*s["a_fp8"], w_q, w_s, s["s"].ids, s["s"].wts,
                                           method=rs_method(args.tdist_method))

    return {"tdist_fp8": tdist_fp8, "group_gemm_fp8": group_gemm_fp8}


def _rel_err(torch, got, ref):
    """max |got - ref| / max |ref| (inf when got is not finite)."""
    got, ref = got.float(), ref.float()
    if got.shape != ref.shape or not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def _check(torch, op, outs, sets):
    """{method: max relative error} of set 0's outputs: tdist against the baseline, the grouped GEMM
    against torch._grouped_mm (tdist's rows taken in PyTorch's order), the FP8 forms against the bf16
    ones (rows up to the last expert's end only: the rest is not written)."""
    s = sets[0]["s"]
    errs = {}
    end = int(s.offsets[-1])
    for fp8, bf16 in (("tdist_fp8", "tdist"), ("group_gemm_fp8", "group_gemm")):
        if fp8 in outs and bf16 in outs:
            rows = end if op == "ag" or bf16 == "group_gemm" else outs[bf16].shape[0]
            errs[fp8] = _rel_err(torch, outs[fp8][:rows], outs[bf16][:rows])
    if "group_gemm" in outs and "torch_grouped_mm" in outs:
        errs["group_gemm"] = _rel_err(torch, outs["group_gemm"][s.perm], outs["torch_grouped_mm"])
    if "tdist" in outs and "baseline" in outs:
        got = outs["tdist"][s.perm] if op == "ag" else outs["tdist"]
        errs["tdist"] = _rel_err(torch, got, outs["baseline"])
    return errs


def _error_text(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _bench_op(torch, dist, tdist, op, sets, w, dims, args):
    """(times {method: us or None}, errors {method: text}, rel_err {method: float}) of one op."""
    calls = _methods(torch, dist, tdist, op, sets, w, dims, args)
    methods = tuple(calls)  # METHODS, then FP8_METHODS with --fp8
    outs, failed = {}, {}

    def try_call(name):
        try:
            outs[name] = calls[name](0)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported in the row; the other methods go on
            failed[name] = _error_text(e)
            torch.cuda.synchronize()

    # Local methods first: the baseline needs PyTorch's grouped GEMM, and a collective must start on
    # every rank or on none.
    for name in ("group_gemm", "torch_grouped_mm", "group_gemm_fp8"):
        if name in calls:
            try_call(name)
    if "torch_grouped_mm" in failed:
        failed["baseline"] = f"needs {dims['grouped_mm']}: " + failed["torch_grouped_mm"]
    ok = torch.tensor([0.0 if name in failed else 1.0 for name in methods], device=w.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    for name in COLLECTIVE + ("tdist_fp8",):
        if name in calls and ok[methods.index(name)] > 0:
            try_call(name)
    # Every rank runs the same methods (the collective ones wait for each other).
    ok = torch.tensor([0.0 if name in failed else 1.0 for name in methods], device=w.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    live = [name for name, flag in zip(methods, ok.tolist()) if flag > 0]
    for name in methods:
        if name not in live and name not in failed:
            failed[name] = "failed on another rank"
    errs = _check(torch, op, {k: v for k, v in outs.items() if k in live}, sets)
    outs.clear()
    err_t = torch.tensor([errs.get(name, -1.0) for name in methods], dtype=torch.float64, device=w.device)
    dist.all_reduce(err_t, op=dist.ReduceOp.MAX)  # the worst rank's (inf stays inf)
    rel = {name: v for name, v in zip(methods, err_t.tolist()) if v >= 0}

    nsets = len(sets)
    for i in range(args.warmup):
        for name in live:
            calls[name](i % nsets)
    torch.cuda.synchronize()
    dist.barrier()
    events = {name: [] for name in live}
    for it in range(args.iters):
        for name in live[it % len(live):] + live[:it % len(live)] if live else []:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            calls[name](it % nsets)
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    med = [statistics.median(s.elapsed_time(e) * 1000.0 for s, e in events[name]) if name in events else -1.0
           for name in methods]
    t = torch.tensor(med, dtype=torch.float64, device=w.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective op is as fast as its slowest rank
    times = {name: (v if name in live else None) for name, v in zip(methods, t.tolist())}
    return times, failed, rel


def _ratio(a, b):
    return a / b if a and b else None


def _goals(op, m, row):
    """{goal: True / False / None (not measured)} of one row."""
    def ratio(a, b):
        return row[a] / row[b] if row.get(a) and row.get(b) else None

    gg = ratio("torch_grouped_mm_us", "group_gemm_us")
    over = ratio("tdist_us", "group_gemm_us")
    speed = ratio("baseline_us", "tdist_us")
    goals = {"group_gemm_vs_torch": None if gg is None else gg >= kGroupGemmVsTorch}
    if op in kOverhead and m >= kLargeM:
        goals["tdist_over_group_gemm"] = None if over is None else over <= kOverhead[op]
    need = kSpeedupLarge if op in kOverhead and m >= kLargeM else kSpeedupSmall
    goals["speedup_vs_baseline"] = None if speed is None else speed >= need
    return goals, gg, over, speed


def main(argv=None) -> int:
    """Run the benchmark (under torchrun); rank 0 prints the table and writes the JSON."""
    args = _parse(argv)
    torch, dist = _bench_world.start("tdist.bench_moe")
    import tdist

    tdist.init(process_group=dist.group.WORLD, heap_size=args.heap_size)
    world, me = dist.get_world_size(), dist.get_rank()
    tp = args.tp or world
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    try:
        if tp % world:
            raise SystemExit(f"tdist.bench_moe: --tp {tp} is not a multiple of the world size {world}")
        grouped_mm, why = _pick_everywhere(torch, dist, dev)
        if me == 0 and why:
            print(f"tdist.bench_moe: PyTorch's grouped GEMM is a {grouped_mm} ({why})", file=sys.stderr, flush=True)
        if args.random:
            shapes = [((name, hidden, inter, experts, topk), [m], [kind])
                      for name, hidden, inter, experts, topk, m, kind in random_cases(args.random, args.seed, tp)]
        else:
            shapes = [(MODELS[model], args.m, args.routing) for model in args.models]
        for mi, ((name, hidden, inter, experts, topk), tokens, routings) in enumerate(shapes):
            if inter % tp or (inter // tp) % 8:
                if me == 0:
                    print(f"tdist.bench_moe: {name}: intermediate {inter} does not split into {tp} shards of a "
                          "multiple of 8; skipped", file=sys.stderr)
                continue
            f = inter // tp
            # This rank's shards: w13 [E, 2 F, H] (gate rows, then up rows), w2 [E, H, F].
            g = torch.Generator(device=dev).manual_seed(args.seed * 7919 + 97 * mi + 1 + me)
            w13 = (torch.randn((experts, 2 * f, hidden), generator=g, device=dev) * hidden ** -0.5).to(torch.bfloat16)
            w2 = (torch.randn((experts, hidden, f), generator=g, device=dev) * inter ** -0.5).to(torch.bfloat16)
            for m in tokens:
                if m % world:
                    if me == 0:
                        print(f"tdist.bench_moe: M={m} does not divide over {world} ranks (NCCL's "
                              "all_gather_into_tensor needs equal parts); skipped", file=sys.stderr)
                    continue
                for ri, kind in enumerate(routings):
                    dims = dict(hidden=hidden, f=f, experts=experts, topk=topk, m=m, world=world,
                                grouped_mm=grouped_mm)
                    seed0 = ((args.seed * 131 + mi) * 131 + m) * 7 + ri
                    bases = [_Set(torch, tdist.moe, dims, m, kind, seed0 * 16 + i, world, me) for i in range(args.sets)]
                    for op in args.ops:
                        sets = []
                        for s in bases:
                            a_pad, a_sorted = _op_inputs(torch, op, s, dims)
                            entry = {"s": s, "a_pad": a_pad, "a_sorted": a_sorted}
                            if op != "ag":
                                entry["inverse"] = torch.argsort(s.order)  # PyTorch's row of each pair
                            sets.append(entry)
                        w = w13 if op == "ag" else w2
                        times, failed, rel = _bench_op(torch, dist, tdist, op, sets, w, dims, args)
                        row = {"op": OPS[op], "model": name, "m": m, "routing": kind,
                               "tdist_us": times["tdist"], "group_gemm_us": times["group_gemm"],
                               "baseline_us": times["baseline"], "torch_grouped_mm_us": times["torch_grouped_mm"],
                               "grouped_mm_baseline": grouped_mm,
                               "n": w.shape[1], "k": w.shape[2], "experts": experts, "topk": topk,
                               "max_rel_err": {k: rel[k] for k in ("tdist", "group_gemm") + FP8_METHODS if k in rel}}
                        if args.fp8:
                            row.update({f"{k}_us": times.get(k) for k in FP8_METHODS})
                            row["ratios_fp8"] = {"op_bf16_over_fp8": _ratio(times["tdist"], times.get("tdist_fp8")),
                                                 "gg_bf16_over_fp8": _ratio(times["group_gemm"],
                                                                            times.get("group_gemm_fp8"))}
                        goals, gg, over, speed = _goals(op, m, row)
                        row["ratios"] = {"group_gemm_vs_torch": gg, "tdist_over_group_gemm": over,
                                         "speedup_vs_baseline": speed}
                        row["goals"] = goals
                        if failed:
                            row["errors"] = failed
                        bad = [k for k, v in row["max_rel_err"].items()
                               if not v <= (kFp8CheckTol if k in FP8_METHODS else kCheckTol)]
                        if bad:
                            row["check_failed"] = bad
                        rows.append(row)
                        if me == 0:
                            _print_row(row, len(rows) == 1, world, args, grouped_mm, tp)
                            for k, e in failed.items():
                                print(f"    {k}: {e}", file=sys.stderr, flush=True)
                        del sets
                    del bases
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            del w13, w2
        if me == 0:
            _print_summary(rows)
        if me == 0 and args.json:
            doc = {"world_size": world, "tp": tp, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "tdist": tdist.__version__, "dtype": "bf16" + (" and e4m3 (--fp8)" if args.fp8 else ""),
                   "command": " ".join(sys.argv),
                   "tdist_method": args.tdist_method, "sets": args.sets, "iters": args.iters,
                   "warmup": args.warmup, "seed": args.seed, "random": args.random,
                   "grouped_mm_baseline": grouped_mm, "grouped_mm_fallback_reason": why,
                   "statistic": "median of per-call CUDA-event times, methods alternating, max over ranks (us)",
                   "goals": {"group_gemm_vs_torch": f">= {kGroupGemmVsTorch}",
                             "tdist_over_group_gemm": {OPS[k]: f"<= {v} at m >= {kLargeM}"
                                                       for k, v in kOverhead.items()},
                             "speedup_vs_baseline": f">= {kSpeedupLarge} at m >= {kLargeM} (ag, rs), "
                                                    f">= {kSpeedupSmall} otherwise"},
                   "rows": rows}
            with open(args.json, "w") as fh:
                json.dump(doc, fh, indent=1)
            print(f"tdist.bench_moe: wrote {args.json}")
    finally:
        _bench_world.finish(dist)
    return 0


def _pick_everywhere(torch, dist, dev):
    """pick_grouped_mm on every rank; the loop everywhere if any rank cannot use torch._grouped_mm (the
    baseline is collective, so every rank runs the same sequence)."""
    name, why = pick_grouped_mm(torch, getattr(torch, "_grouped_mm", None), dev)
    ok = torch.tensor([1.0 if name == GROUPED_MM else 0.0], device=dev)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() > 0:
        return GROUPED_MM, None
    return GROUPED_MM_LOOP, why or "torch._grouped_mm is not usable on another rank"


def _fmt(v, width=10, spec=".1f"):
    return f"{v:>{width}{spec}}" if v is not None else f"{'-':>{width}}"


def _mark(ok):
    return " " if ok is None or ok else "!"


def _print_row(row, first, world, args, grouped_mm=GROUPED_MM, tp=None):
    if first:
        shards = "" if tp in (None, world) else f" (each one rank's share of TP {tp}, no other ranks' communication)"
        print(f"tdist.bench_moe: {world} ranks{shards}, bf16, median of {args.iters} alternating rounds over {args.sets} "
              f"input sets after {args.warmup} warm-up, slowest rank; tdist method={args.tdist_method}; "
              f"PyTorch's grouped GEMM (baseline, torch gg): {grouped_mm}")
        print(f"gg/torch: torch gg time over tdist's grouped GEMM (goal >= {kGroupGemmVsTorch}); "
              f"op/gg: op over the grouped GEMM alone (goal <= {kOverhead['ag']} ag, {kOverhead['rs']} rs at "
              f"M >= {kLargeM}); base/op: PyTorch sequence over the op (goal >= {kSpeedupLarge} at M >= "
              f"{kLargeM}, >= {kSpeedupSmall} below); ! misses its goal; err: max rel. error op / gg")
        head = (f"{'op':<18}{'model':<20}{'M':>6} {'routing':<8}{'tdist us':>10}{'gg us':>10}{'base us':>10}"
                f"{'torch gg':>10}{'gg/torch':>10}{'op/gg':>8}{'base/op':>9}  err")
        print(head)
        print("-" * (len(head) + 16))
    r, g = row["ratios"], row["goals"]
    err = row["max_rel_err"]
    print(f"{row['op']:<18}{row['model']:<20}{row['m']:>6} {row['routing']:<8}" + _fmt(row["tdist_us"])
          + _fmt(row["group_gemm_us"]) + _fmt(row["baseline_us"]) + _fmt(row["torch_grouped_mm_us"])
          + _fmt(r["group_gemm_vs_torch"], 9, ".2f") + _mark(g.get("group_gemm_vs_torch"))
          + _fmt(r["tdist_over_group_gemm"], 7, ".2f") + _mark(g.get("tdist_over_group_gemm"))
          + _fmt(r["speedup_vs_baseline"], 8, ".2f") + _mark(g.get("speedup_vs_baseline"))
          + f"  {_fmt(err.get('tdist'), 0, '.1e')} / {_fmt(err.get('group_gemm'), 0, '.1e')}"
          + _fp8_text(row) + ("  CHECK FAILED" if row.get("check_failed") else ""), flush=True)


def _fp8_text(row):
    """With --fp8: the FP8 op's and grouped GEMM's times, the bf16 ones over them, their errors."""
    if "tdist_fp8_us" not in row:
        return ""
    r, err = row["ratios_fp8"], row["max_rel_err"]
    return (f"  | fp8 op {_fmt(row['tdist_fp8_us'], 0)} us ({_fmt(r['op_bf16_over_fp8'], 0, '.2f')}x) gg "
            f"{_fmt(row['group_gemm_fp8_us'], 0)} us ({_fmt(r['gg_bf16_over_fp8'], 0, '.2f')}x) err "
            f"{_fmt(err.get('tdist_fp8'), 0, '.1e')} / {_fmt(err.get('group_gemm_fp8'), 0, '.1e')}")


def _print_summary(rows):
    met = missed = unmeasured = 0
    for row in rows:
        for ok in row["goals"].values():
            if ok is None:
                unmeasured += 1
            elif ok:
                met += 1
            else:
                missed += 1
    checks = sum(1 for row in rows if row.get("check_failed"))
    print(f"tdist.bench_moe: goals met {met}, missed {missed}, not measured {unmeasured}; "
          f"cross-checks failed {checks} of {len(rows)} rows", flush=True)
    for op in OPS.values():
        for key, small in (("group_gemm_vs_torch", True), ("tdist_over_group_gemm", False)):
            got = sorted((row["ratios"][key], row) for row in rows
                         if row["op"] == op and row["ratios"][key] is not None)
            if len(got) < 2:
                continue
            worst, w = got[0] if small else got[-1]
            print(f"  {op} {key}: {'lowest' if small else 'highest'} {worst:.3f} ({w['model']}, M={w['m']}, "
                  f"{w['routing']}), median {statistics.median(v for v, _ in got):.3f} over {len(got)} rows",
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
