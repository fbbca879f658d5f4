"""CPU tests of scripts/bench-goals: its usage (the committed run's --out) and argument errors, and,
on a machine without GPUs, the error that says so. The benchmarks themselves need GPUs."""

import os
import shutil
import subprocess

import pytest

REPO = os.environ.get("TDIST_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
SCRIPT = os.path.join(REPO, "scripts", "bench-goals")

if not os.path.exists(SCRIPT):
    pytest.skip("scripts/bench-goals is not beside these tests", allow_module_level=True)
if shutil.which("bash") is None:
    pytest.skip("no bash", allow_module_level=True)


def run(*args, tmp_path):
    env = dict(os.environ, TDIST_BUILD_DIR=str(tmp_path / "build"))
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=60, env=env)


def test_usage_names_the_parts_and_the_committed_run(tmp_path):
    out = run("--help", tmp_path=tmp_path)
    assert out.returncode == 0
    assert "flash_decode|moe|triton|layers|random" in out.stdout
    assert "scripts/bench-goals --out bench/results/h200x2" in out.stdout


@pytest.mark.parametrize("args,message", [
    (("--part", "decode"), "unknown part 'decode'"),
    (("--gpus", "1"), "--gpus: expected an integer >= 2, got '1'"),
    (("--out",), "--out needs a value"),
    (("--bogus",), "unknown argument '--bogus'"),
])
def test_argument_errors(tmp_path, args, message):
    out = run(*args, tmp_path=tmp_path)
    assert out.returncode == 2
    assert message in out.stderr and "usage:" in out.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi: it would run")
def test_without_gpus_says_so(tmp_path):
    out = run("--out", str(tmp_path / "goals"), "--part", "moe", tmp_path=tmp_path)
    assert out.returncode == 1
    assert "needs 2 or more GPUs (found 0)" in out.stderr
