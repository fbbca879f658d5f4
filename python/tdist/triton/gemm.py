"""AllGather-GEMM and GEMM-ReduceScatter written in Triton with tdist.triton.language.

    y = tdist.triton.ag_gemm(x, w)     # all_gather(x) @ w.T: (world * m, N); x (m, K), w (N, K)
    z = tdist.triton.gemm_rs(a, b)     # rows of sum_r a_r @ b_r.T for this rank: (M / world, N)

Both are collective (every rank calls them with the same shapes, in the same order) and run on torch's
current stream; rows are split evenly over the ranks (M divisible by the world size).

AG-GEMM: a push kernel on a side stream copies this rank's rows, CHUNK rows at a time, into every
rank's gathered buffer and sets that rank's chunk flag to the call's epoch; the GEMM tiles, ordered
to start with this rank's own rows, wait on the flags of the chunks holding their rows (one flag per
row of the tile, a block wait), then load A through consume_token.
GEMM-RS: each GEMM tile stores its fp32-accumulated partial, in the output dtype, straight from
registers into the owning rank's receive slot (put_tile) and adds 1 to that rank's arrival counter; a
reduce kernel waits for every tile of every rank and sums the slots in fp32.
Each call starts with a barrier across ranks (one program) so that no rank overwrites a buffer a peer
still reads from the previous call.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import language as tdl
from ._launch import heap_view

kChunkRows = 128  # rows per AG flag (and per push program)


@triton.jit
def _barrier_kernel(heap, pad):
    tdl.barrier_all(heap, pad)


@triton.jit
def _ag_push(heap, gathered, x, flags, m_local, K, num_chunks, epoch, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (c, j) copies chunk c of x (rows [c * CHUNK, ...)) into rank (me + 1 + j)'s gathered rows
    # [me * m_local + c * CHUNK, ...) and sets that rank's flags[me * num_chunks + c] to epoch.
    me = tdl.rank(heap)
    world = tdl.num_ranks(heap)
    c = tl.program_id(0)
    peer = (me + 1 + tl.program_id(1)) % world
    rows = c * CHUNK + tl.arange(0, CHUNK)
    rmask = rows < m_local
    src = x + rows[:, None].to(tl.int64) * K
    dst = gathered + (me * m_local + rows)[:, None].to(tl.int64) * K
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = rmask[:, None] & (cols[None, :] < K)
        tdl.put_tile(heap, dst + cols[None, :], tl.load(src + cols[None, :], mask=mask), peer, mask=mask)
    tdl.signal_op(heap, flags + me * num_chunks + c, epoch, peer, "set")


@triton.jit
def _tile_ids(pid, num_pid_m, num_pid_n, shift_m, GROUP_M: tl.constexpr):
    # Grouped order (GROUP_M row blocks share the B columns in L2), rows rotated to start at shift_m.
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    return (pid_m + shift_m) % num_pid_m, pid_n


@triton.jit
def _ag_gemm_kernel(heap, x, gathered, b, out, flags, M, N, K, m_local, num_chunks, epoch,
                    stride_bn, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    me = tdl.rank(heap)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_pid_m, num_pid_n, (me * m_local) // BLOCK_M, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_c = tl.minimum(rows, M - 1)
    # Each row's source rank and the flag of the chunk holding it. This rank's own rows are read from x
    # and need no wait (expected 0 always holds): the first tiles, which are this rank's, never wait, so
    # they free SMs for the push kernel whatever the block scheduler does.
    src = rows_c // m_local
    local_row = rows_c - src * m_local
    own = src == me
    seen = tdl.wait(heap, flags + src * num_chunks + local_row // CHUNK, tl.where(own, 0, epoch))
    a_rows = tl.where(own, x + local_row.to(tl.int64) * K, gathered + rows_c.to(tl.int64) * K)
    a_rows = tdl.consume_token(a_rows, seen)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_c = tl.minimum(cols, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_rows[:, None] + offs_k[None, :]
    b_ptrs = b + cols_c[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a_tile = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
        b_tile = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        acc = tl.dot(a_tile, b_tile, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    omask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(out.dtype.element_ty), mask=omask)


@triton.jit
def _gemm_rs_kernel(heap, a, b, recv, counters, M, N, K, m_local, stride_am, stride_bn, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # recv, on every rank: [world (source), m_local, N] in the output dtype; counters[0] counts arrivals.
    me = tdl.rank(heap)
    world = tdl.num_ranks(heap)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Start with the rows of the next rank: its partials travel while the later tiles compute.
    shift = (((me + 1) % world) * m_local) // BLOCK_M
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_pid_m, num_pid_n, shift, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_c = tl.minimum(rows, M - 1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_c = tl.minimum(cols, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a + rows_c[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b + cols_c[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        acc = tl.dot(tl.load(a_ptrs, mask=kmask[None, :], other=0.0), tl.load(b_ptrs, mask=kmask[:, None], other=0.0),
                     acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dest = rows_c // m_local
    local_row = rows_c - dest * m_local
    ptrs = recv + (me * m_local + local_row)[:, None].to(tl.int64) * N + cols[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tdl.put_tile(heap, ptrs, acc.to(recv.dtype.element_ty), dest[:, None], mask=mask)
    first = pid_m * BLOCK_M // m_local
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, M - 1) // m_local
    for d in range(first, last + 1):
        tdl.signal_op(heap, counters, 1, d, "add")


@triton.jit
def _rs_reduce(heap, recv, out, counters, target, m_local, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    world = tdl.num_ranks(heap)
    seen = tdl.wait(heap, counters, target)
    src = tdl.consume_token(recv, seen)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < m_local) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, world):
        acc += tl.load(src + s * m_local * N + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)


def _gemm_config(m: int, n: int) -> dict:
    # Hopper (wgmma) tiles for the large shapes; smaller tiles keep enough programs for small M.
    if m >= 2048 and n >= 2048:
        return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)


def _check(op: str, cond: bool, message: str):
    if not cond:
        from .._tensors import Error

        raise Error(f"tdist.triton.{op}: {message}")


def _check_matrix(op, name, t, torch):
    _check(op, isinstance(t, torch.Tensor), f"'{name}' must be a torch.Tensor, got {type(t).__name__}")
    _check(op, t.is_cuda and t.dim() == 2, f"'{name}' must be a 2-D CUDA tensor, got shape {tuple(t.shape)} on {t.device}")
    _check(op, t.dtype in (torch.bfloat16, torch.float16),
           f"'{name}' must be bfloat16 or float16, got {t.dtype}")
    _check(op, t.stride(1) == 1, f"'{name}' must have unit stride along K (row-major), got strides {t.stride()}")


class _Workspace:
    """Symmetric buffers of one op and shape family, grown on demand (collectively: every rank makes the
    same calls) and reused across calls; epochs make flags one-shot without resets."""

    def __init__(self):
        self.tensors = {}
        self.epoch = 0
        self.pad = None
        self.side_stream = None
        self.runtime = None
        self.shape = None
        self.target = 0
        self.arrivals_per_call = 0

    def get(self, name, shape, dtype):
        import tdist

        t = self.tensors.get(name)
        numel = 1
        for s in shape:
            numel *= s
        if t is None or t.dtype != dtype or t.numel() < numel:
            if t is not None:
                tdist.free(t)
            t = tdist.empty((max(numel, 1),), dtype)
            self.tensors[name] = t
        return t[:numel].view(shape)


_ag = _Workspace()
_rs = _Workspace()


def _start_call(ws, torch):
    import tdist

    view = heap_view()
    if ws.runtime is not view._runtime:  # first call, or a new tdist.init: the old buffers are gone
        ws.__init__()
        ws.runtime = view._runtime
    if ws.pad is None:
        ws.pad = tdist.empty((view.world_size + 2,), torch.int64)
        # High priority: when SMs free up, the push kernel's programs are dispatched before waiting tiles.
        ws.side_stream = torch.cuda.Stream(priority=-1)
    ws.epoch += 1
    _barrier_kernel[(1,)](view.tensor, ws.pad)
    return view


def ag_gemm(x, w):
    """all_gather(x) @ w.T, the gather overlapped with the GEMM. x: (m, K) this rank's rows (every rank
    the same m); w: (N, K) this rank's weight shard. Returns (world * m, N) in x's dtype."""
    from .._tensors import require_torch

    torch = require_torch("tdist.triton.ag_gemm")
    _check_matrix("ag_gemm", "x", x, torch)
    _check_matrix("ag_gemm", "w", w, torch)
    _check("ag_gemm", x.dtype == w.dtype, f"'x' and 'w' must have one dtype, got {x.dtype} and {w.dtype}")
    _check("ag_gemm", x.shape[1] == w.shape[1], f"'w' must be (N, K) with K = {x.shape[1]} (x's), got {tuple(w.shape)}")
    _check("ag_gemm", x.shape[0] > 0 and w.shape[0] > 0, "x and w must have at least one row")
    x = x.contiguous()
    view = _start_call(_ag, torch)
    world = view.world_size
    m_local, k = x.shape
    n = w.shape[0]
    m = m_local * world
    num_chunks = triton.cdiv(m_local, kChunkRows)
    # gathered: [world * m_local, K] (rank r's rows at r * m_local); flags: [world, num_chunks], the epoch
    # of the last call whose chunk arrived. Flags are laid out per (m_local) and reused only at one m_local.
    gathered = _ag.get("gathered", (m, k), x.dtype)
    flags = _ag.get(f"flags_{m_local}", (world * num_chunks,), torch.int64)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    main = torch.cuda.current_stream()
    side = _ag.side_stream
    side.wait_stream(main)
    with torch.cuda.stream(side):
        if world > 1:
            _ag_push[(num_chunks, world - 1)](view.tensor, gathered, x, flags, m_local, k, num_chunks, _ag.epoch,
                                           CHUNK=kChunkRows, BLOCK_K=128, num_warps=4)
    cfg = _gemm_config(m, n)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _ag_gemm_kernel[grid](view.tensor, x, gathered, w, out, flags, m, n, k, m_local, num_chunks, _ag.epoch, w.stride(0),
                          CHUNK=kChunkRows, **cfg)
    main.wait_stream(side)
    x.record_stream(side)
    return out


def gemm_rs(a, b):
    """This rank's rows of sum over ranks of a @ b.T, the reduction overlapped with the GEMM. a: (M, K_local),
    b: (N, K_local); M divisible by the world size. Returns (M / world, N) in a's dtype."""
    from .._tensors import require_torch

    torch = require_torch("tdist.triton.gemm_rs")
    _check_matrix("gemm_rs", "a", a, torch)
    _check_matrix("gemm_rs", "b", b, torch)
    _check("gemm_rs", a.dtype == b.dtype, f"'a' and 'b' must have one dtype, got {a.dtype} and {b.dtype}")
    _check("gemm_rs", a.shape[1] == b.shape[1], f"'b' must be (N, K) with K = {a.shape[1]} (a's), got {tuple(b.shape)}")
    world = heap_view().world_size
    m, k = a.shape
    n = b.shape[0]
    _check("gemm_rs", m > 0 and n > 0 and m % world == 0,
           f"M (a's rows, {m}) must be a positive multiple of the world size {world}")
    view = _start_call(_rs, torch)
    m_local = m // world
    # recv: [world (source rank), m_local, N]; counters[0]: tile arrivals, growing over calls.
    recv = _rs.get("recv", (world, m_local, n), a.dtype)
    counters = _rs.get("counters", (1,), torch.int64)
    cfg = _gemm_config(m, n)
    bm = cfg["BLOCK_M"]
    tiles_n = triton.cdiv(n, cfg["BLOCK_N"])
    if _rs.shape != (m, n, bm, tiles_n):
        # Arrivals per call at this rank: from each rank, one per tile touching its rows.
        begin, end = view.rank * m_local, (view.rank + 1) * m_local - 1
        _rs.arrivals_per_call = world * tiles_n * (end // bm - begin // bm + 1)
        _rs.shape = (m, n, bm, tiles_n)
    _rs.target += _rs.arrivals_per_call
    out = torch.empty((m_local, n), device=a.device, dtype=a.dtype)
    grid = (triton.cdiv(m, bm) * tiles_n,)
    _gemm_rs_kernel[grid](view.tensor, a, b, recv, counters, m, n, k, m_local, a.stride(0), b.stride(0), **cfg)
    _rs_reduce[(triton.cdiv(m_local, 32), triton.cdiv(n, 256))](view.tensor, recv, out, counters, _rs.target, m_local,
                                                                  n, BLOCK_M=32, BLOCK_N=256, num_warps=4)
    return out
