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

The overlapped ops (ag_gemm, gemm_rs, gemm_ar, and every other op of the C++ catalogue, registered
from its description; wrappers and docs in ops.py) check their arguments in Python (_overlap.py) in
both implementations, so a bad call fails while tracing too. Their real
implementations create or grow the op's context in the C++ runtime when a call needs it (collective;
refused during a CUDA graph capture).
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the annotations as types.
import math
from typing import Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode as _in_dispatch_mode

from . import _overlap
from ._runtime import runtime
from ._tensors import Error, describe_checked, raw_stream, torch_dtype_name

_token = None  # barrier's token, on this rank's device while initialised


def on_init(rt) -> None:
    global _token
    _token = torch.zeros(1, dtype=torch.int32, device=torch.device("cuda", rt.device))
    _signatures.clear()
    tag_compile_caches(rt.world_size, rt.rank)


def on_finalize() -> None:
    global _token
    _token = None
    _signatures.clear()  # they hold this world's rank and size
    untag_compile_caches()


# --- torch.compile's caches -----------------------------------------------------------------------
#
# The fake implementations' output shapes depend on the world's size and this rank (an AllGather's
# rows, a GEMM-ReduceScatter's share of M), which the traced graph's text does not show. torch.compile's
# on-disk caches (FX graph, AOTAutograd) are keyed by that text and shared by every process of a user,
# so a graph compiled at world size 1 was loaded at world size 2 and failed its shape asserts (and
# rank 1 could load rank 0's, where their shares of M differ). While a world is up, its size and this rank are part of their key
# (torch.compiler.config.cache_key_tag, appended to the user's own tag); torch without the setting
# gets those two caches turned off instead. Dynamo's in-process cache does not read the tag: a world
# of another size or rank in the same process resets it.
_TAG_SEPARATOR = "|"
_compile_tag = None      # what tag_compile_caches appended, while a world is up
_last_world = None       # (world_size, rank) of the last world of this process


def _compiler_config():
    """torch.compiler.config where the installed torch has cache_key_tag, else None."""
    try:
        import torch.compiler.config as config
    except ImportError:
        return None
    return config if hasattr(config, "cache_key_tag") else None


def tag_compile_caches(world_size: int, rank: int) -> None:
    """Makes this world's size and rank part of torch.compile's cache keys (see above)."""
    global _compile_tag, _last_world
    untag_compile_caches()
    if _last_world is not None and _last_world != (world_size, rank):
        import torch._dynamo
        torch._dynamo.reset()
    _last_world = (world_size, rank)
    config = _compiler_config()
    if config is None:
        import torch._functorch.config
        import torch._inductor.config
        torch._inductor.config.fx_graph_cache = False
        if hasattr(torch._functorch.config, "enable_autograd_cache"):
            torch._functorch.config.enable_autograd_cache = False
        return
    _compile_tag = f"tdist world_size={world_size} rank={rank}"
    config.cache_key_tag = _TAG_SEPARATOR.join(t for t in (config.cache_key_tag, _compile_tag) if t)


def untag_compile_caches() -> None:
    """Takes this world's part out of the cache tag (what the user set meanwhile stays)."""
    global _compile_tag
    if _compile_tag is None:
        return
    config = _compiler_config()
    parts = config.cache_key_tag.split(_TAG_SEPARATOR)
    if _compile_tag in parts:
        parts.remove(_compile_tag)
        config.cache_key_tag = _TAG_SEPARATOR.join(parts)
    _compile_tag = None


def barrier_token() -> Tensor:
    if _token is None:
        raise Error("tdist.barrier: tdist is not initialised; call tdist.init() first")
    return _token


def _stream(t: Tensor) -> int:
    if t.device.type != "cuda":
        return 0  # the C++ checks reject the tensor with a clear message
    return raw_stream(t.device.index)


# --- the eager path -------------------------------------------------------------------------------
#
# Through torch.ops.tdist.*, a call pays the dispatcher and torch.library's custom-op layers (autograd
# wrapper, dynamo guard, alias checks): about 60 us of host time on an H200 host, more than the C++
# op itself. A plain eager call (no tracing or compiling, no dispatch or function mode, no functorch
# transform, no profiler, no input needing a gradient, plain tensors or parameters) calls the real
# implementation directly instead; it is the same code the dispatcher would reach. Everything
# else keeps going through the registered ops, so torch.compile, FakeTensor, autograd and the
# profiler see them as before.
_compiling = torch.compiler.is_compiling
_profiling = torch._C._autograd._profiler_enabled
_function_modes = getattr(torch._C, "_len_torch_function_stack", lambda: 0)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_increment_version = torch.autograd.graph.increment_version
# Tensor types the eager path takes: plain tensors and parameters (a Parameter overrides neither
# __torch_function__ nor __torch_dispatch__; tdist.nn's weights are Parameters).
_PLAIN = (Tensor, torch.nn.Parameter)


def eager(*tensors) -> bool:
    """Whether a call on `tensors` may skip the dispatcher (see above)."""
    if _compiling() or _in_dispatch_mode() or _function_modes() or _functorch_active() or _profiling():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if type(t) not in _PLAIN or (grad and t.requires_grad):
            return False
    return True


def _world_size(op: str) -> int:
    return runtime(op).world_size


def run_collective(op: str, input: Tensor, output: Tensor, method: str) -> None:
    """The C++ collective `op` from `input` into `output` on torch's current stream. `output`'s
    version counter is bumped, as the dispatcher does for a mutated argument: on the eager path an
    in-place call on a tensor that autograd saved (x in y = x * w) must make backward refuse, not
    use the new values."""
    d_in, d_out = describe_checked(input, op, "input"), describe_checked(output, op, "output")
    getattr(runtime(op), op)(d_in, d_out, _stream(input), method)
    _increment_version(output)


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
    run_collective("all_reduce", input, output, method)
    return output


@all_reduce.register_fake
def _(input, method="auto"):
    return torch.empty(input.shape, dtype=input.dtype, device=input.device)


@torch.library.custom_op("tdist::all_reduce_inplace", mutates_args=("tensor",))
def all_reduce_inplace(tensor: Tensor, method: str = "auto") -> None:
    run_collective("all_reduce", tensor, tensor, method)


@all_reduce_inplace.register_fake
def _(tensor, method="auto"):
    return None


@torch.library.custom_op("tdist::all_reduce_out", mutates_args=("output",))
def all_reduce_out(input: Tensor, output: Tensor, method: str = "auto") -> None:
    run_collective("all_reduce", input, output, method)


@all_reduce_out.register_fake
def _(input, output, method="auto"):
    return None


# --- all_gather -----------------------------------------------------------------------------------

def all_gather_new(input: Tensor, method: str = "auto") -> Tensor:
    """all_gather into a new tensor (the op's real implementation, and the eager path)."""
    output = torch.empty(_gathered_shape(input, _world_size("all_gather")), dtype=input.dtype, device=input.device)
    run_collective("all_gather", input, output, method)
    return output


all_gather = torch.library.custom_op("tdist::all_gather", all_gather_new, mutates_args=())


@all_gather.register_fake
def _(input, method="auto"):
    return input.new_empty(_gathered_shape(input, _world_size("all_gather")))


@torch.library.custom_op("tdist::all_gather_out", mutates_args=("output",))
def all_gather_out(input: Tensor, output: Tensor, method: str = "auto") -> None:
    run_collective("all_gather", input, output, method)


@all_gather_out.register_fake
def _(input, output, method="auto"):
    return None


# --- reduce_scatter -------------------------------------------------------------------------------

def reduce_scatter_new(input: Tensor, method: str = "auto") -> Tensor:
    """reduce_scatter into a new tensor (the op's real implementation, and the eager path)."""
    shape = _scattered_shape(input, _world_size("reduce_scatter"))
    output = torch.empty(shape, dtype=input.dtype, device=input.device)
    run_collective("reduce_scatter", input, output, method)
    return output


reduce_scatter = torch.library.custom_op("tdist::reduce_scatter", reduce_scatter_new, mutates_args=())


@reduce_scatter.register_fake
def _(input, method="auto"):
    return input.new_empty(_scattered_shape(input, _world_size("reduce_scatter")))


@torch.library.custom_op("tdist::reduce_scatter_out", mutates_args=("output",))
def reduce_scatter_out(input: Tensor, output: Tensor, method: str = "auto") -> None:
    run_collective("reduce_scatter", input, output, method)


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


# --- overlapped ops: ag_gemm, gemm_rs, gemm_ar and the rest of the C++ catalogue ------------------
#
# Every op is described once in the C++ catalogue (_overlap.op_traits): the helpers below derive the
# call's extents, the output shapes and the C++ call from it. ag_gemm, gemm_rs and gemm_ar keep
# hand-written torch.library definitions (their Python signatures are public); every other op of
# the catalogue is registered from its description by _register_from_catalogue:
#   tdist::NAME(Tensor <input>, ..., [SymInt? m=None,] str method="auto") -> Tensor | (Tensor, ...)
# with `m` where an input holds only this rank's rows, and one op NAME_<output> per optional output
# that returns it after the required ones.

def _operand(t: Tensor, real: bool) -> _overlap.Operand:
    dev = t.device
    return _overlap.Operand(tuple(t.shape), torch_dtype_name(t.dtype), dev.type, dev.index, t.is_contiguous(),
                            t.data_ptr() if real and dev.type == "cuda" and t.numel() > 0 else None)


def _dims(op: str, inputs, m, method, real: bool) -> _overlap.Dims:
    """The Python checks of one call (real and fake implementations alike); `inputs` in the
    catalogue's input order."""
    _overlap.check_method(op, method)
    rt = runtime(op)
    traits = _overlap.op_traits(op)
    named = {o[0]: _operand(t, real) for o, t in zip(traits.inputs, inputs)}
    return _overlap.call_dims(op, named, m, rt.world_size, rt.rank)


def _wanted_outputs(op: str, optional: Tuple[str, ...]) -> tuple:
    """The catalogue outputs a call returns: the required ones, then the optional ones named in `optional`."""
    traits = _overlap.op_traits(op)
    return traits.outputs + tuple(o for o in traits.optional_outputs if o[0] in optional)


def _fake_outputs(op: str, dims: _overlap.Dims, like: Tensor, optional: Tuple[str, ...] = ()):
    """The outputs of a call as the fake implementations return them (shapes only)."""
    return [like.new_empty(_overlap.shape_of(o[1:3], dims)) for o in _wanted_outputs(op, optional)]


class _Signature(NamedTuple):
    """What a call's shapes, dtypes, devices, m and method determine, checked once."""

    dims: _overlap.Dims
    out_shapes: tuple  # the new outputs: the required ones, then the optional ones asked for
    sources: tuple     # per catalogue operand: its index in inputs + outputs, or -1 (absent)
    numels: tuple      # per catalogue operand: its element count (0 where absent)
    dtype: str
    device: int


# Signatures seen, by (op, optional, m, method, (shape, dtype, device) of each input). A call with a
# known signature skips the Python checks: what they check is in the key, and what depends on the
# tensors themselves (contiguity, alignment, overlaps) the C++ core checks on every call.
_signatures: Dict[tuple, _Signature] = {}
_MAX_SIGNATURES = 4096


def _signature(op: str, inputs, m, method: str, optional: Tuple[str, ...]) -> _Signature:
    key = (op, optional, m, method) + tuple((t.shape, t.dtype, t.device) for t in inputs)
    sig = _signatures.get(key)
    if sig is not None:
        return sig
    dims = _dims(op, inputs, m, method, True)  # raises naming the argument; failures are not remembered
    traits = _overlap.op_traits(op)
    wanted = _wanted_outputs(op, optional)
    out_shapes = tuple(_overlap.shape_of(o[1:3], dims) for o in wanted)
    names = [o[0] for o in traits.inputs] + [o[0] for o in wanted]
    shapes = [tuple(t.shape) for t in inputs] + list(out_shapes)
    sources = tuple(names.index(o[0]) if o[0] in names else -1 for o in traits.operands)
    numels = tuple(math.prod(shapes[i]) if i >= 0 else 0 for i in sources)
    if len(_signatures) >= _MAX_SIGNATURES:
        _signatures.clear()
    sig = _signatures[key] = _Signature(dims, out_shapes, sources, numels, torch_dtype_name(inputs[0].dtype),
                                        inputs[0].device.index)
    return sig


def _overlap_call(op: str, inputs, m, method: str, optional: Tuple[str, ...], run: bool):
    """New outputs of a call of a catalogue op on real tensors, then the C++ op on torch's current
    stream (with `run` false it only resolves the method, creating or growing the op's context like a
    call). Returns (outputs, the method that ran or would run)."""
    sig = _signature(op, inputs, m, method, optional)
    like = inputs[0]
    outputs = [torch.empty(shape, dtype=like.dtype, device=like.device) for shape in sig.out_shapes]
    tensors = (*inputs, *outputs)
    descs = [None if i < 0 else (tensors[i].data_ptr(), n, sig.dtype, "cuda", sig.device, tensors[i].is_contiguous())
             for i, n in zip(sig.sources, sig.numels)]
    d = sig.dims
    return outputs, runtime(op).overlap(op, descs, d.m, d.n, d.k, raw_stream(sig.device), method, run)


def call_overlap(op: str, inputs, m, method: str, optional: Tuple[str, ...] = ()):
    """One call of a catalogue op: its new outputs. The real implementation of every catalogue op,
    and the eager path."""
    return _overlap_call(op, inputs, m, method, optional, True)[0]


def gemm_method(op: str, a: Tensor, b: Tensor, m: Optional[int] = None, method: str = "auto") -> str:
    """The method a call of ``op`` with these operands would run ("auto" and TDIST_OVERLAP_METHOD
    resolved), without running it. Collective when the op's context has to be created or grown, like
    a call."""
    return _overlap_call(op, (a, b), m, method, (), False)[1]


@torch.library.custom_op("tdist::ag_gemm", mutates_args=())
def ag_gemm(a_local: Tensor, b: Tensor, m: Optional[int] = None, method: str = "auto") -> Tensor:
    return call_overlap("ag_gemm", (a_local, b), m, method)[0]


@ag_gemm.register_fake
def _(a_local, b, m=None, method="auto"):
    return _fake_outputs("ag_gemm", _dims("ag_gemm", (a_local, b), m, method, False), a_local)[0]


@torch.library.custom_op("tdist::ag_gemm_gathered", mutates_args=())
def ag_gemm_gathered(a_local: Tensor, b: Tensor, m: Optional[int] = None,
                     method: str = "auto") -> Tuple[Tensor, Tensor]:
    d, gathered = call_overlap("ag_gemm", (a_local, b), m, method, ("gathered",))
    return d, gathered


@ag_gemm_gathered.register_fake
def _(a_local, b, m=None, method="auto"):
    dims = _dims("ag_gemm", (a_local, b), m, method, False)
    d, gathered = _fake_outputs("ag_gemm", dims, a_local, ("gathered",))
    return d, gathered


@torch.library.custom_op("tdist::gemm_rs", mutates_args=())
def gemm_rs(a: Tensor, b: Tensor, method: str = "auto") -> Tensor:
    return call_overlap("gemm_rs", (a, b), None, method)[0]


@gemm_rs.register_fake
def _(a, b, method="auto"):
    return _fake_outputs("gemm_rs", _dims("gemm_rs", (a, b), None, method, False), a)[0]


@torch.library.custom_op("tdist::gemm_ar", mutates_args=())
def gemm_ar(a: Tensor, b: Tensor, method: str = "auto") -> Tensor:
    return call_overlap("gemm_ar", (a, b), None, method)[0]


@gemm_ar.register_fake
def _(a, b, method="auto"):
    return _fake_outputs("gemm_ar", _dims("gemm_ar", (a, b), None, method, False), a)[0]


_HAND_WRITTEN = ("ag_gemm", "gemm_rs", "gemm_ar")
# Every catalogue op's torch op by name (NAME, and NAME_<output> for an optional output), all with
# the schema convention above.
catalogue_ops = {name: getattr(torch.ops.tdist, name).default
                 for name in ("ag_gemm", "ag_gemm_gathered", "gemm_rs", "gemm_ar")}


def _register(name: str, op: str, optional: Tuple[str, ...]) -> None:
    traits = _overlap.op_traits(op)
    args = ", ".join(f"Tensor {o[0]}" for o in traits.inputs)
    if traits.takes_m:
        args += ", SymInt? m=None"
    n_out = len(traits.outputs) + len(optional)
    ret = "Tensor" if n_out == 1 else "(" + ", ".join(["Tensor"] * n_out) + ")"
    schema = f"({args}, str method=\"auto\") -> {ret}"
    n_in = len(traits.inputs)

    def split(args):
        inputs, rest = args[:n_in], list(args[n_in:])
        m = rest.pop(0) if traits.takes_m and rest else None
        method = rest.pop(0) if rest else "auto"
        return inputs, m, method

    def real(*args):
        inputs, m, method = split(args)
        out = call_overlap(op, inputs, m, method, optional)
        return out[0] if n_out == 1 else tuple(out)

    def fake(*args):
        inputs, m, method = split(args)
        out = _fake_outputs(op, _dims(op, inputs, m, method, False), inputs[0], optional)
        return out[0] if n_out == 1 else tuple(out)

    torch.library.custom_op(f"tdist::{name}", real, mutates_args=(), schema=schema).register_fake(fake)
    catalogue_ops[name] = getattr(torch.ops.tdist, name).default


def _register_from_catalogue() -> None:
    for op, traits in _overlap.ops().items():
        if op in _HAND_WRITTEN:
            continue
        _register(op, op, ())
        for o in traits.optional_outputs:
            _register(f"{op}_{o[0]}", op, (o[0],))


_register_from_catalogue()


from . import _autograd  # noqa: E402,F401  (the GEMMs' autograd formulas, registered on import)
