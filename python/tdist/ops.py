"""Collectives with PyTorch-style signatures.

torch tensors go through the torch.library ops ``torch.ops.tdist.*`` (traceable by
torch.compile(fullgraph=True), capturable in CUDA graphs) and run on torch's current stream. Other
arrays (DLPack or __cuda_array_interface__, e.g. CuPy) call the C++ core directly, on torch's
current stream when torch is installed and the default stream otherwise.

Every op is collective: all ranks call it in the same order with the same shapes, dtype and
method. Supported dtypes: bfloat16, float16, float32; tensors contiguous, on this rank's GPU.
"""

from __future__ import annotations

from ._runtime import runtime
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


def _check_method(method) -> str:
    if not isinstance(method, str):
        raise Error(f"tdist: method must be a str, got {type(method).__name__}")
    return method


def _direct(op: str, input, output, method: str) -> None:
    """The torch-free path: both arrays given, C++ checks and runs them."""
    d_in, d_out = describe_checked(input, op, "input"), describe_checked(output, op, "output")
    rt = runtime(op)
    getattr(rt, op)(d_in, d_out, current_stream(rt.device), method)


def all_reduce(tensor, output=None, method: str = "auto"):
    """Sum ``tensor`` over all ranks.

    Like ``torch.distributed.all_reduce(tensor)``: in place when ``output`` is None; otherwise the
    sum goes to ``output`` (same shape and dtype) and ``tensor`` is left as it was.

    Args:
        tensor: CUDA tensor (bfloat16, float16 or float32, contiguous) on this rank's GPU.
        output: optional tensor for the result.
        method: "auto" (by size; docs/collectives.md), "one_shot", "two_shot", "ll" or "nccl".
            ``TDIST_ALLREDUCE_METHOD`` overrides "auto".

    Returns:
        The tensor holding the sum (``tensor`` or ``output``).

    The sum accumulates in fp32 and is bit-identical on every rank. For a functional form (new
    output tensor) use ``torch.ops.tdist.all_reduce(input, method)``.
    """
    method = _check_method(method)
    if is_torch_tensor(tensor) and (output is None or is_torch_tensor(output)):
        if output is None:
            _all_reduce_inplace(tensor, method)
            return tensor
        _all_reduce_out(tensor, output, method)
        return output
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
        method: "auto", "sm", "ce_push", "ce_pull", "ll" or "nccl" (``TDIST_ALLGATHER_METHOD``).

    Returns:
        The gathered tensor.
    """
    method = _check_method(method)
    if is_torch_tensor(input) and (output is None or is_torch_tensor(output)):
        if output is None:
            return _all_gather(input, method)
        _all_gather_out(input, output, method)
        return output
    if output is None:
        raise Error("tdist.all_gather: 'output' is required for arrays that are not torch tensors")
    _direct("all_gather", input, output, method)
    return output


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
    method = _check_method(method)
    if is_torch_tensor(input) and (output is None or is_torch_tensor(output)):
        if output is None:
            return _reduce_scatter(input, method)
        _reduce_scatter_out(input, output, method)
        return output
    if output is None:
        raise Error("tdist.reduce_scatter: 'output' is required for arrays that are not torch tensors")
    _direct("reduce_scatter", input, output, method)
    return output


def barrier() -> None:
    """Stream barrier across ranks, on torch's current stream.

    GPU work queued after it (on every rank) starts after the work queued before it on every
    rank. It does not block the host; capturable in CUDA graphs.
    """
    if _torch is None:
        runtime("barrier").barrier(0)
        return
    _barrier(_tops.barrier_token())


# Fused GEMM + collective ops (ag_gemm, gemm_rs, gemm_ar) belong here, with the same conventions
# (torch.library op with a fake implementation in _torch_ops.py, C++ argument checks in _C), once
# the C++ core provides them.
