"""GPU tests of the Python package, on 2+ GPUs of one node:

    torchrun --nproc-per-node 2 -m pytest -q tests/python/gpu_test_ops.py
    torchrun --nproc-per-node 2 tests/python/gpu_test_ops.py          # plain script

Every op against torch.distributed reference math (fp64 sums of the gathered fp32 inputs), eagerly,
inside torch.compile(fullgraph=True) and inside a captured CUDA graph; tdist.empty / peer; the JIT
launching a kernel on torch tensors; argument errors. Outputs are poisoned (NaN) before each run.
Both ways end with a line "N passed, M failed".
"""

import os
import sys
import traceback

import tdist  # before torch: tdist's libnccl (>= 2.28) is then the one the process loads

import torch
import torch.distributed as dist

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}
# Sizes per rank: tiny, unaligned (not a multiple of 16 bytes), LL-sized, beyond LL, large.
COUNTS = (1, 1001, 8192, 300_000, 4 << 20)
AR_METHODS = ("auto", "one_shot", "two_shot", "ll", "nccl")
AG_METHODS = ("auto", "sm", "ce_push", "ce_pull", "ll", "nccl")
RS_METHODS = ("auto", "fused", "ce", "ll", "nccl")
LL_BYTES = 256 * 1024


def setup():
    """init_process_group (NCCL) + tdist.init over it. Idempotent."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    if not tdist.is_initialized():
        tdist.init(process_group=dist.group.WORLD, heap_size="2G")


def teardown():
    if tdist.is_initialized():
        tdist.finalize()
    if dist.is_initialized():
        dist.destroy_process_group()


def rank():
    return dist.get_rank()


def world():
    return dist.get_world_size()


def rand(count, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed * 7919 + rank())
    return torch.randn(count, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def gathered_fp64(x):
    """Every rank's x, exactly, as float64: [world, *x.shape]."""
    out = torch.empty((world(),) + tuple(x.shape), device="cuda", dtype=torch.float32)
    dist.all_gather_into_tensor(out, x.float().contiguous())
    return out.double()


def check_close(got, want, dtype, what):
    torch.testing.assert_close(got.double(), want.double(), rtol=TOL[dtype], atol=TOL[dtype], msg=lambda m: f"{what}: {m}")


def ll_ok(bytes_):
    return bytes_ <= LL_BYTES


# --- eager ------------------------------------------------------------------------------------------

def test_all_reduce_eager():
    for dtype in DTYPES:
        for count in COUNTS:
            x = rand(count, dtype, count)
            want = gathered_fp64(x).sum(0)
            for method in AR_METHODS:
                if method == "ll" and not ll_ok(count * x.element_size()):
                    continue
                what = f"all_reduce {dtype} n={count} {method}"
                out = torch.full_like(x, float("nan"))
                assert tdist.all_reduce(x, output=out, method=method) is out
                check_close(out, want, dtype, what + " out=")
                y = x.clone()
                assert tdist.all_reduce(y, method=method) is y
                check_close(y, want, dtype, what + " in place")
                z = torch.ops.tdist.all_reduce(x, method)
                check_close(z, want, dtype, what + " functional")
                # every rank holds the same bits
                check_close(gathered_fp64(z) - gathered_fp64(z)[0], torch.zeros(world(), count, device="cuda"),
                            torch.float32, what + " identical on ranks")


def test_all_gather_eager():
    for dtype in DTYPES:
        for count in COUNTS:
            x = rand(count, dtype, count + 1)
            want = torch.empty(world() * count, device="cuda", dtype=dtype)
            dist.all_gather_into_tensor(want, x)
            for method in AG_METHODS:
                if method == "ll" and not ll_ok(count * x.element_size()):
                    continue
                what = f"all_gather {dtype} n={count} {method}"
                out = torch.full((world() * count,), float("nan"), device="cuda", dtype=dtype)
                tdist.all_gather(x, out, method=method)
                assert torch.equal(out, want), what
                got = tdist.all_gather(x.view(1, count), method=method)
                assert got.shape == (world(), count), what
                assert torch.equal(got.flatten(), want), what + " functional"
                # in place: input is this rank's part of the output
                buf = torch.full((world() * count,), float("nan"), device="cuda", dtype=dtype)
                buf[rank() * count:(rank() + 1) * count] = x
                tdist.all_gather(buf[rank() * count:(rank() + 1) * count], buf, method=method)
                assert torch.equal(buf, want), what + " in place"


def test_reduce_scatter_eager():
    for dtype in DTYPES:
        for count in COUNTS:
            x = rand(world() * count, dtype, count + 2)
            want = gathered_fp64(x).sum(0)[rank() * count:(rank() + 1) * count]
            for method in RS_METHODS:
                if method == "ll" and not ll_ok(count * x.element_size()):
                    continue
                what = f"reduce_scatter {dtype} n={count} {method}"
                out = torch.full((count,), float("nan"), device="cuda", dtype=dtype)
                tdist.reduce_scatter(x, out, method=method)
                check_close(out, want, dtype, what)
                got = tdist.reduce_scatter(x.view(world(), count), method=method)
                assert got.shape == (1, count)
                check_close(got.flatten(), want, dtype, what + " functional")
                y = x.clone()
                part = y[rank() * count:(rank() + 1) * count]
                tdist.reduce_scatter(y, part, method=method)
                check_close(part, want, dtype, what + " in place")


def test_barrier_orders_streams():
    # Rank 0 delays, then writes into rank 1's symmetric buffer; after the barrier rank 1 must see it.
    buf = tdist.empty((1024,), torch.float32)
    tdist.barrier()
    if rank() == 0:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the write
        tdist.peer(buf, 1).fill_(42.0)
    tdist.barrier()
    if rank() == 1:
        assert torch.all(buf == 42.0).item(), "barrier did not order the peer's write"
    tdist.barrier()
    torch.cuda.synchronize()
    tdist.free(buf)


def test_other_stream():
    s = torch.cuda.Stream()
    x = rand(5000, torch.bfloat16, 5)
    want = gathered_fp64(x).sum(0)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = torch.ops.tdist.all_reduce(x, "auto")
    torch.cuda.current_stream().wait_stream(s)
    check_close(y, want, torch.bfloat16, "all_reduce on a side stream")


# --- torch.compile ----------------------------------------------------------------------------------

def test_torch_compile_fullgraph():
    torch._dynamo.reset()

    def f(x, rs_in):
        a = tdist.all_reduce(x * 2, output=torch.empty_like(x))
        g = tdist.all_gather(a + 1)
        r = tdist.reduce_scatter(rs_in)
        b = torch.ops.tdist.all_reduce(x, "one_shot")
        tdist.barrier()
        return g, r * 3, b

    def f_inplace(x):
        tdist.all_reduce(x)
        return x * 1

    cf = torch.compile(f, fullgraph=True)
    ci = torch.compile(f_inplace, fullgraph=True)
    for dtype in DTYPES:
        for count in (1001, 70_000):
            x = rand(count, dtype, 11)
            rs_in = rand(world() * count, dtype, 12)
            gx = gathered_fp64(x)
            want_ar2 = (gx * 2).sum(0)
            want_g = (want_ar2.to(dtype).double() + 1).repeat(world())
            want_r = gathered_fp64(rs_in).sum(0)[rank() * count:(rank() + 1) * count] * 3
            g, r, b = cf(x, rs_in)
            check_close(g, want_g, dtype, f"compiled all_reduce(out=) -> all_gather {dtype}")
            check_close(r, want_r, dtype, f"compiled reduce_scatter {dtype}")
            check_close(b, gx.sum(0), dtype, f"compiled functional all_reduce {dtype}")
            y = x.clone()
            out = ci(y)
            check_close(y, gx.sum(0), dtype, f"compiled in-place all_reduce {dtype} (input mutated)")
            check_close(out, gx.sum(0), dtype, f"compiled in-place all_reduce {dtype}")


# --- CUDA graphs ------------------------------------------------------------------------------------

def test_cuda_graph_capture():
    for dtype in DTYPES:
        for count in (1001, 100_000):
            for ar_method in ("auto", "two_shot", "nccl"):
                x = rand(count, dtype, 21)
                rs_in = rand(world() * count, dtype, 22)
                ar_out = torch.empty_like(x)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):  # warm-up outside the capture
                    tdist.all_reduce(x, output=ar_out, method=ar_method)
                    tdist.all_gather(x)
                    tdist.reduce_scatter(rs_in)
                torch.cuda.current_stream().wait_stream(s)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    tdist.all_reduce(x, output=ar_out, method=ar_method)
                    ag = tdist.all_gather(x)
                    rs = tdist.reduce_scatter(rs_in)
                    tdist.barrier()
                    fn = torch.ops.tdist.all_reduce(ag, "auto")
                for replay in range(3):
                    x.copy_(rand(count, dtype, 100 + replay))
                    rs_in.copy_(rand(world() * count, dtype, 200 + replay))
                    ar_out.fill_(float("nan"))
                    graph.replay()
                    gx = gathered_fp64(x)
                    what = f"graph {dtype} n={count} {ar_method} replay {replay}"
                    check_close(ar_out, gx.sum(0), dtype, what + " all_reduce")
                    assert torch.equal(ag, gx.flatten().to(dtype)), what + " all_gather"
                    check_close(rs, gathered_fp64(rs_in).sum(0)[rank() * count:(rank() + 1) * count], dtype,
                                what + " reduce_scatter")
                    check_close(fn, gx.flatten().to(dtype).double() * world(), dtype, what + " all_reduce of gather")
                torch.cuda.synchronize()
                del graph


# --- symmetric tensors ------------------------------------------------------------------------------

def test_empty_and_peer():
    info0 = tdist.heap_info()
    n = 4096
    a = tdist.empty((world(), n), torch.float32)
    assert a.shape == (world(), n) and a.dtype == torch.float32 and a.device == torch.device("cuda", tdist.get_device())
    assert tdist.is_symmetric(a) and not tdist.is_symmetric(torch.empty(4, device="cuda"))
    assert torch.all(a == 0).item(), "symmetric buffers start zeroed"
    assert tdist.heap_info()["in_use"] >= info0["in_use"] + a.numel() * 4
    nxt, prv = (rank() + 1) % world(), (rank() - 1) % world()
    a[rank()].fill_(rank() + 1)
    tdist.barrier()
    # read: row r of the peer's copy holds r + 1 only in that peer's own row
    p = tdist.peer(a, nxt)
    assert p.shape == a.shape and p.dtype == a.dtype
    got = p[nxt].clone()
    assert torch.all(got == nxt + 1).item(), "peer read"
    tdist.barrier()
    # write: put my rank into row `rank` of the next rank's copy
    b = tdist.empty((world(), 8), torch.bfloat16)
    tdist.peer(b, nxt)[rank()].fill_(rank() + 10)
    tdist.barrier()
    assert torch.all(b[prv] == prv + 10).item(), "peer write"
    # a view: peer of a slice keeps shape, strides and offset
    v = a[:, 16:32]
    pv = tdist.peer(v, nxt)
    assert pv.stride() == v.stride() and pv.shape == v.shape
    assert torch.all(pv[nxt] == nxt + 1).item()
    assert torch.equal(tdist.peer(a, rank()), a)
    tdist.barrier()
    torch.cuda.synchronize()
    # a symmetric tensor in a collective is used in place (zero copy)
    c = tdist.empty((3000,), torch.bfloat16)
    c.copy_(rand(3000, torch.bfloat16, 31))
    want = gathered_fp64(c).sum(0)
    tdist.all_reduce(c)
    check_close(c, want, torch.bfloat16, "all_reduce on a symmetric tensor")
    torch.cuda.synchronize()
    for t in (a, b, c):
        tdist.free(t)
    assert tdist.heap_info()["in_use"] == info0["in_use"]
    try:
        tdist.free(a)
    except tdist.Error as e:
        assert "not a live buffer" in str(e)
    else:
        raise AssertionError("double free was accepted")


# --- JIT --------------------------------------------------------------------------------------------

KERNEL = r"""
#include <cuda_bf16.h>
#include <tdist/device.cuh>
template <typename T>
__global__ void axpb(T* out, const T* x, float a, float b, unsigned long long n) {
  unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  if (i < n) out[i] = T(a * float(x[i]) + b + kBias);
}
extern "C" __global__ void put_rank(tdist::device::SymmetricHeapView heap, int* buf) {}
"""


def test_jit_launch_on_tensors():
    mod = tdist.jit.compile(KERNEL, ["axpb<float>", "axpb<__nv_bfloat16>"], constants={"kBias": ("float", "0.5f")})
    assert mod.arch.startswith("sm_")
    n = 100_003
    x = torch.randn(n, device="cuda")
    out = torch.full_like(x, float("nan"))
    k = mod.kernel("axpb<float>", signature="float*, const float*, float, float, size_t")
    k(out, x, 2.0, 1.0, n, grid=(n + 255) // 256, block=256)
    torch.testing.assert_close(out, 2 * x + 1.5)
    xb = x.to(torch.bfloat16)
    ob = torch.empty_like(xb)
    kb = mod["axpb<__nv_bfloat16>"]
    j = tdist.jit
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # torch's current stream is s
        kb(ob, xb, j.f32(-1.0), j.f32(0.0), j.u64(n), grid=((n + 127) // 128,), block=(128, 1, 1))
    s.synchronize()
    torch.testing.assert_close(ob.float(), (-xb.float() + 0.5).to(torch.bfloat16).float())
    try:
        k(out, x, 2.0, 1.0, grid=1, block=32)
    except tdist.Error as e:
        assert "signature has 5 arguments" in str(e)
    else:
        raise AssertionError("missing argument accepted")


# --- errors -----------------------------------------------------------------------------------------

def expect_error(fn, *fragments, cls=None):
    cls = cls or tdist.Error
    try:
        fn()
    except cls as e:
        for f in fragments:
            assert f in str(e), f"'{f}' not in '{e}'"
    else:
        raise AssertionError(f"no {cls.__name__} raised; expected {fragments}")


def test_argument_errors_on_gpu():
    x = torch.zeros(64, device="cuda", dtype=torch.bfloat16)
    expect_error(lambda: tdist.all_reduce(torch.zeros(8)), "must be a CUDA tensor", "'cpu'")
    expect_error(lambda: tdist.all_reduce(torch.zeros(8, device="cuda", dtype=torch.int32)), "dtype int32")
    expect_error(lambda: tdist.all_reduce(torch.zeros(8, 8, device="cuda").t()), "must be contiguous")
    expect_error(lambda: tdist.all_reduce(x, method="three_shot"), "three_shot")
    expect_error(lambda: tdist.all_gather(x, torch.empty(65, device="cuda", dtype=torch.bfloat16)),
                 "expected world_size * input.numel()")
    expect_error(lambda: tdist.all_gather(x, torch.empty(64 * world(), device="cuda")), "dtype float32 but 'input' has bfloat16")
    expect_error(lambda: tdist.reduce_scatter(torch.zeros(world() * 2 + 1, 3, device="cuda")), "multiple of world_size")
    expect_error(lambda: tdist.init(), "already initialised")
    expect_error(lambda: tdist.peer(torch.zeros(4, device="cuda"), 0), "symmetric heap")
    expect_error(lambda: tdist.peer(x, world()), "rank must be")
    expect_error(lambda: tdist.empty((4,), device="cpu"), "device must be cuda")
    if torch.cuda.device_count() > 1:
        other = (tdist.get_device() + 1) % torch.cuda.device_count()
        expect_error(lambda: tdist.all_reduce(torch.zeros(8, device=f"cuda:{other}")), f"is on cuda:{other}")


def test_finalize_and_reinit_as_context_manager():
    tdist.finalize()
    assert not tdist.is_initialized()
    with tdist.init(heap_size="256M", max_bytes="16M") as session:
        assert session.world_size == world() and session.rank == rank()
        assert tdist.heap_info()["collective_max_bytes"] == 16 << 20
        x = rand(1 << 20, torch.float32, 41)  # 4 MB
        y = torch.ops.tdist.all_reduce(x, "auto")
        check_close(y, gathered_fp64(x).sum(0), torch.float32, "after re-init")
        big = rand(6 << 20, torch.float32, 42)  # 24 MB > max_bytes: NCCL fallback
        check_close(torch.ops.tdist.all_reduce(big, "auto"), gathered_fp64(big).sum(0), torch.float32, "above max_bytes")
    assert not tdist.is_initialized()
    expect_error(lambda: tdist.all_reduce(x), "not initialised")
    tdist.init(process_group=dist.group.WORLD, heap_size="2G")


TESTS = [test_all_reduce_eager, test_all_gather_eager, test_reduce_scatter_eager, test_barrier_orders_streams,
         test_other_stream, test_torch_compile_fullgraph, test_cuda_graph_capture, test_empty_and_peer,
         test_jit_launch_on_tensors, test_argument_errors_on_gpu, test_finalize_and_reinit_as_context_manager]


# pytest: one init for the module
try:
    import pytest

    @pytest.fixture(scope="module", autouse=True)
    def _tdist_session():
        setup()
        yield
        teardown()
except ImportError:  # plain-script use does not need pytest
    pass


def main():
    setup()
    passed = failed = 0
    for t in TESTS:
        try:
            t()
            passed += 1
            print(f"[rank {rank()}] PASS {t.__name__}", flush=True)
        except Exception:
            failed += 1
            print(f"[rank {rank()}] FAIL {t.__name__}\n{traceback.format_exc()}", flush=True)
        torch.cuda.synchronize()
        dist.barrier()
    teardown()
    print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
