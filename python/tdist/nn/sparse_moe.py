"""A tensor-parallel sparse mixture-of-experts block on tdist's MoE ops (docs/nn.md, "ParallelMoE").

Layout (this rank r of W ranks; M tokens over all ranks, split as RowChunks{M, W}; E experts, top-k;
hidden H; every expert's intermediate I, F = I / W of it on each rank):

  router_weight  (E, H)        replicated: the same on every rank (its gradient is summed over ranks)
  w13            (E, 2 F, H)   every expert's gate rows [r F, (r + 1) F) of its full gate projection,
                               then the same rows of its up projection
  w2             (E, H, F)     every expert's columns [r F, (r + 1) F) of its full down projection

  x (rows(r), H), this rank's tokens -> y (rows(r), H), the same tokens

  logits = x @ router_weight.T; p = softmax(logits) (fp32); ids, weights = top-k of p (renormalised to
  sum 1 when norm_topk_prob); every rank's ids and weights gathered (all of them, [M, k]);
  h13 = moe_ag_group_gemm(x, ids, w13)            AllGather of the tokens + grouped GEMM, expert order
  y = moe_group_gemm_rs(SiLU(gate) * up, w2, ids, weights)   grouped GEMM + top-k sum + ReduceScatter
                                                  (SwiGLU: its backward writes one h13 gradient)

Where the router runs: on this rank's rows, then an AllGather of the top-k ids and weights ([M, k]
each, packed into one fp32 [M, 2k] tensor: ids below 2^24 are exact in fp32). The MoE ops need every
token's ids on every rank, the same bits everywhere; this gives them by construction, and moves
M x k x 8 bytes (1 MiB for Qwen3-30B-A3B at M = 16384). Routing the gathered tokens instead would need
the tokens gathered outside the op (M x H x 2 bytes, 64 MiB there: the op gathers them inside its
GEMM and does not return them) and W times the router's GEMM, with the top-k then computed on W GPUs
that must agree bit for bit.

FP8 serving (quantize_fp8()): w13 and w2 become e4m3 buffers with one f32 scale per 128 x 128 block
(w13_fp8 (E, 2 F, H), w13_scales (E, ceil(2 F / 128), ceil(H / 128)); w2_fp8 (E, H, F), w2_scales
(E, ceil(H / 128), ceil(F / 128))); the forward quantises this rank's tokens and the SwiGLU output per
row and 128 columns (moe.quantize_fp8_rows, moe.swiglu_quantize_fp8: tdist's one-pass kernels) and
runs the FP8 ops, under no_grad. The AllGather then moves e4m3 rows (half the bytes) with their
scales.

Gradients: the top-k weights' gradient that moe_group_gemm_rs returns is already summed over ranks
(complete on every rank, docs/moe.md "Training"), so the gather's backward keeps this rank's rows
(no ReduceScatter). The router weight feeds only this rank's tokens, so its gradient is summed over
ranks in the backward (an AllReduce of E x H) and stays the same on every rank.
"""

from __future__ import annotations

import math
from typing import Optional

from .._tensors import Error, require_torch
from .. import moe as _moe

torch = require_torch("tdist.nn")
from .. import _torch_ops  # noqa: E402,F401  (registers torch.ops.tdist.* and their autograd)
from .. import _autograd as _ag  # noqa: E402
from .modules import _device, _flatten, _rank_world, _unflatten  # noqa: E402

_DTYPES = (torch.bfloat16, torch.float16)
_METHODS = _moe.AG_METHODS  # 'fused': the first projection's; the second then runs chunked
_CLS = "ParallelMoE"


def _fail(message: str):
    raise ValueError(f"tdist.nn.{_CLS}: {message}")


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        _fail(f"{name} must be a positive int, got {v!r}")
    return v


def top_k_routing(x, router_weight, top_k: int, norm_topk_prob: bool):
    """(ids int32 (rows, k), weights fp32 (rows, k)): the top_k experts of each row of x (rows, H) by
    softmax(x @ router_weight.T), the logits in x's dtype (fp32 accumulation), the softmax in fp32;
    the weights renormalised to sum 1 when norm_topk_prob (as Qwen3-MoE's router)."""
    logits = torch.nn.functional.linear(x, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights


class SwiGLU(torch.autograd.Function):
    """SiLU(gate) * up of h13 = [gate | up] (rows, 2 F) -> (rows, F), with a backward that writes the
    gradient of h13 as one tensor: autograd of the plain expression gives each slice of h13 its own
    zero-filled (rows, 2 F) gradient and adds the two, three passes over h13's size more (at
    Qwen3-30B-A3B, 2048 tokens and 128 experts, h13 is 100 MB). Keeps what that autograd keeps:
    h13 and SiLU(gate)."""

    @staticmethod
    def forward(ctx, h13, f: int):
        s = torch.nn.functional.silu(h13[:, :f])
        ctx.save_for_backward(h13, s)
        ctx.f = f
        return s * h13[:, f:]

    @staticmethod
    def backward(ctx, grad):
        h13, s = ctx.saved_tensors
        f = ctx.f
        grad_h13 = torch.empty_like(h13)
        # d gate = grad * up * SiLU'(gate); d up = grad * SiLU(gate)
        torch.ops.aten.silu_backward.grad_input(grad * h13[:, f:], h13[:, :f], grad_input=grad_h13[:, :f])
        torch.mul(grad, s, out=grad_h13[:, f:])
        return grad_h13, None


def swiglu(h13, f: int):
    """SiLU(h13[:, :f]) * h13[:, f:] (SwiGLU) with the one-tensor backward of SwiGLU."""
    return SwiGLU.apply(h13, f)


class GatherRouting(torch.autograd.Function):
    """(ids int32 [rows, k], weights fp32 [rows, k]) of this rank's tokens -> every rank's ([M, k],
    [M, k]) in rank order (RowChunks{M, W}), through one tdist AllGather of both packed as fp32.
    Backward: this rank's rows of the weights' gradient, which the MoE op gives complete (summed over
    ranks) on every rank."""

    @staticmethod
    def forward(ctx, ids, weights, m: int, rank: int, world: int):
        ctx.begin, ctx.rows = _moe.rows_of(m, world, rank)
        k = ids.shape[1]
        if world == 1 or m == 0:  # nothing to gather (m == 0 on every rank alike)
            gathered_ids, gathered_weights = ids.clone(), weights.clone()
        else:
            packed = torch.cat([weights.float(), ids.float()], dim=1)  # ids < 2^24: exact in fp32
            full = _ag.gather_rows(packed, m, world)
            gathered_weights = full[:, :k].contiguous()
            gathered_ids = full[:, k:].to(torch.int32)
        ctx.mark_non_differentiable(gathered_ids)
        return gathered_ids, gathered_weights

    @staticmethod
    def backward(ctx, grad_ids, grad_weights):
        if grad_weights is None:
            return None, None, None, None, None
        return None, grad_weights[ctx.begin:ctx.begin + ctx.rows], None, None, None


class ParallelMoE(torch.nn.Module):
    """A sparse MoE block (router, top-k, SwiGLU experts) in sequence + tensor parallelism: every
    expert's intermediate features split over the ranks, tokens sequence-sharded in and out.

    Args:
        hidden_size: H, the tokens' features (a multiple of 8).
        intermediate_size: I, every expert's full intermediate size (divisible by the world size into
            multiples of 8: F = I / W on each rank).
        num_experts: E (1 .. the MoE ops' limit).
        top_k: experts per token (1 .. E).
        norm_topk_prob: renormalise the top-k probabilities to sum 1 (Qwen3-MoE's norm_topk_prob,
            Mixtral's behaviour); False keeps the softmax's values.
        method: the MoE ops' method ("auto", "fused", "chunked", "baseline"), forward and backward;
            "fused" is the first projection's (tdist.moe_ag_group_gemm), the second runs "chunked".
        device: of the parameters, default this rank's GPU.
        dtype: torch.bfloat16 (default) or torch.float16, the grouped GEMM's types.

    Parameters: ``router_weight`` (E, H), replicated; ``w13`` (E, 2 F, H): this rank's gate rows then
    up rows of every expert; ``w2`` (E, H, F): this rank's columns of every expert's down projection
    (module docstring). Initialisation: uniform in +-1/sqrt(fan-in) of the full matrices (H for the
    router and w13, I for w2), as torch.nn.Linear. The router is replicated, so it is the same on
    every rank only where every rank seeds torch alike; ``from_weights`` / ``from_module`` copy given
    weights. Needs tdist.init() first (the world size and rank are tdist's).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 norm_topk_prob: bool = True, method: str = "auto", device=None, dtype=None):
        super().__init__()
        hidden_size = _positive_int("hidden_size", hidden_size)
        intermediate_size = _positive_int("intermediate_size", intermediate_size)
        num_experts = _positive_int("num_experts", num_experts)
        top_k = _positive_int("top_k", top_k)
        if top_k > num_experts:
            _fail(f"top_k={top_k} must be at most num_experts={num_experts}")
        if not isinstance(norm_topk_prob, bool):
            _fail(f"norm_topk_prob must be a bool, got {norm_topk_prob!r}")
        if method not in _METHODS:
            _fail(f"method must be one of {', '.join(repr(m) for m in _METHODS)}, got {method!r}")
        dtype = torch.bfloat16 if dtype is None else dtype
        if dtype not in _DTYPES:
            _fail(f"dtype must be torch.bfloat16 or torch.float16 (tdist's grouped GEMM), got {dtype}")
        self.rank, self.world_size = _rank_world("nn." + _CLS)
        if hidden_size % 8:
            _fail(f"hidden_size={hidden_size} must be a multiple of 8 (the grouped GEMM's K and N)")
        if intermediate_size % self.world_size or (intermediate_size // self.world_size) % 8:
            _fail(f"intermediate_size={intermediate_size} must split over the world size {self.world_size} "
                  "into multiples of 8 (each rank's share is a grouped GEMM's K and N)")
        try:  # the MoE ops' own limits (experts, top-k), checked once here rather than at the first call
            _moe._C.moe_check_routing(0, top_k, num_experts, self.world_size, self.rank)
        except Error as e:
            _fail(str(e))
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.local_intermediate_size = intermediate_size // self.world_size
        self.norm_topk_prob = norm_topk_prob
        self.method = method
        kw = {"device": _device(device), "dtype": dtype}
        f = self.local_intermediate_size
        self.router_weight = torch.nn.Parameter(torch.empty((num_experts, hidden_size), **kw))
        self.w13 = torch.nn.Parameter(torch.empty((num_experts, 2 * f, hidden_size), **kw))
        self.w2 = torch.nn.Parameter(torch.empty((num_experts, hidden_size, f), **kw))
        self.fp8 = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in +-1/sqrt(fan-in) of the full matrices, as torch.nn.Linear."""
        if self.fp8:
            _fail("reset_parameters: the experts are quantised to FP8 (quantize_fp8); build a new module")
        for p, fan_in in ((self.router_weight, self.hidden_size), (self.w13, self.hidden_size),
                          (self.w2, self.intermediate_size)):
            bound = 1.0 / math.sqrt(fan_in)
            torch.nn.init.uniform_(p, -bound, bound)

    def quantize_fp8(self) -> "ParallelMoE":
        """Serving in FP8 (e4m3 with DeepSeek-V3's block scales, docs/moe.md "FP8"): replaces the
        parameters w13 and w2 by e4m3 buffers and their 128 x 128 block scales (module docstring),
        freeing the bf16 / fp16 copies. The forward then quantises the tokens and the SwiGLU output
        per row and 128 columns and runs tdist.moe_ag_group_gemm_fp8 and moe_group_gemm_rs_fp8; the
        router stays in the module's dtype, the output too. Inference only: the forward runs under
        torch.no_grad and refuses an input that requires grad while grad mode is on. Needs H and F
        multiples of 16 (the FP8 GEMMs' K). Returns self; a second call is refused."""
        if self.fp8:
            _fail("quantize_fp8: the experts are already FP8")
        for name, size in (("hidden_size", self.hidden_size), ("intermediate_size / world size",
                                                                self.local_intermediate_size)):
            if size % 16:
                _fail(f"quantize_fp8: {name} = {size} must be a multiple of 16 (an FP8 GEMM's K)")
        with torch.no_grad():
            w13 = _moe.quantize_fp8_blocks(self.w13)
            w2 = _moe.quantize_fp8_blocks(self.w2)
        del self.w13, self.w2
        for name, t in zip(("w13_fp8", "w13_scales", "w2_fp8", "w2_scales"), (*w13, *w2)):
            self.register_buffer(name, t)
        self.fp8 = True
        return self

    def route(self, x):
        """The router alone on this rank's rows x (rows, H): top_k_routing with this module's weight,
        whose gradient is summed over ranks in the backward (it sees only this rank's tokens)."""
        router = _ag.CopyReplicated.apply(self.router_weight) if self.world_size > 1 else self.router_weight
        return top_k_routing(x, router, self.top_k, self.norm_topk_prob)

    def forward(self, x, m: Optional[int] = None):
        """x: (rows, ..., H), this rank's rows (tokens) first; returns the block's output for the same
        rows, shaped as x. ``m``: all ranks' rows of the flattened input when the ranks hold unequal
        counts (RowChunks{m, W}; the same on every rank); default rows x world_size."""
        x2 = _flatten(_CLS, x, self.hidden_size, "this rank's rows (tokens) first")
        dtype, device = self.router_weight.dtype, self.router_weight.device
        if x2.dtype != dtype:
            _fail(f"input has dtype {x2.dtype}; expected the parameters' {dtype}")
        if x2.device != device:
            _fail(f"input is on {x2.device}; expected the parameters' device {device}")
        if self.fp8 and torch.is_grad_enabled() and x2.requires_grad:
            _fail("the FP8 experts (quantize_fp8) are inference only: the input requires grad; call under "
                  "torch.no_grad() or detach it")
        rows = x2.shape[0]
        if m is None:
            m = rows * self.world_size
        elif isinstance(m, bool) or not isinstance(m, int) or m < 0:
            _fail(f"m must be None or a non-negative int, got {m!r}")
        expected = _moe.rows_of(m, self.world_size, self.rank)[1]
        if rows != expected:
            _fail(f"input has {rows} rows on rank {self.rank}; expected {expected}, this rank's share of m={m} "
                  f"over {self.world_size} ranks (RowChunks)")
        if self.fp8:
            with torch.no_grad():
                return _unflatten(self._forward_fp8(x2, m).to(dtype), x)
        ids, weights = self.route(x2)
        ids, weights = GatherRouting.apply(ids, weights, m, self.rank, self.world_size)
        h13 = _moe.moe_ag_group_gemm(_ag.dense(x2), ids, self.w13, method=self.method)
        f = self.local_intermediate_size
        h = swiglu(h13, f)
        y = _moe.moe_group_gemm_rs(h, self.w2, ids, weights, method=_moe.rs_method(self.method))
        return _unflatten(y, x)

    def _forward_fp8(self, x2, m: int):
        """The forward on FP8 experts (quantize_fp8), bf16 out; under no_grad."""
        ids, weights = self.route(x2)
        ids, weights = GatherRouting.apply(ids, weights, m, self.rank, self.world_size)
        h13 = _moe.moe_ag_group_gemm_fp8(*_moe.quantize_fp8_rows(x2), ids, self.w13_fp8, self.w13_scales,
                                         method=self.method)
        # Column-major scales: the second projection's GEMM copies a tile's scales in one piece.
        h_q, h_s = _moe.swiglu_quantize_fp8(h13, column_major=True)
        return _moe.moe_group_gemm_rs_fp8(h_q, h_s, self.w2_fp8, self.w2_scales, ids, weights,
                                          method=_moe.rs_method(self.method))

    @classmethod
    def from_weights(cls, router_weight, gate_up_weight, down_weight, top_k: int, *, norm_topk_prob: bool = True,
                     method: str = "auto"):
        """This rank's shard of full (unsharded) weights, the same on every rank: ``router_weight`` (E, H),
        ``gate_up_weight`` (E, 2 I, H) (every expert's gate rows, then its up rows, as transformers'
        fused experts store them), ``down_weight`` (E, H, I). On their device and dtype."""
        for name, t, dims in (("router_weight", router_weight, 2), ("gate_up_weight", gate_up_weight, 3),
                              ("down_weight", down_weight, 3)):
            if not isinstance(t, torch.Tensor) or t.dim() != dims:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                _fail(f"{name} must be a {dims}-D tensor, got {got}")
        experts, hidden = router_weight.shape
        if gate_up_weight.shape[0] != experts or gate_up_weight.shape[2] != hidden or gate_up_weight.shape[1] % 2:
            _fail(f"gate_up_weight has shape {tuple(gate_up_weight.shape)}; expected ({experts}, 2 x intermediate, "
                  f"{hidden}) after router_weight {tuple(router_weight.shape)}")
        inter = gate_up_weight.shape[1] // 2
        if tuple(down_weight.shape) != (experts, hidden, inter):
            _fail(f"down_weight has shape {tuple(down_weight.shape)}; expected ({experts}, {hidden}, {inter})")
        for name, t in (("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
            if t.dtype != router_weight.dtype or t.device != router_weight.device:
                _fail(f"{name} is {t.dtype} on {t.device}; expected router_weight's {router_weight.dtype} on "
                      f"{router_weight.device}")
        mod = cls(hidden, inter, experts, top_k, norm_topk_prob=norm_topk_prob, method=method,
                  device=router_weight.device, dtype=router_weight.dtype)
        f, r = mod.local_intermediate_size, mod.rank
        with torch.no_grad():
            mod.router_weight.copy_(router_weight)
            mod.w13[:, :f].copy_(gate_up_weight[:, r * f:(r + 1) * f])
            mod.w13[:, f:].copy_(gate_up_weight[:, inter + r * f:inter + (r + 1) * f])
            mod.w2.copy_(down_weight[:, :, r * f:(r + 1) * f])
        return mod

    @classmethod
    def from_module(cls, block, *, method: str = "auto"):
        """This rank's shard of a Hugging Face Qwen3-MoE-like sparse block with the full weights (the
        same on every rank): ``block.gate`` the router (a weight (E, H); ``top_k`` and
        ``norm_topk_prob`` on it or on the block), ``block.experts`` either transformers 5's fused
        experts (``gate_up_proj`` (E, 2 I, H), ``down_proj`` (E, H, I)) or a list of MLPs with
        ``gate_proj`` / ``up_proj`` / ``down_proj`` Linears (transformers 4); SiLU activation, no
        biases, no shared expert. On the block's device and dtype."""
        if not isinstance(block, torch.nn.Module):
            _fail(f"from_module: block must be a torch.nn.Module, got {type(block).__name__}")
        name = type(block).__name__
        gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
        router = getattr(gate, "weight", None)
        if not isinstance(router, torch.Tensor) or router.dim() != 2 or experts is None:
            _fail(f"from_module: {name} has no router 'gate' with a 2-D weight and 'experts'; expected a "
                  "Qwen3-MoE-like sparse block")
        for extra in ("shared_expert", "shared_experts"):
            if getattr(block, extra, None) is not None:
                _fail(f"from_module: {name} has a {extra}, which ParallelMoE does not hold")
        if getattr(gate, "bias", None) is not None:
            _fail(f"from_module: {name}.gate has a bias; the router has none")

        def setting(attr):
            for owner in (gate, block):
                if hasattr(owner, attr):
                    return getattr(owner, attr)
            _fail(f"from_module: {name} has no '{attr}' (on the block or its gate)")

        top_k = setting("top_k")
        norm = setting("norm_topk_prob")
        with torch.no_grad():
            if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):  # transformers 5: fused 3-D
                for attr, want in (("is_transposed", False), ("is_concatenated", True), ("has_bias", False),
                                   ("has_gate", True)):
                    if getattr(experts, attr, want) != want:
                        _fail(f"from_module: {name}.experts.{attr} is {getattr(experts, attr)!r}; expected {want}")
                _check_silu(name, getattr(experts, "act_fn", None))
                gate_up, down = experts.gate_up_proj, experts.down_proj
            elif isinstance(experts, (torch.nn.ModuleList, list, tuple)) and len(experts) > 0:  # transformers 4
                for e in experts:
                    for proj in ("gate_proj", "up_proj", "down_proj"):
                        if not isinstance(getattr(e, proj, None), torch.nn.Linear) or getattr(e, proj).bias is not None:
                            _fail(f"from_module: every expert of {name} needs {proj} as a torch.nn.Linear without "
                                  "bias")
                    _check_silu(name, getattr(e, "act_fn", None))
                gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts])
                down = torch.stack([e.down_proj.weight for e in experts])
            else:
                _fail(f"from_module: {name}.experts is neither fused experts (gate_up_proj, down_proj) nor a list of "
                      "MLPs (gate_proj, up_proj, down_proj)")
        return cls.from_weights(router.detach(), gate_up.detach(), down.detach(), int(top_k),
                                norm_topk_prob=bool(norm), method=method)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size} "
                f"({self.local_intermediate_size} on rank {self.rank} of {self.world_size}), "
                f"num_experts={self.num_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}, "
                f"method={self.method!r}" + (", fp8=True" if self.fp8 else ""))


def _check_silu(name: str, act) -> None:
    """The experts' activation must be SiLU (torch's, or transformers' SiLUActivation); None: not said."""
    if act is None:
        return
    kind = type(act).__name__
    if not (isinstance(act, torch.nn.SiLU) or kind in ("SiLU", "SiLUActivation") or act is torch.nn.functional.silu):
        _fail(f"from_module: {name}'s experts use {kind}; ParallelMoE runs SiLU(gate) * up")


__all__ = ["ParallelMoE", "GatherRouting", "SwiGLU", "swiglu", "top_k_routing"]
