"""GPU tests of the overlapped GEMMs' autograd and of tdist.nn, on 2+ GPUs of one node:

    python -m torch.distributed.run --nproc-per-node 2 tests/python/gpu_test_layers.py
    torchrun --nproc-per-node 2 -m pytest -q tests/python/gpu_test_layers.py

Each op's backward (ag_gemm with and without the gathered A, gemm_rs, gemm_ar; every method, bf16
and fp16, odd shapes with M not divisible by the world size) against float64 references of the
unsharded math on every rank's inputs; a Llama-style MLP converted by tdist.nn.parallelize against
the unconverted one on rank 0's weights (outputs, input and weight gradients, both ways of keeping the
gathered input); one SGD step of a two-layer model with biases, sequence-parallel and replicated,
against the single-GPU step (loss, updated weights); torch.compile(fullgraph=True) of forward +
backward; activation checkpointing; a CUDA graph of a forward, and one of a forward + backward,
replayed on new inputs; the ops' backward both ways (TDIST_TP_BACKWARD overlap and fused); the torch
fallback (float32, shapes the overlapped GEMMs refuse, unequal row counts); argument errors.
Gradients are new tensors, so blocks of their sizes are filled with NaN before each backward.
Both ways end with a line "N passed, M failed".
"""

import copy
import os
import sys

import tdist  # before torch: tdist's libnccl (>= 2.28) is then the one the process loads
import tdist.nn

import torch
import torch.distributed as dist

from gpu_harness import expect_error as harness_expect_error
from gpu_harness import pytest_session, rank, run_tests, world
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DTYPES = (torch.bfloat16, torch.float16)
METHODS = ("auto", "fused", "chunked", "baseline")
OP_TOL = 1e-2      # single ops: max |got - want| / max |want|
MODEL_TOL = 2e-2   # bf16 models (intermediate activations rounded to bf16)


def chunk(m):
    """This rank's (begin, rows) in RowChunks{m, world}."""
    w, r = world(), rank()
    return r * (m // w) + min(r, m % w), m // w + (r < m % w)


def rand(shape, seed, scale=1.0, same=False):
    """float32 normal values; different on every rank unless ``same``."""
    g = torch.Generator(device="cuda").manual_seed(seed * 7919 + (0 if same else 1 + rank()))
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * scale


def gather_rows_fp64(x, m):
    """Every rank's rows (RowChunks{m, world}) of a 2-D x, in rank order, exactly, as float64."""
    w = world()
    most = m // w + (m % w > 0)
    pad = torch.zeros((most, x.shape[1]), device="cuda", dtype=torch.float64)
    pad[: x.shape[0]] = x.double()
    out = torch.empty((w * most, x.shape[1]), device="cuda", dtype=torch.float64)
    dist.all_gather_into_tensor(out, pad)
    return torch.cat([out[r * most: r * most + (m // w + (r < m % w))] for r in range(w)])


def sum_fp64(x):
    y = x.double().contiguous()
    dist.all_reduce(y)
    return y


def poison(*shapes_dtypes):
    """NaN-filled blocks of these sizes left in torch's caching allocator, handed to the next
    allocations of those sizes (gradients): a kernel that skips part of its output shows NaN."""
    blocks = [torch.full(shape, float("nan"), device="cuda", dtype=dtype) for shape, dtype in shapes_dtypes]
    del blocks


def check(got, want, tol, what):
    """max |got - want| / max |want| <= tol (NaN fails), on this rank; shapes must agree."""
    assert got is not None, f"{what}: no gradient"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if want.numel() == 0:
        return
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= tol * max(scale, 1e-30), f"{what}: max |diff| {err:.3e} > {tol} x max |ref| {scale:.3e}"


def expect_error(fn, *fragments, cls=ValueError):
    """As gpu_harness.expect_error, ValueError by default (tdist.nn's plan and shape errors)."""
    harness_expect_error(fn, *fragments, cls=cls)


def op_shapes():
    """(M, N, K): a rank with no rows, M not divisible by the world size, M divisible, several tiles."""
    w = world()
    return ((1, 40, 72), (389, 136, 264), (64 * w, 24, 40), (1000 * w + w - 1, 264, 520))


def methods_for(m):
    return METHODS + (("sequential",) if m % world() == 0 else ())


# --- the ops' backward --------------------------------------------------------------------------------

def test_ag_gemm_backward():
    """d = gather(a) @ b.T: da = rows of sum_r dd_r @ b_r (+ the gathered A's own gradient, summed),
    db = dd.T @ gather(a); plain (re-gathers) and return_gathered (keeps the gathered A)."""
    for dtype in DTYPES:
        for m, n, k in op_shapes():
            begin, rows = chunk(m)
            for method in methods_for(m):
                for mode in ("plain", "gathered_unused", "gathered_used"):
                    what = f"ag_gemm backward {dtype} m={m} n={n} k={k} {method} {mode}"
                    seed = m + n + k + len(method) + len(mode)
                    a = rand((rows, k), seed).to(dtype).requires_grad_()
                    b = rand((n, k), seed + 1, k ** -0.5).to(dtype).requires_grad_()
                    dd = rand((m, n), seed + 2)
                    if mode == "plain":
                        d = tdist.ag_gemm(a, b, m=m, method=method)
                        loss = (d.float() * dd).sum()
                    else:
                        d, g = tdist.ag_gemm(a, b, m=m, method=method, return_gathered=True)
                        loss = (d.float() * dd).sum()
                        if mode == "gathered_used":
                            dg = rand((m, k), seed + 3)
                            loss = loss + (g.float() * dg).sum()
                    poison(((rows, k), dtype), ((n, k), dtype))
                    loss.backward()
                    full = sum_fp64(dd.double() @ b.detach().double())
                    if mode == "gathered_used":
                        full = full + sum_fp64(dg)
                    check(a.grad, full[begin:begin + rows], OP_TOL, what + " da")
                    check(b.grad, dd.double().T @ gather_rows_fp64(a.detach(), m), OP_TOL, what + " db")


def test_gemm_rs_backward():
    """d = rows of sum_r a_r @ b_r.T: da = G @ b, db = G.T @ a with G every rank's dd (gathered);
    both gradients (ag_gemm_gathered), only da (ag_gemm), only db (re-gather)."""
    for dtype in DTYPES:
        for m, n, k in op_shapes():
            begin, rows = chunk(m)
            for method in methods_for(m):
                needs = ((True, True),) if method != "auto" else ((True, True), (True, False), (False, True))
                for need_a, need_b in needs:
                    what = f"gemm_rs backward {dtype} m={m} n={n} k={k} {method} da={need_a} db={need_b}"
                    seed = 3 * m + n + k + len(method)
                    a = rand((m, k), seed).to(dtype).requires_grad_(need_a)
                    b = rand((n, k), seed + 1, (k * world()) ** -0.5).to(dtype).requires_grad_(need_b)
                    d = tdist.gemm_rs(a, b, method=method)
                    dd = rand((rows, n), seed + 2)
                    poison(((m, k), dtype), ((n, k), dtype))
                    (d.float() * dd).sum().backward()
                    G = gather_rows_fp64(dd, m)
                    if need_a:
                        check(a.grad, G @ b.detach().double(), OP_TOL, what + " da")
                    else:
                        assert a.grad is None, what
                    if need_b:
                        check(b.grad, G.T @ a.detach().double(), OP_TOL, what + " db")
                    else:
                        assert b.grad is None, what


def test_gemm_ar_backward():
    """d = sum_r a_r @ b_r.T on every rank, its gradient replicated: da = dd @ b, db = dd.T @ a."""
    for dtype in DTYPES:
        for m, n, k in op_shapes():
            for method in methods_for(m) + (("sequential",) if m % world() else ()):
                what = f"gemm_ar backward {dtype} m={m} n={n} k={k} {method}"
                seed = 5 * m + n + k + len(method)
                a = rand((m, k), seed).to(dtype).requires_grad_()
                b = rand((n, k), seed + 1, (k * world()) ** -0.5).to(dtype).requires_grad_()
                d = tdist.gemm_ar(a, b, method=method)
                dd = rand((m, n), seed + 2, same=True)
                poison(((m, k), dtype), ((n, k), dtype))
                (d.float() * dd).sum().backward()
                check(a.grad, dd.double() @ b.detach().double(), OP_TOL, what + " da")
                check(b.grad, dd.double().T @ a.detach().double(), OP_TOL, what + " db")


def test_fused_backward_style():
    """The ops' backward as the forward's overlapped ops (TDIST_TP_BACKWARD=fused), beside the default
    (cuBLAS GEMMs with the collective on a side stream), which the tests above ran."""
    before = os.environ.get("TDIST_TP_BACKWARD")
    os.environ["TDIST_TP_BACKWARD"] = "fused"
    try:
        test_ag_gemm_backward()
        test_gemm_rs_backward()
        test_gemm_ar_backward()
    finally:
        if before is None:
            del os.environ["TDIST_TP_BACKWARD"]
        else:
            os.environ["TDIST_TP_BACKWARD"] = before


def test_backward_of_views():
    """Gradients arriving as non-contiguous views (a transposed use of the output) are made dense."""
    dtype = torch.bfloat16
    m, n, k = 6 * world(), 48, 64
    begin, rows = chunk(m)
    a = rand((rows, k), 700).to(dtype).requires_grad_()
    b = rand((n, k), 701, k ** -0.5).to(dtype).requires_grad_()
    dd = rand((n, m), 702)
    (tdist.ag_gemm(a, b).t().float() * dd).sum().backward()  # d's gradient is dd.T: a transposed view
    full = sum_fp64(dd.double().T @ b.detach().double())
    check(a.grad, full[begin:begin + rows], OP_TOL, "ag_gemm backward of a transposed use")
    check(b.grad, dd.double() @ gather_rows_fp64(a.detach(), m), OP_TOL, "ag_gemm db of a transposed use")


# --- models -------------------------------------------------------------------------------------------

class MLP(torch.nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden, inter, bias=False):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=bias)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=bias)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TwoLayer(torch.nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


MLP_PLAN = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
SP_PLAN = {"fc1": "colwise", "fc2": "rowwise"}
REPLICATED_PLAN = {"fc1": "colwise_replicated", "fc2": "rowwise_replicated"}


def rank0_model(cls, *args, dtype=torch.bfloat16, seed=0, **kw):
    """A model on this GPU whose weights are rank 0's on every rank."""
    torch.manual_seed(seed)
    model = cls(*args, **kw).to(device="cuda", dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    return model


def same_rand(shape, seed, scale=1.0):
    """The same values on every rank (rank 0's)."""
    return rand(shape, seed, scale, same=True)


def expected_shard(tp_model, name, full):
    """This rank's part of the unconverted model's tensor `full` for the parameter `name`."""
    owner = tp_model.get_submodule(name.rpartition(".")[0])
    r = rank()
    if isinstance(owner, tdist.nn.ColumnParallelLinear):
        n = owner.local_out_features
        return full[r * n:(r + 1) * n]
    if isinstance(owner, tdist.nn.RowParallelLinear) and name.endswith("weight"):
        k = owner.local_in_features
        return full[:, r * k:(r + 1) * k]
    return full


def run_sp(tp, ref, m, hidden, seed, dtype=torch.bfloat16, tol=MODEL_TOL, what="", run=None):
    """Sequence-parallel forward + backward of tp on this rank's rows against ref (float64) on all
    rows: outputs, input gradients, every parameter's gradient (this rank's shard)."""
    begin, rows = chunk(m)
    x_full = same_rand((m, hidden), seed)
    dy_full = same_rand((m, hidden), seed + 1)
    x_ref = x_full.to(dtype).double().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * dy_full.double()).sum().backward()
    x = x_full[begin:begin + rows].to(dtype).requires_grad_()
    for p in tp.parameters():
        p.grad = None
    poison(*[(tuple(p.shape), p.dtype) for p in tp.parameters()], ((rows, hidden), dtype))
    y = (tp if run is None else run)(x)
    (y.float() * dy_full[begin:begin + rows]).sum().backward()
    check(y, y_ref.detach()[begin:begin + rows], tol, what + " output")
    check(x.grad, x_ref.grad[begin:begin + rows], tol, what + " input gradient")
    ref_params = dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        check(p.grad, expected_shard(tp, name, ref_params[name].grad), tol, f"{what} {name} gradient")
    return y


def test_mlp_matches_unconverted():
    hidden, inter = 264, 88 * world()
    m = 61 * 2 * world()
    for save in (False, True):
        model = rank0_model(MLP, hidden, inter, seed=11)
        ref = copy.deepcopy(model).double()
        tp = tdist.nn.parallelize(model, MLP_PLAN, save_gathered=save)
        assert isinstance(tp.gate_proj, tdist.nn.ColumnParallelLinear) and tp.gate_proj.weight.shape == (88, hidden)
        assert isinstance(tp.down_proj, tdist.nn.RowParallelLinear) and tp.down_proj.weight.shape == (hidden, 88)
        run_sp(tp, ref, m, hidden, 20 + save, what=f"MLP save_gathered={save}")
    # a 3-D input (tokens, batch, hidden), sequence first
    model = rank0_model(MLP, hidden, inter, seed=12)
    ref = copy.deepcopy(model).double()
    tp = tdist.nn.parallelize(model, MLP_PLAN)
    t, bsz = 10 * world(), 3
    begin, rows = chunk(t)
    x = same_rand((t, bsz, hidden), 30)
    with torch.no_grad():
        y = tp(x[begin:begin + rows].to(torch.bfloat16))
        y_ref = ref(x.to(torch.bfloat16).double())
    check(y, y_ref[begin:begin + rows], MODEL_TOL, "MLP on (tokens, batch, hidden)")


def sgd_step_check(plan, sequence_parallel, seed):
    hidden, ffn, m = 136, 48 * world(), 40 * world() + 8
    model = rank0_model(TwoLayer, hidden, ffn, seed=seed)
    ref = copy.deepcopy(model).double()
    w0 = {name: p.detach().clone() for name, p in model.named_parameters()}
    tp = tdist.nn.parallelize(model, plan)
    begin, rows = chunk(m)
    x_full = same_rand((m, hidden), seed + 1)
    target = same_rand((m, hidden), seed + 2)
    # reference: one SGD step of the unconverted model on every row (float64)
    x_ref = x_full.to(torch.bfloat16).double().requires_grad_()
    loss_ref = ((ref(x_ref) - target.double()) ** 2).sum() / (m * hidden)
    loss_ref.backward()
    # a learning rate per parameter that moves it by a third of its largest value: the step must show
    # the gradient above the bf16 rounding of the updated weights
    lrs = {name: (0.3 * p.detach().abs().max() / p.grad.abs().max().clamp_min(1e-30)).item()
           for name, p in ref.named_parameters()}
    ref_opt = torch.optim.SGD([{"params": [p], "lr": lrs[name]} for name, p in ref.named_parameters()], lr=1.0)
    ref_opt.step()
    # tensor-parallel step
    opt = torch.optim.SGD([{"params": [p], "lr": lrs[name]} for name, p in tp.named_parameters()], lr=1.0)
    if sequence_parallel:
        x = x_full[begin:begin + rows].to(torch.bfloat16).requires_grad_()
        local = ((tp(x).float() - target[begin:begin + rows]) ** 2).sum() / (m * hidden)
        loss = sum_fp64(local.detach())  # each rank's rows add up to the loss
        local.backward()
        check(x.grad, x_ref.grad[begin:begin + rows], MODEL_TOL, f"{plan} input gradient")
    else:
        x = x_full.to(torch.bfloat16).requires_grad_()
        local = ((tp(x).float() - target) ** 2).sum() / (m * hidden)
        loss = local.detach().double()  # every rank computes the whole loss
        local.backward()
        check(x.grad, x_ref.grad, MODEL_TOL, f"{plan} input gradient")
    check(loss, loss_ref.detach(), MODEL_TOL, f"{plan} loss")
    opt.step()
    ref_params = dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        want = expected_shard(tp, name, ref_params[name].detach())
        start = expected_shard(tp, name, w0[name]).double()
        check(p.detach(), want, MODEL_TOL, f"{plan} updated {name}")
        # the step itself: within 3% of the reference step plus the bf16 rounding of the result
        step, want_step = p.detach().double() - start, want - start
        err = (step - want_step).abs().max().item()
        allowed = 3e-2 * want_step.abs().max().item() + 2 ** -8 * want.abs().max().item()
        assert err <= allowed, f"{plan} step of {name}: max |diff| {err:.3e} > {allowed:.3e}"


def test_training_step_matches_single_gpu():
    sgd_step_check(SP_PLAN, True, 40)
    sgd_step_check(REPLICATED_PLAN, False, 50)


def test_torch_compile_forward_backward():
    hidden, inter, m = 264, 88 * world(), 30 * world()
    torch._dynamo.reset()
    for save in (False, True):
        model = rank0_model(MLP, hidden, inter, seed=60)
        ref = copy.deepcopy(model).double()
        tp = tdist.nn.parallelize(model, MLP_PLAN, save_gathered=save)
        compiled = torch.compile(tp, fullgraph=True)
        run_sp(tp, ref, m, hidden, 61 + save, what=f"compiled MLP save_gathered={save}", run=compiled)
    # biases: the column slice and the sequence-parallel bias (an autograd.Function) under compile
    model = rank0_model(TwoLayer, 136, 48 * world(), seed=62)
    ref = copy.deepcopy(model).double()
    tp = tdist.nn.parallelize(model, SP_PLAN)
    run_sp(tp, ref, 24 * world(), 136, 63, what="compiled two-layer", run=torch.compile(tp, fullgraph=True))


def test_activation_checkpointing():
    hidden, inter, m = 264, 88 * world(), 50 * world()
    for save in (False, True):
        model = rank0_model(MLP, hidden, inter, seed=70)
        ref = copy.deepcopy(model).double()
        tp = tdist.nn.parallelize(model, MLP_PLAN, save_gathered=save)
        run_sp(tp, ref, m, hidden, 71, what=f"checkpointed MLP save_gathered={save}",
               run=lambda x: checkpoint(tp, x, use_reentrant=False))


def test_cuda_graph_forward():
    hidden, inter, m = 264, 88 * world(), 40 * world()
    begin, rows = chunk(m)
    model = rank0_model(MLP, hidden, inter, seed=80)
    ref = copy.deepcopy(model).double()
    tp = tdist.nn.parallelize(model, MLP_PLAN)
    two = rank0_model(TwoLayer, hidden, inter, seed=81)
    two_ref = copy.deepcopy(two).double()
    two_tp = tdist.nn.parallelize(two, SP_PLAN)
    x = torch.zeros((rows, hidden), device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside the capture: the ops' contexts for these shapes
            tp(x)
            two_tp(x)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = tp(x)
            y2 = two_tp(y)
        for replay in range(3):
            x_full = same_rand((m, hidden), 90 + replay)
            x.copy_(x_full[begin:begin + rows])
            y.fill_(float("nan"))
            y2.fill_(float("nan"))
            graph.replay()
            want = ref(x_full.to(torch.bfloat16).double())
            check(y, want[begin:begin + rows], MODEL_TOL, f"graph MLP replay {replay}")
            want2 = two_ref(gather_rows_fp64(y, m).to(torch.bfloat16).double())
            check(y2, want2[begin:begin + rows], MODEL_TOL, f"graph two-layer replay {replay}")
    torch.cuda.synchronize()
    del graph


def test_cuda_graph_forward_backward():
    """A training step's forward and backward captured in one CUDA graph (the backward's side stream
    forks and joins inside the capture), replayed on new inputs and output gradients."""
    hidden, inter, m = 264, 88 * world(), 48 * world()
    begin, rows = chunk(m)
    for save in (False, True):
        model = rank0_model(MLP, hidden, inter, seed=85)
        ref = copy.deepcopy(model).double()
        tp = tdist.nn.parallelize(model, MLP_PLAN, save_gathered=save)
        x = torch.zeros((rows, hidden), device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.zeros((rows, hidden), device="cuda", dtype=torch.float32)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside the capture
            for _ in range(2):
                (tp(x).float() * dy).sum().backward()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        x.grad = None
        for p in tp.parameters():
            p.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = tp(x)
            (y.float() * dy).sum().backward()
        what = f"graph MLP forward + backward save_gathered={save}"
        for replay in range(3):
            x_full = same_rand((m, hidden), 95 + replay)
            dy_full = same_rand((m, hidden), 97 + replay)
            with torch.no_grad():
                x.copy_(x_full[begin:begin + rows])
            dy.copy_(dy_full[begin:begin + rows])
            with torch.no_grad():
                for t in [y, x.grad] + [p.grad for p in tp.parameters()]:
                    t.fill_(float("nan"))
            graph.replay()
            x_ref = x_full.to(torch.bfloat16).double().requires_grad_()
            ref.zero_grad(set_to_none=True)
            y_ref = ref(x_ref)
            (y_ref * dy_full.double()).sum().backward()
            check(y, y_ref.detach()[begin:begin + rows], MODEL_TOL, f"{what} replay {replay} output")
            check(x.grad, x_ref.grad[begin:begin + rows], MODEL_TOL, f"{what} replay {replay} input gradient")
            ref_params = dict(ref.named_parameters())
            for name, p in tp.named_parameters():
                check(p.grad, expected_shard(tp, name, ref_params[name].grad), MODEL_TOL,
                      f"{what} replay {replay} {name} gradient")
        torch.cuda.synchronize()
        del graph


def test_fallback_shapes_and_unequal_rows():
    """float32, and features the overlapped GEMMs refuse (not multiples of 8), run the same math
    through torch matmuls and tdist's collectives; unequal row counts through m=."""
    w = world()
    # float32 (any shape) and bf16 with out_features / world = 5 and in_features 36
    for dtype, hidden, inter in ((torch.float32, 264, 88 * w), (torch.bfloat16, 36, 5 * w)):
        # bf16: the bias gradients sum a few rows of bf16-rounded activation gradients that partly
        # cancel, so their error against the largest entry runs above the model tolerance
        tol = 1e-4 if dtype == torch.float32 else 2 * MODEL_TOL
        model = rank0_model(MLP, hidden, inter, dtype=dtype, seed=100, bias=True)
        ref = copy.deepcopy(model).double()
        tp = tdist.nn.parallelize(model, MLP_PLAN)
        run_sp(tp, ref, 13 * w, hidden, 101, dtype=dtype, tol=tol, what=f"fallback MLP {dtype} hidden={hidden}")
    # unequal rows (M not divisible by the world size): ColumnParallelLinear takes m=, fused and fallback
    for dtype, hidden, inter in ((torch.bfloat16, 264, 88 * w), (torch.float32, 36, 5 * w)):
        tol = 1e-4 if dtype == torch.float32 else MODEL_TOL
        m = 7 * w + 1
        begin, rows = chunk(m)
        model = rank0_model(TwoLayer, hidden, inter, dtype=dtype, seed=110)
        ref = copy.deepcopy(model).double()
        col = tdist.nn.ColumnParallelLinear.from_linear(model.fc1)
        row = tdist.nn.RowParallelLinear.from_linear(model.fc2)

        class Pair(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1, self.fc2 = col, row

            def forward(self, x):
                return self.fc2(F.gelu(self.fc1(x, m=m)))

        run_sp(Pair(), ref, m, hidden, 111, dtype=dtype, tol=tol, what=f"unequal rows m={m} {dtype}")


def test_layer_errors():
    w = world()
    if w > 1:  # any size divides over one rank
        expect_error(lambda: tdist.nn.ColumnParallelLinear(64, 8 * w + 1), "ColumnParallelLinear",
                     f"out_features={8 * w + 1}", f"divisible by the world size {w}")
        expect_error(lambda: tdist.nn.RowParallelLinear(8 * w + 1, 64), "RowParallelLinear", f"in_features={8 * w + 1}")
    expect_error(lambda: tdist.nn.RowParallelLinear(0, 64), "in_features must be a positive int")
    model = rank0_model(MLP, 64, 16 * w, seed=120)
    expect_error(lambda: tdist.nn.parallelize(model, {"gate": "colwise"}), "'gate'", "matches no module")
    expect_error(lambda: tdist.nn.parallelize(model, {"down_proj": "sideways"}), "'sideways'", '"rowwise"')
    expect_error(lambda: tdist.nn.parallelize(torch.nn.Sequential(MLP(64, 16 * w), torch.nn.ReLU()),
                                              {"1": "colwise"}), "layer '1'", "is a ReLU", "torch.nn.Linear")
    if w > 1:
        odd = rank0_model(MLP, 64, 16 * w + 1, seed=121)
        expect_error(lambda: tdist.nn.parallelize(odd, {"up_proj": "colwise"}), "layer 'up_proj'",
                     f"out_features={16 * w + 1}", f"divisible by {w}")
    tp = tdist.nn.parallelize(model, MLP_PLAN)
    expect_error(lambda: tp.gate_proj(torch.zeros(4, 63, device="cuda", dtype=torch.bfloat16)),
                 "ColumnParallelLinear", "(4, 63)", "expected (rows, ..., 64)")
    if w > 1:  # the whole input width is this rank's shard at one rank
        expect_error(lambda: tp.down_proj(torch.zeros(4, 16 * w, device="cuda", dtype=torch.bfloat16)),
                     "RowParallelLinear", "16 of")
    expect_error(lambda: tdist.nn.set_save_gathered("yes"), "expected a bool")
    expect_error(lambda: tdist.nn.ColumnParallelLinear(64, 16 * w, method="fastest"), "method must be one of",
                 cls=tdist.Error)
    # every rank refuses (a rank that went on would wait in the collective): rows that disagree with m
    x = torch.zeros(5, 64, device="cuda", dtype=torch.bfloat16)
    expect_error(lambda: tp.gate_proj(x, m=6 * w), "'a_local' has 5 rows", cls=tdist.Error)


TESTS = [test_ag_gemm_backward, test_gemm_rs_backward, test_gemm_ar_backward, test_fused_backward_style,
         test_backward_of_views,
         test_mlp_matches_unconverted, test_training_step_matches_single_gpu, test_torch_compile_forward_backward,
         test_activation_checkpointing, test_cuda_graph_forward, test_cuda_graph_forward_backward,
         test_fallback_shapes_and_unequal_rows,
         test_layer_errors]


# pytest: one init for the module
_tdist_session = pytest_session()


def main():
    return run_tests(TESTS)


if __name__ == "__main__":
    sys.exit(main())
