"""GPU tests of tdist's tensor-parallel MoE ops under torchrun:

    python -m torch.distributed.run --nproc-per-node 2 tests/python/gpu_test_moe.py

Every rank draws the same tokens, ids and weights (seeded alike) and its own weight shards; the
references are float64, built from the host routing (tdist.moe.routing_reference), with every
rank's partial sums added through torch.distributed.

* moe_ag_group_gemm: every expert-ordered row against x[token] @ w[e]^T, padding rows exactly 0;
* moe_group_gemm_rs / moe_group_gemm_ar: against the sum over ranks and slots of w * h[row] @ w2[e]^T,
  with h's padding rows and the rows past offsets[E] filled with garbage (they must not be read);
* methods auto, fused (the first projection's), chunked and baseline; bf16 and fp16; random, skewed,
  single-expert routings; M = 1 (below the world size), odd M, M past the chunked bound; K and N odd
  multiples of 8; int64 ids;
* the worked layer of docs/moe.md (up projection, SwiGLU, down projection) against a float64 layer;
* a CUDA graph of the layer replayed with fresh routing and tokens; torch.compile(fullgraph=True);
* moe_ag_group_gemm_fp8 (e4m3 tokens and weights with block scales) against float64 of the dequantised
  operands, every method, under torch.compile; moe_group_gemm_rs_fp8 / _ar_fp8 likewise (summed over
  ranks); their argument errors;
* the grouped GEMM alone (tdist.moe.grouped_gemm): every group's rows, padding included, against
  float64 x w[g]^T; empty groups, int32 and int64 offsets, rows past offsets[G]; its argument errors;
* its FP8 instance (tdist.moe.grouped_gemm_fp8) on tdist.moe.quantize_fp8_* outputs against float64 of
  the dequantised operands, row- and column-major scales, under torch.compile; its argument errors;
* argument errors naming the argument;
* 200 back-to-back calls of each op (the test waits for none before the last), every call with
  fresh routing, tokens and router weights, M from 1 to 384, methods and bf16 / fp16 alternating,
  each output allocated where a NaN block of its size was just freed, every call against float64;
* tdist.moe.routing on the GPU (the backward's) against the torch-op routing of the same ids;
* an expert id out of range (== E, negative) in topk_ids: the host reference raises naming topk_ids;
  each op (every rank passing the same bad ids) goes on, and tdist.moe.check_errors() raises naming
  topk_ids[t][k] and the id, once per report; the next good call is right.
Outputs come from torch's allocator, poisoned with NaN before each call. TDIST_GPU_TESTS (names,
comma-separated) runs only the tests named.
"""

import sys

import gpu_harness as h
from gpu_harness import check_close, expect_error, rank, world

import tdist  # noqa: F401 (gpu_harness imported it before torch)

import torch
import torch.distributed as dist
import torch.nn.functional as F

moe = tdist.moe
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2}


def poison_allocator():
    junk = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    junk.fill_(0xFF)
    del junk


def routing_ids(m, topk, experts, kind, seed):
    """int32 [m, topk] distinct experts per token, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand((m, experts), generator=g)
    if kind == "skewed":
        scores = scores + (torch.arange(experts) < 2) * 0.8
    elif kind == "single":  # every token's first slot on expert 1
        scores = scores + (torch.arange(experts) == 1) * 10.0
    return scores.topk(topk, dim=1).indices.to(torch.int32)


def rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def all_ranks_sum(t):
    t = t.cuda()
    dist.all_reduce(t)
    return t.cpu()


def ag_reference(x_all, ids, w, routing):
    """float64 [offsets[E], N]: expert e's rows x[token] @ w[e]^T, its padding rows 0."""
    offsets, counts = routing["offsets"], routing["counts"]
    tor = torch.tensor(routing["token_of_row"], dtype=torch.long)
    E = w.shape[0]
    ref = torch.zeros((offsets[E], w.shape[1]), dtype=torch.float64)
    for e in range(E):
        rows = torch.arange(offsets[e], offsets[e] + counts[e])
        assert bool((tor[rows] >= 0).all()) and bool((tor[offsets[e] + counts[e]:offsets[e + 1]] < 0).all())
        ref[rows] = x_all[tor[rows]].double() @ w[e].double().T
    return ref


def rs_partial(h, w2, ids, weights, routing):
    """This rank's float64 [M, N]: sum over slots k of weights[t, k] * h[row_of_pair[t][k]] @ w2[e]^T."""
    m, topk = ids.shape
    out = torch.zeros((m, w2.shape[1]), dtype=torch.float64)
    rop = torch.tensor(routing["row_of_pair"], dtype=torch.long).view(m, topk)
    for e in range(w2.shape[0]):
        t, k = (ids.long() == e).nonzero(as_tuple=True)
        if t.numel():
            part = h[rop[t, k]].double() @ w2[e].double().T
            out.index_add_(0, t, weights[t, k].double().view(-1, 1) * part)
    return out


def dequant_rows(q, scales):
    """float64 [M, K] on the host of quantize_fp8_rows' (q [M, K], scales [M, ceil(K / 128)])."""
    return (q.double() * scales.double().repeat_interleave(128, 1)[:, :q.shape[1]]).cpu()


def dequant_blocks(q, scales):
    """float64 [G, N, K] on the host of quantize_fp8_blocks' (q [G, N, K], scales [G, NB, KB])."""
    n, k = q.shape[1], q.shape[2]
    return (q.double() * scales.double().repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[..., :k]).cpu()


def garbage_padding(h, routing, capacity):
    """h with its padding rows and the rows past offsets[E] set to large values (not read by the op)."""
    h = h.clone()
    tor = routing["token_of_row"]
    pad = [r for r in range(len(tor)) if tor[r] < 0] + list(range(len(tor), capacity))
    if pad:
        h[torch.tensor(pad)] = 3.0e4
    return h


CASES = [  # (m, topk, experts, K, N, routing)
    (1, 2, 4, 200, 136, "random"),
    (301, 2, 8, 200, 136, "random"),
    (1200, 2, 8, 136, 264, "skewed"),
    (517, 4, 6, 72, 104, "single"),
]


def test_moe_ag_group_gemm():
    W, me = world(), rank()
    seed = 10
    for dtype in (torch.bfloat16, torch.float16):
        for (m, topk, E, K, N, kind) in CASES:
            for method in moe.AG_METHODS:
                seed += 1
                what = f"ag {dtype} m={m} topk={topk} E={E} K={K} N={N} {kind} {method}"
                ids = routing_ids(m, topk, E, kind, seed)
                x_all = rand((m, K), dtype, seed + 1)
                w = rand((E, N, K), dtype, seed + 100 * (me + 2), scale=0.1)  # this rank's shard
                first, rows = moe.rows_of(m, W, me)
                ids_dev = ids.cuda() if method != "auto" else ids.to(torch.int64).cuda()  # int64 converted
                poison_allocator()
                d = tdist.moe_ag_group_gemm(x_all[first:first + rows].cuda(), ids_dev, w.cuda(), method=method)
                cap = moe.capacity(m, topk, E)
                assert tuple(d.shape) == (cap, N), what
                routing = moe.routing_reference(ids, E, W, me)
                ref = ag_reference(x_all, ids, w, routing)
                got = d[:routing["offsets"][E]]
                check_close(got, ref, what, TOL[dtype])
                pad = torch.tensor([r for r, t in enumerate(routing["token_of_row"]) if t < 0], dtype=torch.long)
                if pad.numel():
                    assert bool((got.cpu()[pad] == 0).all()), f"{what}: padding rows not 0"


FP8_AG_CASES = [  # (m, topk, experts, K, N, routing): K a multiple of 16, not always of 128
    (301, 2, 8, 208, 136, "random"),
    (1200, 4, 16, 256, 264, "skewed"),
    (3, 2, 4, 400, 40, "random"),
]


FP8_RS_CASES = [  # (m, topk, experts, K, N, routing): K (the intermediate size) a multiple of 16
    (301, 2, 8, 144, 200, "random"),
    (1200, 4, 16, 256, 264, "skewed"),
    (3, 2, 4, 48, 400, "random"),
]


def test_moe_ag_group_gemm_fp8():
    """tdist.moe_ag_group_gemm_fp8 on every rank's tokens quantised by quantize_fp8_rows and its weight
    shard by quantize_fp8_blocks, every method: against float64 of the dequantised operands, padding
    rows 0; column-major token scales give the same bits; under torch.compile(fullgraph=True). Argument
    errors name the argument."""
    W, me = world(), rank()
    seed = 700
    for (m, topk, E, K, N, kind) in FP8_AG_CASES:
        for method in moe.AG_FP8_METHODS:
            seed += 1
            what = f"ag fp8 m={m} topk={topk} E={E} K={K} N={N} {kind} {method}"
            ids = routing_ids(m, topk, E, kind, seed)
            x_all = rand((m, K), torch.bfloat16, seed + 1).cuda()
            w = rand((E, N, K), torch.bfloat16, seed + 100 * (me + 2), scale=0.1).cuda()
            x_q, x_s = moe.quantize_fp8_rows(x_all)  # every token's (the same on every rank)
            w_q, w_s = moe.quantize_fp8_blocks(w)
            first, rows = moe.rows_of(m, W, me)
            poison_allocator()
            d = tdist.moe_ag_group_gemm_fp8(x_q[first:first + rows], x_s[first:first + rows], ids.cuda(), w_q, w_s,
                                            method=method)
            assert d.dtype == torch.bfloat16 and tuple(d.shape) == (moe.capacity(m, topk, E), N), what
            routing = moe.routing_reference(ids, E, W, me)
            got = d[:routing["offsets"][E]]
            check_close(got, ag_reference(dequant_rows(x_q, x_s), ids, dequant_blocks(w_q, w_s), routing), what, 1e-2)
            pad = torch.tensor([r for r, t in enumerate(routing["token_of_row"]) if t < 0], dtype=torch.long)
            if pad.numel():
                assert bool((got.cpu()[pad] == 0).all()), f"{what}: padding rows not 0"
    m, topk, E, K, N = 64, 2, 4, 128, 72
    ids = routing_ids(m, topk, E, "random", 5).cuda()
    first, rows = moe.rows_of(m, W, me)
    x_q, x_s = moe.quantize_fp8_rows(rand((m, K), torch.bfloat16, 6).cuda()[first:first + rows])
    w_q, w_s = moe.quantize_fp8_blocks(rand((E, N, K), torch.bfloat16, 7 + me).cuda())
    compiled = torch.compile(lambda *t: tdist.moe_ag_group_gemm_fp8(*t) * 2, fullgraph=True)
    eager = tdist.moe_ag_group_gemm_fp8(x_q, x_s, ids, w_q, w_s).double().cpu()
    check_close(compiled(x_q, x_s, ids, w_q, w_s), 2 * eager, "moe_ag_group_gemm_fp8 under torch.compile", 1e-2)
    column = tdist.moe_ag_group_gemm_fp8(x_q, x_s.t().contiguous().t(), ids, w_q, w_s).double().cpu()
    assert torch.equal(column, eager), "moe_ag_group_gemm_fp8: column-major token scales changed the result"
    expect_error(lambda: tdist.moe_ag_group_gemm_fp8(x_q, x_s, ids, w_q, w_s, method="sequential"), "'method'")
    expect_error(lambda: tdist.moe_ag_group_gemm_fp8(x_q.float(), x_s, ids, w_q, w_s), "'x_rows'")
    expect_error(lambda: tdist.moe_ag_group_gemm_fp8(x_q, x_s[:, :0], ids, w_q, w_s), "'x_scales'")
    expect_error(lambda: tdist.moe_ag_group_gemm_fp8(x_q, x_s, ids, w_q, w_s[:1]), "'w_scales'")
    torch.cuda.synchronize()


def test_moe_group_gemm_rs_and_ar():
    W, me = world(), rank()
    seed = 1000
    for dtype in (torch.bfloat16, torch.float16):
        for (m, topk, E, K, N, kind) in CASES:
            for method in ("auto", "chunked", "baseline", "all_reduce"):
                seed += 1
                what = f"rs {dtype} m={m} topk={topk} E={E} K={K} N={N} {kind} {method}"
                ids = routing_ids(m, topk, E, kind, seed)
                weights = torch.rand((m, topk), generator=torch.Generator().manual_seed(seed + 2))
                cap = moe.capacity(m, topk, E)
                routing = moe.routing_reference(ids, E, W, me)
                h_rows = rand((cap, K), dtype, seed + 100 * (me + 2))
                w2 = rand((E, N, K), dtype, seed + 100 * (me + 2) + 1, scale=0.1)
                hh = garbage_padding(h_rows, routing, cap)
                ref = all_ranks_sum(rs_partial(h_rows, w2, ids, weights, routing))
                poison_allocator()
                if method == "all_reduce":
                    y = tdist.moe_group_gemm_ar(hh.cuda(), w2.cuda(), ids.cuda(), weights.cuda())
                    check_close(y, ref, what, TOL[dtype])
                else:
                    y = tdist.moe_group_gemm_rs(hh.cuda(), w2.cuda(), ids.cuda(), weights.cuda(), method=method)
                    first, rows = moe.rows_of(m, W, me)
                    check_close(y, ref[first:first + rows], what, TOL[dtype])


def test_moe_group_gemm_rs_fp8():
    """tdist.moe_group_gemm_rs_fp8 / _ar_fp8 on this rank's h (expert order, garbage padding rows) quantised
    by quantize_fp8_rows (row-major scales, or column-major: each method meets both) and its w2 shard by
    quantize_fp8_blocks, every method: against float64 of the dequantised operands summed over ranks.
    Argument errors name the argument."""
    W, me = world(), rank()
    seed = 1700
    for case, (m, topk, E, K, N, kind) in enumerate(FP8_RS_CASES):
        for i, method in enumerate(moe.RS_FP8_METHODS + ("all_reduce",)):
            seed += 1
            column_major = (case + i) % 2 == 1
            what = f"rs fp8 m={m} topk={topk} E={E} K={K} N={N} {kind} {method} column-major={column_major}"
            ids = routing_ids(m, topk, E, kind, seed)
            weights = torch.rand((m, topk), generator=torch.Generator().manual_seed(seed + 2))
            cap = moe.capacity(m, topk, E)
            routing = moe.routing_reference(ids, E, W, me)
            h = garbage_padding(rand((cap, K), torch.bfloat16, seed + 100 * (me + 2)), routing, cap).cuda()
            w2 = rand((E, N, K), torch.bfloat16, seed + 100 * (me + 2) + 1, scale=0.1).cuda()
            h_q, h_s = moe.quantize_fp8_rows(h, column_major=column_major)
            w_q, w_s = moe.quantize_fp8_blocks(w2)
            ref = all_ranks_sum(rs_partial(dequant_rows(h_q, h_s), dequant_blocks(w_q, w_s), ids, weights, routing))
            poison_allocator()
            if method == "all_reduce":
                y = tdist.moe_group_gemm_ar_fp8(h_q, h_s, w_q, w_s, ids.cuda(), weights.cuda())
                assert y.dtype == torch.bfloat16 and tuple(y.shape) == (m, N), what
                check_close(y, ref, what, 1e-2)
            else:
                y = tdist.moe_group_gemm_rs_fp8(h_q, h_s, w_q, w_s, ids.cuda(), weights.cuda(), method=method)
                first, rows = moe.rows_of(m, W, me)
                assert y.dtype == torch.bfloat16 and tuple(y.shape) == (rows, N), what
                check_close(y, ref[first:first + rows], what, 1e-2)
    ids, weights = ids.cuda(), weights.cuda()
    expect_error(lambda: tdist.moe_group_gemm_rs_fp8(h_q, h_s, w_q, w_s, ids, weights, method="fused"), "'method'")
    expect_error(lambda: tdist.moe_group_gemm_rs_fp8(h_q[:-1], h_s, w_q, w_s, ids, weights), "'h'")
    expect_error(lambda: tdist.moe_group_gemm_rs_fp8(h_q, h_s.double(), w_q, w_s, ids, weights), "'h_scales'")
    expect_error(lambda: tdist.moe_group_gemm_ar_fp8(h_q, h_s, w_q, w_s[:, :, :0], ids, weights), "'w_scales'")
    torch.cuda.synchronize()


def layer_weights(E, hidden, ffn_local, seed):
    """This rank's shards: w13 [E, 2 F, H] (gate rows, then up rows), w2 [E, H, F]."""
    w13 = rand((E, 2 * ffn_local, hidden), torch.bfloat16, seed + 10 * rank(), scale=hidden ** -0.5)
    w2 = rand((E, hidden, ffn_local), torch.bfloat16, seed + 10 * rank() + 1, scale=(ffn_local * world()) ** -0.5)
    return w13, w2


def layer_reference(x_all, ids, weights, w13, w2):
    """float64 [M, H]: sum over ranks and slots of weights * (silu(x w1^T) * (x w3^T)) w2^T on the shards."""
    f = w2.shape[2]
    m, topk = ids.shape
    out = torch.zeros((m, w2.shape[1]), dtype=torch.float64)
    for e in range(w13.shape[0]):
        t, k = (ids.long() == e).nonzero(as_tuple=True)
        if t.numel():
            a = x_all[t].double() @ w13[e].double().T
            part = (F.silu(a[:, :f]) * a[:, f:]) @ w2[e].double().T
            out.index_add_(0, t, weights[t, k].double().view(-1, 1) * part)
    return all_ranks_sum(out)


def moe_layer(x_rows, topk_ids, topk_weights, w13, w2):
    # --- the layer of docs/moe.md ---
    h13 = tdist.moe_ag_group_gemm(x_rows, topk_ids, w13)        # [capacity, 2 F] in expert order
    f = h13.shape[1] // 2
    h = F.silu(h13[:, :f]) * h13[:, f:]                          # row by row; padding rows stay 0
    return tdist.moe_group_gemm_rs(h, w2, topk_ids, topk_weights)  # [rows(rank), H]


def test_docs_layer():
    W, me = world(), rank()
    E, topk, hidden, ffn_local = 8, 2, 256, 136
    w13, w2 = layer_weights(E, hidden, ffn_local, 4000)
    for m, kind in ((64, "random"), (777, "skewed")):
        ids = routing_ids(m, topk, E, kind, 4100 + m)
        weights = torch.rand((m, topk), generator=torch.Generator().manual_seed(4200 + m))
        x_all = rand((m, hidden), torch.bfloat16, 4300 + m)
        first, rows = moe.rows_of(m, W, me)
        poison_allocator()
        y = moe_layer(x_all[first:first + rows].cuda(), ids.cuda(), weights.cuda(), w13.cuda(), w2.cuda())
        ref = layer_reference(x_all, ids, weights, w13, w2)
        check_close(y, ref[first:first + rows], f"docs layer m={m} {kind}", tol=3e-2)


def test_cuda_graph_fresh_routing():
    W, me = world(), rank()
    E, topk, hidden, ffn_local, m = 8, 2, 256, 136, 600
    w13, w2 = layer_weights(E, hidden, ffn_local, 5000)
    w13_d, w2_d = w13.cuda(), w2.cuda()
    first, rows = moe.rows_of(m, W, me)
    x_s = torch.zeros((rows, hidden), dtype=torch.bfloat16, device="cuda")
    ids_s = torch.zeros((m, topk), dtype=torch.int32, device="cuda")
    ids_s[:, 1] = 1
    w_s = torch.zeros((m, topk), dtype=torch.float32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe_layer(x_s, ids_s, w_s, w13_d, w2_d)  # contexts made, kernels loaded
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = moe_layer(x_s, ids_s, w_s, w13_d, w2_d)
    for rep, kind in enumerate(("random", "skewed", "single")):
        ids = routing_ids(m, topk, E, kind, 5100 + rep)
        weights = torch.rand((m, topk), generator=torch.Generator().manual_seed(5200 + rep))
        x_all = rand((m, hidden), torch.bfloat16, 5300 + rep)
        x_s.copy_(x_all[first:first + rows].cuda())
        ids_s.copy_(ids.cuda())
        w_s.copy_(weights.cuda())
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = layer_reference(x_all, ids, weights, w13, w2)
        check_close(y, ref[first:first + rows], f"graph replay {rep} {kind}", tol=3e-2)
    del g
    torch.cuda.synchronize()


def test_torch_compile():
    W, me = world(), rank()
    E, topk, hidden, ffn_local, m = 8, 2, 256, 136, 100
    w13, w2 = layer_weights(E, hidden, ffn_local, 6000)
    ids = routing_ids(m, topk, E, "random", 6100)
    weights = torch.rand((m, topk), generator=torch.Generator().manual_seed(6200))
    x_all = rand((m, hidden), torch.bfloat16, 6300)
    first, rows = moe.rows_of(m, W, me)
    compiled = torch.compile(moe_layer, fullgraph=True)
    y = compiled(x_all[first:first + rows].cuda(), ids.cuda(), weights.cuda(), w13.cuda(), w2.cuda())
    ref = layer_reference(x_all, ids, weights, w13, w2)
    check_close(y, ref[first:first + rows], "torch.compile layer", tol=3e-2)


def test_errors():
    W, me = world(), rank()
    m, topk, E, K, N = 40, 2, 4, 64, 72
    ids = routing_ids(m, topk, E, "random", 7000).cuda()
    weights = torch.rand((m, topk), device="cuda")
    first, rows = moe.rows_of(m, W, me)
    x = torch.randn((rows, K), device="cuda").to(torch.bfloat16)
    w = torch.randn((E, N, K), device="cuda").to(torch.bfloat16)
    h_ = torch.randn((moe.capacity(m, topk, E), K), device="cuda").to(torch.bfloat16)
    expect_error(lambda: tdist.moe_ag_group_gemm(x, ids, w.float()), "'w'", "bfloat16")
    expect_error(lambda: tdist.moe_ag_group_gemm(x.half(), ids, w), "'x_rows'")
    expect_error(lambda: tdist.moe_ag_group_gemm(x[:, :8].contiguous(), ids, w), "'x_rows'")
    expect_error(lambda: tdist.moe_ag_group_gemm(torch.cat([x, x]), ids, w), "'x_rows'")
    expect_error(lambda: tdist.moe_ag_group_gemm(x, ids.float(), w), "'topk_ids'")
    expect_error(lambda: tdist.moe_ag_group_gemm(x, ids, w, method="sequential"), "'method'")
    expect_error(lambda: tdist.moe_group_gemm_rs(h_, w, ids, weights, method="fused"), "'method'")
    expect_error(lambda: tdist.moe_ag_group_gemm(x, ids[:, :1].repeat(1, E + 1).contiguous(), w), "'topk'")
    expect_error(lambda: tdist.moe_group_gemm_rs(h_, w, ids, weights[:-1]), "'topk_weights'")
    expect_error(lambda: tdist.moe_group_gemm_rs(h_, w, ids, weights.double()), "'topk_weights'")
    expect_error(lambda: tdist.moe_group_gemm_rs(h_[:-1], w, ids, weights), "'h'")
    expect_error(lambda: tdist.moe_group_gemm_rs(h_.t(), w, ids, weights), "'h'")
    # a good call still works after them
    y = tdist.moe_group_gemm_rs(h_, w, ids, weights)
    assert tuple(y.shape) == (rows, N)
    torch.cuda.synchronize()


class Call:
    """One back-to-back call's inputs (host and device) and the routing of this rank."""

    def __init__(self, i, E, topk, K, N, m_max, W, me):
        g = torch.Generator().manual_seed(9000 + i)  # the same draws on every rank
        self.m = m_max if i == 0 else (1, 2, 127, 128, 129)[i % 5] if i % 7 == 0 else int(
            torch.randint(1, m_max + 1, (1,), generator=g))
        self.dtype = (torch.bfloat16, torch.float16)[i % 2]
        self.method = moe.AG_METHODS[i % 4]
        kind = ("random", "skewed", "single")[i % 3 if i % 4 else 0]
        self.what = f"call {i}: m={self.m} {self.dtype} {self.method} {kind}"
        self.ids = routing_ids(self.m, topk, E, kind, 9100 + i)
        self.weights = torch.rand((self.m, topk), generator=g)
        self.x_all = rand((self.m, K), self.dtype, 9200 + i)
        self.cap = moe.capacity(self.m, topk, E)
        self.routing = moe.routing_reference(self.ids, E, W, me)
        self.h = rand((self.cap, N), self.dtype, 9300 + 7 * i + me)  # this rank's activations
        first, self.rows = moe.rows_of(self.m, W, me)
        self.first = first
        self.x_d = self.x_all[first:first + self.rows].cuda()
        self.ids_d = self.ids.to(torch.int64).cuda() if i % 4 == 3 else self.ids.cuda()  # int64 converted
        self.w_d = self.weights.cuda()
        self.h_d = garbage_padding(self.h, self.routing, self.cap).cuda()


def poisoned(shape, dtype, call):
    """(call()'s output, whether it took the block a NaN tensor of `shape` had just freed): the op's
    output of that shape comes from torch's allocator, which hands back the block it was given last."""
    junk = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    ptr = junk.data_ptr()
    del junk
    out = call()
    return out, out.numel() == 0 or out.data_ptr() == ptr


def test_back_to_back_fresh_routing():
    W, me = world(), rank()
    E, topk, K, N, m_max, calls = 8, 2, 200, 136, 384, 200
    # This rank's shards, fixed: w13 [E, N, K] for the first projection, w2 [E, K, N] for the second.
    w13 = {dt: rand((E, N, K), dt, 9400 + me, scale=0.1) for dt in (torch.bfloat16, torch.float16)}
    w2 = {dt: rand((E, K, N), dt, 9500 + me, scale=0.1) for dt in (torch.bfloat16, torch.float16)}
    w13_d = {dt: w.cuda() for dt, w in w13.items()}
    w2_d = {dt: w.cuda() for dt, w in w2.items()}
    inputs = [Call(i, E, topk, K, N, m_max, W, me) for i in range(calls)]
    c = inputs[0]  # m_max tokens: every context made at its full size before the loop (a new one syncs)
    for dt in w13_d:
        tdist.moe_ag_group_gemm(c.x_d.to(dt), c.ids_d, w13_d[dt])
        tdist.moe_group_gemm_rs(c.h_d.to(dt), w2_d[dt], c.ids_d, c.w_d)
        tdist.moe_group_gemm_ar(c.h_d.to(dt), w2_d[dt], c.ids_d, c.w_d)
    torch.cuda.synchronize()
    dist.barrier()
    outs, landed = [], [0, 0, 0]
    for c in inputs:  # no host synchronisation from here to the end of the loop
        ag, l0 = poisoned((c.cap, N), c.dtype, lambda: tdist.moe_ag_group_gemm(c.x_d, c.ids_d, w13_d[c.dtype],
                                                                               method=c.method))
        rs, l1 = poisoned((c.rows, K), c.dtype, lambda: tdist.moe_group_gemm_rs(c.h_d, w2_d[c.dtype], c.ids_d, c.w_d,
                                                                                method=moe.rs_method(c.method)))
        ar, l2 = poisoned((c.m, K), c.dtype, lambda: tdist.moe_group_gemm_ar(c.h_d, w2_d[c.dtype], c.ids_d, c.w_d))
        outs.append((ag, rs, ar))
        landed = [n + int(ok) for n, ok in zip(landed, (l0, l1, l2))]
    torch.cuda.synchronize()
    # The poison reached the outputs (else an unwritten row could hold an earlier call's right value).
    assert min(landed) >= calls // 2, f"outputs on the poisoned blocks (ag, rs, ar): {landed} of {calls}"
    for c, (ag, rs, ar) in zip(inputs, outs):
        offsets = c.routing["offsets"]
        assert tuple(ag.shape) == (c.cap, N), c.what
        check_close(ag[:offsets[E]], ag_reference(c.x_all, c.ids, w13[c.dtype], c.routing), f"ag {c.what}",
                    TOL[c.dtype])
        pad = torch.tensor([r for r, t in enumerate(c.routing["token_of_row"]) if t < 0], dtype=torch.long)
        if pad.numel():
            assert bool((ag[:offsets[E]].cpu()[pad] == 0).all()), f"ag {c.what}: padding rows not 0"
        ref = all_ranks_sum(rs_partial(c.h, w2[c.dtype], c.ids, c.weights, c.routing))  # collective, same order
        check_close(rs, ref[c.first:c.first + c.rows], f"rs {c.what}", TOL[c.dtype])
        check_close(ar, ref, f"ar {c.what}", TOL[c.dtype])
    if me == 0:
        print(f"back to back: {calls} calls of each op checked; outputs on the poisoned blocks (ag, rs, ar): "
              f"{landed}", flush=True)


def test_expert_id_out_of_range():
    W, me = world(), rank()
    m, topk, E, K, N = 40, 2, 4, 64, 72
    ids = routing_ids(m, topk, E, "random", 9600)
    for bad in (E, -1):  # the host reference checks every id
        host = ids.clone()
        host[7, 1] = bad
        expect_error(lambda: moe.routing_reference(host, E, W, me), "topk_ids", str(bad))
    first, rows = moe.rows_of(m, W, me)
    x_all = rand((m, K), torch.bfloat16, 9601)
    w = rand((E, N, K), torch.bfloat16, 9602 + me, scale=0.1)
    x_d, ids_d, w_d = x_all[first:first + rows].cuda(), ids.cuda(), w.cuda()
    h_d = rand((moe.capacity(m, topk, E), N), torch.bfloat16, 9603).cuda()
    w2_d = rand((E, K, N), torch.bfloat16, 9604 + me, scale=0.1).cuda()
    wts_d = torch.rand((m, topk), generator=torch.Generator().manual_seed(9605)).cuda()
    routing = moe.routing_reference(ids, E, W, me)
    ref = ag_reference(x_all, ids, w, routing)
    calls = {"ag": lambda i: tdist.moe_ag_group_gemm(x_d, i, w_d),
             "rs": lambda i: tdist.moe_group_gemm_rs(h_d, w2_d, i, wts_d),
             "ar": lambda i: tdist.moe_group_gemm_ar(h_d, w2_d, i, wts_d)}

    def good_call(what):
        d, _ = poisoned((moe.capacity(m, topk, E), N), torch.bfloat16, lambda: tdist.moe_ag_group_gemm(x_d, ids_d, w_d))
        check_close(d[:routing["offsets"][E]], ref, what, TOL[torch.bfloat16])

    good_call("good call before")
    for op in calls:
        calls[op](ids_d)
    moe.check_errors()  # good ids: nothing to report
    # Every rank passes the same ids (collective); the bad pair goes to expert 0, the stream goes on,
    # and check_errors (which synchronises) names the first bad id of each context.
    for op, t, k, bad in (("ag", 17, 1, E), ("ag", 0, 0, -1), ("rs", 39, 0, E), ("ar", 5, 1, -7)):
        bad_ids = ids_d.clone()
        bad_ids[t, k] = bad
        calls[op](bad_ids)
        calls[op](bad_ids)  # a second call: still one report, still the first id's
        expect_error(moe.check_errors, "topk_ids", f"topk_ids[{t}][{k}] = {bad}", f"[0, {E})")
        moe.check_errors()  # the report was taken
        good_call(f"good call after {op} with topk_ids[{t}][{k}] = {bad}")  # the context lives on
        dist.barrier()


# grouped_gemm's cases: rows per group (empty groups, one row, more than a tile), K, N, offsets' dtype
GROUPED_GEMM_CASES = (([0, 129, 1, 300, 0], 136, 104, torch.int32), ([5], 72, 200, torch.int64),
                      ([200, 0, 0, 17, 128, 3, 1], 264, 136, torch.int32))


def padded_offsets(counts):
    """offsets [G + 1] of groups of `counts` rows, each padded to the grouped GEMM's alignment."""
    align = moe.grouped_gemm_alignment()
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + (c + align - 1) // align * align)
    return offsets


def test_grouped_gemm():
    seed = 8000 + rank()
    for dtype in (torch.bfloat16, torch.float16):
        for counts, K, N, idx in GROUPED_GEMM_CASES:
            seed += 1
            what = f"grouped_gemm {dtype} counts={counts} K={K} N={N} {idx}"
            offsets = padded_offsets(counts)
            m_total = offsets[-1] + 37  # rows past offsets[G]: neither read into a group nor written
            a = rand((m_total, K), dtype, seed)
            w = rand((len(counts), N, K), dtype, seed + 50, scale=0.1)
            ref = torch.zeros((offsets[-1], N), dtype=torch.float64)
            for g in range(len(counts)):
                ref[offsets[g]:offsets[g + 1]] = a[offsets[g]:offsets[g + 1]].double() @ w[g].double().T
            poison_allocator()
            d = moe.grouped_gemm(a.cuda(), w.cuda(), torch.tensor(offsets, dtype=idx, device="cuda"))
            assert tuple(d.shape) == (m_total, N), what
            check_close(d[:offsets[-1]], ref, what, TOL[dtype])
    a = torch.randn((256, 64), device="cuda").to(torch.bfloat16)
    w = torch.randn((2, 72, 64), device="cuda").to(torch.bfloat16)
    offs = torch.tensor([0, 128, 256], dtype=torch.int32, device="cuda")
    expect_error(lambda: moe.grouped_gemm(a, w.float(), offs), "'w'", "bfloat16")
    expect_error(lambda: moe.grouped_gemm(a[:, :56].contiguous(), w, offs), "'a'")
    expect_error(lambda: moe.grouped_gemm(a.half(), w, offs), "'a'")
    expect_error(lambda: moe.grouped_gemm(a, w, offs[:2]), "'offsets'")
    expect_error(lambda: moe.grouped_gemm(a, w, offs.float()), "'offsets'")
    expect_error(lambda: moe.grouped_gemm(a, w, offs.cpu()), "'offsets'")
    expect_error(lambda: moe.grouped_gemm(a.t(), w, offs), "'a'")
    expect_error(lambda: moe.grouped_gemm(a[:, :60].contiguous(), w[:, :, :60].contiguous(), offs), "'w'")
    expect_error(lambda: moe.grouped_gemm(a, w[:, :70].contiguous(), offs), "'w'", "N")
    d = moe.grouped_gemm(a, w, offs)
    check_close(d, torch.cat([a[:128].double() @ w[0].double().T, a[128:].double() @ w[1].double().T]).cpu(),
                "grouped_gemm after errors", TOL[torch.bfloat16])
    torch.cuda.synchronize()


# K a multiple of 16 (e4m3 rows of 16 bytes), not of 128 (a partial scale block).
FP8_GROUPED_GEMM_CASES = (([0, 129, 1, 300, 0], 144, 104, torch.int32), ([5], 400, 200, torch.int64),
                          ([200, 0, 0, 17, 128, 3, 1], 272, 136, torch.int32), ([300, 0, 77], 2064, 256, torch.int64))


def test_grouped_gemm_fp8():
    """tdist.moe.grouped_gemm_fp8 on tensors quantised by tdist.moe.quantize_fp8_rows / _blocks:
    against float64 of the dequantised operands (the kernel's own inputs), row-major and column-major
    A scales (column-major with M a multiple of 4 takes the kernel's bulk scale copies), K not a
    multiple of 128, empty groups, int32 and int64 offsets, rows past offsets[G];
    and against the unquantised bf16 product within e4m3's precision. torch.compile(fullgraph=True)
    through the registered op. Argument errors name the argument."""
    seed = 9000 + rank()
    for counts, K, N, idx in FP8_GROUPED_GEMM_CASES:
        for column_major, past in ((False, 37), (True, 37), (True, 36)):
            seed += 1
            what = f"grouped_gemm_fp8 counts={counts} K={K} N={N} {idx} column-major scales={column_major} +{past}"
            offsets = padded_offsets(counts)
            m_total = offsets[-1] + past
            a = rand((m_total, K), torch.bfloat16, seed).cuda()
            w = rand((len(counts), N, K), torch.bfloat16, seed + 50, scale=0.1).cuda()
            a_q, a_s = moe.quantize_fp8_rows(a)
            w_q, w_s = moe.quantize_fp8_blocks(w)
            if column_major:
                a_s = a_s.t().contiguous().t()  # [M, KB] with strides (1, M)
            a_deq, w_deq = dequant_rows(a_q, a_s), dequant_blocks(w_q, w_s)
            ref = torch.zeros((offsets[-1], N), dtype=torch.float64)
            exact = torch.zeros((offsets[-1], N), dtype=torch.float64)
            for g in range(len(counts)):
                rows = slice(offsets[g], offsets[g + 1])
                ref[rows] = a_deq[rows] @ w_deq[g].T
                exact[rows] = a[rows].double().cpu() @ w[g].double().cpu().T
            poison_allocator()
            d = moe.grouped_gemm_fp8(a_q, a_s, w_q, w_s, torch.tensor(offsets, dtype=idx, device="cuda"))
            assert d.dtype == torch.bfloat16 and tuple(d.shape) == (m_total, N), what
            check_close(d[:offsets[-1]], ref, what, 1e-2)
            check_close(d[:offsets[-1]], exact, what + " (against bf16 inputs)", 8e-2)
    a_q, a_s = moe.quantize_fp8_rows(torch.randn((256, 64), device="cuda"))
    w_q, w_s = moe.quantize_fp8_blocks(torch.randn((2, 72, 64), device="cuda"))
    offs = torch.tensor([0, 128, 256], dtype=torch.int32, device="cuda")
    compiled = torch.compile(lambda *t: moe.grouped_gemm_fp8(*t) * 2, fullgraph=True)
    check_close(compiled(a_q, a_s, w_q, w_s, offs), 2 * moe.grouped_gemm_fp8(a_q, a_s, w_q, w_s, offs).double().cpu(),
                "grouped_gemm_fp8 under torch.compile", 1e-2)
    expect_error(lambda: moe.grouped_gemm_fp8(a_q.float(), a_s, w_q, w_s, offs), "'a'", "float8_e4m3fn")
    expect_error(lambda: moe.grouped_gemm_fp8(a_q, a_s, w_q.float(), w_s, offs), "'w'")
    expect_error(lambda: moe.grouped_gemm_fp8(a_q, a_s[:, :0], w_q, w_s, offs), "'a_scales'")
    expect_error(lambda: moe.grouped_gemm_fp8(a_q, a_s, w_q, w_s[:1], offs), "'w_scales'")
    expect_error(lambda: moe.grouped_gemm_fp8(a_q, a_s.double(), w_q, w_s, offs), "'a_scales'")
    expect_error(lambda: moe.grouped_gemm_fp8(a_q, a_s, w_q, w_s, offs[:2]), "'offsets'")
    expect_error(lambda: moe.grouped_gemm_fp8(a_q, a_s, w_q[:, :, :56].contiguous(), w_s, offs), "'w'", "16")
    torch.cuda.synchronize()


def test_routing_on_gpu():
    """tdist.moe.routing of GPU ids (the ops' routing kernels, which the backward calls) equals the
    torch-op routing of the same ids on the CPU (checked against the host reference by the CPU tests),
    array by array: every rank of several world sizes, int32 and int64 ids, M = 0 and 1, 1024
    experts, ids out of range (sent to expert 0, then reported by check_errors naming topk_ids), and
    replays of a CUDA graph with fresh ids. The allocator is poisoned first."""
    def same(got, ids, experts, w, r, what):
        want = moe.routing(ids.cpu(), experts, w, r)
        assert set(got) == set(want), f"{what}: keys {sorted(got)} vs {sorted(want)}"
        for key, v in want.items():
            assert got[key].dtype == torch.int32, f"{what}: {key} is {got[key].dtype}"
            if not torch.equal(got[key].cpu(), v):
                raise AssertionError(f"{what}: {key} differs from the CPU routing")

    cases = [(0, 2, 4, "random"), (1, 2, 4, "random"), (301, 3, 8, "skewed"), (4097, 8, 128, "random"),
             (2048, 8, 128, "single"), (777, 6, 64, "skewed"), (50, 8, 1024, "random")]
    for m, topk, experts, kind in cases:
        ids = routing_ids(m, topk, experts, kind, 9900 + m)
        for w in (1, 2, 3, 8):
            for r in sorted({0, w // 2, w - 1}):
                poison_allocator()
                dev = ids.cuda().long() if (m + r) % 2 else ids.cuda()
                same(moe.routing(dev, experts, w, r), ids, experts, w, r, f"m {m} top-{topk} of {experts} {kind} "
                     f"rank {r} of {w}")
    moe.check_errors()  # nothing out of range so far
    ids = routing_ids(200, 4, 16, "random", 9950)
    bad = ids.clone()
    bad[3, 2], bad[150, 0] = 16, -5
    same(moe.routing(bad.cuda(), 16, 2, 1), bad, 16, 2, 1, "ids out of range")
    try:  # the first bad id the kernel met: either
        moe.check_errors()
        raise AssertionError("check_errors did not report the ids out of range")
    except tdist.Error as e:
        assert "'topk_ids'" in str(e) and ("topk_ids[3][2] = 16" in str(e) or "topk_ids[150][0] = -5" in str(e)), e
    moe.check_errors()  # taken
    # In a CUDA graph: captured once (after a call of as many tokens), replayed with fresh ids.
    m, topk, experts = 1000, 8, 64
    ids_d = routing_ids(m, topk, experts, "random", 9960).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe.routing(ids_d, experts, 2, 0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe.routing(ids_d, experts, 2, 0)
    for rep, kind in enumerate(("random", "skewed", "single")):
        fresh = routing_ids(m, topk, experts, kind, 9970 + rep)
        ids_d.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        same(captured, fresh, experts, 2, 0, f"graph replay {rep} ({kind})")
    torch.cuda.synchronize()


def test_quantize_kernels():
    """tdist's FP8 row quantisers on the GPU (not collective): quantize_fp8_rows the same bits as its torch
    form on bf16, fp16 and fp32 rows (one row, K of one block, a partial last block, a column window of
    a wider tensor); swiglu_quantize_fp8 within e4m3's rounding of float64 SiLU(gate) * up and equal to
    the torch form's bits but for a rare step where fp32 expf and torch's exp differ; outputs poisoned."""
    for i, (m, k, dtype) in enumerate([(1, 16, torch.bfloat16), (301, 208, torch.bfloat16), (1000, 400, torch.float16),
                                       (77, 128, torch.float32), (5, 2064, torch.bfloat16)]):
        what = f"quantize_fp8_rows m={m} k={k} {dtype}"
        wide = rand((m, k + 48), dtype, 900 + i, scale=3.0).cuda()
        wide[0, :16] = 0  # an all-zero block when k = 16
        for x in (wide[:, :k].contiguous(), wide[:, 32:32 + k]):
            poison_allocator()
            q, sc = moe.quantize_fp8_rows(x)
            q_ref, sc_ref = moe._quantize_rows_torch(torch, x)
            torch.cuda.synchronize()
            assert torch.equal(sc, sc_ref), f"{what}: scales differ from the torch form"
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), f"{what}: e4m3 differ from the torch form"
            poison_allocator()
            q_c, sc_c = moe.quantize_fp8_rows(x, column_major=True)  # the kernel writing column-major scales
            assert sc_c.stride() == (1, -(-m // 4) * 4), f"{what}: column-major strides {sc_c.stride()}"
            assert torch.equal(sc_c, sc_ref) and torch.equal(q_c.view(torch.uint8), q_ref.view(torch.uint8)), \
                f"{what}: column-major output differs from the torch form"
    for i, (m, f) in enumerate([(1, 16), (517, 208), (64, 768)]):
        what = f"swiglu_quantize_fp8 m={m} f={f}"
        h13 = rand((m, 2 * f), torch.bfloat16, 950 + i, scale=2.0).cuda()
        poison_allocator()
        q, sc = moe.swiglu_quantize_fp8(h13)
        gate, up = h13[:, :f].float(), h13[:, f:].float()
        q_ref, sc_ref = moe._quantize_rows_torch(torch, gate / (1.0 + torch.exp(-gate)) * up)
        torch.cuda.synchronize()
        ref = (torch.nn.functional.silu(h13[:, :f].double()) * h13[:, f:].double()).cpu()
        got = dequant_rows(q, sc)
        step = sc.double().cpu().repeat_interleave(128, 1)[:, :f]
        assert bool(((got - ref).abs() <= ref.abs() * 2 ** -4 + step * 2 ** -8).all()), f"{what}: beyond e4m3 rounding"
        same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).double().mean().item()
        assert same > 0.999, f"{what}: only {same:.4%} of the e4m3 values equal the torch form's"
        assert bool(((sc - sc_ref).abs() <= sc_ref * 1e-6).all()), f"{what}: scales differ from the torch form"
        q_c, sc_c = moe.swiglu_quantize_fp8(h13, column_major=True)
        assert torch.equal(sc_c, sc) and torch.equal(q_c.view(torch.uint8), q.view(torch.uint8)), \
            f"{what}: column-major output differs from the row-major one"


TESTS = [
    test_quantize_kernels,
    test_routing_on_gpu,
    test_moe_ag_group_gemm,
    test_moe_ag_group_gemm_fp8,
    test_moe_group_gemm_rs_and_ar,
    test_moe_group_gemm_rs_fp8,
    test_docs_layer,
    test_cuda_graph_fresh_routing,
    test_torch_compile,
    test_errors,
    test_grouped_gemm,
    test_grouped_gemm_fp8,
    test_back_to_back_fresh_routing,
    test_expert_id_out_of_range,
]

if __name__ == "__main__":
    sys.exit(h.run_tests(TESTS))
