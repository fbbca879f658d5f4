"""CPU tests of bench/goals.py (the 2 x H200 speed goals checked from the summary files) on hand-made
summaries: a goal met, one missed with its worst case named, one not measured, --check's exit
status, an unreadable file. No torch, no GPU."""

import json
import os

from repo_scripts import load_script

goals = load_script("bench/goals.py")


def write(folder, name, rows, wrapped=False):
    with open(os.path.join(folder, name), "w") as f:
        json.dump({"rows": rows} if wrapped else rows, f)


def fd(batch, kv_len, world, tdist, base, floor, per_rank=None):
    return {"model": "llama3-8b", "batch": batch, "kv_len": kv_len, "page_size": 16, "world": world,
            "tdist_us": tdist, "baseline_1gpu": "FlashInfer", "baseline_1gpu_us": base, "sdpa_1gpu_us": None,
            "per_rank_nccl_us": per_rank, "hbm_floor_us": floor}


def layer(name, tdist, no_comm, eager, async_tp):
    return {"layer": name, "model": "llama3-8b", "tokens": 4096, "pass": "fwd", "tdist_us": tdist,
            "no_comm_us": no_comm, "torch_eager_tp_us": eager, "torch_async_tp_us": async_tp}


def lines(out):
    """{goal text: (tag, measured)} of the printed table."""
    result = {}
    for line in out.splitlines():
        tag, rest = line[:6].strip(), line[8:]
        goal, _, measured = rest.rpartition("  ")
        result[goal.strip()] = (tag, measured.strip())
    return result


def test_met_missed_and_unmeasured(tmp_path, capsys):
    write(tmp_path, "flash_decode_summary.json", [
        fd(1, 32768, 1, 40.0, 41.0, 32.0),    # 0.80 of the floor: the HBM goal missed here
        fd(8, 131072, 1, 100.0, 98.0, 100.0),
        fd(8, 131072, 2, 50.0, 98.0, 50.0, per_rank=70.0),
    ], wrapped=True)
    write(tmp_path, "layers_summary.json", [layer("mlp", 102.0, 100.0, 120.0, 110.0),
                                            layer("moe", 100.0, 200.0, 50.0, None)])
    assert goals.main(["--dir", str(tmp_path)]) == 0
    got = lines(capsys.readouterr().out)
    assert got["decode attention, one GPU: baseline / tdist >= 0.95"][0] == "met"
    tag, measured = got["decode attention, one GPU: HBM floor / tdist >= 0.85 from 32768 tokens"]
    assert tag == "MISSED" and measured.startswith("worst 0.800 (llama3-8b batch 1 kv 32768")
    assert got["decode attention, several GPUs: tdist / one-GPU baseline <= 0.55 from 131072 tokens"][0] == "met"  # 0.510
    assert got["decode attention, several GPUs: per rank + NCCL + merge / tdist >= 1.3"][0] == "met"  # 1.4
    assert got["decode attention, several GPUs: tdist / one-GPU baseline <= 1.1 at 4096 tokens"] == ("-", "not measured")
    assert got["layers: tdist / no communication <= 1.03"][0] == "met"  # the MoE row has no goal
    assert got["layers: PyTorch eager TP / tdist >= 1.1"][0] == "met"
    assert got["moe_summary.json: no such file"] == ("-", "not measured")
    assert goals.main(["--dir", str(tmp_path), "--check"]) == 1


def test_moe_triton_and_random(tmp_path, capsys):
    write(tmp_path, "moe_summary.json", [
        {"op": "moe_ag_group_gemm", "model": "qwen3", "m": 4096, "routing": "uniform", "tdist_us": 105.0,
         "group_gemm_us": 100.0, "baseline_us": 140.0, "torch_grouped_mm_us": 96.0},
        {"op": "moe_group_gemm_rs", "model": "qwen3", "m": 1024, "routing": "skewed", "tdist_us": 50.0,
         "group_gemm_us": 40.0, "baseline_us": 45.0, "torch_grouped_mm_us": 40.0},
    ])
    write(tmp_path, "triton_summary.json", [
        {"op": "ag_gemm", "m": 4096, "n": 28672, "k": 8192, "triton_us": 1150.0, "cpp_us": 1000.0,
         "torch_fused_us": 1200.0, "baseline_us": 1300.0},
        {"op": "ag_gemm", "m": 1024, "n": 28672, "k": 8192, "triton_us": 900.0, "cpp_us": 500.0,
         "torch_fused_us": 400.0, "baseline_us": 600.0},  # below 4096 rows: no goal
    ])
    write(tmp_path, "random_shapes_summary.json", [
        {"op": "all_reduce", "m": None, "n": None, "k": None, "bytes": 1 << 20, "auto_us": 10.0, "best_us": 10.0,
         "best_method": "ll", "baseline_us": 12.0, "gemm_us": None}])
    assert goals.main(["--dir", str(tmp_path), "--check"]) == 1
    got = lines(capsys.readouterr().out)
    assert got["MoE grouped GEMM: torch._grouped_mm / tdist >= 0.95"][0] == "met"  # worst 0.96
    assert got["MoE ag: tdist / grouped GEMM alone <= 1.1 from 4096 tokens"][0] == "met"
    assert got["MoE ag: PyTorch sequence / tdist >= 1.25 from 4096 tokens"][0] == "met"  # 1.333
    assert got["MoE rs: tdist / grouped GEMM alone <= 1.12 from 4096 tokens"] == ("-", "not measured")
    tag, measured = got["MoE, every op: PyTorch sequence / tdist >= 1 at 1024 tokens"]
    assert tag == "MISSED" and "moe_group_gemm_rs qwen3 m 1024 skewed" in measured
    tag, measured = got["Triton / C++ <= 1.1 from 4096 rows"]
    assert tag == "MISSED" and measured.startswith("worst 1.150 (ag_gemm 4096 x 28672 x 8192)")
    assert got["Triton / torch's fused op < 1 from 4096 rows"][0] == "met"
    assert any(goal.startswith("random shapes, ") for goal in got)


def test_unreadable_file(tmp_path, capsys):
    (tmp_path / "moe_summary.json").write_text("{not json")
    assert goals.main(["--dir", str(tmp_path)]) == 2
    assert "moe_summary.json" in capsys.readouterr().err
