"""CPU tests of the expert-parallel autograd (python/tdist/ep.py, docs/ep.md "Training"): no GPU. They
need torch and skip, saying so, without it.

The autograd formulas run unchanged on a stand-in Buffer whose high-throughput kernels are simulated
with torch on the CPU, W ranks as W threads meeting at barriers: each dispatch lays the rows of a
source out in a random order (the kernels' order within a source is not part of the contract) and
fills every row past the counts with garbage (NaN rows, out-of-range sources and rows), so the
backward's matching of rows by source token and its masking are what is tested. The simulated
ReduceScatter sums the ranks' fp32 matrices. Checked against float64 autograd of the same math
written out with index_add: gradients of x, topk_weights, the experts' weights and y_compact, with
masked and repeated top-k slots, odd token counts, a rank with no tokens, two layers through one
buffer, sync_counts on and off; and the argument errors of the autograd paths.
The real kernels are checked on GPUs: tests/python/gpu_test_ep_grad.py.
"""

import threading

import pytest

torch = pytest.importorskip("torch", reason="the EP autograd tests need torch")

import tdist  # noqa: E402
from tdist import ep  # noqa: E402
from tdist._tensors import check_tensor_kind  # noqa: E402


class _SimWorld:
    """What the simulated ranks share: a barrier and one mailbox per rank."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.box = [None] * size

    def exchange(self, rank, item):
        """Every rank's item, in rank order (collective)."""
        self.box[rank] = item
        self.barrier.wait()
        items = list(self.box)
        self.barrier.wait()
        return items


def _sent(row, j, experts):
    e = int(row[j])
    return 0 <= e < experts and all(int(row[i]) != e for i in range(j))


class _SimBuffer(ep.Buffer):
    """ep.Buffer in high-throughput mode with its two kernels simulated (no runtime, no GPU)."""

    def __init__(self, world, rank, max_tokens, hidden, num_experts, topk, alignment=4):
        self.max_tokens, self.hidden, self.num_experts, self.topk = max_tokens, hidden, num_experts, topk
        self.mode, self.expert_alignment = "high_throughput", alignment
        self.world_size, self.rank, self.device, self.world = world.size, rank, 0, world
        self.num_local_experts = num_experts // world.size
        self.id, self._ht_call, self._ht_views = 1000 + rank, 0, []
        self.calls = 0

    def _tensor(self, op, name, t, dtypes, dims):
        check_tensor_kind(lambda *a: ep._fail(op, *a), name, t, dtypes, dims)
        if not t.is_contiguous():
            ep._fail(op, name, "a contiguous tensor", f"strides {tuple(t.stride())}")

    def _ht_dispatch(self, x, topk_idx, topk_weights, sync_counts):
        W, M, H, K, E, L, A = (self.world_size, self.max_tokens, self.hidden, self.topk, self.num_experts,
                               self.num_local_experts, self.expert_alignment)
        ep._bump_versions(self._ht_views)
        self.calls += 1
        inputs = self.world.exchange(self.rank, (x.clone(), topk_idx.clone(), topk_weights.clone()))
        g = torch.Generator().manual_seed(7919 * self.calls + self.rank)
        R, X = W * M, W * M * min(K, L) + L * (A - 1)
        recv_x = torch.full((R, H), float("nan"), dtype=torch.bfloat16)
        recv_src = torch.randint(-5, 10 * R, (R,), generator=g, dtype=torch.int32)  # garbage past the count
        recv_idx = torch.randint(-3, L + 3, (R, K), generator=g, dtype=torch.int32)
        recv_w = torch.rand((R, K), generator=g)
        recv_row = torch.randint(-3, X + 9, (R, K), generator=g, dtype=torch.int32)
        pairs = []  # (compact row, slot, local expert)
        n = 0
        for s, (xs, ids, ws) in enumerate(inputs):
            rows = []
            for t in range(xs.shape[0]):
                here = [j for j in range(K) if _sent(ids[t], j, E) and int(ids[t, j]) // L == self.rank]
                if here:
                    rows.append((t, here))
            for i in torch.randperm(len(rows), generator=g).tolist():  # any order within a source
                t, here = rows[i]
                recv_x[n], recv_src[n], recv_w[n] = xs[t], s * M + t, ws[t]
                recv_idx[n] = -1
                recv_row[n] = -1
                for j in here:
                    recv_idx[n, j] = int(ids[t, j]) % L
                    pairs.append((n, j, int(ids[t, j]) % L))
                n += 1
        counts = [sum(1 for p in pairs if p[2] == le) for le in range(L)]
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + (c + A - 1) // A * A)
        expert_x = torch.full((X, H), float("nan"), dtype=torch.bfloat16)
        expert_src = torch.randint(-5, 10 * R, (X,), generator=g, dtype=torch.int32)
        for le in range(L):
            mine = [p for p in pairs if p[2] == le]
            for k, i in enumerate(torch.randperm(len(mine), generator=g).tolist()):
                r, j, _ = mine[i]
                pos = offsets[le] + k
                recv_row[r, j], expert_x[pos], expert_src[pos] = pos, recv_x[r], r
            expert_src[offsets[le] + counts[le]:offsets[le + 1]] = -1
        info = torch.tensor([n, offsets[L]] + counts + offsets, dtype=torch.int32)
        views = dict(recv_x=recv_x, recv_src=recv_src, recv_topk_idx=recv_idx, recv_topk_weights=recv_w,
                     recv_expert_row=recv_row, expert_x=expert_x, expert_src=expert_src, info=info)
        self._ht_views = [ep.weakref.ref(v) for v in views.values()]
        self._ht_call = self.calls
        views.update(max_recv_rows=R, max_expert_rows=X, num_recv=n if sync_counts else -1,
                     num_expert_rows=offsets[L] if sync_counts else -1,
                     expert_counts=counts if sync_counts else [], expert_offsets=offsets if sync_counts else [])
        handle = ep.HighThroughputHandle(self.id, self.calls, int(x.shape[0]), views)
        handle.topk_idx, handle.topk_weights = topk_idx, topk_weights
        self.sim = views  # the latest layout, for the simulated combine
        return handle

    def _ht_combine(self, y, y_compact, handle, out):
        assert handle.call == self._ht_call, "a combine with a handle that is not the buffer's latest"
        v, M = self.sim, self.max_tokens
        partial = {}  # source -> this rank's bf16 row for it
        for r in range(int(v["info"][0])):
            if y_compact is not None:
                row = y_compact[r].float()
            else:
                row = torch.zeros(self.hidden)
                for j in range(self.topk):
                    pos = int(v["recv_expert_row"][r, j])
                    if pos >= 0:
                        row += float(v["recv_topk_weights"][r, j]) * y[pos].float()
            partial[int(v["recv_src"][r])] = row.to(torch.bfloat16)
        every = self.world.exchange(self.rank, partial)
        res = torch.zeros((handle.num_tokens, self.hidden))
        for p in every:
            for t in range(handle.num_tokens):
                if self.rank * M + t in p:
                    res[t] += p[self.rank * M + t].float()
        res = res.to(torch.bfloat16)
        if out is None:
            return res
        out.copy_(res)
        return out


def _draw(seed, rank, tokens, hidden, experts, topk):
    g = torch.Generator().manual_seed(seed * 131 + rank)
    x = torch.randn((tokens, hidden), generator=g).to(torch.bfloat16)
    idx = torch.rand((tokens, experts), generator=g).topk(topk, dim=1).indices
    idx[torch.rand((tokens, topk), generator=g) < 0.25] = -1  # masked slots
    if tokens > 2:
        idx[1, -1] = idx[1, 0]  # a repeated expert: not sent again
    w = torch.rand((tokens, topk), generator=g)
    proj = torch.randn((tokens, hidden), generator=g)  # the loss: sum(out * proj)
    return x, idx, w, proj


def _ranks(world_size, max_tokens, hidden, experts, topk, monkeypatch):
    """W simulated ranks' buffers, and tdist's ReduceScatter simulated among them."""
    world = _SimWorld(world_size)
    bufs = [_SimBuffer(world, r, max_tokens, hidden, experts, topk) for r in range(world_size)]

    def reduce_scatter(t):
        me = next(b for b in bufs if b.thread == threading.current_thread())
        every = world.exchange(me.rank, t.clone())
        rows = t.shape[0] // world_size
        return sum(e[me.rank * rows:(me.rank + 1) * rows] for e in every)

    monkeypatch.setattr(tdist.ops, "reduce_scatter", reduce_scatter)
    return bufs


def _run(bufs, fn):
    """fn(rank, buf) on one thread per simulated rank; their results in rank order (a failure re-raised)."""
    results, errors = [None] * len(bufs), []

    def body(r):
        try:
            results[r] = fn(r, bufs[r])
        except BaseException as e:  # noqa: BLE001 (re-raised below; the barrier released for the others)
            errors.append(e)
            bufs[r].world.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(bufs))]
    for b, t in zip(bufs, threads):
        b.thread = t
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _reference(inputs, experts_w, experts, layers=1):
    """float64 autograd of `layers` MoE layers (dispatch, per-expert linear, weighted combine) on every
    rank's tokens: the routing written out with gather and index_add."""
    xs = [x.double().requires_grad_() for x, _, _, _ in inputs]
    ws = [w.double().requires_grad_() for _, _, w, _ in inputs]
    wexp = experts_w.double().requires_grad_()
    loss = 0
    for (x_in, idx, _, proj), x, w in zip(inputs, xs, ws):
        h = x
        for layer in range(layers):
            out = torch.zeros_like(h)
            for j in range(idx.shape[1]):
                sent = torch.tensor([_sent(idx[t], j, experts) for t in range(idx.shape[0])], dtype=torch.bool)
                tok = torch.nonzero(sent).view(-1)
                e = idx[tok, j]
                rows = torch.bmm(h[tok].unsqueeze(1), wexp[layer][e]).squeeze(1)
                out = out.index_add(0, tok, w[tok, j].view(-1, 1) * rows)
            h = out
        loss = loss + (h * proj.double()).sum()
    loss.backward()
    return [x.grad for x in xs], [w.grad for w in ws], wexp.grad


def _layer(buf, x, idx, w, w_local):
    """dispatch -> per-local-expert linear in plain torch (rows of expert le from handle.info) -> combine."""
    expert_x, handle = buf.dispatch(x, idx, w, sync_counts=getattr(buf, "sync", False))
    L, X = buf.num_local_experts, expert_x.shape[0]
    begin, count = handle.info[2 + L:2 + 2 * L].long(), handle.info[2:2 + L].long()
    r = torch.arange(X).view(-1, 1)
    of = (r >= begin.view(1, -1)) & (r < (begin + count).view(1, -1))  # [X, L]
    rows = torch.where(of.any(1, keepdim=True), expert_x, 0)  # rows past the counts are garbage
    y = (torch.einsum("xh,lhg->lxg", rows.float(), w_local.float()) * of.t().unsqueeze(2)).sum(0)
    return buf.combine(y.to(torch.bfloat16), handle)


@pytest.mark.parametrize("world_size,tokens,sync,layers", [(1, 9, False, 1), (2, 7, True, 1), (2, 11, False, 2),
                                                            (3, 5, False, 1), (2, 1, True, 2)])
def test_layer_gradients_match_float64(monkeypatch, world_size, tokens, sync, layers):
    H, E, K, M = 24, 4 * world_size, 3, 12
    L = E // world_size
    counts = [0 if r == world_size - 1 and world_size > 1 else tokens + 2 * r for r in range(world_size)]
    inputs = [_draw(5 + world_size + tokens, r, counts[r], H, E, K) for r in range(world_size)]
    g = torch.Generator().manual_seed(99)
    experts_w = (torch.randn((layers, E, H, H), generator=g) / H ** 0.5).to(torch.bfloat16)
    bufs = _ranks(world_size, M, H, E, K, monkeypatch)
    for b in bufs:
        b.sync = sync

    def step(r, buf):
        x_in, idx, w_in, proj = inputs[r]
        x, w = x_in.clone().requires_grad_(), w_in.clone().requires_grad_()
        w_local = experts_w[:, r * L:(r + 1) * L].clone().requires_grad_()
        h = x
        for layer in range(layers):
            h = _layer(buf, h, idx, w, w_local[layer])
        (h.float() * proj).sum().backward()
        return x.grad, w.grad, w_local.grad

    results = _run(bufs, step)
    gx, gw, gexp = _reference(inputs, experts_w, E, layers)
    for r in range(world_size):
        dx, dw, dexp = results[r]
        scale = max(gx[r].abs().max().item() if gx[r].numel() else 0.0, 1e-3)
        assert dx.shape == gx[r].shape and dx.dtype == torch.bfloat16
        assert (dx.double() - gx[r]).abs().max().item() <= 3e-2 * scale if dx.numel() else True, f"rank {r} dx"
        assert dw.shape == gw[r].shape and dw.dtype == torch.float32
        if dw.numel():
            assert (dw.double() - gw[r]).abs().max().item() <= 3e-2 * max(gw[r].abs().max().item(), 1e-3), \
                f"rank {r} dtopk_weights"
        ref = gexp[:, r * L:(r + 1) * L]
        assert (dexp.double() - ref).abs().max().item() <= 3e-2 * max(ref.abs().max().item(), 1e-3), \
            f"rank {r} experts' weights"



def test_layer_under_torch_compile(monkeypatch):
    """The layer compiled (the EP calls break the graph, as the forward does); gradients as eagerly."""
    H, E, K, M = 24, 4, 3, 12
    bufs = _ranks(1, M, H, E, K, monkeypatch)
    inputs = [_draw(3, 0, 9, H, E, K)]
    experts_w = (torch.randn((1, E, H, H), generator=torch.Generator().manual_seed(5)) / H ** 0.5).to(torch.bfloat16)

    def step(r, buf):
        x_in, idx, w_in, proj = inputs[r]
        x, w = x_in.clone().requires_grad_(), w_in.clone().requires_grad_()
        w_local = experts_w[0].clone().requires_grad_()
        loss = torch.compile(lambda x, w, wl: (_layer(buf, x, idx, w, wl).float() * proj).sum())
        loss(x, w, w_local).backward()
        return x.grad, w.grad, w_local.grad

    (dx, dw, dexp), = _run(bufs, step)
    gx, gw, gexp = _reference(inputs, experts_w, E)
    for got, ref, what in ((dx, gx[0], "x"), (dw, gw[0], "topk_weights"), (dexp, gexp[0], "experts' weights")):
        assert (got.double() - ref).abs().max().item() <= 3e-2 * ref.abs().max().item(), what


def _one_rank(monkeypatch, mode="high_throughput", hidden=24, experts=4, topk=3, max_tokens=12):
    buf = _ranks(1, max_tokens, hidden, experts, topk, monkeypatch)[0]
    buf.mode = mode
    buf.thread = threading.current_thread()
    return buf


def test_low_latency_calls_refuse_grad(monkeypatch):
    buf = _one_rank(monkeypatch, mode="low_latency")
    x, idx, w, _ = _draw(1, 0, 5, 24, 4, 3)
    for fp8 in (False, True):
        with pytest.raises(tdist.Error, match=r"'x' requires grad.*low_latency_\* has no backward; use dispatch / "
                                              r"combine"):
            buf.low_latency_dispatch(x.clone().requires_grad_(), idx, use_fp8=fp8)
    handle = ep.LowLatencyHandle(buf.id, 1, 5, False, None, None)
    y = torch.zeros((4, 12, 24), dtype=torch.bfloat16)
    with pytest.raises(tdist.Error, match=r"'y' requires grad.*has no backward"):
        buf.low_latency_combine(y.requires_grad_(), idx, w, handle)
    with pytest.raises(tdist.Error, match=r"'topk_weights' requires grad.*has no backward"):
        buf.low_latency_combine(y.detach(), idx, w.clone().requires_grad_(), handle)


def test_autograd_argument_errors(monkeypatch):
    buf = _one_rank(monkeypatch)
    x, idx, w, _ = _draw(2, 0, 7, 24, 4, 3)
    expert_x, first = buf.dispatch(x, idx, w)
    assert expert_x.data_ptr() == first.expert_x.data_ptr()  # no autograd: the buffer's own rows
    y = expert_x.clone().requires_grad_()
    with pytest.raises(tdist.Error, match="'out'.*differentiated"):
        buf.combine(y, first, out=torch.empty((7, 24), dtype=torch.bfloat16))
    buf.dispatch(x, idx, w)
    with pytest.raises(tdist.Error, match="'handle'.*latest dispatch"):
        buf.combine(y, first)
    with pytest.raises(tdist.Error, match="'handle'.*latest dispatch"):
        buf.combine(None, first, y_compact=torch.zeros((12, 24), dtype=torch.bfloat16, requires_grad=True))
    # A backward that kept the buffer's expert_x, which its own dispatch then overwrote, raises.
    expert_x, handle = buf.dispatch(x, idx, w)
    s = torch.ones((), dtype=torch.bfloat16, requires_grad=True)
    out = buf.combine(expert_x * s, handle)  # mul keeps expert_x (the buffer's rows) for s's gradient
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()
    # With x or topk_weights requiring grad the rows and info are copies, which nothing overwrites.
    expert_x, handle = buf.dispatch(x, idx, w.clone().requires_grad_())
    assert expert_x.data_ptr() == handle.expert_x.data_ptr() != buf.sim["expert_x"].data_ptr()
    assert handle.info.data_ptr() != buf.sim["info"].data_ptr()


def test_gradients_of_parts(monkeypatch):
    """Dispatch alone (its backward dispatches again for a layout) and the compact combine (y_compact's
    gradient: the output gradient of each row's source token, 0 past the rows) at two ranks."""
    H, E, K, M = 16, 8, 3, 10
    bufs = _ranks(2, M, H, E, K, monkeypatch)
    inputs = [_draw(11, r, [7, 3][r], H, E, K) for r in range(2)]
    c = torch.randn((E, H), generator=torch.Generator().manual_seed(4))

    def step(r, buf):
        x_in, idx, w, proj = inputs[r]
        x = x_in.clone().requires_grad_()
        expert_x, handle = buf.dispatch(x, idx, w)
        L = buf.num_local_experts
        rows = torch.zeros(expert_x.shape[0], dtype=torch.long)
        valid = handle.expert_src >= 0
        for le in range(L):
            rows[int(handle.info[2 + L + le]):int(handle.info[2 + L + le]) + int(handle.info[2 + le])] = r * L + le
        (torch.where(valid.view(-1, 1), expert_x.float(), 0) * c[rows]).sum().backward()
        _, handle = buf.dispatch(x_in, idx, w, sync_counts=True)
        yc = torch.randn((handle.max_recv_rows, H)).to(torch.bfloat16).requires_grad_()
        src = handle.recv_src[:handle.num_recv].clone()
        (buf.combine(None, handle, y_compact=yc).float() * proj).sum().backward()
        return x.grad, yc.grad, src

    results = _run(bufs, step)
    for r, (dx, dyc, src) in enumerate(results):
        x_in, idx, _, _ = inputs[r]
        ref = torch.zeros((x_in.shape[0], H), dtype=torch.float64)
        for t in range(x_in.shape[0]):
            for j in range(K):
                if _sent(idx[t], j, E):
                    ref[t] += c[int(idx[t, j])].double()
        assert (dx.double() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
        want = torch.zeros_like(dyc)
        for i, s in enumerate(src.tolist()):
            want[i] = inputs[s // M][3][s % M].to(torch.bfloat16)
        assert torch.equal(dyc, want)
