"""CPU tests of the MoE ops' autograd (python/tdist/_autograd.py, MoE section) and of
tdist.moe.routing: no GPU. They need torch and skip, saying so, without it.

* tdist.moe.routing on CPU tensors equals the host reference (tdist.moe.routing_reference) for random,
  skewed (empty experts) and single-expert routings, several world sizes and every rank, M = 0 and 1;
  its argument errors name the argument;
* the backward ops' fake implementations give the gradients' shapes and dtypes, an empty tensor for
  a gradient not asked for;
* backward through the forward ops on meta tensors (a stand-in runtime of 2 ranks, rank 1): every
  differentiable input gets a gradient of its own shape, topk_ids and offsets none;
* the backward's compact order (where torch._grouped_mm runs) against autograd in float64 at one
  rank, with a loop over groups standing in for torch's grouped GEMM;
* when the ops skip torch.library's dispatch (plain CUDA tensors, no autograd, mode or compile) and
  when they must not.
The gradients' values through the ops are checked on GPUs: tests/python/gpu_test_moe_grad.py.
"""

import pytest

torch = pytest.importorskip("torch", reason="the MoE autograd tests need torch")

import tdist  # noqa: E402
from tdist import _runtime, moe  # noqa: E402


def routing_ids(m, topk, experts, kind, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand((m, experts), generator=g)
    if kind == "skewed":  # every token on the first topk experts: the others get none
        scores = scores + (torch.arange(experts) < topk) * 10.0
    elif kind == "single":
        scores = scores + (torch.arange(experts) == experts - 1) * 10.0
    return scores.topk(topk, dim=1).indices.to(torch.int32)


@pytest.mark.parametrize("m,topk,experts,world", [(0, 2, 4, 2), (1, 2, 4, 2), (301, 2, 8, 3), (517, 4, 6, 2),
                                                  (1000, 3, 130, 8), (129, 1, 1, 1)])
@pytest.mark.parametrize("kind", ["random", "skewed", "single"])
def test_routing_equals_host_reference(m, topk, experts, world, kind):
    ids = routing_ids(m, topk, experts, kind, m + topk + experts)
    for rank in range(world):
        ref = moe.routing_reference(ids, experts, world, rank)
        got = moe.routing(ids.long() if rank % 2 else ids, experts, world, rank)
        cap = moe.capacity(m, topk, experts)
        assert got["offsets"].tolist() == list(ref["offsets"])
        assert got["counts"].tolist() == list(ref["counts"])
        assert tuple(got["token_of_row"].shape) == (cap,)
        assert got["token_of_row"].tolist() == list(ref["token_of_row"]) + [-1] * (cap - ref["offsets"][experts])
        assert tuple(got["row_of_pair"].shape) == (m, topk)
        assert got["row_of_pair"].tolist() == [list(r) for r in ref["row_of_pair"]]
        # The compact order: the padded rows with the padding taken out, expert by expert.
        padded = [r for r, t in enumerate(ref["token_of_row"]) if t >= 0]
        assert got["row_of_compact"].tolist() == padded
        assert got["compact_offsets"].tolist() == [0] + torch.cumsum(torch.tensor(ref["counts"]), 0).tolist()
        assert got["token_of_compact"].tolist() == [ref["token_of_row"][r] for r in padded]
        pair_of_row = {row: t * topk + k for t, rs in enumerate(ref["row_of_pair"]) for k, row in enumerate(rs)}
        assert got["pair_of_compact"].tolist() == [pair_of_row[r] for r in padded]
        compact_of_pair = [[padded.index(row) for row in rs] for rs in ref["row_of_pair"]]
        assert got["compact_of_pair"].tolist() == compact_of_pair
        assert all(v.dtype == torch.int32 for v in got.values())


def test_routing_sends_ids_out_of_range_to_expert_0():
    # As the ops' routing kernel does (it also records the id for tdist.moe.check_errors).
    ids = routing_ids(37, 3, 6, "random", 5)
    bad = ids.clone()
    bad[4, 2], bad[30, 0], bad[36, 1] = 6, -1, 1 << 20
    fixed = bad.clone()
    fixed[4, 2], fixed[30, 0], fixed[36, 1] = 0, 0, 0
    for rank in range(2):
        got, ref = moe.routing(bad, 6, 2, rank), moe.routing_reference(fixed, 6, 2, rank)
        assert got["counts"].tolist() == list(ref["counts"])
        assert got["row_of_pair"].tolist() == [list(r) for r in ref["row_of_pair"]]


def test_routing_argument_errors():
    ids = routing_ids(10, 2, 4, "random", 1)
    with pytest.raises(tdist.Error, match="'topk_ids'"):
        moe.routing(ids.float(), 4)
    with pytest.raises(tdist.Error, match="'topk_ids'"):
        moe.routing(ids.reshape(-1), 4)
    with pytest.raises(tdist.Error, match="'topk_ids'"):
        moe.routing(ids.tolist(), 4)
    with pytest.raises(tdist.Error, match="'topk'"):
        moe.routing(ids, 1)
    with pytest.raises(tdist.Error, match="'experts'"):
        moe.routing(ids, 0)
    with pytest.raises(tdist.Error, match="'rank'"):
        moe.routing(ids, 4, 2, 2)


class _StandInRuntime:
    world_size, rank, device, closed = 2, 1, 0, False


@pytest.fixture
def stand_in_runtime():
    _runtime._state.runtime = _StandInRuntime()
    yield
    _runtime._state.runtime = None


def meta(shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def test_backward_fakes(stand_in_runtime):
    m, topk, experts, k, n = 301, 2, 8, 200, 136
    cap = moe.capacity(m, topk, experts)
    ids = meta((m, topk), torch.int32)
    x, w, d = meta((150, k)), meta((experts, n, k)), meta((cap, n))
    gx, gw = torch.ops.tdist.moe_ag_group_gemm_backward(d, x, ids, w, "auto", True, True)
    assert gx.shape == (150, k) and gw.shape == (experts, n, k) and gx.dtype == gw.dtype == torch.bfloat16
    gx, gw = torch.ops.tdist.moe_ag_group_gemm_backward(d, x, ids, w, "chunked", False, True)
    assert gx.numel() == 0 and gw.shape == (experts, n, k)
    h, w2, p, y = meta((cap, k)), meta((experts, n, k)), meta((m, topk), torch.float32), meta((150, n))
    gh, gw, gp = torch.ops.tdist.moe_group_gemm_rs_backward(y, h, w2, ids, p, False, True, True, True)
    assert gh.shape == (cap, k) and gw.shape == (experts, n, k) and gp.shape == (m, topk)
    assert gp.dtype == torch.float32 and gh.dtype == torch.bfloat16
    gh, gw, gp = torch.ops.tdist.moe_group_gemm_rs_backward(meta((m, n)), h, w2, ids, p, True, False, False, True)
    assert gh.numel() == 0 and gw.numel() == 0 and gp.shape == (m, topk)
    a, offs = meta((cap + 37, k), torch.float16), meta((experts + 1,), torch.int64)
    ga, gw = torch.ops.tdist.grouped_gemm_backward(meta((cap + 37, n), torch.float16), a,
                                                  meta((experts, n, k), torch.float16), offs, True, False)
    assert ga.shape == (cap + 37, k) and ga.dtype == torch.float16 and gw.numel() == 0


def test_backward_through_forward_ops_on_meta(stand_in_runtime):
    m, topk, experts, k, f, hidden = 301, 2, 8, 200, 72, 200
    cap = moe.capacity(m, topk, experts)
    ids = meta((m, topk), torch.int64)
    x = meta((150, k), grad=True)  # rank 1 of 2: tokens 151 .. 300
    w13, w2 = meta((experts, 2 * f, k), grad=True), meta((experts, hidden, f), grad=True)
    p = meta((m, topk), torch.float32, grad=True)
    h13 = tdist.moe_ag_group_gemm(x, ids, w13)
    h = torch.nn.functional.silu(h13[:, :f]) * h13[:, f:]
    y = tdist.moe_group_gemm_rs(h, w2, ids, p)
    assert y.shape == (150, hidden)
    y.sum().backward()
    for t in (x, w13, w2, p):
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype
    x.grad = w13.grad = w2.grad = p.grad = None
    h = meta((cap, f), grad=True)
    tdist.moe_group_gemm_ar(h, w2, ids, p).sum().backward()
    assert h.grad.shape == (cap, f) and w2.grad.shape == w2.shape and p.grad.shape == (m, topk)
    a, w = meta((cap + 5, k), grad=True), meta((experts, f, k), grad=True)
    offs = meta((experts + 1,), torch.int32)
    moe.grouped_gemm(a, w, offs).sum().backward()
    assert a.grad.shape == a.shape and w.grad.shape == w.shape


def test_weight_grad_style_is_checked(monkeypatch):
    from tdist import _autograd
    monkeypatch.setenv("TDIST_MOE_WGRAD", "loop")
    with pytest.raises(ValueError, match="TDIST_MOE_WGRAD"):
        _autograd.grouped_weight_grad(torch.zeros((128, 8)), torch.zeros((128, 8)), torch.tensor([0, 128]), 1)


def test_weight_grad_tiles_on_cpu(monkeypatch):
    """The tile fallback of the experts' weight gradient (device-agnostic) against float64: empty
    groups, rows past offsets[G], a row count not a multiple of the tile."""
    from tdist import _autograd
    monkeypatch.setenv("TDIST_MOE_WGRAD", "tiles")
    monkeypatch.setattr(_autograd, "_DW_CHUNK_BYTES", 3 * 24 * 16 * 4)  # three tiles per chunk: several chunks
    tile = moe.grouped_gemm_alignment()
    offsets = [0, 0, 2 * tile, 2 * tile, 5 * tile, 6 * tile, 6 * tile]
    rows = offsets[-1] + 37
    g = torch.Generator().manual_seed(3)
    dy, a = torch.randn((rows, 24), generator=g), torch.randn((rows, 16), generator=g)
    dy[offsets[-1]:] = 0
    a[offsets[-1]:] = 0
    got = _autograd.grouped_weight_grad(dy, a, torch.tensor(offsets), len(offsets) - 1)
    assert got.shape == (6, 24, 16)
    for e in range(6):
        ref = dy[offsets[e]:offsets[e + 1]].double().T @ a[offsets[e]:offsets[e + 1]].double()
        assert torch.allclose(got[e].double(), ref, atol=1e-4, rtol=1e-4), e


def reference_grouped_mm(a, b, offs):
    """torch._grouped_mm's two forms as the compact backward calls them, by a loop over groups (the
    GPU kernel's stand-in on CPU): 2-D x 3-D, out[rows of g] = a[rows of g] @ b[g]; 2-D x 2-D,
    out[g] = a[:, cols of g] @ b[rows of g]. Rows past offs[-1] of the first form stay NaN."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=a.dtype)
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = a[s:e] @ b[g]
        return out
    return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])


@pytest.mark.parametrize("m,topk,experts", [(37, 3, 6), (1, 2, 4), (130, 1, 3)])
def test_compact_backward_against_float64(monkeypatch, m, topk, experts):
    """The backward's compact order (where torch._grouped_mm runs) against autograd of the forward
    ops' definitions in float64, at one rank, with a reference grouped GEMM in torch's place: empty
    experts, padding rows of h filled with garbage (their gradient must be 0)."""
    from tdist import _autograd
    monkeypatch.setattr(torch, "_grouped_mm", reference_grouped_mm, raising=False)
    g = torch.Generator().manual_seed(m + topk)
    ids = torch.stack([torch.randperm(experts - 1, generator=g)[:topk] for _ in range(m)]).int()  # last: empty
    r = moe.routing(ids, experts)
    rows, k, n = moe.capacity(m, topk, experts), 16, 24
    rop, tok = r["row_of_pair"], r["token_of_row"]
    expert_of_row = torch.full((rows,), -1, dtype=torch.long)
    expert_of_row[rop.reshape(-1)] = ids.long().reshape(-1)

    # Second projection: y[t] = sum_j p[t, j] h[rop[t, j]] @ w_e.T
    h, w = torch.randn((rows, k), generator=g, dtype=torch.float64), torch.randn((experts, n, k), generator=g,
                                                                                dtype=torch.float64)
    p, dy = torch.rand((m, topk), generator=g, dtype=torch.float64), torch.randn((m, n), generator=g,
                                                                                 dtype=torch.float64)
    hr, wr, pr = (t.clone().requires_grad_() for t in (h, w, p))
    y = torch.stack([sum(pr[t, j] * (hr[rop[t, j]] @ wr[ids[t, j]].T) for j in range(topk)) for t in range(m)])
    (y * dy).sum().backward()
    gh, gw, gp = _autograd._moe_rs_backward_compact(r, dy, h, w, p, 1, None, None, True, True, True)
    pairs = tok >= 0
    # p passes through fp32 (the op's topk_weights are fp32): 1e-5
    assert torch.allclose(gh[pairs].double(), hr.grad[pairs], atol=1e-5) and (gh[~pairs] == 0).all()
    assert torch.allclose(gw.double(), wr.grad, atol=1e-5) and torch.allclose(gp.double(), pr.grad, atol=1e-5)

    # First projection: d[r] = x[tok[r]] @ w_e.T for the pairs' rows
    x, dd = torch.randn((m, k), generator=g, dtype=torch.float64), torch.randn((rows, n), generator=g,
                                                                              dtype=torch.float64)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    d = torch.stack([xr[tok[i]] @ wr[expert_of_row[i]].T if tok[i] >= 0 else xr.new_zeros(n) for i in range(rows)])
    (d * dd).sum().backward()
    gx, gw = _autograd._moe_ag_backward_compact(r, dd, x, w, m, 1, 0, True, True)
    assert torch.allclose(gx, xr.grad, atol=1e-9) and torch.allclose(gw, wr.grad, atol=1e-9)
    assert (gw[experts - 1] == 0).all()  # the empty expert


def test_eager_calls_skip_the_dispatch_only_when_nothing_watches(monkeypatch):
    # No GPU here: stand in for the CUDA check, so that what is tested is the rest of the rule.
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type in ("cpu", "cuda")))
    a = torch.zeros(4, 8, dtype=torch.bfloat16)
    w = torch.nn.Parameter(torch.zeros(2, 8, 8, dtype=torch.bfloat16))
    assert moe._eager(a, w.detach())
    assert not moe._eager(a, w)  # autograd records the weight's use
    with torch.no_grad():
        assert moe._eager(a, w)
    assert not moe._eager(torch.zeros(4, 8, device="meta"))  # the op's fake runs for meta
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        assert not moe._eager(torch.zeros(4, 8))
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False):
        assert not moe._eager(a)
    compiled = torch.compile(lambda x: torch.tensor(moe._eager(x)), backend="eager", fullgraph=True)
    assert not bool(compiled(a))
