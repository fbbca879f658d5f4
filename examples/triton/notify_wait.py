"""Tutorial 1 (Triton) — notify and wait, the Triton twin of examples/01_notify_wait.

A ring: in every round rank r puts a payload into rank r+1's mailbox and raises its `ready` flag to
the round number; rank r+1 waits for it, copies the mailbox out and raises rank r's `mailbox_free`
flag, so that the next round may overwrite the mailbox (back-pressure). Flags only grow (the round
number is the signal value): no resets, no host synchronisation between rounds.

Buffers (symmetric: tdist.empty, same offset on every rank):
    mailbox       float32[capacity]   written by the previous rank
    ready         int64               = round once the mailbox holds that round (previous rank)
    mailbox_free  int64               = round once the next rank has read round `round` out

    python -m torch.distributed.run --nproc-per-node 2 examples/triton/notify_wait.py
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
def ring_round(heap, mailbox, ready, mailbox_free, payload, out, n, rnd, BLOCK: tl.constexpr):
    me = tdl.rank(heap)
    world = tdl.num_ranks(heap)
    nxt = (me + 1) % world
    prv = (me + world - 1) % world
    # 1. The next rank has read round rnd-1 out of the mailbox we are about to overwrite. Its flag lives
    #    in our memory (it raised it remotely); acquire, then every thread is ordered after it.
    tdl.wait(heap, mailbox_free, rnd - 1)
    # 2. Payload into the next rank's mailbox, then its `ready` = rnd: release after a bar.sync, so the
    #    whole payload is visible to whoever acquires `ready`.
    tdl.put_signal(heap, mailbox, payload, n, ready, rnd, nxt, BLOCK)
    # 3. Our own mailbox, filled by the previous rank: wait, then load through consume_token.
    seen = tdl.wait(heap, ready, rnd)
    src = tdl.consume_token(mailbox, seen)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out + offs, tl.load(src + offs, mask=mask), mask=mask)
    # 4. Tell the previous rank that its mailbox on us is free again (release: our reads come first).
    tdl.signal_op(heap, mailbox_free, rnd, prv)


def run(rounds=50, sizes=(1, 1000, 4099)):
    rank, world = tdist.get_rank(), tdist.get_world_size()
    capacity = max(sizes)
    mailbox = tdist.empty((capacity,), torch.float32)
    ready = tdist.empty((1,), torch.int64)
    mailbox_free = tdist.empty((1,), torch.int64)
    results = []
    rnd = 0
    for n in sizes:
        payloads = [common.randn(n, rank, salt=1000 * n + i) for i in range(rounds)]
        outs = torch.full((rounds, n), -1.0, device="cuda")
        for i in range(rounds):  # back to back: only the flags order the rounds
            rnd += 1
            ring_round[(1,)](mailbox, ready, mailbox_free, payloads[i], outs[i], n, rnd, BLOCK=1024)
        torch.cuda.synchronize()
        prev = (rank - 1) % world
        ok = all(torch.equal(outs[i], common.randn(n, prev, salt=1000 * n + i)) for i in range(rounds))
        results.append((f"ring of {rounds} rounds, {n} floats", ok))
    torch.cuda.synchronize()
    torch.distributed.barrier()
    for t in (mailbox, ready, mailbox_free):
        tdist.free(t)
    return results


if __name__ == "__main__":
    common.main(run)
