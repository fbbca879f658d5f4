"""Shapes and argument checks of the overlapped ops (ag_gemm, gemm_rs, gemm_ar, ...), torch-free.

Every op is described once, in the C++ catalogue (include/tdist/ops/overlap_ops.hpp), which this
module reads through ``_C.overlap_ops()``: its operands, the extents their shapes are written in (M,
rows, N, N/2, K) and the multiple N must be. The checks here derive M, N and K of a call from its input
shapes and the output shapes from the same description, so an op added to the catalogue needs no line
here. They run on plain metadata (:class:`Operand`: shape, dtype name, device, contiguity, address),
so the same code serves the real and the fake (meta) implementations of the torch ops and the CPU
tests. Every error names the op and the argument. The C++ core checks the descriptors again before
a run (``_C.check_overlap``).

Rows split over ranks as ``RowChunks{M, world_size}``: rank r owns rows ``[begin(r), begin(r) +
rows(r))``; the first ``M % world_size`` ranks own one row more.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional

from . import _C
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


class OpTraits(NamedTuple):
    """One op of the C++ catalogue."""

    name: str
    summary: str
    operands: tuple      # ((name, rows extent, cols extent, role), ...); role: input, output, optional_output
    n_multiple: int

    @property
    def inputs(self):
        return tuple(o for o in self.operands if o[3] == "input")

    @property
    def outputs(self):
        return tuple(o for o in self.operands if o[3] == "output")

    @property
    def optional_outputs(self):
        return tuple(o for o in self.operands if o[3] == "optional_output")

    @property
    def takes_m(self) -> bool:
        """Whether a call passes M: some input holds only this rank's rows."""
        return any("rows" in (o[1], o[2]) for o in self.inputs)


_catalogue: Optional[Dict[str, OpTraits]] = None


def ops() -> Dict[str, OpTraits]:
    """The catalogue of overlapped ops, by name."""
    global _catalogue
    if _catalogue is None:
        _catalogue = {d["name"]: OpTraits(d["name"], d["summary"], tuple(tuple(o) for o in d["operands"]),
                                          d["n_multiple"]) for d in _C.overlap_ops()}
    return _catalogue


def op_traits(op: str) -> OpTraits:
    try:
        return ops()[op]
    except KeyError:
        raise Error(f"tdist: no overlapped op is named {op!r} (known: {', '.join(sorted(ops()))})") from None


def _with_extent(t: OpTraits, extent: str, axis: int) -> str:
    return " and ".join(f"'{o[0]}'" for o in t.inputs if o[1 + axis] == extent)


def call_dims(op: str, inputs: Dict[str, Operand], m, world_size: int, rank: int) -> Dims:
    """M, N, K and this rank's rows of a call of ``op`` from its inputs (in the catalogue's order) and,
    for ops whose inputs hold only this rank's rows, ``m`` (None: rows x world_size)."""
    t = op_traits(op)
    check_operands(op, **inputs)
    bound: Dict[str, tuple] = {}  # extent -> (value, operand name, axis)
    for name, rows_extent, cols_extent, _ in t.inputs:
        for axis, extent in ((0, rows_extent), (1, cols_extent)):
            value = inputs[name].shape[axis]
            if extent == "N/2":
                extent, value = "N", 2 * value
            if extent in bound and bound[extent][0] != value:
                first_value, first_name, first_axis = bound[extent]
                what = ("rows", "columns")
                raise Error(f"tdist.{op}: '{first_name}' has {first_value} {what[first_axis]} but '{name}' has "
                            f"{value}; "
                            f"both are {extent} (shapes {', '.join(str(tuple(inputs[o[0]].shape)) for o in t.inputs)}"
                            f": y = a @ b.T with b of shape (N, K))")
            bound.setdefault(extent, (value, name, axis))
    n, k = bound["N"][0], bound["K"][0]
    if not (0 < k < _LIMIT and k % 8 == 0):
        raise Error(f"tdist.{op}: K (columns of {_with_extent(t, 'K', 1)}) must be a positive multiple of 8, "
                    f"got {k}")
    if not (0 < n < _LIMIT and n % t.n_multiple == 0):
        raise Error(f"tdist.{op}: N (rows of {_with_extent(t, 'N', 0)}) must be a positive multiple of "
                    f"{t.n_multiple}, got {n}")
    if "M" in bound:
        m = bound["M"][0]
        if not m < _LIMIT:
            raise Error(f"tdist.{op}: '{bound['M'][1]}' has {m} rows; M must stay below 2^31")
        return Dims(m, n, k, chunk_rows(m, world_size, rank))
    rows, rows_name = bound["rows"][0], bound["rows"][1]
    m = rows * world_size if check_m(op, m) is None else m
    if not 0 <= m < _LIMIT:
        raise Error(f"tdist.{op}: m must be in [0, 2^31), got {m}")
    want = chunk_rows(m, world_size, rank)
    if rows != want:
        raise Error(f"tdist.{op}: '{rows_name}' has {rows} rows, but rank {rank} owns {want} of m={m} rows over "
                    f"{world_size} ranks (RowChunks: the first m % world_size ranks own one more); pass m= the "
                    "total row count, the same on every rank")
    return Dims(m, n, k, rows)


def shape_of(extents: tuple, dims: Dims) -> tuple:
    """The shape of an operand whose (rows, cols) extents are ``extents``, in a call of ``dims``."""
    value = {"M": dims.m, "rows": dims.rows, "N": dims.n, "N/2": dims.n // 2, "K": dims.k}
    return tuple(value[e] for e in extents)


def ag_gemm_dims(a_local: Operand, b: Operand, m, world_size: int, rank: int) -> Dims:
    """ag_gemm: a_local (rows, K) this rank's rows of A, b (N, K); d (m, N)."""
    return call_dims("ag_gemm", {"a_local": a_local, "b": b}, m, world_size, rank)


def gemm_rs_dims(a: Operand, b: Operand, world_size: int, rank: int, op: str = "gemm_rs") -> Dims:
    """gemm_rs / gemm_ar: a (M, K_local), b (N, K_local); d (rows, N) or (M, N)."""
    return call_dims(op, {"a": a, "b": b}, None, world_size, rank)
