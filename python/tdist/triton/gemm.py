"""AllGather-GEMM and GEMM-ReduceScatter written in Triton with tdist.triton.language.

    y = tdist.triton.ag_gemm(x, w)     # all_gather(x) @ w.T: (world * m, N); x (m, K), w (N, K)
    z = tdist.triton.gemm_rs(a, b)     # rows of sum_r a_r @ b_r.T for this rank: (M / world, N)

Both are collective (every rank calls them with the same shapes, in the same order) and run on torch's
current stream; rows are split evenly over the ranks (M divisible by the world size).

AG-GEMM: one persistent kernel. Its first few programs push this rank's rows, CHUNK rows at a time,
into every peer's gathered buffer and set that peer's chunk flag to the call's epoch; then every
program computes GEMM tiles on a static grid-stride schedule (the pushing programs take the last tile of
each wave), in an order that starts with this rank's own rows (read from x, no wait); a tile holding a
peer's rows waits on the flags of the chunks holding them, then loads A. Where A goes through TMA (and
always on one rank, which neither pushes nor waits) the tile and K loops are fused into one pipelined
loop: the next tile's loads overlap this tile's last steps and its stores.
A, B and the output tile go through TMA where the layouts allow and each tile's rows lie in one rank's
chunk (a wait on that chunk's flag, then a proxy fence); otherwise A by pointer loads after one flag per
row of the tile (a block wait) and consume_token.
GEMM-RS: each GEMM tile stores its fp32-accumulated partial, in the output dtype, straight from
registers into the owning rank's receive slot (put_tile) and adds 1 to that rank's arrival counter; a
reduce kernel waits for every tile of every rank and sums the slots in fp32.
Each call starts with a barrier across ranks (one program) so that no rank overwrites a buffer a peer
still reads from the previous call.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import language as tdl
from ._launch import heap_view

kChunkRows = 128  # rows per AG flag (and per push program)


@triton.jit
def _barrier_kernel(heap, pad):
    tdl.barrier_all(heap, pad)


@triton.jit
def _ag_start(heap, pad):
    # Starts an AG-GEMM call: a barrier across ranks (nobody pushes into rows a peer's previous GEMM may
    # still read).
    tdl.barrier_all(heap, pad)


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
def _ag_push_chunks(heap, gathered, x, flags, m_local, K, num_chunks, epoch, worker, num_workers,
                    CHUNK: tl.constexpr, PUSH_K: tl.constexpr):
    # Worker w of num_workers copies work items w, w + num_workers, ...: item (j, c) puts chunk c of x (rows
    # [c * CHUNK, ...)) into rows [me * m_local + c * CHUNK, ...) of the gathered A of rank me - 1 - j, then
    # sets that rank's flags[me * num_chunks + c] to epoch. Rank me - 1 reads this rank's rows right after its
    # own (tile order below), so it is served first.
    me = tdl.rank(heap)
    world = tdl.num_ranks(heap)
    for item in range(worker, (world - 1) * num_chunks, num_workers):
        j = item // num_chunks
        c = item - j * num_chunks
        peer = (me + world - 1 - j) % world
        rows = c * CHUNK + tl.arange(0, CHUNK)
        rmask = rows < m_local
        src = x + rows[:, None].to(tl.int64) * K
        dst = gathered + (me * m_local + rows)[:, None].to(tl.int64) * K
        # One stage: this loop only moves data, the GEMM loop below keeps the shared memory.
        for k0 in tl.range(0, K, PUSH_K, num_stages=1):
            cols = k0 + tl.arange(0, PUSH_K)
            mask = rmask[:, None] & (cols[None, :] < K)
            tdl.put_tile(heap, dst + cols[None, :], tl.load(src + cols[None, :], mask=mask), peer, mask=mask)
        tdl.signal_op(heap, flags + me * num_chunks + c, epoch, peer, "set")  # after a bar.sync: the chunk first


@triton.jit
def _async_proxy_after(token):
    # fence.proxy.async.global, then a zero computed from the waited value: the rows acquired by the wait
    # (written through the generic proxy: a peer's stores over NVLink) are seen by TMA loads (async proxy)
    # issued after the fence, and the TMA coordinates, built from the zero, depend on the wait, so no pass
    # can issue those loads earlier (consume_token's device, for TMA coordinates rather than addresses).
    return tl.inline_asm_elementwise("fence.proxy.async.global;\n\tand.b64 $0, $1, 0;", "=l,l", [token],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _ag_gemm_kernel(heap, x, gathered, a_own, a_peer, b, out, flags, x_delta, M, N, K, m_local, num_chunks, epoch,
                    stride_bn, num_push, CHUNK: tl.constexpr, PUSH_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                    B_TMA: tl.constexpr, A_TMA: tl.constexpr, C_TMA: tl.constexpr, PEERS: tl.constexpr):
    # Persistent: as many programs per SM as fit at once, no more. Programs [0, num_push) first push this
    # rank's rows to the peers (no wait before: the pushes progress whatever the peers do); then every
    # program computes GEMM tiles on a static schedule. Tiles go in grouped order starting with this rank's
    # own rows, which are read from x and never wait; a tile holding a peer's rows waits for the flags of
    # its chunks, then loads A.
    # A_TMA (B_TMA too; BLOCK_M divides m_local and CHUNK, so a tile's rows come from one rank and one chunk):
    # a_own, a_peer: TMA descriptors of x [m_local, K] and of gathered [M, K]; own tiles read a_own, the
    # others wait on their chunk's one flag (tdl.wait_each_thread: no barrier), fence the async proxy and read
    # a_peer. Else A by pointer loads, one flag per row (a block wait) and consume_token; a_own and a_peer unused.
    # b: w [N, K], a TMA descriptor when B_TMA, else a pointer. out: [M, N], a TMA descriptor with blocks
    # [BLOCK_M, BLOCK_N / 2] when C_TMA (rows and columns past the ends are not written), else a pointer.
    # PEERS (world > 1): the pushes and the waits are compiled in (one rank has neither). The tile loop
    # and the K loop are fused into one pipelined loop (flatten), so the next tile's first loads are in
    # flight while this tile's last wgmma and its epilogue run; with A through TMA the wait of a peer tile
    # is then issued a few K steps ahead of its loads, which depend on it (_async_proxy_after) and so stay
    # behind it. Not with A by pointers and peers: their block wait ends with a bar.sync, and Triton 3.6
    # does not pipeline a loop holding a barrier (the fused loop would lose its multi-buffering, far
    # slower than nested loops).
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    if PEERS and pid < num_push:
        _ag_push_chunks(heap, gathered, x, flags, m_local, K, num_chunks, epoch, pid, num_push, CHUNK, PUSH_K)
    me = tdl.rank(heap)
    if PEERS:
        tdl.wait_diagnostics(heap)  # outside the loop: the waits' diagnostics call vprintf
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    shift = (me * m_local) // BLOCK_M
    offs_k = tl.arange(0, BLOCK_K)
    # Program p takes tiles r, r + P, r + 2P, ... with r = (p - num_push) mod P (P programs): the pushing
    # programs start their tiles late, so they take the last positions of each wave (r in [P - num_push, P))
    # and, when the tile count is not a multiple of P, the ones that carry one tile fewer; the programs
    # that start at once take the first tiles, this rank's own rows. One rank: num_push = 0, plain grid
    # stride. Static rather than taken from a counter: Triton fuses and pipelines across tiles only a
    # counted loop.
    first = (pid + num_programs - num_push) % num_programs
    FUSED: tl.constexpr = A_TMA or not PEERS
    for tile in tl.range(first, num_tiles, num_programs, flatten=FUSED):
        pid_m, pid_n = _tile_ids(tile, num_pid_m, num_pid_n, shift, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if A_TMA:
            row0 = pid_m * BLOCK_M
            a = a_own
            a_row = row0 - me * m_local
            if PEERS:
                src = row0 // m_local
                if src != me:
                    # One flag, every thread acquiring it. After an aborted wait the TMA reads stale rows
                    # (garbage, as the contract says), never out of bounds (TMA clips).
                    flag = flags + src * num_chunks + (row0 - src * m_local) // CHUNK
                    seen = tdl.wait_each_thread(heap, flag, epoch)
                    a = a_peer
                    a_row = row0 + _async_proxy_after(seen).to(tl.int32)
            # A[a_row : a_row + BLOCK_M, :] @ B[cols, :].T, both through TMA (blocks [BLOCK_M, BLOCK_K] and
            # [BLOCK_N, BLOCK_K]; K and rows past the ends read 0).
            for k0 in range(0, K, BLOCK_K):
                acc = tl.dot(a.load([a_row, k0]), b.load([pid_n * BLOCK_N, k0]).T, acc)
        else:
            rows_c = tl.minimum(rows, M - 1)
            src = rows_c // m_local
            local_row = rows_c - src * m_local
            own = src == me
            # One base: row r of the gathered buffer, or for this rank's own rows the same row of x, which
            # lies x_delta - me * m_local * K elements further. Arithmetic rather than tl.where: a select (of
            # pointers or of offsets) loses the alignment facts in Triton 3.9, and with them the vector loads
            # and the pipelined K loop; a product and a sum keep them.
            own_shift = x_delta.to(tl.int64) - (me * m_local).to(tl.int64) * K
            a_rows = gathered + (rows_c.to(tl.int64) * K + own.to(tl.int64) * own_shift)
            if PEERS:
                # Expected 0 always holds: own rows never wait. After an aborted wait the loads read stale
                # rows (garbage, as the contract says), never out of bounds: addresses come from the row
                # numbers.
                seen = tdl.wait(heap, flags + src * num_chunks + local_row // CHUNK, tl.where(own, 0, epoch))
                a_rows = tdl.consume_token(a_rows, seen)
            cols_c = tl.minimum(cols, N - 1)
            a_ptrs = a_rows[:, None] + offs_k[None, :]
            if B_TMA:
                # b: a TMA descriptor of w [N, K], blocks [BLOCK_N, BLOCK_K]; out-of-range columns and K read 0.
                for k0 in range(0, K, BLOCK_K):
                    if EVEN_K:
                        a_tile = tl.load(a_ptrs)
                    else:
                        a_tile = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
                    acc = tl.dot(a_tile, b.load([pid_n * BLOCK_N, k0]).T, acc)
                    a_ptrs += BLOCK_K
            else:
                b_ptrs = b + cols_c[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
                for k0 in range(0, K, BLOCK_K):
                    if EVEN_K:
                        a_tile = tl.load(a_ptrs)
                        b_tile = tl.load(b_ptrs)
                    else:
                        kmask = offs_k < K - k0
                        a_tile = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
                        b_tile = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
                    acc = tl.dot(a_tile, b_tile, acc)
                    a_ptrs += BLOCK_K
                    b_ptrs += BLOCK_K
        if C_TMA:
            # Two TMA stores of [BLOCK_M, BLOCK_N / 2]: half the staging tile in shared memory (room for a
            # fourth stage), and the first half's store drains while the second half is converted.
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            c0, c1 = tl.split(halves)
            out.store([pid_m * BLOCK_M, pid_n * BLOCK_N], c0.to(out.dtype))
            out.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], c1.to(out.dtype))
        else:
            omask = (rows[:, None] < M) & (cols[None, :] < N)
            tl.store(out + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(out.dtype.element_ty), mask=omask)


@triton.jit
def _gemm_rs_kernel(heap, a, b, recv, counters, M, N, K, m_local, stride_am, stride_bn, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                    AB_TMA: tl.constexpr):
    # recv, on every rank: [world (source), m_local, N] in the output dtype; counters[0] counts arrivals.
    # AB_TMA: a and b are TMA descriptors (blocks [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K]), else pointers.
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if AB_TMA:  # rows, columns and K past the ends read 0
        for k0 in range(0, K, BLOCK_K):
            acc = tl.dot(a.load([pid_m * BLOCK_M, k0]), b.load([pid_n * BLOCK_N, k0]).T, acc)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a + rows_c[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        b_ptrs = b + cols_c[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)
            else:
                kmask = offs_k < K - k0
                acc = tl.dot(tl.load(a_ptrs, mask=kmask[None, :], other=0.0),
                             tl.load(b_ptrs, mask=kmask[:, None], other=0.0), acc)
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


# Tile configurations, fixed rather than autotuned: an autotuner times each candidate on each rank alone,
# but these kernels wait on their peers, so every rank would have to time the same candidate at the same
# moment and pick the same winner. Hopper (wgmma) tiles for the large shapes (3 stages of 128 x 64 +
# 64 x 256 bf16 take 144 KiB of shared memory); smaller tiles keep enough programs for small M.
kLargeConfig = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
kSmallConfig = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
# The AG-GEMM's large tile with four stages in flight, as the C++ GEMM keeps: 192 KiB of stages plus a
# 32 KiB half of the output tile staged for its TMA store (the store is split in two halves) fit in the
# 227 KiB a block may take, whether or not Triton reuses the stages' buffers for the output.
kAgLargeConfig = dict(kLargeConfig, num_stages=4)
kPushPrograms = 16  # AG-GEMM programs that push before they compute (about 8 SMs fill NVLink: DESIGN.md)


def _tile_score(cfg: dict, m: int, n: int, programs: int) -> float:
    # The C++ op's rule (choose_gemm_tile in src/ops/gemm.cpp): useful fraction of the tile area (edge
    # tiles are partly empty) x fill of the last wave x the tile's operand reuse.
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    waves = triton.cdiv(tiles, programs)
    used = m * n / (tiles * bm * bn)
    fill = tiles / (waves * programs)
    return used * fill * (bm * bn / (bm * bn + 48 * (bm + bn)))


def _scored_config(large: dict, small: dict, m: int, n: int, num_sms: int) -> dict:
    """The better scored of a large (one program per SM) and a small (two) tile. Scored rather than by a
    threshold on M: at M = 1024, N = 28672 the large tiles still fill 97% of their last wave and reuse each
    load more than the small ones."""
    s_large = _tile_score(large, m, n, num_sms * _programs_per_sm(large))
    s_small = _tile_score(small, m, n, num_sms * _programs_per_sm(small))
    return dict(large if s_large >= s_small else small)


def _ag_gemm_config(m: int, n: int, num_sms: int) -> dict:
    """The AG-GEMM's tile (its large tile keeps four stages)."""
    return _scored_config(kAgLargeConfig, kSmallConfig, m, n, num_sms)


def _rs_gemm_config(m: int, n: int, num_sms: int) -> dict:
    """The GEMM-RS's tile. By the score, not by M >= 2048 as before: at M = 1024, N = 8192, K = 28672 the small
    tiles ran at 453 TFLOP/s on one H200 against the C++ op's 739."""
    return _scored_config(kLargeConfig, kSmallConfig, m, n, num_sms)


def _tma_ok(t) -> bool:
    # What a TMA descriptor needs of a row-major matrix: a 16-byte aligned base and row stride.
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def _ag_operand_paths(x, w, gathered, cfg: dict) -> tuple[bool, bool]:
    """(A through TMA, B through TMA) for the AG-GEMM: B where w's layout allows; A where B does, x's and
    the gathered buffer's layouts allow, and every tile's rows lie in one rank's rows and one flag's chunk
    (BLOCK_M divides x's row count and the chunk)."""
    b_tma = _tma_ok(w)
    bm = cfg["BLOCK_M"]
    a_tma = b_tma and _tma_ok(x) and _tma_ok(gathered) and x.shape[0] % bm == 0 and kChunkRows % bm == 0
    return a_tma, b_tma


def _num_sms(device, torch) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _programs_per_sm(cfg: dict) -> int:
    # Shared memory decides (228 KiB per H100 / H200 SM): the large tiles' 144 KiB (GEMM-RS) or 224 KiB
    # (AG-GEMM: four stages and half an output tile) leave room for one program, the small tiles' 96 KiB
    # (104 KiB with the AG-GEMM's half output tile) for two.
    return 1 if cfg["BLOCK_M"] * cfg["BLOCK_N"] >= 128 * 256 else 2


def _ag_launch_shape(num_sms: int, per_sm: int, world: int, num_chunks: int, num_tiles: int) -> tuple[int, int]:
    """(programs, pushing programs) of the persistent AG-GEMM: at most per_sm programs per SM (as many as
    fit at once: a program waits only for pushes, and every pushing program runs), and no more than one
    per tile beside the pushing programs (which take the last tile positions, so then none); the pushing
    programs are a few (an eighth of the SMs at most, one per work item at most), none for one rank."""
    push = 0 if world == 1 else max(1, min(kPushPrograms, num_sms // 8, (world - 1) * num_chunks))
    return max(1, min(num_sms * per_sm, num_tiles + push)), push


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
        self.num_sms = 0
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
    """Prepares a call (the caller then launches its start kernel: a barrier across ranks first)."""
    import tdist

    tdist.check_device_faults()  # an earlier wait gave up: the flags are out of step, this call would hang
    view = heap_view()
    if ws.runtime is not view._runtime:  # first call, or a new tdist.init: the old buffers are gone
        ws.__init__()
        ws.runtime = view._runtime
    if ws.pad is None:
        ws.pad = tdist.empty((view.world_size + 2,), torch.int64)
        ws.num_sms = _num_sms(view.tensor.device, torch)
    ws.epoch += 1
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
    cfg = _ag_gemm_config(m, n, _ag.num_sms)
    bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
    num_tiles = triton.cdiv(m, bm) * triton.cdiv(n, cfg["BLOCK_N"])
    programs, push = _ag_launch_shape(_ag.num_sms, _programs_per_sm(cfg), world, num_chunks, num_tiles)
    # The weight through TMA where its layout allows it: the SM's copy engine fetches B, zero-filling past N
    # and K. A too where, besides, every tile's rows come from one rank and one flag's chunk (BLOCK_M divides
    # m_local and the chunk): own tiles read x's descriptor, the others gathered's after their flag. Else A
    # by pointer loads, row by row.
    a_tma, b_tma = _ag_operand_paths(x, w, gathered, cfg)
    b = TensorDescriptor.from_tensor(w, [cfg["BLOCK_N"], bk]) if b_tma else w
    a_own, a_peer = x, gathered  # unused by the pointer path
    if a_tma:
        a_own = TensorDescriptor.from_tensor(x, [bm, bk])
        a_peer = TensorDescriptor.from_tensor(gathered, [bm, bk])
    # The output tile through two TMA stores of half a tile each where A is read through TMA (the
    # configurations the shared memory is checked for) and out's rows are 16-byte aligned.
    c_tma = a_tma and _tma_ok(out)
    c = TensorDescriptor.from_tensor(out, [bm, cfg["BLOCK_N"] // 2]) if c_tma else out
    _ag_start[(1,)](view.tensor, _ag.pad)
    # x as an offset from gathered, in elements (both are 2-byte aligned, so the division is exact).
    x_delta = (x.data_ptr() - gathered.data_ptr()) // x.element_size()
    # One kernel on the current stream: no side stream, so nothing depends on how the block scheduler
    # interleaves two kernels. The pushing programs have the lowest ids (dispatched first) and wait for
    # nothing before their pushes: the GEMM's waits always end.
    _ag_gemm_kernel[(programs,)](view.tensor, x, gathered, a_own, a_peer, b, c, flags, x_delta, m, n, k, m_local,
                                 num_chunks, _ag.epoch, w.stride(0), push, CHUNK=kChunkRows,
                                 PUSH_K=16 * cfg["num_warps"], EVEN_K=k % bk == 0, B_TMA=b_tma, A_TMA=a_tma,
                                 C_TMA=c_tma, PEERS=world > 1, **cfg)
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
    _barrier_kernel[(1,)](view.tensor, _rs.pad)
    m_local = m // world
    # recv: [world (source rank), m_local, N]; counters[0]: tile arrivals, growing over calls.
    recv = _rs.get("recv", (world, m_local, n), a.dtype)
    counters = _rs.get("counters", (1,), torch.int64)
    cfg = _rs_gemm_config(m, n, _rs.num_sms)
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
    ab_tma = all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (a, b))
    a_arg, b_arg = a, b
    if ab_tma:
        a_arg = TensorDescriptor.from_tensor(a, [bm, cfg["BLOCK_K"]])
        b_arg = TensorDescriptor.from_tensor(b, [cfg["BLOCK_N"], cfg["BLOCK_K"]])
    _gemm_rs_kernel[grid](view.tensor, a_arg, b_arg, recv, counters, m, n, k, m_local, a.stride(0), b.stride(0),
                          EVEN_K=k % cfg["BLOCK_K"] == 0, AB_TMA=ab_tma, **cfg)
    _rs_reduce[(triton.cdiv(m_local, 32), triton.cdiv(n, 256))](view.tensor, recv, out, counters, _rs.target, m_local,
                                                                  n, BLOCK_M=32, BLOCK_N=256, num_warps=4)
    return out
