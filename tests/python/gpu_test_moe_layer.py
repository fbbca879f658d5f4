"""GPU tests of tdist.nn.ParallelMoE (python/tdist/nn/sparse_moe.py, docs/nn.md "ParallelMoE") under
torchrun, at any world size (1 included; two ranks may share one GPU with TDIST_SHARE_GPUS=1):

    python -m torch.distributed.run --nproc-per-node 2 tests/python/gpu_test_moe_layer.py
    python -m torch.distributed.run --nproc-per-node 1 tests/python/gpu_test_moe_layer.py
    TDIST_SHARE_GPUS=1 python -m torch.distributed.run --nproc-per-node 2 tests/python/gpu_test_moe_layer.py

Every rank draws the same full (unsharded) weights, tokens and output gradient (seeded alike) and
builds the module from the full weights (ParallelMoE.from_weights: this rank's shards). The reference
is float64 autograd of the unsharded block on every token (router, softmax, top-k, renormalisation,
every expert's SwiGLU written out per expert), on one GPU; each rank compares its rows of the output
and of the input gradient, the router weight's gradient (whole, summed over ranks), and its shards
of the experts' weight gradients. Checked:

* the output, the input gradient and every parameter gradient: bf16 and fp16; hidden and expert
  intermediate (per rank) odd multiples of 8; M not divisible by the world size, M = 1 (a rank with
  no token at W = 2), a 3-D input; experts without tokens (their weight gradients exactly 0);
  norm_topk_prob on and off; methods auto, fused, chunked, baseline; the router gradient the same bits on
  every rank; no expert id out of range (tdist.moe.check_errors);
* one SGD step: the step of every parameter against -lr x the reference gradient, the router still
  the same bits on every rank, and a second forward against the float64 block on the updated weights
  (the full experts gathered from every rank's shards);
* ParallelMoE.from_module of transformers' Qwen3MoeSparseMoeBlock (where transformers is installed)
  against that block's own forward;
* argument errors raised alike on every rank before any collective;
* FP8 serving (quantize_fp8): the output against float64 of the block with the same quantisation
  (fp8_reference), every method, bf16 and fp16 modules, one token.

The routing is made unambiguous, so that bf16 rounding cannot flip a token's experts between the
module and the reference: the router weight's row e is the unit vector of feature e, so a token's
logits are its first E features, exactly; those are drawn with the chosen experts' logits in
[1.5, 2.5) and the others' in [-1, 0.5) (a margin of 1). Experts E - empty .. E - 1 are never chosen.
The allocator's free blocks are filled with NaN before each forward and backward. Tolerance: 4e-2 x
max |reference| (bf16 / fp16 intermediates between the GEMMs, as gpu_test_moe_grad.py's layer).
Ends with "N passed, M failed"; a failed check names the case and the tensor.
"""

import sys

import gpu_harness as h
from gpu_harness import check_close, rank, world
from gpu_test_moe import dequant_blocks, dequant_rows, poison_allocator
from gpu_test_moe_grad import Checks

import tdist
import tdist.nn

import torch
import torch.distributed as dist
import torch.nn.functional as F

moe = tdist.moe
TOL = 4e-2
STEP_TOL = 6e-2  # the step's bf16 rounding (2^-9 of the largest weight, 1/128 of the largest step) on top

CASES = [  # (name, m, experts, top_k, hidden, intermediate per rank, empty experts, norm_topk_prob, dtype, method)
    ("odd", 301, 12, 3, 200, 72, 3, True, torch.bfloat16, "auto"),
    ("one_token", 1, 8, 2, 136, 40, 2, False, torch.bfloat16, "auto"),
    ("fp16", 517, 6, 4, 72, 104, 1, True, torch.float16, "auto"),
    ("chunked", 402, 10, 2, 136, 72, 4, False, torch.bfloat16, "chunked"),
    ("fused", 389, 10, 2, 136, 72, 3, True, torch.bfloat16, "fused"),
    ("baseline", 263, 9, 3, 200, 40, 2, True, torch.bfloat16, "baseline"),
]


def full_inputs(m, experts, top_k, hidden, inter, empty, dtype, seed):
    """(x_all (m, H), router (E, H), gate_up (E, 2 I, H), down (E, H, I), grad (m, H)): the same on every
    rank, in ``dtype``, on this rank's GPU. Token t's logits are x[t, :E] (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((m, hidden), generator=g)
    logits = torch.rand((m, experts), generator=g) * 1.5 - 1.0                    # [-1, 0.5)
    chosen = torch.rand((m, experts - empty), generator=g).argsort(dim=1)[:, :top_k]
    logits.scatter_(1, chosen, 1.5 + torch.rand((m, top_k), generator=g))        # [1.5, 2.5)
    x[:, :experts] = logits
    router = torch.zeros((experts, hidden))
    router[torch.arange(experts), torch.arange(experts)] = 1.0
    gate_up = torch.randn((experts, 2 * inter, hidden), generator=g) * hidden ** -0.5
    down = torch.randn((experts, hidden, inter), generator=g) * inter ** -0.5
    grad = torch.randn((m, hidden), generator=g)
    return [t.to(dtype).cuda() for t in (x, router, gate_up, down, grad)]


def block_reference(x, router, gate_up, down, top_k, norm, margin_check=True, x_experts=None, h_map=None):
    """float64 output (m, H) of the unsharded block, differentiable in every argument (float64 leaves
    the caller made). Raises when a token's k-th and (k+1)-th logits are closer than 0.05 (the test's
    routing would then be ambiguous in bf16). ``x_experts``: the tokens the experts read (default x,
    which the router reads); ``h_map``: applied to each expert's SwiGLU output (m_e, I)."""
    logits = x @ router.T
    if margin_check and logits.shape[1] > top_k and logits.shape[0]:
        top = logits.detach().topk(top_k + 1, dim=1).values
        gap = float((top[:, top_k - 1] - top[:, top_k]).min())
        assert gap > 0.05, f"test setup: routing margin {gap:.3g} too small for bf16 logits"
    probs = torch.softmax(logits, dim=1)
    weights, ids = probs.topk(top_k, dim=1)
    if norm:
        weights = weights / weights.sum(dim=1, keepdim=True)
    inter = down.shape[2]
    x_experts = x if x_experts is None else x_experts
    y = torch.zeros_like(x)
    for e in range(router.shape[0]):
        t, j = (ids == e).nonzero(as_tuple=True)
        if t.numel():
            a = x_experts[t] @ gate_up[e].T
            hidden = F.silu(a[:, :inter]) * a[:, inter:]
            if h_map is not None:
                hidden = h_map(hidden)
            y = y.index_add(0, t, weights[t, j].unsqueeze(1) * (hidden @ down[e].T))
    return y


def reference_grads(x, router, gate_up, down, grad, top_k, norm):
    """(y, dx, drouter, dgate_up, ddown), float64 on the GPU, of <grad, block(x)>."""
    leaves = [t.double().requires_grad_() for t in (x, router, gate_up, down)]
    y = block_reference(*leaves, top_k, norm)
    (y * grad.double()).sum().backward()
    return [y.detach()] + [t.grad for t in leaves]


def shard_w13(full, inter_local, r):
    """Rank r's w13 of a full (E, 2 I, H) gate/up tensor: its gate rows, then its up rows."""
    inter = full.shape[1] // 2
    return torch.cat([full[:, r * inter_local:(r + 1) * inter_local],
                      full[:, inter + r * inter_local:inter + (r + 1) * inter_local]], dim=1)


def shard_w2(full, inter_local, r):
    return full[:, :, r * inter_local:(r + 1) * inter_local]


def expect(ok, message):
    assert ok, message


def no_moe_errors(what):
    """tdist.moe.check_errors() as a check: an expert id out of range fails it (as an AssertionError,
    so that Checks records it and every rank goes on to the same collectives)."""
    try:
        moe.check_errors()
    except tdist.Error as e:
        raise AssertionError(f"{what}: {e}") from None


def same_on_every_rank(t):
    """t equals rank 0's t bit for bit."""
    r0 = t.detach().clone()
    dist.broadcast(r0, 0)
    return bool(torch.equal(r0, t.detach()))


def local_rows(x_all, m):
    first, rows = moe.rows_of(m, world(), rank())
    return first, rows, x_all[first:first + rows]


def run_case(check, name, m, experts, top_k, hidden, f, empty, norm, dtype, method, seed, shape3d=False):
    W, me = world(), rank()
    inter = f * W
    what = f"[{name}] m={m} E={experts} k={top_k} H={hidden} F={f} x{W} {dtype} norm={norm} method={method}"
    x_all, router, gate_up, down, grad = full_inputs(m, experts, top_k, hidden, inter, empty, dtype, seed)
    mod = tdist.nn.ParallelMoE.from_weights(router, gate_up, down, top_k, norm_topk_prob=norm, method=method)
    first, rows, x_rows = local_rows(x_all, m)
    x = x_rows.clone()
    if shape3d:  # (tokens, 2, H): the module's rows are tokens x 2
        x = x.view(rows // 2, 2, hidden)
    x.requires_grad_()
    poison_allocator()
    y = mod(x, m=None if shape3d else m)
    check(expect, y.shape == x.shape, f"{what} output: shape {tuple(y.shape)}, expected {tuple(x.shape)}")
    poison_allocator()
    y.backward(grad[first:first + rows].view(y.shape))
    torch.cuda.synchronize()
    check(no_moe_errors, what)
    ref_y, ref_dx, ref_router, ref_gate_up, ref_down = reference_grads(x_all, router, gate_up, down, grad, top_k, norm)
    check(check_close, y.reshape(rows, hidden), ref_y[first:first + rows].cpu(), what + " output", TOL)
    check(check_close, x.grad.reshape(rows, hidden), ref_dx[first:first + rows].cpu(), what + " input gradient", TOL)
    check(check_close, mod.router_weight.grad, ref_router.cpu(), what + " router_weight gradient", TOL)
    check(check_close, mod.w13.grad, shard_w13(ref_gate_up, f, me).cpu(), what + " w13 gradient", TOL)
    check(check_close, mod.w2.grad, shard_w2(ref_down, f, me).cpu(), what + " w2 gradient", TOL)
    if empty:
        for p in ("w13", "w2"):
            check(expect, bool((getattr(mod, p).grad[experts - empty:] == 0).all()),
                  f"{what} {p} gradient of the experts without tokens is not 0")
    check(expect, same_on_every_rank(mod.router_weight.grad), f"{what} router_weight gradient differs between ranks")
    return mod, (x_all, router, gate_up, down, grad), (ref_router, ref_gate_up, ref_down)


FP8_TOL = 6e-2  # bf16 rounding of h13 and h moves some e4m3 roundings of h by one step (2^-3 relative)
FP8_CASES = [  # as CASES; hidden and intermediate per rank multiples of 16
    ("fp8", 301, 12, 3, 208, 80, 3, True, torch.bfloat16, "auto"),
    ("fp8_fused", 389, 10, 2, 144, 48, 2, False, torch.bfloat16, "fused"),
    ("fp8_fp16_chunked", 263, 9, 3, 144, 144, 1, True, torch.float16, "chunked"),
    ("fp8_baseline_one_token", 1, 8, 2, 128, 16, 2, True, torch.bfloat16, "baseline"),
]


def fp8_reference(x_all, router, gate_up, down, top_k, norm, f):
    """float64 output (m, H) of the block as the FP8 module computes it: the experts' values are every
    rank's shards quantised by quantize_fp8_blocks (dequantised back into the full weights), the
    experts read the tokens quantised by quantize_fp8_rows, and each expert's SwiGLU output is quantised
    per row over each rank's F columns (what that rank's second projection reads)."""
    W, inter = world(), f * world()
    gu, dn = gate_up.double().clone(), down.double().clone()
    for r in range(W):
        w13 = dequant_blocks(*moe.quantize_fp8_blocks(shard_w13(gate_up, f, r))).to(gu.device)
        gu[:, r * f:(r + 1) * f], gu[:, inter + r * f:inter + (r + 1) * f] = w13[:, :f], w13[:, f:]
        dn[:, :, r * f:(r + 1) * f] = dequant_blocks(*moe.quantize_fp8_blocks(shard_w2(down, f, r).contiguous()))

    def h_map(h):
        return torch.cat([dequant_rows(*moe.quantize_fp8_rows(h[:, r * f:(r + 1) * f])) for r in range(W)],
                         dim=1).to(h.device)

    x_q = dequant_rows(*moe.quantize_fp8_rows(x_all)).to(x_all.device)
    return block_reference(x_all.double(), router.double(), gu, dn, top_k, norm, x_experts=x_q, h_map=h_map)


def test_fp8_serving():
    """ParallelMoE.quantize_fp8: the output against fp8_reference, the module's dtype out, every method,
    grad mode on with an input that needs none."""
    check = Checks()
    for i, (name, m, experts, top_k, hidden, f, empty, norm, dtype, method) in enumerate(FP8_CASES):
        W = world()
        what = f"[{name}] m={m} E={experts} k={top_k} H={hidden} F={f} x{W} {dtype} norm={norm} method={method}"
        x_all, router, gate_up, down, _ = full_inputs(m, experts, top_k, hidden, f * W, empty, dtype, 400 + i)
        mod = tdist.nn.ParallelMoE.from_weights(router, gate_up, down, top_k, norm_topk_prob=norm, method=method)
        mod.quantize_fp8()
        first, rows, x_rows = local_rows(x_all, m)
        poison_allocator()
        y = mod(x_rows.clone(), m=m)
        torch.cuda.synchronize()
        check(no_moe_errors, what)
        check(expect, y.dtype == dtype and y.shape == x_rows.shape and not y.requires_grad,
              f"{what}: output {y.dtype} {tuple(y.shape)} requires_grad={y.requires_grad}")
        with torch.no_grad():
            ref = fp8_reference(x_all, router, gate_up, down, top_k, norm, f)
        check(check_close, y, ref[first:first + rows].cpu(), what + " output", FP8_TOL)
    check.raise_failed()


def test_forward_backward_against_float64():
    check = Checks()
    for i, (name, m, experts, top_k, hidden, f, empty, norm, dtype, method) in enumerate(CASES):
        run_case(check, name, m, experts, top_k, hidden, f, empty, norm, dtype, method, 100 + i)
    check.raise_failed()


def test_3d_input():
    check = Checks()
    W = world()
    run_case(check, "3-D", 2 * 37 * W, 8, 2, 136, 72, 1, True, torch.bfloat16, "auto", 200, shape3d=True)
    check.raise_failed()


def test_one_sgd_step():
    W, me = world(), rank()
    check = Checks()
    m, experts, top_k, hidden, f = 301, 12, 3, 200, 72
    what = f"[sgd] m={m} x{W}"
    mod, inputs, refs = run_case(check, "sgd", m, experts, top_k, hidden, f, 3, True, torch.bfloat16, "auto", 300)
    x_all, router, gate_up, down, grad = inputs
    full = {"router_weight": router, "w13": gate_up, "w2": down}
    shards = {"router_weight": lambda t: t, "w13": lambda t: shard_w13(t, f, me), "w2": lambda t: shard_w2(t, f, me)}
    ref_grad = dict(zip(("router_weight", "w13", "w2"), refs))
    # One learning rate per parameter, the same on every rank (from the full tensors): the experts'
    # largest step a quarter of their largest weight, well above bf16's rounding of the weight; the
    # router's largest step 0.01, so that the logits move by a few hundredths (the routing's margin
    # is 1: the second forward routes as the reference does).
    groups, lrs = [], {}
    for n, p in mod.named_parameters():
        share = 0.01 if n == "router_weight" else 0.25
        lrs[n] = share * float(full[n].abs().max()) / max(float(ref_grad[n].abs().max()), 1e-30)
        groups.append({"params": [p], "lr": lrs[n]})
    before = {n: p.detach().double().clone() for n, p in mod.named_parameters()}
    torch.optim.SGD(groups, lr=1.0).step()
    for n, p in mod.named_parameters():
        step, want = p.detach().double() - before[n], -lrs[n] * shards[n](ref_grad[n])
        if n == "router_weight":  # its zero entries only: bf16's rounding of 1 + step hides a step of 0.01
            zero = before[n] == 0
            step, want = step[zero], want[zero]
        check(check_close, step, want.cpu(), f"{what} step of {n}", STEP_TOL)
    check(expect, same_on_every_rank(mod.router_weight), f"{what} router_weight differs between ranks after the step")
    # The block on the updated weights: the full experts gathered from every rank's shards.
    w13_all = [torch.empty_like(mod.w13) for _ in range(W)]
    w2_all = [torch.empty_like(mod.w2) for _ in range(W)]
    dist.all_gather(w13_all, mod.w13.detach().contiguous())
    dist.all_gather(w2_all, mod.w2.detach().contiguous())
    new_gate_up = torch.cat([t[:, :f] for t in w13_all] + [t[:, f:] for t in w13_all], dim=1)
    new_down = torch.cat(w2_all, dim=2)
    first, rows, x_rows = local_rows(x_all, m)
    poison_allocator()
    with torch.no_grad():
        y = mod(x_rows, m=m)
    ref = block_reference(x_all.double(), mod.router_weight.detach().double(), new_gate_up.double(),
                          new_down.double(), top_k, True)
    check(check_close, y, ref[first:first + rows].cpu(), f"{what} output after the step", TOL)
    check.raise_failed()


def test_from_transformers_block():
    try:
        from transformers.models.qwen3_moe import modeling_qwen3_moe as hf
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    except ImportError as e:
        print(f"[rank {rank()}] test_from_transformers_block: transformers' Qwen3-MoE not importable ({e}); "
              "nothing checked", flush=True)
        return
    W = world()
    check = Checks()
    m, experts, top_k, hidden, f = 211, 8, 2, 136, 40
    inter = f * W
    for norm in (True, False):
        what = f"[transformers] norm_topk_prob={norm} x{W}"
        config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                                num_experts_per_tok=top_k, norm_topk_prob=norm, hidden_act="silu",
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                intermediate_size=128, vocab_size=32)
        x_all, router, gate_up, down, _ = full_inputs(m, experts, top_k, hidden, inter, 2, torch.bfloat16, 400)
        block = hf.Qwen3MoeSparseMoeBlock(config).to(device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            block.gate.weight.copy_(router)
            if hasattr(block.experts, "gate_up_proj"):  # transformers 5: fused experts
                block.experts.gate_up_proj.copy_(gate_up)
                block.experts.down_proj.copy_(down)
            else:  # transformers 4: a list of MLPs
                for e, mlp in enumerate(block.experts):
                    mlp.gate_proj.weight.copy_(gate_up[e, :inter])
                    mlp.up_proj.weight.copy_(gate_up[e, inter:])
                    mlp.down_proj.weight.copy_(down[e])
            want = block(x_all.view(1, m, hidden))
            want = (want[0] if isinstance(want, tuple) else want).view(m, hidden)
        mod = tdist.nn.ParallelMoE.from_module(block)
        first, rows, x_rows = local_rows(x_all, m)
        poison_allocator()
        with torch.no_grad():
            y = mod(x_rows, m=m)
        check(check_close, y, want[first:first + rows].double().cpu(), what + " output against the block's", TOL)
    check.raise_failed()


def test_argument_errors():
    """Raised on every rank alike, before any collective (the next test's collectives still meet)."""
    W = world()
    x_all, router, gate_up, down, _ = full_inputs(40, 6, 2, 72, 8 * W, 0, torch.bfloat16, 500)
    mod = tdist.nn.ParallelMoE.from_weights(router, gate_up, down, 2)
    _, _, x_rows = local_rows(x_all, 40)
    cases = [
        (lambda: mod(x_rows, m=41 + W), "this rank's share of m="),
        (lambda: mod(x_rows.half(), m=40), "input has dtype torch.float16"),
        (lambda: mod(x_rows[:, :64], m=40), "expected (rows, ..., 72)"),
        (lambda: tdist.nn.ParallelMoE(72, 8 * W + 4, 6, 2), f"intermediate_size={8 * W + 4}"),
        (lambda: tdist.nn.ParallelMoE(72, 8 * W, 6, 7), "top_k=7 must be at most num_experts=6"),
        (lambda: tdist.nn.ParallelMoE(72, 8 * W, 6, 2, dtype=torch.float32), "torch.bfloat16 or torch.float16"),
        (lambda: tdist.nn.ParallelMoE.from_weights(router, gate_up[:, :-8], down, 2), "down_weight has shape"),
    ]
    for fn, words in cases:
        h.expect_error(fn, "tdist.nn.ParallelMoE", words, cls=ValueError)
    # after the errors, a good call on every rank still works
    with torch.no_grad():
        y = mod(x_rows, m=40)
    assert y.shape == x_rows.shape and bool(torch.isfinite(y).all()), "the call after the errors is wrong"


TESTS = [
    test_forward_backward_against_float64,
    test_3d_input,
    test_one_sgd_step,
    test_from_transformers_block,
    test_argument_errors,
    test_fp8_serving,
]

if __name__ == "__main__":
    sys.exit(h.run_tests(TESTS))
