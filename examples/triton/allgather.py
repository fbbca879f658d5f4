"""Tutorial 2 (Triton) — an AllGather by hand, the Triton twin of examples/02_allgather.

Every rank puts its chunk into slot [rank] of every rank's output (its own included) with plain
stores through symm_at, and sets that rank's flags[rank] to the call number (release); then it waits
for all of its flags at once (a block wait: one flag per source) and copies the gathered output.
A barrier across ranks at the start of each call is the "may write" handshake: no rank overwrites an
output slot a peer is still copying out from the previous call.

Buffers (symmetric):
    gathered  float32[world, capacity]   slot s written by rank s
    flags     int64[world]               flags[s] = call number once slot s holds that call
    pad       int64[world + 2]           barrier pad (tdist.triton.barrier_pad)

    python -m torch.distributed.run --nproc-per-node 2 examples/triton/allgather.py
"""

import triton
import triton.language as tl

import common
import torch
import tdist
import tdist.triton
import tdist.triton.language as tdl


@tdist.triton.kernel
@triton.jit
def all_gather(heap, gathered, flags, pad, chunk, out, n, capacity, call, MAX_WORLD: tl.constexpr,
               BLOCK: tl.constexpr):
    me = tdl.rank(heap)
    world = tdl.num_ranks(heap)
    tdl.barrier_all(heap, pad)  # every rank has finished reading the previous call's slots
    for p in range(0, world):
        tdl.put_signal(heap, gathered + me * capacity, chunk, n, flags + me, call, p, BLOCK)
    src_ranks = tl.arange(0, MAX_WORLD)
    seen = tdl.wait(heap, flags + tl.minimum(src_ranks, world - 1), call)  # every source, one block wait
    src = tdl.consume_token(gathered, seen)
    for s in range(0, world):
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(out + s * n + offs, tl.load(src + s * capacity + offs, mask=mask), mask=mask)


def run(calls=20, sizes=(1, 333, 65537)):
    rank, world = tdist.get_rank(), tdist.get_world_size()
    capacity = max(sizes)
    gathered = tdist.empty((world, capacity), torch.float32)
    flags = tdist.empty((world,), torch.int64)
    pad = tdist.triton.barrier_pad()
    results = []
    call = 0
    for n in sizes:
        chunks = [common.randn(n, rank, salt=7 * n + i) for i in range(calls)]
        outs = torch.full((calls, world * n), -1.0, device="cuda")
        for i in range(calls):
            call += 1
            all_gather[(1,)](gathered, flags, pad[0], chunks[i], outs[i], n, capacity, call,
                             MAX_WORLD=triton.next_power_of_2(world), BLOCK=1024)
        torch.cuda.synchronize()
        ok = all(torch.equal(outs[i], torch.cat([common.randn(n, s, salt=7 * n + i) for s in range(world)]))
                 for i in range(calls))
        results.append((f"all-gather x{calls}, {n} floats per rank", ok))
    torch.distributed.barrier()
    for t in (gathered, flags, pad):
        tdist.free(t)
    return results


if __name__ == "__main__":
    common.main(run)
