"""Shapes and argument checks of the overlapped GEMMs (ag_gemm, gemm_rs, gemm_ar), torch-free.

The checks run on plain metadata (:class:`Operand`: shape, dtype name, device, contiguity, address), so
the same code serves the real and the fake (meta) implementations of the torch ops and the CPU tests.
Every error names the op and the argument. The C++ core checks the descriptors again before a run
(``_C.check_gemm_overlap``).

Rows split over ranks as ``RowChunks{M, world_size}``: rank r owns rows ``[begin(r), begin(r) +
rows(r))``; the first ``M % world_size`` ranks own one row more.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from ._tensors import Error

METHODS = ("auto", "fused", "chunked", "sequential", "baseline")
DTYPES = ("bfloat16", "float16")
_LIMIT = 1 << 31  # M, N and K stay below 2^31 (the GEMM's 32-bit tile coordinates)


class Operand(NamedTuple):
    """What the checks need to know of a tensor argument."""

    shape: tuple
    dtype: str                   # torch's name: "bfloat16", "float16", ...
    device_type: str             # "cuda", "cpu", ...
    device_index: Optional[int]  # None: unknown
    contiguous: bool
    ptr: Optional[int] = None    # data address; None where unknown (fake tensors)


class Dims(NamedTuple):
    """One call: m = all ranks' rows, n and k = this rank's GEMM, rows = this rank's RowChunks rows."""

    m: int
    n: int
    k: int
    rows: int


def chunk_rows(m, world_size: int, rank: int):
    """Rows of rank ``rank`` in RowChunks{m, world_size} (also for symbolic ``m``: no branch on m)."""
    return (m + world_size - 1 - rank) // world_size


def chunk_begin(m: int, world_size: int, rank: int) -> int:
    """First row of rank ``rank`` in RowChunks{m, world_size}."""
    return rank * (m // world_size) + min(rank, m % world_size)


def check_method(op: str, method) -> str:
    if not isinstance(method, str):
        raise Error(f"tdist.{op}: method must be a str, got {type(method).__name__}")
    if method not in METHODS:
        raise Error(f"tdist.{op}: method must be one of {', '.join(METHODS)}; got {method!r}")
    return method


def check_m(op: str, m):
    """ag_gemm's m: None or an int (a SymInt while tracing), not a bool."""
    if m is not None and (isinstance(m, bool) or not (isinstance(m, int) or hasattr(m, "node"))):
        raise Error(f"tdist.{op}: m must be None or an int (the total row count), got {type(m).__name__}")
    return m


def _check_operand(op: str, name: str, t: Operand) -> None:
    if t.device_type != "cuda":
        raise Error(f"tdist.{op}: '{name}' must be a CUDA tensor, got one on device type '{t.device_type}'")
    if t.dtype not in DTYPES:
        raise Error(f"tdist.{op}: '{name}' has dtype {t.dtype}; the overlapped GEMMs take bfloat16 or float16")
    if len(t.shape) != 2:
        raise Error(f"tdist.{op}: '{name}' must be 2-D, got shape {tuple(t.shape)} (flatten the leading "
                    "dimensions first, e.g. x.flatten(0, -2))")
    if not t.contiguous:
        raise Error(f"tdist.{op}: '{name}' must be contiguous (call .contiguous() first)")
    if t.ptr is not None and t.ptr % 16 != 0:
        raise Error(f"tdist.{op}: '{name}' must start at a 16-byte aligned address, got {t.ptr:#x} (a view at an "
                    "odd offset; call .clone() first)")


def check_operands(op: str, **operands: Operand) -> None:
    """CUDA, bfloat16/float16, 2-D, contiguous, aligned; one dtype and one device for all."""
    first_name, first = next(iter(operands.items()))
    for name, t in operands.items():
        _check_operand(op, name, t)
        if t.dtype != first.dtype:
            raise Error(f"tdist.{op}: '{name}' has dtype {t.dtype} but '{first_name}' has {first.dtype}; "
                        "they must match")
        if t.device_index != first.device_index:
            raise Error(f"tdist.{op}: '{name}' is on cuda:{t.device_index} but '{first_name}' is on "
                        f"cuda:{first.device_index}; they must be on the same device")


def _check_nk(op: str, a_name: str, a: Operand, b: Operand):
    n, k = b.shape
    if a.shape[1] != k:
        raise Error(f"tdist.{op}: '{a_name}' has {a.shape[1]} columns but 'b' has {k}; both are K "
                    f"(shapes {tuple(a.shape)} and {tuple(b.shape)}: y = {a_name} @ b.T with b of shape (N, K))")
    if not (0 < k < _LIMIT and k % 8 == 0):
        raise Error(f"tdist.{op}: K (columns of '{a_name}' and 'b') must be a positive multiple of 8, got {k}")
    if not (0 < n < _LIMIT and n % 8 == 0):
        raise Error(f"tdist.{op}: N (rows of 'b') must be a positive multiple of 8, got {n}")
    return n, k


def ag_gemm_dims(a_local: Operand, b: Operand, m, world_size: int, rank: int) -> Dims:
    """ag_gemm: a_local (rows, K) this rank's rows of A, b (N, K); d (m, N)."""
    op = "ag_gemm"
    check_operands(op, a_local=a_local, b=b)
    n, k = _check_nk(op, "a_local", a_local, b)
    rows = a_local.shape[0]
    m = rows * world_size if check_m(op, m) is None else m
    if not 0 <= m < _LIMIT:
        raise Error(f"tdist.{op}: m must be in [0, 2^31), got {m}")
    want = chunk_rows(m, world_size, rank)
    if rows != want:
        raise Error(f"tdist.{op}: 'a_local' has {rows} rows, but rank {rank} owns {want} of m={m} rows over "
                    f"{world_size} ranks (RowChunks: the first m % world_size ranks own one more); pass m= the "
                    "total row count, the same on every rank")
    return Dims(m, n, k, rows)


def gemm_rs_dims(a: Operand, b: Operand, world_size: int, rank: int, op: str = "gemm_rs") -> Dims:
    """gemm_rs / gemm_ar: a (M, K_local), b (N, K_local); d (rows, N) or (M, N)."""
    check_operands(op, a=a, b=b)
    n, k = _check_nk(op, "a", a, b)
    m = a.shape[0]
    if not m < _LIMIT:
        raise Error(f"tdist.{op}: 'a' has {m} rows; M must stay below 2^31")
    return Dims(m, n, k, chunk_rows(m, world_size, rank))
