"""GPU tests of tdist.nn.parallelize on Hugging Face transformers models (1 or more ranks):

    python -m torch.distributed.run --nproc-per-node 2 tests/python/gpu_test_hf.py
    torchrun --nproc-per-node 2 -m pytest -q tests/python/gpu_test_hf.py

Small models built from a config (no download), bf16, the same weights on every rank (rank 0's), with
sizes that are odd multiples of 8 where the overlapped GEMMs need multiples of 8 (every converted layer
here takes the overlapped path); each converted model against a float64 copy of the unconverted one
(outputs, input gradient, every parameter's gradient: this rank's shard of a converted layer's, the
whole gradient of the others):

- transformers' LlamaMLP with the sequence-parallel plan (gate/up "colwise", down "rowwise"): each
  rank feeds its rows of the sequence and gets its rows back. 2-D (tokens, hidden) with and without
  biases, and 3-D (sequence, batch, hidden), sequence first.
- LlamaModel, two decoder layers, with the replicated plan (q/k/v and gate/up "colwise_replicated",
  o and down "rowwise_replicated"): every rank feeds the whole (batch, sequence, hidden) input and
  gets the whole output. HF's attention reshapes q/k/v by the input's (batch, sequence) shape, so it
  needs every token of the sequence on every rank: the sequence-parallel styles do not fit it (the
  next test shows how that goes wrong). Converted attention keeps this rank's heads (3 per rank, one
  key/value head per rank: GQA groups stay whole).
- at 2+ ranks, the sequence-parallel plan on HF's attention is refused (a shape error at o_proj),
  not silently wrong.
- Qwen2ForCausalLM (q/k/v with biases, plan patterns under "model.layers.*") with the replicated
  plan, from token ids to logits (lm_head left whole), the embedding's gradient included.

Attention runs through torch's SDPA (attn_implementation="sdpa"), which takes float64 for the
reference. Gradients and outputs are new tensors, so blocks of their sizes are filled with NaN before
each converted forward. When a check fails the message gives the error and, for the models, the
unconverted bf16 model's own error against the same reference. Without transformers the file says so
and is skipped ("0 passed, 0 failed", exit status 0). Both ways end with a line "N passed, M failed".
"""

import copy
import os
import sys

import tdist  # before torch: tdist's libnccl (>= 2.28) is then the one the process loads
import tdist.nn

import torch
import torch.distributed as dist

from gpu_harness import pytest_session, rank, run_tests, skip_all, world
from gpu_test_layers import MODEL_TOL, check, chunk, expect_error, expected_shard, poison, rank0_model, run_sp
from gpu_test_layers import same_rand

try:
    import transformers
    from transformers import LlamaConfig, LlamaModel, Qwen2Config, Qwen2ForCausalLM
    from transformers.models.llama.modeling_llama import LlamaMLP
    MISSING = None
except ImportError as e:  # an optional package: the file is skipped, saying so
    MISSING = f"gpu_test_hf.py: transformers is not installed ({e}); pip install 'transformers>=5'"

# Whole decoder layers in bf16 (norms, rotary embedding, attention, two layers deep) against float64:
# the unconverted bf16 Llama model below is itself 2.1% off in its worst weight gradient (on CPU).
HF_MODEL_TOL = 5e-2

# The sequence-parallel plan of Llama's MLP (docs/nn.md, "Converting a Hugging Face model").
LLAMA_MLP_PLAN = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}

# The replicated plan of a Llama model (LlamaModel's module names; a *ForCausalLM puts them under
# "model."): every rank runs the whole sequence through this rank's heads and intermediate features.
LLAMA_REPLICATED_PLAN = {
    "layers.*.self_attn.[qkv]_proj": "colwise_replicated",
    "layers.*.self_attn.o_proj": "rowwise_replicated",
    "layers.*.mlp.gate_proj": "colwise_replicated",
    "layers.*.mlp.up_proj": "colwise_replicated",
    "layers.*.mlp.down_proj": "rowwise_replicated",
}
CAUSAL_LM_REPLICATED_PLAN = {"model." + k: v for k, v in LLAMA_REPLICATED_PLAN.items()}

# Attention sizes: 3 query heads and 1 key/value head per rank, head_dim 24; hidden 120 (= 8 x 15).
HIDDEN, HEAD_DIM, VOCAB = 120, 24, 96


def attention_config(cls, inter_per_rank, **kw):
    w = world()
    assert HIDDEN % (3 * w) == 0, f"hidden {HIDDEN} must be a multiple of the {3 * w} heads at {w} ranks"
    return cls(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=inter_per_rank * w, num_hidden_layers=2,
               num_attention_heads=3 * w, num_key_value_heads=w, head_dim=HEAD_DIM, max_position_embeddings=256,
               attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False, **kw)


def hf_model(cls, config, seed):
    """cls(config), bf16 on this GPU, the same weights on every rank (rank 0's). Weights are drawn
    again, as HF's own initialisation leaves biases at 0 and norm weights at 1 (a mis-sliced bias or
    a norm's gradient would not show) and its 0.02 standard deviation makes the attention's share of
    the residual stream small: Linear weights N(0, 1 / in_features), biases N(0, 0.1^2), embeddings
    N(0, 1), every other parameter (the RMSNorm weights) N(1, 0.2^2)."""
    model = rank0_model(cls, config, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed)

    def draw(p, mean, std):
        p.copy_(torch.randn(p.shape, generator=g, device="cuda", dtype=torch.float32) * std + mean)

    with torch.no_grad():
        for mod in model.modules():
            for name, p in mod.named_parameters(recurse=False):
                if isinstance(mod, torch.nn.Linear):
                    draw(p, 0.0, mod.in_features ** -0.5 if name == "weight" else 0.1)
                elif isinstance(mod, torch.nn.Embedding):
                    draw(p, 0.0, 1.0)
                else:
                    draw(p, 1.0, 0.2)
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    return model


def assert_overlapped(tp, count):
    """tp holds `count` converted layers, each with sizes the overlapped GEMMs take (multiples of 8)."""
    layers = [m for m in tp.modules() if isinstance(m, (tdist.nn.ColumnParallelLinear, tdist.nn.RowParallelLinear))]
    assert len(layers) == count, f"{len(layers)} converted layers, expected {count}"
    for m in layers:
        if isinstance(m, tdist.nn.ColumnParallelLinear):
            n, k = m.local_out_features, m.in_features
        else:
            n, k = m.out_features, m.local_in_features
        assert n % 8 == 0 and k % 8 == 0, f"{m}: N={n}, K={k} are not multiples of 8"


def rel_err(got, want):
    if got is None or tuple(got.shape) != tuple(want.shape):
        return float("nan")
    return (got.double() - want.double()).abs().max().item() / max(want.double().abs().max().item(), 1e-30)


def compare(what, tp, ref, base, forward, x_full, dy_full, tol, shard=None):
    """Forward + backward of the converted `tp` (bf16) against the unconverted `ref` (float64) and
    `base` (bf16, only for the messages), all on the same input. ``forward(model, x)`` returns the
    output tensor; x_full is the whole input (floating: its gradient is checked; token ids: not),
    dy_full the output's gradient. ``shard``: a slice of the first dimension that this rank feeds and
    gets back (sequence-parallel); None: every rank feeds and gets everything (replicated)."""
    part = (lambda t: t) if shard is None else (lambda t: t[shard])
    floating = x_full.is_floating_point()
    runs = {}
    x_bf16 = x_full.to(torch.bfloat16) if floating else x_full
    for name, model in (("ref", ref), ("base", base), ("tdist", tp)):
        x = x_bf16.double() if name == "ref" and floating else x_bf16
        dy = dy_full.double() if name == "ref" else dy_full
        if name == "tdist":
            x, dy = part(x), part(dy)
        if floating:
            x = x.detach().requires_grad_()
        for p in model.parameters():
            p.grad = None
        if name == "tdist":
            # the gradients' sizes, the input's (its gradient) and the output's
            poison(*[(tuple(p.shape), p.dtype) for p in model.parameters()], (tuple(x.shape), torch.bfloat16),
                   (tuple(dy.shape), torch.bfloat16))
        y = forward(model, x)
        (y.to(dy.dtype) * dy).sum().backward()
        runs[name] = (y.detach(), x.grad if floating else None, dict(model.named_parameters()))

    def checked(got, want, base_got, label, tol=tol):
        try:
            check(got, want, tol, f"{what}: {label}")
        except AssertionError as e:
            base_err = rel_err(base_got, want)
            raise AssertionError(f"{e} (the unconverted bf16 model: {base_err:.3e} x max |ref|)") from None

    y, gx, params = runs["tdist"]
    y_ref, gx_ref, ref_params = runs["ref"]
    y_base, gx_base, base_params = runs["base"]
    checked(y, part(y_ref), part(y_base), "output")
    if floating:
        checked(gx, part(gx_ref), part(gx_base), "input gradient")
    names = [name for name, _ in ref.named_parameters()]
    assert sorted(params) == sorted(names), f"{what}: parameters {sorted(params)}, expected {sorted(names)}"
    for name, p in params.items():
        want = ref_params[name].grad
        if want is None:  # unused by this forward (the embedding, when the input is embeddings)
            assert p.grad is None, f"{what}: {name} has a gradient; the unconverted model's has none"
            continue
        # The softmax ignores a shift of every key, so the key bias's gradient is a sum that nearly
        # cancels (only the rotary embedding keeps it from 0): the unconverted bf16 Qwen2 model is 3.6%
        # off in it against the largest entry of rank 1's shard (on CPU); twice the tolerance there.
        checked(p.grad, expected_shard(tp, name, want), expected_shard(tp, name, base_params[name].grad),
                f"{name} gradient", tol * 2 if name.endswith("k_proj.bias") else tol)


def copies(model):
    """(float64 reference, bf16 baseline) copies of the unconverted model."""
    return copy.deepcopy(model).double(), copy.deepcopy(model)


# --- the tests ----------------------------------------------------------------------------------------

def test_llama_mlp_sequence_parallel():
    """LlamaMLP, sequence-parallel: each rank's rows of the tokens in, its rows of the output back."""
    w = world()
    hidden, inter = 200, 104 * w                  # 8 x 25; 8 x 13 per rank
    for bias in (False, True):
        config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=5, mlp_bias=bias,
                             hidden_act="silu")
        model = hf_model(LlamaMLP, config, seed=10 + bias)
        ref = copy.deepcopy(model).double()
        tp = tdist.nn.parallelize(model, LLAMA_MLP_PLAN)
        assert isinstance(tp.gate_proj, tdist.nn.ColumnParallelLinear) and tp.gate_proj.sequence_parallel
        assert isinstance(tp.down_proj, tdist.nn.RowParallelLinear) and tp.down_proj.sequence_parallel
        assert tp.up_proj.weight.shape == (104, hidden) and tp.down_proj.weight.shape == (hidden, 104)
        assert_overlapped(tp, 3)
        # HF's module calls gate_proj(x) without m=, so the ranks hold equal rows: 74 each
        run_sp(tp, ref, 74 * w, hidden, 12 + bias, what=f"LlamaMLP bias={bias} (tokens, hidden)")
    # (sequence, batch, hidden), sequence first: a rank's rows are whole sequence positions
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=5, hidden_act="silu")
    model = hf_model(LlamaMLP, config, seed=14)
    ref, base = copies(model)
    tp = tdist.nn.parallelize(model, LLAMA_MLP_PLAN)
    seq, batch = 37 * w, 3
    begin, rows = chunk(seq)
    compare("LlamaMLP (sequence, batch, hidden)", tp, ref, base, lambda m, x: m(x), same_rand((seq, batch, hidden), 15),
            same_rand((seq, batch, hidden), 16), MODEL_TOL, shard=slice(begin, begin + rows))


def llama_forward(model, x):
    return model(inputs_embeds=x, use_cache=False).last_hidden_state


def test_llama_model_replicated():
    """LlamaModel (two decoder layers), replicated plan: the whole (batch, sequence, hidden) on every rank."""
    config = attention_config(LlamaConfig, 104)  # 8 x 13 intermediate features per rank
    model = hf_model(LlamaModel, config, seed=20)
    ref, base = copies(model)
    tp = tdist.nn.parallelize(model, LLAMA_REPLICATED_PLAN)
    attn = tp.layers[1].self_attn
    assert isinstance(attn.q_proj, tdist.nn.ColumnParallelLinear) and not attn.q_proj.sequence_parallel
    assert isinstance(attn.o_proj, tdist.nn.RowParallelLinear) and not attn.o_proj.sequence_parallel
    assert attn.q_proj.weight.shape == (3 * HEAD_DIM, HIDDEN) and attn.k_proj.weight.shape == (HEAD_DIM, HIDDEN)
    assert attn.o_proj.weight.shape == (HIDDEN, 3 * HEAD_DIM)
    assert_overlapped(tp, 14)
    batch, seq = 2, 29
    compare("LlamaModel replicated", tp, ref, base, llama_forward, same_rand((batch, seq, HIDDEN), 21),
            same_rand((batch, seq, HIDDEN), 22), HF_MODEL_TOL)


def test_sequence_sharded_attention_is_refused():
    """The sequence-parallel plan on HF's attention: q_proj ("colwise") returns every token of this
    rank's heads, which HF views by the input's own (batch, local sequence) shape as all heads of the
    local tokens; the attention's output then has every head's features, which o_proj ("rowwise",
    expecting this rank's share) refuses. At one rank the plan is exact, so there is nothing to show."""
    if world() < 2:
        print(f"[rank {rank()}] SKIP test_sequence_sharded_attention_is_refused: needs 2 or more ranks, the "
              f"world has {world()}", flush=True)
        return
    config = attention_config(LlamaConfig, 104)
    model = hf_model(LlamaModel, config, seed=25)
    plan = {"layers.*.self_attn.[qkv]_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
    tp = tdist.nn.parallelize(model, plan)
    seq = 8 * world()
    begin, rows = chunk(seq)
    x = same_rand((1, seq, HIDDEN), 26)[:, begin:begin + rows].to(torch.bfloat16)
    with torch.no_grad():
        expect_error(lambda: llama_forward(tp, x), "RowParallelLinear",
                     f"this rank's {3 * HEAD_DIM} of {3 * HEAD_DIM * world()} input features")


def test_qwen2_causal_lm_replicated():
    """Qwen2ForCausalLM (q/k/v with biases), the replicated plan under "model.": token ids to logits."""
    config = attention_config(Qwen2Config, 88)  # 8 x 11 intermediate features per rank
    model = hf_model(Qwen2ForCausalLM, config, seed=30)
    ref, base = copies(model)
    tp = tdist.nn.parallelize(model, CAUSAL_LM_REPLICATED_PLAN)
    assert tp.model.layers[0].self_attn.k_proj.bias.shape == (HEAD_DIM,)
    assert isinstance(tp.lm_head, torch.nn.Linear)  # not in the plan: whole
    assert_overlapped(tp, 14)
    batch, seq = 2, 23
    g = torch.Generator(device="cuda").manual_seed(31)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g, device="cuda")
    dist.broadcast(ids, 0)
    compare("Qwen2ForCausalLM replicated", tp, ref, base, lambda m, x: m(input_ids=x, use_cache=False).logits, ids,
            same_rand((batch, seq, VOCAB), 32), HF_MODEL_TOL)


TESTS = [test_llama_mlp_sequence_parallel, test_llama_model_replicated, test_sequence_sharded_attention_is_refused,
         test_qwen2_causal_lm_replicated]


# pytest: one init for the module, or the whole module skipped without transformers (as a script,
# main() says so)
if MISSING is None:
    _tdist_session = pytest_session()
elif __name__ != "__main__":
    import pytest

    pytest.skip(MISSING, allow_module_level=True)


def main():
    if MISSING is not None:
        return skip_all(MISSING)
    if os.environ.get("RANK", "0") == "0":
        print(f"transformers {transformers.__version__}, torch {torch.__version__}", flush=True)
    return run_tests(TESTS)


if __name__ == "__main__":
    sys.exit(main())
