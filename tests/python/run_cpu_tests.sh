#!/usr/bin/env bash
# CPU tests of the Python package: a fresh virtual environment, `pip install .` (scikit-build-core
# builds libtdist and the extension), then pytest on tests/python/test_*.py. No torch, no GPU.
# Needs python3 (>= 3.9) with venv, the CUDA 13 toolkit, NCCL >= 2.28, CMake >= 3.25 and Ninja, and
# PyPI for scikit-build-core, nanobind and pytest (TDIST_PIP_ARGS adds pip options, e.g. a mirror).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-python3}
venv=${TDIST_PY_VENV:-$root/build-python/venv-cpu-tests}
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH

if ! "$python" -c "import venv, ensurepip" 2>/dev/null; then
  # Debian/Ubuntu keep venv's pip bootstrap in a separate package.
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
  else
    echo "run_cpu_tests.sh: $python cannot make a virtual environment (install python3-venv)" >&2
    exit 1
  fi
fi
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q ${TDIST_PIP_ARGS:-} "scikit-build-core>=0.10" "nanobind>=2.0" pytest matplotlib
# Triton compiles tdist.triton's kernels to PTX without a GPU; test_triton_*.py skip, saying so, without it.
"${pip[@]}" install -q ${TDIST_PIP_ARGS:-} "triton>=3.6" || echo "run_cpu_tests.sh: triton not installed; test_triton_*.py will skip"
# Build isolation off: the build uses the packages above (and the system's CMake and Ninja), so the
# same command works on a machine without a package index once they are installed.
CMAKE_BUILD_PARALLEL_LEVEL=${TDIST_BUILD_JOBS:-$(nproc)} \
  "${pip[@]}" install --no-build-isolation ${TDIST_PIP_ARGS:-} "$root"

cd "$root/tests/python"  # the installed package is tested, not python/tdist of the source tree
"$venv/bin/python" -m pytest -q -p no:cacheprovider test_*.py "$@"
