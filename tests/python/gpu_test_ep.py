"""GPU tests of tdist.ep (the expert-parallel all-to-all) under torchrun:

    python -m torch.distributed.run --nproc-per-node 2 tests/python/gpu_test_ep.py

Every rank draws its tokens, top-k ids and weights from (seed, rank) on the CPU and redraws every
other rank's, so it knows which rows each of its local experts must receive and what each of its
tokens must get back (order-independent: received rows are matched by their source token).

* low-latency dispatch (bf16, FP8, FP8 with UE8M0 scales): per-expert counts, every expected
  (source rank, token, slot) row present once, bf16 rows bit for bit, FP8 within e4m3's bound;
* low-latency combine: the expert side answers bf16(x * f(expert)), rows past the counts NaN, out
  against a float64 reference (combine's output comes from torch's allocator, poisoned with NaN);
* routings: uniform, skewed, all to one rank, masked slots (-1); tokens: full, zero on the last
  rank, one, odd counts;
* receive hooks with two dispatches (and two combines) in flight; a CUDA graph replayed with fresh
  routing and tokens; the torch.library ops directly;
* high throughput: counts (device info and sync_counts), compact rows with their routing and
  weights, expert-major rows and their sources, the weighted and the compact combine, a CUDA graph;
* the worked MoE layers of docs/ep.md (one per mode) against a float64 layer;
* argument errors naming the argument; ids out of range and repeated reported by check_errors().
"""

import math
import sys

import gpu_harness as h
from gpu_harness import check_close, expect_error, rank, world

import tdist  # noqa: F401 (gpu_harness imported it before torch)

import torch
import torch.nn.functional as F

ep = tdist.ep
H_LL, H_HT = 384, 264  # hidden sizes: 3 x 128 (FP8 groups), 33 x 8


def poison_allocator():
    """Fills the caching allocator's free blocks with NaN: an output the op leaves unwritten shows."""
    junk = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    junk.fill_(0xFF)
    del junk


def tokens_of(case, r, m):
    W = world()
    return {"full": m, "zero_on_last": 0 if r == W - 1 else m, "one": 1, "odd": max(1, m - 7 - 2 * r)}[case]


def draw(seed, r, t, hidden, experts, topk, routing):
    """Rank r's (x bf16 [t, hidden], topk_idx int64 [t, topk], topk_weights float32 [t, topk]) on the CPU."""
    g = torch.Generator().manual_seed(seed * 1009 + r)
    x = torch.randn((t, hidden), generator=g).to(torch.bfloat16)
    scores = torch.rand((t, experts), generator=g)
    L = experts // world()
    if routing == "skewed":  # most slots on rank 0's experts, the first of them most of all
        scores = scores * torch.where(torch.arange(experts) < L, 8.0, 1.0) + (torch.arange(experts) == 0) * 4.0
    elif routing == "one_rank":  # every slot on the last rank's experts
        scores = scores + (torch.arange(experts) >= experts - L) * 10.0
    idx = scores.topk(topk, dim=1).indices.to(torch.int64)
    if routing == "masked":
        idx[torch.rand((t, topk), generator=g) < 0.35] = -1
    w = torch.rand((t, topk), generator=g).to(torch.float32)
    return x, idx, w


def sent(idx_row, j, experts):
    """The kernels' rule: slot j is sent when its id is in [0, experts) and no earlier slot holds it."""
    e = int(idx_row[j])
    return 0 <= e < experts and all(int(idx_row[i]) != e for i in range(j))


def factor(e):
    return 1.0 + (e % 5) / 8.0


def local_factors(L):
    """factor() of this rank's experts as a CUDA tensor, computed on the GPU (no host copy, so it can
    run inside a CUDA graph capture)."""
    e = torch.arange(L, device="cuda") + rank() * L
    return 1.0 + (e % 5).float() / 8.0


def all_inputs(seed, m, hidden, experts, topk, routing, case):
    return [draw(seed, r, tokens_of(case, r, m), hidden, experts, topk, routing) for r in range(world())]


def to_cuda(inp):
    x, idx, w = inp
    return x.cuda(), idx.cuda(), w.cuda()


def combine_reference(x, idx, w, experts):
    """float64 [t, hidden]: sum over sent slots j of w[t, j] * bf16(x[t] * f(e_j))."""
    ref = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            if sent(idx[t], j, experts):
                e = int(idx[t, j])
                y = (x[t].float() * factor(e)).to(torch.bfloat16).double()
                ref[t] += float(w[t, j]) * y
    return ref


# --- low latency ------------------------------------------------------------------------------------

def ll_expected(inputs, me, L, topk, experts):
    """{local expert: set of (source rank, token, slot)} this rank must receive."""
    want = {le: set() for le in range(L)}
    for s, (_, idx, _) in enumerate(inputs):
        for t in range(idx.shape[0]):
            for j in range(topk):
                if sent(idx[t], j, experts) and int(idx[t, j]) // L == me:
                    want[int(idx[t, j]) % L].add((s, t, j))
    return want


def check_ll_dispatch(buf, inputs, recv_x, recv_scales, recv_count, handle, fp8, ue8m0, what):
    L, M, K, E = buf.num_local_experts, buf.max_tokens, buf.topk, buf.num_experts
    want = ll_expected(inputs, rank(), L, K, E)
    counts = recv_count.cpu().tolist()
    routes = handle.recv_route.cpu()
    if fp8:
        sc = recv_scales.cpu().repeat_interleave(128, dim=-1)
        rx = recv_x.float().cpu() * sc
        if ue8m0:
            s = recv_scales.cpu()
            for le in range(L):
                v = s[le, :counts[le]]
                assert torch.equal(v, torch.exp2(torch.round(torch.log2(v)))), f"{what}: a UE8M0 scale is no power of 2"
    else:
        rx = recv_x.cpu()
    for le in range(L):
        n = counts[le]
        assert n == len(want[le]), f"{what}: local expert {le} received {n} rows, expected {len(want[le])}"
        got = set()
        for r in range(n):
            q = int(routes[le, r])
            s, t, j = q // K // M, (q // K) % M, q % K
            assert (s, t, j) in want[le] and (s, t, j) not in got, f"{what}: expert {le} row {r}: route {q}"
            got.add((s, t, j))
            x = inputs[s][0][t]
            if fp8:
                err = (rx[le, r] - x.float()).abs()
                assert bool((err <= x.float().abs() / 16 + sc[le, r] / 512 + 1e-30).all()), \
                    f"{what}: expert {le} row {r} beyond e4m3's bound"
            else:
                assert torch.equal(rx[le, r], x), f"{what}: expert {le} row {r} (rank {s} token {t}) differs"


def expert_outputs_ll(buf, recv_x, recv_count):
    """y [L, W * M, H] bf16: bf16(x * f(expert)) for received rows, NaN past the counts."""
    L = buf.num_local_experts
    y = (recv_x.float() * local_factors(L).view(L, 1, 1)).to(torch.bfloat16)
    rows = torch.arange(y.shape[1], device="cuda").view(1, -1)
    return y.masked_fill((rows >= recv_count.view(L, 1)).unsqueeze(-1), float("nan"))


def ll_buffer(m=64, hidden=H_LL, topk=4):
    return ep.Buffer(None, m, hidden, 4 * world(), topk)


def test_ll_dispatch_combine():
    buf = ll_buffer()
    try:
        seed = 1
        for routing in ("uniform", "skewed", "one_rank", "masked"):
            for case in ("full", "zero_on_last", "one", "odd"):
                for fp8, ue8m0 in ((False, False), (True, False), (True, True)):
                    seed += 1
                    what = f"ll {routing} {case} fp8={fp8} ue8m0={ue8m0}"
                    inputs = all_inputs(seed, buf.max_tokens, buf.hidden, buf.num_experts, buf.topk, routing, case)
                    x, idx, w = to_cuda(inputs[rank()])
                    recv_x, recv_scales, recv_count, handle, hook = buf.low_latency_dispatch(
                        x, idx, use_fp8=fp8, round_scale=ue8m0)
                    assert hook is None and (recv_scales is None) == (not fp8)
                    assert recv_x.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
                    check_ll_dispatch(buf, inputs, recv_x, recv_scales, recv_count, handle, fp8, ue8m0, what)
                    if fp8:
                        continue  # the combine is checked on exact (bf16) rows
                    y = expert_outputs_ll(buf, recv_x, recv_count)
                    poison_allocator()
                    out = buf.low_latency_combine(y, idx, w, handle)
                    check_close(out, combine_reference(*inputs[rank()], buf.num_experts), what + " combine")
        buf.check_errors()
    finally:
        buf.close()


def test_ll_hooks_two_in_flight():
    buf = ll_buffer()
    try:
        in1 = all_inputs(101, buf.max_tokens, buf.hidden, buf.num_experts, buf.topk, "uniform", "odd")
        in2 = all_inputs(102, buf.max_tokens, buf.hidden, buf.num_experts, buf.topk, "masked", "full")
        x1, i1, w1 = to_cuda(in1[rank()])
        x2, i2, w2 = to_cuda(in2[rank()])
        r1 = buf.low_latency_dispatch(x1, i1, return_recv_hook=True)
        r2 = buf.low_latency_dispatch(x2, i2, return_recv_hook=True)
        assert callable(r1[4]) and callable(r2[4])
        r1[4]()
        r2[4]()
        check_ll_dispatch(buf, in1, r1[0], None, r1[2], r1[3], False, False, "hook 1")
        check_ll_dispatch(buf, in2, r2[0], None, r2[2], r2[3], False, False, "hook 2")
        expect_error(lambda: r1[4](), "'hook'")  # a hook runs once
        y1 = expert_outputs_ll(buf, r1[0], r1[2])
        y2 = expert_outputs_ll(buf, r2[0], r2[2])
        poison_allocator()
        out1, c1 = buf.low_latency_combine(y1, i1, w1, r1[3], return_recv_hook=True)
        out2, c2 = buf.low_latency_combine(y2, i2, w2, r2[3], return_recv_hook=True)
        c1()
        c2()
        check_close(out1, combine_reference(*in1[rank()], buf.num_experts), "combine hook 1")
        check_close(out2, combine_reference(*in2[rank()], buf.num_experts), "combine hook 2")
        # combine into a given tensor
        out = torch.full_like(out2, float("nan"))
        r3 = buf.low_latency_dispatch(x2, i2)
        assert buf.low_latency_combine(expert_outputs_ll(buf, r3[0], r3[2]), i2, w2, r3[3], out=out) is out
        check_close(out, combine_reference(*in2[rank()], buf.num_experts), "combine out=")
    finally:
        buf.close()


def test_ll_torch_library_ops():
    buf = ll_buffer()
    try:
        inputs = all_inputs(7, buf.max_tokens, buf.hidden, buf.num_experts, buf.topk, "uniform", "odd")
        x, idx, w = to_cuda(inputs[rank()])
        recv_x, scales, count, route, meta = torch.ops.tdist.ep_ll_dispatch(buf.id, x, idx, False, False, False)
        assert scales.numel() == 0 and meta.device.type == "cpu"
        handle = ep.LowLatencyHandle(buf.id, int(meta[0]), x.shape[0], False, count, route)
        check_ll_dispatch(buf, inputs, recv_x, None, count, handle, False, False, "op dispatch")
        out, meta2 = torch.ops.tdist.ep_ll_combine(buf.id, expert_outputs_ll(buf, recv_x, count), idx, w, count,
                                                   int(meta[0]), False)
        assert int(meta2[0]) == 0
        check_close(out, combine_reference(*inputs[rank()], buf.num_experts), "op combine")
        # the fake implementations: shapes only
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode() as mode:
            fx, fi = mode.from_tensor(x), mode.from_tensor(idx)
            fr = torch.ops.tdist.ep_ll_dispatch(buf.id, fx, fi, True, False, False)
            L, rows = buf.num_local_experts, world() * buf.max_tokens
            assert tuple(fr[0].shape) == (L, rows, buf.hidden) and fr[0].dtype == torch.float8_e4m3fn
            assert tuple(fr[1].shape) == (L, rows, buf.hidden // 128)
            assert tuple(fr[2].shape) == (L,) and tuple(fr[3].shape) == (L, rows)
    finally:
        buf.close()


def replay_with_fresh_routing(buf, step, static, seed, routings, what):
    """Captures step() (a dispatch and combine of the static (x, topk_idx, weights) tensors) in a CUDA
    graph, after one run on a side stream that loads the kernels; then, for each routing, writes fresh
    inputs into the static tensors, replays, and checks the combined output."""
    x_s, i_s, w_s = static
    m = x_s.shape[0]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for rep, routing in enumerate(routings):
        inputs = all_inputs(seed + rep, m, buf.hidden, buf.num_experts, buf.topk, routing, "full")
        x, idx, w = to_cuda(inputs[rank()])
        x_s.copy_(x)
        i_s.copy_(idx)
        w_s.copy_(w)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check_close(out, combine_reference(*inputs[rank()], buf.num_experts), f"{what} {rep} {routing}")
    del g
    torch.cuda.synchronize()


def test_ll_cuda_graph_fresh_routing():
    buf = ll_buffer()
    try:
        m = buf.max_tokens
        L = buf.num_local_experts
        f = local_factors(L).view(L, 1, 1)
        x_s = torch.zeros((m, buf.hidden), dtype=torch.bfloat16, device="cuda")
        i_s = torch.full((m, buf.topk), -1, dtype=torch.int64, device="cuda")
        w_s = torch.zeros((m, buf.topk), dtype=torch.float32, device="cuda")

        def step():
            recv_x, _, count, handle, _ = buf.low_latency_dispatch(x_s, i_s)
            return buf.low_latency_combine((recv_x.float() * f).to(torch.bfloat16), i_s, w_s, handle)

        replay_with_fresh_routing(buf, step, (x_s, i_s, w_s), 200, ("uniform", "skewed", "masked", "one_rank"),
                                  "graph replay")
    finally:
        buf.close()


def test_ll_errors():
    buf = ll_buffer()
    try:
        inputs = all_inputs(9, buf.max_tokens, buf.hidden, buf.num_experts, buf.topk, "uniform", "full")
        x, idx, w = to_cuda(inputs[rank()])
        expect_error(lambda: buf.low_latency_dispatch(x.float(), idx), "'x'", "bfloat16")
        expect_error(lambda: buf.low_latency_dispatch(x, idx.int()), "'topk_idx'", "int64")
        expect_error(lambda: buf.low_latency_dispatch(x, idx[:, :2].contiguous()), "'topk_idx'")
        big = torch.zeros((buf.max_tokens + 1, buf.hidden), dtype=torch.bfloat16, device="cuda")
        expect_error(lambda: buf.low_latency_dispatch(big, idx), "'x'", "max_tokens_per_rank")
        expect_error(lambda: buf.low_latency_dispatch(x, idx, round_scale=True), "'round_scale'")
        expect_error(lambda: buf.dispatch(x, idx, w), "'self'", "high_throughput")
        if world() > 1:  # any expert count divides over one rank
            expect_error(lambda: ep.Buffer(None, 64, buf.hidden, 4 * world() + 1, 4), "'config.num_experts'")
        expect_error(lambda: ep.Buffer(None, 64, 100, 4 * world(), 4), "'config.hidden'")
        first = buf.low_latency_dispatch(x, idx)
        y = expert_outputs_ll(buf, first[0], first[2])
        expect_error(lambda: buf.low_latency_combine(y[:, :5], idx, w, first[3]), "'y'")
        expect_error(lambda: buf.low_latency_combine(y, idx, w.double(), first[3]), "'topk_weights'")
        expect_error(lambda: buf.low_latency_combine(y, idx, w, "handle"), "'handle'")
        buf.low_latency_dispatch(x, idx)
        buf.low_latency_dispatch(x, idx)  # the first dispatch's slot is reused now
        expect_error(lambda: buf.low_latency_combine(y, idx, w, first[3]), "'handle'")
    finally:
        buf.close()
    expect_error(lambda: buf.low_latency_dispatch(x, idx), "closed")


def test_ll_bad_ids_reported():
    buf = ll_buffer()
    try:
        inputs = all_inputs(11, buf.max_tokens, buf.hidden, buf.num_experts, buf.topk, "uniform", "full")
        x0, idx0, w0 = inputs[0]  # rank 0's ids, as every rank redraws them
        idx0 = idx0.clone()
        idx0[0, 1] = idx0[0, 0]            # repeated within token 0
        idx0[3, 2] = buf.num_experts + 3   # out of range
        inputs[0] = (x0, idx0, w0)
        x, idx, w = inputs[rank()]
        xc, ic, wc = x.cuda(), idx.cuda(), w.cuda()
        recv_x, _, count, handle, _ = buf.low_latency_dispatch(xc, ic)
        check_ll_dispatch(buf, inputs, recv_x, None, count, handle, False, False, "bad ids dispatch")
        out = buf.low_latency_combine(expert_outputs_ll(buf, recv_x, count), ic, wc, handle)
        check_close(out, combine_reference(x, idx, w, buf.num_experts), "bad ids combine")
        if rank() == 0:
            expect_error(buf.check_errors, "'topk_idx'")
        else:
            buf.check_errors()
        buf.check_errors()  # cleared
    finally:
        buf.close()


# --- high throughput -------------------------------------------------------------------------------

def ht_expected(inputs, me, L, K, E, align):
    """(tokens from each source, rows of each local expert, offsets [L + 1])."""
    from_s = []
    rows = [0] * L
    for _, idx, _ in inputs:
        n = 0
        for t in range(idx.shape[0]):
            here = [j for j in range(K) if sent(idx[t], j, E) and int(idx[t, j]) // L == me]
            n += 1 if here else 0
            for j in here:
                rows[int(idx[t, j]) % L] += 1
        from_s.append(n)
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + (r + align - 1) // align * align)
    return from_s, rows, offsets


def check_ht_dispatch(buf, inputs, handle, what):
    L, K, E, M = buf.num_local_experts, buf.topk, buf.num_experts, buf.max_tokens
    me = rank()
    from_s, rows, offsets = ht_expected(inputs, me, L, K, E, buf.expert_alignment)
    info = handle.info.cpu().tolist()
    R = sum(from_s)
    assert info[0] == R, f"{what}: {info[0]} compact rows, expected {R}"
    assert info[1] == offsets[L], f"{what}: {info[1]} expert-major rows, expected {offsets[L]}"
    assert info[2:2 + L] == rows and info[2 + L:3 + 2 * L] == offsets, f"{what}: counts {info}, expected {rows} {offsets}"
    if handle.num_recv >= 0:
        assert handle.num_recv == R and handle.expert_counts == rows, f"{what}: sync_counts' host counts"
    src = handle.recv_src[:R].cpu()
    rx = handle.recv_x[:R].cpu()
    ridx = handle.recv_topk_idx[:R].cpu()
    rw = handle.recv_topk_weights[:R].cpu()
    rpos = handle.recv_expert_row[:R].cpu()
    ex = handle.expert_x[:offsets[L]].cpu()
    esrc = handle.expert_src[:offsets[L]].cpu()
    begin = [sum(from_s[:s]) for s in range(len(from_s) + 1)]
    seen, used = set(), set()
    for i in range(R):
        s, t = int(src[i]) // M, int(src[i]) % M
        assert 0 <= s < world() and t < inputs[s][0].shape[0] and int(src[i]) not in seen, f"{what}: row {i} source"
        seen.add(int(src[i]))
        assert begin[s] <= i < begin[s + 1], f"{what}: row {i} of rank {s} outside its block"
        x, idx, w = inputs[s]
        assert torch.equal(rx[i], x[t]), f"{what}: compact row {i} (rank {s} token {t}) differs"
        for j in range(K):
            here = sent(idx[t], j, E) and int(idx[t, j]) // L == me
            assert int(ridx[i, j]) == (int(idx[t, j]) % L if here else -1), f"{what}: row {i} slot {j} id"
            assert float(rw[i, j]) == float(w[t, j]), f"{what}: row {i} slot {j} weight"
            pos = int(rpos[i, j])
            if not here:
                assert pos == -1, f"{what}: row {i} slot {j}: expert row {pos} for a remote slot"
                continue
            le = int(idx[t, j]) % L
            assert offsets[le] <= pos < offsets[le] + rows[le] and pos not in used, f"{what}: expert row {pos}"
            used.add(pos)
            assert int(esrc[pos]) == i and torch.equal(ex[pos], rx[i]), f"{what}: expert row {pos}"
    for le in range(L):
        assert bool((esrc[offsets[le] + rows[le]:offsets[le + 1]] == -1).all()), f"{what}: padding of expert {le}"
    return offsets, rows


def expert_outputs_ht(buf, handle):
    """y [X, H] bf16: bf16(expert_x * f(expert)) on every expert's rows (from handle.info, on the GPU)."""
    L = buf.num_local_experts
    info = handle.info
    begin, count = info[2 + L:2 + 2 * L].long(), info[2:2 + L].long()
    r = torch.arange(handle.max_expert_rows, device="cuda").view(-1, 1)
    mine = (r >= begin.view(1, -1)) & (r < (begin + count).view(1, -1))  # [X, L]
    fr = (mine.float() * local_factors(L).view(1, -1)).sum(1, keepdim=True)
    y = (handle.expert_x.float() * fr).to(torch.bfloat16)
    return y.masked_fill(~mine.any(1, keepdim=True), float("nan"))


def compact_reference(x, idx, L, E):
    """x[t] times the number of ranks token t went to (the compact combine of recv_x)."""
    n = torch.tensor([len({int(idx[t, j]) // L for j in range(idx.shape[1]) if sent(idx[t], j, E)})
                      for t in range(x.shape[0])], dtype=torch.float64)
    return x.double() * n.view(-1, 1)


def ht_buffer(m=96):
    return ep.Buffer(None, m, H_HT, 4 * world(), 4, mode="high_throughput")


def test_ht_dispatch_combine():
    buf = ht_buffer()
    try:
        seed = 300
        for routing in ("uniform", "skewed", "one_rank", "masked"):
            for case in ("full", "zero_on_last", "one", "odd"):
                for sync in (False, True):
                    seed += 1
                    what = f"ht {routing} {case} sync_counts={sync}"
                    inputs = all_inputs(seed, buf.max_tokens, buf.hidden, buf.num_experts, buf.topk, routing, case)
                    x, idx, w = to_cuda(inputs[rank()])
                    expert_x, handle = buf.dispatch(x, idx, w, sync_counts=sync)
                    assert expert_x.data_ptr() == handle.expert_x.data_ptr()
                    check_ht_dispatch(buf, inputs, handle, what)
                    poison_allocator()
                    out = buf.combine(expert_outputs_ht(buf, handle), handle)
                    check_close(out, combine_reference(*inputs[rank()], buf.num_experts), what + " combine")
                    y_compact = handle.recv_x.clone()
                    poison_allocator()
                    out = buf.combine(None, handle, y_compact=y_compact)
                    check_close(out, compact_reference(x.cpu(), idx.cpu(), buf.num_local_experts, buf.num_experts),
                                what + " compact combine")
        buf.check_errors()
    finally:
        buf.close()


def test_ht_cuda_graph_and_errors():
    buf = ht_buffer()
    try:
        m = buf.max_tokens
        x_s = torch.zeros((m, buf.hidden), dtype=torch.bfloat16, device="cuda")
        i_s = torch.full((m, buf.topk), -1, dtype=torch.int64, device="cuda")
        w_s = torch.zeros((m, buf.topk), dtype=torch.float32, device="cuda")

        def step():
            _, handle = buf.dispatch(x_s, i_s, w_s)
            return buf.combine(expert_outputs_ht(buf, handle), handle)

        replay_with_fresh_routing(buf, step, (x_s, i_s, w_s), 400, ("uniform", "masked", "skewed"), "ht graph replay")

        inputs = all_inputs(450, m, buf.hidden, buf.num_experts, buf.topk, "uniform", "odd")
        x, idx, w = to_cuda(inputs[rank()])
        expect_error(lambda: buf.dispatch(x, idx, w.half()), "'topk_weights'")
        expect_error(lambda: buf.low_latency_dispatch(x, idx), "'self'", "low_latency")
        _, first = buf.dispatch(x, idx, w)
        y = expert_outputs_ht(buf, first)
        expect_error(lambda: buf.combine(y[:-1], first), "'y'")
        expect_error(lambda: buf.combine(y, first, y_compact=first.recv_x), "'y'", "exactly one")
        _, second = buf.dispatch(x, idx, w)
        expect_error(lambda: buf.combine(y, first), "'handle'")  # outputs valid until the next dispatch
        out = buf.combine(expert_outputs_ht(buf, second), second)
        check_close(out, combine_reference(*inputs[rank()], buf.num_experts), "ht combine after the errors")
    finally:
        buf.close()


# --- the worked layers of docs/ep.md --------------------------------------------------------------

def expert_weights(experts, hidden, ffn, seed=77):
    """Every expert's (w1 [E, H, F], w2 [E, F, H]) in bf16, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn((experts, hidden, ffn), generator=g) / math.sqrt(hidden)).to(torch.bfloat16)
    w2 = (torch.randn((experts, ffn, hidden), generator=g) / math.sqrt(ffn)).to(torch.bfloat16)
    return w1, w2


def layer_reference(x, idx, w, w1, w2, experts):
    """float64 sum over sent slots j of w[t, j] * silu(x[t] @ w1_e) @ w2_e."""
    ref = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            if sent(idx[t], j, experts):
                e = int(idx[t, j])
                ref[t] += float(w[t, j]) * (F.silu(x[t].double() @ w1[e].double()) @ w2[e].double())
    return ref


def test_docs_layer_low_latency():
    E, K, Hd, ffn = 4 * world(), 4, H_LL, 256
    buf = ep.Buffer(None, 32, Hd, E, K)
    try:
        L = buf.num_local_experts
        w1, w2 = expert_weights(E, Hd, ffn)
        w1_local = w1[rank() * L:(rank() + 1) * L].cuda()  # this rank's experts
        w2_local = w2[rank() * L:(rank() + 1) * L].cuda()
        inputs = all_inputs(500, 32, Hd, E, K, "uniform", "odd")
        x, topk_idx, topk_weights = to_cuda(inputs[rank()])
        # --- the layer, as in docs/ep.md ---
        recv_x, _, recv_count, handle, _ = buf.low_latency_dispatch(x, topk_idx)
        y = torch.bmm(F.silu(torch.bmm(recv_x, w1_local)), w2_local)  # [L, W * M, H]; rows past the counts unused
        out = buf.low_latency_combine(y, topk_idx, topk_weights, handle)
        # ---
        check_close(out, layer_reference(*inputs[rank()], w1, w2, E), "docs layer (low latency)", tol=3e-2)
    finally:
        buf.close()


def test_docs_layer_high_throughput():
    E, K, Hd, ffn = 4 * world(), 4, H_HT, 128
    buf = ep.Buffer(None, 96, Hd, E, K, mode="high_throughput")
    try:
        L = buf.num_local_experts
        w1, w2 = expert_weights(E, Hd, ffn, seed=78)
        w1_local = w1[rank() * L:(rank() + 1) * L].cuda()
        w2_local = w2[rank() * L:(rank() + 1) * L].cuda()
        inputs = all_inputs(501, 96, Hd, E, K, "skewed", "full")
        x, topk_idx, topk_weights = to_cuda(inputs[rank()])
        # --- the layer, as in docs/ep.md ---
        expert_x, handle = buf.dispatch(x, topk_idx, topk_weights, sync_counts=True)
        y = torch.empty_like(expert_x)
        for e in range(L):
            rows = slice(handle.expert_offsets[e], handle.expert_offsets[e] + handle.expert_counts[e])
            y[rows] = F.silu(expert_x[rows] @ w1_local[e]) @ w2_local[e]
        out = buf.combine(y, handle)
        # ---
        check_close(out, layer_reference(*inputs[rank()], w1, w2, E), "docs layer (high throughput)", tol=3e-2)
    finally:
        buf.close()


TESTS = [
    test_ll_dispatch_combine,
    test_ll_hooks_two_in_flight,
    test_ll_torch_library_ops,
    test_ll_cuda_graph_fresh_routing,
    test_ll_errors,
    test_ll_bad_ids_reported,
    test_ht_dispatch_combine,
    test_ht_cuda_graph_and_errors,
    test_docs_layer_low_latency,
    test_docs_layer_high_throughput,
]

if __name__ == "__main__":
    sys.exit(h.run_tests(TESTS))
