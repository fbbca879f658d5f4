"""Tutorial 4 (Triton) — the core of AllGather-GEMM: GEMM tiles that wait on the flags of the chunks
holding their rows; the Triton twin of examples/04_gemm_wait_flags.

A push kernel, on a high-priority side stream, copies this rank's rows of A, CHUNK rows per program,
into every rank's gathered A (its own included) and sets that rank's flag for the chunk to the call
number. The GEMM kernel, on the main stream at the same time, computes C = gathered A @ B.T tile by
tile; each tile first waits for the flags of the chunks holding its rows (a block wait, one flag per
row), then loads A through consume_token so that no load of A can be issued before the wait.
A barrier across ranks starts each call: nobody overwrites gathered rows a peer's previous GEMM may
still read.

Here every tile waits, even for this rank's rows, so the kernels rely on the push running while GEMM
tiles spin: true for the small grids of this tutorial (they fit on the GPU at once). The library op
tdist.triton.ag_gemm holds at any size: one persistent kernel whose first programs push before they
compute, and whose tiles start with this rank's own rows, read straight from A without waiting.

Buffers (symmetric):
    gathered  bf16[world * m_local, K]   rows of rank r at r * m_local
    flags     int64[world, chunks]       = call number once that chunk of rank r's rows arrived
    pad       int64[world + 2]           barrier pad

    python -m torch.distributed.run --nproc-per-node 2 examples/triton/ag_gemm.py
"""

import triton
import triton.language as tl

import common
import torch
import tdist
import tdist.triton
import tdist.triton.language as tdl

CHUNK = 32


@tdist.triton.kernel
@triton.jit
def start_barrier(heap, pad):
    tdl.barrier_all(heap, pad)


@tdist.triton.kernel
@triton.jit
def push_rows(heap, gathered, a, flags, m_local, K, chunks, call, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr):
    me = tdl.rank(heap)
    c = tl.program_id(0)
    peer = tl.program_id(1)
    rows = c * CHUNK + tl.arange(0, CHUNK)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = (rows[:, None] < m_local) & (cols[None, :] < K)
        tile = tl.load(a + rows[:, None] * K + cols[None, :], mask=mask)
        tdl.put_tile(heap, gathered + (me * m_local + rows)[:, None] * K + cols[None, :], tile, peer, mask=mask)
    tdl.signal_op(heap, flags + me * chunks + c, call, peer)  # after a bar.sync: the whole chunk first


@tdist.triton.kernel
@triton.jit
def gemm_wait_flags(heap, gathered, b, c, flags, M, N, K, m_local, chunks, call, CHUNK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = tl.minimum(pid_m * BLOCK_M + tl.arange(0, BLOCK_M), M - 1)
    src = rows // m_local
    seen = tdl.wait(heap, flags + src * chunks + (rows - src * m_local) // CHUNK, call)
    a_base = tdl.consume_token(gathered, seen)
    cols = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = ks < K - k0
        a_tile = tl.load(a_base + rows[:, None] * K + (k0 + ks)[None, :], mask=kmask[None, :], other=0.0)
        b_tile = tl.load(b + cols[None, :] * K + (k0 + ks)[:, None], mask=kmask[:, None], other=0.0)
        acc = tl.dot(a_tile, b_tile, acc)
    out_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    out_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (out_rows[:, None] < M) & (out_cols[None, :] < N)
    tl.store(c + out_rows[:, None] * N + out_cols[None, :], acc.to(tl.bfloat16), mask=mask)


def run(shapes=((1, 64, 64), (45, 100, 200), (200, 384, 256)), calls=3):
    rank, world = tdist.get_rank(), tdist.get_world_size()
    side = torch.cuda.Stream(priority=-1)
    pad = tdist.triton.barrier_pad()
    results = []
    call = 0
    for m_local, n, k in shapes:
        chunks = triton.cdiv(m_local, CHUNK)
        gathered = tdist.empty((world * m_local, k), torch.bfloat16)
        flags = tdist.empty((world, chunks), torch.int64)
        ok = True
        for i in range(calls):
            call += 1
            a = (common.randn((m_local, k), rank, salt=100 * i + k) / k ** 0.5).to(torch.bfloat16)
            b = common.randn((n, k), rank, salt=5 + k).to(torch.bfloat16)
            c = torch.full((world * m_local, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            start_barrier[(1,)](pad[0])
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # launched first, high priority: its programs find SMs
                push_rows[(chunks, world)](gathered, a, flags, m_local, k, chunks, call, CHUNK=CHUNK, BLOCK_K=64)
            grid = (triton.cdiv(world * m_local, 64), triton.cdiv(n, 64))
            gemm_wait_flags[grid](gathered, b, c, flags, world * m_local, n, k, m_local, chunks, call, CHUNK=CHUNK,
                                  BLOCK_M=64, BLOCK_N=64, BLOCK_K=32)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            full_a = torch.cat([(common.randn((m_local, k), s, salt=100 * i + k) / k ** 0.5).to(torch.bfloat16)
                                for s in range(world)])
            ref = full_a.double() @ b.double().T
            ok &= bool(torch.allclose(c.double(), ref, rtol=2e-2, atol=2e-2))
        results.append((f"AG-GEMM with flag waits, m_local {m_local}, N {n}, K {k}, x{calls}", ok))
        torch.distributed.barrier()
        tdist.free(gathered)
        tdist.free(flags)
    tdist.free(pad)
    return results


if __name__ == "__main__":
    common.main(run)
