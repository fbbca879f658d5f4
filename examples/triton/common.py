"""Shared by the Triton tutorials: joining the job (torchrun: NCCL process group, then tdist.init over
it), seeded inputs, and the report (rank 0 prints PASS/FAIL per case for all ranks, then
"N passed, M failed"; the exit code is 0 only when every case passed on every rank)."""

import os
import sys

import tdist  # before torch: tdist's libnccl (>= 2.28) is then the one the process loads

import torch
import torch.distributed as dist

SEED = int(os.environ.get("TDIST_SEED", "2024"))


def setup(heap_size="2G"):
    """Idempotent: the GPU test calls the tutorials inside its own session."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    if not tdist.is_initialized():
        tdist.init(process_group=dist.group.WORLD, heap_size=heap_size)


def randn(shape, rank, salt=0, dtype=torch.float32):
    """Fresh random values that any rank can recompute for any other (seeded by rank and salt)."""
    g = torch.Generator(device="cuda").manual_seed(SEED * 1000003 + 7919 * salt + rank)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def report(results):
    """results: list of (case name, ok). Returns the exit status, the same on every rank."""
    ok_here = all(ok for _, ok in results)
    flags = torch.tensor([1 if ok_here else 0], device="cuda")
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, [(name, ok) for name, ok in results])
    if dist.get_rank() == 0:
        passed = failed = 0
        for r, cases in enumerate(lines):
            for name, ok in cases:
                print(f"[rank {r}] {'PASS' if ok else 'FAIL'} {name}", flush=True)
                passed += ok
                failed += not ok
        print(f"{passed} passed, {failed} failed", flush=True)
    return 0 if flags.item() == 1 else 1


def teardown():
    if tdist.is_initialized():
        tdist.finalize()
    if dist.is_initialized():
        dist.destroy_process_group()


def main(run):
    """A tutorial run as a script: join, run its cases, report them, leave; exits with the report's status."""
    setup()
    status = report(run())
    teardown()
    sys.exit(status)
