"""The process-wide runtime: joining the job (init/finalize) and symmetric tensors."""

from __future__ import annotations

import math
import os
from datetime import timedelta

from . import _C
from ._tensors import Error, dlpack_dtype, require_torch, torch_module

_NCCL_MIN_VERSION = 22800  # NCCL 2.28: the device API (symmetric windows, LSA pointers)


class _State:
    runtime = None       # _C.Runtime while initialised
    process_group = None
    buffers = {}         # address -> _SymmetricBuffer (tdist.empty allocations)
    inits = 0            # init calls in this process, to make bootstrap keys unique


_state = _State()


def runtime(op: str = "this operation"):
    """The live runtime, or tdist.Error when tdist.init() has not been called."""
    rt = _state.runtime
    if rt is None:
        raise Error(f"tdist.{op}: tdist is not initialised; call tdist.init() first")
    return rt


class _SymmetricBuffer:
    """Owner of one tdist.empty allocation; tensors made from it keep it alive. Its memory returns
    to the heap only through tdist.free or tdist.finalize (both collective), never on garbage
    collection, which does not happen at the same point on every rank."""

    __slots__ = ("ptr", "nbytes", "freed", "__weakref__")

    def __init__(self, ptr: int, nbytes: int):
        self.ptr = ptr
        self.nbytes = nbytes
        self.freed = False


def _size_arg(value, what: str) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return _C.parse_size(value)
    if isinstance(value, int) and value > 0:
        return value
    raise Error(f"tdist.init: {what} must be a positive int or a size such as '512M' or '2G', got {value!r}")


class Session:
    """Returned by tdist.init(); as a context manager it calls tdist.finalize() on exit."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        finalize()
        return False

    @property
    def rank(self) -> int:
        """This process's rank."""
        return runtime("rank").rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return runtime("world_size").world_size


def _shares_gpus() -> bool:
    """TDIST_SHARE_GPUS=1, a test mode (World::shares_gpus in C++): ranks may time-share a GPU."""
    return os.environ.get("TDIST_SHARE_GPUS", "") in ("1", "true", "TRUE", "True", "on", "ON", "yes", "YES")


def _claim_own_nccl_host() -> None:
    """Under TDIST_SHARE_GPUS each rank names an NCCL host of its own (NCCL refuses two ranks on one
    GPU of one host); set at import, before torch or tdist creates an NCCL communicator. A value the
    user set is kept. The C++ World does the same for C++ programs."""
    if _shares_gpus():
        os.environ.setdefault("NCCL_HOSTID", "tdist-shared-gpu-rank-" + os.environ.get("RANK", "0"))


def _launcher_device() -> int:
    """This rank's GPU under a launcher: LOCAL_RANK, modulo the visible GPUs when ranks share them."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if _shares_gpus():
        torch = torch_module()
        count = torch.cuda.device_count() if torch is not None else 0
        local %= max(count, 1)
    return local


def _local_device(device) -> int:
    if device is not None:
        if isinstance(device, int):
            return device
        torch = torch_module()
        d = torch.device(device) if torch is not None else None
        if d is None or d.type != "cuda" or d.index is None:
            raise Error(f"tdist.init: device must be a CUDA device index or 'cuda:N', got {device!r}")
        return d.index
    if "LOCAL_RANK" in os.environ:
        return _launcher_device()
    torch = torch_module()
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.current_device()
    return 0


def _uid_from_group(group, device: int) -> bytes:
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    on_gpu = "nccl" in backend or "cuda" in backend
    uid = _C.nccl_unique_id() if dist.get_rank(group) == 0 else bytes(128)
    t = torch.tensor(list(uid), dtype=torch.uint8)
    if on_gpu:
        t = t.to(torch.device("cuda", device))
    dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
    return bytes(t.cpu().tolist())


def _uid_from_torchrun_store(rank: int, world_size: int, timeout_s: float) -> bytes:
    import torch.distributed as dist

    # torchrun's agent owns the store on MASTER_ADDR:MASTER_PORT (tdist's own TCP store could not
    # listen there); workers connect to it as clients.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timedelta(seconds=timeout_s))
    key = "tdist/{}/{}/{}/nccl_unique_id".format(os.environ.get("TORCHELASTIC_RUN_ID", ""),
                                                 os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), _state.inits)
    if rank == 0:
        store.set(key, _C.nccl_unique_id())
    return bytes(store.get(key))


def init(process_group=None, *, device=None, heap_size=None, max_bytes=None, timeout=None) -> Session:
    """Join the job: create this rank's NCCL communicator, symmetric heap and collectives context.

    Collective: every rank calls it. Where the ranks come from:

    * ``process_group`` (a ``torch.distributed`` ProcessGroup): rank and world size are the
      group's; a new NCCL communicator for tdist is bootstrapped by broadcasting its unique id
      over the group. When ``process_group`` is None and ``torch.distributed`` is initialised,
      the default group is used.
    * otherwise under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``): the unique id is
      exchanged through torchrun's store at ``MASTER_ADDR:MASTER_PORT``;
    * otherwise the launcher's environment (tdistrun, torchrun variables, Open MPI, Slurm) with
      tdist's own TCP rendezvous.

    Args:
        process_group: a torch.distributed group whose ranks form tdist's world (all of them on
            one NVLink domain), or None.
        device: CUDA device index (or torch.device) of this rank; default ``LOCAL_RANK``, else the
            current device.
        heap_size: bytes of symmetric memory per rank (int, or '512M', '2G'); default
            ``TDIST_SYMMETRIC_HEAP_SIZE``, else 1 GiB. ``tdist.empty`` and the collectives'
            workspace come from it.
        max_bytes: largest buffer the collectives stage through their workspace (2 x max_bytes
            of the heap); larger calls run through NCCL. Default: heap_size / 8.
        timeout: seconds bounding host waits (rendezvous, NCCL init); default
            ``TDIST_HOST_TIMEOUT_S``, else 300.

    Returns:
        A Session; ``with tdist.init(): ...`` finalizes on exit.

    Raises:
        tdist.Error: already initialised, no GPU, bad sizes, NCCL too old; tdist.TimeoutError
        when a rank does not arrive.
    """
    if _state.runtime is not None:
        raise Error("tdist.init: tdist is already initialised; call tdist.finalize() first")
    heap_bytes = _size_arg(heap_size, "heap_size")
    max_b = _size_arg(max_bytes, "max_bytes")
    timeout_s = float(timeout) if timeout is not None else 0.0
    if timeout is not None and timeout_s <= 0:
        raise Error(f"tdist.init: timeout must be positive seconds, got {timeout!r}")
    nccl = _C.nccl_version()
    if nccl < _NCCL_MIN_VERSION:
        raise Error(f"tdist.init: the process loaded NCCL {nccl}, tdist needs >= {_NCCL_MIN_VERSION} (2.28) for "
                    "its device API; import tdist before torch so that tdist's NCCL is loaded first, or "
                    "install a newer NCCL")
    if not _C.driver_available():
        raise Error("tdist.init: no CUDA driver or GPU is available; tdist needs one GPU per rank")

    torch = torch_module()
    dist = None
    if torch is not None:
        import torch.distributed as dist  # noqa: F811
    group = process_group
    if group is None and dist is not None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    dev = _local_device(device)
    if torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(dev)

    # A fault of an earlier world (tdist.DeviceTimeoutError) concerned that world's flags; this one
    # starts in step, and its construction meets the other ranks without the bound a fault sets.
    _C.clear_device_fault()
    if group is not None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise Error("tdist.init: this process is not a member of process_group")
        uid = _uid_from_group(group, dev)
        rt = _C.Runtime.from_unique_id(uid, rank, world, dev, heap_bytes, max_b, timeout_s)
    elif dist is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        uid = _uid_from_torchrun_store(rank, world, timeout_s or 300.0)
        rt = _C.Runtime.from_unique_id(uid, rank, world, dev, heap_bytes, max_b, timeout_s)
    else:
        rt = _C.Runtime.from_env(-1 if device is None else dev, heap_bytes, max_b, timeout_s)
    _state.inits += 1
    _state.runtime = rt
    _state.process_group = group
    _state.buffers = {}
    if torch is not None:
        from . import _torch_ops
        _torch_ops.on_init(rt)
    return Session()


def finalize() -> None:
    """Leave the job: free every symmetric buffer, the heap and the communicator tdist created.

    Collective (every rank calls it); waits for the GPU first. Tensors from ``tdist.empty`` and
    ``tdist.peer`` must not be used afterwards. A no-op when tdist is not initialised.
    """
    rt = _state.runtime
    if rt is None:
        return
    for buf in _state.buffers.values():
        buf.freed = True
    _state.buffers = {}
    torch = torch_module()
    if torch is not None:
        from . import _torch_ops
        _torch_ops.on_finalize()
    try:
        rt.close()
    finally:
        _state.runtime = None
        _state.process_group = None


def is_initialized() -> bool:
    """Whether tdist.init() has been called (and tdist.finalize() not yet)."""
    return _state.runtime is not None


def get_rank() -> int:
    """This process's rank in tdist's world."""
    return runtime("get_rank").rank


def get_world_size() -> int:
    """Number of ranks in tdist's world."""
    return runtime("get_world_size").world_size


def get_device() -> int:
    """CUDA device index this rank runs on."""
    return runtime("get_device").device


def heap_info() -> dict:
    """The symmetric heap: {'capacity', 'in_use', 'collective_max_bytes'} in bytes, and
    'gemm_contexts': the live contexts of the overlapped GEMMs, as dicts with 'op', 'dtype', 'k'
    (ag_gemm), 'max_m' and 'max_n' (gemm_rs, gemm_ar)."""
    rt = runtime("heap_info")
    contexts = [dict(zip(("op", "dtype", "k", "max_m", "max_n"), c)) for c in rt.overlap_contexts()]
    return {"capacity": rt.heap_capacity, "in_use": rt.heap_bytes_in_use, "collective_max_bytes": rt.max_bytes,
            "gemm_contexts": contexts}


def _check_device(op: str, device, rt) -> None:
    if device is None:
        return
    torch = torch_module()
    d = torch.device(device)
    if d.type != "cuda" or (d.index is not None and d.index != rt.device):
        raise Error(f"tdist.{op}: device must be cuda:{rt.device} (this rank's GPU), got {d}")


def empty(shape, dtype=None, device=None):
    """A torch tensor backed by a new symmetric buffer (same offset on every rank), zero-filled.

    Collective: every rank calls it with the same shape and dtype, in the same order. The buffer
    comes from the heap sized by ``tdist.init(heap_size=...)``; kernels and ``tdist.peer`` reach
    the other ranks' copies. Collectives use symmetric tensors in place (zero copy).

    Args:
        shape: int or sequence of ints.
        dtype: torch dtype; default ``torch.get_default_dtype()``.
        device: None or this rank's CUDA device.

    The tensor keeps its buffer object alive, but the memory returns to the heap only with
    ``tdist.free(tensor)`` or ``tdist.finalize()`` (both collective); using the tensor after
    either is an error the GPU cannot detect.
    """
    torch = require_torch("tdist.empty")
    rt = runtime("empty")
    _check_device("empty", device, rt)
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise Error(f"tdist.empty: shape {shape} has a negative dimension")
    dtype = torch.get_default_dtype() if dtype is None else dtype
    code, bits = dlpack_dtype(dtype)
    nbytes = math.prod(shape) * (bits // 8)
    ptr = rt.allocate(nbytes)
    buf = _SymmetricBuffer(ptr, nbytes)
    _state.buffers[ptr] = buf
    arr = _C.device_array(ptr, list(shape), [], code, bits, rt.device, buf)
    return torch.from_dlpack(arr)


def free(tensor) -> None:
    """Return a tensor's symmetric buffer (from tdist.empty) to the heap.

    Collective: every rank frees the same buffer. Waits for the GPU first. Any tensor or peer view
    of the buffer must not be used afterwards.
    """
    torch = require_torch("tdist.free")
    rt = runtime("free")
    if not isinstance(tensor, torch.Tensor):
        raise Error(f"tdist.free: expected a torch.Tensor from tdist.empty, got {type(tensor).__name__}")
    ptr = tensor.untyped_storage().data_ptr()
    buf = _state.buffers.pop(ptr, None)
    if buf is None:
        raise Error("tdist.free: the tensor's storage is not a live buffer from tdist.empty (already freed, "
                    "or not symmetric)")
    buf.freed = True
    rt.free(ptr)


def is_symmetric(tensor) -> bool:
    """Whether the tensor's memory lies in tdist's symmetric heap."""
    rt = runtime("is_symmetric")
    n = tensor.numel() * tensor.element_size()
    p = tensor.data_ptr()
    return rt.is_symmetric(p) and (n == 0 or rt.is_symmetric(p + n - 1))


def peer(tensor, rank: int):
    """A view of rank ``rank``'s copy of a symmetric tensor, addressable from this GPU.

    Same shape, strides and dtype as ``tensor`` (which must lie in tdist's symmetric heap, e.g. a
    tensor from tdist.empty or a view of one), reading and writing the peer's memory over NVLink
    through NCCL's peer (LSA) pointer. Not collective. Ordering with the peer's own work is up to
    the caller (e.g. tdist.barrier()).
    """
    torch = require_torch("tdist.peer")
    rt = runtime("peer")
    if not isinstance(tensor, torch.Tensor):
        raise Error(f"tdist.peer: expected a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(rank, int) or not 0 <= rank < rt.world_size:
        raise Error(f"tdist.peer: rank must be an int in [0, {rt.world_size}), got {rank!r}")
    if not is_symmetric(tensor):
        raise Error("tdist.peer: the tensor does not lie in tdist's symmetric heap (allocate it with tdist.empty)")
    code, bits = dlpack_dtype(tensor.dtype)
    ptr = rt.peer_ptr(tensor.data_ptr(), rank)
    arr = _C.device_array(ptr, list(tensor.shape), list(tensor.stride()), code, bits, rt.device, tensor)
    return torch.from_dlpack(arr)
