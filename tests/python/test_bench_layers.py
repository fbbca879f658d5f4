"""CPU tests of tdist.bench_layers' --summary rows and its option parsing (no torch, no GPU), and of
the layer moe's PyTorch pieces on CPU tensors (those skip without torch)."""

import json

import pytest

from tdist import bench_layers as bl

SCHEMA = ["layer", "model", "tokens", "pass", "tdist_us", "no_comm_us", "torch_eager_tp_us", "torch_async_tp_us"]


def row(layer, tokens, pas, model="llama3-8b", **times):
    """A row as main() collects it: every method's key, None where it did not run."""
    r = {"layer": layer, "model": model, "tokens": tokens, "pass": pas}
    r.update({f"{m}_us": times.get(m) for m in bl.METHODS})
    return r


def test_rows_flat_in_schema_and_order():
    rows = bl.summary_rows([
        row("decoder", 4096, "fwd", tdist=1744.1, no_comm=1566.5, torch_eager_tp=1941.0, torch_async_tp=1788.6),
        row("decoder", 4096, "fwd+bwd", tdist=6162.4, no_comm=5068.8, torch_eager_tp=5905.3, torch_async_tp=5505.8),
    ])
    assert rows == [
        {"layer": "decoder", "model": "llama3-8b", "tokens": 4096, "pass": "fwd", "tdist_us": 1744.1,
         "no_comm_us": 1566.5, "torch_eager_tp_us": 1941.0, "torch_async_tp_us": 1788.6},
        {"layer": "decoder", "model": "llama3-8b", "tokens": 4096, "pass": "fwd_bwd", "tdist_us": 6162.4,
         "no_comm_us": 5068.8, "torch_eager_tp_us": 5905.3, "torch_async_tp_us": 5505.8},
    ]
    assert all(list(r) == SCHEMA for r in rows)


def test_method_not_run_is_null_and_errors_dropped():
    r = row("mlp", 16384, "fwd+bwd", tdist=10.0, no_comm=8.0, torch_eager_tp=12.0)
    r["errors"] = {"torch_async_tp": "RuntimeError: no symm_mem"}
    missing = row("attention", 2048, "fwd", tdist=3.0)
    del missing["torch_async_tp_us"]  # an older row without the method's key at all
    rows = bl.summary_rows([r, missing])
    assert [list(x) for x in rows] == [SCHEMA, SCHEMA]
    assert rows[0]["torch_async_tp_us"] is None and rows[0]["pass"] == "fwd_bwd"
    assert rows[1]["torch_async_tp_us"] is None and rows[1]["no_comm_us"] is None and rows[1]["tdist_us"] == 3.0
    text = json.dumps(rows)  # what --summary writes: a list, null for the missing times
    assert json.loads(text)[0]["torch_async_tp_us"] is None and '"torch_async_tp_us": null' in text


def test_pass_names():
    assert [r["pass"] for r in bl.summary_rows([row("mlp", 2048, p) for p in ("fwd", "fwd+bwd")])] == \
        ["fwd", "fwd_bwd"]
    assert bl.summary_rows([row("mlp", 2048, "fwd_bwd")])[0]["pass"] == "fwd_bwd"  # already the summary's name
    with pytest.raises(ValueError, match="unknown pass"):
        bl.summary_rows([row("mlp", 2048, "bwd")])


def test_one_row_per_case():
    with pytest.raises(ValueError, match="two rows"):
        bl.summary_rows([row("mlp", 2048, "fwd", tdist=1.0), row("mlp", 2048, "fwd", tdist=2.0)])
    # the same case in another pass, size or layer is another row
    assert len(bl.summary_rows([row("mlp", 2048, "fwd"), row("mlp", 2048, "fwd+bwd"), row("mlp", 4096, "fwd"),
                                row("decoder", 2048, "fwd")])) == 4


def test_options():
    args = bl._parse([])
    assert args.tokens == [2048, 4096, 8192, 16384] and args.summary is None
    assert args.passes == ["fwd", "fwd+bwd"]
    args = bl._parse(["--tokens", "4096,16384,4096", "--passes", "fwd_bwd,fwd", "--models", "8b",
                      "--summary", "s.json"])
    assert args.tokens == [4096, 16384] and args.passes == ["fwd+bwd", "fwd"] and args.summary == "s.json"
    for bad in (["--tokens", "4k"], ["--passes", "bwd"], ["--summary"]):
        with pytest.raises(SystemExit):
            bl._parse(bad)


# --- the layer moe -----------------------------------------------------------------------------------

def test_moe_rows_in_schema():
    r = row("moe", 4096, "fwd+bwd", model="Qwen3-30B-A3B", tdist=900.0, no_comm=700.0, torch_eager_tp=1500.0)
    r["max_rel_err"] = {"no_comm_vs_tdist": 0.004, "torch_eager_tp_vs_tdist": 0.006}  # JSON rows only
    dense = row("mlp", 4096, "fwd+bwd", tdist=1.0)
    rows = bl.summary_rows([r, row("moe", 4096, "fwd", model="Qwen3-30B-A3B", tdist=300.0), dense])
    assert [list(x) for x in rows] == [SCHEMA] * 3
    assert rows[0] == {"layer": "moe", "model": "Qwen3-30B-A3B", "tokens": 4096, "pass": "fwd_bwd", "tdist_us": 900.0,
                       "no_comm_us": 700.0, "torch_eager_tp_us": 1500.0, "torch_async_tp_us": None}
    assert rows[1]["pass"] == "fwd" and rows[1]["torch_async_tp_us"] is None
    # the same tokens and pass in another model or layer is another row
    assert len(bl.summary_rows([r, row("moe", 4096, "fwd+bwd", model="DeepSeek-V2-Lite"), dense])) == 3


def test_moe_options_pick_models_by_kind():
    args = bl._parse(["--layers", "moe"])
    assert args.layers == ["moe"] and args.models == ["qwen3", "dsv2lite"] and args.moe_routing == "uniform"
    args = bl._parse(["--models", "qwen3"])  # no --layers: the layers of the models' kinds
    assert args.layers == ["moe"] and args.models == ["qwen3"]
    args = bl._parse(["--models", "8b,mixtral"])
    assert args.layers == ["decoder", "attention", "mlp", "moe"] and args.models == ["8b", "mixtral"]
    args = bl._parse(["--layers", "mlp,moe"])
    assert args.models == ["8b", "70b", "qwen3", "dsv2lite"]
    args = bl._parse(["--layers", "moe", "--models", "dsv2lite,qwen3,dsv2lite", "--moe-routing", "skewed",
                      "--tdist-method", "chunked", "--passes", "fwd_bwd"])
    assert args.models == ["dsv2lite", "qwen3"] and args.moe_routing == "skewed" and args.passes == ["fwd+bwd"]
    assert [bl.model_kind(m) for m in ("8b", "70b", "qwen3", "dsv2lite", "mixtral")] == ["dense"] * 2 + ["moe"] * 3
    assert bl.MOE_MODELS["qwen3"][1:] == (2048, 768, 128, 8) and bl.MOE_MODELS["dsv2lite"][1:] == (2048, 1408, 64, 6)


@pytest.mark.parametrize("argv,words", [
    (["--layers", "moe", "--models", "8b"], ["--layers moe", "needs a model of its kind", "qwen3"]),
    (["--layers", "mlp", "--models", "8b,qwen3"], ["--models qwen3", "no layer of --layers"]),
    (["--layers", "moe", "--tdist-method", "sequential"],
     ["--tdist-method sequential", "auto, fused, chunked, baseline"]),
    (["--layers", "moe", "--moe-routing", "hot"], ["--moe-routing"]),
    (["--layers", "moe,ffn"], ["unknown layers 'ffn'"]),
    (["--models", "qwen4"], ["unknown models 'qwen4'"]),
])
def test_moe_option_errors(argv, words, capsys):
    with pytest.raises(SystemExit):
        bl._parse(argv)
    err = capsys.readouterr().err
    for w in words:
        assert w in err, (w, err)


def test_moe_shapes():
    assert bl._moe_shapes("qwen3", 1, 2) == ("Qwen3-30B-A3B", 2048, 768, 128, 8)
    assert bl._moe_shapes("dsv2lite", 2, 8) == ("DeepSeek-V2-Lite", 1024, 704, 64, 6)
    with pytest.raises(SystemExit, match="intermediate=768"):
        bl._moe_shapes("qwen3", 1, 5)  # 768 does not split over 5 ranks


def _experts_reference(tokens, ids, weights, w13, w2):
    """float64 loop over tokens and slots of sum_j weights[t, j] expert_{ids[t, j]}(tokens[t])."""
    torch = pytest.importorskip("torch")
    f = w2.shape[2]
    out = []
    for t in range(tokens.shape[0]):
        acc = tokens.new_zeros(w2.shape[1])
        for j in range(ids.shape[1]):
            a = w13[ids[t, j]] @ tokens[t]
            acc = acc + weights[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(a[:f]) * a[f:]))
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("dtype_name,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_moe_experts_torch_both_grouped_mms(dtype_name, tol):
    """torch_eager_tp's expert math (sort by expert, grouped GEMMs, un-sort, weighted top-k sum) and its
    autograd against a float64 loop, with torch._grouped_mm and with tdist.bench_moe's loop, two
    experts without tokens."""
    torch = pytest.importorskip("torch", reason="the moe pieces need torch")
    from tdist import bench_moe
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(11)
    m, k, experts, hidden, f = 37, 3, 6, 16, 24
    ids = torch.stack([torch.randperm(experts - 2, generator=g)[:k] for _ in range(m)]).to(torch.int32)
    weights = torch.softmax(torch.randn((m, k), generator=g), 1)
    tokens = torch.randn((m, hidden), generator=g)
    w13 = torch.randn((experts, 2 * f, hidden), generator=g) * 0.3
    w2 = torch.randn((experts, hidden, f), generator=g) * 0.3
    dy = torch.randn((m, hidden), generator=g)
    leaves64 = [t.double().requires_grad_() for t in (tokens, weights, w13, w2)]
    ref = _experts_reference(leaves64[0], ids.long(), *leaves64[1:])
    (ref * dy.double()).sum().backward()
    fns = bl.grouped_mm_functions(torch)
    assert set(fns) == {bench_moe.GROUPED_MM, bench_moe.GROUPED_MM_LOOP}
    for name, grouped_mm in fns.items():
        if name == bench_moe.GROUPED_MM and not hasattr(torch, "_grouped_mm"):
            continue
        leaves = [t.to(dtype).clone().requires_grad_() for t in (tokens, weights, w13, w2)]
        leaves[1] = weights.clone().requires_grad_()  # the router's weights stay fp32
        try:
            y = bl.moe_experts_torch(torch, leaves[0], ids, leaves[1], leaves[2], leaves[3], grouped_mm)
        except RuntimeError:  # torch._grouped_mm without a CPU kernel in this torch
            if name == bench_moe.GROUPED_MM:
                continue
            raise
        assert y.shape == (m, hidden) and y.dtype == dtype
        (y.float() * dy).sum().backward()
        for what, got, want in [("y", y, ref)] + [(n, t.grad, r.grad) for n, t, r in
                                                  zip(("tokens", "weights", "w13", "w2"), leaves, leaves64)]:
            err = (got.double() - want).abs().max() / want.abs().max()
            assert err <= tol, (name, what, float(err))
        assert bool((leaves[2].grad[experts - 2:] == 0).all()) and bool((leaves[3].grad[experts - 2:] == 0).all())


def test_fixed_gathered_stands_for_a_gather():
    torch = pytest.importorskip("torch", reason="the moe pieces need torch")
    fixed = bl.fixed_gathered(torch)
    local = torch.randn((2, 3), requires_grad=True)
    full = torch.randn((5, 3))
    out = fixed.apply(local, full, 1)
    assert torch.equal(out, full) and out.requires_grad
    (out * torch.arange(15.0).view(5, 3)).sum().backward()
    assert local.grad.tolist() == [[3.0, 4.0, 5.0], [6.0, 7.0, 8.0]]  # rows 1 .. 2 of the gradient, no sum


def test_moe_check_compares_no_comm_only_at_one_rank():
    # no_comm's output is this rank's partial sum at two ranks and up: comparing it would fail a
    # correct run.
    assert bl.moe_check_methods(1) == ("tdist", "no_comm", "torch_eager_tp")
    for world in (2, 4, 8):
        assert bl.moe_check_methods(world) == ("tdist", "torch_eager_tp")
