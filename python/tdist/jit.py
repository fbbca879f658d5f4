"""Run-time compilation of CUDA C++ kernels (tdist's JIT: NVRTC or nvcc, cached on disk) and
launching them on torch tensors.

    mod = tdist.jit.compile(SOURCE, name_expressions=["scale<float>"])
    k = mod.kernel("scale<float>", signature="float*, const float*, float, u64")
    k(out, x, 2.0, x.numel(), grid=(x.numel() + 255) // 256, block=256)

Tensors pass as device pointers; Python numbers need a C type, from the kernel's signature or
wrapped: ``tdist.jit.u64(n)``, ``tdist.jit.f32(x)``. Launches go to torch's current stream unless
``stream=`` says otherwise. Compiling needs no GPU (give ``arch``); launching does. docs/jit.md
describes the cache, the compilers and the environment settings.
"""

from __future__ import annotations

from . import _C
from ._tensors import Error, current_stream, is_torch_tensor, stream_handle

__all__ = ["compile", "Module", "Kernel", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64", "f32",
           "f64", "boolean", "ptr"]


class _Typed:
    """A Python value with the C type it is passed as."""

    __slots__ = ("value",)
    ctype = ""

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return f"tdist.jit.{type(self).__name__}({self.value!r})"


def _typed(name: str, ctype: str, what: str):
    cls = type(name, (_Typed,), {"__slots__": (), "ctype": ctype,
                                 "__doc__": f"Pass a Python value to a kernel as {what}."})
    cls.__module__ = __name__
    return cls


i8 = _typed("i8", "i8", "int8_t")
i16 = _typed("i16", "i16", "int16_t")
i32 = _typed("i32", "i32", "int32_t (int)")
i64 = _typed("i64", "i64", "int64_t (long long)")
u8 = _typed("u8", "u8", "uint8_t")
u16 = _typed("u16", "u16", "uint16_t")
u32 = _typed("u32", "u32", "uint32_t (unsigned)")
u64 = _typed("u64", "u64", "uint64_t (size_t, unsigned long long)")
f32 = _typed("f32", "f32", "float")
f64 = _typed("f64", "f64", "double")
boolean = _typed("boolean", "bool", "bool")
ptr = _typed("ptr", "ptr", "a raw device pointer (an int address)")

# Signature spellings -> argument kinds.
_C_TYPES = {
    "i8": "i8", "int8_t": "i8", "char": "i8", "signed char": "i8",
    "i16": "i16", "int16_t": "i16", "short": "i16",
    "i32": "i32", "int32_t": "i32", "int": "i32",
    "i64": "i64", "int64_t": "i64", "long long": "i64", "long": "i64", "ptrdiff_t": "i64",
    "u8": "u8", "uint8_t": "u8", "unsigned char": "u8",
    "u16": "u16", "uint16_t": "u16", "unsigned short": "u16",
    "u32": "u32", "uint32_t": "u32", "unsigned": "u32", "unsigned int": "u32",
    "u64": "u64", "uint64_t": "u64", "unsigned long long": "u64", "unsigned long": "u64", "size_t": "u64",
    "f32": "f32", "float": "f32", "f64": "f64", "double": "f64", "bool": "bool", "ptr": "ptr",
}


def parse_signature(signature) -> list[str]:
    """Argument kinds from a signature: "float*, const float*, int, u64" or a list of such names."""
    parts = signature.split(",") if isinstance(signature, str) else list(signature)
    kinds = []
    for i, part in enumerate(parts):
        spelled = " ".join(str(part).replace("__restrict__", " ").split())
        if spelled.endswith("*"):
            kinds.append("ptr")
            continue
        words = [w for w in spelled.split() if w not in ("const", "volatile")]
        key = " ".join(words)
        if key not in _C_TYPES:
            raise Error(f"tdist.jit: signature argument {i} '{part.strip()}' is not a known type (pointers, "
                        f"{', '.join(sorted(set(_C_TYPES)))})")
        kinds.append(_C_TYPES[key])
    return kinds


def _pointer_of(x, i: int) -> int:
    if x is None:
        return 0
    if is_torch_tensor(x):
        if x.device.type != "cuda":
            raise Error(f"tdist.jit: argument {i} is a tensor on {x.device}; kernels take CUDA tensors")
        return x.data_ptr()
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    if hasattr(x, "__dlpack__"):
        desc = _C.dlpack_describe(x)
        if desc[3] not in ("cuda", "cuda_managed"):
            raise Error(f"tdist.jit: argument {i} lives on '{desc[3]}'; kernels take CUDA arrays")
        return desc[0]
    return -1  # not an array


def _pack(args, kinds):
    if kinds is not None and len(kinds) != len(args):
        raise Error(f"tdist.jit: the kernel's signature has {len(kinds)} arguments, the launch passed {len(args)}")
    packed = []
    for i, a in enumerate(args):
        want = kinds[i] if kinds is not None else None
        if isinstance(a, _Typed):
            if want is not None and want != a.ctype:
                raise Error(f"tdist.jit: argument {i} is {a!r} but the signature says {want}")
            packed.append((a.ctype, a.value))
            continue
        p = _pointer_of(a, i)
        if p >= 0:
            if want is not None and want != "ptr":
                raise Error(f"tdist.jit: argument {i} is an array but the signature says {want}")
            packed.append(("ptr", p))
            continue
        if isinstance(a, (bool, int, float)):
            if want is None:
                raise Error(f"tdist.jit: argument {i} is a Python {type(a).__name__} ({a!r}) and the kernel has no "
                            "signature: give its C type, e.g. tdist.jit.i32(x), tdist.jit.u64(n), tdist.jit.f32(v), "
                            "or pass signature= to Module.kernel")
            packed.append((want, a))
            continue
        raise Error(f"tdist.jit: argument {i} has unsupported type {type(a).__name__} (tensors, arrays, "
                    "tdist.jit.<type>(value), or numbers with a signature)")
    return packed


def _dim3(v, what: str):
    if isinstance(v, int):
        v = (v,)
    v = tuple(int(x) for x in v)
    if not 1 <= len(v) <= 3 or any(x <= 0 for x in v):
        raise Error(f"tdist.jit: {what} must be a positive int or 1-3 positive ints, got {v}")
    return v + (1,) * (3 - len(v))


class Kernel:
    """One kernel of a Module; call it to launch."""

    def __init__(self, module: "Module", name: str, signature=None):
        self._module = module
        self._kernel = _C.JitKernel(module._compiled, name)
        self.name = name
        self.signature = None if signature is None else parse_signature(signature)

    def __call__(self, *args, grid, block, shared_mem: int = 0, stream=None, cluster=1, pdl: bool = False):
        """Launch on ``grid`` x ``block`` threads with ``args``.

        Args:
            *args: torch tensors / CUDA arrays (device pointers), None (null pointer),
                ``tdist.jit.<type>(value)``, or numbers typed by the signature.
            grid, block, cluster: int or up to three ints.
            shared_mem: dynamic shared memory in bytes (above 48 KiB raises the kernel's limit).
            stream: None (torch's current stream), an int cudaStream_t, or a torch.cuda.Stream.
            pdl: programmatic dependent launch.
        """
        packed = _pack(args, self.signature)
        if stream is None:
            dev = next((a.device.index for a in args if is_torch_tensor(a) and a.device.type == "cuda"), None)
            s = current_stream(dev)
        else:
            s = stream_handle(stream)
        if not isinstance(shared_mem, int) or shared_mem < 0:
            raise Error(f"tdist.jit: shared_mem must be a non-negative int, got {shared_mem!r}")
        self._kernel.launch(_dim3(grid, "grid"), _dim3(block, "block"), packed, shared_mem, s,
                            _dim3(cluster, "cluster"), bool(pdl))

    launch = __call__

    def __repr__(self):
        return f"<tdist.jit.Kernel {self.name!r}>"


class Module:
    """A compiled CUDA module (cubin) from tdist.jit.compile; loaded onto the GPU at first launch."""

    def __init__(self, compiled):
        self._compiled = compiled

    @property
    def arch(self) -> str:
        """The arch the cubin is for ("sm_90a")."""
        return self._compiled.arch

    @property
    def cubin(self) -> bytes:
        """The ELF cubin."""
        return self._compiled.cubin

    @property
    def log(self) -> str:
        """Compiler and ptxas (-v) log."""
        return self._compiled.log

    @property
    def key(self) -> str:
        """The cache key (hex SHA-256)."""
        return self._compiled.key

    @property
    def compiler(self) -> str:
        """Identity of the compiler that built it."""
        return self._compiled.compiler

    @property
    def name_expressions(self) -> list:
        """The name expressions given to compile()."""
        return self._compiled.name_expressions

    def lowered_name(self, name_expression: str) -> str:
        """The mangled symbol of a name expression given to compile()."""
        return self._compiled.lowered_name(name_expression)

    def kernel(self, name: str, signature=None) -> Kernel:
        """A kernel by name expression (``"k<128, float>"``) or symbol (``extern "C"`` name).

        ``signature`` ("float*, const float*, int" or ["ptr", "i32"]) types plain Python
        numbers; without it, numbers must be wrapped (``tdist.jit.i32(x)``).
        """
        return Kernel(self, name, signature)

    def __getitem__(self, name: str) -> Kernel:
        return self.kernel(name)

    def __repr__(self):
        return f"<tdist.jit.Module {self.arch} {self.key[:12]}>"


def compile(source: str, name_expressions=(), arch=None, *, file_name: str = "kernel.cu", constants=None,
            defines=(), include_dirs=(), flags=(), compiler: str = "auto") -> Module:
    """Compile CUDA C++ ``source`` to a Module (cached in memory and on disk).

    Args:
        source: CUDA C++ text; may include ``<tdist/device.cuh>`` and CUDA's headers.
        name_expressions: kernels to instantiate and look up, e.g. ``["k<128, __nv_bfloat16>"]``;
            ``extern "C"`` kernels can be found by name without one.
        arch: "sm_90a", "90a", ...; None: the current GPU's (then a GPU is needed).
        file_name: names the source in compiler messages.
        constants: ``{"kBlock": ("int", 128)}`` or ``[("int", "kBlock", "128")]``, prepended as
            ``static constexpr``.
        defines: "NAME" or "NAME=VALUE".
        include_dirs: searched before tdist's and CUDA's.
        flags: further compiler options ("-maxrregcount=128").
        compiler: "auto" (NVRTC; nvcc for sources that include NCCL), "nvrtc" or "nvcc".

    Raises:
        tdist.Error: with the compiler's log on a compile error.
    """
    if not isinstance(source, str):
        raise Error(f"tdist.jit.compile: source must be a str, got {type(source).__name__}")
    if isinstance(name_expressions, str):
        name_expressions = [name_expressions]
    consts = []
    if isinstance(constants, dict):
        for name, (ctype, value) in constants.items():
            consts.append((str(ctype), str(name), str(value).lower() if isinstance(value, bool) else str(value)))
    elif constants:
        consts = [(str(t), str(n), str(v)) for t, n, v in constants]
    compiled = _C.jit_compile(source, list(name_expressions), "" if arch is None else str(arch), file_name, consts,
                              list(defines), [str(d) for d in include_dirs], list(flags), compiler)
    return Module(compiled)
