"""Tutorial 3 (Triton) — a low-latency all-to-all (MoE dispatch), the Triton twin of
examples/03_low_latency_all_to_all.

Each rank holds rows for every destination rank (a variable count per destination, at most `cap`).
It puts, into the destination's slot for this source, the count and the rows, then sets the
destination's flag for this source to the call number. Slots are double-buffered by call parity, so a
call never overwrites the slot a peer may still read from the previous call; the count travels in the
same slot, before the flag's release, so one acquire covers both.

Buffers (symmetric), on every rank:
    rows    float32[2 (parity), world (source), cap, hidden]
    counts  int64[2 (parity), world (source)]
    flags   int64[2 (parity), world (source)]   = call number once that slot holds the call

Two calls apart (same parity) the host synchronises here; a kernel that reuses a parity without it must
first wait for the peers to have drained it (tutorial 1's back-pressure).

    python -m torch.distributed.run --nproc-per-node 2 examples/triton/all_to_all.py
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
def dispatch(heap, rows, counts, flags, send, send_counts, recv, recv_counts, cap, hidden, call,
             BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    # Program d sends to destination rank d and then receives from source rank d.
    me = tdl.rank(heap)
    world = tdl.num_ranks(heap)
    d = tl.program_id(0)
    parity = call % 2
    slot = parity * world + me  # our slot on the destination
    cnt = tl.load(send_counts + d)
    r = tl.arange(0, BLOCK_R)
    hcols = tl.arange(0, BLOCK_H)
    for r0 in range(0, cnt, BLOCK_R):
        rr = r0 + r
        mask = (rr[:, None] < cnt) & (hcols[None, :] < hidden)
        vals = tl.load(send + (d * cap + rr)[:, None] * hidden + hcols[None, :], mask=mask)
        tdl.put_tile(heap, rows + (slot * cap + rr)[:, None] * hidden + hcols[None, :], vals, d, mask=mask)
    tdl.put_tile(heap, counts + slot, cnt, d)
    tdl.signal_op(heap, flags + slot, call, d)
    # Receive from source s = d: wait for its flag, then read its count and rows.
    src_slot = parity * world + d
    seen = tdl.wait(heap, flags + src_slot, call)
    n = tl.load(tdl.consume_token(counts + src_slot, seen))
    n = tl.minimum(tl.maximum(n, 0), cap)  # a timed-out wait returns anyway: bound the count before it indexes
    base = tdl.consume_token(rows, seen)
    tl.store(recv_counts + d, n)
    for r0 in range(0, n, BLOCK_R):
        rr = r0 + r
        mask = (rr[:, None] < n) & (hcols[None, :] < hidden)
        vals = tl.load(base + (src_slot * cap + rr)[:, None] * hidden + hcols[None, :], mask=mask)
        tl.store(recv + (d * cap + rr)[:, None] * hidden + hcols[None, :], vals, mask=mask)


def _counts(src, call, world, cap):
    g = torch.Generator().manual_seed(common.SEED + 31 * call + src)
    return torch.randint(0, cap + 1, (world,), generator=g)


def run(calls=8, cap=37, hidden=100):
    rank, world = tdist.get_rank(), tdist.get_world_size()
    rows = tdist.empty((2, world, cap, hidden), torch.float32)
    counts = tdist.empty((2, world), torch.int64)
    flags = tdist.empty((2, world), torch.int64)
    ok = True
    for call in range(1, calls + 1):
        send_counts = _counts(rank, call, world, cap).cuda()
        send = common.randn((world, cap, hidden), rank, salt=call)
        recv = torch.full((world, cap, hidden), -1.0, device="cuda")
        recv_counts = torch.full((world,), -1, dtype=torch.int64, device="cuda")
        dispatch[(world,)](rows, counts, flags, send, send_counts, recv, recv_counts, cap, hidden, call,
                           BLOCK_R=16, BLOCK_H=128)
        torch.cuda.synchronize()
        for s in range(world):
            n = int(_counts(s, call, world, cap)[rank])
            expect = common.randn((world, cap, hidden), s, salt=call)[rank, :n]
            ok &= int(recv_counts[s]) == n and torch.equal(recv[s, :n], expect)
            ok &= bool((recv[s, n:] == -1.0).all())  # nothing beyond the count was written
    torch.distributed.barrier()
    for t in (rows, counts, flags):
        tdist.free(t)
    return [(f"all-to-all x{calls}, cap {cap}, hidden {hidden}", ok)]


if __name__ == "__main__":
    common.main(run)
