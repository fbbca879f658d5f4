"""Finds the CUDA runtime, NVRTC and NCCL that libtdist needs, as PyTorch's wheels do.

libtdist's RUNPATH names only the nvidia-* wheels' folders next to the package
(site-packages/nvidia/cu13/lib, nvidia/nccl/lib), never a path of the machine that built it. Before
the extension is imported, each library is loaded here with RTLD_GLOBAL, in this order:

1. from the nvidia-* wheels when they are installed (NCCL only when >= 2.28, the device API);
2. by soname from the system (LD_LIBRARY_PATH, ld.so.cache);
3. from CUDA_HOME / CUDA_PATH and /usr/local/cuda.

NVRTC is loaded here only from the wheel (the JIT opens the system's by itself, when it first
compiles). A library already in the process (torch imported first) is used as it is. libtdist's dependencies then
resolve, by soname, to the ones loaded here. A library not found is left to the dynamic loader, whose
error names it.
"""

from __future__ import annotations

import ctypes
import os
import site
import sys

# (folder under site-packages/nvidia, soname)
LIBRARIES = (("cu13", "libcudart.so.13"), ("cu13", "libnvrtc.so.13"), ("nccl", "libnccl.so.2"))
NCCL_MIN = (2, 28)

loaded: dict = {}  # soname -> path it was loaded from, or "system" (by soname)


def _site_dirs():
    dirs = []
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the site-packages of tdist
    for d in [here] + list(getattr(site, "getsitepackages", lambda: [])()) + [site.getusersitepackages()] + sys.path:
        if d and os.path.isdir(d) and d not in dirs:
            dirs.append(d)
    return dirs


def _nccl_wheel_ok() -> bool:
    try:
        from importlib.metadata import version

        parts = version("nvidia-nccl-cu13").split(".")
        return tuple(int(p) for p in parts[:2]) >= NCCL_MIN
    except Exception:  # noqa: BLE001 - not installed or an odd version string: look for a newer wheel file
        return True


def wheel_library(folder: str, soname: str):
    """Path of `soname` in an installed nvidia-* wheel, or None."""
    if folder == "nccl" and not _nccl_wheel_ok():
        return None
    for d in _site_dirs():
        path = os.path.join(d, "nvidia", folder, "lib", soname)
        if os.path.isfile(path):
            return path
    return None


def system_candidates(soname: str):
    out = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root:
            out += [os.path.join(root, "lib64", soname), os.path.join(root, "lib", soname)]
    out += [os.path.join("/usr/local/cuda", sub, soname) for sub in ("lib64", "lib", "targets/x86_64-linux/lib")]
    return out


def load_libraries() -> dict:
    """Loads each library once (see the module's text); returns soname -> where it came from."""
    if os.environ.get("TDIST_PRELOAD", "1") == "0":  # leave everything to the dynamic loader
        return loaded
    for folder, soname in LIBRARIES:
        if soname in loaded:
            continue
        path = wheel_library(folder, soname)
        if soname.startswith("libnvrtc") and not path:
            continue  # the JIT opens the system's NVRTC itself, when it first compiles
        candidates = ([path] if path else []) + [soname] + system_candidates(soname)
        for c in candidates:
            if c != soname and not os.path.isfile(c):
                continue
            try:
                ctypes.CDLL(c, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            loaded[soname] = c if c != soname else "system"
            break
    return loaded
