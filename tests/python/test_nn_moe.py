"""CPU tests of tdist.nn.ParallelMoE (python/tdist/nn/sparse_moe.py): no GPU. They need torch and skip,
saying so, without it; the transformers comparisons skip without transformers.

* argument errors of the constructor, from_weights, from_module and forward name the argument and
  what was expected;
* from_weights / from_module shard the full weights as documented (rank 1 of 2 and of 3, stand-in
  runtimes): w13 = this rank's gate rows then its up rows, w2 = its columns of the down projection,
  the router whole; transformers 5's fused experts and transformers 4's list of MLPs alike;
* the router (top_k_routing) equals transformers' Qwen3-MoE router, norm_topk_prob on and off;
* forward and backward on meta tensors (the MoE ops' and the AllGather's fake implementations): the
  output has the input's shape (3-D included) and every parameter a gradient of its own shape.
The values of the block's output and gradients are checked on GPUs: tests/python/gpu_test_moe_layer.py.
"""

import pytest

torch = pytest.importorskip("torch", reason="tdist.nn.ParallelMoE needs torch")

import tdist  # noqa: E402
from tdist import _runtime  # noqa: E402
import tdist.nn  # noqa: E402
from tdist.nn import sparse_moe  # noqa: E402

H, I, E, K = 64, 96, 6, 2  # hidden, full intermediate (divides by 1, 2 and 3 into multiples of 8), experts, top-k


def stand_in(world, rank):
    class Runtime:
        world_size, device, closed = world, 0, False

    rt = Runtime()
    rt.rank = rank
    return rt


@pytest.fixture
def runtime_2_1():
    _runtime._state.runtime = stand_in(2, 1)
    yield
    _runtime._state.runtime = None


def full_weights(experts=E, hidden=H, inter=I, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((experts, hidden), generator=g).to(dtype),
            torch.randn((experts, 2 * inter, hidden), generator=g).to(dtype),
            torch.randn((experts, hidden, inter), generator=g).to(dtype))


def test_exported_lazily():
    assert "ParallelMoE" in dir(tdist.nn) and tdist.nn.ParallelMoE is sparse_moe.ParallelMoE


def test_needs_init():
    _runtime._state.runtime = None
    with pytest.raises(tdist.Error, match="not initialised"):
        tdist.nn.ParallelMoE(H, I, E, K, device="meta")


@pytest.mark.parametrize("kwargs,words", [
    (dict(hidden_size=0), ["hidden_size must be a positive int, got 0"]),
    (dict(hidden_size=64.0), ["hidden_size must be a positive int, got 64.0"]),
    (dict(intermediate_size=True), ["intermediate_size must be a positive int, got True"]),
    (dict(num_experts=-1), ["num_experts must be a positive int"]),
    (dict(top_k=7), ["top_k=7 must be at most num_experts=6"]),
    (dict(hidden_size=60), ["hidden_size=60 must be a multiple of 8"]),
    (dict(intermediate_size=90), ["intermediate_size=90", "world size 2", "multiples of 8"]),
    (dict(intermediate_size=40), ["intermediate_size=40"]),  # 20 per rank: not a multiple of 8
    (dict(num_experts=1 << 20, top_k=2), ["'experts'"]),  # past the MoE ops' limit (their message)
    (dict(norm_topk_prob=1), ["norm_topk_prob must be a bool, got 1"]),
    (dict(method="sequential"),
     ["method must be one of 'auto', 'fused', 'chunked', 'baseline', got 'sequential'"]),
    (dict(dtype=torch.float32), ["dtype must be torch.bfloat16 or torch.float16", "float32"]),
])
def test_constructor_errors(runtime_2_1, kwargs, words):
    args = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K)
    args.update(kwargs)
    positional = [args.pop(n) for n in ("hidden_size", "intermediate_size", "num_experts", "top_k")]
    with pytest.raises(ValueError) as e:
        tdist.nn.ParallelMoE(*positional, device="meta", **args)
    assert str(e.value).startswith("tdist.nn.ParallelMoE: ")
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_shapes_and_defaults(runtime_2_1):
    mod = tdist.nn.ParallelMoE(H, I, E, K, device="meta")
    assert mod.local_intermediate_size == I // 2 and (mod.rank, mod.world_size) == (1, 2)
    assert mod.router_weight.shape == (E, H) and mod.w13.shape == (E, I, H) and mod.w2.shape == (E, H, I // 2)
    assert mod.w13.dtype == torch.bfloat16 and mod.norm_topk_prob and mod.method == "auto"
    assert "48 on rank 1 of 2" in repr(mod)
    assert sorted(n for n, _ in mod.named_parameters()) == ["router_weight", "w13", "w2"]


@pytest.mark.parametrize("world,rank", [(2, 1), (3, 1), (3, 2), (1, 0)])
def test_from_weights_shards(world, rank):
    _runtime._state.runtime = stand_in(world, rank)
    try:
        router, gate_up, down = full_weights()
        mod = tdist.nn.ParallelMoE.from_weights(router, gate_up, down, K, norm_topk_prob=False, method="chunked")
        f = I // world
        assert mod.w13.device.type == "cpu" and mod.w13.dtype == torch.bfloat16
        assert (mod.top_k, mod.norm_topk_prob, mod.method) == (K, False, "chunked")
        assert torch.equal(mod.router_weight, router)
        assert torch.equal(mod.w13[:, :f], gate_up[:, rank * f:(rank + 1) * f])          # gate rows
        assert torch.equal(mod.w13[:, f:], gate_up[:, I + rank * f:I + (rank + 1) * f])  # up rows
        assert torch.equal(mod.w2, down[:, :, rank * f:(rank + 1) * f])
    finally:
        _runtime._state.runtime = None


def test_from_weights_errors(runtime_2_1):
    router, gate_up, down = full_weights()
    cases = [
        ((router[0], gate_up, down), "router_weight must be a 2-D tensor, got (64,)"),
        ((router, gate_up.tolist(), down), "gate_up_weight must be a 3-D tensor, got list"),
        ((router, gate_up[:, :-1], down), "gate_up_weight has shape (6, 191, 64); expected (6, 2 x intermediate, 64)"),
        ((router, gate_up[:5], down), "gate_up_weight has shape (5, 192, 64)"),
        ((router, gate_up, down[:, :, :48]), "down_weight has shape (6, 64, 48); expected (6, 64, 96)"),
        ((router, gate_up.half(), down), "gate_up_weight is torch.float16 on cpu; expected router_weight's"),
        ((router.float(), gate_up.float(), down.float()), "dtype must be torch.bfloat16 or torch.float16"),
    ]
    for args, words in cases:
        with pytest.raises(ValueError, match="ParallelMoE") as e:
            tdist.nn.ParallelMoE.from_weights(*args, K)
        assert words in str(e.value), (words, str(e.value))


# --- Hugging Face-like blocks --------------------------------------------------------------------------

class FusedExperts(torch.nn.Module):  # transformers 5's layout
    def __init__(self, gate_up, down):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(gate_up.clone())
        self.down_proj = torch.nn.Parameter(down.clone())
        self.act_fn = torch.nn.SiLU()


class Router(torch.nn.Module):
    def __init__(self, weight, top_k, norm):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())
        self.top_k, self.norm_topk_prob = top_k, norm


class Block5(torch.nn.Module):
    def __init__(self, router, gate_up, down, top_k=K, norm=True):
        super().__init__()
        self.gate = Router(router, top_k, norm)
        self.experts = FusedExperts(gate_up, down)


class MLP(torch.nn.Module):
    def __init__(self, gate, up, down, act=None):
        super().__init__()
        self.gate_proj = torch.nn.Linear(gate.shape[1], gate.shape[0], bias=False, dtype=gate.dtype)
        self.up_proj = torch.nn.Linear(up.shape[1], up.shape[0], bias=False, dtype=up.dtype)
        self.down_proj = torch.nn.Linear(down.shape[1], down.shape[0], bias=False, dtype=down.dtype)
        with torch.no_grad():
            self.gate_proj.weight.copy_(gate)
            self.up_proj.weight.copy_(up)
            self.down_proj.weight.copy_(down)
        self.act_fn = act or torch.nn.SiLU()


class Block4(torch.nn.Module):  # transformers 4's layout: a Linear router, a list of MLPs
    def __init__(self, router, gate_up, down, top_k=K, norm=False):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm
        self.gate = torch.nn.Linear(router.shape[1], router.shape[0], bias=False, dtype=router.dtype)
        with torch.no_grad():
            self.gate.weight.copy_(router)
        inter = down.shape[2]
        self.experts = torch.nn.ModuleList(MLP(gate_up[e, :inter], gate_up[e, inter:], down[e])
                                           for e in range(router.shape[0]))


@pytest.mark.parametrize("layout", [Block5, Block4])
def test_from_module_shards_like_from_weights(runtime_2_1, layout):
    router, gate_up, down = full_weights(seed=3)
    block = layout(router, gate_up, down, top_k=3)
    mod = tdist.nn.ParallelMoE.from_module(block, method="baseline")
    ref = tdist.nn.ParallelMoE.from_weights(router, gate_up, down, 3)
    assert (mod.top_k, mod.norm_topk_prob, mod.method) == (3, layout is Block5, "baseline")
    for a, b in zip(mod.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert not mod.w13.requires_grad or mod.w13.grad is None


def test_from_module_errors(runtime_2_1):
    router, gate_up, down = full_weights()
    with pytest.raises(ValueError, match="block must be a torch.nn.Module, got dict"):
        tdist.nn.ParallelMoE.from_module({})
    with pytest.raises(ValueError, match="has no router 'gate'"):
        tdist.nn.ParallelMoE.from_module(torch.nn.Linear(4, 4))
    block = Block5(router, gate_up, down)
    block.shared_expert = MLP(gate_up[0, :I], gate_up[0, I:], down[0])
    with pytest.raises(ValueError, match="has a shared_expert"):
        tdist.nn.ParallelMoE.from_module(block)
    block = Block5(router, gate_up, down)
    del block.gate.top_k
    with pytest.raises(ValueError, match="has no 'top_k'"):
        tdist.nn.ParallelMoE.from_module(block)
    block = Block5(router, gate_up, down)
    block.experts.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match="use GELU; ParallelMoE runs SiLU"):
        tdist.nn.ParallelMoE.from_module(block)
    block = Block5(router, gate_up, down)
    block.experts.is_transposed = True
    with pytest.raises(ValueError, match="experts.is_transposed is True; expected False"):
        tdist.nn.ParallelMoE.from_module(block)
    block = Block4(router, gate_up, down)
    block.experts[2].up_proj = torch.nn.Linear(H, I, bias=True, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs up_proj as a torch.nn.Linear without bias"):
        tdist.nn.ParallelMoE.from_module(block)
    block = Block4(router, gate_up, down)
    block.experts = torch.nn.Identity()
    with pytest.raises(ValueError, match="neither fused experts"):
        tdist.nn.ParallelMoE.from_module(block)
    block = Block4(router, gate_up, down)
    block.gate = torch.nn.Linear(H, E, bias=True, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gate has a bias"):
        tdist.nn.ParallelMoE.from_module(block)


def _qwen3_config(norm):
    transformers = pytest.importorskip("transformers", reason="the Qwen3-MoE comparison needs transformers")
    try:
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    except ImportError:
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3-MoE")
    return Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                          norm_topk_prob=norm, hidden_act="silu", num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=128, vocab_size=32)


@pytest.mark.parametrize("norm", [True, False])
def test_router_equals_transformers(norm):
    config = _qwen3_config(norm)
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf
    block = hf.Qwen3MoeSparseMoeBlock(config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn((33, H), generator=g)
    router = block.gate if hasattr(block.gate, "top_k") else None
    if router is None:
        pytest.skip("this transformers' Qwen3-MoE router is a Linear (transformers 4)")
    _, want_weights, want_ids = router(x)
    ids, weights = sparse_moe.top_k_routing(x, router.weight, K, norm)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids.long())
    assert torch.allclose(weights, want_weights.float(), rtol=1e-6, atol=1e-7)


def test_from_module_of_transformers_block(runtime_2_1):
    config = _qwen3_config(True)
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf
    block = hf.Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    mod = tdist.nn.ParallelMoE.from_module(block)
    f = I // 2
    assert (mod.top_k, mod.norm_topk_prob, mod.num_experts) == (K, True, E)
    assert (mod.hidden_size, mod.intermediate_size) == (H, I)
    if hasattr(block.experts, "gate_up_proj"):
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    else:
        gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in block.experts])
        down = torch.stack([e.down_proj.weight for e in block.experts])
    assert torch.equal(mod.w13[:, :f], gate_up[:, f:2 * f]) and torch.equal(mod.w13[:, f:], gate_up[:, I + f:])
    assert torch.equal(mod.w2, down[:, :, f:]) and torch.equal(mod.router_weight, block.gate.weight)


# --- forward on meta tensors ---------------------------------------------------------------------------

def meta(shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def test_forward_backward_on_meta(runtime_2_1):
    mod = tdist.nn.ParallelMoE(H, I, E, K, device="meta")
    x = meta((5, H), grad=True)  # rank 1 of 2, m = 11: tokens 6 .. 10
    y = mod(x, m=11)
    assert y.shape == (5, H) and y.dtype == torch.bfloat16
    y.sum().backward()
    assert x.grad.shape == x.shape
    for name, p in mod.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype, name
    x3 = meta((3, 2, H), grad=True)  # (tokens, batch, hidden): 6 rows on each rank
    y3 = mod(x3)
    assert y3.shape == (3, 2, H)
    with torch.no_grad():
        assert mod(meta((0, H)), m=1).shape == (0, H)  # m = 1 over 2 ranks: rank 1 holds no token


def test_forward_errors(runtime_2_1):
    mod = tdist.nn.ParallelMoE(H, I, E, K, device="meta")
    cases = [
        (lambda: mod(meta((5, H + 8))), "input has shape (5, 72); expected (rows, ..., 64)"),
        (lambda: mod([[0.0] * H]), "input must be a torch.Tensor, got list"),
        (lambda: mod(meta((5, H), torch.float16)), "input has dtype torch.float16; expected the parameters' "
                                                   "torch.bfloat16"),
        (lambda: mod(torch.zeros((5, H), dtype=torch.bfloat16)),
         "input is on cpu; expected the parameters' device meta"),
        (lambda: mod(meta((5, H)), m=12), "input has 5 rows on rank 1; expected 6, this rank's share of m=12"),
        (lambda: mod(meta((5, H)), m=-1), "m must be None or a non-negative int, got -1"),
        (lambda: mod(meta((5, H)), m=11.0), "m must be None or a non-negative int, got 11.0"),
    ]
    for fn, words in cases:
        with pytest.raises(ValueError) as e:
            fn()
        assert words in str(e.value), (words, str(e.value))


# --- FP8 serving ------------------------------------------------------------------------------------

def test_quantize_fp8_replaces_the_experts(runtime_2_1):
    router, gate_up, down = full_weights(hidden=128, inter=160)
    mod = tdist.nn.ParallelMoE.from_weights(router, gate_up, down, K)
    w13, w2 = mod.w13.detach().clone(), mod.w2.detach().clone()
    assert mod.quantize_fp8() is mod and mod.fp8 and "fp8=True" in repr(mod)
    assert [n for n, _ in mod.named_parameters()] == ["router_weight"]
    assert not hasattr(mod, "w13") and not hasattr(mod, "w2")
    f = 80  # 160 over two ranks: one full block and one of 32 rows / columns past it
    for name, shape in (("w13_fp8", (E, 2 * f, 128)), ("w13_scales", (E, 2, 1)), ("w2_fp8", (E, 128, f)),
                        ("w2_scales", (E, 1, 1))):
        t = getattr(mod, name)
        assert tuple(t.shape) == shape, (name, tuple(t.shape))
        assert t.dtype == (torch.float8_e4m3fn if name.endswith("fp8") else torch.float32), name
        assert name in dict(mod.named_buffers()), name
    for q, sc, w in ((mod.w13_fp8, mod.w13_scales, w13), (mod.w2_fp8, mod.w2_scales, w2)):
        scale = sc.repeat_interleave(128, 1)[:, :w.shape[1]].repeat_interleave(128, 2)[:, :, :w.shape[2]]
        value = q.float() * scale
        err = float((value - w.float()).abs().max() / w.float().abs().max())
        assert 0 < err < 2 ** -4, err  # e4m3: 3 mantissa bits, rounding to nearest
    with pytest.raises(ValueError, match="already FP8"):
        mod.quantize_fp8()
    with pytest.raises(ValueError, match="reset_parameters: the experts are quantised"):
        mod.reset_parameters()


@pytest.mark.parametrize("hidden,inter,words", [(72, 96, "hidden_size = 72"), (64, 48, "world size = 24")])
def test_quantize_fp8_needs_multiples_of_16(runtime_2_1, hidden, inter, words):
    mod = tdist.nn.ParallelMoE(hidden, inter, E, K, device="meta")
    with pytest.raises(ValueError) as e:
        mod.quantize_fp8()
    assert words in str(e.value) and "multiple of 16" in str(e.value), str(e.value)
    assert not mod.fp8 and isinstance(mod.w13, torch.nn.Parameter)  # unchanged


def test_fp8_forward_on_meta(runtime_2_1):
    mod = tdist.nn.ParallelMoE(H, I, E, K, device="meta", dtype=torch.float16).quantize_fp8()
    with torch.no_grad():
        y = mod(meta((5, H), torch.float16), m=11)
    assert y.shape == (5, H) and y.dtype == torch.float16  # the module's dtype
    y3 = mod(meta((3, 2, H), torch.float16))  # grad mode on, the input needs none
    assert y3.shape == (3, 2, H) and not y3.requires_grad
    with pytest.raises(ValueError, match="inference only: the input requires grad"):
        mod(meta((5, H), torch.float16, grad=True), m=11)


def test_gather_routing_backward_keeps_this_ranks_rows():
    """At one rank the gather is a copy; the weights' gradient comes back as it is (the MoE op gives it
    complete, summed over ranks)."""
    ids = torch.tensor([[0, 2], [1, 3], [2, 0]], dtype=torch.int32)
    weights = torch.rand((3, 2), requires_grad=True)
    got_ids, got_weights = sparse_moe.GatherRouting.apply(ids, weights, 3, 0, 1)
    assert torch.equal(got_ids, ids) and not got_ids.requires_grad and torch.equal(got_weights, weights)
    grad = torch.arange(6.0).view(3, 2)
    got_weights.backward(grad)
    assert torch.equal(weights.grad, grad)


@pytest.mark.parametrize("rows,f", [(1, 8), (37, 24), (130, 72)])
def test_swiglu_against_autograd_in_float64(rows, f):
    """SwiGLU's one-tensor backward against autograd of SiLU(gate) * up, in float64, with a
    gradient that is not contiguous (a transposed view)."""
    g = torch.Generator().manual_seed(rows + f)
    h13 = torch.randn((rows, 2 * f), generator=g, dtype=torch.float64)
    dy = torch.randn((f, rows), generator=g, dtype=torch.float64).t()
    a, b = h13.clone().requires_grad_(), h13.clone().requires_grad_()
    got = sparse_moe.swiglu(a, f)
    want = torch.nn.functional.silu(b[:, :f]) * b[:, f:]
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    got.backward(dy)
    want.backward(dy)
    assert torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12)
