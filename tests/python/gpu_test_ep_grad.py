"""GPU tests of the expert-parallel autograd (python/tdist/ep.py, docs/ep.md "Training") under torchrun,
at any world size (1 included):

    python -m torch.distributed.run --nproc-per-node 2 tests/python/gpu_test_ep_grad.py
    python -m torch.distributed.run --nproc-per-node 1 tests/python/gpu_test_ep_grad.py

Every rank draws every rank's tokens, top-k ids, router weights and loss projection from (seed, rank)
on the CPU (gpu_test_ep's draw), and the experts' weights from one seed, so each builds the whole
float64 reference itself: the layer written out per expert with gather and index_add (tdist unused),
differentiated by torch in float64; a rank then compares its own tokens' and experts' gradients.

* the layer dispatch -> per-expert linear (plain torch, rows of each expert from handle.info) ->
  combine: gradients of x, topk_weights and the experts' weights, and the output; routings uniform,
  skewed, masked (-1 slots and a repeated expert); tokens full, odd, one, none on the last rank;
  sync_counts on and off; only topk_weights requiring grad (x not);
* two such layers through one buffer (the backward runs after the buffer's handle was overwritten);
  the layer under torch.compile;
* dispatch alone (its backward dispatches once more for the layout) and the compact combine
  (y_compact's gradient is the output gradient of each row's source token, bit for bit, 0 past the
  received rows);
* low-latency calls (bf16 and FP8) with a tensor requiring grad raise the clear error, and run
  under torch.no_grad(); combine's out= and a stale handle under autograd are argument errors; a
  saved view of the buffer's expert_x overwritten before the backward makes autograd raise.
Gradients are new tensors: the allocator's free blocks are filled with NaN before each forward and
backward. Tolerance (max |got - ref| <= tol x max |ref|): 3e-2 for bf16 rows (x, the expert outputs
and the output gradient as dispatched are bf16, each 2^-9 relative, and the expert GEMMs run in bf16),
the same for the fp32 topk_weights gradient (dot products of those bf16 rows).
"""

import sys

import gpu_harness as h
from gpu_harness import check_close, expect_error, rank, world
from gpu_test_ep import draw, poison_allocator, sent, tokens_of
from gpu_test_moe_grad import Checks

import tdist

import torch

ep = tdist.ep
TOL = 3e-2
M, H, K = 96, 264, 4  # tokens per rank at most, hidden (33 x 8), top-k


def expect(ok, what):
    assert ok, what


def experts_count():
    return 4 * world()


def inputs_of(seed, routing, case, layers=1):
    """Every rank's (x, topk_idx, topk_weights, proj) on the CPU; proj: the loss is sum(out * proj)."""
    E = experts_count()
    every = []
    for r in range(world()):
        x, idx, w = draw(seed, r, tokens_of(case, r, M), H, E, K, routing)
        if routing == "masked" and idx.shape[0] > 1:
            idx[1, K - 1] = idx[1, 0]  # a repeated expert: the slot is not sent (nor differentiated)
        g = torch.Generator().manual_seed(seed * 7 + r)
        every.append((x, idx, w, torch.randn((x.shape[0], H), generator=g)))
    g = torch.Generator().manual_seed(seed)
    wexp = (torch.randn((layers, E, H, H), generator=g) / H ** 0.5).to(torch.bfloat16)
    return every, wexp


def reference(every, wexp, layers=1):
    """float64 (outputs, dx, dtopk_weights, dwexp) of sum over ranks of <layer^n(x_r), proj_r>: every
    rank's term, so the experts' weights gradient has every rank's tokens."""
    E = experts_count()
    wx = wexp.double().requires_grad_()
    xs, ws, outs = [], [], []
    loss = 0
    for x, idx, w, proj in every:
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        xs.append(x64)
        ws.append(w64)
        hcur = x64
        for layer in range(layers):
            out = torch.zeros_like(hcur)
            for j in range(K):
                tok = torch.tensor([t for t in range(idx.shape[0]) if sent(idx[t], j, E)], dtype=torch.long)
                rows = torch.bmm(hcur[tok].unsqueeze(1), wx[layer][idx[tok, j]]).squeeze(1)
                out = out.index_add(0, tok, w64[tok, j].view(-1, 1) * rows)
            hcur = out
        outs.append(hcur.detach())
        loss = loss + (hcur * proj.double()).sum()
    loss.backward()
    grad = lambda t: t.grad if t.grad is not None else torch.zeros_like(t)  # noqa: E731 (unused inputs)
    return outs, [grad(x) for x in xs], [grad(w) for w in ws], grad(wx)


def expert_layer(buf, x, idx, w, w_local, sync):
    """dispatch -> y = expert_x @ w_local[e] on each local expert's rows (rows from handle.info, on the
    GPU; rows past the counts are garbage and masked out) -> combine."""
    expert_x, handle = buf.dispatch(x, idx, w, sync_counts=sync)
    L, X = buf.num_local_experts, expert_x.shape[0]
    begin, count = handle.info[2 + L:2 + 2 * L].long(), handle.info[2:2 + L].long()
    r = torch.arange(X, device="cuda").view(-1, 1)
    of = (r >= begin.view(1, -1)) & (r < (begin + count).view(1, -1))  # [X, L]
    rows = torch.where(of.any(1, keepdim=True), expert_x, 0)
    y = (torch.einsum("xh,lhg->lxg", rows, w_local) * of.t().unsqueeze(2).to(rows.dtype)).sum(0)
    return buf.combine(y, handle)


def run_layers(buf, every, wexp, layers, sync, x_grad=True):
    """This rank's (out, dx, dw, dw_local) through `layers` layers on one buffer, gradients poisoned first."""
    L = buf.num_local_experts
    x_in, idx, w_in, proj = every[rank()]
    poison_allocator()
    x = x_in.cuda().requires_grad_(x_grad)
    w = w_in.cuda().requires_grad_()
    w_local = wexp[:, rank() * L:(rank() + 1) * L].cuda().requires_grad_()
    idx = idx.cuda()
    hcur = x
    for layer in range(layers):
        hcur = expert_layer(buf, hcur, idx, w, w_local[layer], sync)
    poison_allocator()
    (hcur.float() * proj.cuda()).sum().backward()
    return hcur, x.grad, w.grad, w_local.grad


def check_case(check, buf, seed, routing, case, sync, layers=1, x_grad=True):
    what = f"{routing} {case} sync_counts={sync} layers={layers}" + ("" if x_grad else " (x without grad)")
    every, wexp = inputs_of(seed, routing, case, layers)
    out, dx, dw, dwl = run_layers(buf, every, wexp, layers, sync, x_grad)
    outs, gx, gw, gwexp = reference(every, wexp, layers)
    L = buf.num_local_experts
    me = rank()
    check(check_close, out, outs[me], what + ": output", TOL)
    if x_grad:
        check(check_close, dx, gx[me], what + ": x gradient", TOL)
    else:
        check(expect, dx is None, what + ": x without grad got a gradient")
    check(check_close, dw, gw[me], what + ": topk_weights gradient", TOL)
    check(check_close, dwl, gwexp[:, me * L:(me + 1) * L], what + ": experts' weights gradient", TOL)


def test_layer_gradients():
    buf = ep.Buffer(None, M, H, experts_count(), K, mode="high_throughput")
    check = Checks()
    try:
        seed = 700
        for routing, case, sync in (("uniform", "full", False), ("uniform", "odd", True), ("masked", "odd", False),
                                    ("masked", "zero_on_last", True), ("skewed", "one", False),
                                    ("skewed", "zero_on_last", False), ("masked", "full", True)):
            seed += 1
            check_case(check, buf, seed, routing, case, sync)
        check_case(check, buf, 720, "masked", "odd", False, x_grad=False)
    finally:
        buf.close()
    check.raise_failed()


def test_two_layers_one_buffer():
    buf = ep.Buffer(None, M, H, experts_count(), K, mode="high_throughput")
    check = Checks()
    try:
        check_case(check, buf, 730, "uniform", "odd", False, layers=2)
        check_case(check, buf, 731, "masked", "zero_on_last", True, layers=2)
    finally:
        buf.close()
    check.raise_failed()


def test_layer_under_torch_compile():
    """The layer and its loss compiled (the EP calls break the graph, as in the forward alone)."""
    buf = ep.Buffer(None, M, H, experts_count(), K, mode="high_throughput")
    check = Checks()
    try:
        L = buf.num_local_experts
        every, wexp = inputs_of(750, "masked", "odd")
        x_in, idx, w_in, proj = every[rank()]
        x, w = x_in.cuda().requires_grad_(), w_in.cuda().requires_grad_()
        w_local = wexp[0, rank() * L:(rank() + 1) * L].cuda().requires_grad_()
        idx, proj = idx.cuda(), proj.cuda()
        loss = torch.compile(lambda x, w, wl: (expert_layer(buf, x, idx, w, wl, False).float() * proj).sum())
        poison_allocator()
        loss(x, w, w_local).backward()
        _, gx, gw, gwexp = reference(every, wexp)
        check(check_close, x.grad, gx[rank()], "compiled layer: x gradient", TOL)
        check(check_close, w.grad, gw[rank()], "compiled layer: topk_weights gradient", TOL)
        check(check_close, w_local.grad, gwexp[0, rank() * L:(rank() + 1) * L], "compiled layer: experts' weights", TOL)
    finally:
        buf.close()
    check.raise_failed()


def test_dispatch_alone_and_compact_combine():
    E = experts_count()
    buf = ep.Buffer(None, M, H, E, K, mode="high_throughput")
    check = Checks()
    try:
        for seed, routing, case, sync in ((740, "masked", "odd", False), (741, "skewed", "zero_on_last", True)):
            what = f"{routing} {case} sync_counts={sync}"
            every, _ = inputs_of(seed, routing, case)
            x_in, idx, w, proj = every[rank()]
            c = torch.randn((E, H), generator=torch.Generator().manual_seed(seed))  # per expert
            # dispatch alone: loss = sum over expert rows of <row, c[expert]>; dx[t] = sum over sent j of c[e_j]
            poison_allocator()
            x = x_in.cuda().requires_grad_()
            expert_x, handle = buf.dispatch(x, idx.cuda(), w.cuda(), sync_counts=sync)
            L = buf.num_local_experts
            begin, count = handle.info[2 + L:2 + 2 * L].long(), handle.info[2:2 + L].long()
            r = torch.arange(expert_x.shape[0], device="cuda").view(-1, 1)
            of = ((r >= begin.view(1, -1)) & (r < (begin + count).view(1, -1))).float()  # [X, L]
            c_rows = of @ c[rank() * L:(rank() + 1) * L].cuda()  # 0 on padding and past the counts
            poison_allocator()
            (torch.where(of.sum(1, keepdim=True) > 0, expert_x.float(), 0) * c_rows).sum().backward()
            ref = torch.zeros((x_in.shape[0], H), dtype=torch.float64)
            for t in range(x_in.shape[0]):
                for j in range(K):
                    if sent(idx[t], j, E):
                        ref[t] += c[int(idx[t, j])].double()
            check(check_close, x.grad, ref, what + ": dispatch alone, x gradient", TOL)
            # compact combine: y_compact's gradient is dout of each row's source token, 0 past the rows
            _, handle = buf.dispatch(x_in.cuda(), idx.cuda(), w.cuda(), sync_counts=sync)
            yc = torch.randn((handle.max_recv_rows, H), device="cuda").to(torch.bfloat16).requires_grad_()
            poison_allocator()
            out = buf.combine(None, handle, y_compact=yc)
            n = int(handle.info[0])
            src = handle.recv_src[:n].long().cpu()
            poison_allocator()
            (out.float() * proj.cuda()).sum().backward()
            want = torch.zeros((handle.max_recv_rows, H), dtype=torch.bfloat16)
            for i in range(n):
                s, t = int(src[i]) // M, int(src[i]) % M
                want[i] = every[s][3][t].to(torch.bfloat16)
            check(expect, torch.equal(yc.grad.cpu(), want), what + ": y_compact gradient differs")
    finally:
        buf.close()
    check.raise_failed()


def test_low_latency_refuses_grad():
    E = experts_count()
    buf = ep.Buffer(None, 32, 384, E, K)
    try:
        x, idx, w = draw(760, rank(), 17, 384, E, K, "uniform")
        x, idx, w = x.cuda(), idx.cuda(), w.cuda()
        msg = ("low_latency_* has no backward", "dispatch / combine")
        for fp8 in (False, True):
            expect_error(lambda: buf.low_latency_dispatch(x.clone().requires_grad_(), idx, use_fp8=fp8),
                         "'x'", *msg)
        recv_x, _, _, handle, _ = buf.low_latency_dispatch(x, idx)
        y = recv_x.clone()
        expect_error(lambda: buf.low_latency_combine(y.clone().requires_grad_(), idx, w, handle), "'y'", *msg)
        expect_error(lambda: buf.low_latency_combine(y, idx, w.clone().requires_grad_(), handle),
                     "'topk_weights'", *msg)
        with torch.no_grad():  # the same tensors under no_grad: allowed
            x_g = x.clone().requires_grad_()
            recv_x, _, _, handle, _ = buf.low_latency_dispatch(x_g, idx)
            out = buf.low_latency_combine(recv_x.clone(), idx, w.clone().requires_grad_(), handle)
        ref = torch.zeros((x.shape[0], 384), dtype=torch.float64)
        for t in range(x.shape[0]):
            for j in range(K):
                if sent(idx[t].cpu(), j, E):
                    ref[t] += float(w[t, j]) * x[t].double().cpu()
        check_close(out, ref, "low-latency under no_grad", TOL)
    finally:
        buf.close()


def test_autograd_argument_errors():
    buf = ep.Buffer(None, M, H, experts_count(), K, mode="high_throughput")
    try:
        every, _ = inputs_of(770, "uniform", "odd")
        x_in, idx, w_in, _ = every[rank()]
        x, idx, w = x_in.cuda(), idx.cuda(), w_in.cuda()
        expert_x, first = buf.dispatch(x, idx, w)
        y = expert_x.clone().requires_grad_()
        out = torch.empty((x.shape[0], H), dtype=torch.bfloat16, device="cuda")
        expect_error(lambda: buf.combine(y, first, out=out), "'out'", "differentiated")
        buf.dispatch(x, idx, w)
        expect_error(lambda: buf.combine(y, first), "'handle'", "latest dispatch")
        # A backward that saved the buffer's expert_x (a view) after the buffer overwrote it: autograd raises.
        expert_x, handle = buf.dispatch(x, idx, w)
        s = torch.ones((), dtype=torch.bfloat16, device="cuda", requires_grad=True)
        out = buf.combine(expert_x * s, handle)  # mul saves expert_x for s's gradient
        expect_error(lambda: out.float().sum().backward(), "modified by an inplace operation", cls=RuntimeError)
    finally:
        buf.close()


TESTS = [
    test_layer_gradients,
    test_two_layers_one_buffer,
    test_layer_under_torch_compile,
    test_dispatch_alone_and_compact_combine,
    test_low_latency_refuses_grad,
    test_autograd_argument_errors,
]

if __name__ == "__main__":
    sys.exit(h.run_tests(TESTS))
