"""tdist: GPU kernels that overlap compute with inter-GPU communication, from Python.

    import torch, tdist
    with tdist.init():                       # torchrun / an existing torch.distributed group
        x = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16)
        tdist.all_reduce(x)                  # in place, on torch's current stream
        y = tdist.all_gather(x)              # torch.ops.tdist.all_gather: torch.compile / CUDA graphs
        buf = tdist.empty((1024,), torch.float32)   # symmetric memory
        remote = tdist.peer(buf, (tdist.get_rank() + 1) % tdist.get_world_size())
        y = tdist.ag_gemm(x_rows, w_shard)   # all_gather(x_rows) @ w_shard.T, overlapped

Importing needs neither torch nor a GPU. docs/python.md has the API; `python -m tdist.collect_env`
reports versions and settings.
"""

from ._libs import load_libraries as _load_libraries

try:
    from ._version import __version__  # written by the build from VERSION
except ImportError:  # pragma: no cover - a source tree used without building
    from importlib.metadata import version as _dist_version

    __version__ = _dist_version("tdist")

# First: the CUDA runtime, NVRTC and NCCL (the nvidia-* wheels when installed, else the system's), then
# libtdist, before torch loads its own NCCL.
_load_libraries()
try:
    from . import _C
except ImportError as _e:
    raise ImportError(
        f"tdist {__version__}: cannot load its extension ({_e}). tdist needs the CUDA 13 runtime and "
        "NCCL >= 2.28: pip install 'tdist[cuda]' (NVIDIA's wheels), or install the CUDA 13 toolkit and "
        "NCCL and set CUDA_HOME or LD_LIBRARY_PATH; `python -m tdist.collect_env` shows what was found."
    ) from _e
from ._C import Error, TimeoutError  # noqa: A004 (tdist.TimeoutError also subclasses the built-in)
from ._C import DeviceTimeoutError, check_device_faults
from ._runtime import (
    Session,
    empty,
    finalize,
    free,
    get_device,
    get_rank,
    get_world_size,
    heap_info,
    init,
    is_initialized,
    is_symmetric,
    peer,
)
from .ops import ag_gemm, all_gather, all_reduce, barrier, gemm_ar, gemm_rs, overlap, overlap_ops, reduce_scatter
from .ops import catalogue_functions as _catalogue_functions
from . import jit
from .flash_decode import flash_decode
from . import ep, moe
from .moe import (moe_ag_group_gemm, moe_ag_group_gemm_fp8, moe_group_gemm_ar, moe_group_gemm_ar_fp8, moe_group_gemm_rs,
                  moe_group_gemm_rs_fp8)

# Every other op of the C++ catalogue of overlapped ops, as tdist.<name> (e.g. tdist.ag_gemm_swiglu).
globals().update(_catalogue_functions)

# TDIST_SHARE_GPUS (a test mode): NCCL_HOSTID set before torch or tdist creates a communicator.
_runtime._claim_own_nccl_host()


__all__ = [
    "Error",
    "TimeoutError",
    "DeviceTimeoutError",
    "check_device_faults",
    "Session",
    "init",
    "finalize",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "get_device",
    "heap_info",
    "empty",
    "free",
    "peer",
    "is_symmetric",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "barrier",
    "ag_gemm",
    "gemm_rs",
    "gemm_ar",
    "overlap",
    "overlap_ops",
    *_catalogue_functions,
    "jit",
    "flash_decode",
    "ep",
    "moe",
    "moe_ag_group_gemm",
    "moe_ag_group_gemm_fp8",
    "moe_group_gemm_rs",
    "moe_group_gemm_rs_fp8",
    "moe_group_gemm_ar",
    "moe_group_gemm_ar_fp8",
]
