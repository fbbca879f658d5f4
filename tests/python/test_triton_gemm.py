"""CPU tests of tdist.triton's AG-GEMM and GEMM-RS kernels (no GPU): every tile configuration compiles for
sm_90a (operands through TMA or pointers) with wgmma, a pipelined K loop, 16-byte accesses and its shared
memory within an H200 SM's; the persistent AG-GEMM takes its tiles through one thread's atomic, and its
launch shape keeps pushing programs and no more programs than fit at once. Skipped, with the reason
printed, where Triton is not installed."""

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

AG_SIG = {"heap": "*i64", "x": "*bf16", "gathered": "*bf16", "b": "*bf16", "out": "*bf16", "flags": "*i64",
          "tile_counter": "*i32", "x_delta": "i64", "M": "i32", "N": "i32", "K": "i32", "m_local": "i32",
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


CONFIGS = [pytest.param(gemm.kLargeConfig, id="large"), pytest.param(gemm.kSmallConfig, id="small")]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("even_k", [True, False])
@pytest.mark.parametrize("b_tma", [True, False])
def test_ag_gemm_configs_compile_pipelined(cfg, even_k, b_tma):
    constexprs = dict(CHUNK=gemm.kChunkRows, PUSH_K=16 * cfg["num_warps"], EVEN_K=even_k, B_TMA=b_tma, **_tiles(cfg))
    sig = dict(AG_SIG)
    aligned = ["heap", "x", "gathered", "out", "flags", "tile_counter", "x_delta", "N", "K", "stride_bn"]
    if b_tma:
        sig["b"] = f"tensordesc<bf16[{cfg['BLOCK_N']}, {cfg['BLOCK_K']}]>"
    else:
        aligned.append("b")
    c = _compile(gemm._ag_gemm_kernel, sig, constexprs, cfg, aligned)
    ptx = c.asm["ptx"]
    assert "wgmma.mma_async" in ptx, "the GEMM does not use Hopper's wgmma"
    assert "cp.async.cg" in ptx or "cp.async.ca" in ptx, "the K loop is not pipelined"
    assert ("cp.async.bulk.tensor" in ptx) == b_tma, "B is read through TMA exactly when asked"
    # 16-byte accesses for A (pushed and loaded) and the output tile: no 2-byte access survives.
    assert not re.search(r"(ld|st)\.global\.b16", ptx), "an access of A or of the output is not vectorised"
    stage = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
    assert cfg["num_stages"] * stage <= c.metadata.shared <= kMaxSharedBytes, (c.metadata.shared, stage)
    # Tiles come from a counter: one thread's relaxed atomic per fetch, broadcast through shared memory.
    atoms = [line for line in ptx.splitlines() if "atom.global" in line and ".add.u32" in line]
    assert len(atoms) == 2 and all(line.strip().startswith("@%p") for line in atoms), atoms
    # The waits keep the timeout, the record of the abort action and the trap.
    assert "%globaltimer" in ptx and "atom.cas.sys.b32" in ptx and "trap;" in ptx


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


def test_config_choice():
    assert gemm._gemm_config(8192, 14336) == gemm.kLargeConfig
    assert gemm._gemm_config(1024, 14336) == gemm.kSmallConfig
    assert gemm._gemm_config(8192, 1000) == gemm.kSmallConfig


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


@pytest.mark.parametrize("cfg,per_sm", [(gemm.kLargeConfig, 1), (gemm.kSmallConfig, 2)])
def test_programs_per_sm_fit_in_shared_memory(cfg, per_sm):
    assert gemm._programs_per_sm(cfg) == per_sm
    stage = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
    assert per_sm * (cfg["num_stages"] * stage + 1024) <= 228 * 1024
