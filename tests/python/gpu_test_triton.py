"""GPU tests of tdist.triton (torchrun, 2 or more ranks): every primitive against expected data at both
scopes (32- and 64-bit flags, every comparison kind the tests name, local and remote notify), a wait that must time out with the diagnostic (in a subprocess, once per action: abort, the
default, records the fault and returns; trap kills the context),
200 back-to-back calls without host work, and a Triton kernel and a C++ (tdist.jit) kernel exchanging
data and flags on one symmetric buffer.

    python -m torch.distributed.run --nproc-per-node 2 tests/python/gpu_test_triton.py
"""

import os
import re
import socket
import subprocess
import sys

import gpu_harness as h
from gpu_harness import rank, world

import tdist
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import tdist.triton
import tdist.triton.language as tdl

kPoison = -7777.0


def fresh(shape, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(1234 + 97 * seed + rank())
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def expected_from(r, shape, seed=0):
    g = torch.Generator(device="cuda").manual_seed(1234 + 97 * seed + r)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32)


# --- kernels ---------------------------------------------------------------------------------------

@tdist.triton.kernel
@triton.jit
def k_identity(heap, out, buf, n, BLOCK: tl.constexpr):
    # out[0] = rank, out[1] = world, out[2 + i] = next rank's buf[i], through symm_at.
    me = tdl.rank(heap)
    world = tdl.num_ranks(heap)
    tl.store(out, me.to(tl.float32))
    tl.store(out + 1, world.to(tl.float32))
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    vals = tdl.get_tile(heap, buf + offs, (me + 1) % world, mask=mask, other=0.0)
    tl.store(out + 2 + offs, vals, mask=mask)


@tdist.triton.kernel
@triton.jit
def k_ring_put_signal(heap, send, recv, out, flag, n, epoch, BLOCK: tl.constexpr):
    # Puts `send` into the next rank's `recv`, raises its flag to `epoch`, waits for the previous rank's
    # data, copies it to `out` through a load that depends on the wait.
    me = tdl.rank(heap)
    world = tdl.num_ranks(heap)
    tdl.put_signal(heap, recv, send, n, flag, epoch, (me + 1) % world, BLOCK)
    seen = tdl.wait(heap, flag, epoch)
    src = tdl.consume_token(recv, seen)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out + offs, tl.load(src + offs, mask=mask), mask=mask)


@tdist.triton.kernel
@triton.jit
def k_all_add(heap, recv, send, out, counter, n, expected, BLOCK: tl.constexpr):
    # Every rank puts its row into recv[me] of every peer, then adds 1 to each peer's counter; waits until
    # all world ranks have added (counter >= expected), then copies recv to out.
    me = tdl.rank(heap)
    world = tdl.num_ranks(heap)
    for p in range(0, world):
        tdl.put(heap, recv + me * n, send, n, p, BLOCK)
        tdl.signal_op(heap, counter, 1, p, "add")
    seen = tdl.wait(heap, counter, expected)
    src = tdl.consume_token(recv, seen)
    for start in range(0, world * n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < world * n
        tl.store(out + offs, tl.load(src + offs, mask=mask), mask=mask)


@tdist.triton.kernel
@triton.jit
def k_many_flags(heap, recv, send, out, flags, n, epoch, MAX_WORLD: tl.constexpr, BLOCK: tl.constexpr):
    # Rank r puts its row into recv[r] of every peer and sets flags[r] there; the receiver waits for all
    # flags at once (a block of flags: `wait` on many).
    me = tdl.rank(heap)
    world = tdl.num_ranks(heap)
    for p in range(0, world):
        tdl.put_signal(heap, recv + me * n, send, n, flags + me, epoch, p, BLOCK)
    idx = tl.arange(0, MAX_WORLD)
    seen = tdl.wait(heap, flags + tl.where(idx < world, idx, 0), epoch)
    src = tdl.consume_token(recv, seen)
    for start in range(0, world * n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < world * n
        tl.store(out + offs, tl.load(src + offs, mask=mask), mask=mask)


@tdist.triton.kernel
@triton.jit
def k_local_scope(heap, data, out, flag, n, epoch, SCOPE: tl.constexpr, BLOCK: tl.constexpr):
    # Two programs of one GPU: program 1 writes data and raises the flag (release at SCOPE); program 0
    # waits for it (acquire at SCOPE) and copies the data. Both programs are resident (grid of 2).
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    if tl.program_id(0) == 1:
        tl.store(data + offs, offs.to(tl.float32) * 0.5 + epoch, mask=mask)
        tdl.fence(SCOPE)
        tdl.notify(flag, epoch, SCOPE)
    else:
        seen = tdl.wait(heap, flag, epoch, SCOPE)
        tl.store(out + offs, tl.load(tdl.consume_token(data + offs, seen), mask=mask), mask=mask)


@tdist.triton.kernel
@triton.jit
def k_flag_kinds(heap, data, out, flag32, down32, counter, probe, n, epoch, BLOCK: tl.constexpr):
    # Two programs of one GPU, as k_local_scope: program 1 writes data, adds 1 to a 64-bit counter, sets
    # a 32-bit count-down flag to 0 and a 32-bit flag to the epoch (each a release at gpu scope);
    # program 0 waits for the epoch with 'eq', reads the counter with ld_acquire and ld_relaxed, waits
    # on it again with every thread (wait_each_thread, 'ge') and on the count-down with 'lt'.
    tdl.wait_diagnostics(heap)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    if tl.program_id(0) == 1:
        tl.store(data + offs, offs.to(tl.float32) * 0.25 + epoch, mask=mask)
        tdl.notify(counter, 1, "gpu", "add")
        tdl.notify(down32, 0, "gpu")
        tdl.notify(flag32, epoch, "gpu")
    else:
        seen = tdl.wait(heap, flag32, epoch, "gpu", "eq")
        tl.store(probe, tdl.ld_acquire(counter, "gpu"))
        tl.store(probe + 1, tdl.ld_relaxed(counter, "gpu"))
        tl.store(probe + 2, tdl.wait_each_thread(heap, counter, epoch, "gpu"))
        below = tdl.wait(heap, down32, 1, "gpu", "lt")
        tl.store(probe + 3, below.to(tl.int64))
        tl.store(out + offs, tl.load(tdl.consume_token(data + offs, seen), mask=mask), mask=mask)


@tdist.triton.kernel
@triton.jit
def k_get(heap, dst, src, n, BLOCK: tl.constexpr):
    me = tdl.rank(heap)
    tdl.get(heap, dst, src, n, (me + 1) % tdl.num_ranks(heap), BLOCK)


@tdist.triton.kernel
@triton.jit
def k_grid_barrier(heap, recv, send, out, pad, n, BLOCK: tl.constexpr):
    # Each program puts its chunk of `send` into the next rank's `recv` with plain stores, then quiet and
    # a grid barrier across ranks; after it, each program reads its chunk of its own `recv`.
    me = tdl.rank(heap)
    world = tdl.num_ranks(heap)
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tdl.put_tile(heap, recv + offs, tl.load(send + offs, mask=mask), (me + 1) % world, mask=mask)
    tdl.quiet()
    tdl.barrier_all_grid(heap, pad)
    tl.store(out + offs, tl.load(recv + offs, mask=mask), mask=mask)


@tdist.triton.kernel
@triton.jit
def k_block_barrier(heap, counter, pad, out):
    # One program per rank: increments its own counter, barrier, then reads the next rank's counter.
    me = tdl.rank(heap)
    world = tdl.num_ranks(heap)
    tl.store(counter, tl.load(counter) + 1)
    tdl.barrier_all(heap, pad)
    tl.store(out, tdl.get_tile(heap, counter, (me + 1) % world))


@tdist.triton.kernel
@triton.jit
def k_wait_forever(heap, flag):
    tdl.wait(heap, flag, 1)


# --- tests -----------------------------------------------------------------------------------------

def test_rank_world_symm_at():
    tdist.triton.heap_view()  # collective on first use: every rank makes the anchor now
    n = 1000
    buf = tdist.empty((n,), torch.float32)
    buf.copy_(fresh(n, seed=1))
    out = torch.full((n + 2,), kPoison, device="cuda")
    dist.barrier()
    torch.cuda.synchronize()
    dist.barrier()
    k_identity[(1,)](out, buf, n, BLOCK=1024)
    torch.cuda.synchronize()
    assert out[0].item() == rank() and out[1].item() == world()
    torch.testing.assert_close(out[2:], expected_from((rank() + 1) % world(), n, seed=1), rtol=0, atol=0)
    dist.barrier()
    tdist.free(buf)


def test_ring_put_signal_wait_sys():
    for n in (1, 777, 4096 + 3):
        send = tdist.empty((n,), torch.float32)
        recv = tdist.empty((n,), torch.float32)
        flag = tdist.empty((1,), torch.int64)
        send.copy_(fresh(n, seed=n))
        recv.fill_(kPoison)
        out = torch.full((n,), kPoison, device="cuda")
        torch.cuda.synchronize()
        dist.barrier()
        k_ring_put_signal[(1,)](send, recv, out, flag, n, 1, BLOCK=512)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, expected_from((rank() - 1) % world(), n, seed=n), rtol=0, atol=0)
        assert flag.item() == 1
        dist.barrier()
        for t in (send, recv, flag):
            tdist.free(t)


def test_signal_add_and_put():
    n = 333
    send = tdist.empty((n,), torch.float32)
    recv = tdist.empty((world(), n), torch.float32)
    counter = tdist.empty((1,), torch.int64)
    send.copy_(fresh(n, seed=5))
    recv.fill_(kPoison)
    torch.cuda.synchronize()
    dist.barrier()
    for call in range(1, 4):  # the counter grows by world per call: epochs, never reset
        out = torch.full((world(), n), kPoison, device="cuda")
        k_all_add[(1,)](recv, send, out, counter, n, call * world(), BLOCK=256)
        torch.cuda.synchronize()
        for r in range(world()):
            torch.testing.assert_close(out[r], expected_from(r, n, seed=5), rtol=0, atol=0)
        dist.barrier()  # the next call's puts must not overwrite rows a peer still copies
    assert counter.item() == 3 * world()
    for t in (send, recv, counter):
        tdist.free(t)


def test_wait_on_many_flags():
    n = 129
    send = tdist.empty((n,), torch.float32)
    recv = tdist.empty((world(), n), torch.float32)
    flags = tdist.empty((world(),), torch.int64)
    send.copy_(fresh(n, seed=9))
    recv.fill_(kPoison)
    out = torch.full((world(), n), kPoison, device="cuda")
    torch.cuda.synchronize()
    dist.barrier()
    k_many_flags[(1,)](recv, send, out, flags, n, 7, MAX_WORLD=triton.next_power_of_2(world()), BLOCK=128)
    torch.cuda.synchronize()
    for r in range(world()):
        torch.testing.assert_close(out[r], expected_from(r, n, seed=9), rtol=0, atol=0)
    assert flags.tolist() == [7] * world()
    dist.barrier()
    for t in (send, recv, flags):
        tdist.free(t)


def test_notify_wait_both_scopes_on_one_gpu():
    n = 100
    for scope in ("gpu", "sys"):
        data = torch.full((n,), kPoison, device="cuda")
        flag = torch.zeros(1, dtype=torch.int64, device="cuda")
        for epoch in (1, 2, 3):
            out = torch.full((n,), kPoison, device="cuda")
            k_local_scope[(2,)](data, out, flag, n, epoch, SCOPE=scope, BLOCK=128)
            torch.cuda.synchronize()
            ref = torch.arange(n, device="cuda", dtype=torch.float32) * 0.5 + epoch
            torch.testing.assert_close(out, ref, rtol=0, atol=0)
            assert flag.item() == epoch


def test_flag_widths_comparisons_and_loads_on_one_gpu():
    # 32-bit flags, 'eq' and 'lt', a local 'add' notify, ld_acquire / ld_relaxed and wait_each_thread,
    # which the other tests leave out.
    n = 300
    data = torch.full((n,), kPoison, device="cuda")
    flag32 = torch.zeros(1, dtype=torch.int32, device="cuda")
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    for epoch in (1, 2, 3, 4):
        down32 = torch.full((1,), 5, dtype=torch.int32, device="cuda")
        out = torch.full((n,), kPoison, device="cuda")
        probe = torch.full((4,), -1, dtype=torch.int64, device="cuda")
        k_flag_kinds[(2,)](data, out, flag32, down32, counter, probe, n, epoch, BLOCK=512)
        torch.cuda.synchronize()
        ref = torch.arange(n, device="cuda", dtype=torch.float32) * 0.25 + epoch
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        assert probe.tolist() == [epoch, epoch, epoch, 0], (epoch, probe.tolist())
        assert flag32.item() == epoch and counter.item() == epoch and down32.item() == 0


def test_get():
    n = 5000 + 11
    src = tdist.empty((n,), torch.float32)
    src.copy_(fresh(n, seed=11))
    dst = torch.full((n,), kPoison, device="cuda")
    torch.cuda.synchronize()
    dist.barrier()
    k_get[(1,)](dst, src, n, BLOCK=1024)
    torch.cuda.synchronize()
    torch.testing.assert_close(dst, expected_from((rank() + 1) % world(), n, seed=11), rtol=0, atol=0)
    dist.barrier()
    tdist.free(src)


def test_barriers():
    n = 8 * 1024 + 5
    block = 1024
    programs = triton.cdiv(n, block)  # 9 programs: all resident on any GPU
    send = tdist.empty((n,), torch.float32)
    recv = tdist.empty((n,), torch.float32)
    pad = tdist.triton.barrier_pad(2)
    counter = tdist.empty((1,), torch.int64)
    torch.cuda.synchronize()
    dist.barrier()
    for call in range(3):  # the pads are reused: epochs, nothing reset
        send.copy_(fresh(n, seed=20 + call))
        recv.fill_(kPoison)
        out = torch.full((n,), kPoison, device="cuda")
        torch.cuda.synchronize()
        dist.barrier()
        k_grid_barrier[(programs,)](recv, send, out, pad[0], n, BLOCK=block)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, expected_from((rank() - 1) % world(), n, seed=20 + call), rtol=0, atol=0)
        one = torch.full((1,), -1, dtype=torch.int64, device="cuda")
        k_block_barrier[(1,)](counter, pad[1], one)
        torch.cuda.synchronize()
        assert one.item() == call + 1, (one.item(), call + 1)
        dist.barrier()
    for t in (send, recv, pad, counter):
        tdist.free(t)


def test_200_back_to_back_calls():
    n, calls = 1023, 200
    send = tdist.empty((calls, n), torch.float32)
    recv = tdist.empty((calls, n), torch.float32)
    flag = tdist.empty((calls,), torch.int64)
    send.copy_(fresh((calls, n), seed=30))
    recv.fill_(kPoison)
    out = torch.full((calls, n), kPoison, device="cuda")
    torch.cuda.synchronize()
    dist.barrier()
    for i in range(calls):  # no host synchronisation between calls: flags carry the order
        k_ring_put_signal[(1,)](send[i], recv[i], out[i], flag[i:], n, i + 1, BLOCK=512)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected_from((rank() - 1) % world(), (calls, n), seed=30), rtol=0, atol=0)
    assert flag.tolist() == list(range(1, calls + 1))
    dist.barrier()
    for t in (send, recv, flag):
        tdist.free(t)


_TIMEOUT_CHILD = r"""
import ctypes, os, sys, time
import tdist, torch, triton, triton.language as tl
import tdist.triton, tdist.triton.language as tdl

@tdist.triton.kernel
@triton.jit
def k_wait_forever(heap, flag):
    tdl.wait(heap, flag, 1)

@tdist.triton.kernel
@triton.jit
def k_wait_many_forever(heap, flags):
    tdl.wait(heap, flags + tl.arange(0, 4), 1)  # a block of flags: every thread spins

def out(*args):
    print(*args, flush=True)
    ctypes.CDLL(None).fflush(None)  # the device printf goes through C stdio, buffered on a pipe

tdist.init(heap_size="64M")
flag = tdist.empty((4,), torch.int64)
flag.zero_()
torch.cuda.synchronize()
out("flag address", hex(flag.data_ptr()))
try:
    k_wait_forever[(1,)](flag)
    torch.cuda.synchronize()
    out("the wait returned")
except Exception as e:
    out("kernel failed:", type(e).__name__, e)
    os._exit(3)  # the context is unusable (trap): skip every teardown
try:
    tdist.check_device_faults()
    out("no fault recorded")
except tdist.DeviceTimeoutError as e:
    out("device fault:", e)
try:
    k_wait_forever[(1,)](flag)
    out("launched after the fault")
except tdist.DeviceTimeoutError:
    out("launch refused after the fault")
# Followers: with the fault recorded, waits with a 300 s timeout give up at their first clock check.
view = tdist.triton.heap_view(timeout=300.0)
start = time.monotonic()
k_wait_forever.fn[(8,)](view.tensor, flag)
k_wait_many_forever.fn[(8,)](view.tensor, flag)
torch.cuda.synchronize()
out(f"followers returned after {time.monotonic() - start:.1f} s")
out("context usable:", int(torch.arange(10, device="cuda").sum().item()))
os._exit(0)
"""


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_timeout_child(action):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC", "MASTER_", "GROUP_", "ROLE_", "LOCAL_WORLD", "TORCH_NCCL"))}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    device = torch.cuda.current_device()
    device = visible.split(",")[device] if visible else str(device)
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", TDIST_WAIT_TIMEOUT_S="0.5",
               TDIST_WAIT_TIMEOUT_ACTION=action, CUDA_VISIBLE_DEVICES=device, MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"_triton_timeout_child_{action}.py")
    with open(path, "w") as f:  # triton.jit needs its kernels in a file
        f.write(_TIMEOUT_CHILD)
    try:
        proc = subprocess.run([sys.executable, path], capture_output=True, text=True, env=env, timeout=240)
    finally:
        os.unlink(path)
    text = proc.stdout + proc.stderr
    addr = next((int(line.split()[-1], 16) for line in text.splitlines() if line.startswith("flag address")), None)
    assert addr is not None, text
    return proc.returncode, text, addr


def _diagnostic(text, suffix):
    return re.search(r"tdist: wait timed out after 0\.5 s: rank 0, block \(0,0,0\), thread \(0,0,0\), "
                     r"address (?:0x)?([0-9a-fA-F]+), waiting for value >= 1, seen 0" + re.escape(suffix) + "\n", text)


def test_wait_times_out_and_aborts():
    # The default action: the wait records the fault and returns; the process survives, the host raises
    # tdist.DeviceTimeoutError, later launches are refused, every later wait gives up at once.
    if rank() != 0:
        return
    code, text, addr = _run_timeout_child("abort")
    assert code == 0, text
    assert "the wait returned" in text, text
    m = _diagnostic(text, "; aborting this process's waits")
    assert m and int(m.group(1), 16) == addr, (hex(addr), text)
    assert len(re.findall(r"tdist: wait timed out", text)) == 1, text  # only the first wait reports
    fault = re.search(r"device fault: (.*)", text)
    assert fault, text
    assert "rank 0: a user kernel's wait in block (0,0,0), thread (0,0,0)" in fault.group(1), fault.group(1)
    # the flag lies in a tdist.empty tensor: the message names it
    assert (f"waited at address {hex(addr)} (a symmetric tensor (tdist.empty)) for a value >= 1 and saw 0"
            in fault.group(1)), fault.group(1)
    assert "launch refused after the fault" in text, text
    follow = re.search(r"followers returned after ([0-9.]+) s", text)
    assert follow and float(follow.group(1)) < 60.0, text
    assert "context usable: 45" in text, text


def test_wait_times_out_and_traps():
    # TDIST_WAIT_TIMEOUT_ACTION=trap: the diagnostic without the abort suffix, then the kernel traps.
    if rank() != 0:
        return
    code, text, addr = _run_timeout_child("trap")
    assert code == 3, text
    assert "the wait returned" not in text, text
    m = _diagnostic(text, "")
    assert m and int(m.group(1), 16) == addr, (hex(addr), text)


_CPP_PONG = r"""
#include <tdist/device.cuh>
using namespace tdist::device;
// Waits for `flag` >= epoch (Triton's signal), adds 1 to each of n floats of `in`, puts them into the
// peer's `out` (peer_out, a translated address) and raises the peer's flag (peer_flag) to epoch.
extern "C" __global__ void cpp_pong(const u64* flag, const float* in, float* peer_out, u64* peer_flag, u64 epoch,
                                    int n) {
  wait_block(flag, 1, epoch);
  for (int i = threadIdx.x; i < n; i += blockDim.x) peer_out[i] = in[i] + 1.0f;
  __syncthreads();
  if (threadIdx.x == 0) notify(peer_flag, epoch);
}
"""


@tdist.triton.kernel
@triton.jit
def k_ping(heap, send, recv_peer, flag, n, epoch, BLOCK: tl.constexpr):
    # Triton side: put `send` into rank 1's recv buffer, raise rank 1's flag, wait for the C++ reply.
    tdl.put_signal(heap, recv_peer, send, n, flag, epoch, 1, BLOCK)
    tdl.wait(heap, flag, epoch)


def test_triton_and_cpp_kernels_share_flags():
    if world() < 2:
        print("test_triton_and_cpp_kernels_share_flags: needs two ranks, skipped")
        return
    n = 2049
    send = tdist.empty((n,), torch.float32)
    recv = tdist.empty((n,), torch.float32)  # rank 1 receives here; rank 0 gets the reply here
    flag = tdist.empty((1,), torch.int64)
    send.copy_(fresh(n, seed=40))
    recv.fill_(kPoison)
    torch.cuda.synchronize()
    dist.barrier()
    for epoch in (1, 2):
        if rank() == 0:
            k_ping[(1,)](send, recv, flag, n, epoch, BLOCK=512)
        elif rank() == 1:
            mod = tdist.jit.compile(_CPP_PONG, file_name="cpp_pong.cu")
            k = mod.kernel("cpp_pong", signature="const u64*, const float*, float*, u64*, u64, int")
            k(flag, recv, tdist.peer(recv, 0), tdist.peer(flag, 0), epoch, n, grid=1, block=256)
        torch.cuda.synchronize()
        if rank() == 0:
            torch.testing.assert_close(recv, expected_from(0, n, seed=40) + 1.0, rtol=0, atol=0)
            assert flag.item() == epoch
        dist.barrier()
        recv.fill_(kPoison)
        torch.cuda.synchronize()
        dist.barrier()
    for t in (send, recv, flag):
        tdist.free(t)


def _gathered(t):
    parts = [torch.empty_like(t) for _ in range(world())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _a_through_tma(x, w):
    # The path ag_gemm takes for A (its gathered buffer, from tdist.empty, is always 16-byte aligned: x stands
    # in for it).
    from tdist.triton import gemm

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = gemm._ag_gemm_config(world() * x.shape[0], w.shape[0], num_sms)
    x = x.contiguous()
    return gemm._ag_operand_paths(x, w, x, cfg)[0]


def test_ag_gemm_against_float64():
    # Odd shapes (rows not a multiple of the tile or the chunk, K not a multiple of BLOCK_K); fewer rows per
    # rank than a tile with many tiles (every tile waits: more waiting tiles than SMs would hang a push
    # that needs free SMs); large shapes that take the 128 x 256 tiles, pipelined (K a multiple of 64).
    # K = 97: rows not 16-byte aligned, so the weight is read through pointers rather than TMA.
    # A through TMA (rows per rank a multiple of the tile): 64-row tiles with a chunk and a half per rank
    # and K = 520 (TMA zero-fills the last K block), N = 1000 (the TMA store clips the last column block);
    # 64-row tiles, every tile of a peer waiting; 128-row tiles with N = 2053 (rows not 16-byte aligned:
    # the output through pointer stores); the large tiles over the full K = 8192.
    shapes = ((1, 33, 64), (77, 333, 200), (45, 130, 97), (33, 8192, 256), (300, 1000, 1024), (1027, 2053, 520),
              (3000, 2304, 512), (192, 1000, 520), (128, 8192, 256), (1024, 2053, 520), (1024, 3584, 8192))
    paths = set()
    for m_local, n, k in shapes:
        x = (fresh((m_local, k), seed=m_local) / k ** 0.5).to(torch.bfloat16)
        w = fresh((n, k), seed=n + 1).to(torch.bfloat16)
        paths.add(_a_through_tma(x, w))
        out = tdist.triton.ag_gemm(x, w)
        torch.cuda.synchronize()
        ref = torch.cat([p.double() for p in _gathered(x)]) @ w.double().T
        assert out.shape == (world() * m_local, n) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    assert paths == {True, False}, f"A's paths covered (True: TMA): {paths}"
    h.expect_error(lambda: tdist.triton.ag_gemm(x, w[:, :-1]), "'w' must be (N, K)")
    h.expect_error(lambda: tdist.triton.ag_gemm(x.float(), w), "'x' must be bfloat16 or float16")


def test_ag_gemm_views():
    # x a row slice (its offset from the gathered buffer not a multiple of 16 elements), w a column slice
    # (rows longer than K) and w offset by one element (not 16-byte aligned: pointer loads, not TMA).
    m_local, n, k = 70, 300, 200
    xs = (fresh((m_local + 1, k), seed=61) / k ** 0.5).to(torch.bfloat16)
    wide = fresh((n + 1, k + 24), seed=62).to(torch.bfloat16)
    x = xs[1:]
    for w in (wide[:n, :k], wide.view(-1)[1:1 + n * k].view(n, k)):
        out = tdist.triton.ag_gemm(x, w)
        torch.cuda.synchronize()
        ref = torch.cat([p.double() for p in _gathered(x)]) @ w.double().T
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    # Rows per rank a multiple of the tile: x a row slice starting one row in (16-byte aligned: A's TMA
    # descriptor on x's own base), then x offset by one element (not aligned: A by pointers).
    m_local, n, k = 128, 520, 256
    flat = (fresh(((m_local + 1) * k + 1,), seed=63) / k ** 0.5).to(torch.bfloat16)
    w = fresh((n, k), seed=64).to(torch.bfloat16)
    for x, via_tma in ((flat[:(m_local + 1) * k].view(m_local + 1, k)[1:], True),
                       (flat[1:1 + m_local * k].view(m_local, k), False)):
        assert _a_through_tma(x, w) == via_tma
        out = tdist.triton.ag_gemm(x, w)
        torch.cuda.synchronize()
        ref = torch.cat([p.double() for p in _gathered(x)]) @ w.double().T
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def test_ag_gemm_back_to_back():
    # A by pointers (130 rows per rank), then through TMA (256): each call's flags are one epoch further.
    for m_local, n, k, calls in ((130, 257, 256, 20), (256, 520, 512, 20)):
        xs = [(fresh((m_local, k), seed=100 + i) / k ** 0.5).to(torch.bfloat16) for i in range(calls)]
        w = fresh((n, k), seed=99).to(torch.bfloat16)
        assert _a_through_tma(xs[0], w) == (m_local == 256)
        outs = [tdist.triton.ag_gemm(x, w) for x in xs]  # no host synchronisation between calls
        torch.cuda.synchronize()
        for x, out in zip(xs, outs):
            ref = torch.cat([p.double() for p in _gathered(x)]) @ w.double().T
            torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def _ag_config(x, w):
    from tdist.triton import gemm

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    return gemm._ag_gemm_config(world() * x.shape[0], w.shape[0], num_sms)


def _poison_pool(shape, count):
    # ag_gemm allocates its output: fill `count` blocks of the output's size with poison and free them, so
    # that torch's caching allocator hands those blocks back to the next outputs of that size; a cell the
    # kernel never writes then reads -7777 instead of whatever happened to be there.
    blocks = [torch.full(shape, kPoison, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
    del blocks


def test_ag_gemm_tile_schedule():
    # The persistent schedule over several waves of tiles, the last wave partial (the tile and K loops
    # fused where A goes through TMA, and on one rank always: one tile's epilogue runs beside the next
    # tile's loads; with several ranks the pushing programs take the last tile of each wave), on the
    # large tiles:
    # A through TMA with K = 520 (the last K block zero-filled) and N = 2920 (the last column block 104
    # wide: its second half-tile store lies wholly past N and is clipped away); odd rows (A by pointers,
    # the output by masked stores) with N = 3400 and K = 1000 (B through TMA, the last K block masked);
    # A through TMA with N = 3000 (the last block's second half-tile partly past N).
    from tdist.triton import gemm

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m_local, n, k, via_tma in ((2304, 2920, 520, True), (4097, 3400, 1000, False), (1536, 3000, 520, True)):
        x = (fresh((m_local, k), seed=m_local + 5) / k ** 0.5).to(torch.bfloat16)
        w = fresh((n, k), seed=n + 11).to(torch.bfloat16)
        assert _ag_config(x, w) == gemm.kAgLargeConfig and _a_through_tma(x, w) == via_tma
        tiles = triton.cdiv(world() * m_local, 128) * triton.cdiv(n, 256)
        assert tiles > num_sms, (tiles, num_sms)
        _poison_pool((world() * m_local, n), 2)
        out = tdist.triton.ag_gemm(x, w)
        torch.cuda.synchronize()
        ref = torch.cat([p.double() for p in _gathered(x)]) @ w.double().T
        assert out.shape == (world() * m_local, n) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def test_ag_gemm_200_back_to_back():
    # 200 calls with no host work between them, on the large tiles with A and the output through TMA (two
    # waves of tiles, the second partial; N = 8000 not a multiple of the tile); every output kept and
    # checked, so a call that overlapped its predecessor's buffers (or, across ranks, read a chunk of the
    # wrong epoch) shows.
    m_local, n, k, calls = 128 * max(1, 8 // world()), 8000, 256, 200
    w = fresh((n, k), seed=201).to(torch.bfloat16)
    xs = [(fresh((m_local, k), seed=300 + i) / k ** 0.5).to(torch.bfloat16) for i in range(calls)]
    assert _a_through_tma(xs[0], w)
    _poison_pool((world() * m_local, n), calls)
    outs = [tdist.triton.ag_gemm(x, w) for x in xs]
    torch.cuda.synchronize()
    wt = w.double().T
    for i, (x, out) in enumerate(zip(xs, outs)):
        ref = torch.cat([p.double() for p in _gathered(x)]) @ wt
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2, msg=lambda m, i=i: f"call {i}: {m}")


def test_gemm_rs_against_float64():
    # K = 99: rows not 16-byte aligned, so both operands go through pointers rather than TMA.
    for m_local, n, k in ((1, 40, 64), (65, 333, 136), (33, 100, 99), (512, 1000, 520), (1100, 2048, 512),
                          (1024, 2048, 1024)):
        m = m_local * world()
        a = (fresh((m, k), seed=m + 3) / k ** 0.5).to(torch.bfloat16)
        b = fresh((n, k), seed=n + 7).to(torch.bfloat16)
        outs = [tdist.triton.gemm_rs(a, b) for _ in range(3)]  # back to back: the counters only grow
        torch.cuda.synchronize()
        full = sum(pa.double() @ pb.double().T for pa, pb in zip(_gathered(a), _gathered(b)))
        ref = full[rank() * m_local:(rank() + 1) * m_local]
        for out in outs:
            assert out.shape == (m_local, n) and out.dtype == torch.bfloat16
            torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2)
    if world() > 1:  # any row count divides over one rank
        h.expect_error(lambda: tdist.triton.gemm_rs(a[:m - 1], b), "must be a positive multiple of the world size")


def _tutorial(name):
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "triton")
    if folder not in sys.path:
        sys.path.insert(0, os.path.abspath(folder))
    import importlib

    return importlib.import_module(name)


def _check_tutorial(name):
    results = _tutorial(name).run()
    failed = [case for case, ok in results if not ok]
    assert results and not failed, f"{name}: failed cases {failed}"


def test_tutorial_notify_wait():
    _check_tutorial("notify_wait")


def test_tutorial_allgather():
    _check_tutorial("allgather")


def test_tutorial_all_to_all():
    _check_tutorial("all_to_all")


def test_tutorial_ag_gemm():
    _check_tutorial("ag_gemm")


TESTS = [test_rank_world_symm_at, test_ring_put_signal_wait_sys, test_signal_add_and_put, test_wait_on_many_flags,
         test_notify_wait_both_scopes_on_one_gpu, test_flag_widths_comparisons_and_loads_on_one_gpu, test_get,
         test_barriers, test_200_back_to_back_calls,
         test_wait_times_out_and_aborts, test_wait_times_out_and_traps,
         test_triton_and_cpp_kernels_share_flags,
         test_ag_gemm_against_float64, test_ag_gemm_views, test_ag_gemm_back_to_back,
         test_ag_gemm_tile_schedule, test_ag_gemm_200_back_to_back, test_gemm_rs_against_float64,
         test_tutorial_notify_wait, test_tutorial_allgather, test_tutorial_all_to_all, test_tutorial_ag_gemm]


if __name__ == "__main__":
    sys.exit(h.run_tests(TESTS))
