"""CPU tests of tdist.nn's plan checks (plain Python: no torch, no GPU)."""

import subprocess
import sys

import pytest

from tdist.nn import STYLES, Layer, Target, check_plan, pattern_matches, resolve_plan


def llama_layers(n_layers=2, hidden=64, inter=176, kv=32):
    """The modules of a small Llama-style model, as named_modules() lists them."""
    layers = [Layer("", "LlamaModel", False), Layer("embed", "Embedding", False), Layer("layers", "ModuleList", False)]
    for i in range(n_layers):
        p = f"layers.{i}"
        layers += [
            Layer(p, "DecoderLayer", False),
            Layer(f"{p}.self_attn", "Attention", False),
            Layer(f"{p}.self_attn.q_proj", "Linear", True, hidden, hidden),
            Layer(f"{p}.self_attn.k_proj", "Linear", True, hidden, kv),
            Layer(f"{p}.self_attn.v_proj", "Linear", True, hidden, kv),
            Layer(f"{p}.self_attn.o_proj", "Linear", True, hidden, hidden),
            Layer(f"{p}.mlp", "MLP", False),
            Layer(f"{p}.mlp.gate_proj", "Linear", True, hidden, inter),
            Layer(f"{p}.mlp.up_proj", "Linear", True, hidden, inter),
            Layer(f"{p}.mlp.down_proj", "Linear", True, inter, hidden),
            Layer(f"{p}.input_layernorm", "RMSNorm", False),
        ]
    layers.append(Layer("lm_head", "Linear", True, hidden, 1000))
    return layers


PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.[kv]_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.*_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",  # down_proj also matches "*_proj" above: two styles
}


def expect(fn, *fragments):
    with pytest.raises(ValueError) as info:
        fn()
    for f in fragments:
        assert f in str(info.value), f"'{f}' not in '{info.value}'"
    return str(info.value)


def test_patterns_match_per_dotted_part():
    assert pattern_matches("layers.*.mlp.up_proj", "layers.0.mlp.up_proj")
    assert pattern_matches("layers.1?.mlp.up_proj", "layers.12.mlp.up_proj")
    assert not pattern_matches("layers.*.up_proj", "layers.0.mlp.up_proj")  # * stays within one part
    assert not pattern_matches("layers.*", "layers.0.mlp")
    assert pattern_matches("lm_head", "lm_head") and not pattern_matches("lm_head", "lm_head2")
    assert pattern_matches("layers.*.self_attn.[kv]_proj", "layers.3.self_attn.v_proj")
    assert not pattern_matches("layers.*.self_attn.[kv]_proj", "layers.3.self_attn.q_proj")


def test_resolves_in_model_order():
    plan = {"layers.*.mlp.down_proj": "rowwise", "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
            "layers.*.self_attn.[qkv]_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise_replicated"}
    targets = resolve_plan(plan, llama_layers(), 2)
    assert all(isinstance(t, Target) for t in targets)
    names = [t.name for t in targets]
    assert names == [f"layers.{i}.{m}" for i in range(2) for m in
                     ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    styles = {t.name: t.style for t in targets}
    assert styles["layers.1.self_attn.o_proj"] == "rowwise_replicated"
    assert styles["layers.0.mlp.down_proj"] == "rowwise" and styles["layers.0.mlp.up_proj"] == "colwise"
    assert {t.pattern for t in targets if t.name.endswith("k_proj")} == {"layers.*.self_attn.[qkv]_proj"}
    # the same style from two patterns is fine
    both = resolve_plan({"layers.*.mlp.*_proj": "colwise", "layers.0.mlp.up_proj": "colwise"},
                        [layer for layer in llama_layers() if "down" not in layer.name], 4)
    assert len(both) == 4


def test_unknown_layer_is_named():
    msg = expect(lambda: resolve_plan({"layers.*.mlp.w1": "colwise"}, llama_layers(), 2),
                 "'layers.*.mlp.w1'", "matches no module")
    assert "layers.0.self_attn.q_proj" in msg  # a hint of the names the model has
    expect(lambda: resolve_plan({"decoder.*.fc": "rowwise"}, [Layer("", "Net", False)], 2), "has no nn.Linear")


def test_non_linear_target_is_named():
    expect(lambda: resolve_plan({"layers.*.input_layernorm": "colwise"}, llama_layers(), 2),
           "layer 'layers.0.input_layernorm'", "is a RMSNorm", "expected a torch.nn.Linear")
    expect(lambda: resolve_plan({"layers.*.mlp": "rowwise"}, llama_layers(), 2), "'layers.0.mlp'", "is a MLP")


def test_shapes_not_divisible_by_world_size():
    # colwise splits out_features: k_proj's 32 over 3 ranks
    expect(lambda: resolve_plan({"layers.*.self_attn.k_proj": "colwise"}, llama_layers(), 3),
           "layer 'layers.0.self_attn.k_proj'", "out_features=32", "divisible by 3")
    # rowwise splits in_features: down_proj's 176 over 32 ranks; its out_features (64) would divide
    expect(lambda: resolve_plan({"layers.*.mlp.down_proj": "rowwise"}, llama_layers(), 32),
           "'layers.0.mlp.down_proj'", "splits in_features over 32 ranks", "in_features=176")
    expect(lambda: resolve_plan({"layers.*.mlp.down_proj": "rowwise_replicated"}, llama_layers(), 32),
           "in_features divisible by 32")
    # the same layers divide at 2 ranks, and 176 / 16 = 11 rows too (no multiple-of-8 rule in the plan)
    assert len(resolve_plan({"layers.*.mlp.down_proj": "rowwise"}, llama_layers(), 16)) == 2


def test_heads_are_not_split():
    # a layer that knows its attention block's head_dim: 96 features = 6 heads of 16
    layers = [Layer("attn", "Attention", False), Layer("attn.q_proj", "Linear", True, 64, 96, 16),
              Layer("attn.o_proj", "Linear", True, 96, 64, 16)]
    assert [t.name for t in resolve_plan({"attn.q_proj": "colwise", "attn.o_proj": "rowwise"}, layers, 3)] == \
        ["attn.q_proj", "attn.o_proj"]
    # 4 ranks divide the 96 features (24 each) but not the 6 heads
    expect(lambda: resolve_plan({"attn.q_proj": "colwise"}, layers, 4), "layer 'attn.q_proj'",
           "96 out_features (6 heads of 16) over 4 ranks, 24 each", "head count divisible by 4")
    expect(lambda: resolve_plan({"attn.o_proj": "rowwise_replicated"}, layers, 4), "layer 'attn.o_proj'",
           "96 in_features")
    # without head_dim only the features are checked
    plain = [Layer("fc", "Linear", True, 64, 96)]
    assert len(resolve_plan({"fc": "colwise"}, plain, 4)) == 1


def test_bad_styles_and_plans():
    msg = expect(lambda: resolve_plan({"lm_head": "columnwise"}, llama_layers(), 2), "'lm_head'", "'columnwise'")
    for style in STYLES:
        assert f'"{style}"' in msg
    expect(lambda: resolve_plan({"lm_head": None}, llama_layers(), 2), "style None")
    expect(lambda: resolve_plan([("lm_head", "colwise")], llama_layers(), 2), "plan must be a dict", "list")
    expect(lambda: resolve_plan({}, llama_layers(), 2), "plan is empty")
    expect(lambda: resolve_plan({"layers..mlp": "colwise"}, llama_layers(), 2), "not a dotted module name")
    expect(lambda: resolve_plan({3: "colwise"}, llama_layers(), 2), "plan key 3")
    expect(lambda: resolve_plan({"lm_head": "colwise"}, llama_layers(), 0), "world_size must be a positive int")
    expect(lambda: resolve_plan({"lm_head": "colwise"}, llama_layers(), True), "world_size")
    assert check_plan({"a.b": "rowwise"}) == [("a.b", "rowwise")]


def test_two_styles_for_one_layer():
    expect(lambda: resolve_plan(PLAN, llama_layers(), 2),
           "layer 'layers.0.mlp.down_proj'", "'layers.*.mlp.*_proj'", '"colwise"', "one style per layer")
    expect(lambda: resolve_plan({"lm_head": "colwise", "lm_hea?": "rowwise"}, llama_layers(), 2),
           "'lm_head' is matched by 'lm_head'")


def test_model_itself_cannot_be_a_target():
    layers = [Layer("", "Linear", True, 64, 64)]
    # the root's name is "": a bare wildcard reaches it, and a module cannot replace itself in place
    expect(lambda: resolve_plan({"*": "colwise"}, layers, 2), "names the model itself")


def test_nn_modules_need_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import tdist, tdist.nn\n"
            "assert tdist.nn.resolve_plan({'fc': 'colwise'}, [tdist.nn.Layer('fc', 'Linear', True, 8, 8)], 2)\n"
            "try:\n"
            "    tdist.nn.parallelize\n"
            "except tdist.Error as e:\n"
            "    assert 'tdist.nn needs PyTorch' in str(e), e\n"
            "else:\n"
            "    raise SystemExit('tdist.nn.parallelize without torch')\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
