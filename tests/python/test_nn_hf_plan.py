"""CPU tests of tdist.nn's plan checks on Hugging Face transformers models (torch + transformers; no
GPU, no tdist runtime): the plans of docs/nn.md, "Converting a Hugging Face model", resolved over the
modules of small Llama and Qwen2 models built from a config, as tdist.nn.parallelize resolves them,
and the errors for a pattern that names nothing and for sizes the world size does not divide.
Skipped, saying so, without torch or transformers (tests/python/gpu_test_hf.py runs the converted
models on GPUs)."""

import pytest

import tdist.nn
from tdist.nn import resolve_plan
from test_nn_plan import expect

torch = pytest.importorskip("torch", reason="needs torch (transformers' models)")
transformers = pytest.importorskip("transformers", reason="needs transformers: pip install 'transformers>=5'")

# docs/nn.md: every rank feeds its rows of the sequence to the MLP and gets its rows back
LLAMA_MLP_PLAN = {
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}
# docs/nn.md: every rank runs the whole sequence through its heads and intermediate features
LLAMA_REPLICATED_PLAN = {
    "model.layers.*.self_attn.[qkv]_proj": "colwise_replicated",
    "model.layers.*.self_attn.o_proj": "rowwise_replicated",
    "model.layers.*.mlp.gate_proj": "colwise_replicated",
    "model.layers.*.mlp.up_proj": "colwise_replicated",
    "model.layers.*.mlp.down_proj": "rowwise_replicated",
}
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")


def layers_of(model):
    """The model's modules as tdist.nn.parallelize describes them to resolve_plan."""
    return tdist.nn.plan_layers(model)


def small_config(cls, **kw):
    # hidden 24, 6 query heads and 2 key/value heads of 8 (q_proj 48 features, k/v 16), intermediate 88
    return cls(vocab_size=64, hidden_size=24, intermediate_size=88, num_hidden_layers=2, num_attention_heads=6,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False, **kw)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(small_config(transformers.LlamaConfig))


def test_llama_plans_resolve(llama):
    layers = layers_of(llama)
    for world in (1, 2):
        targets = resolve_plan(LLAMA_REPLICATED_PLAN, layers, world)
        assert [t.name for t in targets] == [f"model.layers.{i}.{p}" for i in range(2) for p in PROJ]
        styles = {t.name.partition(".layers.")[2].partition(".")[2]: t.style for t in targets}
        assert styles == {p: "rowwise_replicated" if p in ("self_attn.o_proj", "mlp.down_proj") else
                          "colwise_replicated" for p in PROJ}
        mlp = resolve_plan(LLAMA_MLP_PLAN, layers, world)
        assert [(t.name, t.style) for t in mlp] == [(f"model.layers.{i}.mlp.{p}", s) for i in range(2) for p, s in
                                                    (("gate_proj", "colwise"), ("up_proj", "colwise"),
                                                     ("down_proj", "rowwise"))]
    # the same plans without "model." on the base model (LlamaModel, gpu_test_hf.py's)
    base = layers_of(llama.model)
    bare = {k.removeprefix("model."): v for k, v in LLAMA_REPLICATED_PLAN.items()}
    assert [t.name for t in resolve_plan(bare, base, 2)] == [f"layers.{i}.{p}" for i in range(2) for p in PROJ]
    # lm_head stays whole unless named
    assert all("lm_head" not in t.name for t in resolve_plan(LLAMA_REPLICATED_PLAN, layers, 2))


def test_qwen2_uses_the_same_patterns():
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(small_config(transformers.Qwen2Config))
    layers = layers_of(model)
    q = next(layer for layer in layers if layer.name == "model.layers.0.self_attn.q_proj")
    assert (q.in_features, q.out_features) == (24, 48)
    assert len(resolve_plan(LLAMA_REPLICATED_PLAN, layers, 2)) == 14
    assert len(resolve_plan(LLAMA_MLP_PLAN, layers, 2)) == 6


def test_unknown_pattern_is_named(llama):
    layers = layers_of(llama)
    msg = expect(lambda: resolve_plan({"model.layers.*.mlp.w1": "colwise"}, layers, 2),
                 "'model.layers.*.mlp.w1'", "matches no module")
    assert "model.layers.0.self_attn.q_proj" in msg  # the names the model has
    # a LlamaModel plan on LlamaForCausalLM (whose decoder layers are under "model."): named, with the hint
    msg = expect(lambda: resolve_plan({"layers.*.mlp.gate_proj": "colwise"}, layers, 2),
                 "'layers.*.mlp.gate_proj'", "matches no module")
    assert "model.layers.0.mlp.gate_proj" in msg
    # a module that is not an nn.Linear
    expect(lambda: resolve_plan({"model.layers.*.mlp.act_fn": "colwise"}, layers, 2),
           "layer 'model.layers.0.mlp.act_fn'", "expected a torch.nn.Linear")
    expect(lambda: resolve_plan({"model.layers.*.input_layernorm": "rowwise"}, layers, 2),
           "layer 'model.layers.0.input_layernorm'", "is a LlamaRMSNorm")


def test_sizes_not_divisible_by_world_size(llama):
    layers = layers_of(llama)
    # k_proj's 16 output features over 3 ranks (q_proj's 48 divide): the first layer that fails, in model order
    expect(lambda: resolve_plan(LLAMA_REPLICATED_PLAN, layers, 3), "layer 'model.layers.0.self_attn.k_proj'",
           "out_features=16", "as \"colwise_replicated\"", "divisible by 3")
    # the MLP: gate_proj's 88 output features over 16 ranks
    expect(lambda: resolve_plan(LLAMA_MLP_PLAN, layers, 16), "layer 'model.layers.0.mlp.gate_proj'",
           "out_features=88", "divisible by 16")
    # rowwise splits the input features: down_proj's 88 over 3 ranks
    expect(lambda: resolve_plan({"model.layers.*.mlp.down_proj": "rowwise"}, layers, 3),
           "layer 'model.layers.0.mlp.down_proj'", "splits in_features over 3 ranks", "in_features=88")
    # 2 ranks: 3 query heads and 1 key/value head each (the attention block's head_dim, 8, is known)
    assert layers[[x.name for x in layers].index("model.layers.0.self_attn.q_proj")].head_dim == 8
    assert len(resolve_plan(LLAMA_REPLICATED_PLAN, layers, 2)) == 14


def test_heads_not_divisible_by_world_size(llama):
    layers = layers_of(llama)
    # 4 ranks divide q_proj's 48 features (12 each) but not its 6 heads of 8: named, not split
    expect(lambda: resolve_plan({"model.layers.*.self_attn.q_proj": "colwise_replicated"}, layers, 4),
           "layer 'model.layers.0.self_attn.q_proj'", "6 heads of 8", "over 4 ranks, 12 each",
           "head count divisible by 4")
    # o_proj, rowwise: its 48 input features over 8 ranks; the MLP has no head_dim: 88 / 8 passes
    expect(lambda: resolve_plan({"model.layers.*.self_attn.o_proj": "rowwise_replicated"}, layers, 8),
           "layer 'model.layers.0.self_attn.o_proj'", "48 in_features", "over 8 ranks")
    assert len(resolve_plan(LLAMA_MLP_PLAN, layers, 8)) == 6
