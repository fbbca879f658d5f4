"""A rank that dies (its process ends) while the others are in an op, and a rank that dies before
tdist.init. One case per job, 2 or more ranks under torchrun; the last rank dies:

    TDIST_WAIT_TIMEOUT_S=2 python -m torch.distributed.run --nproc-per-node 2 tests/python/gpu_test_killed_rank.py CASE

In an op case every rank first makes a matching call (the op's context exists, its kernels are compiled and
its signature has been compared), then the last rank ends its process with os._exit(0) and the others call
the op again. Exit code 0 so that the launcher, which stops every rank when one fails (torchrun and
tdistrun both do), leaves the survivors running: as they would run on other nodes until their agents
notice. Each survivor must:
  - get its work back without a CUDA error and tdist.DeviceTimeoutError naming its rank and the op whose
    flag its wait watched (from the call or from tdist.check_device_faults()) within the wait timeout plus
    a few seconds;
  - copy a tensor to the host and run a kernel (a checkpoint can be saved);
  - leave through tdist.finalize() within the wait timeout plus a few seconds (its frees and barriers
    would otherwise wait for the dead rank up to the host timeout), then end with exit code 0.
Case before_init: the last rank ends before tdist.init; the others' tdist.init(timeout=5) must raise
tdist.TimeoutError within 5 s plus a few seconds.
Prints "1 passed, 0 failed" on each survivor that passed; the dying rank prints that it exits.
"""

import faulthandler
import os
import sys
import time

os.environ.setdefault("TDIST_WAIT_TIMEOUT_S", "2")  # read when the kernels load
# The default call checking: the survivors' second call has a signature seen before, so they wait in the
# op's device waits (gpu_test_faults, imported below for its input helpers, would turn it off).
os.environ.setdefault("TDIST_CHECK_CALLS", "first")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_harness as h  # noqa: E402 (imports tdist before torch)
import gpu_test_faults as faults  # noqa: E402 (its helpers build the ops' inputs)

import tdist  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

TIMEOUT_S = float(os.environ["TDIST_WAIT_TIMEOUT_S"])
SLACK_S = 5.0  # "a few seconds": a launch behind a JIT compile, the host's polling


def all_reduce():
    x = tdist.empty((1 << 14,), dtype=torch.float32)
    x.fill_(h.rank() + 1)
    return lambda: tdist.all_reduce(x, method="one_shot")


def ag_gemm():
    a = faults.rand((256, 512), torch.bfloat16, 1 + h.rank()).cuda()
    b = faults.rand((384, 512), torch.bfloat16, 2 + h.rank(), scale=0.1).cuda()
    return lambda: tdist.ag_gemm(a, b, method="fused")


def gemm_rs():
    a = faults.rand((512, 256), torch.bfloat16, 3 + h.rank()).cuda()
    b = faults.rand((384, 256), torch.bfloat16, 4 + h.rank(), scale=0.1).cuda()
    return lambda: tdist.gemm_rs(a, b, method="fused")


def moe_ag_group_gemm():
    return faults.moe_ag_call("chunked", 6)


def moe_ag_group_gemm_fused():
    return faults.moe_ag_call("fused", 6)


def moe_group_gemm_rs():
    m, topk, experts, k, n = 301, 2, 10, 200, 136
    ids = faults.moe_ids(m, topk, experts, 4).cuda()
    weights = torch.rand((m, topk), generator=torch.Generator().manual_seed(5)).cuda()
    hidden = faults.rand((tdist.moe.capacity(m, topk, experts), k), torch.bfloat16, 6 + h.rank()).cuda()
    w2 = faults.rand((experts, n, k), torch.bfloat16, 7 + h.rank(), scale=0.1).cuda()
    return lambda: tdist.moe_group_gemm_rs(hidden, w2, ids, weights, method="chunked")


def ep_low_latency_dispatch():
    buf = faults.ep_buffer("low_latency")
    x, idx, _ = faults.ep_tokens(buf, 13, 10)
    return lambda: buf.low_latency_dispatch(x, idx)


def ep_dispatch():
    buf = faults.ep_buffer("high_throughput")
    x, idx, weights = faults.ep_tokens(buf, 13, 12)
    return lambda: buf.dispatch(x, idx, weights)


def flash_decode():
    batch, q_heads, kv_heads, head_dim, capacity = 3, 8, 2, 128, 40
    q = faults.rand((batch, q_heads, head_dim), torch.bfloat16, 20).cuda()
    k = faults.rand((batch, capacity, kv_heads, head_dim), torch.bfloat16, 21 + h.rank()).cuda()
    v = faults.rand((batch, capacity, kv_heads, head_dim), torch.bfloat16, 22 + h.rank()).cuda()
    lens = torch.tensor([capacity, 0, 17 + h.rank()], dtype=torch.int32, device="cuda")
    return lambda: tdist.flash_decode(q, k, v, lens, distributed=True)


def triton_ag_gemm():
    import tdist.triton

    x = faults.rand((256, 512), torch.bfloat16, 30 + h.rank()).cuda()
    w = faults.rand((384, 512), torch.bfloat16, 31 + h.rank(), scale=0.1).cuda()
    return lambda: tdist.triton.ag_gemm(x, w)


# What each case's error must name: the owner of the flag the survivor's wait watched (its op).
OWNERS = {"all_reduce": "tdist's collectives", "ag_gemm": "AllGather-GEMM", "gemm_rs": "GEMM-ReduceScatter",
          "moe_ag_group_gemm": "MoE AllGather + grouped GEMM",
          "moe_ag_group_gemm_fused": "MoE AllGather + grouped GEMM",
          "moe_group_gemm_rs": "MoE grouped GEMM + ReduceScatter",
          "ep_low_latency_dispatch": "EP buffer (low-latency", "ep_dispatch": "EP buffer (high-throughput",
          "flash_decode": "flash", "triton_ag_gemm": "symmetric tensor (tdist.empty)"}

OP_CASES = {f.__name__: f for f in (all_reduce, ag_gemm, gemm_rs, moe_ag_group_gemm, moe_ag_group_gemm_fused,
                                    moe_group_gemm_rs, ep_low_latency_dispatch, ep_dispatch, flash_decode,
                                    triton_ag_gemm)}


def dies() -> bool:
    return int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1


def die(when: str):
    print(f"[rank {os.environ['RANK']}] ends its process {when}", flush=True)
    os._exit(0)


def arm_watchdog():
    """From the peer's death on, a survivor stuck past every bound prints where it is and fails."""
    faulthandler.dump_traceback_later(2 * (TIMEOUT_S + SLACK_S) + 10, exit=True)


def survive_op(name: str):
    h.setup()
    call = OP_CASES[name]()
    call()  # every rank: context, kernels, the call's signature compared
    state = torch.randn(4096, device="cuda")  # what a training job would want to save
    torch.cuda.synchronize()
    dist.barrier()
    if dies():
        die(f"instead of its second {name} call")
    arm_watchdog()
    time.sleep(0.2)  # the peer is gone before the call, not merely late
    start = time.monotonic()
    raised = None
    try:
        call()
        torch.cuda.synchronize()  # returns: the waits aborted instead of trapping
        tdist.check_device_faults()
    except tdist.DeviceTimeoutError as e:
        raised = str(e)
    took = time.monotonic() - start
    assert raised is not None, f"{name}: no DeviceTimeoutError after the peer died ({took:.2f} s)"
    assert f"on rank {h.rank()}" in raised, f"{name}: the error does not name rank {h.rank()}: {raised}"
    assert OWNERS[name] in raised, f"{name}: the error does not name '{OWNERS[name]}': {raised}"
    assert took < TIMEOUT_S + SLACK_S, f"{name}: the error came after {took:.2f} s"
    torch.cuda.synchronize()
    saved = state.cpu()
    assert torch.equal(saved.cuda(), state) and torch.allclose((state * 2).sum(), state.sum() * 2)
    start_finalize = time.monotonic()
    tdist.finalize()
    took_finalize = time.monotonic() - start_finalize
    assert took_finalize < TIMEOUT_S + SLACK_S, f"{name}: tdist.finalize() took {took_finalize:.2f} s"
    print(f"[rank {h.rank()}] {name}: DeviceTimeoutError after {took:.2f} s, a tensor copied out, tdist.finalize() in "
          f"{took_finalize:.2f} s: {raised.split('. ')[0]}", flush=True)


def survive_before_init():
    if dies():
        die("before tdist.init")
    arm_watchdog()
    start = time.monotonic()
    try:
        tdist.init(heap_size="256M", timeout=5)
    except tdist.TimeoutError as e:
        took = time.monotonic() - start
        assert took < 5 + SLACK_S, f"before_init: tdist.init raised after {took:.2f} s"
        print(f"[rank {os.environ['RANK']}] before_init: tdist.TimeoutError after {took:.2f} s: {e}", flush=True)
        return
    raise AssertionError("tdist.init returned although a rank never joined")


def main(argv) -> int:
    cases = sorted(OP_CASES) + ["before_init"]
    if argv == ["--list"]:
        print(" ".join(cases))
        return 0
    if len(argv) != 1 or argv[0] not in cases:
        sys.exit(f"usage: gpu_test_killed_rank.py CASE, one of {cases}")
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        print(f"SKIP {argv[0]}: a rank must die while another runs; needs 2 or more ranks", flush=True)
        return 0
    try:
        survive_before_init() if argv[0] == "before_init" else survive_op(argv[0])
    except Exception:
        import traceback

        print(f"[rank {os.environ['RANK']}] FAIL {argv[0]}\n{traceback.format_exc()}\n0 passed, 1 failed", flush=True)
        os._exit(1)  # the world is broken: no orderly teardown
    print(f"[rank {os.environ['RANK']}] PASS {argv[0]}\n1 passed, 0 failed", flush=True)
    # tdist has left; torch's process group still counts the dead rank, and its teardown at exit is
    # torch's to bound, not what this test checks.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
