"""Faults under PyTorch (torchrun, 2 or more ranks): in each case the last rank skips one call of an op
that the others make. The others' device waits time out (2 s here), abort and return: the call ends
within a few timeouts, tdist.check_device_faults() and the next call of the op raise
tdist.DeviceTimeoutError naming the rank, and torch keeps working on the same GPU (a checkpoint can be
saved). The rank that skipped sees no fault.

The ops: tdist.all_reduce (one_shot); the MoE tensor-parallel pair tdist.moe_ag_group_gemm (methods
chunked and fused: its wait runs inside the grouped GEMM) and tdist.moe_group_gemm_rs (chunked;
baseline runs NCCL collectives, which have no device wait timeout); the EP buffer's low-latency
dispatch and combine and high-throughput dispatch and combine; tdist.flash_decode(distributed=True).
Every rank first makes a matching call of the same shapes, so that the op's context exists (made
collectively) and its kernels are compiled; a combine's case has every rank dispatch first. Each case
uses objects of its own (its own MoE context, EP buffer or flash-decode exchange), which are not used
again after the fault, and clears the fault afterwards on every rank, as
tests/gpu/test_device_faults.cu does; all_reduce, which runs on the runtime's own collectives, comes
last. (Rebuilding the world in the same process, tdist.finalize() then tdist.init(), gave wrong sums on
2 x H200 after such a fault: not supported yet; end the process.) At world size 1 every case is
skipped, saying so.

    TDIST_WAIT_TIMEOUT_S=2 python -m torch.distributed.run --nproc-per-node 2 tests/python/gpu_test_faults.py [case ...]
"""

import functools
import os
import sys
import time

os.environ.setdefault("TDIST_WAIT_TIMEOUT_S", "2")  # read when the kernels load
# A skipped call may be new to the other ranks: under the default call checking (TDIST_CHECK_CALLS=first)
# they would wait for the last one at the call comparison (the collectives and dense overlapped ops),
# on the host, not in the device waits whose recovery this test is about (docs/security.md).
os.environ.setdefault("TDIST_CHECK_CALLS", "off")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_harness as h  # noqa: E402 (imports tdist before torch)

import tdist  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

TIMEOUT_S = float(os.environ["TDIST_WAIT_TIMEOUT_S"])
_retired = []  # the faulted cases' objects, kept to the end: destroying them is collective


def needs_peers(test):
    """`test`, skipped (saying why) at world size 1: a rank must skip the call while another makes it."""
    @functools.wraps(test)
    def run():
        if h.world() < 2:
            print(f"[rank {h.rank()}] SKIP {test.__name__}: a rank must skip the call while another makes it; "
                  f"needs 2 or more ranks, the world has {h.world()}", flush=True)
            return
        test()
    return run


def skip_on_last_rank(what: str, call):
    """Every rank but the last runs `call`, the op whose peer is absent: its work must end without a CUDA
    error within a few timeouts (not before one), the fault must name this rank, the next call (`call`
    again) must be refused with DeviceTimeoutError, and a tensor must still copy out. The last rank
    must have no fault. Clears the fault on every rank afterwards."""
    last = h.world() - 1
    state = torch.randn(4096, device="cuda")  # what a training job would want to save
    torch.cuda.synchronize()
    dist.barrier()  # the ranks start together: the time measured is the wait's
    try:
        if h.rank() == last:
            tdist.check_device_faults()  # the rank that skipped has waited for nothing
            return
        start = time.monotonic()
        try:
            call()
        except tdist.DeviceTimeoutError:
            # A launch later in the same call (behind a JIT compile longer than the timeout) found the
            # fault already recorded: the op raised at once, as it should; the checks below still hold.
            pass
        torch.cuda.synchronize()  # returns: the waits aborted instead of trapping
        took = time.monotonic() - start
        assert 0.9 * TIMEOUT_S <= took < 15 * TIMEOUT_S, f"{what}: the aborted call took {took:.2f} s"
        h.expect_error(tdist.check_device_faults, f"on rank {h.rank()}", "timed out", cls=tdist.DeviceTimeoutError)
        print(f"[rank {h.rank()}] {what}: aborted after {took:.2f} s: {tdist._C.device_fault_message()}", flush=True)
        h.expect_error(call, "timed out", cls=tdist.DeviceTimeoutError)
        saved = state.cpu()  # the context is intact: copies and kernels work
        assert torch.equal(saved.cuda(), state)
        assert torch.allclose((state * 2).sum(), state.sum() * 2)
    finally:
        torch.cuda.synchronize()
        tdist._C.clear_device_fault()


def rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def moe_ids(m, topk, experts, seed):
    """int32 [m, topk] distinct experts per token, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand((m, experts), generator=g).topk(topk, dim=1).indices.to(torch.int32)


def moe_ag_call(method, experts):
    """A moe_ag_group_gemm call of `method` on a context of its own (`experts` tells the cases apart)."""
    m, topk, k, n = 301, 2, 136, 200
    first, rows = tdist.moe.rows_of(m, h.world(), h.rank())
    x_rows = rand((m, k), torch.bfloat16, 1)[first:first + rows].cuda()
    ids = moe_ids(m, topk, experts, 2).cuda()
    w = rand((experts, n, k), torch.bfloat16, 3 + h.rank(), scale=0.1).cuda()
    return lambda: tdist.moe_ag_group_gemm(x_rows, ids, w, method=method)


@needs_peers
def test_peer_skips_moe_ag_group_gemm():
    call = moe_ag_call("chunked", 6)
    call()  # every rank: the context and the kernels
    skip_on_last_rank("moe_ag_group_gemm (chunked)", call)


@needs_peers
def test_peer_skips_moe_ag_group_gemm_fused():
    call = moe_ag_call("fused", 7)
    call()
    skip_on_last_rank("moe_ag_group_gemm (fused)", call)


@needs_peers
def test_peer_skips_moe_group_gemm_rs():
    m, topk, experts, k, n = 301, 2, 10, 200, 136
    ids = moe_ids(m, topk, experts, 4).cuda()
    weights = torch.rand((m, topk), generator=torch.Generator().manual_seed(5)).cuda()
    hidden = rand((tdist.moe.capacity(m, topk, experts), k), torch.bfloat16, 6 + h.rank()).cuda()
    w2 = rand((experts, n, k), torch.bfloat16, 7 + h.rank(), scale=0.1).cuda()

    def call():
        return tdist.moe_group_gemm_rs(hidden, w2, ids, weights, method="chunked")

    call()
    skip_on_last_rank("moe_group_gemm_rs (chunked)", call)


def ep_tokens(buf, tokens, seed):
    """(x bf16 [tokens, hidden], topk_idx int64 [tokens, topk] of distinct experts, topk_weights float32)."""
    g = torch.Generator().manual_seed(seed * 1009 + h.rank())
    x = torch.randn((tokens, buf.hidden), generator=g).to(torch.bfloat16)
    idx = torch.rand((tokens, buf.num_experts), generator=g).topk(buf.topk, dim=1).indices.to(torch.int64)
    weights = torch.rand((tokens, buf.topk), generator=g)
    return x.cuda(), idx.cuda(), weights.cuda()


def ep_buffer(mode):
    buf = tdist.ep.Buffer(None, max_tokens_per_rank=16, hidden=256, num_experts=2 * h.world(), topk=2, mode=mode)
    _retired.append(buf)
    return buf


def ll_round(buf, x, idx, weights):
    recv_x, _, _, handle, _ = buf.low_latency_dispatch(x, idx)
    return buf.low_latency_combine(recv_x.clone(), idx, weights, handle)


def ht_round(buf, x, idx, weights):
    expert_x, handle = buf.dispatch(x, idx, weights)
    return buf.combine(expert_x.clone(), handle)


@needs_peers
def test_peer_skips_ep_low_latency_dispatch():
    buf = ep_buffer("low_latency")
    x, idx, weights = ep_tokens(buf, 13, 10)
    ll_round(buf, x, idx, weights)

    def call():
        return buf.low_latency_dispatch(x, idx)

    skip_on_last_rank("EP low_latency_dispatch", call)


@needs_peers
def test_peer_skips_ep_low_latency_combine():
    buf = ep_buffer("low_latency")
    x, idx, weights = ep_tokens(buf, 13, 11)
    ll_round(buf, x, idx, weights)
    recv_x, _, _, handle, _ = buf.low_latency_dispatch(x, idx)  # every rank: the combine's peer is absent
    y = recv_x.clone()

    def call():
        return buf.low_latency_combine(y, idx, weights, handle)

    skip_on_last_rank("EP low_latency_combine", call)


@needs_peers
def test_peer_skips_ep_dispatch():
    buf = ep_buffer("high_throughput")
    x, idx, weights = ep_tokens(buf, 13, 12)
    ht_round(buf, x, idx, weights)

    def call():
        return buf.dispatch(x, idx, weights)

    skip_on_last_rank("EP (high-throughput) dispatch", call)


@needs_peers
def test_peer_skips_ep_combine():
    buf = ep_buffer("high_throughput")
    x, idx, weights = ep_tokens(buf, 13, 13)
    ht_round(buf, x, idx, weights)
    expert_x, handle = buf.dispatch(x, idx, weights)  # every rank: the combine's peer is absent
    y = expert_x.clone()

    def call():
        return buf.combine(y, handle)

    skip_on_last_rank("EP (high-throughput) combine", call)


@needs_peers
def test_peer_skips_flash_decode():
    batch, q_heads, kv_heads, head_dim, capacity = 3, 8, 2, 128, 40
    q = rand((batch, q_heads, head_dim), torch.bfloat16, 20).cuda()  # the same on every rank
    k = rand((batch, capacity, kv_heads, head_dim), torch.bfloat16, 21 + h.rank()).cuda()
    v = rand((batch, capacity, kv_heads, head_dim), torch.bfloat16, 22 + h.rank()).cuda()
    lens = torch.tensor([capacity, 0, 17 + h.rank()], dtype=torch.int32, device="cuda")  # this rank's part

    def call():
        return tdist.flash_decode(q, k, v, lens, distributed=True)

    call()
    skip_on_last_rank("flash_decode(distributed=True)", call)


@needs_peers
def test_peer_skips_all_reduce():
    x = tdist.empty((1 << 14,), dtype=torch.float32)
    x.fill_(h.rank() + 1)

    def call():
        tdist.all_reduce(x, method="one_shot")

    skip_on_last_rank("all_reduce (one_shot)", call)


TESTS = [test_peer_skips_moe_ag_group_gemm, test_peer_skips_moe_ag_group_gemm_fused, test_peer_skips_moe_group_gemm_rs,
         test_peer_skips_ep_low_latency_dispatch, test_peer_skips_ep_low_latency_combine, test_peer_skips_ep_dispatch,
         test_peer_skips_ep_combine, test_peer_skips_flash_decode,
         test_peer_skips_all_reduce]  # last: the runtime's own collectives are out of step after it


if __name__ == "__main__":
    wanted = sys.argv[1:]
    unknown = [w for w in wanted if w not in {t.__name__ for t in TESTS}]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; the cases: {[t.__name__ for t in TESTS]}")
    sys.exit(h.run_tests([t for t in TESTS if not wanted or t.__name__ in wanted]))
