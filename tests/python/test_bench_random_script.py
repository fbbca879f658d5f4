"""CPU tests of scripts/bench-random: its usage (the committed run's --out), argument errors, and
its summary part, which needs no GPU: it reads the sweep files of --out and prints the goal table
last."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from repo_scripts import REPO

SCRIPT = os.path.join(REPO, "scripts", "bench-random")

if not os.path.exists(SCRIPT) or not os.path.exists(os.path.join(REPO, "bench", "random_summary.py")):
    pytest.skip("scripts/bench-random and bench/random_summary.py are not beside these tests", allow_module_level=True)
if shutil.which("bash") is None:
    pytest.skip("no bash", allow_module_level=True)


def run(*args, tmp_path):
    # python3 of the script is this interpreter; TDIST_BUILD_DIR keeps its default folder in tmp_path
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    wrapper = bindir / "python3"
    if not wrapper.exists():  # a wrapper, not a link: a virtual environment's python finds its packages
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        wrapper.chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
               TDIST_BUILD_DIR=str(tmp_path / "build"))
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=120, env=env)


def test_usage_names_the_committed_run(tmp_path):
    out = run("--help", tmp_path=tmp_path)
    assert out.returncode == 0
    assert "scripts/bench-random --out bench/results/h200x2" in out.stdout
    assert "build-gpu/random-sweep" in out.stdout


@pytest.mark.parametrize("args,message", [(["--seed"], "--seed needs a value"), (["--part", "gemm"], "unknown part"),
                                          (["--sizes", "x"], "non-negative integer"), (["--bogus"], "unknown argument")])
def test_bad_arguments(args, message, tmp_path):
    out = run(*args, tmp_path=tmp_path)
    assert out.returncode == 2
    assert message in out.stderr and "usage:" in out.stderr


def sweep(path, bench, rows):
    path.write_text(json.dumps({"schema": "tdist.bench/1", "bench": bench, "gpu": "test", "world_size": 2,
                                "rows": rows}))


def test_summary_part_prints_the_goal_table_last(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    coll = []
    for i in range(3):
        nbytes = 4096 + 2 * i
        coll += [{"op": "all_reduce", "bytes": nbytes, "impl": "tdist", "method": "auto:ll", "us": 5.0},
                 {"op": "all_reduce", "bytes": nbytes, "impl": "tdist", "method": "one_shot", "us": 4.0},
                 {"op": "all_reduce", "bytes": nbytes, "impl": "nccl", "method": "nccl", "us": 6.0}]
    sweep(results / "collectives_random.json", "tdist-bench", coll)
    shape = {"op": "gemm_rs", "m": 4096, "n": 8192, "k": 3584}
    sweep(results / "gemm_rs_random.json", "gemm_overlap", [
        dict(shape, impl="tdist", method="auto", resolved="fused", us=130.0),
        dict(shape, impl="gemm", method="tdist::Gemm", us=100.0),
        dict(shape, impl="nccl+cublas", method="baseline", us=120.0),
        dict(shape, impl="nccl", method="nccl", us=30.0),
        dict(shape, impl="cublas", method="cublas", us=100.0)])
    out = run("--out", str(results), "--part", "summary", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.rstrip("\n").splitlines()
    table = (results / "random_shapes_goals.txt").read_text().splitlines()
    assert table and lines[-len(table):] == table  # the table closes the output, once
    assert sum(line == table[0] for line in lines) == 1
    assert lines[-len(table) - 1].startswith("bench-random: goals (")
    assert any(line.startswith("MISSED") and "1.03 x NCCL + cuBLAS" in line and "worst 1.083" in line
               for line in table)
    assert any(line.startswith("MISSED") and "best method" in line for line in table)  # 5 us vs 4 us
    assert any(line.startswith("MISSED") and "gemm_rs: median auto / GEMM alone" in line for line in table)
    rows = json.loads((results / "random_shapes_summary.json").read_text())
    assert [r["best_method"] for r in rows] == ["one_shot"] * 3 + ["auto:fused"]
    assert not (results / "build.log").exists()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (results / "random_shapes_summary.png").stat().st_size > 1000


def test_summary_part_without_sweeps_says_so(tmp_path):
    out = run("--out", str(tmp_path / "empty"), "--part", "summary", tmp_path=tmp_path)
    assert out.returncode == 1 and "no sweep results in" in out.stderr
