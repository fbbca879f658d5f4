"""Launcher glue: the heap descriptor a Triton kernel reads (layout in language.py) and a decorator
that passes it, with the rank and world size, without boilerplate."""

from __future__ import annotations

import math
import os

# Limits of TDIST_WAIT_TIMEOUT_S, as the C++ runtime's (common/env.hpp, runtime/wait_config.hpp).
kDefaultWaitTimeoutSeconds = 60.0
kMinTimeoutSeconds = 0.001
kMaxTimeoutSeconds = 86400.0
kHeapHeaderWords = 4

# Names of kernel parameters the decorator fills when the caller leaves them out.
kHeapArg = "heap"
kRankArg = "RANK"
kWorldArg = "WORLD_SIZE"


def wait_timeout_seconds(value: str | None = None) -> float:
    """Seconds of a device wait: `value` (a string) or TDIST_WAIT_TIMEOUT_S, else 60; the same rules as the
    C++ runtime (a decimal number from 0.001 to 86400). A bad value raises ValueError naming the variable."""
    text = os.environ.get("TDIST_WAIT_TIMEOUT_S") if value is None else value
    if text is None or text.strip() == "":
        return kDefaultWaitTimeoutSeconds
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (kMinTimeoutSeconds <= seconds <= kMaxTimeoutSeconds):
        raise ValueError(f"TDIST_WAIT_TIMEOUT_S must be a number of seconds from {kMinTimeoutSeconds} to "
                         f"{kMaxTimeoutSeconds:g}, got {text!r}")
    return seconds


class HeapView:
    """This rank's view of the symmetric heap for Triton kernels.

    tensor: int64 [4 + world] on this rank's GPU (layout in tdist.triton.language); pass it as the
    kernel's `heap` argument. anchor: the small symmetric allocation whose peer addresses are the bases.
    action: what a timed-out wait does, 'abort' (record the fault, return) or 'trap'
    (TDIST_WAIT_TIMEOUT_ACTION, read when the view is made).
    """

    __slots__ = ("tensor", "rank", "world_size", "timeout_s", "action", "anchor", "_runtime")

    def __init__(self, tensor, rank, world_size, timeout_s, action, anchor, runtime):
        self.tensor = tensor
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.action = action
        self.anchor = anchor
        self._runtime = runtime

    def __repr__(self):
        return (f"tdist.triton.HeapView(rank={self.rank}, world_size={self.world_size}, timeout_s={self.timeout_s}, "
                f"action={self.action!r})")


_views: dict[tuple[float, int], HeapView] = {}


def heap_view(timeout: float | None = None) -> HeapView:
    """The heap descriptor for this rank (created on first use, then cached per timeout).

    The first call is collective (every rank calls it, in the same order as its other tdist.empty calls):
    it allocates a 64-byte symmetric anchor. `timeout`: seconds a device wait spins before its diagnostic;
    default TDIST_WAIT_TIMEOUT_S, else 60. What a timed-out wait then does follows TDIST_WAIT_TIMEOUT_ACTION
    (abort, the default: record the fault in the process's FaultRecord, whose address word 3 holds, and
    return; trap: word 3 is 0).
    """
    from .. import _C, _runtime
    from .._tensors import require_torch

    torch = require_torch("tdist.triton.heap_view")
    rt = _runtime.runtime("triton.heap_view")
    if timeout is None:
        seconds = wait_timeout_seconds()
    else:
        if not isinstance(timeout, (int, float)) or not kMinTimeoutSeconds <= timeout <= kMaxTimeoutSeconds:
            raise ValueError(f"tdist.triton.heap_view: timeout must be seconds from {kMinTimeoutSeconds} to "
                             f"{kMaxTimeoutSeconds:g}, got {timeout!r}")
        seconds = float(timeout)
    for key, view in list(_views.items()):
        if view._runtime is not rt:  # from before a finalize: its anchor is gone
            del _views[key]
    fault = int(_C._wait_fault_record())  # raises on a bad TDIST_WAIT_TIMEOUT_ACTION, naming it
    view = _views.get((seconds, fault))
    if view is not None:
        return view
    anchor = next((v.anchor for v in _views.values()), None)
    if anchor is None:
        anchor = _runtime.empty((8,), torch.int64)
    base = anchor.data_ptr()
    words = [rt.rank, rt.world_size, int(seconds * 1e9), fault]
    for r in range(rt.world_size):
        words.append(base if r == rt.rank else _peer_or_zero(rt, base, r))
    # Addresses above 2^63 do not occur on Linux (user space ends at 2^47).
    tensor = torch.tensor(words, dtype=torch.int64, device=torch.device("cuda", rt.device))
    view = HeapView(tensor, rt.rank, rt.world_size, seconds, "abort" if fault else "trap", anchor, rt)
    _views[(seconds, fault)] = view
    return view


def _peer_or_zero(rt, ptr: int, peer: int) -> int:
    try:
        return int(rt.peer_ptr(ptr, peer))
    except Exception:  # not load/store reachable: symm_at must not be used for that peer
        return 0


def barrier_pad(slots: int = 1):
    """A zeroed symmetric int64 tensor [slots, world + 2] for language.barrier_all / barrier_all_grid (one
    slot per concurrent barrier). Collective."""
    from .. import _runtime
    from .._tensors import require_torch

    torch = require_torch("tdist.triton.barrier_pad")
    rt = _runtime.runtime("triton.barrier_pad")
    if not isinstance(slots, int) or slots < 1:
        raise ValueError(f"tdist.triton.barrier_pad: slots must be a positive int, got {slots!r}")
    return _runtime.empty((slots, rt.world_size + 2), torch.int64)


class _Launcher:
    """fn[grid](...) with `heap`, `RANK` and `WORLD_SIZE` filled in when the kernel declares them and the
    call leaves them out."""

    def __init__(self, fn):
        names = getattr(fn, "arg_names", None)
        if names is None:
            raise TypeError(f"tdist.triton.kernel: expected a @triton.jit function, got {type(fn).__name__}")
        self.fn = fn
        self.arg_names = list(names)
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def _fill(self, args, kwargs):
        # Filled parameters are never passed positionally: positional arguments bind, in order, to the
        # kernel's parameters that are neither filled nor passed by keyword, so `k[grid](buf, flag)` works
        # whatever the position of `heap`.
        filled = [n for n in (kHeapArg, kRankArg, kWorldArg) if n in self.arg_names and n not in kwargs]
        others = [n for n in self.arg_names if n not in filled and n not in kwargs]
        if len(args) > len(others):
            raise TypeError(f"{self.__name__}: takes {len(others)} positional arguments besides "
                            f"{', '.join(filled) or 'none'}, got {len(args)}")
        bound = dict(zip(others, args))
        bound.update(kwargs)
        if filled:
            view = heap_view()
            values = {kHeapArg: view.tensor, kRankArg: view.rank, kWorldArg: view.world_size}
            for n in filled:
                bound[n] = values[n]
        return bound

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def run(*args, **kwargs):
            from .. import _C

            _C.check_device_faults()  # as every JIT launch: an earlier wait gave up, so this one would too
            return launch(**self._fill(args, kwargs))

        return run

    def __call__(self, *args, **kwargs):
        raise TypeError(f"{self.__name__}: launch it as {self.__name__}[grid](...)")


def kernel(fn):
    """Decorator over @triton.jit: `k[grid](args...)` fills the parameters named `heap` (the heap descriptor,
    tdist.triton.heap_view().tensor), `RANK` and `WORLD_SIZE` (ints; declare them tl.constexpr to specialise
    on them) when the call does not pass them. The other arguments are the kernel's own: tdist.empty tensors
    for symmetric buffers, any tensors for local ones."""
    return _Launcher(fn)
