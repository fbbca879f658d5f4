"""CPU tests of tdist.triton's AG-GEMM and GEMM-RS kernels (no GPU): every tile configuration compiles for
sm_90a (operands through TMA or pointers) with wgmma, a pipelined K loop, 16-byte accesses and its shared
memory within an H200 SM's; the persistent AG-GEMM's one-rank form fuses its tile and K loops (the next
tile's loads in the loop that stores this tile), its multi-rank form keeps the waits before the loads they
guard, and its launch shape keeps pushing programs and no more programs than fit at once. Skipped, with
the reason printed, where Triton is not installed."""

import re
import sys

import pytest

try:
    import triton
    from triton.backends.compiler import GPUTarget
except ImportError as e:  # pragma: no cover - depends on the environment
    print(f"test_triton_gemm.py: skipped, Triton is not installed ({e}); pip install 'triton>=3.6'", file=sys.stderr)
    pytest.skip(f"Triton is not installed ({e})", allow_module_level=True)

import tdist.triton  # noqa: F401
from tdist.triton import gemm

SM90 = GPUTarget("cuda", 90, 32)
kMaxSharedBytes = 227 * 1024  # per block on H100 / H200

AG_SIG = {"heap": "*i64", "x": "*bf16", "gathered": "*bf16", "a_own": "*bf16", "a_peer": "*bf16", "b": "*bf16",
          "out": "*bf16", "flags": "*i64", "x_delta": "i64", "M": "i32", "N": "i32", "K": "i32", "m_local": "i32",
          "num_chunks": "i32",
          "epoch": "i64", "stride_bn": "i32", "num_push": "i32"}
RS_SIG = {"heap": "*i64", "a": "*bf16", "b": "*bf16", "recv": "*bf16", "counters": "*i64", "M": "i32", "N": "i32",
          "K": "i32", "m_local": "i32", "stride_am": "i32", "stride_bn": "i32"}


def _compile(fn, sig, constexprs, cfg, aligned):
    # Pointers 16-byte aligned and the named integers multiples of 16, as Triton's launcher specialises them
    # for the LLaMA shapes.
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    try:
        return triton.compile(triton.compiler.ASTSource(fn, sig, constexprs, attrs), target=SM90, options=opts)
    except RuntimeError as e:
        if "ptxas" in str(e):
            pytest.skip(f"Triton cannot assemble for sm_90 here: {e}")
        raise


def _tiles(cfg):
    return {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}


CONFIGS = [pytest.param(gemm.kLargeConfig, id="large"), pytest.param(gemm.kAgLargeConfig, id="ag_large"),
           pytest.param(gemm.kSmallConfig, id="small")]


def _compile_ag(cfg, even_k, a_tma, b_tma, c_tma, peers=True):
    constexprs = dict(CHUNK=gemm.kChunkRows, PUSH_K=16 * cfg["num_warps"], EVEN_K=even_k, B_TMA=b_tma, A_TMA=a_tma,
                      C_TMA=c_tma, PEERS=peers, **_tiles(cfg))
    sig = dict(AG_SIG)
    aligned = ["heap", "x", "gathered", "flags", "x_delta", "N", "K", "stride_bn"]
    if c_tma:  # the output in two halves: ag_gemm's descriptor has blocks [BLOCK_M, BLOCK_N / 2]
        sig["out"] = f"tensordesc<bf16[{cfg['BLOCK_M']}, {cfg['BLOCK_N'] // 2}]>"
    else:
        aligned.append("out")
    if a_tma:
        sig["a_own"] = sig["a_peer"] = f"tensordesc<bf16[{cfg['BLOCK_M']}, {cfg['BLOCK_K']}]>"
    if b_tma:
        sig["b"] = f"tensordesc<bf16[{cfg['BLOCK_N']}, {cfg['BLOCK_K']}]>"
    else:
        aligned.append("b")
    return _compile(gemm._ag_gemm_kernel, sig, constexprs, cfg, aligned)


# (A_TMA, B_TMA, C_TMA): the launcher reads A through TMA only when B also goes through TMA, and stores the
# output through TMA only when A goes through TMA.
AG_OPERANDS = [pytest.param(True, True, True, id="abc_tma"), pytest.param(True, True, False, id="ab_tma"),
               pytest.param(False, True, False, id="b_tma"), pytest.param(False, False, False, id="pointers")]


def _loop_around(ttgir, op):
    # The body of the innermost scf.for holding the first line with `op` (TTGIR nests by indentation).
    lines = ttgir.splitlines()
    at = next(i for i, line in enumerate(lines) if op in line)
    indent = lambda line: len(line) - len(line.lstrip())
    head = next(i for i in range(at, -1, -1) if "scf.for" in lines[i] and indent(lines[i]) < indent(lines[at]))
    end = next(i for i in range(head + 1, len(lines)) if indent(lines[i]) <= indent(lines[head]))
    return "\n".join(lines[head:end])


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("even_k", [True, False])
@pytest.mark.parametrize("a_tma,b_tma,c_tma", AG_OPERANDS)
@pytest.mark.parametrize("peers", [True, False], ids=["ranks", "one_rank"])
def test_ag_gemm_configs_compile_pipelined(cfg, even_k, a_tma, b_tma, c_tma, peers):
    c = _compile_ag(cfg, even_k, a_tma, b_tma, c_tma, peers)
    ptx = c.asm["ptx"]
    assert "wgmma.mma_async" in ptx, "the GEMM does not use Hopper's wgmma"
    assert "wgmma.wait_group.sync.aligned 1" in ptx, "the wgmma of one K step does not overlap the next"
    if a_tma:  # both operands through TMA into multi-buffered stages, no pointer loads in the K loop
        assert "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx
        assert "cp.async.cg" not in ptx and "cp.async.ca" not in ptx
    else:
        assert "cp.async.cg" in ptx or "cp.async.ca" in ptx, "the K loop is not pipelined"
        assert ("cp.async.bulk.tensor" in ptx) == b_tma, "B is read through TMA exactly when asked"
    stores = ptx.count("cp.async.bulk.tensor.2d.global.shared")
    assert (stores > 0) == c_tma, "the output goes through TMA exactly when asked"
    # Two half-tile stores per tile (each copy of the epilogue that the compiler makes holds both).
    assert stores % 2 == 0, stores
    # 16-byte accesses for A (pushed and loaded) and the output tile: no 2-byte access survives.
    assert not re.search(r"(ld|st)\.global\.b16", ptx), "an access of A or of the output is not vectorised"
    stage = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
    # One set of stages: the own and peer tiles share one K loop (a select of descriptors, not two loops).
    assert cfg["num_stages"] * stage <= c.metadata.shared, (c.metadata.shared, stage)
    # Every configuration fits in one launch (ag_gemm has no retry with fewer stages), and the launch
    # shape's programs per SM all fit at once (each block also holds 1 KiB reserved by the GPU).
    assert c.metadata.shared <= kMaxSharedBytes, (c.metadata.shared, cfg)
    assert gemm._programs_per_sm(cfg) * (c.metadata.shared + 1024) <= 228 * 1024, c.metadata.shared
    # A static schedule: no tile counter, no atomic on global memory outside the waits' fault record.
    assert not [line for line in ptx.splitlines() if "atom.global" in line and ".add." in line]
    if peers:
        # The waits keep the timeout, the record of the abort action and the trap; the pushes their release.
        assert "%globaltimer" in ptx and "atom.cas.sys.b32" in ptx and "trap;" in ptx
        assert "st.release.sys.u64" in ptx
    else:  # one rank: nothing pushed, nothing waited for
        assert "%globaltimer" not in ptx and "ld.acquire" not in ptx and "st.release" not in ptx
    if a_tma or not peers:
        # The tile loop and the K loop fused into one loop, so the loads of the next tile are issued in the
        # loop that holds this tile's epilogue (not with A by pointers and peers: their wait's bar.sync).
        loop = _loop_around(c.asm["ttgir"], "ttng.warp_group_dot ")
        store = "ttng.async_tma_copy_local_to_global" if c_tma else "tt.store"
        assert store in loop, "the epilogue is not in the loop of the wgmma: tile and K loops not fused"
        if a_tma:
            assert loop.count("ttng.async_tma_copy_global_to_local") >= 2, "A and B not loaded in the fused loop"


def _body(ptx):
    return "\n".join(line for line in ptx[ptx.index(".entry"):].splitlines()
                     if not line.strip().startswith((".loc", "//", "$L__tmp")))


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("c_tma", [True, False])
def test_ag_gemm_tma_loads_of_peer_rows_follow_the_wait(cfg, c_tma):
    # A peer tile: every thread spins on its chunk's flag and acquires it into T, then fence.proxy.async.global
    # (the acquired rows visible to the async proxy) and a zero from T; the row coordinate of A's TMA loads
    # is computed from that zero, so no load of the tile is issued before the wait, and every TMA load of A
    # comes after a fence in program order. The tile and K loops are fused and pipelined, so the wait has
    # several copies (the pipeline's prologue issues the first tiles' loads before the loop): each holds.
    c = _compile_ag(cfg, True, True, True, c_tma)
    body = _body(c.asm["ptx"])
    waits = list(re.finditer(r"ld\.acquire\.sys\.u64 (%rd\d+), \[[^\]]+\];\s*tdist_done:\s*\}\s*"
                             r"fence\.proxy\.async\.global;\s*and\.b64 (%rd\d+), \1, 0;", body))
    assert waits, "no acquire, proxy fence and zero from the acquired value after the spin"
    assert body.count("fence.proxy.async.global") == len(waits), "a proxy fence that does not follow a wait"
    assert "bar.sync" not in body[waits[0].start() - 3000:waits[0].start()].split("tdist_poll:")[-1]
    # Registers computed from a zero (to a fixed point: the fused loop carries values around its back edge).
    lines = [line.strip() for line in body.splitlines()]
    deps = {m.group(2) for m in waits}
    grown = True
    while grown:
        grown = False
        for line in lines:
            dst = re.match(r"[\w.]+\s+(%r[d]?\d+),(.*)", line)
            if dst and dst.group(1) not in deps and any(re.search(rf"{re.escape(d)}\b", dst.group(2)) for d in deps):
                deps.add(dst.group(1))
                grown = True
    # TMA loads: [smem], [descriptor, {k, row}]. A's descriptors are those whose loads use a coordinate from
    # a zero (B's row coordinate is the tile's column, never from a wait).
    loads = [(i, desc, row) for i, line in enumerate(lines) for desc, _, row in
             re.findall(r"cp\.async\.bulk\.tensor\.2d\S* \[[^\]]+\], \[(%rd\d+), \{(%r\d+), (%r\d+)\}\]", line)]
    assert loads, "no TMA loads"
    a_desc = {desc for _, desc, row in loads if row in deps}
    b_desc = {desc for _, desc, row in loads if row not in deps}
    assert a_desc and b_desc and not a_desc & b_desc, (sorted(deps), loads)
    first_fence = body[:waits[0].end()].count("\n")
    assert all(i > first_fence for i, desc, _ in loads if desc in a_desc), "a TMA load of A precedes the proxy fence"
    # At the TTGIR level (SSA, structured): the branch that waits is the one that takes the peer's
    # descriptor. Each wait lies in an scf.if whose condition also selects between A's two descriptors
    # (x's and the gathered buffer's), the gathered one when the condition holds; the if yields the row
    # computed from the zero.
    ttgir = c.asm["ttgir"]
    a_type = rf"!tt\.tensordesc<(?:tensor<)?{cfg['BLOCK_M']}x{cfg['BLOCK_K']}xbf16"  # Triton 3.6 / 3.9 spellings
    signature = ttgir[ttgir.index("tt.func public @_ag_gemm_kernel("):].split("\n")[0]
    # a_own and a_peer come first in the signature (the small tiles' halved output has their block shape too).
    a_own, a_peer = re.findall(rf"(%[\w]+): {a_type}", signature)[:2]
    tt_lines = ttgir.splitlines()
    spins = [i for i, line in enumerate(tt_lines) if "tdist_poll" in line]
    assert spins
    yielding = 0
    for at in spins:
        zero = re.search(r"(%\w+) = tt\.elementwise_inline_asm \"fence\.proxy", "\n".join(tt_lines[at:at + 4])).group(1)
        head = next(i for i in range(at, -1, -1) if "scf.if %" in tt_lines[i])
        if "= scf.if" not in tt_lines[head]:
            # The copy for K <= 0 (no K step: Triton keeps the loops unfused for it) loads nothing: the zero
            # is used nowhere in the if's region (names repeat across regions).
            indent = len(tt_lines[head]) - len(tt_lines[head].lstrip())
            end = next(i for i in range(head + 1, len(tt_lines))
                       if tt_lines[i].strip() and len(tt_lines[i]) - len(tt_lines[i].lstrip()) <= indent)
            region = "\n".join(tt_lines[head:end])
            assert len(re.findall(rf"{re.escape(zero)}\b", region)) == 1, region
            continue
        yielding += 1
        cond = re.search(r"scf\.if (%\w+)", tt_lines[head]).group(1)
        select = rf"arith\.select {re.escape(cond)}, {re.escape(a_peer)}, {re.escape(a_own)} :"
        assert re.search(select, "\n".join(tt_lines[head - 12:head])), f"the wait's branch ({cond}) reads not gathered"
        rest = "\n".join(tt_lines[at:at + 8])
        row = re.search(rf"(%\w+) = arith\.trunci {re.escape(zero)} ", rest).group(1)
        added = re.search(rf"(%\w+) = arith\.addi %\w+, {re.escape(row)} ", rest).group(1)
        assert re.search(rf"scf\.yield {re.escape(added)} ", rest), "the waited branch yields a row not from the zero"
    assert yielding, "no wait in the loop that loads"


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("even_k", [True, False])
@pytest.mark.parametrize("ab_tma", [True, False])
def test_gemm_rs_configs_compile_pipelined(cfg, even_k, ab_tma):
    sig = dict(RS_SIG)
    aligned = ["heap", "recv", "counters", "N", "K", "stride_am", "stride_bn"]
    if ab_tma:
        sig["a"] = f"tensordesc<bf16[{cfg['BLOCK_M']}, {cfg['BLOCK_K']}]>"
        sig["b"] = f"tensordesc<bf16[{cfg['BLOCK_N']}, {cfg['BLOCK_K']}]>"
    else:
        aligned += ["a", "b"]
    c = _compile(gemm._gemm_rs_kernel, sig, dict(EVEN_K=even_k, AB_TMA=ab_tma, **_tiles(cfg)), cfg, aligned)
    ptx = c.asm["ptx"]
    assert "wgmma.mma_async" in ptx
    assert not re.search(r"(ld|st)\.global\.b16", ptx), "an access of the operands or the partials is not vectorised"
    if ab_tma:  # both operands through TMA, multi-buffered
        assert "cp.async.bulk.tensor" in ptx and "mbarrier" in ptx
        stage = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
        assert c.metadata.shared >= 2 * stage, (c.metadata.shared, stage)
    else:
        assert "cp.async.cg" in ptx or "cp.async.ca" in ptx
    assert c.metadata.shared <= kMaxSharedBytes
    assert "red.release.sys.add.u64" in ptx  # the arrival count, after the partial's stores


def test_rs_reduce_compiles():
    sig = {"heap": "*i64", "recv": "*bf16", "out": "*bf16", "counters": "*i64", "target": "i64", "m_local": "i32",
           "N": "i32"}
    c = _compile(gemm._rs_reduce, sig, dict(BLOCK_M=32, BLOCK_N=256), {"num_warps": 4, "num_stages": 3},
                 ("heap", "recv", "out", "counters"))
    assert "ld.acquire.sys.u64" in c.asm["ptx"]


@pytest.mark.parametrize("m,n,expected", [
    (8192, 8192, gemm.kLargeConfig),  # LLaMA-3-70B's MLP down-projection at M = 8192, 1024
    (1024, 8192, gemm.kLargeConfig),  # 256 large tiles fill 97% of 2 waves on 132 SMs, and reuse more
    (64, 1000, gemm.kSmallConfig),    # 4 large tiles would be half empty
])
def test_rs_config_choice(m, n, expected):
    assert gemm._rs_gemm_config(m, n, 132) == expected


@pytest.mark.parametrize("m,n,expected", [
    (8192, 28672, gemm.kAgLargeConfig),  # LLaMA-3-70B's MLP up-projection at M = 8192, 4096, 1024
    (4096, 28672, gemm.kAgLargeConfig),
    (1024, 28672, gemm.kAgLargeConfig),  # 896 large tiles fill 97% of 7 waves on 132 SMs
    (256, 4096, gemm.kSmallConfig),    # 32 large tiles would leave three quarters of the SMs idle
    (64, 1000, gemm.kSmallConfig),
])
def test_ag_config_choice(m, n, expected):
    assert gemm._ag_gemm_config(m, n, 132) == expected


@pytest.mark.parametrize("sms,per_sm,world,chunks,tiles,expected", [
    (132, 1, 2, 32, 2048, (132, 16)),   # LLaMA-70B at M = 8192: every SM, 16 pushing
    (132, 2, 2, 8, 1792, (264, 8)),     # small tiles: two programs per SM; 8 chunks, 8 pushers
    (132, 1, 2, 1, 1, (2, 1)),          # one chunk, one tile: the pusher and one program for the tile
    (132, 1, 1, 8, 500, (132, 0)),      # one rank: nothing to push
    (132, 2, 8, 2, 3, (17, 14)),        # 7 peers x 2 chunks: 14 pushers, plus the tiles
    (8, 1, 2, 64, 1000, (8, 1)),        # a small GPU: an eighth of the SMs push, at least one
])
def test_ag_launch_shape(sms, per_sm, world, chunks, tiles, expected):
    programs, push = gemm._ag_launch_shape(sms, per_sm, world, chunks, tiles)
    assert (programs, push) == expected
    assert programs <= sms * per_sm and push <= programs and (push > 0) == (world > 1)


@pytest.mark.parametrize("cfg,per_sm", [(gemm.kLargeConfig, 1), (gemm.kAgLargeConfig, 1), (gemm.kSmallConfig, 2)])
def test_programs_per_sm_fit_in_shared_memory(cfg, per_sm):
    assert gemm._programs_per_sm(cfg) == per_sm
    stage = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
    half_out = cfg["BLOCK_M"] * cfg["BLOCK_N"] // 2 * 2  # the AG-GEMM's staged half output tile, bf16
    assert per_sm * (cfg["num_stages"] * stage + half_out + 1024) <= 228 * 1024
