"""tdist: GPU kernels that overlap compute with inter-GPU communication, from Python.

    import torch, tdist
    with tdist.init():                       # torchrun / an existing torch.distributed group
        x = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16)
        tdist.all_reduce(x)                  # in place, on torch's current stream
        y = tdist.all_gather(x)              # torch.ops.tdist.all_gather: torch.compile / CUDA graphs
        buf = tdist.empty((1024,), torch.float32)   # symmetric memory
        remote = tdist.peer(buf, (tdist.get_rank() + 1) % tdist.get_world_size())
        y = tdist.ag_gemm(x_rows, w_shard)   # all_gather(x_rows) @ w_shard.T, overlapped

Importing needs neither torch nor a GPU. docs/python.md has the API.
"""

from . import _C  # first: libtdist brings in the NCCL it was built with before torch loads its own
from ._C import Error, TimeoutError  # noqa: A004 (tdist.TimeoutError also subclasses the built-in)
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
from .ops import ag_gemm, all_gather, all_reduce, barrier, gemm_ar, gemm_rs, reduce_scatter
from . import jit

__version__ = "0.1.0"

__all__ = [
    "Error",
    "TimeoutError",
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
    "jit",
]
