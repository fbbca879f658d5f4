"""CPU tests of tdist.bench_layers' --summary rows and its option parsing. No torch, no GPU."""

import json

import pytest

from tdist import bench_layers as bl

SCHEMA = ["layer", "model", "tokens", "pass", "tdist_us", "no_comm_us", "torch_eager_tp_us", "torch_async_tp_us"]


def row(layer, tokens, pas, **times):
    """A row as main() collects it: every method's key, None where it did not run."""
    r = {"layer": layer, "model": "llama3-8b", "tokens": tokens, "pass": pas}
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
