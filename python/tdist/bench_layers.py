"""Model-layer benchmark: a Llama-style decoder layer, and a sparse MoE block, in sequence + tensor
parallelism, tdist.nn beside PyTorch's ways of running the same layer.

    torchrun --nproc-per-node 2 -m tdist.bench_layers [--models 8b,70b] [--tokens 2048,4096,8192,16384]
        [--layers decoder,attention,mlp] [--passes fwd,fwd+bwd] [--iters 20] [--json FILE] [--summary FILE]
    torchrun --nproc-per-node 2 -m tdist.bench_layers --layers moe [--models qwen3,dsv2lite]
        [--moe-routing uniform|skewed] [--tdist-method auto|chunked|baseline] ...

--models takes Llama keys (8b, 70b: layers decoder, attention, mlp) and MoE keys (qwen3, dsv2lite,
mixtral: layer moe); each layer runs on the models of its kind. Without --models: 8b,70b for the Llama
layers, qwen3,dsv2lite for moe; without --layers: the layers of the given models' kinds (decoder,
attention, mlp when neither is given).

The layer (this rank's shard at TP = world size; activations between blocks sequence-sharded):
RMSNorm -> qkv projection (colwise, q/k/v weights fused into one) -> causal SDPA over this rank's
heads (k/v heads repeated for grouped-query attention) -> o projection (rowwise) -> residual ->
RMSNorm -> gate/up projection (colwise, fused) -> SiLU(gate) * up -> down projection (rowwise) ->
residual. Shapes: Llama-3-8B (hidden 4096, 32 heads, 8 kv heads, intermediate 14336) and Llama-3-70B
(8192, 64, 8, 28672), head dim 128, bf16, one sequence of --tokens tokens; "attention" and "mlp"
time the two halves alone. Heads, kv heads and the intermediate size are divided by the world size
(kv heads at least one per rank); --scale divides the hidden and intermediate sizes and the heads
further, for GPUs where a layer does not fit.

Methods, all on the same weights and inputs:
  tdist            tdist.nn.ColumnParallelLinear / RowParallelLinear (AllGather-GEMM and
                   GEMM-ReduceScatter, their overlapped backward); --save-gathered as the modules'
                   option (default on: like the two torch methods, which keep the gathered input)
  no_comm          the same layer's local GEMMs only: colwise on an already-gathered input, rowwise
                   without the reduction (the floor an overlap approaches)
  torch_eager_tp   NCCL all_gather_into_tensor / reduce_scatter_tensor, then / after torch.matmul
                   (backward: the transposed collectives)
  torch_async_tp   torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter (backward:
                   each other), where this torch has them

The layer "moe" (MoE models only, below): RMSNorm -> sparse MoE block -> residual. The block: a router
(hidden -> E logits, softmax, top-k, the top-k weights renormalised), every expert a SwiGLU MLP whose
gate/up and down weights are split on the intermediate dimension over the ranks, tokens sequence-
sharded in and out. Shapes from tdist.bench_moe: Qwen3-30B-A3B (hidden 2048, expert intermediate 768,
128 experts, top-8), DeepSeek-V2-Lite (2048, 1408, 64, top-6), Mixtral-8x7B (4096, 14336, 8, top-2);
bf16; --scale divides hidden and intermediate. Fixed random router weights, the same on every rank;
--moe-routing skewed scales one expert's router row by 8, which puts it in the top-k of about 40 % of
the tokens. Every method routes this rank's tokens with the same router call and gathers the top-k
ids and weights, so the routing is the same bits for every method. Methods:
  tdist            tdist.nn.ParallelMoE: the router on this rank's rows, its top-k gathered (tdist
                   AllGather of M x k ids and weights), moe_ag_group_gemm, SiLU(gate) * up (its
                   SwiGLU autograd), moe_group_gemm_rs; their autograd (--save-gathered does not
                   apply: the backward gathers the tokens again)
  no_comm          the same work without communication: the set's gathered tokens and routing taken as
                   already there, tdist.moe.routing, the tokens copied into expert order,
                   tdist.moe.grouped_gemm twice (SwiGLU between), the weighted top-k sum of every
                   token, this rank's rows kept (no reduction); backward through the same ops, no
                   collective
  torch_eager_tp   NCCL all_gather_into_tensor of the top-k and of the tokens, a stable sort by expert,
                   torch._grouped_mm (where it runs bf16 on this GPU; otherwise a loop of per-expert
                   matmuls, tdist.bench_moe's, which reads the experts' row counts to the host; the
                   header and the JSON's moe_grouped_mm say which), the weighted top-k sum (bmm), NCCL
                   reduce_scatter_tensor; backward: autograd of those ops (NCCL all_reduce of the
                   router weight's gradient)
  torch_async_tp   none: PyTorch has no fused collective + grouped GEMM (its symm_mem matmuls are
                   dense), so its column stays null
Before timing, set 0's forward outputs of the methods (the block's, without the residual) are compared
with tdist's (max |diff| / max |tdist|, worst rank; JSON "max_rel_err", "CHECK FAILED" on stderr above
3e-2); no_comm's only at one rank, since it keeps this rank's partial sums.

Timing: CUDA events around each call; --warmup calls of every method first; then --iters rounds, each
calling every method once in an order that rotates from round to round, on inputs rotated over three
sets; the median per method, the slowest rank's. fwd runs under torch.no_grad(); fwd+bwd (also
spelt fwd_bwd) runs the forward and backward of a fixed output gradient. NVLink multicast stays off.

--summary FILE writes the rows alone as a JSON list, one flat row per (layer, model, tokens, pass):
{"layer", "model", "tokens", "pass" ("fwd" or "fwd_bwd"), "tdist_us", "no_comm_us",
"torch_eager_tp_us", "torch_async_tp_us"}, null where a method did not run (torch_async_tp always,
for "layer": "moe"; "model" is then bench_moe's name, e.g. "Qwen3-30B-A3B").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings

from . import _bench_world, bench_moe

MODELS = {
    # name: (hidden, heads, kv heads, intermediate)
    "8b": ("llama3-8b", 4096, 32, 8, 14336),
    "70b": ("llama3-70b", 8192, 64, 8, 28672),
}
# The layer "moe" runs on these (tdist.bench_moe's shapes): key: (name, hidden, intermediate, experts, topk).
MOE_MODELS = bench_moe.MODELS
HEAD_DIM = 128
METHODS = ("tdist", "no_comm", "torch_eager_tp", "torch_async_tp")
MOE_METHODS = ("tdist", "no_comm", "torch_eager_tp")  # no PyTorch async TP for MoE
DENSE_LAYERS = ("decoder", "attention", "mlp")
LAYERS = DENSE_LAYERS + ("moe",)
# --models left out: these per kind of layer.
DEFAULT_MODELS = {"dense": ("8b", "70b"), "moe": ("qwen3", "dsv2lite")}
MOE_ROUTINGS = ("uniform", "skewed")
MOE_TDIST_METHODS = ("auto", "fused", "chunked", "baseline")  # fused: the first projection's (tdist.moe)
kMoeCheckTol = 3e-2  # max |diff| / max |tdist| between two bf16 forwards of the MoE block
PASSES = ("fwd", "fwd+bwd")
# The pass names of --summary (fwd+bwd is not a plain identifier); --passes takes either spelling.
SUMMARY_PASS = {"fwd": "fwd", "fwd+bwd": "fwd_bwd"}


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m tdist.bench_layers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default=None,
                   help=f"comma-separated: {', '.join(MODELS)} (Llama: layers {', '.join(DENSE_LAYERS)}) and "
                        f"{', '.join(MOE_MODELS)} (MoE: layer moe); default "
                        f"{','.join(DEFAULT_MODELS['dense'])} for the Llama layers, "
                        f"{','.join(DEFAULT_MODELS['moe'])} for moe")
    p.add_argument("--tokens", default="2048,4096,8192,16384", help="comma-separated sequence lengths (all ranks)")
    p.add_argument("--layers", default=None,
                   help=f"comma-separated: {', '.join(LAYERS)}; default {','.join(DENSE_LAYERS)} for Llama models "
                        "and moe for MoE models (those of --models; without it the Llama layers)")
    p.add_argument("--moe-routing", default="uniform", choices=MOE_ROUTINGS,
                   help="moe: the router's weights as drawn (uniform) or one expert's row scaled by 8 (skewed)")
    p.add_argument("--passes", default=",".join(PASSES), help="comma-separated: " + ", ".join(PASSES))
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated: " + ", ".join(METHODS))
    p.add_argument("--scale", type=int, default=1, help="divide hidden, intermediate and heads by this")
    p.add_argument("--save-gathered", type=int, default=1, choices=(0, 1),
                   help="tdist: keep the gathered input for backward (1) or gather again (0)")
    p.add_argument("--tdist-method", default="auto", help="the overlapped GEMMs' method for tdist")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls of every method first")
    p.add_argument("--iters", type=int, default=20, help="timed rounds (one call of every method each)")
    p.add_argument("--heap-size", default="8G", help="tdist's symmetric heap per rank")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON (rank 0)")
    p.add_argument("--summary", default=None, metavar="FILE",
                   help="also write the flat summary rows as a JSON list (rank 0; pass fwd or fwd_bwd)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after timing, profile 3 calls of every method (torch.profiler) and write each "
                        "rank's kernel table and GPU busy time to DIR")
    args = p.parse_args(argv)

    if args.layers is None:  # the layers of the models' kinds
        named = _bench_world.pick(p, args.models, tuple(MODELS) + tuple(MOE_MODELS), "models") if args.models else []
        kinds = [k for k in ("dense", "moe") if any(model_kind(m) == k for m in named)] or ["dense"]
        args.layers = ",".join(x for x in LAYERS if layer_kind(x) in kinds)
    args.layers = _bench_world.pick(p, args.layers, LAYERS, "layers")
    kinds = [k for k in ("dense", "moe") if any(layer_kind(x) == k for x in args.layers)]
    if args.models is None:
        args.models = ",".join(m for k in kinds for m in DEFAULT_MODELS[k])
    args.models = _bench_world.pick(p, args.models, tuple(MODELS) + tuple(MOE_MODELS), "models")
    for k in kinds:
        if not any(model_kind(m) == k for m in args.models):
            p.error(f"--layers {','.join(x for x in args.layers if layer_kind(x) == k)} needs a model of its kind "
                    f"in --models (one of {', '.join(MODELS if k == 'dense' else MOE_MODELS)})")
    for k in ("dense", "moe"):
        named = [m for m in args.models if model_kind(m) == k]
        if named and k not in kinds:
            p.error(f"--models {','.join(named)}: no layer of --layers runs on "
                    f"{'a Llama' if k == 'dense' else 'an MoE'} model (its layers: "
                    f"{', '.join(DENSE_LAYERS) if k == 'dense' else 'moe'})")
    if "moe" in args.layers and args.tdist_method not in MOE_TDIST_METHODS:
        p.error(f"--tdist-method {args.tdist_method} is not a method of the MoE ops (layer moe): expected one of "
                f"{', '.join(MOE_TDIST_METHODS)}")
    args.passes = _bench_world.pick(p, args.passes.replace("fwd_bwd", "fwd+bwd"), PASSES, "passes")
    args.methods = _bench_world.pick(p, args.methods, METHODS, "methods")
    try:
        args.tokens = [int(x) for x in args.tokens.split(",") if x.strip()]
    except ValueError:
        p.error(f"--tokens must be comma-separated integers, got '{args.tokens}'")
    # a repeated name or size would time the same case twice (and give two summary rows for it)
    for what in ("models", "layers", "passes", "methods", "tokens"):
        setattr(args, what, list(dict.fromkeys(getattr(args, what))))
    if args.scale < 1 or args.iters < 1 or args.warmup < 0:
        p.error("--scale and --iters must be at least 1, --warmup at least 0")
    return args


def model_kind(model: str) -> str:
    """'moe' for a key of MOE_MODELS, else 'dense'."""
    return "moe" if model in MOE_MODELS else "dense"


def layer_kind(layer: str) -> str:
    """'moe' for the layer moe, else 'dense' (the Llama layers)."""
    return "moe" if layer == "moe" else "dense"


def summary_rows(rows) -> list:
    """The --summary rows of the benchmark's rows (main's, or a --json file's "rows"): layer, model,
    tokens, pass (named as in SUMMARY_PASS) and every method's time, None where it has none; nothing
    else (no errors). One row per (layer, model, tokens, pass)."""
    out, seen = [], set()
    for r in rows:
        pas = SUMMARY_PASS.get(r["pass"], r["pass"])
        if pas not in SUMMARY_PASS.values():
            raise ValueError(f"bench_layers: unknown pass {r['pass']!r} (expected {', '.join(SUMMARY_PASS)})")
        row = {"layer": r["layer"], "model": r["model"], "tokens": r["tokens"], "pass": pas}
        row.update((f"{m}_us", r.get(f"{m}_us")) for m in METHODS)
        key = (row["layer"], row["model"], row["tokens"], pas)
        if key in seen:
            raise ValueError(f"bench_layers: two rows for {key}")
        seen.add(key)
        out.append(row)
    return out


def _shapes(model: str, scale: int, world: int):
    """(model name, hidden, local heads, local kv heads, local intermediate) of this rank's shard."""
    name, hidden, heads, kv, inter = MODELS[model]
    hidden, heads, kv, inter = hidden // scale, max(1, heads // scale), max(1, kv // scale), inter // scale
    for what, v in (("heads", heads), ("intermediate", inter)):
        if v % world:
            raise SystemExit(f"tdist.bench_layers: {name} {what}={v} does not divide over {world} ranks")
    kv_local = max(1, kv // world)  # fewer kv heads than ranks: each rank keeps (a copy of) one
    return name, hidden, heads // world, kv_local, inter // world


def _eager_collectives(torch, dist, group, world):
    """(EagerGather, EagerScatter): NCCL all_gather_into_tensor / reduce_scatter_tensor over dim 0 of a
    2-D tensor as autograd functions, each the other's backward."""

    class EagerGather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out = x.new_empty((x.shape[0] * world, x.shape[1]))
            dist.all_gather_into_tensor(out, x.contiguous(), group=group)
            return out

        @staticmethod
        def backward(ctx, grad):
            out = grad.new_empty((grad.shape[0] // world, grad.shape[1]))
            dist.reduce_scatter_tensor(out, grad.contiguous(), group=group)
            return out

    class EagerScatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out = x.new_empty((x.shape[0] // world, x.shape[1]))
            dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
            return out

        @staticmethod
        def backward(ctx, grad):
            out = grad.new_empty((grad.shape[0] * world, grad.shape[1]))
            dist.all_gather_into_tensor(out, grad.contiguous(), group=group)
            return out

    return EagerGather, EagerScatter


class _Layer:
    """The weights of this rank's shard and the four ways of running its linear layers."""

    methods = METHODS
    check_methods = ()  # no_comm runs on stand-in buffers: no output to compare

    def __init__(self, torch, dist, tdist_nn, args, hidden, heads, kv, inter, tokens, symm):
        self.torch, self.dist = torch, dist
        self.hidden, self.heads, self.kv, self.inter, self.tokens = hidden, heads, kv, inter, tokens
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.rows = tokens // self.world
        self.group = dist.group.WORLD
        self.symm = symm
        dtype, dev = torch.bfloat16, torch.device("cuda", torch.cuda.current_device())
        qkv_out = (heads + 2 * kv) * HEAD_DIM
        save = bool(args.save_gathered)
        mk = dict(bias=False, method=args.tdist_method, device=dev, dtype=dtype)
        # tdist's modules own the weights; the other methods use the same tensors.
        self.mods = {
            "qkv": tdist_nn.ColumnParallelLinear(hidden, qkv_out * self.world, save_gathered=save, **mk),
            "o": tdist_nn.RowParallelLinear(heads * HEAD_DIM * self.world, hidden, **mk),
            "gate_up": tdist_nn.ColumnParallelLinear(hidden, 2 * inter * self.world, save_gathered=save, **mk),
            "down": tdist_nn.RowParallelLinear(inter * self.world, hidden, **mk),
        }
        self.w = {name: mod.weight for name, mod in self.mods.items()}
        self.norm1 = torch.nn.Parameter(torch.ones(hidden, device=dev, dtype=dtype))
        self.norm2 = torch.nn.Parameter(torch.ones(hidden, device=dev, dtype=dtype))
        # no_comm: the gathered inputs (colwise) and the gathered output gradients (rowwise) as fixed
        # buffers, so that only the GEMMs run.
        self.full_in = torch.randn(tokens, hidden, device=dev, dtype=dtype)
        self.full_grad = torch.randn(tokens, hidden, device=dev, dtype=dtype)
        self._functions()

    def params(self):
        return list(self.w.values()) + [self.norm1, self.norm2]

    def _functions(self):
        torch, dist, group, world, rows = self.torch, self.dist, self.group, self.world, self.rows
        layer = self
        EagerGather, EagerScatter = _eager_collectives(torch, dist, group, world)

        class AsyncColumn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, w, keep):
                # keep: the gathered input, for the weight gradient (grad mode is off in here)
                gathered, (y,) = torch.ops.symm_mem.fused_all_gather_matmul(
                    x.contiguous(), [w.t()], 0, layer.symm, return_A=keep)
                if keep:
                    ctx.save_for_backward(gathered, w)
                return y

            @staticmethod
            def backward(ctx, grad):
                gathered, w = ctx.saved_tensors
                grad = grad.contiguous()
                dx = torch.ops.symm_mem.fused_matmul_reduce_scatter(grad, w, "sum", 0, layer.symm)
                return dx, grad.t() @ gathered, None

        class AsyncRow(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, w):
                ctx.save_for_backward(x, w)
                return torch.ops.symm_mem.fused_matmul_reduce_scatter(x.contiguous(), w.t(), "sum", 0, layer.symm)

            @staticmethod
            def backward(ctx, grad):
                x, w = ctx.saved_tensors
                gathered, (dx,) = torch.ops.symm_mem.fused_all_gather_matmul(
                    grad.contiguous(), [w], 0, layer.symm, return_A=True)
                return dx, gathered.t() @ x

        class LocalColumn(torch.autograd.Function):
            """The colwise GEMM on an already-gathered input; backward: the two GEMMs, no reduction."""

            @staticmethod
            def forward(ctx, x, w):
                full = layer.full_in[:, :w.shape[1]]
                ctx.save_for_backward(w)
                return full @ w.t()

            @staticmethod
            def backward(ctx, grad):
                (w,) = ctx.saved_tensors
                dx = grad @ w
                dw = grad.t() @ layer.full_in[:, :w.shape[1]]
                return dx[:rows], dw

        class LocalRow(torch.autograd.Function):
            """The rowwise GEMM without the reduction (this rank keeps its rows of its own partial
            sum); backward: the two GEMMs on an already-gathered output gradient."""

            @staticmethod
            def forward(ctx, x, w):
                ctx.save_for_backward(x, w)
                return (x @ w.t())[:rows]

            @staticmethod
            def backward(ctx, grad):
                x, w = ctx.saved_tensors
                full = layer.full_grad[:, :w.shape[0]]
                return full @ w, full.t() @ x

        self.EagerGather, self.EagerScatter = EagerGather, EagerScatter
        self.AsyncColumn, self.AsyncRow = AsyncColumn, AsyncRow
        self.LocalColumn, self.LocalRow = LocalColumn, LocalRow

    def linears(self, method):
        """(colwise(h, name), rowwise(a, name)) of one method."""
        w, mods = self.w, self.mods
        if method == "tdist":
            return (lambda h, n: mods[n](h)), (lambda a, n: mods[n](a))
        if method == "no_comm":
            return (lambda h, n: self.LocalColumn.apply(h, w[n])), (lambda a, n: self.LocalRow.apply(a, w[n]))
        if method == "torch_eager_tp":
            return ((lambda h, n: self.EagerGather.apply(h) @ w[n].t()),
                    (lambda a, n: self.EagerScatter.apply(a @ w[n].t())))
        grad = self.torch.is_grad_enabled
        return ((lambda h, n: self.AsyncColumn.apply(h, w[n], grad() and (h.requires_grad or w[n].requires_grad))),
                (lambda a, n: self.AsyncRow.apply(a, w[n])))

    def attention(self, x, col, row):
        F = self.torch.nn.functional
        t, d, hq, hkv = self.tokens, HEAD_DIM, self.heads, self.kv
        h = F.rms_norm(x, (self.hidden,), self.norm1, 1e-5)
        qkv = col(h, "qkv")
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q = q.view(1, t, hq, d).transpose(1, 2)
        k = k.view(1, t, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
        v = v.view(1, t, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(t, hq * d)
        return x + row(o, "o")

    def mlp(self, x, col, row):
        F = self.torch.nn.functional
        h = F.rms_norm(x, (self.hidden,), self.norm2, 1e-5)
        gate, up = col(h, "gate_up").chunk(2, dim=-1)
        return x + row(F.silu(gate) * up, "down")

    def forward(self, layer, x, col, row):
        if layer == "attention":
            return self.attention(x, col, row)
        if layer == "mlp":
            return self.mlp(x, col, row)
        return self.mlp(self.attention(x, col, row), col, row)

    def prepare(self, xs):
        """Nothing to derive from the input sets (no_comm uses fixed random buffers)."""

    def runner(self, layer, method):
        """f(x, set index) -> the layer's output for one method."""
        col, row = self.linears(method)
        return lambda x, i: self.forward(layer, x, col, row)


def _moe_shapes(model: str, scale: int, world: int):
    """(model name, hidden, full expert intermediate, experts, top-k) of an MoE model at --scale."""
    name, hidden, inter, experts, topk = MOE_MODELS[model]
    hidden, inter = hidden // scale, inter // scale
    if hidden % 8 or inter % world or (inter // world) % 8:
        raise SystemExit(f"tdist.bench_layers: {name} hidden={hidden} and intermediate={inter} must be multiples of "
                         f"8, the intermediate over {world} ranks too")
    return name, hidden, inter, experts, topk


def moe_experts_torch(torch, tokens, ids, weights, w13, w2, grouped_mm):
    """Every token's experts in PyTorch ops, on this rank's shards: (M, H), row t = sum over j of
    weights[t, j] x down_e(SiLU(gate_e(tokens[t])) x up_e(tokens[t])), e = ids[t, j] (a partial sum
    over the ranks' shards). The pairs sorted by expert (stable), the rows gathered in that order,
    ``grouped_mm(a, w_t, ends)`` for each projection (w_t (E, K, N), ends: int32 cumulative rows per
    expert), un-sorted, the weighted top-k sum by one bmm. Autograd runs through all of it.
    tokens (M, H); ids (M, k) integer; weights (M, k) fp32; w13 (E, 2 F, H); w2 (E, H, F)."""
    m, k = ids.shape
    experts, f = w13.shape[0], w2.shape[2]
    sorted_ids, order = torch.sort(ids.reshape(-1).long(), stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(1, experts + 1, device=ids.device), out_int32=True)
    a = tokens.index_select(0, order // k)                               # (M k, H), expert order
    h13 = grouped_mm(a, w13.transpose(1, 2), ends)                       # (M k, 2 F)
    h = torch.nn.functional.silu(h13[:, :f]) * h13[:, f:]
    out = grouped_mm(h, w2.transpose(1, 2), ends)                        # (M k, H)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    pairs = out.index_select(0, inverse).view(m, k, -1)                  # pair order: t k + j
    return torch.bmm(weights.to(out.dtype).view(m, 1, k), pairs).view(m, -1)


def grouped_mm_functions(torch):
    """{bench_moe.GROUPED_MM, bench_moe.GROUPED_MM_LOOP: grouped_mm(a, w_t, ends) with autograd}: PyTorch's
    torch._grouped_mm, and tdist.bench_moe's loop of per-expert matmuls (the experts' row counts read
    to the host) with a backward of the same loops."""

    class LoopGroupedMM(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w_t, ends):
            ctx.counts = bench_moe.counts_of_ends(ends.tolist())
            ctx.save_for_backward(a, w_t)
            return bench_moe.grouped_mm_loop(torch, a, w_t, ctx.counts)

        @staticmethod
        def backward(ctx, grad):
            a, w_t = ctx.saved_tensors
            grad = grad.contiguous()
            grad_a = bench_moe.grouped_mm_loop(torch, grad, w_t.transpose(1, 2), ctx.counts)
            grad_w = torch.zeros_like(w_t)
            start = 0
            for e, c in enumerate(ctx.counts):
                if c:
                    grad_w[e] = a[start:start + c].t() @ grad[start:start + c]
                start += c
            return grad_a, grad_w, None

    return {bench_moe.GROUPED_MM: lambda a, w_t, ends: torch._grouped_mm(a, w_t, offs=ends),
            bench_moe.GROUPED_MM_LOOP: LoopGroupedMM.apply}


def fixed_gathered(torch):
    """An autograd function (local, full) -> full: stands for the AllGather of ``local`` (this rank's
    rows begin .. begin + rows of ``full``, which holds every rank's) without communicating; backward:
    this rank's rows of the gradient, no reduction (no_comm)."""

    class FixedGathered(torch.autograd.Function):
        @staticmethod
        def forward(ctx, local, full, begin):
            ctx.begin, ctx.rows = begin, local.shape[0]
            return full.view_as(full)

        @staticmethod
        def backward(ctx, grad):
            return grad[ctx.begin:ctx.begin + ctx.rows], None, None

    return FixedGathered


def moe_check_methods(world):
    """The MoE layer's methods whose outputs are compared with tdist's: no_comm keeps this rank's
    partial sums (no reduction over the ranks' intermediate shards), the block's output at one rank only."""
    return MOE_METHODS if world == 1 else tuple(m for m in MOE_METHODS if m != "no_comm")


class _MoeLayer:
    """This rank's shard of a sparse MoE block behind an RMSNorm and a residual, and three ways of
    running it (tdist, no_comm, torch_eager_tp; module docstring)."""

    methods = MOE_METHODS

    def __init__(self, torch, dist, tdist, tdist_nn, args, hidden, inter, experts, topk, tokens, grouped_mm,
                 device=None):
        from .nn import sparse_moe

        self.torch, self.dist, self.tdist = torch, dist, tdist
        self.hidden, self.inter, self.experts, self.topk, self.tokens = hidden, inter, experts, topk, tokens
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.rows = tokens // self.world
        self.group = dist.group.WORLD
        self.check_methods = moe_check_methods(self.world)
        dtype = torch.bfloat16
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        self.mod = tdist_nn.ParallelMoE(hidden, inter, experts, topk, norm_topk_prob=True, method=args.tdist_method,
                                        device=dev, dtype=dtype)
        # The router: fixed random weights, the same on every rank (a CPU generator of one seed).
        g = torch.Generator().manual_seed(2024)
        router = (torch.rand((experts, hidden), generator=g) * 2 - 1) * hidden ** -0.5
        if args.moe_routing == "skewed":
            router[int(torch.randint(experts, (1,), generator=g))] *= 8.0
        with torch.no_grad():
            self.mod.router_weight.copy_(router)
        self.norm = torch.nn.Parameter(torch.ones(hidden, device=dev, dtype=dtype))
        self.top_k_routing, self.swiglu = sparse_moe.top_k_routing, sparse_moe.swiglu
        self.grouped_mm = grouped_mm_functions(torch)[grouped_mm]
        self.EagerGather, self.EagerScatter = _eager_collectives(torch, dist, self.group, self.world)
        self.FixedGathered = fixed_gathered(torch)
        group = self.group

        class EagerReplicated(torch.autograd.Function):
            """The replicated router weight feeding this rank's tokens: its gradient summed (NCCL)."""

            @staticmethod
            def forward(ctx, w):
                return w.view_as(w)

            @staticmethod
            def backward(ctx, grad):
                grad = grad.contiguous()
                dist.all_reduce(grad, group=group)
                return grad

        self.EagerReplicated = EagerReplicated
        self.fixed = []  # per input set: (gathered routing (M, 2k) fp32, gathered normed tokens (M, H))

    def params(self):
        return [self.mod.router_weight, self.mod.w13, self.mod.w2, self.norm]

    def _normed(self, x):
        return self.torch.nn.functional.rms_norm(x, (self.hidden,), self.norm, 1e-5)

    def _packed_routing(self, h, router):
        ids, weights = self.top_k_routing(h, router, self.topk, self.mod.norm_topk_prob)
        return self.torch.cat([weights, ids.float()], dim=1)  # (rows, 2k) fp32: ids exact below 2^24

    def _unpack(self, packed):
        k = self.topk
        return packed[:, k:].long(), packed[:, :k]

    def prepare(self, xs):
        """no_comm's stand-ins for its gathers: every set's gathered routing and normed tokens, from
        the same router call the other methods make (so the same bits)."""
        torch, dist = self.torch, self.dist
        self.fixed = []
        with torch.no_grad():
            for x in xs:
                h = self._normed(x)
                packed = self._packed_routing(h, self.mod.router_weight)
                full_r = packed.new_empty((self.tokens, packed.shape[1]))
                dist.all_gather_into_tensor(full_r, packed.contiguous(), group=self.group)
                full_h = h.new_empty((self.tokens, self.hidden))
                dist.all_gather_into_tensor(full_h, h.contiguous(), group=self.group)
                self.fixed.append((full_r, full_h))

    def runner(self, layer, method, residual=True):
        """f(x, set index) -> the layer's output x + MoE(RMSNorm(x)) for one method (without the
        residual: MoE(RMSNorm(x)), whose bf16 rounding the residual's would hide)."""
        block = self._block(method)
        return (lambda x, i: x + block(x, i)) if residual else block

    def _block(self, method):
        torch, mod = self.torch, self.mod
        if method == "tdist":
            return lambda x, i: mod(self._normed(x))
        if method == "torch_eager_tp":
            def eager(x, i):
                h = self._normed(x)
                ids, weights = self._unpack(self.EagerGather.apply(
                    self._packed_routing(h, self.EagerReplicated.apply(mod.router_weight))))
                y = moe_experts_torch(torch, self.EagerGather.apply(h), ids, weights, mod.w13, mod.w2,
                                      self.grouped_mm)
                return self.EagerScatter.apply(y)
            return eager
        if method == "no_comm":
            begin = self.rank * self.rows

            def no_comm(x, i):
                full_r, full_h = self.fixed[i]
                h = self._normed(x)
                ids, weights = self._unpack(self.FixedGathered.apply(
                    self._packed_routing(h, mod.router_weight), full_r, begin))
                tokens = self.FixedGathered.apply(h, full_h, begin)
                r = self.tdist.moe.routing(ids, self.experts, self.world, self.rank)
                offsets, pair_rows = r["offsets"], r["row_of_pair"].view(-1)
                a = tokens.index_select(0, r["token_of_row"].clamp(min=0))  # padding rows: token 0, no gradient
                h13 = self.tdist.moe.grouped_gemm(a, mod.w13, offsets)
                f = mod.local_intermediate_size
                out = self.tdist.moe.grouped_gemm(self.swiglu(h13, f), mod.w2, offsets)
                pairs = out.index_select(0, pair_rows).view(self.tokens, self.topk, -1)
                y = torch.bmm(weights.to(out.dtype).view(self.tokens, 1, self.topk), pairs).view(self.tokens, -1)
                return y[begin:begin + self.rows]
            return no_comm
        raise ValueError(f"tdist.bench_layers: the layer moe has no method {method!r}")


def _symm_mem_group(torch, dist):
    """The group name for torch.ops.symm_mem's fused matmuls, or None where this torch lacks them."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
        torch.ops.symm_mem.fused_all_gather_matmul
        torch.ops.symm_mem.fused_matmul_reduce_scatter
    except (ImportError, AttributeError, RuntimeError):
        return None
    name = dist.group.WORLD.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed up to torch 2.9, a deprecated no-op after
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(name)
        except Exception:  # noqa: BLE001 - versions differ
            pass
    return name


def _bench_config(layer_obj, layer, pas, methods, args, torch, dist):
    """{method: median us (slowest rank) or None} for one (layer, pass)."""
    rows, hidden = layer_obj.rows, layer_obj.hidden
    gen = torch.Generator(device="cuda").manual_seed(4321 + dist.get_rank())
    grad_mode = pas == "fwd+bwd"
    xs = [torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(grad_mode)
          for _ in range(3)]
    dys = [torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
    params = layer_obj.params()
    layer_obj.prepare(xs)
    methods = [m for m in methods if m in layer_obj.methods]  # the layer moe has no torch_async_tp

    def make(method):
        run = layer_obj.runner(layer, method)

        def call(i):
            x = xs[i % 3]
            if not grad_mode:
                with torch.no_grad():
                    return run(x, i % 3)
            x.grad = None
            for p in params:
                p.grad = None
            y = run(x, i % 3)
            y.backward(dys[i % 3])
            return None
        return call

    calls, failed = {}, {}
    for method in methods:
        fn = make(method)
        try:
            for i in range(args.warmup):
                fn(i)
            torch.cuda.synchronize()
            calls[method] = fn
        except Exception as e:  # noqa: BLE001 - report, keep benchmarking the others
            failed[method] = f"{type(e).__name__}: {e}"
            torch.cuda.synchronize()
    # every rank must run the same methods (they are collective)
    ok = torch.tensor([1.0 if m in calls else 0.0 for m in methods], device="cuda")
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    live = [m for m, flag in zip(methods, ok.tolist()) if flag > 0]
    rel = _check_outputs(layer_obj, layer, [m for m in live if m in layer_obj.check_methods], xs, torch, dist)
    dist.barrier()
    times = {m: [] for m in live}
    for it in range(args.iters):
        order = live[it % len(live):] + live[:it % len(live)] if live else []
        for method in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            calls[method](it)
            end.record()
            times[method].append((start, end))
    torch.cuda.synchronize()
    if args.profile:
        _profile(calls, live, f"{layer_obj.tokens}_{layer}_{pas.replace('+', '_')}", args, torch, dist)
    out = {}
    for method in methods:
        if method in times:
            med = statistics.median(s.elapsed_time(e) * 1000.0 for s, e in times[method])
        else:
            med = -1.0
        t = torch.tensor([med], device="cuda", dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[method] = None if method not in live else float(t.item())
    return out, failed, rel


def _check_outputs(layer_obj, layer, methods, xs, torch, dist):
    """{"<method>_vs_<first>": max |d - d_first| / max |d_first|, the worst rank's} of set 0's forward,
    d = the layer's output without its residual (whose bf16 rounding would hide the difference), for
    the methods after the first of ``methods`` (tdist where it ran); {} with fewer than two."""
    if len(methods) < 2:
        return {}
    with torch.no_grad():
        outs = {m: layer_obj.runner(layer, m, residual=False)(xs[0], 0).float() for m in methods}
    ref = outs[methods[0]]
    errs = []
    for m in methods[1:]:
        got = outs[m]
        finite = bool(torch.isfinite(got).all())
        errs.append(float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)) if finite else float("inf"))
    t = torch.tensor(errs, device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {f"{m}_vs_{methods[0]}": v for m, v in zip(methods[1:], t.tolist())}


def _profile(calls, methods, tag, args, torch, dist):
    """Three calls of each method under torch.profiler: the kernels by GPU time, and how much of the
    calls' wall time the GPU was busy (a low share means the host, or a synchronisation, held it)."""
    from torch.profiler import ProfilerActivity, profile
    os.makedirs(args.profile, exist_ok=True)
    for method in methods:
        dist.barrier()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(3):
                calls[method](i)
            end.record()
            torch.cuda.synchronize()
        wall = start.elapsed_time(end) * 1000.0
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = _union_us([(e.time_range.start, e.time_range.end) for e in kernels])
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
        name = os.path.join(args.profile, f"{tag}_{method}_rank{dist.get_rank()}.txt")
        with open(name, "w") as f:
            f.write(f"{method}: 3 calls, {wall:.1f} us wall (CUDA events), GPU busy {busy:.1f} us "
                    f"({100.0 * busy / max(wall, 1e-9):.0f} %)\n\n{table}\n")


def _union_us(ranges):
    """Total length of the union of (start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(ranges):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def main(argv=None) -> int:
    """Run the benchmark (under torchrun); rank 0 prints the table and writes the JSON."""
    args = _parse(argv)
    torch, dist = _bench_world.start("tdist.bench_layers")
    import tdist
    import tdist.nn as tdist_nn

    tdist.init(process_group=dist.group.WORLD, heap_size=args.heap_size)
    world, me = dist.get_world_size(), dist.get_rank()
    dense = any(model_kind(m) == "dense" for m in args.models)
    symm = _symm_mem_group(torch, dist) if "torch_async_tp" in args.methods and dense else None
    methods = [m for m in args.methods if m != "torch_async_tp" or symm is not None]
    if me == 0 and "torch_async_tp" in args.methods and dense and symm is None:
        print("tdist.bench_layers: this torch has no symm_mem fused matmuls; torch_async_tp left out", file=sys.stderr)
    grouped_mm = grouped_mm_why = None
    if "moe" in args.layers and "torch_eager_tp" in methods:
        # PyTorch's grouped GEMM for torch_eager_tp: torch._grouped_mm, or a loop where it fails here
        grouped_mm, grouped_mm_why = bench_moe._pick_everywhere(torch, dist, torch.device("cuda",
                                                                                          torch.cuda.current_device()))
        if me == 0:
            print(f"tdist.bench_layers: moe's torch_eager_tp runs PyTorch's grouped GEMM as a {grouped_mm}"
                  + (f" ({grouped_mm_why})" if grouped_mm_why else ""), file=sys.stderr, flush=True)
    results = []
    try:
        for model in args.models:
            kind = model_kind(model)
            layers = [x for x in args.layers if layer_kind(x) == kind]
            if kind == "moe":
                name, hidden, inter, experts, topk = _moe_shapes(model, args.scale, world)
            else:
                name, hidden, heads, kv, inter = _shapes(model, args.scale, world)
            for tokens in args.tokens:
                if tokens % world:
                    raise SystemExit(f"tdist.bench_layers: --tokens {tokens} must be divisible by {world} ranks")
                if kind == "moe":
                    layer_obj = _MoeLayer(torch, dist, tdist, tdist_nn, args, hidden, inter, experts, topk, tokens,
                                          grouped_mm or bench_moe.GROUPED_MM)
                else:
                    layer_obj = _Layer(torch, dist, tdist_nn, args, hidden, heads, kv, inter, tokens, symm)
                for layer in layers:
                    for pas in args.passes:
                        times, failed, rel = _bench_config(layer_obj, layer, pas, methods, args, torch, dist)
                        row = {"layer": layer, "model": name, "tokens": tokens, "pass": pas}
                        for m in METHODS:
                            row[f"{m}_us"] = times.get(m)
                        if rel:
                            row["max_rel_err"] = rel
                        if failed:
                            row["errors"] = failed
                            if me == 0:
                                for m, e in failed.items():
                                    print(f"{name} {layer} {pas} tokens={tokens} {m}: {e}", file=sys.stderr)
                        bad = [k for k, v in rel.items() if not v <= kMoeCheckTol]
                        if bad and me == 0:
                            print(f"{name} {layer} {pas} tokens={tokens}: CHECK FAILED (max |diff| / max |tdist| over "
                                  f"{kMoeCheckTol}): " + ", ".join(f"{k} {rel[k]:.3g}" for k in bad), file=sys.stderr)
                        results.append(row)
                        if me == 0:
                            _print_row(row, len(results) == 1, world, args)
                del layer_obj
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        if me == 0 and args.json:
            doc = {"world_size": world, "dtype": "bf16", "scale": args.scale, "save_gathered": bool(args.save_gathered),
                   "tdist_method": args.tdist_method, "iters": args.iters, "warmup": args.warmup,
                   "moe_routing": args.moe_routing if "moe" in args.layers else None,
                   "moe_grouped_mm": grouped_mm, "moe_grouped_mm_fallback_reason": grouped_mm_why,
                   "statistic": "median of per-call CUDA-event times, methods alternating, max over ranks (us)",
                   "rows": results}
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
            print(f"tdist.bench_layers: wrote {args.json}")
        if me == 0 and args.summary:
            with open(args.summary, "w") as f:
                json.dump(summary_rows(results), f, indent=1)
            print(f"tdist.bench_layers: wrote {args.summary}")
    finally:
        _bench_world.finish(dist)
    return 0


def _fmt(v):
    return f"{v:>12.1f}" if v is not None else f"{'-':>12}"


def _print_row(row, first, world, args):
    if first:
        print(f"tdist.bench_layers: {world} ranks, bf16, median of {args.iters} alternating rounds after "
              f"{args.warmup} warm-up, slowest rank; tdist save_gathered={bool(args.save_gathered)}, "
              f"method={args.tdist_method}; x/tdist: that method's time over tdist's")
        head = (f"{'model':<17}{'layer':<10}{'tokens':>7} {'pass':<8}" + "".join(f"{m + ' us':>12}" for m in
                ("tdist", "no_comm", "eager_tp", "async_tp")) + f"{'eager/tdist':>12}{'async/tdist':>12}")
        print(head)
        print("-" * len(head))
    t = row["tdist_us"]

    def ratio(key):
        v = row[key]
        return f"{v / t:>11.2f}x" if v is not None and t else f"{'-':>12}"

    print(f"{row['model']:<17}{row['layer']:<10}{row['tokens']:>7} {row['pass']:<8}" + _fmt(row["tdist_us"])
          + _fmt(row["no_comm_us"]) + _fmt(row["torch_eager_tp_us"]) + _fmt(row["torch_async_tp_us"])
          + ratio("torch_eager_tp_us") + ratio("torch_async_tp_us"), flush=True)


if __name__ == "__main__":
    sys.exit(main())
