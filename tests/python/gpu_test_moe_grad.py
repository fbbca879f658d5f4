"""GPU tests of the MoE ops' autograd (python/tdist/_autograd.py, docs/moe.md "Training") under torchrun,
at any world size (1 included):

    python -m torch.distributed.run --nproc-per-node 2 tests/python/gpu_test_moe_grad.py
    python -m torch.distributed.run --nproc-per-node 1 tests/python/gpu_test_moe_grad.py

Every rank draws the same tokens, ids, router weights and output gradients (seeded alike) and its own
weight shards and h; the references are float64 autograd of the whole math written out per expert
(tdist's pieces unused), with every rank's terms summed through torch.distributed (the AllGather's
adjoint, a ReduceScatter, as an all_reduce then this rank's rows):

* moe_ag_group_gemm: grads of x_rows and w, with the output gradient NaN in the rows past offsets[E]
  (not outputs: must not count) and random in the padding rows (constant outputs: must not count);
* moe_group_gemm_rs / moe_group_gemm_ar: grads of h, w and topk_weights, h NaN in its padding rows and
  past offsets[E]; the h gradient exactly 0 there;
* grouped_gemm alone: grads of a and w, empty groups, int32 and int64 offsets, rows past offsets[G]
  NaN in a and in the output gradient;
* bf16 and fp16; random routing, one with half the experts empty, one hot expert; M = 1 (below the
  world size at W = 2) and odd M; K and N odd multiples of 8; the experts' weight gradient both ways
  (TDIST_MOE_WGRAD: torch._grouped_mm where it applies, and the tile fallback);
* the layer of docs/moe.md (up projection, SwiGLU, down projection): eagerly, under
  torch.compile(fullgraph=True), with torch.utils.checkpoint, and forward + backward captured in one
  CUDA graph replayed with fresh routing, tokens and gradients.
Gradients are new tensors: the allocator's free blocks are filled with NaN before each backward.

Tolerances (max |got - ref| <= tol x max |ref|): 2e-2 for one op in bf16 / fp16 (its inputs exact in
both; the output gradient, the rows dY @ w_e and the results are rounded to 16 bits, 2^-9 relative
each, and sums of up to topk such rows or of a few hundred products in fp32 add a few of those); 4e-2
for the layer (h13 and h rounded to bf16 between the GEMMs, and SiLU's derivative on them).
"""

import os
import sys

import gpu_harness as h
from gpu_harness import check_close, rank, world
from gpu_test_moe import GROUPED_GEMM_CASES, moe_layer, padded_offsets, poison_allocator, rand

import tdist

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

moe = tdist.moe
OP_TOL = 2e-2
LAYER_TOL = 4e-2
DTYPES = (torch.bfloat16, torch.float16)

CASES = [  # (m, topk, experts, K, N, routing)
    (1, 2, 4, 200, 136, "random"),
    (301, 2, 8, 200, 136, "half_empty"),
    (517, 4, 6, 72, 104, "hot"),
    (1200, 2, 8, 136, 264, "random"),
]


def routing_ids(m, topk, experts, kind, seed):
    """int32 [m, topk] distinct experts per token, the same on every rank. half_empty: experts
    E/2 .. E - 1 get no token; hot: every token's first slot on expert 1."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand((m, experts), generator=g)
    if kind == "half_empty":
        scores = scores - (torch.arange(experts) >= experts // 2) * 10.0
    elif kind == "hot":
        scores = scores + (torch.arange(experts) == 1) * 10.0
    return scores.topk(topk, dim=1).indices.to(torch.int32)


class Checks:
    """Collects failed checks and raises them at the end of a test: a rank whose check fails still runs
    every later case, so the ranks keep calling the collectives together (a rank leaving the loop
    early would leave the others waiting)."""

    def __init__(self):
        self.failed = []

    def __call__(self, fn, *args):
        try:
            fn(*args)
        except AssertionError as e:
            self.failed.append(str(e))

    def raise_failed(self):
        if self.failed:
            raise AssertionError(f"{len(self.failed)} checks failed:\n" + "\n".join(self.failed[:20]))


def check_zero(t, what):
    assert bool((t == 0).all()), what


def all_ranks_sum(t):
    t = t.detach().clone()
    dist.all_reduce(t)
    return t


def with_wgrad(style):
    """Sets TDIST_MOE_WGRAD for one case; returns the old value's restorer."""
    old = os.environ.get("TDIST_MOE_WGRAD")
    os.environ["TDIST_MOE_WGRAD"] = style

    def restore():
        if old is None:
            os.environ.pop("TDIST_MOE_WGRAD", None)
        else:
            os.environ["TDIST_MOE_WGRAD"] = old
    return restore


def pairs_of(ids, e):
    t, j = (ids.long() == e).nonzero(as_tuple=True)
    return t.cuda(), j.cuda()


def nan_outside_pairs(t, routing, cap):
    """t with the rows that hold no pair (padding, and past offsets[E]) set to NaN."""
    t = t.clone()
    tor = torch.tensor(routing["token_of_row"] + [-1] * (cap - len(routing["token_of_row"])), dtype=torch.long)
    t[(tor < 0).to(t.device)] = float("nan")
    return t


# --- moe_ag_group_gemm -------------------------------------------------------------------------------

def ag_reference(x_all, w, g, routing):
    """float64 grads (of every token: this rank's term, of this rank's w) of sum over the pairs' rows r
    of <g[r], x[tok[r]] @ w_e^T>."""
    offsets, counts = routing["offsets"], routing["counts"]
    tor = torch.tensor(routing["token_of_row"], dtype=torch.long, device="cuda")
    x64 = x_all.double().requires_grad_()
    w64 = w.double().requires_grad_()
    loss = x64.new_zeros(())
    for e in range(w.shape[0]):
        rows = torch.arange(offsets[e], offsets[e] + counts[e], device="cuda")
        if rows.numel():
            loss = loss + ((x64[tor[rows]] @ w64[e].T) * g[rows].double()).sum()
    loss.backward()
    return x64.grad, w64.grad


def test_moe_ag_group_gemm_grad():
    W, me = world(), rank()
    seed = 100
    check = Checks()
    for dtype in DTYPES:
        for (m, topk, E, K, N, kind) in CASES:
            for style in (("auto", "tiles") if dtype == torch.bfloat16 else ("auto",)):
                seed += 1
                what = f"ag grad {dtype} m={m} topk={topk} E={E} K={K} N={N} {kind} wgrad={style}"
                restore = with_wgrad(style)
                try:
                    ids = routing_ids(m, topk, E, kind, seed)
                    x_all = rand((m, K), dtype, seed + 1).cuda()
                    w = rand((E, N, K), dtype, seed + 100 * (me + 2), scale=0.1).cuda()
                    first, rows = moe.rows_of(m, W, me)
                    cap = moe.capacity(m, topk, E)
                    routing = moe.routing_reference(ids, E, W, me)
                    g = rand((cap, N), dtype, seed + 7 + me).cuda()
                    g[routing["offsets"][E]:] = float("nan")  # not outputs of the op
                    x_rows = x_all[first:first + rows].clone().requires_grad_()
                    w_ = w.clone().requires_grad_()
                    d = tdist.moe_ag_group_gemm(x_rows, ids.cuda(), w_)
                    poison_allocator()
                    d.backward(g)
                    dx_ref, dw_ref = ag_reference(x_all, w, g, routing)
                    dx_ref = all_ranks_sum(dx_ref)[first:first + rows]
                    check(check_close, x_rows.grad, dx_ref.cpu(), what + " x_rows", OP_TOL)
                    check(check_close, w_.grad, dw_ref.cpu(), what + " w", OP_TOL)
                    empty = [e for e in range(E) if routing["counts"][e] == 0]
                    if empty:
                        check(check_zero, w_.grad[empty], f"{what}: an empty expert's w gradient is not 0")
                finally:
                    restore()
    check.raise_failed()


# --- moe_group_gemm_rs / _ar -------------------------------------------------------------------------

def rs_reference(h_, w, ids, p, g_all, routing):
    """float64 grads (this rank's h, this rank's w, p: this rank's term) of <g_all, z>, z[t] = sum_j
    p[t, j] h[row_of_pair[t][j]] @ w_e^T."""
    m, topk = ids.shape
    rop = torch.tensor(routing["row_of_pair"], dtype=torch.long, device="cuda").view(m, topk)
    h64 = torch.nan_to_num(h_.double(), nan=0.0).requires_grad_()  # rows outside the pairs: unused
    w64 = w.double().requires_grad_()
    p64 = p.double().requires_grad_()
    z = torch.zeros((m, w.shape[1]), dtype=torch.float64, device="cuda")
    for e in range(w.shape[0]):
        t, j = pairs_of(ids, e)
        if t.numel():
            z = z.index_add(0, t, p64[t, j].unsqueeze(1) * (h64[rop[t, j]] @ w64[e].T))
    (z * g_all.double()).sum().backward()
    return h64.grad, w64.grad, p64.grad


def test_moe_group_gemm_rs_and_ar_grad():
    W, me = world(), rank()
    seed = 2000
    check = Checks()
    for dtype in DTYPES:
        for (m, topk, E, K, N, kind) in CASES:
            for variant in ("rs", "ar"):
                seed += 1
                what = f"{variant} grad {dtype} m={m} topk={topk} E={E} K={K} N={N} {kind}"
                ids = routing_ids(m, topk, E, kind, seed)
                cap = moe.capacity(m, topk, E)
                routing = moe.routing_reference(ids, E, W, me)
                p = torch.rand((m, topk), generator=torch.Generator().manual_seed(seed + 2)).cuda()
                h_ = nan_outside_pairs(rand((cap, K), dtype, seed + 100 * (me + 2)).cuda(), routing, cap)
                w = rand((E, N, K), dtype, seed + 100 * (me + 2) + 1, scale=0.1).cuda()
                g_all = rand((m, N), dtype, seed + 3).cuda()  # every token's output gradient, every rank alike
                hh, ww, pp = h_.clone().requires_grad_(), w.clone().requires_grad_(), p.clone().requires_grad_()
                if variant == "rs":
                    first, rows = moe.rows_of(m, W, me)
                    y = tdist.moe_group_gemm_rs(hh, ww, ids.cuda(), pp)
                    grad = g_all[first:first + rows]
                else:  # replicated output, replicated gradient (every rank's loss is the same)
                    y = tdist.moe_group_gemm_ar(hh, ww, ids.cuda(), pp)
                    grad = g_all
                poison_allocator()
                y.backward(grad)
                dh_ref, dw_ref, dp_ref = rs_reference(h_, w, ids, p, g_all, routing)
                dp_ref = all_ranks_sum(dp_ref)
                check(check_close, hh.grad, dh_ref.cpu(), what + " h", OP_TOL)
                check(check_zero, hh.grad[torch.isnan(h_).any(1)], f"{what}: h gradient not 0 outside the pairs")
                check(check_close, ww.grad, dw_ref.cpu(), what + " w", OP_TOL)
                check(check_close, pp.grad, dp_ref.cpu(), what + " topk_weights", OP_TOL)
    check.raise_failed()


# --- grouped_gemm ------------------------------------------------------------------------------------

def test_grouped_gemm_grad():
    seed = 3000 + rank()
    check = Checks()
    for dtype in DTYPES:
        for counts, K, N, idx in GROUPED_GEMM_CASES:
            seed += 1
            what = f"grouped_gemm grad {dtype} counts={counts} K={K} N={N} {idx}"
            offsets = padded_offsets(counts)
            end, m_total = offsets[-1], offsets[-1] + 37
            a = rand((m_total, K), dtype, seed).cuda()
            a[end:] = float("nan")  # rows past offsets[G] take no part
            w = rand((len(counts), N, K), dtype, seed + 50, scale=0.1).cuda()
            g = rand((m_total, N), dtype, seed + 60).cuda()
            g[end:] = float("nan")
            aa, ww = a.clone().requires_grad_(), w.clone().requires_grad_()
            d = moe.grouped_gemm(aa, ww, torch.tensor(offsets, dtype=idx, device="cuda"))
            poison_allocator()
            d.backward(g)
            a64 = a[:end].double().requires_grad_()
            w64 = w.double().requires_grad_()
            ref = torch.cat([a64[offsets[i]:offsets[i + 1]] @ w64[i].T for i in range(len(counts))])
            (ref * g[:end].double()).sum().backward()
            da_ref = torch.cat([a64.grad, a64.grad.new_zeros((m_total - end, K))])
            check(check_close, aa.grad, da_ref.cpu(), what + " a", OP_TOL)
            check(check_close, ww.grad, w64.grad.cpu(), what + " w", OP_TOL)
    check.raise_failed()


# --- the layer of docs/moe.md ------------------------------------------------------------------------

HIDDEN, FFN_LOCAL, EXPERTS, TOPK = 256, 136, 8, 2


def layer_inputs(m, kind, seed):
    """(ids, p, x_all, g_all) the same on every rank; (w13, w2) this rank's shards."""
    ids = routing_ids(m, TOPK, EXPERTS, kind, seed)
    p = torch.rand((m, TOPK), generator=torch.Generator().manual_seed(seed + 1)).cuda()
    x_all = rand((m, HIDDEN), torch.bfloat16, seed + 2).cuda()
    g_all = rand((m, HIDDEN), torch.bfloat16, seed + 3).cuda()
    w13 = rand((EXPERTS, 2 * FFN_LOCAL, HIDDEN), torch.bfloat16, seed + 10 * (rank() + 1), scale=HIDDEN ** -0.5)
    w2 = rand((EXPERTS, HIDDEN, FFN_LOCAL), torch.bfloat16, seed + 10 * (rank() + 1) + 1,
              scale=(FFN_LOCAL * world()) ** -0.5)
    return ids, p, x_all, g_all, w13.cuda(), w2.cuda()


def layer_reference(ids, p, x_all, g_all, w13, w2):
    """float64 (output of every token, grads of this rank's rows of x, w13, w2, p) of <g_all, y>."""
    W, me = world(), rank()
    f = w2.shape[2]
    x64, w13_64, w2_64, p64 = (t.double().requires_grad_() for t in (x_all, w13, w2, p))
    z = torch.zeros((x_all.shape[0], w2.shape[1]), dtype=torch.float64, device="cuda")
    for e in range(w13.shape[0]):
        t, j = pairs_of(ids, e)
        if t.numel():
            a = x64[t] @ w13_64[e].T
            z = z.index_add(0, t, p64[t, j].unsqueeze(1) * ((F.silu(a[:, :f]) * a[:, f:]) @ w2_64[e].T))
    (z * g_all.double()).sum().backward()
    first, rows = moe.rows_of(x_all.shape[0], W, me)
    return (all_ranks_sum(z), all_ranks_sum(x64.grad)[first:first + rows], w13_64.grad, w2_64.grad,
            all_ranks_sum(p64.grad))


def check_layer(check, what, y, y_ref_rows, x, w13, w2, p, refs):
    _, dx_ref, dw13_ref, dw2_ref, dp_ref = refs
    check(check_close, y, y_ref_rows.cpu(), what + " output", LAYER_TOL)
    check(check_close, x.grad, dx_ref.cpu(), what + " x_rows", LAYER_TOL)
    check(check_close, w13.grad, dw13_ref.cpu(), what + " w13", LAYER_TOL)
    check(check_close, w2.grad, dw2_ref.cpu(), what + " w2", LAYER_TOL)
    check(check_close, p.grad, dp_ref.cpu(), what + " topk_weights", LAYER_TOL)


def run_layer(check, what, m, kind, seed, run):
    ids, p, x_all, g_all, w13, w2 = layer_inputs(m, kind, seed)
    first, rows = moe.rows_of(m, world(), rank())
    x = x_all[first:first + rows].clone().requires_grad_()
    w13_, w2_, p_ = w13.clone().requires_grad_(), w2.clone().requires_grad_(), p.clone().requires_grad_()
    y = run(x, ids.cuda(), p_, w13_, w2_)
    poison_allocator()
    y.backward(g_all[first:first + rows])
    refs = layer_reference(ids, p, x_all, g_all, w13, w2)
    check_layer(check, what, y.detach(), refs[0][first:first + rows], x, w13_, w2_, p_, refs)


def test_layer_eager():
    check = Checks()
    for m, kind in ((64, "random"), (777, "half_empty")):
        run_layer(check, f"layer m={m} {kind}", m, kind, 4000 + m, moe_layer)
    check.raise_failed()


def test_layer_torch_compile():
    torch._dynamo.reset()
    compiled = torch.compile(moe_layer, fullgraph=True)
    check = Checks()
    for m, kind in ((100, "random"), (333, "hot")):
        run_layer(check, f"compiled layer m={m} {kind}", m, kind, 5000 + m, compiled)
    check.raise_failed()


def test_layer_activation_checkpointing():
    check = Checks()
    run_layer(check, "checkpointed layer", 250, "half_empty", 6000,
              lambda *args: checkpoint(moe_layer, *args, use_reentrant=False))
    check.raise_failed()


def test_layer_cuda_graph_forward_backward():
    """Forward and backward of the layer in one CUDA graph (the backward's routing, grouped GEMMs,
    side-stream collectives inside the capture), replayed with fresh routing, tokens and gradients."""
    W, me = world(), rank()
    m = 600
    check = Checks()
    first, rows = moe.rows_of(m, W, me)
    ids0, p0, x0, g0, w13, w2 = layer_inputs(m, "random", 7000)
    x = x0[first:first + rows].clone().requires_grad_()
    ids = ids0.cuda()
    p = p0.clone().requires_grad_()
    g = g0[first:first + rows].clone()
    w13_, w2_ = w13.clone().requires_grad_(), w2.clone().requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture: contexts, kernels, the methods' timing
        for _ in range(2):
            moe_layer(x, ids, p, w13_, w2_).backward(g)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    for t in (x, p, w13_, w2_):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe_layer(x, ids, p, w13_, w2_)
        y.backward(g)
    for replay, kind in enumerate(("half_empty", "hot", "random")):
        ids_r, p_r, x_all, g_all, _, _ = layer_inputs(m, kind, 7100 + replay)
        with torch.no_grad():
            x.copy_(x_all[first:first + rows])
            p.copy_(p_r)
            for t in (y, x.grad, p.grad, w13_.grad, w2_.grad):
                t.fill_(float("nan"))
        ids.copy_(ids_r.cuda())
        g.copy_(g_all[first:first + rows])
        graph.replay()
        torch.cuda.synchronize()
        refs = layer_reference(ids_r, p_r, x_all, g_all, w13, w2)
        check_layer(check, f"graph layer replay {replay} {kind}", y.detach(), refs[0][first:first + rows], x, w13_,
                    w2_, p, refs)
    del graph
    torch.cuda.synchronize()
    check.raise_failed()


TESTS = [
    test_moe_ag_group_gemm_grad,
    test_moe_group_gemm_rs_and_ar_grad,
    test_grouped_gemm_grad,
    test_layer_eager,
    test_layer_torch_compile,
    test_layer_activation_checkpointing,
    test_layer_cuda_graph_forward_backward,
]

if __name__ == "__main__":
    sys.exit(h.run_tests(TESTS))
