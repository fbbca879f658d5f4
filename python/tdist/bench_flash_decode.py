"""Decode-attention benchmark: tdist.flash_decode on one GPU and sequence-parallel over the ranks,
beside what a serving engine runs without tdist, all from one run.

    torchrun --nproc-per-node 2 -m tdist.bench_flash_decode [--models 8b,70b] [--batch 1,8,32]
        [--kv-len 4K,32K,128K,512K,1M] [--page-size 16,64] [--flashinfer-path DIR] [--json FILE] [--plot FILE]
    python -m tdist.bench_flash_decode ...        (world size 1: the single-GPU rows only)
    python -m tdist.bench_flash_decode --random 40 --seed 7    (cases nobody tuned on, then a summary)

Cases: Llama-3-8B (32 query heads, 8 KV heads) and Llama-3-70B (64, 8), head dim 128, bf16, one
query token per sequence, every sequence kv_len tokens long (kv_len is the whole sequence; at world
size W each rank holds 1 / W of it, whole pages). A case whose cache does not fit in this GPU's free
memory is skipped and said so; SDPA, which needs its own contiguous copy, is left out alone where
only the paged cache fits. --random N runs N drawn cases (random_cases: model, batch, length, page
size) in place of the --batch x --kv-len grid, and ends with the baseline / tdist ratios over them.

Methods, all on the same cache:
  tdist             tdist.flash_decode over the paged cache (block table, pages in random order)
  tdist (W GPUs)    tdist.flash_decode(distributed=True): each rank its part, merged inside the call
  FlashInfer        flashinfer.BatchDecodeWithPagedKVCacheWrapper (NHD, the same pages and table)
                    over the whole cache on one GPU; both of its kernels (use_tensor_cores False:
                    CUDA cores, True: its prefill kernel on tensor cores) are timed and the faster
                    is the baseline (each is written too)
  per rank + NCCL   FlashInfer on the rank's pages, one NCCL all_gather of (out, lse), then
                    flashinfer.merge_states (FlashInfer's lse is base 2; the merge keeps that base)
  SDPA              torch's scaled_dot_product_attention over a contiguous cache [batch, kv_heads,
                    kv_len, head_dim], the GQA group folded into the query length
  HBM floor         the KV bytes read / this GPU's copy bandwidth (a 2 GiB device-to-device copy,
                    read + write bytes, measured in the same run)
Where FlashInfer cannot be imported or its JIT fails (the reason is printed and written), SDPA
takes its place: on one GPU, and per rank followed by the same all_gather and a log-sum-exp merge
in torch; the summary names the baseline used.

Checks: before any timing, every baseline's output (and log-sum-exp, natural log) is compared with
tdist's on this case's data (outputs poisoned with NaN first where the method writes into a buffer
given to it); a mismatch stops the run.

Timing: each method's call is captured in a CUDA graph (several calls, rotating over copies of the
cache when it is smaller than 3 x L2), replayed --iters times with methods alternating round by
round; the median per call, the slowest rank's (all_reduce MAX). Where a capture fails on any rank
every method is timed eagerly (CUDA events around each call) and the JSON says so.

Summary rows (--json): {"model", "batch", "kv_len", "page_size", "world", "tdist_us",
"baseline_1gpu" ("FlashInfer" or "SDPA"), "baseline_1gpu_us", "sdpa_1gpu_us", "per_rank_nccl_us"
(null at world 1), "hbm_floor_us"}, one row at world 1 (tdist on one GPU over the whole cache) and
one at the run's world size; at world W, hbm_floor_us is one rank's share of the bytes. The file is
rewritten after every case ("complete": false until the sweep ends), with the skipped cases, the
baseline used and why FlashInfer was not, the copy bandwidth and the timing mode.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

from . import _bench_world

MODELS = {
    # name: (label, query heads, KV heads)
    "8b": ("llama3-8b", 32, 8),
    "70b": ("llama3-70b", 64, 8),
}
HEAD_DIM = 128
ELEM_BYTES = 2  # bf16
MAX_SETS = 8  # copies of a small cache rotated through, so that each call reads it from HBM
WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace per wrapper (its recommended size)
LN2 = math.log(2.0)


def _int_list(text, what, p):
    out = []
    for x in text.split(","):
        x = x.strip()
        if not x:
            continue
        scale = 1
        if x[-1] in "kKmM":
            scale = 1024 if x[-1] in "kK" else 1024 * 1024
            x = x[:-1]
        try:
            v = int(x) * scale
        except ValueError:
            p.error(f"--{what}: expected comma-separated integers (K and M suffixes allowed), got '{text}'")
        if v < 1:
            p.error(f"--{what}: expected positive values, got {v}")
        out.append(v)
    if not out:
        p.error(f"--{what}: expected at least one value")
    return out


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m tdist.bench_flash_decode", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default="8b,70b", help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--batch", default=None, help="comma-separated batch sizes (default 1,8,32)")
    p.add_argument("--kv-len", default=None,
                   help="comma-separated tokens per sequence, the whole sequence over all ranks (default "
                        "4K,32K,128K,512K,1M)")
    p.add_argument("--random", type=int, default=0, metavar="N",
                   help="N cases drawn from --seed (model, batch, length, page size; see random_cases) in "
                        "place of the --batch x --kv-len grid")
    p.add_argument("--page-size", default="16,64", help="comma-separated page sizes (1..256)")
    p.add_argument("--baseline", default="auto", choices=("auto", "flashinfer", "sdpa"),
                   help="auto: FlashInfer where it imports and compiles, else SDPA; flashinfer: fail without it")
    p.add_argument("--flashinfer-path", default=None, metavar="DIR",
                   help="folder put first on sys.path to find flashinfer (default: $TDIST_FLASHINFER_PATH, "
                        "else .carry/flashinfer/site where it exists)")
    p.add_argument("--flashinfer-kernels", default="both", choices=("both", "tensor-cores", "cuda-cores"),
                   help="FlashInfer's decode kernels timed (use_tensor_cores True / False); the baseline "
                        "is the faster of those that build")
    p.add_argument("--warmup", type=int, default=3, help="untimed replays of every method first")
    p.add_argument("--iters", type=int, default=10, help="timed replays of every method (alternating)")
    p.add_argument("--min-graph-us", type=float, default=400.0,
                   help="calls per graph: enough for about this much HBM-floor time")
    p.add_argument("--mem-margin-gib", type=float, default=12.0,
                   help="free GPU memory kept aside when deciding whether a case fits")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--heap-size", default="1G", help="tdist's symmetric heap per rank (world size > 1)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the summary rows (rank 0)")
    p.add_argument("--plot", default=None, metavar="FILE", help="write the scaling plot (rank 0, matplotlib)")
    args = p.parse_args(argv)
    items = [x.strip() for x in args.models.split(",") if x.strip()]
    for x in items:
        if x not in MODELS:
            p.error(f"--models: unknown model '{x}' (expected {', '.join(MODELS)})")
    if not items:
        p.error("--models: expected at least one model")
    args.models = items
    if args.random and (args.batch is not None or args.kv_len is not None):
        p.error("--random N draws the batches and lengths: leave out --batch and --kv-len")
    if args.random and args.plot:
        p.error("--plot draws the --batch x --kv-len grid; with --random, write --json")
    if not 0 <= args.random <= 10000:
        p.error(f"--random: expected 0 (off) to 10000 cases, got {args.random}")
    args.batch = _int_list(args.batch or "1,8,32", "batch", p)
    args.kv_len = _int_list(args.kv_len or "4K,32K,128K,512K,1M", "kv-len", p)
    args.page_size = _int_list(args.page_size, "page-size", p)
    for ps in args.page_size:
        if ps > 256:
            p.error(f"--page-size: expected 1..256, got {ps}")
    for n in args.kv_len if not args.random else ():
        for ps in args.page_size:
            if n % ps:
                p.error(f"--kv-len {n} must be a multiple of every --page-size (got {ps})")
    if args.iters < 1 or args.warmup < 0 or args.min_graph_us <= 0 or args.mem_margin_gib < 0:
        p.error("--iters must be at least 1, --warmup and --mem-margin-gib at least 0, --min-graph-us positive")
    return args


def _fmt_len(n):
    return f"{n // (1 << 20)}M" if n % (1 << 20) == 0 else f"{n // 1024}K" if n % 1024 == 0 else str(n)


def random_cases(count, seed, models, page_sizes):
    """`count` cases (model, batch, kv_len, page_size) off the swept grid, drawn from `seed`
    (splitmix64, as tdist.bench's random sweeps): the model and page size uniformly from the lists,
    the batch in [1, 64) and the cache's tokens (batch x kv_len) in [4K, 4M) log-uniform by octave
    (up to 16 GiB of bf16 K and V at 8 KV heads), kv_len rounded down to whole pages, at least 8 (so
    that each of up to 8 ranks holds one); in the order drawn."""
    from .bench import SplitMix64, _check_count

    _check_count(count)
    if not models or not page_sizes:
        raise ValueError(f"random_cases: expected models and page sizes, got {models}, {page_sizes}")
    r = SplitMix64(seed)
    cases = []
    for _ in range(count):
        model = models[r.below(len(models))]
        page = page_sizes[r.below(len(page_sizes))]
        lo = 1 << r.below(6)
        batch = lo + r.below(lo)
        lo = 4096 << r.below(10)
        tokens = lo + r.below(lo)
        cases.append((model, batch, max(8 * page, tokens // batch // page * page), page))
    return cases


# ----------------------------------------------------------------------------------------------
# FlashInfer


def _flashinfer_path(args):
    if args.flashinfer_path:
        return args.flashinfer_path
    env = os.environ.get("TDIST_FLASHINFER_PATH")
    if env:
        return env
    default = os.path.join(".carry", "flashinfer", "site")
    return default if os.path.isdir(default) else None


def _import_flashinfer(args):
    """(module, None) or (None, why not)."""
    if args.baseline == "sdpa":
        return None, "--baseline sdpa"
    path = _flashinfer_path(args)
    if path:
        if not os.path.isdir(os.path.join(path, "flashinfer")):
            return None, f"--flashinfer-path {path}: no flashinfer package in it"
        sys.path.insert(0, os.path.abspath(path))
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - any import failure means: no FlashInfer here
        return None, f"import flashinfer: {type(e).__name__}: {e}"
    return flashinfer, None


class _FlashInfer:
    """FlashInfer's paged decode over one block table (NHD pages, like tdist's)."""

    def __init__(self, fi, torch, tensor_cores, device):
        self.fi, self.torch, self.tensor_cores = fi, torch, tensor_cores
        ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=bool(tensor_cores))

    def plan(self, table, page_size, q_heads, kv_heads):
        torch = self.torch
        batch, pages = int(table.shape[0]), int(table.shape[1])
        dev = table.device
        indptr = torch.arange(0, batch + 1, dtype=torch.int32, device=dev) * pages
        indices = table.reshape(-1).contiguous()
        last = torch.full((batch,), page_size, dtype=torch.int32, device=dev)  # kv_len % page_size == 0
        self.wrapper.plan(indptr, indices, last, q_heads, kv_heads, HEAD_DIM, page_size, pos_encoding_mode="NONE",
                          q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                          sm_scale=1.0 / math.sqrt(HEAD_DIM))

    def run(self, q, k_pool, v_pool, out=None, lse=None):
        """(out bf16 [batch, q_heads, head_dim], lse f32 [batch, q_heads], base 2)."""
        if out is not None:
            return self.wrapper.run(q, (k_pool, v_pool), out=out, lse=lse, return_lse=True)
        return self.wrapper.run(q, (k_pool, v_pool), return_lse=True)


FI_KERNELS = {"tensor-cores": 1, "cuda-cores": 0}  # use_tensor_cores of each FlashInfer decode kernel


def _probe_flashinfer(fi, torch, dist, kernels):
    """Builds (JIT) and runs FlashInfer's decode kernels and merge once on a tiny case on every rank;
    returns the use_tensor_cores settings that work everywhere (possibly none) and why the others
    do not."""
    reasons, good = [], []
    for tc in [FI_KERNELS[k] for k in (FI_KERNELS if kernels == "both" else (kernels,))]:
        why = None
        try:
            dev = torch.device("cuda", torch.cuda.current_device())
            pool = torch.randn(8, 16, 8, HEAD_DIM, device=dev, dtype=torch.bfloat16)
            table = torch.arange(8, dtype=torch.int32, device=dev).view(2, 4)
            q = torch.randn(2, 32, HEAD_DIM, device=dev, dtype=torch.bfloat16)
            w = _FlashInfer(fi, torch, tc, dev)
            w.plan(table, 16, 32, 8)
            o, s = w.run(q, pool, pool)
            fi.merge_states(torch.stack([o, o], 1).contiguous(), torch.stack([s, s], 1).contiguous())
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - JIT or runtime failure: try the next setting
            why = f"use_tensor_cores={tc}: {type(e).__name__}: {str(e)[:300]}"
            reasons.append(why)
        ok = torch.tensor([0.0 if why else 1.0], device="cuda")
        if dist is not None:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() > 0:
            good.append(tc)
        elif not why:
            reasons.append(f"use_tensor_cores={tc}: failed on another rank")
    return good, "; ".join(reasons) or None


# ----------------------------------------------------------------------------------------------
# SDPA


def _sdpa(torch, q, k_c, v_c):
    """SDPA over a contiguous cache [batch, kv_heads, len, d]; the GQA group is the query length
    (no mask, so the same attention), so no repeated K/V. -> [batch, q_heads, d]."""
    b, h, d = q.shape
    kh = k_c.shape[1]
    qg = q.view(b, kh, h // kh, d)
    out = torch.nn.functional.scaled_dot_product_attention(qg, k_c, v_c, scale=1.0 / math.sqrt(d))
    return out.reshape(b, h, d)  # the flash backend's output may be [b, g, kh, d] in memory


def _sdpa_lse(torch, q, k_c, v_c):
    """(out, lse natural) of one rank's part through torch's flash-attention op, which returns the
    log-sum-exp (the public SDPA does not)."""
    b, h, d = q.shape
    kh = k_c.shape[1]
    qg = q.view(b, kh, h // kh, d)
    res = torch.ops.aten._scaled_dot_product_flash_attention(qg, k_c, v_c, 0.0, False, False,
                                                            scale=1.0 / math.sqrt(d))
    return res[0].reshape(b, h, d), res[1].reshape(b, h)


# ----------------------------------------------------------------------------------------------
# timing


class _Timer:
    """Captures each method (a function of the rotation index) into a CUDA graph of `reps` calls,
    or runs it eagerly, and times rounds of all methods alternating."""

    def __init__(self, torch, dist, args):
        self.torch, self.dist, self.args = torch, dist, args
        self.use_graphs = True

    def _all_ok(self, ok):
        t = self.torch.tensor([1.0 if ok else 0.0], device="cuda")
        if self.dist is not None:
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return t.item() > 0

    def time(self, methods, reps, sets):
        """{name: median us per call, slowest rank} for methods {name: fn(i)}; same order on all ranks."""
        torch = self.torch
        names = list(methods)
        for name in names:  # warm-up outside any capture: JIT, allocations, NCCL communicators
            for i in range(sets):
                methods[name](i)
        torch.cuda.synchronize()
        graphs = {}
        if self.use_graphs:
            failed = None
            for name in names:
                try:
                    g = torch.cuda.CUDAGraph()
                    # thread_local: other threads' CUDA calls (NCCL's watchdog) do not void the capture
                    with torch.cuda.graph(g, capture_error_mode="thread_local"):
                        for i in range(reps):
                            methods[name](i % sets)
                    graphs[name] = g
                except Exception as e:  # noqa: BLE001 - fall back to eager timing on every rank
                    failed = f"{name}: {type(e).__name__}: {str(e)[:200]}"
                    break
            torch.cuda.synchronize()
            if not self._all_ok(failed is None):
                self.use_graphs = False
                graphs = {}
                if failed:
                    print(f"tdist.bench_flash_decode: CUDA graph capture failed ({failed}); timing eagerly",
                          file=sys.stderr)
        reps_eff = reps if self.use_graphs else 1

        def call(name, it):
            if self.use_graphs:
                graphs[name].replay()
            else:
                methods[name](it % sets)

        for _ in range(self.args.warmup):
            for name in names:
                call(name, 0)
        torch.cuda.synchronize()
        if self.dist is not None:
            self.dist.barrier()
        events = {n: [] for n in names}
        for it in range(self.args.iters):
            order = names[it % len(names):] + names[:it % len(names)]
            for name in order:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                call(name, it)
                e.record()
                events[name].append((s, e))
        torch.cuda.synchronize()
        med = torch.tensor([statistics.median(s.elapsed_time(e) * 1e3 / reps_eff for s, e in events[n])
                            for n in names], dtype=torch.float64, device="cuda")
        if self.dist is not None:
            self.dist.all_reduce(med, op=self.dist.ReduceOp.MAX)
        return dict(zip(names, med.tolist()))


def _copy_bandwidth(torch, dist, args):
    """This GPU's device-to-device copy bandwidth in bytes/s (read + write), 2 GiB, slowest rank."""
    n = 1 << 31  # as bench/flash_decode.cu
    src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    timer = _Timer(torch, dist, args)
    timer.use_graphs = False
    us = timer.time({"copy": lambda i: dst.copy_(src)}, 1, 1)["copy"]
    return 2.0 * n / (us * 1e-6)


# ----------------------------------------------------------------------------------------------
# checks


def _check(what, out, ref, lse=None, ref_lse=None):
    """Raises SystemExit naming the method when out (and lse, natural log) differ from tdist's."""
    o, r = out.float(), ref.float()
    if not bool(o.isfinite().all()):
        raise SystemExit(f"tdist.bench_flash_decode: {what}: non-finite output (poisoned NaN left or overflow)")
    scale = float(r.abs().max()) + 1e-6
    err = float((o - r).abs().max())
    # bf16 outputs: 2^-8 relative each, plus different summation orders
    if err > 2e-2 * scale:
        raise SystemExit(f"tdist.bench_flash_decode: {what}: output differs from tdist's by {err:.3g} "
                         f"(largest |out| {scale:.3g}, allowed {2e-2 * scale:.3g})")
    if lse is not None:
        d = float((lse.float() - ref_lse.float()).abs().max())
        if not math.isfinite(d) or d > 1e-2:
            raise SystemExit(f"tdist.bench_flash_decode: {what}: log-sum-exp differs from tdist's by {d:.3g}")


# ----------------------------------------------------------------------------------------------
# one case


class _Case:
    """The data of one (model, batch, kv_len): the contiguous cache for SDPA (where it fits), the
    paged pools of each page size (built from it, or random where it does not fit), copies for the
    rotation when the cache is small."""

    def __init__(self, torch, model, batch, kv_len, world, rank, args, l2_bytes):
        self.torch = torch
        self.label, self.q_heads, self.kv_heads = MODELS[model]
        self.batch, self.kv_len, self.world, self.rank = batch, kv_len, world, rank
        self.kv_bytes = 2 * batch * kv_len * self.kv_heads * HEAD_DIM * ELEM_BYTES  # K and V
        self.sets = max(1, min(MAX_SETS, math.ceil(3 * l2_bytes / self.kv_bytes)))
        self.gen = torch.Generator(device="cuda").manual_seed(args.seed + batch * 7919 + kv_len)
        dev = torch.device("cuda", torch.cuda.current_device())
        self.dev = dev
        # every rank the same q (the sequence-parallel op's contract) and the same cache
        self.q = torch.randn(batch, self.q_heads, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=self.gen)
        self.contig = None

    def make_contig(self):
        """k, v [sets][batch, kv_heads, kv_len, head_dim] (SDPA's layout)."""
        torch = self.torch
        shape = (self.batch, self.kv_heads, self.kv_len, HEAD_DIM)
        k = torch.randn(shape, device=self.dev, dtype=torch.bfloat16, generator=self.gen)
        v = torch.randn(shape, device=self.dev, dtype=torch.bfloat16, generator=self.gen)
        self.contig = ([k] + [k.clone() for _ in range(self.sets - 1)], [v] + [v.clone() for _ in range(self.sets - 1)])

    def make_pool(self, page_size):
        """Paged pools k, v [sets][num_pages, page_size, kv_heads, head_dim] and the block table
        i32 [batch, pages per sequence] (pages in random order); from the contiguous cache when it
        exists, so that SDPA and the paged methods read the same tokens."""
        torch = self.torch
        pages = self.kv_len // page_size
        num_pages = self.batch * pages
        perm = torch.randperm(num_pages, device=self.dev, generator=self.gen).to(torch.int32)
        table = perm.view(self.batch, pages).contiguous()
        shape = (num_pages, page_size, self.kv_heads, HEAD_DIM)
        pools = []
        for which in range(2):
            if self.contig is not None:
                pool = torch.empty(shape, device=self.dev, dtype=torch.bfloat16)
                src_all = self.contig[which][0]
                for b in range(self.batch):  # one sequence at a time: no second whole copy
                    src = src_all[b].view(self.kv_heads, pages, page_size, HEAD_DIM).permute(1, 2, 0, 3)
                    pool.index_copy_(0, table[b].long(), src)
            else:
                pool = torch.randn(shape, device=self.dev, dtype=torch.bfloat16, generator=self.gen)
            pools.append([pool] + [pool.clone() for _ in range(self.sets - 1)])
        return pools[0], pools[1], table

    def rank_pages(self, pages):
        """This rank's whole pages of every sequence: [first, last)."""
        return pages * self.rank // self.world, pages * (self.rank + 1) // self.world


def _run_case(ctx, case, page_size, sdpa_cached):
    """Times one (model, batch, kv_len, page_size); returns the (world 1, world W) summary rows."""
    torch, dist, args, world = ctx["torch"], ctx["dist"], ctx["args"], case.world
    tdist = ctx["tdist"]
    fi_tcs = ctx["fi_tcs"]  # FlashInfer's decode kernels that build here (use_tensor_cores values)
    fi = ctx["fi"] if fi_tcs else None
    B, H, KH = case.batch, case.q_heads, case.kv_heads
    kpool, vpool, table = case.make_pool(page_size)
    pages = int(table.shape[1])
    p0, p1 = case.rank_pages(pages)
    my_table = table[:, p0:p1].contiguous()
    full_lens = torch.full((B,), case.kv_len, dtype=torch.int32, device=case.dev)
    my_lens = torch.full((B,), (p1 - p0) * page_size, dtype=torch.int32, device=case.dev)
    q = case.q

    # reference: tdist on one GPU over the whole cache
    ref_out, ref_lse = tdist.flash_decode(q, kpool[0], vpool[0], full_lens, table)
    ctx["check_errors"]()

    methods = {"tdist_1": lambda i: tdist.flash_decode(q, kpool[i], vpool[i], full_lens, table)}
    for tc in fi_tcs:
        fi_full = _FlashInfer(fi, torch, tc, case.dev)
        fi_full.plan(table, page_size, H, KH)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((B, H), float("nan"), dtype=torch.float32, device=case.dev)
        fi_full.run(q, kpool[0], vpool[0], out=out, lse=lse)
        _check(f"FlashInfer use_tensor_cores={tc} (1 GPU, page {page_size})", out, ref_out, lse * LN2, ref_lse)
        methods[f"fi_1_{tc}"] = lambda i, w=fi_full: w.run(q, kpool[i], vpool[i])
    if case.contig is not None and sdpa_cached is None:
        kc, vc = case.contig
        _check("SDPA (1 GPU)", _sdpa(torch, q, kc[0], vc[0]), ref_out)
        methods["sdpa_1"] = lambda i: _sdpa(torch, q, kc[i], vc[i])

    if world > 1:
        dist_out, dist_lse = tdist.flash_decode(q, kpool[0], vpool[0], my_lens, my_table, distributed=True)
        ctx["check_errors"]()
        _check(f"tdist distributed ({world} ranks)", dist_out, ref_out, dist_lse, ref_lse)
        methods["tdist_w"] = lambda i: tdist.flash_decode(q, kpool[i], vpool[i], my_lens, my_table,
                                                          distributed=True)
        out_bytes, lse_bytes = B * H * HEAD_DIM * ELEM_BYTES, B * H * 4
        send = torch.empty(out_bytes + lse_bytes, dtype=torch.uint8, device=case.dev)
        recv = torch.empty(world * (out_bytes + lse_bytes), dtype=torch.uint8, device=case.dev)  # rank-major
        parts = recv.view(world, out_bytes + lse_bytes)

        def gather(o, s):
            """[batch, world, ...] views of every rank's (out, lse): one NCCL all_gather of the bytes."""
            send[:out_bytes].copy_(o.reshape(-1).view(torch.uint8))
            send[out_bytes:].copy_(s.reshape(-1).view(torch.uint8))
            dist.all_gather_into_tensor(recv, send)
            v = parts[:, :out_bytes].reshape(world, B, H, HEAD_DIM * ELEM_BYTES).transpose(0, 1).contiguous()
            l_ = parts[:, out_bytes:].reshape(world, B, H, 4).transpose(0, 1).contiguous()
            return v.view(torch.bfloat16), l_.view(torch.float32).reshape(B, world, H)

        per_rank = {}
        for tc in fi_tcs:
            fi_rank = _FlashInfer(fi, torch, tc, case.dev)
            fi_rank.plan(my_table, page_size, H, KH)

            def fi_per_rank(i, w=fi_rank):
                o, s = w.run(q, kpool[i], vpool[i])
                v, l2 = gather(o, s)
                return fi.merge_states(v, l2)  # base-2 log-sum-exp in and out
            per_rank[f"rank_w_{tc}"] = fi_per_rank
        if fi is None and case.contig is not None:
            kc, vc = case.contig
            t0, t1 = p0 * page_size, p1 * page_size

            def sdpa_per_rank(i):
                o, s = _sdpa_lse(torch, q, kc[i][:, :, t0:t1], vc[i][:, :, t0:t1])
                v, ln = gather(o, s)
                m = torch.logsumexp(ln, dim=1)  # [B, H], natural log
                w = torch.exp(ln - m[:, None])  # [B, world, H]
                return (v.float() * w[..., None]).sum(1).to(torch.bfloat16), m
            per_rank["rank_w_sdpa"] = sdpa_per_rank
        for name, fn in per_rank.items():
            o, s = fn(0)
            _check(f"per rank + NCCL, {name} ({world} ranks)", o, ref_out, s * LN2 if fi is not None else s,
                   ref_lse)
            methods[name] = fn

    floor_bw = ctx["copy_bw"]
    reps = max(1, min(64, math.ceil(args.min_graph_us * 1e-6 * floor_bw / case.kv_bytes)))
    times = ctx["timer"].time(methods, reps, case.sets)
    if "sdpa_1" in times:
        sdpa_cached = times["sdpa_1"]
    base_name = "FlashInfer" if fi is not None else "SDPA"

    def best(prefix):
        got = [v for k, v in times.items() if k.startswith(prefix)]
        return min(got) if got else None
    base_1 = best("fi_1_") if fi is not None else sdpa_cached
    fi_detail = {k: {tc: times.get(f"{p}{tc}") for tc in fi_tcs} for k, p in
                 (("flashinfer_1gpu_us", "fi_1_"), ("flashinfer_per_rank_nccl_us", "rank_w_"))}
    fi_detail = {k: {("tensor_cores" if tc else "cuda_cores"): v for tc, v in d.items()} for k, d in fi_detail.items()}
    common = dict(model=case.label, batch=B, kv_len=case.kv_len, page_size=page_size)
    rows = [dict(common, world=1, tdist_us=times["tdist_1"], baseline_1gpu=base_name, baseline_1gpu_us=base_1,
                 sdpa_1gpu_us=sdpa_cached, per_rank_nccl_us=None, hbm_floor_us=case.kv_bytes / floor_bw * 1e6,
                 kv_bytes=case.kv_bytes, flashinfer_1gpu_us=fi_detail["flashinfer_1gpu_us"])]
    if world > 1:
        my_bytes = case.kv_bytes * (p1 - p0) // pages
        rows.append(dict(common, world=world, tdist_us=times["tdist_w"], baseline_1gpu=base_name,
                         baseline_1gpu_us=base_1, sdpa_1gpu_us=sdpa_cached, per_rank_nccl_us=best("rank_w_"),
                         hbm_floor_us=my_bytes / floor_bw * 1e6, kv_bytes=my_bytes,
                         flashinfer_per_rank_nccl_us=fi_detail["flashinfer_per_rank_nccl_us"]))
    return rows, sdpa_cached


# ----------------------------------------------------------------------------------------------
# plot


def plot_summary(rows, path, page_size=None, title=None):
    """Time against KV length, log-log: one panel per (model, batch), tdist and the baselines on 1
    GPU and on the run's world size. rows: the summary rows; page_size: the one plotted (default the
    smallest present)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise ValueError("plot_summary: no rows to plot")
    if page_size is None:
        page_size = min(r["page_size"] for r in rows)
    rows = [r for r in rows if r["page_size"] == page_size]
    models = list(dict.fromkeys(r["model"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    worlds = sorted({r["world"] for r in rows})
    wmax = worlds[-1]
    fig, axes = plt.subplots(len(models), len(batches), figsize=(4.2 * len(batches), 3.6 * len(models)),
                             squeeze=False)
    base_name = next((r["baseline_1gpu"] for r in rows if r.get("baseline_1gpu")), "baseline")
    series = [  # (label, world, key, style)
        ("tdist, 1 GPU", 1, "tdist_us", dict(color="tab:blue", marker="o")),
        (f"{base_name}, 1 GPU", 1, "baseline_1gpu_us", dict(color="tab:orange", marker="s")),
        ("SDPA, 1 GPU", 1, "sdpa_1gpu_us", dict(color="tab:green", marker="^")),
        ("HBM floor, 1 GPU", 1, "hbm_floor_us", dict(color="gray", linestyle="--")),
    ]
    if wmax > 1:
        series += [
            (f"tdist, {wmax} GPUs", wmax, "tdist_us", dict(color="tab:blue", marker="o", linestyle=":")),
            (f"{base_name} per rank + NCCL, {wmax} GPUs", wmax, "per_rank_nccl_us",
             dict(color="tab:orange", marker="s", linestyle=":")),
            (f"HBM floor, {wmax} GPUs", wmax, "hbm_floor_us", dict(color="gray", linestyle=":")),
        ]
    for i, model in enumerate(models):
        for j, batch in enumerate(batches):
            ax = axes[i][j]
            for label, world, key, style in series:
                pts = sorted((r["kv_len"], r[key]) for r in rows if r["model"] == model and r["batch"] == batch
                             and r["world"] == world and r.get(key) is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, markersize=4, **style)
            ax.set_xscale("log", base=2)
            lens = sorted({r["kv_len"] for r in rows})
            ax.set_xticks(lens, [_fmt_len(n) for n in lens])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_title(f"{model}, batch {batch}", fontsize=10)
            ax.set_xlabel("KV length (tokens per sequence)")
            ax.set_ylabel("time per decode step (us)")
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    fig.suptitle(title or f"decode attention, bf16, head dim {HEAD_DIM}, page size {page_size}", fontsize=11)
    fig.tight_layout(rect=(0, 0.06 + 0.03 * ((len(labels) - 1) // 4), 1, 0.96))
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# main


def _fmt(v, width=10):
    return f"{v:>{width}.1f}" if v is not None else f"{'-':>{width}}"


def _print_header(ctx):
    a = ctx["args"]
    print(f"tdist.bench_flash_decode: {ctx['gpu']}, {ctx['world']} ranks, bf16, head dim {HEAD_DIM}; copy "
          f"bandwidth {ctx['copy_bw'] / 1e9:.0f} GB/s; baseline {ctx['baseline']}"
          + (f" (kernels: {', '.join('tensor cores' if tc else 'CUDA cores' for tc in ctx['fi_tcs'])}; the faster)"
             if ctx["fi_tcs"] else "") + (f" (FlashInfer: {ctx['fi_why']})" if ctx["fi_why"] else "")
          + f"; median of {a.iters} alternating replays (CUDA graphs), slowest rank")
    print(f"{'model':<11}{'batch':>6}{'kv_len':>7}{'page':>5}{'world':>6}{'tdist us':>10}{'base us':>10}"
          f"{'sdpa us':>10}{'rank+nccl':>10}{'floor us':>10}{'of floor':>9}{'base/tdist':>11}")


def _print_row(r):
    ratio_ref = r["per_rank_nccl_us"] if r["world"] > 1 else r["baseline_1gpu_us"]
    ratio = f"{ratio_ref / r['tdist_us']:>10.2f}x" if ratio_ref else f"{'-':>11}"
    print(f"{r['model']:<11}{r['batch']:>6}{_fmt_len(r['kv_len']):>7}{r['page_size']:>5}{r['world']:>6}"
          + _fmt(r["tdist_us"]) + _fmt(r["baseline_1gpu_us"] if r["world"] == 1 else None)
          + _fmt(r["sdpa_1gpu_us"] if r["world"] == 1 else None) + _fmt(r["per_rank_nccl_us"])
          + _fmt(r["hbm_floor_us"]) + f"{100.0 * r['hbm_floor_us'] / r['tdist_us']:>8.0f}%" + ratio, flush=True)


def _print_random_summary(rows):
    """FlashInfer (or SDPA) / tdist over the drawn cases at world 1, and per rank + NCCL / tdist at
    the run's world size: lowest, median, and the cases below 0.95."""
    for world in sorted({r["world"] for r in rows}):
        key = "baseline_1gpu_us" if world == 1 else "per_rank_nccl_us"
        got = [(r[key] / r["tdist_us"], r) for r in rows if r["world"] == world and r.get(key)]
        if not got:
            continue
        got.sort(key=lambda x: x[0])
        worst, r = got[0]
        below = [f"{x['model']} b{x['batch']} {_fmt_len(x['kv_len'])} p{x['page_size']}: {v:.3f}"
                 for v, x in got if v < 0.95]
        what = "baseline / tdist" if world == 1 else "per rank + NCCL / tdist"
        print(f"random cases, world {world}, {what} over {len(got)}: lowest {worst:.3f} ({r['model']} batch "
              f"{r['batch']} kv_len {_fmt_len(r['kv_len'])} page {r['page_size']}), median "
              f"{statistics.median(v for v, _ in got):.3f}; below 0.95: {', '.join(below) or 'none'}", flush=True)


def _write_json(args, ctx, rows, skipped, argv, complete):
    timer, fi_tcs, fi, why = ctx["timer"], ctx["fi_tcs"], ctx["fi"], ctx["fi_why"]
    doc = {"bench": "flash_decode_summary", "gpu": ctx["gpu"], "world_size": ctx["world"], "dtype": "bf16",
           "head_dim": HEAD_DIM, "baseline": ctx["baseline"],
           "flashinfer": getattr(fi, "__version__", None) if fi_tcs else None,
           "flashinfer_kernels": [("tensor_cores" if tc else "cuda_cores") for tc in fi_tcs],
           "flashinfer_unavailable": why,
           "copy_gbps": ctx["copy_bw"] / 1e9, "timing": "cuda graphs" if timer.use_graphs else "eager",
           "iters": args.iters, "warmup": args.warmup,
           "statistic": "median per call over alternating replays, max over ranks (us)",
           "command": " ".join(["python", "-m", "tdist.bench_flash_decode"]
                               + (sys.argv[1:] if argv is None else list(argv))),
           "complete": complete, "skipped": skipped, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, args.json)


def main(argv=None) -> int:
    """Run the benchmark; rank 0 prints the table and writes the JSON and the plot."""
    args = _parse(argv)
    # FlashInfer's JIT: nvcc's own threads per file (ninja runs the files in parallel)
    os.environ.setdefault("FLASHINFER_NVCC_THREADS", "4")

    import importlib

    torch, dist = _bench_world.start("tdist.bench_flash_decode")
    import tdist

    world, me = dist.get_world_size(), dist.get_rank()
    if world > 1:
        tdist.init(process_group=dist.group.WORLD, heap_size=args.heap_size)
    pdist = dist if world > 1 else None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    fi, why = _import_flashinfer(args)
    imported = torch.tensor([1.0 if fi is not None else 0.0], device="cuda")
    if pdist is not None:  # every rank must agree: the per-rank baseline is collective
        pdist.all_reduce(imported, op=dist.ReduceOp.MIN)
    if imported.item() == 0 and fi is not None:
        fi, why = None, "import flashinfer failed on another rank"
    fi_tcs = []
    if fi is not None:
        fi_tcs, why = _probe_flashinfer(fi, torch, pdist, args.flashinfer_kernels)
        if why and me == 0:
            print(f"tdist.bench_flash_decode: FlashInfer: {why}", file=sys.stderr)
    if not fi_tcs and args.baseline == "flashinfer":
        raise SystemExit(f"tdist.bench_flash_decode: --baseline flashinfer, but FlashInfer is unavailable: {why}")
    timer = _Timer(torch, pdist, args)
    ctx = dict(torch=torch, dist=dist, tdist=tdist, args=args,
               check_errors=importlib.import_module("tdist.flash_decode").check_errors, world=world, timer=timer,
               fi=fi, fi_tcs=fi_tcs, fi_why=why, baseline="FlashInfer" if fi_tcs else "SDPA", gpu=props.name)
    ctx["copy_bw"] = _copy_bandwidth(torch, pdist, args)
    l2 = int(getattr(props, "L2_cache_size", 50 << 20))
    rows, skipped = [], []
    if me == 0:
        _print_header(ctx)
    if args.random:
        cases = [(m, b, n, [ps]) for m, b, n, ps in random_cases(args.random, args.seed, args.models,
                                                                 args.page_size)]
    else:
        cases = [(m, b, n, args.page_size) for m in args.models for b in args.batch for n in args.kv_len]
    try:
        for model, batch, kv_len, page_sizes in cases:
            _, _, kv_heads = MODELS[model]
            kv_bytes = 2 * batch * kv_len * kv_heads * HEAD_DIM * ELEM_BYTES
            sets = max(1, min(MAX_SETS, math.ceil(3 * l2 / kv_bytes)))
            torch.cuda.empty_cache()  # what the allocator caches counts as free here
            free, _ = torch.cuda.mem_get_info()
            budget = torch.tensor([free - args.mem_margin_gib * (1 << 30) - 2 * WORKSPACE_BYTES],
                                  dtype=torch.float64, device="cuda")
            if pdist is not None:
                dist.all_reduce(budget, op=dist.ReduceOp.MIN)
            budget = budget.item()
            label = f"{MODELS[model][0]} batch {batch} kv_len {_fmt_len(kv_len)}"
            if sets * kv_bytes > budget:
                skipped.append(f"{label}: cache {kv_bytes / 2**30:.1f} GiB does not fit "
                               f"({max(budget, 0) / 2**30:.1f} GiB free)")
                if me == 0:
                    print(f"  skipped {skipped[-1]}", flush=True)
                continue
            case = _Case(torch, model, batch, kv_len, world, me, args, l2)
            if 2 * sets * kv_bytes <= budget:
                case.make_contig()
            elif me == 0:
                print(f"  {label}: SDPA left out (no room for its contiguous copy beside the pages)",
                      flush=True)
            sdpa_cached = None
            for page_size in page_sizes:
                case_rows, sdpa_cached = _run_case(ctx, case, page_size, sdpa_cached)
                for r in case_rows:
                    rows.append(r)
                    if me == 0:
                        _print_row(r)
            del case
            if me == 0 and args.json:  # so far: a run stopped later keeps what it measured
                _write_json(args, ctx, rows, skipped, argv, complete=False)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if me == 0 and args.random:
            _print_random_summary(rows)
        if me == 0 and args.json:
            _write_json(args, ctx, rows, skipped, argv, complete=True)
            print(f"tdist.bench_flash_decode: wrote {args.json}")
        if me == 0 and args.plot and rows:
            plot_summary(rows, args.plot)
            print(f"tdist.bench_flash_decode: wrote {args.plot}")
    finally:
        _bench_world.finish(dist, tdist_initialised=world > 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
