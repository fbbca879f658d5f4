"""torch.library registration of tdist's ops (namespace "tdist"), imported when torch is present.

Each op has a real (CUDA) implementation, which calls the C++ core on torch's current stream, and a
fake implementation (shapes only), so torch.compile(fullgraph=True) traces them and CUDA graphs
capture them. Functional (out-of-place) forms return new tensors; ``*_out`` and ``*_inplace`` forms declare
the tensors they mutate (names without a trailing underscore, which torch reserves for
in-place ops that return their input).

  tdist::all_reduce(Tensor input, str method="auto") -> Tensor
  tdist::all_reduce_inplace(Tensor(a!) tensor, str method="auto") -> ()
  tdist::all_reduce_out(Tensor input, Tensor(a!) output, str method="auto") -> ()
  tdist::all_gather(Tensor input, str method="auto") -> Tensor           # dim 0 grows world_size x
  tdist::all_gather_out(Tensor input, Tensor(a!) output, str method="auto") -> ()
  tdist::reduce_scatter(Tensor input, str method="auto") -> Tensor       # dim 0 shrinks world_size x
  tdist::reduce_scatter_out(Tensor input, Tensor(a!) output, str method="auto") -> ()
  tdist::barrier(Tensor(a!) token) -> ()
  tdist::ag_gemm(Tensor a_local, Tensor b, SymInt? m=None, str method="auto") -> Tensor
  tdist::ag_gemm_gathered(Tensor a_local, Tensor b, SymInt? m=None, str method="auto") -> (Tensor, Tensor)
  tdist::gemm_rs(Tensor a, Tensor b, str method="auto") -> Tensor
  tdist::gemm_ar(Tensor a, Tensor b, str method="auto") -> Tensor

barrier mutates a one-element token tensor that tdist keeps: an op with neither outputs nor
mutations could be dropped or moved freely by graph passes; a mutation keeps it in the graph.

The overlapped GEMMs (ag_gemm, gemm_rs, gemm_ar; wrappers and docs in ops.py) check their arguments
in Python (_overlap.py) in both implementations, so a bad call fails while tracing too. Their real
implementations create or grow the op's context in the C++ runtime when a call needs it (collective;
refused during a CUDA graph capture).
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the annotations as types.
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _overlap
from ._runtime import runtime
from ._tensors import Error, describe_checked, torch_dtype_name

_token = None  # barrier's token, on this rank's device while initialised


def on_init(rt) -> None:
    global _token
    _token = torch.zeros(1, dtype=torch.int32, device=torch.device("cuda", rt.device))


def on_finalize() -> None:
    global _token
    _token = None


def barrier_token() -> Tensor:
    if _token is None:
        raise Error("tdist.barrier: tdist is not initialised; call tdist.init() first")
    return _token


def _stream(t: Tensor) -> int:
    if t.device.type != "cuda":
        return 0  # the C++ checks reject the tensor with a clear message
    return torch.cuda.current_stream(t.device).cuda_stream


def _world_size(op: str) -> int:
    return runtime(op).world_size


def _run(op: str, input: Tensor, output: Tensor, method: str) -> None:
    d_in, d_out = describe_checked(input, op, "input"), describe_checked(output, op, "output")
    getattr(runtime(op), op)(d_in, d_out, _stream(input), method)


def _gathered_shape(input: Tensor, world: int):
    if input.dim() == 0:
        return (world,)
    return (world * input.shape[0],) + tuple(input.shape[1:])


def _scattered_shape(input: Tensor, world: int):
    if input.dim() == 0 or input.shape[0] % world != 0:
        raise Error(f"tdist.reduce_scatter: input's first dimension ({tuple(input.shape)}) must be a multiple of "
                    f"world_size={world}; pass output= to choose another layout")
    return (input.shape[0] // world,) + tuple(input.shape[1:])


# --- all_reduce -----------------------------------------------------------------------------------

@torch.library.custom_op("tdist::all_reduce", mutates_args=())
def all_reduce(input: Tensor, method: str = "auto") -> Tensor:
    output = torch.empty(input.shape, dtype=input.dtype, device=input.device)
    _run("all_reduce", input, output, method)
    return output


@all_reduce.register_fake
def _(input, method="auto"):
    return torch.empty(input.shape, dtype=input.dtype, device=input.device)


@torch.library.custom_op("tdist::all_reduce_inplace", mutates_args=("tensor",))
def all_reduce_inplace(tensor: Tensor, method: str = "auto") -> None:
    _run("all_reduce", tensor, tensor, method)


@all_reduce_inplace.register_fake
def _(tensor, method="auto"):
    return None


@torch.library.custom_op("tdist::all_reduce_out", mutates_args=("output",))
def all_reduce_out(input: Tensor, output: Tensor, method: str = "auto") -> None:
    _run("all_reduce", input, output, method)


@all_reduce_out.register_fake
def _(input, output, method="auto"):
    return None


# --- all_gather -----------------------------------------------------------------------------------

@torch.library.custom_op("tdist::all_gather", mutates_args=())
def all_gather(input: Tensor, method: str = "auto") -> Tensor:
    output = torch.empty(_gathered_shape(input, _world_size("all_gather")), dtype=input.dtype, device=input.device)
    _run("all_gather", input, output, method)
    return output


@all_gather.register_fake
def _(input, method="auto"):
    return input.new_empty(_gathered_shape(input, _world_size("all_gather")))


@torch.library.custom_op("tdist::all_gather_out", mutates_args=("output",))
def all_gather_out(input: Tensor, output: Tensor, method: str = "auto") -> None:
    _run("all_gather", input, output, method)


@all_gather_out.register_fake
def _(input, output, method="auto"):
    return None


# --- reduce_scatter -------------------------------------------------------------------------------

@torch.library.custom_op("tdist::reduce_scatter", mutates_args=())
def reduce_scatter(input: Tensor, method: str = "auto") -> Tensor:
    shape = _scattered_shape(input, _world_size("reduce_scatter"))
    output = torch.empty(shape, dtype=input.dtype, device=input.device)
    _run("reduce_scatter", input, output, method)
    return output


@reduce_scatter.register_fake
def _(input, method="auto"):
    return input.new_empty(_scattered_shape(input, _world_size("reduce_scatter")))


@torch.library.custom_op("tdist::reduce_scatter_out", mutates_args=("output",))
def reduce_scatter_out(input: Tensor, output: Tensor, method: str = "auto") -> None:
    _run("reduce_scatter", input, output, method)


@reduce_scatter_out.register_fake
def _(input, output, method="auto"):
    return None


# --- barrier --------------------------------------------------------------------------------------

@torch.library.custom_op("tdist::barrier", mutates_args=("token",))
def barrier(token: Tensor) -> None:
    runtime("barrier").barrier(_stream(token))


@barrier.register_fake
def _(token):
    return None


# --- overlapped GEMMs: ag_gemm, gemm_rs, gemm_ar ---------------------------------------------------

def _operand(t: Tensor, real: bool) -> _overlap.Operand:
    dev = t.device
    return _overlap.Operand(tuple(t.shape), torch_dtype_name(t.dtype), dev.type, dev.index, t.is_contiguous(),
                            t.data_ptr() if real and dev.type == "cuda" and t.numel() > 0 else None)


def _rank_world(op: str):
    rt = runtime(op)
    return rt.rank, rt.world_size


def _dims(op: str, a: Tensor, b: Tensor, m, method, real: bool) -> _overlap.Dims:
    """The Python checks of one call (real and fake implementations alike)."""
    _overlap.check_method(op, method)
    rank, world = _rank_world(op)
    if op == "ag_gemm":
        return _overlap.ag_gemm_dims(_operand(a, real), _operand(b, real), m, world, rank)
    return _overlap.gemm_rs_dims(_operand(a, real), _operand(b, real), world, rank, op=op)


def _d_shape(op: str, dims: _overlap.Dims):
    return (dims.rows if op == "gemm_rs" else dims.m, dims.n)


def _descs(op: str, a: Tensor, b: Tensor, d: Tensor):
    a_name = "a_local" if op == "ag_gemm" else "a"
    return [describe_checked(t, op, name) for t, name in ((a, a_name), (b, "b"), (d, "d"))]


def _run_gemm(op: str, dims: _overlap.Dims, method: str, a: Tensor, b: Tensor, d: Tensor,
              gathered: Optional[Tensor] = None) -> None:
    """The C++ call on torch's current stream (after the Python checks; C++ checks the descriptors)."""
    rt = runtime(op)
    descs = _descs(op, a, b, d)
    if op == "ag_gemm":
        g = None if gathered is None else describe_checked(gathered, op, "gathered")
        rt.ag_gemm(*descs, g, dims.m, dims.n, dims.k, _stream(a), method)
    else:
        getattr(rt, op)(*descs, dims.m, dims.n, dims.k, _stream(a), method)


def gemm_method(op: str, a: Tensor, b: Tensor, m: Optional[int] = None, method: str = "auto") -> str:
    """The method a call of ``op`` (ag_gemm, gemm_rs, gemm_ar) with these operands would run ("auto"
    and TDIST_OVERLAP_METHOD resolved), without running it. Collective when the op's context has to be
    created or grown, like a call."""
    dims = _dims(op, a, b, m, method, True)
    d = torch.empty(_d_shape(op, dims), dtype=a.dtype, device=a.device)
    return runtime(op).gemm_method(op, *_descs(op, a, b, d), None, dims.m, dims.n, dims.k, _stream(a), method)


@torch.library.custom_op("tdist::ag_gemm", mutates_args=())
def ag_gemm(a_local: Tensor, b: Tensor, m: Optional[int] = None, method: str = "auto") -> Tensor:
    dims = _dims("ag_gemm", a_local, b, m, method, True)
    d = torch.empty(_d_shape("ag_gemm", dims), dtype=a_local.dtype, device=a_local.device)
    _run_gemm("ag_gemm", dims, method, a_local, b, d)
    return d


@ag_gemm.register_fake
def _(a_local, b, m=None, method="auto"):
    return a_local.new_empty(_d_shape("ag_gemm", _dims("ag_gemm", a_local, b, m, method, False)))


@torch.library.custom_op("tdist::ag_gemm_gathered", mutates_args=())
def ag_gemm_gathered(a_local: Tensor, b: Tensor, m: Optional[int] = None,
                     method: str = "auto") -> Tuple[Tensor, Tensor]:
    dims = _dims("ag_gemm", a_local, b, m, method, True)
    d = torch.empty(_d_shape("ag_gemm", dims), dtype=a_local.dtype, device=a_local.device)
    gathered = torch.empty((dims.m, dims.k), dtype=a_local.dtype, device=a_local.device)
    _run_gemm("ag_gemm", dims, method, a_local, b, d, gathered)
    return d, gathered


@ag_gemm_gathered.register_fake
def _(a_local, b, m=None, method="auto"):
    dims = _dims("ag_gemm", a_local, b, m, method, False)
    return a_local.new_empty(_d_shape("ag_gemm", dims)), a_local.new_empty((dims.m, dims.k))


def _gemm_reduce(op: str, a: Tensor, b: Tensor, method: str, real: bool) -> Tensor:
    dims = _dims(op, a, b, None, method, real)
    if not real:
        return a.new_empty(_d_shape(op, dims))
    d = torch.empty(_d_shape(op, dims), dtype=a.dtype, device=a.device)
    _run_gemm(op, dims, method, a, b, d)
    return d


@torch.library.custom_op("tdist::gemm_rs", mutates_args=())
def gemm_rs(a: Tensor, b: Tensor, method: str = "auto") -> Tensor:
    return _gemm_reduce("gemm_rs", a, b, method, True)


@gemm_rs.register_fake
def _(a, b, method="auto"):
    return _gemm_reduce("gemm_rs", a, b, method, False)


@torch.library.custom_op("tdist::gemm_ar", mutates_args=())
def gemm_ar(a: Tensor, b: Tensor, method: str = "auto") -> Tensor:
    return _gemm_reduce("gemm_ar", a, b, method, True)


@gemm_ar.register_fake
def _(a, b, method="auto"):
    return _gemm_reduce("gemm_ar", a, b, method, False)


from . import _autograd  # noqa: E402,F401  (the GEMMs' autograd formulas, registered on import)
