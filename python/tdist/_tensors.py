"""Tensors as the C++ core sees them: descriptors built from torch tensors, DLPack or
__cuda_array_interface__ objects, and CUDA streams as integers. torch is optional here."""

from __future__ import annotations

import math

from . import _C

Error = _C.Error

try:  # torch is optional: import tdist works without it
    import torch as _torch
except ImportError:  # pragma: no cover - depends on the environment
    _torch = None

# __cuda_array_interface__ typestr -> dtype name (bfloat16 has no typestr)
_TYPESTR = {
    "f2": "float16", "f4": "float32", "f8": "float64",
    "i1": "int8", "i2": "int16", "i4": "int32", "i8": "int64",
    "u1": "uint8", "u2": "uint16", "u4": "uint32", "u8": "uint64", "b1": "bool",
}

# torch dtype name -> (DLPack type code, bits)
_DLPACK = {
    "float16": (2, 16), "float32": (2, 32), "float64": (2, 64), "bfloat16": (4, 16),
    "int8": (0, 8), "int16": (0, 16), "int32": (0, 32), "int64": (0, 64),
    "uint8": (1, 8), "uint16": (1, 16), "uint32": (1, 32), "uint64": (1, 64), "bool": (6, 8),
}


def torch_module():
    """torch, or None when it is not installed."""
    return _torch


def require_torch(what: str):
    if _torch is None:
        raise Error(f"{what} needs PyTorch, which is not installed")
    return _torch


def is_torch_tensor(x) -> bool:
    return _torch is not None and isinstance(x, _torch.Tensor)


_dtype_names: dict = {}


def torch_dtype_name(dtype) -> str:
    """"bfloat16" for torch.bfloat16 (memoised: str() of a dtype costs a microsecond a call)."""
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).rsplit(".", 1)[-1]
    return name


def tensor_shape(t) -> tuple:
    """A tensor's shape as a tuple of ints."""
    return tuple(int(s) for s in t.shape)


def check_tensor_kind(fail, name: str, t, dtypes, dims) -> None:
    """That `t` is a torch tensor of one of `dtypes` (names) with shape `dims` (None: any size); else
    fail(name, expected, got), which raises. Devices and layout are the caller's to check. It runs
    for every argument of every op call: the shape is compared as torch gives it, in a plain loop
    (a generator and tensor_shape's conversion of each size cost about twice as much)."""
    if _torch is None or not isinstance(t, _torch.Tensor):
        fail(name, "a torch tensor", type(t).__name__)
    dtype_name = torch_dtype_name(t.dtype)
    if dtype_name not in dtypes:
        fail(name, " or ".join(dtypes), dtype_name)
    shape = t.shape
    ok = len(shape) == len(dims)
    if ok:
        for s, d in zip(shape, dims):
            if d is not None and s != d:
                ok = False
                break
    if not ok:
        expected = "[" + ", ".join("*" if d is None else str(d) for d in dims) + "]"
        fail(name, f"shape {expected}", list(tensor_shape(t)))


def dlpack_dtype(dtype) -> tuple[int, int]:
    name = torch_dtype_name(dtype)
    if name not in _DLPACK:
        raise Error(f"tdist: dtype {name} cannot back a symmetric tensor (supported: {', '.join(_DLPACK)})")
    return _DLPACK[name]


def describe(x, op: str, name: str):
    """(ptr, numel, dtype name, device type, device index or -1, contiguous) of an array argument."""
    if is_torch_tensor(x):
        dev = x.device
        return (x.data_ptr(), x.numel(), torch_dtype_name(x.dtype), dev.type,
                -1 if dev.index is None else dev.index, x.is_contiguous())
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(cai["shape"])
        typestr = cai["typestr"]
        dtype = _TYPESTR.get(typestr[1:], f"typestr {typestr}")
        itemsize = int(typestr[2:]) if typestr[2:].isdigit() else 0
        strides = cai.get("strides")
        contiguous = True
        if strides is not None:
            expected = itemsize
            for n, s in zip(reversed(shape), reversed(tuple(strides))):
                if n != 1 and s != expected:
                    contiguous = False
                expected *= n
        return (int(cai["data"][0]), math.prod(shape), dtype, "cuda", -1, contiguous)
    if hasattr(x, "__dlpack__"):
        try:
            return _C.dlpack_describe(x)
        except TypeError as e:
            raise Error(f"tdist.{op}: '{name}' could not be read through DLPack: {e}") from None
    raise Error(f"tdist.{op}: '{name}' must be a torch.Tensor or an array exporting DLPack or "
                f"__cuda_array_interface__, got {type(x).__name__}")


def describe_checked(x, op: str, name: str):
    """describe(), then the C++ checks that need no runtime (CUDA, dtype, contiguity)."""
    d = describe(x, op, name)
    _C.check_tensor(op, name, d)
    return d


def current_stream(device: int | None = None) -> int:
    """torch's current CUDA stream on `device` (cudaStream_t as an int), or 0 without torch."""
    if _torch is None:
        return 0
    if device is None or device < 0:
        device = _torch.cuda.current_device()
    return raw_stream(device)


# torch._C._cuda_getCurrentRawStream (what torch.compile's generated code calls) returns the handle
# without building a torch.cuda.Stream object: a fraction of a microsecond against 6 us on an H200 host.
_get_raw_stream = getattr(getattr(_torch, "_C", None), "_cuda_getCurrentRawStream", None)


def raw_stream(device: int) -> int:
    """torch's current CUDA stream on device index `device`, as an int cudaStream_t."""
    if _get_raw_stream is None:
        return _torch.cuda.current_stream(device).cuda_stream
    return _get_raw_stream(device)


def stream_handle(stream) -> int:
    """An int cudaStream_t from None (torch's current stream), an int, or a torch.cuda.Stream."""
    if stream is None:
        return current_stream()
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        raise Error(f"tdist: stream must be None, an int cudaStream_t or a torch.cuda.Stream, got {type(stream).__name__}")
    return int(handle)
