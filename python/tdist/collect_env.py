"""Reports the environment tdist runs in, for bug reports (as `python -m torch.utils.collect_env`):
every version (tdist, NCCL and CUDA built and loaded, driver, torch), the libraries loaded and from
where, the GPUs, the JIT cache folder, and every TDIST_* setting with its effective value. Works
without a GPU and without torch.

    python -m tdist.collect_env        (or: tdist-collect-env)
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

# name -> (default in effect when unset, what it sets). Secrets are never printed.
SETTINGS = {
    "TDIST_DEBUG": ("WARN", "log level: NONE, WARN, INFO, TRACE"),
    "TDIST_DEBUG_SUBSYS": ("ALL", "log subsystems, e.g. INIT,JIT or ^JIT"),
    "TDIST_JIT_VERBOSE": ("0", "JIT log at TRACE (alias)"),
    "TDIST_HOST_TIMEOUT_S": ("300", "host waits: rendezvous, barriers (s)"),
    "TDIST_WAIT_TIMEOUT_S": ("60", "device spin-waits (s)"),
    "TDIST_CHECK_CALLS": ("first", "compare collective calls across ranks: first (new signatures), always, off"),
    "TDIST_SYMMETRIC_HEAP_SIZE": ("1G", "default symmetric heap per rank"),
    "TDIST_SHARE_GPUS": ("0", "test mode: ranks time-share GPUs (docs/testing.md)"),
    "TDIST_STORE_SECRET": ("none", "key of the rendezvous store (tdistrun sets a random one)"),
    "TDIST_OVERLAP_METHOD": ("auto", "method of the overlapped GEMM layers"),
    "TDIST_OVERLAP_PIECES": ("auto", "row pieces of the chunked GEMM-RS / GEMM-AR (1 to 4)"),
    "TDIST_TP_BACKWARD": ("overlap", "backward of the overlapped GEMMs: overlap or fused"),
    "TDIST_ALLREDUCE_METHOD": ("auto", "AllReduce method"),
    "TDIST_ALLGATHER_METHOD": ("auto", "AllGather method"),
    "TDIST_REDUCESCATTER_METHOD": ("auto", "ReduceScatter method"),
    "TDIST_COLLECTIVE_TUNE": ("1", "time the collectives' methods per size class (0: the table decides)"),
    "TDIST_CUBLAS_LIBRARY": ("libcublas.so.13", "cuBLAS library to open"),
    "TDIST_NVRTC_LIBRARY": ("libnvrtc.so.13", "NVRTC library to open"),
    "TDIST_NVCC": ("nvcc of CUDA_HOME or PATH", "nvcc for kernels compiled with nvcc"),
    "TDIST_CACHE_DIR": (None, "JIT cache folder"),
    "TDIST_INCLUDE_DIR": (None, "tdist headers the JIT compiles against"),
    "TDIST_JIT_COMPILER": ("auto", "nvrtc, nvcc or auto"),
    "TDIST_JIT_LINEINFO": ("0", "-lineinfo in JIT compiles"),
    "TDIST_JIT_DUMP": ("off", "folder for each compile's source, cubin, log"),
    "TDIST_JIT_DISABLE_DISK_CACHE": ("0", "keep the JIT cache in memory only"),
    "TDIST_JIT_FAIL_ON_SPILLS": ("0", "fail on register spills"),
    "TDIST_GEMM_DEBUG": ("0", "GEMM kernel debug checks"),
    "TDIST_PRELOAD": ("1", "load CUDA/NCCL from nvidia-* wheels or the system before the extension"),
}
SECRETS = {"TDIST_STORE_SECRET"}
OTHER_VARS = ("CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "NCCL_DEBUG", "NCCL_NVLS_ENABLE",
              "NVSHMEM_DISABLE_NVLS", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "RANK", "WORLD_SIZE", "LOCAL_RANK",
              "MASTER_ADDR", "MASTER_PORT")


def cache_dir() -> str:
    """The JIT cache folder in effect (docs/jit.md): TDIST_CACHE_DIR, $XDG_CACHE_HOME/tdist, ~/.cache/tdist."""
    if os.environ.get("TDIST_CACHE_DIR"):
        return os.environ["TDIST_CACHE_DIR"]
    if os.environ.get("XDG_CACHE_HOME"):
        return os.path.join(os.environ["XDG_CACHE_HOME"], "tdist")
    return os.path.join(os.path.expanduser("~"), ".cache", "tdist")


def _loaded_libraries():
    """Paths of the CUDA, NCCL and tdist libraries mapped into this process."""
    found = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                name = os.path.basename(path)
                for stem in ("libcudart.so", "libnccl.so", "libnvrtc.so", "libcuda.so", "libtdist.so", "libcublas.so",
                             "_C."):
                    if name.startswith(stem) and path not in found.values():
                        found[name] = path
    except OSError:
        pass
    return found


def _distribution_versions():
    from importlib import metadata

    out = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("nvidia-") or name in ("torch", "tdist", "triton", "numpy"):
            out[name] = dist.version
    return dict(sorted(out.items()))


def _gpus():
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "none (nvidia-smi not found)"
    try:
        r = subprocess.run([smi, "--query-gpu=index,name,compute_cap,memory.total,driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown (nvidia-smi: {e})"
    if r.returncode != 0:
        return f"none (nvidia-smi: {(r.stderr or r.stdout).strip()})"
    return "\n".join(r.stdout.strip().splitlines()) or "none"


def _torch():
    try:
        import torch
    except ImportError:
        return "not installed"
    except Exception as e:  # noqa: BLE001 - a broken torch install is worth reporting, not fatal
        return f"import failed: {type(e).__name__}: {e}"
    cuda = getattr(torch.version, "cuda", None)
    try:
        available = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        available = False
    nccl = ""
    try:
        nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001
        pass
    return f"{torch.__version__} (CUDA {cuda}, NCCL {nccl or '?'}, GPU available: {available})"


def report() -> str:
    lines = []

    def section(title):
        lines.append("")
        lines.append(title)
        lines.append("-" * len(title))

    try:
        import tdist
        from tdist import _C

        version = tdist.__version__
        native = _C.version_report(-1).strip().splitlines()
        native_version = _C.version()
        package_dir = os.path.dirname(tdist.__file__)
        preloaded = dict(tdist._libs.loaded)
    except Exception as e:  # noqa: BLE001 - the report is most useful exactly when this fails
        version = native_version = "unavailable"
        native = [f"tdist cannot be imported: {type(e).__name__}: {e}"]
        package_dir = os.path.dirname(os.path.abspath(__file__))
        preloaded = {}

    section("Versions")
    lines.append(f"tdist (package): {version}")
    lines.append(f"libtdist: {native_version}")
    lines += native
    lines.append(f"Python: {sys.version.split()[0]} ({sys.executable})")
    lines.append(f"OS: {platform.platform()}")
    lines.append(f"torch: {_torch()}")

    section("Python packages")
    for name, v in _distribution_versions().items():
        lines.append(f"{name}: {v}")

    section("Libraries")
    lines.append(f"package: {package_dir}")
    for soname, where in preloaded.items():
        lines.append(f"preloaded {soname}: {where}")
    for name, path in sorted(_loaded_libraries().items()):
        lines.append(f"loaded {name}: {path}")

    section("GPUs")
    lines.append(_gpus())

    section("JIT cache")
    d = cache_dir()
    lines.append(f"folder: {d} ({'exists' if os.path.isdir(d) else 'not created yet'})")

    section("Settings (TDIST_*: value in effect)")
    width = max(len(k) for k in SETTINGS)
    for name, (default, what) in SETTINGS.items():
        raw = os.environ.get(name)
        if name in SECRETS:
            value = "set (hidden)" if raw else f"{default} (unset)"
        elif raw is not None:
            value = f"{raw} (set)"
        elif name == "TDIST_CACHE_DIR":
            value = f"{d} (default)"
        elif name == "TDIST_INCLUDE_DIR":
            value = f"{os.path.join(package_dir, 'include')} (default)"
        else:
            value = f"{default} (default)"
        lines.append(f"{name:<{width}}  {value:<40}  {what}")
    for name in sorted(k for k in os.environ if k.startswith("TDIST_") and k not in SETTINGS):
        lines.append(f"{name:<{width}}  {os.environ[name]} (set; not a setting tdist knows)")

    section("Other environment")
    for name in OTHER_VARS:
        lines.append(f"{name}={os.environ[name]}" if name in os.environ else f"{name} unset")
    return "\n".join(lines).lstrip("\n") + "\n"


def main() -> int:
    sys.stdout.write(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
