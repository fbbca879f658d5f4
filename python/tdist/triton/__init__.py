"""Writing overlapping kernels in Triton on tdist's symmetric memory (stock Triton >= 3.6, no fork).

    import triton, triton.language as tl
    import tdist, tdist.triton
    import tdist.triton.language as tdl

    @tdist.triton.kernel                 # passes the heap descriptor as `heap`
    @triton.jit
    def ping(heap, flag, epoch):
        tdl.signal_op(heap, flag, epoch, (tdl.rank(heap) + 1) % tdl.num_ranks(heap))
        tdl.wait(heap, flag, epoch)

    flag = tdist.empty((1,), torch.int64)
    ping[(1,)](flag, 1)

tdist.triton.language holds the device primitives (rank, symm_at, wait, notify, signal_op, put/get,
fence, quiet, barriers); docs/triton.md describes them and their memory-order contracts. Importing
this package needs Triton; `import tdist` alone does not.
"""

from __future__ import annotations

try:
    import triton as _triton  # noqa: F401
    import triton.language as _tl  # noqa: F401
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"tdist.triton needs Triton >= 3.6 (pip install 'triton>=3.6', or 'tdist[triton]'), which could not be "
        f"imported ({_e}). "
        "The rest of tdist works without it."
    ) from _e

from . import language
from .gemm import ag_gemm, gemm_rs
from ._launch import (
    HeapView,
    barrier_pad,
    heap_view,
    kernel,
    wait_timeout_seconds,
)

__all__ = ["language", "ag_gemm", "gemm_rs", "HeapView", "heap_view", "kernel", "barrier_pad", "wait_timeout_seconds"]
