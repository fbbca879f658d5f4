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

barrier mutates a one-element token tensor that tdist keeps: an op with neither outputs nor
mutations could be dropped or moved freely by graph passes; a mutation keeps it in the graph.

Fused GEMM + collective ops (ag_gemm, gemm_rs, gemm_ar) register here too, next to their Python
wrappers in ops.py, when the C++ core has them.
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the annotations as types.
import torch
from torch import Tensor

from ._runtime import runtime
from ._tensors import Error, describe_checked

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
