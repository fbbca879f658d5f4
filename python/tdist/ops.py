"""Collectives and overlapped GEMMs with PyTorch-style signatures.

torch tensors go through the torch.library ops ``torch.ops.tdist.*`` (traceable by
torch.compile(fullgraph=True), capturable in CUDA graphs) and run on torch's current stream. Other
arrays (DLPack or __cuda_array_interface__, e.g. CuPy) call the C++ core directly, on torch's
current stream when torch is installed and the default stream otherwise.

Every op is collective: all ranks call it in the same order with the same shapes, dtype and
method. Supported dtypes: bfloat16, float16, float32 (the overlapped GEMMs: bfloat16, float16);
tensors contiguous, on this rank's GPU. The overlapped GEMMs (ag_gemm, gemm_rs, gemm_ar) take torch
tensors only.
"""

from __future__ import annotations

from ._runtime import runtime
from . import _overlap
from ._tensors import Error, current_stream, describe_checked, is_torch_tensor, torch_module

_torch = torch_module()
if _torch is not None:
    from . import _torch_ops as _tops  # registers torch.ops.tdist.*

    # OpOverloads as globals: what torch.compile traces most directly.
    _all_reduce_inplace = _torch.ops.tdist.all_reduce_inplace.default
    _all_reduce_out = _torch.ops.tdist.all_reduce_out.default
    _all_gather = _torch.ops.tdist.all_gather.default
    _all_gather_out = _torch.ops.tdist.all_gather_out.default
    _reduce_scatter = _torch.ops.tdist.reduce_scatter.default
    _reduce_scatter_out = _torch.ops.tdist.reduce_scatter_out.default
    _barrier = _torch.ops.tdist.barrier.default
    _ag_gemm = _torch.ops.tdist.ag_gemm.default
    _ag_gemm_gathered = _torch.ops.tdist.ag_gemm_gathered.default
    _gemm_rs = _torch.ops.tdist.gemm_rs.default
    _gemm_ar = _torch.ops.tdist.gemm_ar.default


def _check_method(method) -> str:
    if not isinstance(method, str):
        raise Error(f"tdist: method must be a str, got {type(method).__name__}")
    return method


def _direct(op: str, input, output, method: str) -> None:
    """The torch-free path: both arrays given, C++ checks and runs them."""
    d_in, d_out = describe_checked(input, op, "input"), describe_checked(output, op, "output")
    rt = runtime(op)
    getattr(rt, op)(d_in, d_out, current_stream(rt.device), method)


def _gather_or_scatter(op: str, input, output, method):
    """all_gather / reduce_scatter: torch tensors through the functional op (no output) or the _out
    op, other arrays through the C++ core (output required)."""
    method = _check_method(method)
    if is_torch_tensor(input) and (output is None or is_torch_tensor(output)):
        if op == "all_gather":
            functional, new, out_variant = _all_gather, _tops.all_gather_new, _all_gather_out
        else:
            functional, new, out_variant = _reduce_scatter, _tops.reduce_scatter_new, _reduce_scatter_out
        if output is None:
            return new(input, method) if _tops.eager(input) else functional(input, method)
        if _tops.eager(input, output):
            _tops.run_collective(op, input, output, method)
        else:
            out_variant(input, output, method)
        return output
    if output is None:
        raise Error(f"tdist.{op}: 'output' is required for arrays that are not torch tensors")
    _direct(op, input, output, method)
    return output


def all_reduce(tensor, output=None, method: str = "auto"):
    """Sum ``tensor`` over all ranks.

    Like ``torch.distributed.all_reduce(tensor)``: in place when ``output`` is None; otherwise the
    sum goes to ``output`` (same shape and dtype) and ``tensor`` is left as it was.

    Args:
        tensor: CUDA tensor (bfloat16, float16 or float32, contiguous) on this rank's GPU.
        output: optional tensor for the result.
        method: "auto" (by size; docs/collectives.md), "one_shot", "two_shot", "ll", "ll128", "ce"
            (copy-engine ReduceScatter then AllGather; the element count must divide by the world size)
            or "nccl".
            ``TDIST_ALLREDUCE_METHOD`` overrides "auto".

    Returns:
        The tensor holding the sum (``tensor`` or ``output``).

    The sum accumulates in fp32 and is bit-identical on every rank. For a functional form (new
    output tensor) use ``torch.ops.tdist.all_reduce(input, method)``.
    """
    method = _check_method(method)
    if is_torch_tensor(tensor) and (output is None or is_torch_tensor(output)):
        target = tensor if output is None else output
        if _tops.eager(tensor, target):
            _tops.run_collective("all_reduce", tensor, target, method)
        elif output is None:
            _all_reduce_inplace(tensor, method)
        else:
            _all_reduce_out(tensor, output, method)
        return target
    _direct("all_reduce", tensor, tensor if output is None else output, method)
    return tensor if output is None else output


def all_gather(input, output=None, method: str = "auto"):
    """Concatenate every rank's ``input`` along dimension 0, in rank order.

    Like ``torch.distributed.all_gather_into_tensor(output, input)``.

    Args:
        input: CUDA tensor (bfloat16, float16 or float32, contiguous), the same shape on all ranks.
        output: optional tensor of ``world_size * input.numel()`` elements (any shape); default a
            new tensor of shape ``(world_size * input.shape[0], *input.shape[1:])``. In place when
            ``input`` is rank's part of ``output`` (``output[rank * n:(rank + 1) * n]``).
        method: "auto", "sm", "sm_push" (output allocated from the heap), "ce_push", "ce_pull", "ll" or
            "nccl" (``TDIST_ALLGATHER_METHOD``).

    Returns:
        The gathered tensor.
    """
    return _gather_or_scatter("all_gather", input, output, method)


def reduce_scatter(input, output=None, method: str = "auto"):
    """Sum ``input`` over all ranks and keep this rank's part of the sum.

    Like ``torch.distributed.reduce_scatter_tensor(output, input)``: rank r receives elements
    ``[r * n, (r + 1) * n)`` of the sum, ``n = input.numel() / world_size``.

    Args:
        input: CUDA tensor (bfloat16, float16 or float32, contiguous), the same shape on all ranks.
        output: optional tensor of ``input.numel() / world_size`` elements; default a new tensor of
            shape ``(input.shape[0] / world_size, *input.shape[1:])`` (dimension 0 must divide).
            In place when ``output`` is rank's part of ``input``.
        method: "auto", "fused", "ce", "ll" or "nccl" (``TDIST_REDUCESCATTER_METHOD``).

    Returns:
        This rank's part of the sum (fp32 accumulation).
    """
    return _gather_or_scatter("reduce_scatter", input, output, method)


def barrier() -> None:
    """Stream barrier across ranks, on torch's current stream.

    GPU work queued after it (on every rank) starts after the work queued before it on every
    rank. It does not block the host; capturable in CUDA graphs.
    """
    if _torch is None:
        runtime("barrier").barrier(0)
        return
    _barrier(_tops.barrier_token())



# --- overlapped GEMMs -----------------------------------------------------------------------------

def _gemm_operands(op: str, **tensors) -> None:
    """The overlapped GEMMs run on torch tensors only (the C++ core needs their shapes)."""
    if _torch is None:
        raise Error(f"tdist.{op} needs PyTorch, which is not installed")
    for name, t in tensors.items():
        if not is_torch_tensor(t):
            raise Error(f"tdist.{op}: '{name}' must be a torch.Tensor, got {type(t).__name__}")


_GEMM_NOTES = """
    Collective: every rank calls it in the same order with the same shapes, dtype and method. Runs
    on torch's current stream without host synchronisation; traceable by
    ``torch.compile(fullgraph=True)`` and capturable in CUDA graphs.

    Layout "TN", as ``torch.nn.functional.linear``: ``y = x @ w.T`` with the weight ``w`` of shape
    ``(N, K)``. All tensors dense, contiguous, 2-D, 16-byte aligned, bfloat16 or float16 (one dtype),
    on this rank's GPU; N and K multiples of 8; fp32 accumulation.

    Methods (include/tdist/ops/gemm_overlap.hpp has the protocols): "auto" (the performance model's
    choice; ``TDIST_OVERLAP_METHOD`` overrides it), "fused" (tdist's persistent GEMM with the
    communication in its tile hooks, Hopper only), "chunked" (one cuBLAS GEMM per row chunk as chunks
    arrive / leave), "sequential" (cuBLAS, then tdist's collective; for small M; ag_gemm and gemm_rs
    need M divisible by the world size for it), "baseline" (cuBLAS and NCCL in sequence).

    Context: the first call for a (dtype, K) (ag_gemm) or a dtype (gemm_rs, gemm_ar) creates the op's
    context: symmetric buffers sized for the call (about M x K x 2 bytes for ag_gemm, M x N x 2 for
    gemm_rs and twice that for gemm_ar, plus a workspace of up to 64 MiB) from the heap of
    ``tdist.init(heap_size=...)``, and compiled kernels. A later call with a larger M (or N) re-creates
    it larger (at least twice the old M when the heap has room). Both are collective: every rank makes
    the same calls, so they happen on every rank at the same call. A context cannot be created inside
    a CUDA graph capture (tdist.Error); run every shape once before capturing (warm-up).
"""


def ag_gemm(a_local, b, *, m=None, method: str = "auto", return_gathered: bool = False):
    """AllGather-GEMM: ``all_gather(a_local) @ b.T`` with the gather overlapped with the GEMM.

    The rows of ``A`` (M x K in all) are split over the ranks as RowChunks{M, world_size}: rank r
    holds rows ``[begin(r), begin(r) + rows(r))`` with ``rows(r) = M // world + (r < M % world)``
    (the first ``M % world_size`` ranks hold one row more), in rank order. ``b`` is this rank's
    shard of a column-parallel weight (its N output features). The result holds every row:
    ``d = A @ b.T``, of shape ``(M, N)``, the same on every rank up to this rank's ``b``.

    Args:
        a_local: ``(rows(rank), K)`` tensor, this rank's rows of ``A``.
        b: ``(N, K)`` tensor, this rank's weight shard.
        m: ``M``, the total row count (int, the same on every rank). Default
            ``a_local.shape[0] * world_size``, right only when every rank holds as many rows; with
            unequal rows pass it on every rank (a rank cannot see the others' counts).
        method: "auto", "fused", "chunked", "sequential" or "baseline".
        return_gathered: also return the gathered ``A`` (``(M, K)``).

    Returns:
        ``d`` of shape ``(M, N)``, or ``(d, gathered)`` when ``return_gathered``.

    Example (2 ranks)::

        x = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16)   # this rank's tokens
        w = torch.randn(7168, 8192, device="cuda", dtype=torch.bfloat16)   # 14336 / 2 features
        y = tdist.ag_gemm(x, w)                                            # (8192, 7168)
    """
    method = _overlap.check_method("ag_gemm", method)
    _gemm_operands("ag_gemm", a_local=a_local, b=b)
    _overlap.check_m("ag_gemm", m)
    if not isinstance(return_gathered, bool):
        raise Error(f"tdist.ag_gemm: return_gathered must be a bool, got {type(return_gathered).__name__}")
    if _tops.eager(a_local, b):
        out = _tops.call_overlap("ag_gemm", (a_local, b), m, method, ("gathered",) if return_gathered else ())
        return tuple(out) if return_gathered else out[0]
    if return_gathered:
        return _ag_gemm_gathered(a_local, b, m, method)
    return _ag_gemm(a_local, b, m, method)


def gemm_rs(a, b, *, method: str = "auto"):
    """GEMM-ReduceScatter: this rank's rows of ``sum over ranks (a @ b.T)``, the reduction
    overlapped with the GEMM.

    Each rank holds a slice of K (row-parallel weight): ``a`` its ``(M, K_local)`` activations,
    ``b`` its ``(N, K_local)`` weight slice. The sum ``D = sum_r a_r @ b_r.T`` (M x N, fp32
    accumulation) is split by rows as RowChunks{M, world_size}; rank r receives rows
    ``[begin(r), begin(r) + rows(r))``, ``rows(r) = M // world + (r < M % world)`` (M need not divide).
    Like ``torch.distributed.reduce_scatter_tensor(out, a @ b.T)`` for M divisible by the world size.

    Args:
        a: ``(M, K_local)`` tensor, the same M on every rank.
        b: ``(N, K_local)`` tensor.
        method: "auto", "fused", "chunked", "sequential" or "baseline".

    Returns:
        ``(rows(rank), N)`` tensor, this rank's rows of the sum.
    """
    method = _overlap.check_method("gemm_rs", method)
    _gemm_operands("gemm_rs", a=a, b=b)
    if _tops.eager(a, b):
        return _tops.call_overlap("gemm_rs", (a, b), None, method)[0]
    return _gemm_rs(a, b, method)


def gemm_ar(a, b, *, method: str = "auto"):
    """GEMM-AllReduce: ``sum over ranks (a @ b.T)`` on every rank, the reduction overlapped with the
    GEMM.

    Each rank holds a slice of K: ``a`` its ``(M, K_local)`` activations, ``b`` its ``(N, K_local)``
    weight slice. Like ``y = a @ b.T; torch.distributed.all_reduce(y)``.

    Args:
        a: ``(M, K_local)`` tensor, the same M on every rank.
        b: ``(N, K_local)`` tensor.
        method: "auto", "fused", "chunked", "sequential" or "baseline".

    Returns:
        ``(M, N)`` tensor, the sum (fp32 accumulation), on every rank.
    """
    method = _overlap.check_method("gemm_ar", method)
    _gemm_operands("gemm_ar", a=a, b=b)
    if _tops.eager(a, b):
        return _tops.call_overlap("gemm_ar", (a, b), None, method)[0]
    return _gemm_ar(a, b, method)


def overlap(op: str, *inputs, m=None, method: str = "auto", optional_outputs=()):
    """Any overlapped op of the catalogue by name (``tdist.overlap_ops()`` lists them).

    Args:
        op: the op's name, e.g. "ag_gemm_swiglu".
        *inputs: its input tensors, in the catalogue's order.
        m: ``M``, the total row count, for ops whose inputs hold only this rank's rows (default:
            rows x world_size).
        method: "auto", "fused", "chunked", "sequential" or "baseline".
        optional_outputs: names of optional outputs to return too (e.g. ("gathered",)).

    Returns:
        The op's output, or a tuple of its outputs.
    """
    method = _overlap.check_method(op, method)
    traits = _overlap.op_traits(op)
    if len(inputs) != len(traits.inputs):
        raise Error(f"tdist.{op}: takes {len(traits.inputs)} inputs "
                    f"({', '.join(o[0] for o in traits.inputs)}), got {len(inputs)}")
    _gemm_operands(op, **{o[0]: t for o, t in zip(traits.inputs, inputs)})
    if traits.takes_m:
        _overlap.check_m(op, m)
    elif m is not None:
        raise Error(f"tdist.{op}: takes no m (its inputs hold every row)")
    optional = tuple(optional_outputs)
    known = tuple(o[0] for o in traits.optional_outputs)
    for name in optional:
        if name not in known:
            raise Error(f"tdist.{op}: has no optional output {name!r} (it has: {', '.join(known) or 'none'})")
    if len(optional) > 1:
        raise Error(f"tdist.{op}: returns at most one optional output per call, got {optional}")
    if _tops.eager(*inputs):
        out = _tops.call_overlap(op, inputs, m, method, optional)
        return out[0] if len(out) == 1 else tuple(out)
    torch_op = _tops.catalogue_ops[f"{op}_{optional[0]}" if optional else op]
    return torch_op(*inputs, m, method) if traits.takes_m else torch_op(*inputs, method)


def overlap_ops() -> dict:
    """The catalogue of overlapped ops: name -> one-line summary."""
    return {name: t.summary for name, t in _overlap.ops().items()}


def _catalogue_function(op: str):
    traits = _overlap.op_traits(op)

    def call(*inputs, m=None, method: str = "auto"):
        return overlap(op, *inputs, m=m, method=method)

    call.__name__ = call.__qualname__ = op
    shapes = ", ".join(f"{o[0]} ({o[1]}, {o[2]})" for o in traits.operands)
    call.__doc__ = (f"{traits.summary}.\n\n    Operands: {shapes}; M all ranks' rows, rows this rank's "
                    "RowChunks rows, N and K this rank's GEMM.\n    Same as ``tdist.overlap"
                    f"(\"{op}\", ...)``.\n")
    return call


# One function per catalogue op beyond the hand-written ones (tdist.<name>).
catalogue_functions = {op: _catalogue_function(op) for op in _overlap.ops() if op not in ("ag_gemm", "gemm_rs",
                                                                                         "gemm_ar")}

for _f in (ag_gemm, gemm_rs, gemm_ar, *catalogue_functions.values()):
    if _f.__doc__:  # python -OO drops docstrings
        _f.__doc__ += _GEMM_NOTES
del _f
