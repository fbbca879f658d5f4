"""Autograd formulas of the overlapped GEMMs (torch.library.register_autograd), imported by _torch_ops.

Forward ops, in the "TN" layout (``d = a @ b.T``, ``b`` of shape (N, K)):

  ag_gemm    d (M, N) = gather(a_local) @ b.T
  ag_gemm_gathered  as ag_gemm, and returns the gathered A, which the backward then keeps (no second
             gather; M x K per call kept until backward)
  gemm_rs    d (rows, N) = this rank's rows of sum_r a_r @ b_r.T
  gemm_ar    d (M, N) = sum_r a_r @ b_r.T, replicated; its gradient is taken as replicated too
             (every rank computes the same loss from d, as Megatron-LM's all-reduce region):
             da = dd @ b, db = dd.T @ a, local.

Two ways to run the backward (TDIST_TP_BACKWARD):

  "overlap" (default): the two backward GEMMs by cuBLAS, which takes the weight in its stored layout
  (no transposed copy), and the backward's collective on a side stream beside the GEMM that does not
  depend on it (custom ops below, opaque to torch.compile):
    ag_gemm    da_local = ReduceScatter(dd @ b)   beside   db = dd.T @ gather(a_local)
               (without the kept gathered A, the re-gather runs beside dd @ b)
    gemm_rs    G = AllGather(dd) beside da[own rows] = dd @ b; then da[other rows] = G @ b, db = G.T @ a
  "fused": the backward as the forward's overlapped ops (gemm_rs for ag_gemm, ag_gemm_gathered for
  gemm_rs), on a contiguous copy of b.T made once per backward.

Every backward op is the forward's transpose, so its shapes satisfy the op's rules whenever the
forward's did; the forward ``method`` is reused by the fused backward. Gradients arriving as
non-contiguous or misaligned views are copied first. A gradient flowing into the gathered A of
ag_gemm_gathered is reduce-scattered into da_local.

All ops are collective: the backward runs them in the same order on every rank, as the forward did,
which autograd guarantees when every rank runs the same graph (also under torch.utils.checkpoint,
whose recomputation replays the forward's calls in order). Each backward joins its side stream
before it returns, so no two collectives run at once. The formulas use only torch ops and tdist's
custom ops (with fake implementations), so torch.compile traces them into the backward graph.
"""

import functools
import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from ._overlap import chunk_begin, chunk_rows
from ._runtime import runtime
from ._torch_ops import call_overlap, eager  # defined before _torch_ops imports this module

_ops = torch.ops.tdist


def rank_world():
    rt = runtime("autograd")
    return rt.rank, rt.world_size


def dense(t: Tensor) -> Tensor:
    """``t`` as the ops take it: contiguous and 16-byte aligned (a copy only where it is not)."""
    if not t.is_contiguous():
        return t.contiguous()
    if torch.compiler.is_compiling():
        # Dynamo does not trace storage_offset() in every torch version; tensors a compiled graph
        # makes are fresh allocations, aligned.
        return t
    if t.storage_offset() % max(1, 16 // t.element_size()) != 0:
        return t.clone()
    return t


def gather_rows(x: Tensor, m, world: int) -> Tensor:
    """All ranks' rows (RowChunks{m, world}, in rank order) of the 2-D x: (m, K), through tdist's
    AllGather. Unequal row counts are padded to the largest first (the collective moves equal parts)."""
    x = dense(x)
    if m % world == 0:
        return _ops.all_gather.default(x, "auto")
    most = m // world + 1
    pad = torch.cat([x, x.new_zeros((most - x.shape[0], x.shape[1]))]) if x.shape[0] < most else x
    g = _ops.all_gather.default(pad, "auto")
    return torch.cat([g[r * most:r * most + chunk_rows(m, world, r)] for r in range(world)])


def scatter_rows(t: Tensor, m, world: int, rank: int) -> Tensor:
    """This rank's rows (RowChunks{m, world}) of the sum over ranks of the (m, K) t, through tdist's
    ReduceScatter (fp32 accumulation). Unequal parts are padded to the largest first."""
    t = dense(t)
    if m % world == 0:
        return _ops.reduce_scatter.default(t, "auto")
    most = m // world + 1
    parts = []
    for r in range(world):
        begin, rows = chunk_begin(m, world, r), chunk_rows(m, world, r)
        p = t[begin:begin + rows]
        parts.append(torch.cat([p, t.new_zeros((most - rows, t.shape[1]))]) if rows < most else p)
    return _ops.reduce_scatter.default(torch.cat(parts), "auto")[:chunk_rows(m, world, rank)]


def _transposed(b: Tensor) -> Tensor:
    """b.T, contiguous: the backward GEMMs' weight operand in the TN layout."""
    return b.t().contiguous()


def overlapped_backward() -> bool:
    """TDIST_TP_BACKWARD: "overlap" (default) or "fused"."""
    style = os.environ.get("TDIST_TP_BACKWARD", "overlap")
    if style not in ("overlap", "fused"):
        raise ValueError(f"TDIST_TP_BACKWARD must be 'overlap' or 'fused', got '{style}'")
    return style == "overlap"


# --- the backward's collectives on a side stream ---------------------------------------------------
# One side stream per device, of high priority so that the collective's blocks are scheduled ahead
# of the GEMM's as SMs free up. Each op forks it from the current stream first and joins it before
# returning; tensors made on it that outlive the op are recorded on the current stream.

_side_streams = {}


def _side_stream(device) -> "torch.cuda.Stream":
    s = _side_streams.get(device.index)
    if s is None:
        s = _side_streams[device.index] = torch.cuda.Stream(device=device, priority=-1)
    return s


def _no_grad_placeholder(like: Tensor) -> Tensor:
    return like.new_empty((0,))


@torch.library.custom_op("tdist::linear_colwise_backward", mutates_args=())
def linear_colwise_backward(grad: Tensor, w: Tensor, x: Tensor, x_is_gathered: bool, m: int, need_x: bool,
                            need_w: bool) -> Tuple[Tensor, Tensor]:
    """Backward of y = gather(x_local) @ w.T: (grad of x_local, grad of w); an empty tensor where not
    needed. ``x`` is the gathered input when x_is_gathered, else this rank's rows."""
    rank, world = rank_world()
    main = torch.cuda.current_stream(grad.device)
    side = _side_stream(grad.device)
    side.wait_stream(main)
    gathered, gathered_ready = x, None
    if need_w and not x_is_gathered:
        with torch.cuda.stream(side):
            gathered = gather_rows(x, m, world)
            gathered_ready = side.record_event()
    grad_x = grad_w = _no_grad_placeholder(grad)
    if need_x:
        partial = torch.mm(grad, w)  # (m, K): this rank's term of every row's gradient
        side.wait_stream(main)
        with torch.cuda.stream(side):
            grad_x = scatter_rows(partial, m, world, rank)
        grad_x.record_stream(main)
    if need_w:
        if gathered_ready is not None:
            main.wait_event(gathered_ready)
        grad_w = torch.mm(grad.t(), gathered)
    main.wait_stream(side)
    return grad_x, grad_w


@linear_colwise_backward.register_fake
def _(grad, w, x, x_is_gathered, m, need_x, need_w):
    rank, world = rank_world()
    rows = chunk_rows(m, world, rank) if x_is_gathered else x.shape[0]
    grad_x = grad.new_empty((rows, w.shape[1])) if need_x else grad.new_empty((0,))
    grad_w = grad.new_empty(w.shape) if need_w else grad.new_empty((0,))
    return grad_x, grad_w


@torch.library.custom_op("tdist::linear_rowwise_backward", mutates_args=())
def linear_rowwise_backward(grad: Tensor, w: Tensor, x: Tensor, need_x: bool, need_w: bool) -> Tuple[Tensor, Tensor]:
    """Backward of y = this rank's rows of sum_r x_r @ w_r.T, x (m, K) holding every row: (grad of x,
    grad of w); an empty tensor where not needed."""
    rank, world = rank_world()
    m = x.shape[0]
    main = torch.cuda.current_stream(grad.device)
    side = _side_stream(grad.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        gathered = gather_rows(grad, m, world)  # (m, N): every rank's rows of the output gradient
        gathered_ready = side.record_event()
    grad_x = grad_w = _no_grad_placeholder(grad)
    if need_x:
        grad_x = grad.new_empty((m, w.shape[1]))
        begin, rows = chunk_begin(m, world, rank), grad.shape[0]
        if rows > 0:  # this rank's own rows need no gather
            torch.mm(grad, w, out=grad_x[begin:begin + rows])
        main.wait_event(gathered_ready)
        for first, end in ((0, begin), (begin + rows, m)):
            if end > first:
                torch.mm(gathered[first:end], w, out=grad_x[first:end])
    if need_w:
        main.wait_event(gathered_ready)
        grad_w = torch.mm(gathered.t(), x)
    main.wait_stream(side)
    return grad_x, grad_w


@linear_rowwise_backward.register_fake
def _(grad, w, x, need_x, need_w):
    grad_x = grad.new_empty((x.shape[0], w.shape[1])) if need_x else grad.new_empty((0,))
    grad_w = grad.new_empty(w.shape) if need_w else grad.new_empty((0,))
    return grad_x, grad_w


@torch.library.custom_op("tdist::linear_replicated_backward", mutates_args=())
def linear_replicated_backward(grad: Tensor, w: Tensor, x: Tensor, need_x: bool,
                               need_w: bool) -> Tuple[Tensor, Tensor]:
    """Backward of y = x @ w.T with x replicated and w this rank's shard: (sum over ranks of grad @ w,
    grad.T @ x), the AllReduce beside the weight's GEMM; an empty tensor where not needed."""
    main = torch.cuda.current_stream(grad.device)
    side = _side_stream(grad.device)
    grad_x = grad_w = _no_grad_placeholder(grad)
    if need_x:
        partial = torch.mm(grad, w)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            grad_x = _ops.all_reduce.default(partial, "auto")
        grad_x.record_stream(main)
    if need_w:
        grad_w = torch.mm(grad.t(), x)
    main.wait_stream(side)
    return grad_x, grad_w


@linear_replicated_backward.register_fake
def _(grad, w, x, need_x, need_w):
    grad_x = grad.new_empty(x.shape) if need_x else grad.new_empty((0,))
    grad_w = grad.new_empty(w.shape) if need_w else grad.new_empty((0,))
    return grad_x, grad_w


def _or_none(t: Tensor, needed: bool) -> Optional[Tensor]:
    return t if needed else None


# --- ag_gemm: re-gathers A in backward --------------------------------------------------------------

def _ag_gemm_setup(ctx, inputs, output):
    a_local, b, m, method = inputs
    rank, world = rank_world()
    ctx.m = a_local.shape[0] * world if m is None else m
    ctx.method, ctx.rank, ctx.world = method, rank, world
    ctx.save_for_backward(a_local, b)


def _ag_gemm_backward(ctx, grad_d):
    a_local, b = ctx.saved_tensors
    g = dense(grad_d)
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if overlapped_backward():
        grad_a, grad_b = _ops.linear_colwise_backward.default(g, b, a_local, False, ctx.m, need_a, need_b)
        return _or_none(grad_a, need_a), _or_none(grad_b, need_b), None, None
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = _ops.gemm_rs.default(g, _transposed(b), ctx.method)
    if ctx.needs_input_grad[1]:
        grad_b = torch.mm(g.t(), gather_rows(a_local, ctx.m, ctx.world))
    return grad_a, grad_b, None, None


# --- ag_gemm_gathered: keeps the gathered A --------------------------------------------------------

def _ag_gemm_gathered_setup(ctx, inputs, output):
    a_local, b, m, method = inputs
    rank, world = rank_world()
    ctx.m = a_local.shape[0] * world if m is None else m
    ctx.method, ctx.rank, ctx.world = method, rank, world
    # Unused outputs (the gathered A, mostly) arrive as None instead of a zero-filled M x K tensor.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(output[1], b)


def _ag_gemm_gathered_backward(ctx, grad_d, grad_gathered):
    gathered, b = ctx.saved_tensors
    grad_a = grad_b = None
    g = None if grad_d is None else dense(grad_d)
    if g is not None and overlapped_backward():
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_a, grad_b = _ops.linear_colwise_backward.default(g, b, gathered, True, ctx.m, need_a, need_b)
        grad_a, grad_b = _or_none(grad_a, need_a), _or_none(grad_b, need_b)
        if need_a and grad_gathered is not None:
            grad_a = grad_a + scatter_rows(grad_gathered, ctx.m, ctx.world, ctx.rank)
        return grad_a, grad_b, None, None
    if ctx.needs_input_grad[0]:
        if g is not None:
            grad_a = _ops.gemm_rs.default(g, _transposed(b), ctx.method)
        if grad_gathered is not None:
            part = scatter_rows(grad_gathered, ctx.m, ctx.world, ctx.rank)
            grad_a = part if grad_a is None else grad_a + part
    if ctx.needs_input_grad[1] and g is not None:
        grad_b = torch.mm(g.t(), gathered)
    return grad_a, grad_b, None, None


# --- gemm_rs ----------------------------------------------------------------------------------------

def _gemm_rs_setup(ctx, inputs, output):
    a, b, method = inputs
    rank, world = rank_world()
    ctx.method, ctx.rank, ctx.world = method, rank, world
    ctx.save_for_backward(a, b)


def _gemm_rs_backward(ctx, grad_d):
    a, b = ctx.saved_tensors
    m = a.shape[0]
    g = dense(grad_d)
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if overlapped_backward():
        grad_a, grad_b = _ops.linear_rowwise_backward.default(g, b, a, need_a, need_b)
        return _or_none(grad_a, need_a), _or_none(grad_b, need_b), None
    grad_a = grad_b = None
    if need_a and need_b:
        grad_a, gathered = _ops.ag_gemm_gathered.default(g, _transposed(b), m, ctx.method)
        grad_b = torch.mm(gathered.t(), a)
    elif need_a:
        grad_a = _ops.ag_gemm.default(g, _transposed(b), m, ctx.method)
    elif need_b:
        grad_b = torch.mm(gather_rows(g, m, ctx.world).t(), a)
    return grad_a, grad_b, None


# --- gemm_ar ----------------------------------------------------------------------------------------

def _gemm_ar_setup(ctx, inputs, output):
    a, b, method = inputs
    ctx.save_for_backward(a, b)


def _gemm_ar_backward(ctx, grad_d):
    a, b = ctx.saved_tensors
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = torch.mm(grad_d, b)
    if ctx.needs_input_grad[1]:
        grad_b = torch.mm(grad_d.t(), a)
    return grad_a, grad_b, None


torch.library.register_autograd("tdist::ag_gemm", _ag_gemm_backward, setup_context=_ag_gemm_setup)
torch.library.register_autograd("tdist::ag_gemm_gathered", _ag_gemm_gathered_backward,
                                setup_context=_ag_gemm_gathered_setup)
torch.library.register_autograd("tdist::gemm_rs", _gemm_rs_backward, setup_context=_gemm_rs_setup)
torch.library.register_autograd("tdist::gemm_ar", _gemm_ar_backward, setup_context=_gemm_ar_setup)


# --- the same math through torch and tdist's collectives (autograd.Function) ----------------------------
# For layers whose shapes or dtype the overlapped GEMMs refuse (N or K not a multiple of 8, float32):
# torch.matmul and tdist's collectives (which take any size and float32, and run NCCL where their own
# kernels do not apply), one after the other.

class GatherRows(torch.autograd.Function):
    """x (rows, K) -> every rank's rows (m, K); backward: ReduceScatter of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, m: int, rank: int, world: int) -> Tensor:
        ctx.m, ctx.rank, ctx.world = m, rank, world
        return gather_rows(x, m, world)

    @staticmethod
    def backward(ctx, grad):
        return scatter_rows(grad, ctx.m, ctx.world, ctx.rank), None, None, None


class ScatterRows(torch.autograd.Function):
    """t (m, K) -> this rank's rows of the sum over ranks; backward: AllGather of the gradient."""

    @staticmethod
    def forward(ctx, t: Tensor, rank: int, world: int) -> Tensor:
        ctx.m, ctx.world = t.shape[0], world
        return scatter_rows(t, t.shape[0], world, rank)

    @staticmethod
    def backward(ctx, grad):
        return gather_rows(grad, ctx.m, ctx.world), None, None


class ReduceReplicated(torch.autograd.Function):
    """Sum over ranks into a replicated result; backward: identity (the gradient is replicated)."""

    @staticmethod
    def forward(ctx, t: Tensor) -> Tensor:
        return _ops.all_reduce.default(dense(t), "auto")

    @staticmethod
    def backward(ctx, grad):
        return grad


class CopyReplicated(torch.autograd.Function):
    """Identity on a replicated input that feeds rank-local work; backward: sum of the gradients."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _ops.all_reduce.default(dense(grad), "auto")


class ReplicatedColumnLinear(torch.autograd.Function):
    """y = x @ w.T with x replicated and w this rank's column shard (no communication forward);
    backward: dx = sum_r dy_r @ w_r (AllReduce beside dw's GEMM, or tdist's GEMM-AllReduce when
    TDIST_TP_BACKWARD=fused), dw = dy.T @ x."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, method: str) -> Tensor:
        ctx.method = method
        ctx.save_for_backward(x, w)
        return torch.mm(x, w.t())

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        g = dense(grad)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if overlapped_backward():
            grad_x, grad_w = _ops.linear_replicated_backward.default(g, w, x, need_x, need_w)
            return _or_none(grad_x, need_x), _or_none(grad_w, need_w), None
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _ops.gemm_ar.default(g, _transposed(w), ctx.method)
        if ctx.needs_input_grad[1]:
            grad_w = torch.mm(g.t(), x)
        return grad_x, grad_w, None


class SequenceParallelBias(torch.autograd.Function):
    """y + bias where y holds this rank's rows of a replicated layer's output (after a
    ReduceScatter): the bias is added once per row, and its gradient, a sum over every rank's rows,
    is all-reduced (each rank sees only its own rows)."""

    @staticmethod
    def forward(ctx, y: Tensor, bias: Tensor) -> Tensor:
        return y + bias

    @staticmethod
    def backward(ctx, grad):
        grad_bias = None
        if ctx.needs_input_grad[1]:
            part = grad.reshape(-1, grad.shape[-1]).float().sum(0)
            grad_bias = _ops.all_reduce.default(part.contiguous(), "auto").to(grad.dtype)
        return grad, grad_bias


def linear_rows_gathered(x: Tensor, w: Tensor, m: Optional[int], method: str, fused: bool, save_gathered: bool,
                         rank: int, world: int) -> Tensor:
    """Column-parallel, sequence-parallel input: gather(x) @ w.T."""
    if fused:
        x = dense(x)
        if eager(x, w):  # inference: no gradient, so nothing to save
            return call_overlap("ag_gemm", (x, w), m, method)[0]
        if save_gathered and torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return _ops.ag_gemm_gathered.default(x, w, m, method)[0]
        return _ops.ag_gemm.default(x, w, m, method)
    total = x.shape[0] * world if m is None else m
    return torch.mm(GatherRows.apply(x, total, rank, world), w.t())


def linear_rows_scattered(x: Tensor, w: Tensor, method: str, fused: bool, rank: int, world: int) -> Tensor:
    """Row-parallel, sequence-parallel output: this rank's rows of sum_r x_r @ w_r.T."""
    if fused:
        x = dense(x)
        return call_overlap("gemm_rs", (x, w), None, method)[0] if eager(x, w) else _ops.gemm_rs.default(x, w, method)
    return ScatterRows.apply(torch.mm(x, w.t()), rank, world)


def linear_reduced(x: Tensor, w: Tensor, method: str, fused: bool) -> Tensor:
    """Row-parallel, replicated output: sum_r x_r @ w_r.T on every rank."""
    if fused:
        x = dense(x)
        return call_overlap("gemm_ar", (x, w), None, method)[0] if eager(x, w) else _ops.gemm_ar.default(x, w, method)
    return ReduceReplicated.apply(torch.mm(x, w.t()))


def linear_replicated_input(x: Tensor, w: Tensor, method: str, fused: bool) -> Tensor:
    """Column-parallel, replicated input: x @ w.T locally; the input gradient is summed over ranks."""
    if fused:
        return ReplicatedColumnLinear.apply(dense(x), w, method)
    return torch.mm(CopyReplicated.apply(x), w.t())


# --- MoE (tdist.moe): the grouped GEMMs' backward ------------------------------------------------------
# Forward ops (docs/moe.md; W ranks, M tokens, rows in expert order, R = capacity(M, topk, E); the
# routing's offsets, token_of_row tok, row_of_pair rop; w [E, N, K] this rank's shard):
#
#   moe_ag_group_gemm  d [R, N]: d[r] = x[tok[r]] @ w_e.T for the pairs' rows, 0 for padding rows
#   moe_group_gemm_rs  y [rows(rank), N] = this rank's rows of sum_ranks z_s, z_s[t] = sum_j
#                      p[t, j] h[rop[t, j]] @ w_e.T (p: topk_weights); _ar: all of sum_ranks z_s
#   grouped_gemm       d [R, N]: d[r] = a[r] @ w_g.T for rows r < offsets[G]
#
# Backward, with dY the output's gradient (docs/moe.md, "Training"):
#
#   ag   dx_rows = this rank's rows of sum_ranks dx, dx[t] = sum_j dY[rop[t, j]] @ w_e (the
#        ReduceScatter is the AllGather's adjoint): torch._grouped_mm on w as it is, the top-k sum,
#        a ReduceScatter; where it does not run, exactly moe_group_gemm_rs(dY, w_e.T, ids, 1), the
#        tdist op, on a transposed copy of w (grouped_data_grad says why that is the fallback);
#        dw_e = dY_e.T @ X_e, X_e = the expert's rows x[tok[r]] (x gathered again, beside the routing)
#   rs   G = AllGather(dy) (_ar: G = dy, replicated as in gemm_ar); U[r] = G[tok[r]] @ w_e;
#        dh[r] = p(r) U[r]; dp[t, j] = <G[t], h[r] @ w_e.T> = <U[r], h[r]> with r = rop[t, j],
#        summed over ranks (an AllReduce: p is the same on every rank and each rank holds a slice of
#        the features); dw_e = (p G[tok])_e.T @ h_e
#   gg   da[r] = dY[r] @ w_g (rows past offsets[G]: 0); dw_g = dY_g.T @ a_g
#
# dw is a grouped GEMM whose groups split the reduction dimension, which tdist's grouped GEMM (groups
# of output rows) does not do: torch._grouped_mm does (bfloat16 on sm90+), and where it runs the
# whole backward uses it, in the compact order (below); elsewhere a batched GEMM per 128-row tile
# (every tile is one expert's) summed into its expert, which moves an N x K fp32 partial per tile
# and so is the fallback. No per-expert loop: the experts' row counts live on the GPU, and reading
# them would be a host synchronisation. TDIST_MOE_WGRAD: auto, grouped_mm or tiles (the fallback
# for the whole backward, also where torch's kernel runs).
#
# The routing is rebuilt on the GPU from topk_ids (tdist.moe.routing, a few small kernels): the ops
# keep it in their context, which the next call overwrites. Rows outside the pairs (padding, past
# offsets[E], or unwritten rows the user's loss may have touched) are masked before they enter a sum.

from . import moe as _moe

_MOE_TILE = _moe.grouped_gemm_alignment()
_DW_CHUNK_BYTES = 256 << 20  # fp32 per-tile partials kept at once by the tile fallback


def _moe_wgrad_style(dtype, device) -> str:
    style = os.environ.get("TDIST_MOE_WGRAD", "auto")
    if style not in ("auto", "grouped_mm", "tiles"):
        raise ValueError(f"TDIST_MOE_WGRAD must be 'auto', 'grouped_mm' or 'tiles', got '{style}'")
    if style == "auto":  # where torch._grouped_mm runs: bfloat16 on sm90 / sm100
        usable = (hasattr(torch, "_grouped_mm") and dtype == torch.bfloat16 and device.type == "cuda" and
                  _major_capability(device.index) in (9, 10))
        style = "grouped_mm" if usable else "tiles"
    return style


@functools.lru_cache(maxsize=None)
def _major_capability(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _by_torch_grouped_mm(t: Tensor) -> bool:
    """Whether the MoE backward runs torch._grouped_mm (TDIST_MOE_WGRAD: auto or grouped_mm) or, with
    tiles, tdist's grouped GEMM on transposed weights and the tile fallback for dw."""
    return _moe_wgrad_style(t.dtype, t.device) == "grouped_mm"


def grouped_weight_grad(dy: Tensor, a: Tensor, offsets: Tensor, groups: int) -> Tensor:
    """[G, N, K]: dy[rows of g].T @ a[rows of g] per group g (rows [offsets[g], offsets[g + 1]), each
    offset a multiple of the grouped GEMM's alignment); dy [R, N] and a [R, K] are 0 in every row
    outside the groups (the caller masks them)."""
    rows, n, k = dy.shape[0], dy.shape[1], a.shape[1]
    if _moe_wgrad_style(dy.dtype, dy.device) == "grouped_mm":
        # An empty group (no rows to sum) comes out 0, as torch's own grouped_mm backward relies on.
        return torch._grouped_mm(dy.t(), a, offs=offsets[1:].to(torch.int32))
    tiles = -(-rows // _MOE_TILE)
    out = torch.zeros((groups, n, k), dtype=torch.float32, device=dy.device)
    if tiles == 0:
        return out.to(dy.dtype)
    if tiles * _MOE_TILE != rows:
        extra = tiles * _MOE_TILE - rows
        dy = torch.cat([dy, dy.new_zeros((extra, n))])
        a = torch.cat([a, a.new_zeros((extra, k))])
    dy_tiles, a_tiles = dy.view(tiles, _MOE_TILE, n), a.view(tiles, _MOE_TILE, k)
    starts = torch.arange(tiles, device=dy.device, dtype=torch.long) * _MOE_TILE
    # A tile's group: the first g with offsets[g + 1] > its first row (tiles past offsets[G] are 0).
    group = torch.searchsorted(offsets[1:].long().contiguous(), starts, right=True).clamp_(max=groups - 1)
    step = max(1, _DW_CHUNK_BYTES // max(1, n * k * 4))
    for first in range(0, tiles, step):
        part = torch.bmm(dy_tiles[first:first + step].transpose(1, 2), a_tiles[first:first + step])
        out.index_add_(0, group[first:first + step], part.float())
    return out.to(dy.dtype)


def _experts_transposed(w: Tensor) -> Tensor:
    """[E, K, N]: every expert's w_e.T, contiguous (the grouped GEMM's weight operand for dY @ w_e)."""
    return w.transpose(1, 2).contiguous()


def grouped_data_grad(dy: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """[R, K]: dy[r] @ w_g for the rows r in [offsets[g], offsets[g + 1]) of each group g, w [G, N, K]
    as the forward's weight; rows past offsets[G] are not written. torch._grouped_mm reads w as it is
    (its [G, N, K] operand); tdist's grouped GEMM (TN) needs a transposed copy of every expert's
    weight, which at MoE sizes moves more bytes than the GEMM takes time, so it is the fallback."""
    if _by_torch_grouped_mm(dy):
        return torch._grouped_mm(dy, w, offs=offsets[1:].to(torch.int32))
    return _moe.grouped_gemm(dy, _experts_transposed(w), offsets)


def _sum_pairs(u: Tensor, row_of_pair: Tensor) -> Tensor:
    """[M, K]: sum_j u[row_of_pair[t, j]] per token t (fp32 accumulation, u's dtype), in token chunks
    of about 64 MiB of gathered rows."""
    m, topk = row_of_pair.shape
    out = u.new_empty((m, u.shape[1]))
    step = max(1, (64 << 20) // max(1, topk * u.shape[1] * u.element_size()))
    for first in range(0, m, step):
        out[first:first + step] = u[row_of_pair[first:first + step]].sum(1)
    return out


def _rows_valid(token_of_row: Tensor) -> Tensor:
    return (token_of_row >= 0).unsqueeze(1)


def _zero_rows(t: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, t, t.new_zeros(()))


# Where torch._grouped_mm runs, the backward works on the pairs' rows without the padding ("compact"
# order: routing's row_of_compact, expert by expert): torch's grouped GEMM takes any group sizes, so
# the padding to 128-row tiles that tdist's grouped GEMM needs (about twice the pairs at 128
# experts and 2048 tokens) would only add rows to every GEMM and pass, and masking passes to keep
# them out of the sums. Its 2-D x 3-D form also reads w as it is, where tdist's TN grouped GEMM
# needs a transposed copy of every expert's weight.


def _compact_offs(r: dict) -> Tensor:
    return r["compact_offsets"][1:]  # int32: torch._grouped_mm's offs (every group's end)


def _sum_over_ranks_beside(partial: Tensor, world: int, side, main) -> Tensor:
    """partial summed over ranks (tdist's AllReduce on the side stream, beside what main runs next)."""
    if world == 1:
        return partial
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = _ops.all_reduce.default(partial, "auto")
    out.record_stream(main)
    return out


def _moe_ag_backward_compact(r, grad, gathered, w, m, world, rank, need_x, need_w):
    """moe_ag_group_gemm_backward in the compact order (above): G_c = dY[row of c]; dx = this rank's
    rows of sum_ranks sum_j (G_c @ w_e)[c of (t, j)] (the top-k sum, then a ReduceScatter);
    dw_e = G_c,e.T @ x[token of c]_e. gathered: every token's x [M, K] (with need_w)."""
    offs, g_c = _compact_offs(r), grad[r["row_of_compact"]]
    grad_x = grad_w = _no_grad_placeholder(grad)
    if need_x:
        full = _sum_pairs(torch._grouped_mm(g_c, w, offs=offs), r["compact_of_pair"])
        grad_x = full if world == 1 else scatter_rows(full, m, world, rank)
    if need_w:
        grad_w = torch._grouped_mm(g_c.t(), gathered[r["token_of_compact"]], offs=offs)
    return grad_x, grad_w


def _moe_rs_backward_compact(r, g_all, h, w, topk_weights, world, side, main, need_h, need_w, need_weights):
    """moe_group_gemm_rs_backward in the compact order (above): G_c = G[token of c], U = G_c @ w_e,
    dh[row of c] = p(c) U[c] (padding rows 0), dp = <U[c], h[row of c]>, dw_e = (p G_c)_e.T @ h_c."""
    offs, rows = _compact_offs(r), r["row_of_compact"]
    g_c = g_all[r["token_of_compact"]]  # [P, N]
    p_c = topk_weights.reshape(-1)[r["pair_of_compact"]].float().unsqueeze(1)  # [P, 1]
    grad_h = grad_w = grad_p = _no_grad_placeholder(g_all)
    h_c = h[rows] if (need_w or need_weights) else None  # [P, K]
    if need_h or need_weights:
        u = torch._grouped_mm(g_c, w, offs=offs)  # [P, K]
        if need_weights:
            # <U[c], h_c[c]> in fp32, in chunks of about 128 MiB of fp32 temporaries
            dots = torch.empty(rows.numel(), dtype=torch.float32, device=h.device)
            step = max(1, (128 << 20) // max(1, h.shape[1] * 8))
            for first in range(0, rows.numel(), step):
                last = first + step
                torch.sum(u[first:last].float() * h_c[first:last], 1, out=dots[first:last])
            partial = dots[r["compact_of_pair"]]  # [M, topk]
            grad_p = _sum_over_ranks_beside(partial, world, side, main)
        if need_h:  # p(c) U[c]: scaled in place (fp32 product, one rounding), then to h's rows
            grad_h = h.new_zeros(h.shape)
            grad_h[rows] = u.mul_(p_c)
    if need_w:  # (p G_c): g_c scaled in place once U no longer needs it
        grad_w = torch._grouped_mm(g_c.mul_(p_c).t(), h_c, offs=offs)
    return grad_h, grad_w, grad_p


@torch.library.custom_op("tdist::moe_ag_group_gemm_backward", mutates_args=())
def moe_ag_group_gemm_backward(grad: Tensor, x_rows: Tensor, topk_ids: Tensor, w: Tensor, method: str, need_x: bool,
                               need_w: bool) -> Tuple[Tensor, Tensor]:
    """Backward of d = moe_ag_group_gemm(x_rows, topk_ids, w, method): (grad of x_rows, grad of w); an
    empty tensor where not needed."""
    rank, world = rank_world()
    m = topk_ids.shape[0]
    experts, n, k = w.shape
    if m == 0 or n == 0:  # the forward ran no collective either (every rank has the same M)
        return (x_rows.new_zeros(x_rows.shape) if need_x else _no_grad_placeholder(grad),
                w.new_zeros(w.shape) if need_w else _no_grad_placeholder(grad))
    grad_x = grad_w = _no_grad_placeholder(grad)
    grad = dense(grad)
    main = torch.cuda.current_stream(grad.device)
    side = _side_stream(grad.device)
    side.wait_stream(main)
    if need_w:
        with torch.cuda.stream(side):
            gathered = gather_rows(x_rows, m, world) if world > 1 else x_rows  # [M, K]: every token, again
        gathered.record_stream(main)
    # Beside the AllGather: the routing; the collective below waits for it.
    r = _moe.routing(topk_ids, experts, world, rank)
    offsets, token_of_row = r["offsets"], r["token_of_row"]
    main.wait_stream(side)
    if _by_torch_grouped_mm(grad):
        return _moe_ag_backward_compact(r, grad, gathered if need_w else None, w, m, world, rank, need_x, need_w)
    if need_x:
        # dx_rows[t] = this rank's rows of sum_ranks sum_j dY[rop[t, j]] @ w_e: the second projection's
        # op on dY (expert-ordered rows of the same routing) and w_e.T with every weight 1, its
        # ReduceScatter overlapped with its grouped GEMM; it reads no padding row of dY.
        ones = torch.ones(topk_ids.shape, dtype=torch.float32, device=grad.device)
        grad_x = _ops.moe_group_gemm_rs.default(grad, _experts_transposed(w), topk_ids, ones, _moe.rs_method(method),
                                                False)
    if need_w:
        valid = _rows_valid(token_of_row)
        a = _zero_rows(gathered[token_of_row.clamp(min=0)], valid)  # [R, K] in expert order
        grad_w = grouped_weight_grad(_zero_rows(grad, valid), a, offsets, experts)
    return grad_x, grad_w


@moe_ag_group_gemm_backward.register_fake
def _(grad, x_rows, topk_ids, w, method, need_x, need_w):
    grad_x = x_rows.new_empty(x_rows.shape) if need_x else grad.new_empty((0,))
    grad_w = w.new_empty(w.shape) if need_w else grad.new_empty((0,))
    return grad_x, grad_w


@torch.library.custom_op("tdist::moe_group_gemm_rs_backward", mutates_args=())
def moe_group_gemm_rs_backward(grad: Tensor, h: Tensor, w: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                               all_reduce: bool, need_h: bool, need_w: bool,
                               need_weights: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward of y = moe_group_gemm_rs(h, w, topk_ids, topk_weights, method, all_reduce): (grad of h,
    grad of w, grad of topk_weights, summed over ranks); an empty tensor where not needed."""
    rank, world = rank_world()
    m, topk = topk_ids.shape
    experts, n, k = w.shape
    if m == 0 or n == 0:
        return (h.new_zeros(h.shape) if need_h else _no_grad_placeholder(grad),
                w.new_zeros(w.shape) if need_w else _no_grad_placeholder(grad),
                topk_weights.new_zeros(topk_weights.shape) if need_weights else _no_grad_placeholder(grad))
    grad_h = grad_w = grad_p = _no_grad_placeholder(grad)
    grad = dense(grad)
    main = torch.cuda.current_stream(grad.device)
    side = _side_stream(grad.device)
    g_all = grad  # [M, N]: every token's output gradient (replicated for _ar)
    side.wait_stream(main)  # forked in every case, so that the join below is one (also in a capture)
    if not all_reduce:
        with torch.cuda.stream(side):
            g_all = gather_rows(grad, m, world) if world > 1 else grad
            gathered_ready = side.record_event()
        g_all.record_stream(main)
    # Beside the AllGather: the routing.
    r = _moe.routing(topk_ids, experts, world, rank)
    if _by_torch_grouped_mm(grad):
        if not all_reduce:
            main.wait_event(gathered_ready)
        grad_h, grad_w, grad_p = _moe_rs_backward_compact(r, g_all, h, w, topk_weights, world, side, main, need_h,
                                                          need_w, need_weights)
        main.wait_stream(side)
        return grad_h, grad_w, grad_p
    offsets, token_of_row, row_of_pair = r["offsets"], r["token_of_row"], r["row_of_pair"]
    valid = _rows_valid(token_of_row)
    pairs = row_of_pair.reshape(-1)
    # p of each row (fp32 [R]); 0 in padding rows and past offsets[E].
    p_row = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
    p_row[pairs] = topk_weights.reshape(-1).float()
    if not all_reduce:
        main.wait_event(gathered_ready)
    g_rows = g_all[token_of_row.clamp(min=0)]  # [R, N]: G[tok[r]] (token 0 in rows outside the pairs)
    if need_h or need_weights:
        u = grouped_data_grad(g_rows, w, offsets)  # [R, K]: G[tok[r]] @ w_e; rows past offsets[E] unwritten
        if need_h:
            grad_h = _zero_rows((u.float() * p_row.unsqueeze(1)).to(h.dtype), valid)
        if need_weights:
            # <U[r], h[r]> per row (fp32, in chunks of rows), then the pairs' rows; rows outside the
            # pairs (garbage in h, unwritten in u) are computed but never read.
            dots = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
            step = max(1, (64 << 20) // max(1, k * 8))
            for first in range(0, h.shape[0], step):
                dots[first:first + step] = (u[first:first + step].float() * h[first:first + step].float()).sum(1)
            partial = dots[pairs].view(m, topk)
            grad_p = _sum_over_ranks_beside(partial, world, side, main)
    if need_w:
        dz = _zero_rows((g_rows.float() * p_row.unsqueeze(1)).to(h.dtype), valid)
        grad_w = grouped_weight_grad(dz, _zero_rows(h, valid), offsets, experts)
    main.wait_stream(side)
    return grad_h, grad_w, grad_p


@moe_group_gemm_rs_backward.register_fake
def _(grad, h, w, topk_ids, topk_weights, all_reduce, need_h, need_w, need_weights):
    return (h.new_empty(h.shape) if need_h else grad.new_empty((0,)),
            w.new_empty(w.shape) if need_w else grad.new_empty((0,)),
            topk_weights.new_empty(topk_weights.shape) if need_weights else grad.new_empty((0,)))


@torch.library.custom_op("tdist::grouped_gemm_backward", mutates_args=())
def grouped_gemm_backward(grad: Tensor, a: Tensor, w: Tensor, offsets: Tensor, need_a: bool,
                          need_w: bool) -> Tuple[Tensor, Tensor]:
    """Backward of d = tdist.moe.grouped_gemm(a, w, offsets): (grad of a, grad of w); an empty tensor
    where not needed. Rows past offsets[G] take no part (d's are unwritten): their a gradient is 0."""
    groups, n, k = w.shape
    if a.shape[0] == 0 or n == 0:
        return (a.new_zeros(a.shape) if need_a else _no_grad_placeholder(grad),
                w.new_zeros(w.shape) if need_w else _no_grad_placeholder(grad))
    grad_a = grad_w = _no_grad_placeholder(grad)
    grad = dense(grad)
    inside = (torch.arange(a.shape[0], device=a.device) < offsets[groups]).unsqueeze(1)
    if need_a:
        grad_a = _zero_rows(grouped_data_grad(grad, w, offsets), inside)
    if need_w:
        grad_w = grouped_weight_grad(_zero_rows(grad, inside), _zero_rows(a, inside), offsets, groups)
    return grad_a, grad_w


@grouped_gemm_backward.register_fake
def _(grad, a, w, offsets, need_a, need_w):
    return (a.new_empty(a.shape) if need_a else grad.new_empty((0,)),
            w.new_empty(w.shape) if need_w else grad.new_empty((0,)))


def _moe_ag_setup(ctx, inputs, output):
    x_rows, topk_ids, w, method = inputs
    ctx.method = method
    ctx.save_for_backward(x_rows, topk_ids, w)  # this rank's tokens only: backward gathers them again


def _moe_ag_backward(ctx, grad_d):
    x_rows, topk_ids, w = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    grad_x, grad_w = _ops.moe_ag_group_gemm_backward.default(dense(grad_d), x_rows, topk_ids, w, ctx.method, need_x,
                                                             need_w)
    return _or_none(grad_x, need_x), None, _or_none(grad_w, need_w), None


def _moe_rs_setup(ctx, inputs, output):
    h, w, topk_ids, topk_weights, method, all_reduce = inputs
    ctx.all_reduce = all_reduce
    ctx.save_for_backward(h, w, topk_ids, topk_weights)


def _moe_rs_backward(ctx, grad_y):
    h, w, topk_ids, topk_weights = ctx.saved_tensors
    need_h, need_w, need_p = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]
    grad_h, grad_w, grad_p = _ops.moe_group_gemm_rs_backward.default(dense(grad_y), h, w, topk_ids, topk_weights,
                                                                     ctx.all_reduce, need_h, need_w, need_p)
    return _or_none(grad_h, need_h), _or_none(grad_w, need_w), None, _or_none(grad_p, need_p), None, None


def _grouped_gemm_setup(ctx, inputs, output):
    a, w, offsets = inputs
    ctx.save_for_backward(a, w, offsets)


def _grouped_gemm_backward(ctx, grad_d):
    a, w, offsets = ctx.saved_tensors
    need_a, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_a, grad_w = _ops.grouped_gemm_backward.default(dense(grad_d), a, w, offsets, need_a, need_w)
    return _or_none(grad_a, need_a), _or_none(grad_w, need_w), None


torch.library.register_autograd("tdist::moe_ag_group_gemm", _moe_ag_backward, setup_context=_moe_ag_setup)
torch.library.register_autograd("tdist::moe_group_gemm_rs", _moe_rs_backward, setup_context=_moe_rs_setup)
torch.library.register_autograd("tdist::grouped_gemm", _grouped_gemm_backward, setup_context=_grouped_gemm_setup)
