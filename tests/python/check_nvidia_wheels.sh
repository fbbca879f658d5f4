#!/usr/bin/env bash
# Installs NVIDIA's CUDA runtime, NVRTC and NCCL wheels (tdist's extra `cuda`) into the virtual
# environment of the given python, where tdist is installed, then checks that `import tdist` works
# with LD_LIBRARY_PATH unset and that the CUDA runtime and NCCL it loaded are the wheels' (libtdist's
# RUNPATH names only $ORIGIN/../nvidia/*; the system's CUDA is not on any path it searches first).
set -euo pipefail
python=${1:?usage: check_nvidia_wheels.sh PYTHON}
"$python" -m pip --disable-pip-version-check install -q ${TDIST_PIP_ARGS:-} \
  "nvidia-cuda-runtime>=13.0,<14" "nvidia-cuda-nvrtc>=13.0,<14" "nvidia-nccl-cu13>=2.28"
# Twice: with tdist's own loading, and with TDIST_PRELOAD=0 (libtdist's RUNPATH alone).
for preload in 1 0; do
env -u LD_LIBRARY_PATH -u CUDA_HOME -u CUDA_PATH TDIST_PRELOAD=$preload "$python" - <<'PY'
import os
import tdist
from tdist import _C

maps = open("/proc/self/maps").read().split()
libs = {os.path.basename(p): p for p in maps if "/" in p}
for soname in ("libcudart.so.13", "libnccl.so.2"):
    path = libs.get(soname)
    assert path is not None, f"{soname} is not loaded"
    assert "/nvidia/" in path and "site-packages" in path, f"{soname} came from {path}, not the nvidia-* wheel"
    print(f"{soname}: {path}")
print([l for l in _C.version_report().splitlines() if l.startswith("NCCL loaded")][0],
      "(TDIST_PRELOAD=" + os.environ["TDIST_PRELOAD"] + ")")
PY
done
echo "import tdist with the nvidia-* wheels: ok"
