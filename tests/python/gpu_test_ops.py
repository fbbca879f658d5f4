"""GPU tests of the Python package, on 2+ GPUs of one node:

    torchrun --nproc-per-node 2 -m pytest -q tests/python/gpu_test_ops.py
    torchrun --nproc-per-node 2 tests/python/gpu_test_ops.py          # plain script

Every op against torch.distributed reference math (fp64 sums of the gathered fp32 inputs), eagerly,
inside torch.compile(fullgraph=True) and inside a captured CUDA graph; tdist.empty / peer; the JIT
launching a kernel on torch tensors; argument errors. Outputs are poisoned (NaN) before each run.
The overlapped GEMMs (ag_gemm, gemm_rs, gemm_ar) with every method and dtype on odd shapes (M not
divisible by the world size, N and K odd multiples of 8) against float64 references built from every
rank's inputs; their outputs are new tensors, so the caching allocator's blocks of those sizes are
filled with NaN before each eager call (graph outputs are filled directly before each replay).
Both ways end with a line "N passed, M failed".
"""

import sys

import tdist  # before torch: tdist's libnccl (>= 2.28) is then the one the process loads

import torch
import torch.distributed as dist

from gpu_harness import HEAP, expect_error, pytest_session, rank, run_tests, world
from tdist import _torch_ops  # gemm_method: the method a call resolves to

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}
# Sizes per rank: tiny, unaligned (not a multiple of 16 bytes), LL-sized, beyond LL, large.
COUNTS = (1, 1001, 8192, 300_000, 4 << 20)
AR_METHODS = ("auto", "one_shot", "two_shot", "ll", "ce", "nccl")
AG_METHODS = ("auto", "sm", "ce_push", "ce_pull", "ll", "nccl")
RS_METHODS = ("auto", "fused", "ce", "ll", "nccl")
LL_BYTES = 256 * 1024
GEMM_DTYPES = (torch.bfloat16, torch.float16)
GEMM_METHODS = ("auto", "fused", "chunked", "sequential", "baseline")
GEMM_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


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
                if method == "ce" and count % world():
                    continue  # ce needs whole-element slices
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
    if world() < 2:
        print("test_barrier_orders_streams: needs two ranks, skipped")
        return
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

def test_argument_errors_on_gpu():
    x = torch.zeros(64, device="cuda", dtype=torch.bfloat16)
    expect_error(lambda: tdist.all_reduce(torch.zeros(8)), "must be a CUDA tensor", "'cpu'")
    expect_error(lambda: tdist.all_reduce(torch.zeros(8, device="cuda", dtype=torch.int32)), "dtype int32")
    expect_error(lambda: tdist.all_reduce(torch.zeros(8, 8, device="cuda").t()), "must be contiguous")
    expect_error(lambda: tdist.all_reduce(x, method="three_shot"), "three_shot")
    expect_error(lambda: tdist.all_gather(x, torch.empty(65, device="cuda", dtype=torch.bfloat16)),
                 "expected world_size * input.numel()")
    expect_error(lambda: tdist.all_gather(x, torch.empty(64 * world(), device="cuda")), "dtype float32 but 'input' has bfloat16")
    if world() > 1:
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
        # a GEMM context larger than the 256 MB heap: refused before anything is allocated, naming heap_size
        a = torch.zeros(8192, 64, device="cuda", dtype=torch.bfloat16)
        w = torch.zeros(8192, 64, device="cuda", dtype=torch.bfloat16)
        expect_error(lambda: tdist.gemm_ar(a, w), "tdist.gemm_ar", "heap_size", "MiB of symmetric memory")
        assert tdist.heap_info()["gemm_contexts"] == []
        small = tdist.gemm_ar(a[:64], w[:64])  # a context that fits still works
        assert small.shape == (64, 64) and torch.all(small == 0).item()
    assert not tdist.is_initialized()
    expect_error(lambda: tdist.all_reduce(x), "not initialised")
    tdist.init(process_group=dist.group.WORLD, heap_size=HEAP)


# --- overlapped GEMMs ---------------------------------------------------------------------------------

def gemm_shapes():
    """(M, N, K): M with ranks of 0 rows, M not divisible by the world size, M divisible (sequential
    runs), N and K odd multiples of 8; one shape of several 128-row tiles."""
    w = world()
    return ((1, 40, 72), (389, 136, 264), (64 * w, 24, 40), (1000 * w + w - 1, 264, 520))


def chunk(m):
    """This rank's (begin, rows) in RowChunks{m, world}."""
    w, r = world(), rank()
    return r * (m // w) + min(r, m % w), m // w + (r < m % w)


def gemm_rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed * 7919 + rank())
    return (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * scale).to(dtype)


def gather_rows_fp64(x, m):
    """Every rank's rows (RowChunks{m, world}) of a 2-D x, in rank order, exactly, as float64."""
    w = world()
    most = m // w + (m % w > 0)
    pad = torch.zeros((most, x.shape[1]), device="cuda", dtype=torch.float32)
    pad[: x.shape[0]] = x.float()
    out = torch.empty((w * most, x.shape[1]), device="cuda", dtype=torch.float32)
    dist.all_gather_into_tensor(out, pad)
    parts = [out[r * most: r * most + (m // w + (r < m % w))] for r in range(w)]
    return torch.cat(parts).double()


def sum_fp64(x):
    y = x.double().contiguous()
    dist.all_reduce(y)
    return y


def poison(*shapes_dtypes):
    """Leaves NaN-filled blocks of these sizes in torch's caching allocator, which hands them to the
    next allocations of those sizes (the ops' fresh outputs): a kernel that skips part of its output
    shows NaN instead of a stale correct result."""
    blocks = [torch.full(shape, float("nan"), device="cuda", dtype=dtype) for shape, dtype in shapes_dtypes]
    del blocks


def sequential_refused(op, m):
    return op != "gemm_ar" and m % world() != 0


def run_gemm(op, x, w, m, method, dtype, gathered=False):
    n = w.shape[0]
    begin, rows = chunk(m)
    if op == "ag_gemm":
        poison(((m, n), dtype), ((m, x.shape[1]), dtype))
        return tdist.ag_gemm(x, w, m=m, method=method, return_gathered=gathered)
    poison(((rows if op == "gemm_rs" else m, n), dtype))
    return (tdist.gemm_rs if op == "gemm_rs" else tdist.gemm_ar)(x, w, method=method)


def gemm_inputs(op, m, n, k, dtype, seed):
    """This rank's operands: ag_gemm (rows, K) and (N, K); gemm_rs / gemm_ar (M, K) and (N, K) (a K slice)."""
    begin, rows = chunk(m)
    k_total = k if op == "ag_gemm" else k * world()
    x = gemm_rand((rows if op == "ag_gemm" else m, k), dtype, seed)
    w = gemm_rand((n, k), dtype, seed + 1, scale=k_total ** -0.5)
    return x, w


def gemm_reference(op, x, w, m):
    """float64 reference of op on every rank's inputs: ag_gemm (d, gathered A), else d."""
    begin, rows = chunk(m)
    if op == "ag_gemm":
        a = gather_rows_fp64(x, m)
        return a @ w.double().T, a
    full = sum_fp64(x.double() @ w.double().T)
    return full[begin:begin + rows] if op == "gemm_rs" else full


def check_gemm(op, got, x, w, m, dtype, what):
    if op == "ag_gemm":
        want, a = gemm_reference(op, x, w, m)
        d, g = got
        assert g.shape == a.shape, f"{what}: gathered shape {tuple(g.shape)}"
        assert torch.equal(g.double(), a), f"{what}: the gathered A differs from every rank's rows"
    else:
        want, d = gemm_reference(op, x, w, m), got
    assert d.shape == want.shape, f"{what}: shape {tuple(d.shape)}, expected {tuple(want.shape)}"
    torch.testing.assert_close(d.double(), want, rtol=GEMM_TOL[dtype], atol=GEMM_TOL[dtype],
                               msg=lambda msg_: f"{what}: {msg_}")


def test_gemm_eager():
    for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        for dtype in GEMM_DTYPES:
            for m, n, k in gemm_shapes():
                x, w = gemm_inputs(op, m, n, k, dtype, m + n + k)
                for method in GEMM_METHODS:
                    what = f"{op} {dtype} m={m} n={n} k={k} {method}"
                    if method == "sequential" and sequential_refused(op, m):
                        expect_error(lambda: run_gemm(op, x, w, m, method, dtype), "'method'", "sequential")
                        continue
                    if op == "ag_gemm":
                        check_gemm(op, run_gemm(op, x, w, m, method, dtype, gathered=True), x, w, m, dtype, what)
                        d = run_gemm(op, x, w, m, method, dtype)
                        torch.testing.assert_close(d.double(), gemm_reference(op, x, w, m)[0], rtol=GEMM_TOL[dtype],
                                                   atol=GEMM_TOL[dtype], msg=lambda msg_: f"{what} (no gathered): {msg_}")
                        if m % world() == 0:  # m derived from equal rows
                            d2 = tdist.ag_gemm(x, w, method=method)
                            assert d2.shape == (m, n), what
                    else:
                        check_gemm(op, run_gemm(op, x, w, m, method, dtype), x, w, m, dtype, what)
                    chosen = _torch_ops.gemm_method(op, x, w, m if op == "ag_gemm" else None, method)
                    assert chosen in GEMM_METHODS and chosen != "auto", f"{what}: resolved to {chosen}"
                    if method != "auto":
                        assert chosen == method, f"{what}: resolved to {chosen}"



def test_catalogue_op_swiglu():
    """ag_gemm_swiglu, registered from the C++ catalogue's description (no Python of its own):
    silu(gate) * up of the gathered A times [W_gate; W_up]^T, every method, against float64; the
    optional gathered output; the fake implementation under torch.compile."""
    dtype = torch.bfloat16
    for m, half, k in ((7 * world() + 3, 24, 72), (256 * world(), 264, 136)):
        x, w = gemm_inputs("ag_gemm", m, 2 * half, k, dtype, 900 + m)
        h, a = gemm_reference("ag_gemm", x, w, m)
        want = torch.nn.functional.silu(h[:, :half]) * h[:, half:]
        for method in ("auto", "fused", "chunked", "baseline"):
            what = f"ag_gemm_swiglu m={m} n/2={half} k={k} {method}"
            d = tdist.ag_gemm_swiglu(x, w, m=m, method=method)
            assert d.shape == (m, half), f"{what}: shape {tuple(d.shape)}"
            torch.testing.assert_close(d.double(), want, rtol=GEMM_TOL[dtype], atol=GEMM_TOL[dtype],
                                       msg=lambda msg_: f"{what}: {msg_}")
        d, g = tdist.overlap("ag_gemm_swiglu", x, w, m=m, optional_outputs=("gathered",))
        assert torch.equal(g.double(), a), "ag_gemm_swiglu: the gathered A differs from every rank's rows"
        if m % world() == 0:
            compiled = torch.compile(lambda x_, w_: tdist.ag_gemm_swiglu(x_, w_), fullgraph=True)
            torch.testing.assert_close(compiled(x, w).double(), want, rtol=GEMM_TOL[dtype], atol=GEMM_TOL[dtype])
    x, w = gemm_inputs("ag_gemm", 8 * world(), 24, 72, dtype, 7)  # N = 24: a multiple of 8, not of 16
    expect_error(lambda: tdist.ag_gemm_swiglu(x, w), "tdist.ag_gemm_swiglu", "multiple of 16")

def test_gemm_contexts_grow():
    """A context is created on the first call for exactly that M and re-created larger when a call
    exceeds it, taking at least twice the old M (the heap has room here); rs / ar contexts serve any
    call up to their max_m and max_n."""
    dtype = torch.float16
    n, k = 56, 88  # K = 88 is used nowhere else: a fresh ag_gemm context

    def contexts(op):
        return [c for c in tdist.heap_info()["gemm_contexts"] if c["op"] == op and c["dtype"] == "f16" and
                (op != "ag_gemm" or c["k"] == k)]

    assert contexts("ag_gemm") == []
    for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        seen = []
        for m in (16, 24, 100):
            x, w = gemm_inputs(op, m, n, k, dtype, 77 + m)
            got = run_gemm(op, x, w, m, "chunked", dtype, gathered=op == "ag_gemm")
            check_gemm(op, got, x, w, m, dtype, f"{op} growth m={m}")
            c = contexts(op)
            assert len(c) == 1 and c[0]["max_m"] >= m and (op == "ag_gemm" or c[0]["max_n"] >= n), c
            seen.append(c[0]["max_m"])
        if op == "ag_gemm":
            assert seen == [16, 32, 100], seen  # 16; 24 -> max(24, 2 * 16); 100 -> max(100, 2 * 32)


def test_gemm_torch_compile():
    torch._dynamo.reset()

    def layer(x_rows, w_up, w_down, m):
        h, g = tdist.ag_gemm(x_rows, w_up, m=m, return_gathered=True)
        h = torch.nn.functional.gelu(h.float()).to(h.dtype)
        y = tdist.gemm_rs(h, w_down, method="chunked")
        z = tdist.gemm_ar(h, w_down)
        return y * 2, z, g

    f = torch.compile(layer, fullgraph=True)
    for dtype in GEMM_DTYPES:
        for m in (3 * world() + 1, 517):  # two M: the second call may trace with a symbolic M
            k, n_up, n_down = 136, 40, 24
            begin, rows = chunk(m)
            x = gemm_rand((rows, k), dtype, 90 + m)
            w_up = gemm_rand((n_up, k), dtype, 91, scale=k ** -0.5)
            w_down = gemm_rand((n_down, n_up), dtype, 92, scale=(n_up * world()) ** -0.5)
            poison(((m, n_up), dtype), ((m, k), dtype), ((rows, n_down), dtype), ((m, n_down), dtype))
            y, z, g = f(x, w_up, w_down, m)
            a = gather_rows_fp64(x, m)
            assert torch.equal(g.double(), a), f"compiled ag_gemm gathered {dtype} m={m}"
            h_ref = (a @ w_up.double().T).to(dtype)  # the eager op's output as the layer's next input
            h_ref = torch.nn.functional.gelu(h_ref.float()).to(dtype).double()
            full = sum_fp64(h_ref @ w_down.double().T)
            what = f"compiled layer {dtype} m={m}"
            torch.testing.assert_close(y.double(), full[begin:begin + rows] * 2, rtol=4 * GEMM_TOL[dtype],
                                       atol=4 * GEMM_TOL[dtype], msg=lambda msg_: f"{what} gemm_rs: {msg_}")
            torch.testing.assert_close(z.double(), full, rtol=4 * GEMM_TOL[dtype], atol=4 * GEMM_TOL[dtype],
                                       msg=lambda msg_: f"{what} gemm_ar: {msg_}")


def test_gemm_cuda_graph():
    for dtype in GEMM_DTYPES:
        for method in ("auto", "fused", "chunked", "baseline"):
            m, n, k = 2 * 389 + world() - 1, 136, 264
            begin, rows = chunk(m)
            x_ag, w_ag = gemm_inputs("ag_gemm", m, n, k, dtype, 300)
            x_rs, w_rs = gemm_inputs("gemm_rs", m, n, k, dtype, 310)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm-up outside the capture: creates / grows the contexts
                tdist.ag_gemm(x_ag, w_ag, m=m, method=method, return_gathered=True)
                tdist.gemm_rs(x_rs, w_rs, method=method)
                tdist.gemm_ar(x_rs, w_rs, method=method)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                d_ag, g_ag = tdist.ag_gemm(x_ag, w_ag, m=m, method=method, return_gathered=True)
                d_rs = tdist.gemm_rs(x_rs, w_rs, method=method)
                d_ar = tdist.gemm_ar(x_rs, w_rs, method=method)
            for replay in range(3):
                x_ag.copy_(gemm_inputs("ag_gemm", m, n, k, dtype, 400 + replay)[0])
                x_rs.copy_(gemm_inputs("gemm_rs", m, n, k, dtype, 500 + replay)[0])
                for out in (d_ag, g_ag, d_rs, d_ar):
                    out.fill_(float("nan"))
                graph.replay()
                what = f"graph {dtype} {method} m={m} replay {replay}"
                check_gemm("ag_gemm", (d_ag, g_ag), x_ag, w_ag, m, dtype, what + " ag_gemm")
                check_gemm("gemm_rs", d_rs, x_rs, w_rs, m, dtype, what + " gemm_rs")
                check_gemm("gemm_ar", d_ar, x_rs, w_rs, m, dtype, what + " gemm_ar")
            torch.cuda.synchronize()
            del graph


def test_gemm_capture_without_warmup_is_refused():
    # K = 8 * 97 has no context yet: the call inside the capture would have to create one.
    dtype = torch.bfloat16
    x, w = gemm_inputs("ag_gemm", 4 * world(), 16, 776, dtype, 600)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            tdist.ag_gemm(x, w)
    except tdist.Error as e:
        for fragment in ("tdist.ag_gemm", "capturing a CUDA graph", "warm-up"):
            assert fragment in str(e), f"'{fragment}' not in '{e}'"
    else:
        raise AssertionError("a context was created during a CUDA graph capture")
    del graph
    torch.cuda.synchronize()
    d = tdist.ag_gemm(x, w)  # after the capture: created normally
    torch.testing.assert_close(d.double(), gemm_reference("ag_gemm", x, w, 4 * world())[0], rtol=GEMM_TOL[dtype],
                               atol=GEMM_TOL[dtype])


def test_gemm_argument_errors():
    bf = torch.bfloat16
    x = torch.zeros(8, 64, device="cuda", dtype=bf)
    w = torch.zeros(24, 64, device="cuda", dtype=bf)
    expect_error(lambda: tdist.gemm_rs(x.float(), w.float()), "tdist.gemm_rs", "'a' has dtype float32")
    expect_error(lambda: tdist.gemm_rs(x, w.half()), "'b' has dtype float16 but 'a' has bfloat16")
    expect_error(lambda: tdist.gemm_ar(x.cpu(), w), "'a' must be a CUDA tensor")
    expect_error(lambda: tdist.gemm_ar(torch.zeros(64, 8, device="cuda", dtype=bf).t(), w), "'a' must be contiguous")
    expect_error(lambda: tdist.gemm_ar(x, torch.zeros(24, 56, device="cuda", dtype=bf)), "both are K")
    expect_error(lambda: tdist.gemm_ar(x, torch.zeros(20, 64, device="cuda", dtype=bf)), "multiple of 8, got 20")
    expect_error(lambda: tdist.gemm_ar(torch.zeros(8, 60, device="cuda", dtype=bf),
                                       torch.zeros(24, 60, device="cuda", dtype=bf)), "multiple of 8, got 60")
    expect_error(lambda: tdist.gemm_ar(torch.zeros(2, 8, 64, device="cuda", dtype=bf), w), "'a' must be 2-D")
    unaligned = torch.zeros(8 * 64 + 4, device="cuda", dtype=bf)[4:].view(8, 64)
    expect_error(lambda: tdist.gemm_ar(unaligned, w), "16-byte aligned")
    expect_error(lambda: tdist.gemm_ar(x, w, method="fastest"), "method must be one of")
    # every rank must refuse (a rank that accepted would wait in the collective): 9 rows each, not 8
    expect_error(lambda: tdist.ag_gemm(x, w, m=9 * world()), "'a_local' has 8 rows", "pass m=")
    expect_error(lambda: tdist.ag_gemm(x, w, m=2.5), "m must be None or an int")
    expect_error(lambda: tdist.ag_gemm([1], w), "'a_local' must be a torch.Tensor")
    if torch.cuda.device_count() > 1:
        other = (tdist.get_device() + 1) % torch.cuda.device_count()
        expect_error(lambda: tdist.gemm_ar(x.to(f"cuda:{other}"), w.to(f"cuda:{other}")), f"is on cuda:{other}")
        expect_error(lambda: tdist.gemm_ar(x, w.to(f"cuda:{other}")), "same device")
    # m = 0: an empty result, no context, no communication
    d = tdist.ag_gemm(x[:0], w, m=0)
    assert d.shape == (0, 24)
    assert tdist.gemm_ar(x[:0], w).shape == (0, 24)


def test_eager_path_skips_only_what_it_may():
    """Plain eager calls skip the dispatcher (python/tdist/_torch_ops.py, "the eager path") and the
    Python checks of a signature seen before; what depends on the tensors themselves is still
    checked on every call, and every other context goes through torch.ops.tdist.*."""
    bf = torch.bfloat16
    m, n, k = 8 * world(), 24, 64
    x, w = gemm_inputs("gemm_ar", m, n, k, bf, 4242)
    assert _torch_ops.eager(x, w)
    eager = tdist.gemm_ar(x, w, method="baseline")  # the signature is now known
    dispatched = torch.ops.tdist.gemm_ar.default(x, w, "baseline")
    assert torch.equal(eager, dispatched), "the eager path and the registered op disagree"
    check_gemm("gemm_ar", eager, x, w, m, bf, "gemm_ar eager path")
    # the same shapes, dtypes and devices, so the Python checks are skipped: the C++ checks still refuse
    strided = torch.zeros(k, m, device="cuda", dtype=bf).t()
    expect_error(lambda: tdist.gemm_ar(strided, w, method="baseline"), "'a' must be contiguous")
    unaligned = torch.zeros(m * k + 4, device="cuda", dtype=bf)[4:].view(m, k)
    expect_error(lambda: tdist.gemm_ar(unaligned, w, method="baseline"), "16-byte aligned")
    expect_error(lambda: tdist.gemm_ar(x, w.half(), method="baseline"), "'b' has dtype float16 but 'a' has bfloat16")
    # contexts that must see the registered op
    wg = w.clone().requires_grad_(True)
    assert not _torch_ops.eager(x, wg), "an input needing a gradient must go through autograd"
    with torch.no_grad():
        assert _torch_ops.eager(x, wg)
    assert _torch_ops.eager(x, torch.nn.Parameter(w, requires_grad=False)), "a frozen weight takes the eager path"
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        assert not _torch_ops.eager(fx, fw)
        assert tdist.gemm_ar(fx, fw).shape == (m, n)  # the fake implementation
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert not _torch_ops.eager(x, w)
        tdist.gemm_ar(x, w, method="baseline")
        torch.cuda.synchronize()
    assert any("tdist::gemm_ar" in e.key for e in prof.key_averages()), "the profiler must see the op"
    # collectives take the same path
    t = rand(1001, bf, 77)
    want = gathered_fp64(t).sum(0)
    got = tdist.all_reduce(t.clone())
    check_close(got, want, bf, "all_reduce eager path")
    # an in-place call on a tensor autograd saved (it needs no gradient itself, so the eager path
    # runs) bumps its version: backward refuses instead of using the summed values
    saved, scale = t.float(), torch.ones(1001, device="cuda", requires_grad=True)
    y = (saved * scale).sum()
    assert _torch_ops.eager(saved)
    tdist.all_reduce(saved)
    expect_error(y.backward, "modified by an inplace operation", cls=RuntimeError)


TESTS = [test_all_reduce_eager, test_all_gather_eager, test_reduce_scatter_eager, test_barrier_orders_streams,
         test_other_stream, test_torch_compile_fullgraph, test_cuda_graph_capture, test_empty_and_peer,
         test_jit_launch_on_tensors, test_argument_errors_on_gpu, test_gemm_eager, test_gemm_contexts_grow,
         test_gemm_torch_compile, test_gemm_cuda_graph, test_gemm_capture_without_warmup_is_refused,
         test_gemm_argument_errors, test_catalogue_op_swiglu, test_eager_path_skips_only_what_it_may,
         test_finalize_and_reinit_as_context_manager]


# pytest: one init for the module
_tdist_session = pytest_session()


def main():
    return run_tests(TESTS)


if __name__ == "__main__":
    sys.exit(main())
