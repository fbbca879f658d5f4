"""tdist's device primitives for Triton kernels (stock Triton >= 3.6): the Triton side of
include/tdist/device/*.cuh, built on tl.inline_asm_elementwise and plain loads and stores.

    import tdist.triton.language as tdl

    @tdist.triton.kernel                       # fills `heap` (and RANK / WORLD_SIZE if declared)
    @triton.jit
    def ring(heap, buf, flag, n, epoch, BLOCK: tl.constexpr):
        me, world = tdl.rank(heap), tdl.num_ranks(heap)
        tdl.put_signal(heap, buf, buf, n, flag, epoch, (me + 1) % world, BLOCK)
        tdl.wait(heap, flag, epoch)

Heap descriptor (`heap`, an int64 device tensor made by tdist.triton.heap_view()), in words:
    [0] rank   [1] world size   [2] wait timeout in ns
    [3] address of the process's FaultRecord (host-mapped, include/tdist/device/timeout.cuh) under the
        abort action (TDIST_WAIT_TIMEOUT_ACTION=abort, the default); 0 under trap
    [4 + r] address, mapped in this process, of rank r's copy of the heap's anchor (0 when rank r is
            not load/store reachable). Every rank's heap has the same layout, so a symmetric object
            at `p` here sits at `p - base[rank] + base[peer]` on `peer`: what symm_at computes, as
            SymmetricHeapView::symm_at does with the LSA base pointers.

Memory-order contract (the words of signal.cuh and memory_order.cuh):
  - notify / signal_op write the flag with release semantics at scope S: every load and store the
    calling program made before it is visible to whoever later observes the flag with acquire
    semantics. They start with a bar.sync (tl.debug_barrier) so that every thread's earlier accesses
    precede the release of thread 0, which alone writes the flag. Set is st.release.S, add is
    red.release.S.
  - wait reads the flags with ld.acquire.S: no load or store of the program after the wait is
    performed before the flags were seen. It ends with a bar.sync, so every thread of the program is
    ordered after every flag (as wait_block). wait_each_thread has every thread acquire the flag itself
    and no bar.sync: each thread is ordered after the flag by its own acquire (as wait_thread).
  - The default scope is 'sys', right for flags written over NVLink by another GPU. Use 'gpu' only
    for flags that never leave one GPU.
  - Flags are 32- or 64-bit integers and never reset by these calls: give each use a new value (a
    call count, an epoch) and compare with 'ge', which also tolerates a peer that runs ahead.
  - Every wait times out after the heap descriptor's timeout (TDIST_WAIT_TIMEOUT_S, default 60 s, as
    the C++ device API) with the diagnostic "tdist: wait timed out after ... s: rank R, block (x,y,z),
    thread (x,y,z), address A, waiting for value >= E, seen V". Under the abort action (the default)
    the first such wait records the fault for the host and returns; from then on every wait of the
    process returns at its next clock check, so kernels drain and tdist.check_device_faults() raises
    tdist.DeviceTimeoutError. A wait can thus return without its condition holding: bound any value
    read from a waited flag before it serves as an index or a count. Under trap it traps.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language import core as _core

from . import _asm

# Defaults of the constexpr string parameters (Triton wraps a str default in constexpr only when
# it is one already).
_SYS = tl.constexpr("sys")
_GE = tl.constexpr("ge")
_SET = tl.constexpr("set")

# Words of the heap descriptor before the per-rank bases (layout above).
HEAP_HEADER_WORDS = tl.constexpr(4)


def _value(x):
    return _core._unwrap_if_constexpr(x)


def _flag_bits(ptr, what: str) -> int:
    ty = ptr.type.scalar if hasattr(ptr.type, "scalar") else ptr.type
    if not isinstance(ty, tl.pointer_type) or not ty.element_ty.is_int():
        raise ValueError(f"tdist.triton: {what} must be a pointer (or block of pointers) to 32- or 64-bit integers, "
                         f"got {ptr.type}")
    return _asm.check_bits(ty.element_ty.primitive_bitwidth, what)


def _int_type(bits: int):
    return tl.int32 if bits == 32 else tl.int64


# --- trace-time builders (Triton builtins: plain Python run while the kernel is traced) -------------

@_core.builtin
def _spin(flags, expected, timeout_ns, rank, fault, scope, cmp, leader_only, _semantic=None):
    bits = _flag_bits(flags, "flags")
    asm, constraints = _asm.spin_wait(_asm.check_scope(_value(scope)), _asm.check_cmp(_value(cmp)), bits,
                                      bool(_value(leader_only)))
    ty = _int_type(bits)
    expected = tl.cast(_core.to_tensor(expected, _semantic=_semantic), ty, _semantic=_semantic)
    timeout_ns = tl.cast(timeout_ns, tl.int64, _semantic=_semantic)
    rank = tl.cast(rank, tl.int32, _semantic=_semantic)
    fault = tl.cast(fault, tl.int64, _semantic=_semantic)
    return tl.inline_asm_elementwise(asm, constraints, [flags, expected, timeout_ns, rank, fault], dtype=ty,
                                     is_pure=False, pack=1, _semantic=_semantic)


@_core.builtin
def _load(ptr, semantic, scope, _semantic=None):
    bits = _flag_bits(ptr, "ptr")
    asm, constraints = _asm.load(_value(semantic), _asm.check_scope(_value(scope)), bits)
    return tl.inline_asm_elementwise(asm, constraints, [ptr], dtype=_int_type(bits), is_pure=False, pack=1,
                                     _semantic=_semantic)


@_core.builtin
def _leader_store(ptr, value, semantic, op, scope, _semantic=None):
    if ptr.type.is_block():
        raise ValueError("tdist.triton: notify / signal_op take one flag (a scalar pointer); a block of flags "
                         "would be written once per thread holding a copy. Loop over the flags instead.")
    bits = _flag_bits(ptr, "flag")
    asm, constraints = _asm.leader_store(_value(semantic), _value(op), _asm.check_scope(_value(scope)), bits)
    value = tl.cast(_core.to_tensor(value, _semantic=_semantic), _int_type(bits), _semantic=_semantic)
    return tl.inline_asm_elementwise(asm, constraints, [ptr, value], dtype=tl.int32, is_pure=False, pack=1,
                                     _semantic=_semantic)


@_core.builtin
def _leader_atomic_add(ptr, value, scope, _semantic=None):
    bits = _flag_bits(ptr, "counter")
    asm, constraints = _asm.leader_atomic_add(_asm.check_scope(_value(scope)), bits)
    value = tl.cast(_core.to_tensor(value, _semantic=_semantic), _int_type(bits), _semantic=_semantic)
    return tl.inline_asm_elementwise(asm, constraints, [ptr, value], dtype=_int_type(bits), is_pure=False, pack=1,
                                     _semantic=_semantic)


@_core.builtin
def _fence(scope, _semantic=None):
    asm, constraints = _asm.fence(_asm.check_scope(_value(scope)))
    zero = _core.to_tensor(0, _semantic=_semantic)
    return tl.inline_asm_elementwise(asm, constraints, [zero], dtype=tl.int32, is_pure=False, pack=1,
                                     _semantic=_semantic)


@_core.builtin
def _token_zero(token, _semantic=None):
    bits = token.dtype.primitive_bitwidth
    asm, constraints = _asm.TOKEN_ZERO_32 if bits <= 32 else _asm.TOKEN_ZERO_64
    ty = tl.int32 if bits <= 32 else tl.int64
    token = tl.cast(token, ty, bitcast=bits in (32, 64), _semantic=_semantic)
    # Not pure: a pure asm whose result is provably used only as 0 could still be CSE'd across waits.
    return tl.inline_asm_elementwise(asm, constraints, [token], dtype=ty, is_pure=False, pack=1, _semantic=_semantic)


@_core.builtin
def _known_zero(zero, _semantic=None):
    # It is 0: a multiple of anything and, in a block, constant throughout. Saying so keeps the accesses
    # through consume_token contiguous and vectorised.
    zero = tl.multiple_of(zero, [tl.constexpr(16)] * max(len(zero.shape), 1), _semantic=_semantic)
    if zero.type.is_block():
        zero = tl.max_constancy(zero, [tl.constexpr(d) for d in zero.shape], _semantic=_semantic)
    return zero


@_core.builtin
def _element_offset(ptr, delta, _semantic=None):
    # The byte distance between two heaps in elements of ptr's type, marked a multiple of 16 bytes (heap
    # bases are page aligned), so that accesses through the translated pointer stay vectorised.
    ty = ptr.type.scalar if hasattr(ptr.type, "scalar") else ptr.type
    if not isinstance(ty, tl.pointer_type):
        raise ValueError(f"tdist.triton: symm_at needs a pointer or a block of pointers, got {ptr.type}")
    size = max(ty.element_ty.primitive_bitwidth // 8, 1)
    offset = delta.__floordiv__(size, _semantic=_semantic) if size > 1 else delta
    values = [tl.constexpr(max(16 // size, 1))] * max(len(offset.shape), 1)
    return tl.multiple_of(offset, values, _semantic=_semantic)


@_core.builtin
def _same_shape(x, y, _semantic=None):
    return tl.constexpr(x.type.is_block() and y.type.is_block() and list(x.shape) == list(y.shape))


@_core.builtin
def _is_block(x, _semantic=None):
    return tl.constexpr(x.type.is_block())


# --- rank, world, symmetric addresses ----------------------------------------------------------------

@triton.jit
def rank(heap):
    """This process's rank (int32)."""
    return tl.load(heap).to(tl.int32)


@triton.jit
def num_ranks(heap):
    """The world size (int32)."""
    return tl.load(heap + 1).to(tl.int32)


@triton.jit
def symm_at(heap, ptr, peer):
    """The address, mapped here, of `peer`'s copy of the symmetric object at `ptr` (a pointer or a block of
    pointers into this rank's heap: a tdist.empty tensor). Loads and stores through it reach the peer
    over NVLink. Not checked: `peer` must be a load/store reachable rank (all ranks of one node)."""
    me = tl.load(heap).to(tl.int32)
    local = tl.load(heap + HEAP_HEADER_WORDS + me)
    remote = tl.load(heap + HEAP_HEADER_WORDS + peer)
    return ptr + _element_offset(ptr, remote - local)


# --- flags -----------------------------------------------------------------------------------------------

@triton.jit
def _declare_vprintf(timeout_ns):
    # The timeout diagnostics call vprintf from inline PTX; this print (reached only with a corrupt heap
    # descriptor) makes Triton declare vprintf in the module.
    if timeout_ns < 0:
        tl.device_print("tdist: heap descriptor has a negative wait timeout", timeout_ns)


@triton.jit
def wait(heap, flags, expected, scope: tl.constexpr = _SYS, cmp: tl.constexpr = _GE):
    """Spins until cmp(flag, expected) holds for the flag at `flags` (scalar pointer: thread 0 spins, then
    every thread reads it once more with acquire) or for every flag of a block of pointers (each thread
    spins on its own elements); ends with a bar.sync. Returns the values seen (same shape as `flags`):
    feed them to consume_token. Times out with the C++ device API's diagnostic, then aborts (records the
    fault and returns the values seen, the condition not holding) or traps: see the contract above."""
    me = tl.load(heap).to(tl.int32)
    timeout_ns = tl.load(heap + 2)
    fault = tl.load(heap + 3)
    _declare_vprintf(timeout_ns)
    if _is_block(flags):
        seen = _spin(flags, expected, timeout_ns, me, fault, scope, cmp, False)
        tl.debug_barrier()
    else:
        _spin(flags, expected, timeout_ns, me, fault, scope, cmp, True)
        tl.debug_barrier()  # thread 0 has acquired; the others are ordered after it (cumulativity)
        seen = _load(flags, "acquire", scope)
    return seen


@triton.jit
def wait_each_thread(heap, flag, expected, scope: tl.constexpr = _SYS, cmp: tl.constexpr = _GE):
    """wait on one flag with every thread spinning on it and acquiring it itself, and no bar.sync, so that
    a loop holding it can still be pipelined (Triton 3.6 pipelines no loop holding a barrier). Returns the
    value each thread saw (feed it to consume_token). The same bounded spin, diagnostic and abort as
    wait; the first thread to time out records the fault, the others return quietly (under the trap
    action several may print). A kernel calling it must call wait_diagnostics(heap) once, outside its
    loops (the diagnostic's vprintf is declared there)."""
    return _spin(flag, expected, tl.load(heap + 2), tl.load(heap).to(tl.int32), tl.load(heap + 3), scope, cmp, False)


@triton.jit
def wait_diagnostics(heap):
    """Makes the timeout diagnostics of wait_each_thread printable: call it once in the kernel, before
    and outside the loops that wait (its print, reached only with a corrupt heap descriptor, keeps them
    out of a loop body that Triton would then not pipeline). wait and the barriers do it themselves."""
    _declare_vprintf(tl.load(heap + 2))


@triton.jit
def notify(flag, value, scope: tl.constexpr = _SYS, op: tl.constexpr = _SET):
    """Raises the flag at `flag` (a local or already translated peer address) with release at `scope`:
    st.release (op='set') or red.release.add (op='add'), by thread 0 after a bar.sync."""
    tl.debug_barrier()  # every thread's earlier stores precede thread 0's release
    _leader_store(flag, value, "release", op, scope)


@triton.jit
def signal_op(heap, flag, value, peer, op: tl.constexpr = _SET, scope: tl.constexpr = _SYS):
    """notify on `peer`'s copy of the symmetric flag `flag` (a pointer into this rank's heap)."""
    notify(symm_at(heap, flag, peer), value, scope, op)


@triton.jit
def ld_acquire(ptr, scope: tl.constexpr = _SYS):
    """ld.acquire.<scope> of 32/64-bit integers (elementwise), no spin."""
    return _load(ptr, "acquire", scope)


@triton.jit
def ld_relaxed(ptr, scope: tl.constexpr = _SYS):
    """ld.relaxed.<scope>: single-copy atomic, never stale in L1, orders nothing."""
    return _load(ptr, "relaxed", scope)


@triton.jit
def consume_token(ptr, token):
    """`ptr` (a pointer or a block) plus a zero computed from `token` (values returned by wait) through inline
    PTX the compiler cannot see through: loads from the result depend on the waited value, so neither
    Triton nor LLVM can issue them before the wait, whatever they assume about the memory (the Triton form
    of consume_token in signal.cuh)."""
    zero = _token_zero(token)
    if _is_block(zero) and not _same_shape(zero, ptr):
        zero = _token_zero(tl.max(zero))  # through the asm once more: a reduction's result loses multiple_of
    return ptr + _known_zero(zero)


@triton.jit
def fence(scope: tl.constexpr = _SYS):
    """fence.acq_rel.<scope>: orders each thread's earlier and later accesses at `scope`."""
    _fence(scope)


@triton.jit
def quiet():
    """Completes this program's earlier puts: after it (and a bar.sync for the other threads' puts) they are
    performed at system scope, so a later relaxed flag store cannot overtake them."""
    _fence("sys")


# --- data movement ---------------------------------------------------------------------------------------

@triton.jit
def put(heap, dst, src, n, peer, BLOCK: tl.constexpr):
    """Copies n elements from `src` (any local address) to `peer`'s copy of the symmetric `dst`, BLOCK at a
    time, by the whole program. Visibility to the peer needs a release afterwards (signal_op, put_signal)."""
    remote = symm_at(heap, dst, peer)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(remote + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def get(heap, dst, src, n, peer, BLOCK: tl.constexpr):
    """Copies n elements of `peer`'s copy of the symmetric `src` into `dst` (any local address)."""
    remote = symm_at(heap, src, peer)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(remote + offs, mask=mask), mask=mask)


@triton.jit
def put_signal(heap, dst, src, n, flag, value, peer, BLOCK: tl.constexpr, op: tl.constexpr = _SET):
    """put, then signal_op on `peer`'s copy of `flag` (release, system scope): a peer that acquires the flag
    sees the data."""
    put(heap, dst, src, n, peer, BLOCK)
    signal_op(heap, flag, value, peer, op, "sys")


@triton.jit
def put_tile(heap, dst_ptrs, values, peer, mask=None):
    """Stores a tile (`values`, any shape) at `peer`'s copy of the symmetric addresses `dst_ptrs`."""
    tl.store(symm_at(heap, dst_ptrs, peer), values, mask=mask)


@triton.jit
def get_tile(heap, src_ptrs, peer, mask=None, other=None):
    """Loads a tile from `peer`'s copy of the symmetric addresses `src_ptrs`."""
    return tl.load(symm_at(heap, src_ptrs, peer), mask=mask, other=other)


# --- barriers --------------------------------------------------------------------------------------------
# Barrier pad: a symmetric int64 array, zeroed at allocation (tdist.triton.barrier_pad), world + 2 words per
# slot, the layout of barrier.cuh:
#   slot[r]          arrivals from rank r; rank r adds 1 per barrier (a remote red.release.sys)
#   slot[world]      barriers this rank has passed on this slot (the epoch), touched only locally
#   slot[world + 1]  arrivals of this GPU's programs, for barrier_all_grid
# Concurrent barriers (different programs, different streams) need different slots.

@triton.jit
def barrier_all(heap, slot):
    """Every thread of exactly one program per rank calls it with the same slot. Everything the program did
    before is visible to every rank after it."""
    me = tl.load(heap).to(tl.int32)
    world = tl.load(heap + 1).to(tl.int32)
    epoch = _load(slot + world, "relaxed", "gpu") + 1  # read by all threads before thread 0 updates it
    tl.debug_barrier()
    _leader_store(slot + world, epoch, "relaxed", "set", "gpu")
    for p in range(0, world):
        signal_op(heap, slot + me, 1, p, "add", "sys")
    timeout_ns = tl.load(heap + 2)
    fault = tl.load(heap + 3)
    _declare_vprintf(timeout_ns)
    for p in range(0, world):
        _spin(slot + p, epoch, timeout_ns, me, fault, "sys", "ge", True)
    tl.debug_barrier()


@triton.jit
def _grid_sync(heap, arrivals):
    tl.debug_barrier()
    blocks = (tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)).to(tl.int64)
    before = _leader_atomic_add(arrivals, 1, "sys")  # thread 0's value; the others hold 0 and skip the spin
    target = (before // blocks + 1) * blocks
    timeout_ns = tl.load(heap + 2)
    _declare_vprintf(timeout_ns)
    _spin(arrivals, target, timeout_ns, tl.load(heap).to(tl.int32), tl.load(heap + 3), "sys", "ge", True)
    tl.debug_barrier()


@triton.jit
def barrier_all_grid(heap, slot):
    """Every program of the grid, on every rank, calls it with the same slot; the grid's programs must all be
    resident at once (a persistent grid no larger than the GPU holds). Orders everything every program did
    before it before everything any program of any rank does after it."""
    world = tl.load(heap + 1).to(tl.int32)
    _grid_sync(heap, slot + world + 1)
    if tl.program_id(0) + tl.program_id(1) + tl.program_id(2) == 0:
        barrier_all(heap, slot)
    _grid_sync(heap, slot + world + 1)
