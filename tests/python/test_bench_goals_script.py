"""CPU tests of scripts/bench-goals: its usage (the committed run's --out) and argument errors, and,
on a machine without GPUs, the error that says so. The benchmarks themselves need GPUs."""

import os
import shutil
import subprocess

import pytest

from repo_scripts import REPO

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


def test_parts_run_their_benchmarks(tmp_path):
    """The Python parts with stand-ins for nvidia-smi (two GPUs) and the python that has torch (it
    records each call and writes an empty summary where one is asked for): each part's command, the
    files named in --out, the goal table last, and a part that fails named at the end."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: H200'\necho 'GPU 1: H200'\n")
    calls = tmp_path / "calls.txt"
    fake_py = bindir / "fake-python"
    fake_py.write_text(f"""#!/bin/sh
echo "$*" >> "{calls}"
case "$*" in
  *"import matplotlib"*) exit 1 ;;
  *tdist.bench_triton*) echo "triton failed" >&2; exit 3 ;;
esac
prev=
for a in "$@"; do
  case "$prev" in --json|--summary) echo '[]' > "$a" ;; esac
  prev=$a
done
exit 0
""")
    for f in bindir.iterdir():
        f.chmod(0o755)
    out_dir = tmp_path / "goals"
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", PYTHON=str(fake_py),
               TDIST_BUILD_DIR=str(tmp_path / "build"))
    args = ["--out", str(out_dir)] + [x for p in ("flash_decode", "moe", "triton", "layers") for x in ("--part", p)]
    out = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 1, out.stderr
    assert "bench-goals: failed: triton" in out.stderr
    log = calls.read_text()
    for command in ("-m tdist.bench_flash_decode --models 8b,70b", "-m tdist.bench_moe --json",
                    "-m tdist.bench_triton --op all", "-m tdist.bench_layers --models 8b,70b,qwen3,dsv2lite"):
        assert f"-m torch.distributed.run --nproc-per-node 2 {command}" in log, command
    assert "--plot" not in log  # no matplotlib: no plot asked for
    for name in ("flash_decode_summary.json", "moe_summary.json", "layers_summary.json", "layers.json"):
        assert (out_dir / name).read_text().strip() == "[]", name
    assert "triton failed" in (out_dir / "triton.txt").read_text()
    table = out.stdout[out.stdout.index("bench-goals: goals"):]
    assert "triton_summary.json: no such file" in table and "random_shapes_summary.json: no such file" in table
