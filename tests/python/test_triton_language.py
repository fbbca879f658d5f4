"""CPU tests of tdist.triton (no GPU): the package imports, its primitives compile to PTX for sm_90a with
stock Triton, the PTX of wait holds the acquire load, the clock-bounded poll and the diagnostic, loads
after consume_token depend on the waited value, and bad arguments fail with a message naming them.
Skipped, with the reason printed, where Triton is not installed."""

import os
import re
import subprocess
import sys

import pytest

try:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
except ImportError as e:  # pragma: no cover - depends on the environment
    print(f"test_triton_language.py: skipped, Triton is not installed ({e}); pip install 'triton>=3.6'",
          file=sys.stderr)
    pytest.skip(f"Triton is not installed ({e})", allow_module_level=True)

import tdist
import tdist.triton
import tdist.triton.language as tdl
from tdist.triton import _asm, _launch

SM90 = GPUTarget("cuda", 90, 32)


def compile_ptx(fn, signature, constexprs=None):
    try:
        compiled = triton.compile(triton.compiler.ASTSource(fn, signature, constexprs or {}), target=SM90)
    except RuntimeError as e:  # no ptxas for this target in this Triton build
        if "ptxas" in str(e):
            print(f"skipped: Triton cannot assemble for sm_90 here ({e})", file=sys.stderr)
            pytest.skip(f"Triton cannot assemble for sm_90 here: {e}")
        raise
    return compiled.asm["ptx"]


# --- kernels compiled below ------------------------------------------------------------------------

@triton.jit
def wait_then_load(heap, flag, data, out, epoch, SCOPE: tl.constexpr):
    seen = tdl.wait(heap, flag, epoch, SCOPE)
    tl.store(out, tl.load(tdl.consume_token(data, seen)))


@triton.jit
def wait_many_then_load(heap, flags, data, out, epoch, SCOPE: tl.constexpr, CMP: tl.constexpr):
    offs = tl.arange(0, 8)
    seen = tdl.wait(heap, flags + offs, epoch, SCOPE, CMP)
    tl.store(out + offs, tl.load(tdl.consume_token(data + offs, seen)))


@triton.jit
def every_primitive(heap, flag, data, out, pad, n, epoch, SCOPE: tl.constexpr):
    me = tdl.rank(heap)
    peer = (me + 1) % tdl.num_ranks(heap)
    tdl.put(heap, data, out, n, peer, 64)
    tdl.get(heap, out, data, n, peer, 64)
    tdl.put_signal(heap, data, out, n, flag, epoch, peer, 64)
    tdl.signal_op(heap, flag, epoch, peer, "add", SCOPE)
    tdl.notify(flag, epoch, SCOPE, "set")
    offs = tl.arange(0, 16)
    tdl.put_tile(heap, data + offs, tl.load(out + offs), peer)
    tl.store(out + offs, tdl.get_tile(heap, data + offs, peer))
    tdl.fence(SCOPE)
    tdl.quiet()
    tl.store(out, tdl.ld_acquire(flag, SCOPE).to(tl.float32) + tdl.ld_relaxed(flag, SCOPE).to(tl.float32))
    tdl.barrier_all(heap, pad)
    tdl.barrier_all_grid(heap, pad)


@triton.jit
def notify_block(flag):
    tdl.notify(flag + tl.arange(0, 4), 1)


@triton.jit
def wait_bad_scope(heap, flag):
    tdl.wait(heap, flag, 1, "cta")


@triton.jit
def wait_on_floats(heap, data):
    tdl.wait(heap, data, 1)


SIG = {"heap": "*i64", "flag": "*i64", "data": "*fp32", "out": "*fp32", "epoch": "i64"}


# --- import ----------------------------------------------------------------------------------------

def test_import_without_triton_gives_a_clear_error():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import tdist\n"
            "try:\n"
            "    import tdist.triton\n"
            "except ImportError as e:\n"
            "    assert 'tdist.triton needs Triton' in str(e), e\n"
            "    print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "ok"


def test_public_names():
    for name in ("rank", "num_ranks", "symm_at", "wait", "notify", "signal_op", "consume_token", "put", "get",
                 "put_signal", "put_tile", "get_tile", "fence", "quiet", "barrier_all", "barrier_all_grid",
                 "ld_acquire", "ld_relaxed", "wait_each_thread", "wait_diagnostics"):
        assert isinstance(getattr(tdl, name), triton.JITFunction), name
    assert callable(tdist.triton.heap_view) and callable(tdist.triton.kernel)


# --- the diagnostic is the C++ one -----------------------------------------------------------------

def test_diagnostic_format_matches_the_cpp_header():
    header = os.path.join(os.path.dirname(tdist.__file__), "include", "tdist", "device", "timeout.cuh")
    if not os.path.exists(header):
        pytest.skip(f"tdist's headers are not installed next to the package ({header})")
    text = open(header).read()
    m = re.search(r'printf\(\s*((?:"[^"]*"\s*)+),', text)
    assert m, "timeout.cuh: printf of wait_timed_out not found"
    cpp = "".join(re.findall(r'"([^"]*)"', m.group(1))).replace("\\n", "\n")
    assert cpp.count("%s") == 3
    cpp = cpp.replace("%s", "wait", 1).replace("%s", ">=", 1)
    # The last %s: empty when the wait traps, the abort suffix (the C++ literal) when it records and returns.
    assert f'"{_asm.ABORT_SUFFIX}"' in text
    assert cpp.replace("%s", "") == _asm.diagnostic_format("wait", "ge")
    assert cpp.replace("%s", _asm.ABORT_SUFFIX) == _asm.diagnostic_format("wait", "ge", _asm.ABORT_SUFFIX)


def test_fault_record_layout_matches_the_cpp_header():
    header = os.path.join(os.path.dirname(tdist.__file__), "include", "tdist", "device", "timeout.cuh")
    if not os.path.exists(header):
        pytest.skip(f"tdist's headers are not installed next to the package ({header})")
    text = open(header).read()
    body = re.search(r"struct FaultRecord \{(.*?)\};", text, re.S).group(1)
    fields = re.findall(r"^\s*(u32|u64|int) (\w+)(?:\[(\d+)\])?;", body, re.M)
    offsets, at = {}, 0
    for ty, name, count in fields:
        size = 8 if ty == "u64" else 4
        at += -at % size
        offsets[name] = at
        at += size * int(count or 1)
    assert offsets == {"state": 0, "site": 4, "rank": 8, "cmp": 12, "block": 16, "thread": 28, "address": 40,
                       "expected": 48, "seen": 56, "timeout_ns": 64}, offsets
    assert re.search(r"kFaultNone = 0, kFaultClaimed = 1, kFaultRecorded = 2", text)
    sites = re.search(r"enum class WaitSite : u32 \{([^}]*)\}", text).group(1)
    assert [s.strip().split()[0] for s in sites.split(",")].index("kUser") + 1 == _asm.kWaitSiteUser
    common = open(os.path.join(os.path.dirname(header), "common.cuh")).read()
    cmps = re.search(r"enum class Cmp \{([^}]*)\}", common).group(1)
    assert [c.strip() for c in cmps.split(",")] == ["k" + c.capitalize() for c in _asm.CMPS]


# --- PTX -------------------------------------------------------------------------------------------

def _spin_body(ptx):
    # The first spin's inline PTX, from its acquire to its end label.
    start = ptx.index("ld.acquire.")
    return ptx[start:ptx.index("tdist_done:", start)]


@pytest.mark.parametrize("scope", ["sys", "gpu"])
def test_wait_ptx_holds_acquire_timeout_and_both_actions(scope):
    ptx = compile_ptx(wait_then_load, SIG, {"SCOPE": scope})
    assert f"ld.acquire.{scope}.u64" in ptx
    assert f"ld.relaxed.{scope}.u64" in ptx
    assert "%globaltimer" in ptx
    body = _spin_body(ptx)
    # In order: the clock read, the check of the process's fault record (another wait gave up), the
    # deadline, the claim of the record, its fields, the fence and the state, the diagnostic, then the
    # trap predicated on "no record" (the trap action).
    steps = [r"mov\.u64 %tdist_t0, %globaltimer;", r"ld\.volatile\.u32 %tdist_x, \[(%rd\d+)\];",
             r"setp\.ne\.u32 %tdist_p, %tdist_x, 0;\s*@%tdist_p bra tdist_done;",
             r"mov\.u64 %tdist_t1, %globaltimer;", r"setp\.le\.u64 %tdist_p, %tdist_t1, %rd\d+;",
             r"@%tdist_q bra tdist_report;", r"atom\.cas\.sys\.b32 %tdist_x, \[(%rd\d+)\], 0, 1;",
             r"st\.u64 \[%rd\d+\+64\], %rd\d+;", r"membar\.sys;", r"st\.volatile\.u32 \[%rd\d+\], 2;",
             r"tdist_report:", r"call\.uni \(tdist_rv\), vprintf", r"@%tdist_q trap;", r"bra tdist_done;"]
    at = 0
    for step in steps:
        m = re.compile(step).search(body, at)
        assert m, f"{step} not found in order in the wait's PTX"
        at = m.end()
    # The trap predicate is "the descriptor's record address is 0"; the record is read from that address.
    q = re.search(r"setp\.eq\.s?u?64 %tdist_q, (%rd\d+), 0;", body)
    assert q, "no trap predicate"
    record = q.group(1)
    assert f"ld.volatile.u32 %tdist_x, [{record}];" in body and f"[{record}], 0, 1;" in body
    assert f"st.u32 [{record}+4], {_asm.kWaitSiteUser};" in body
    assert f"st.u32 [{record}+12], {_asm.CMP_CODES['ge']};" in body
    # The record address is word 3 of the heap descriptor.
    word3 = [a for a in re.findall(r"add\.s64\s+(%rd\d+), %rd\d+, 24;", ptx)
             if re.search(r"ld\.global\.b64 \{ " + re.escape(record) + r" \}, \[ " + re.escape(a) + r" \+ 0 \];", ptx)]
    assert word3, f"the record address {record} is not loaded from word 3 of the heap descriptor"
    fmt = _asm.diagnostic_format("wait", "ge", _asm.ABORT_SUFFIX).encode() + b"\0"
    # The format is stored 8 bytes at a time into local memory before the vprintf call; under trap the
    # suffix is cut off by "\n\0" written where it starts.
    first = int.from_bytes(fmt[:8], "little")
    assert f"st.local.u64 [tdist_fmt+0], {first};" in body
    cut = len(_asm.diagnostic_format("wait", "ge").encode()) - 1
    assert f"@%tdist_q st.local.u8 [tdist_fmt+{cut}], 10;" in body
    assert f"@%tdist_q st.local.u8 [tdist_fmt+{cut + 1}], 0;" in body


def test_wait_ptx_assembles():
    # ptxas accepts the whole wait (labels scoped per instance, the record stores, the predicated trap).
    sig = {"heap": "*i64", "flags": "*i32", "data": "*fp32", "out": "*fp32", "epoch": "i64"}
    compiled = triton.compile(triton.compiler.ASTSource(wait_many_then_load, sig, {"SCOPE": "sys", "CMP": "ge"}),
                              target=SM90)
    assert compiled.asm.get("cubin"), "no cubin"


def test_consume_token_orders_the_load_after_the_wait():
    ptx = compile_ptx(wait_then_load, SIG, {"SCOPE": "sys"})
    body = "\n".join(line for line in ptx[ptx.index(".entry"):].splitlines()
                     if not line.strip().startswith((".loc", "//", "$L__tmp")))
    # After the spin: bar.sync, every thread's acquire of the flag into register T, a zero from T, then the
    # data load whose address is computed from that zero.
    m = re.search(r"bar\.sync\s+0;\s*ld\.acquire\.sys\.u64 (%rd\d+), \[[^\]]+\];", body)
    assert m, "no bar.sync + acquire after the spin"
    token = m.group(1)
    rest = body[m.end():]
    z = re.search(rf"and\.b64 (%rd\d+), {re.escape(token)}, 0;", rest)
    assert z, "consume_token's zero is not computed from the acquired value"
    deps = {z.group(1)}
    load = None
    for line in rest[z.end():].splitlines():
        line = line.strip()
        if line.startswith("ld.global"):
            load = line
            break
        dst = re.match(r"[\w.]+\s+(%rd\d+),(.*)", line)
        if dst and any(re.search(rf"{re.escape(d)}\b", dst.group(2)) for d in deps):
            deps.add(dst.group(1))
    assert load is not None, "no data load after consume_token"
    addr = re.search(r"\[\s*(%rd\d+)", load).group(1)
    assert addr in deps, f"the data load ({load}) does not depend on the waited value ({sorted(deps)})"
    assert body.index("tdist_done:") < body.index(load)


@triton.jit
def wait_each_in_a_loop(heap, flags, data, out, epoch, N: tl.constexpr):
    tdl.wait_diagnostics(heap)
    offs = tl.arange(0, 128)
    acc = tl.zeros([128], tl.float32)
    for i in range(N):
        seen = tdl.wait_each_thread(heap, flags + i, epoch)
        acc += tl.load(tdl.consume_token(data + i * 128 + offs, seen))
    tl.store(out + offs, acc)


def test_wait_each_thread_acquires_per_thread_without_a_barrier():
    sig = {"heap": "*i64", "flags": "*i64", "data": "*fp32", "out": "*fp32", "epoch": "i64"}
    ptx = compile_ptx(wait_each_in_a_loop, sig, {"N": 4})
    assert "ld.acquire.sys.u64" in ptx and "%globaltimer" in ptx
    assert "bar.sync" not in ptx, "wait_each_thread must not synchronise the program"
    assert re.search(r"\.extern \.func .*vprintf", ptx), "wait_diagnostics did not declare vprintf"


@pytest.mark.parametrize("scope,cmp", [("sys", "ge"), ("gpu", "eq"), ("sys", "lt")])
def test_wait_on_many_flags(scope, cmp):
    sig = dict(SIG, flags="*i32")
    del sig["flag"]
    ptx = compile_ptx(wait_many_then_load, sig, {"SCOPE": scope, "CMP": cmp})
    assert f"ld.acquire.{scope}.u32" in ptx
    assert f"setp.{cmp}.u32" in ptx
    assert "bar.sync" in ptx


@pytest.mark.parametrize("scope", ["sys", "gpu"])
def test_every_primitive_compiles(scope):
    sig = dict(SIG, pad="*i64", n="i32")
    ptx = compile_ptx(every_primitive, sig, {"SCOPE": scope})
    for needle in (f"red.release.{scope}.add.u64", f"st.release.{scope}.u64", f"fence.acq_rel.{scope}",
                   "fence.acq_rel.sys", "atom.acq_rel.sys.add.u64", "red.release.sys.add.u64",
                   f"ld.acquire.{scope}.u64", f"ld.relaxed.{scope}.u64", "st.relaxed.gpu.u64"):
        assert needle in ptx, needle
    # Flags are written by thread 0 only.
    assert re.search(r"@%tdist_p st\.release\.", ptx)


@triton.jit
def copy_through_peer(heap, src, dst, flags, n, epoch):
    offs = tl.arange(0, 1024)
    seen = tdl.wait(heap, flags + offs % 4, epoch)  # a block of flags, the token of the same shape
    vals = tl.load(tdl.consume_token(src + offs, seen))
    tdl.put_tile(heap, dst + offs, vals, 1)
    seen1 = tdl.wait(heap, flags, epoch)  # one flag: a scalar token
    tl.store(dst + offs, tl.load(tdl.consume_token(src, seen1) + offs))


def test_translated_and_token_accesses_stay_vectorised():
    # symm_at's offset and consume_token's zero are marked multiples of 16 bytes: 16-byte accesses remain.
    sig = {"heap": "*i64", "src": "*fp32", "dst": "*fp32", "flags": "*i64", "n": "i32", "epoch": "i64"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    ptx = triton.compile(triton.compiler.ASTSource(copy_through_peer, sig, {}, attrs), target=SM90).asm["ptx"]
    assert re.search(r"st\.global\.v4\.b32", ptx), "stores through symm_at are not vectorised"
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) >= 2, "loads through consume_token are not vectorised"
    assert not re.search(r"ld\.global\.b32 ", ptx)


# --- bad arguments ---------------------------------------------------------------------------------

def _compile_error(fn, sig):
    with pytest.raises(Exception) as info:
        triton.compile(triton.compiler.ASTSource(fn, sig, {}), target=SM90)
    return str(info.value) + "".join(str(c) for c in (info.value.__cause__, info.value.__context__) if c)


def test_bad_scope_is_named():
    msg = _compile_error(wait_bad_scope, {"heap": "*i64", "flag": "*i64"})
    assert "scope must be 'gpu' or 'sys'" in msg and "'cta'" in msg


def test_wait_on_float_memory_is_refused():
    msg = _compile_error(wait_on_floats, {"heap": "*i64", "data": "*fp32"})
    assert "flags must be a pointer" in msg


def test_notify_on_a_block_is_refused():
    msg = _compile_error(notify_block, {"flag": "*i32"})
    assert "take one flag" in msg


# --- launcher glue ---------------------------------------------------------------------------------

def test_wait_timeout_setting(monkeypatch):
    monkeypatch.delenv("TDIST_WAIT_TIMEOUT_S", raising=False)
    assert tdist.triton.wait_timeout_seconds() == 60.0
    monkeypatch.setenv("TDIST_WAIT_TIMEOUT_S", "2.5")
    assert tdist.triton.wait_timeout_seconds() == 2.5
    for bad in ("0", "-1", "abc", "1e9", "nan"):
        monkeypatch.setenv("TDIST_WAIT_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="TDIST_WAIT_TIMEOUT_S"):
            tdist.triton.wait_timeout_seconds()


def test_launcher_binds_positional_arguments_around_heap():
    launcher = tdist.triton.kernel(wait_then_load)
    bound = launcher._fill(("f", "d", "o", 3), {"SCOPE": "sys", "heap": "H"})
    assert bound == {"heap": "H", "flag": "f", "data": "d", "out": "o", "epoch": 3, "SCOPE": "sys"}
    with pytest.raises(TypeError, match="positional"):
        launcher._fill(("f", "d", "o", 3, 4, 5), {"heap": "H"})
    assert launcher._fill(("d", "o", 3), {"heap": "H", "flag": "f", "SCOPE": "gpu"})["epoch"] == 3
    with pytest.raises(TypeError, match=r"\[grid\]"):
        launcher(1)
    with pytest.raises(TypeError, match="triton.jit"):
        tdist.triton.kernel(lambda: None)


def test_heap_view_needs_init():
    if tdist.is_initialized():
        pytest.skip("tdist is initialised in this process")
    with pytest.raises(tdist.Error, match="not initialised|needs PyTorch"):
        tdist.triton.heap_view()
    assert _launch.kHeapHeaderWords == tdl.HEAP_HEADER_WORDS.value
