"""CPU tests of the FP8 grouped GEMM's Python side (python/tdist/moe.py): no GPU. They need torch and
skip, saying so, without it.

* quantize_fp8_rows / quantize_fp8_blocks: shapes, e4m3 and float32 dtypes, K and N not multiples of
  128, every block's amax mapped to 448, dequantised values within e4m3's half-ulp of the input,
  all-zero blocks kept finite;
* swiglu_quantize_fp8: quantize_fp8_rows of SiLU(gate) * up computed in fp32;
* column_major=True: the same values with scales of strides (1, M rounded up to 4), eagerly and in
  the fakes;
* the registered ops' fake implementations: bf16 [M_total, N] of the GEMM on meta tensors, column-major
  A scales accepted; the quantisers' e4m3 rows and f32 scales;
* argument errors name the argument.
The product and the quantisers' kernel are checked on a GPU: tests/python/gpu_test_moe.py
(test_grouped_gemm_fp8, test_quantize_kernels).
"""

import pytest

torch = pytest.importorskip("torch", reason="the FP8 tests need torch")

import tdist  # noqa: E402
from tdist import moe  # noqa: E402


def dequantize_rows(q, s, k):
    return q.double() * s.double().repeat_interleave(128, 1)[:, :k]


@pytest.mark.parametrize("m,k", [(1, 16), (7, 128), (33, 400), (130, 2048)])
def test_quantize_rows(m, k):
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(m + k)) * 3
    x[0, :16] = 0  # a block partly zero (and, for k = 16, wholly)
    q, s = moe.quantize_fp8_rows(x.to(torch.bfloat16))
    kb = -(-k // 128)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (m, k) and q.is_contiguous()
    assert s.dtype == torch.float32 and tuple(s.shape) == (m, kb)
    assert torch.isfinite(s).all() and (s > 0).all()
    ref = x.to(torch.bfloat16).double()
    got = dequantize_rows(q, s, k)
    # Round to nearest e4m3 (3 mantissa bits): within 2^-4 relative, or the smallest normal's steps.
    assert ((got - ref).abs() <= ref.abs() * 2 ** -4 + s.double().repeat_interleave(128, 1)[:, :k] * 2 ** -9).all()
    # Every block's largest magnitude maps to 448 (up to the e4m3 rounding of 448 itself: exact).
    blocks = torch.nn.functional.pad(q.float().abs(), (0, kb * 128 - k)).view(m, kb, 128).amax(-1)
    assert torch.equal(blocks[blocks > 0], torch.full_like(blocks[blocks > 0], 448.0))


@pytest.mark.parametrize("m,f", [(1, 16), (37, 208)])
def test_swiglu_quantize(m, f):
    h13 = (torch.randn((m, 2 * f), generator=torch.Generator().manual_seed(m * f)) * 2).to(torch.bfloat16)
    q, s = moe.swiglu_quantize_fp8(h13)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (m, f) and tuple(s.shape) == (m, -(-f // 128))
    gate, up = h13[:, :f].float(), h13[:, f:].float()
    q2, s2 = moe.quantize_fp8_rows(gate / (1.0 + torch.exp(-gate)) * up)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    ref = torch.nn.functional.silu(h13[:, :f].double()) * h13[:, f:].double()
    got = dequantize_rows(q, s, f)
    assert ((got - ref).abs() <= ref.abs() * 2 ** -4 + s.double().repeat_interleave(128, 1)[:, :f] * 2 ** -8).all()


@pytest.mark.parametrize("m,k", [(1, 16), (6, 400), (8, 256)])
@pytest.mark.parametrize("swiglu", [False, True])
def test_column_major_scales(m, k, swiglu):
    x = (torch.randn((m, 2 * k if swiglu else k), generator=torch.Generator().manual_seed(m + k)) * 2)
    quantize = moe.swiglu_quantize_fp8 if swiglu else moe.quantize_fp8_rows
    q, s = quantize(x.to(torch.bfloat16))
    qc, sc = quantize(x.to(torch.bfloat16), column_major=True)
    assert torch.equal(q.view(torch.uint8), qc.view(torch.uint8)) and torch.equal(s, sc)
    assert sc.stride() == (1, -(-m // 4) * 4) and qc.is_contiguous()
    meta = quantize(x.to(device="meta", dtype=torch.bfloat16), column_major=True)
    assert meta[1].stride() == sc.stride() and tuple(meta[1].shape) == tuple(sc.shape)


def test_quantizers_fake_shapes():
    x = torch.empty((300, 400), dtype=torch.bfloat16, device="meta")
    q, s = moe.quantize_fp8_rows(x)
    assert (q.dtype, tuple(q.shape), s.dtype, tuple(s.shape)) == (torch.float8_e4m3fn, (300, 400), torch.float32,
                                                                   (300, 4))
    q, s = moe.swiglu_quantize_fp8(x)
    assert tuple(q.shape) == (300, 200) and tuple(s.shape) == (300, 2) and q.device.type == "meta"


@pytest.mark.parametrize("g,n,k", [(1, 8, 16), (3, 136, 400), (2, 256, 128)])
def test_quantize_blocks(g, n, k):
    w = torch.randn((g, n, k), generator=torch.Generator().manual_seed(g * n + k))
    q, s = moe.quantize_fp8_blocks(w)
    nb, kb = -(-n // 128), -(-k // 128)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (g, n, k)
    assert s.dtype == torch.float32 and tuple(s.shape) == (g, nb, kb)
    scale = s.double().repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[..., :k]
    got = q.double() * scale
    assert ((got - w.double()).abs() <= w.double().abs() * 2 ** -4 + scale * 2 ** -9).all()
    q2, s2 = moe.quantize_fp8_blocks(w[0])  # [N, K]: one group
    assert tuple(q2.shape) == (1, n, k) and torch.equal(s2[0], s[0])


def meta_args(m=300, g=3, n=136, k=400, column_major=False):
    kb, nb = -(-k // 128), -(-n // 128)
    a = torch.empty((m, k), dtype=torch.float8_e4m3fn, device="meta")
    a_s = torch.empty((kb, m), device="meta").t() if column_major else torch.empty((m, kb), device="meta")
    w = torch.empty((g, n, k), dtype=torch.float8_e4m3fn, device="meta")
    w_s = torch.empty((g, nb, kb), device="meta")
    offs = torch.empty((g + 1,), dtype=torch.int32, device="meta")
    return a, a_s, w, w_s, offs


@pytest.mark.parametrize("column_major", [False, True])
def test_fake_shape(column_major):
    d = torch.ops.tdist.grouped_gemm_fp8(*meta_args(column_major=column_major))
    assert d.dtype == torch.bfloat16 and tuple(d.shape) == (300, 136) and d.device.type == "meta"
    s = moe.check_grouped_gemm_fp8_args(*meta_args(column_major=column_major))
    assert (s["m"], s["n"], s["k"], s["groups"], s["offsets_dtype"]) == (300, 136, 400, 3, "int32")


def expect_error(fn, *words):
    with pytest.raises(tdist.Error) as e:
        fn()
    for w in words:
        assert w in str(e.value), str(e.value)


def test_argument_errors():
    a, a_s, w, w_s, offs = meta_args()
    check = moe.check_grouped_gemm_fp8_args
    expect_error(lambda: check(a.to(torch.bfloat16), a_s, w, w_s, offs), "'a'", "float8_e4m3fn")
    expect_error(lambda: check(a, a_s, w.to(torch.bfloat16), w_s, offs), "'w'")
    expect_error(lambda: check(a, a_s, w[:, :, :392].contiguous(), w_s, offs), "'w'", "16")
    expect_error(lambda: check(a, a_s, w[:, :130].contiguous(), w_s, offs), "'w'", "N")
    expect_error(lambda: check(a[:, :384].contiguous(), a_s, w, w_s, offs), "'a'")
    expect_error(lambda: check(a, a_s[:, :3], w, w_s, offs), "'a_scales'")
    expect_error(lambda: check(a, a_s.double(), w, w_s, offs), "'a_scales'")
    expect_error(lambda: check(a, a_s, w, w_s[:, :1], offs), "'w_scales'")
    expect_error(lambda: check(a, a_s, w, w_s, offs[:3]), "'offsets'")
    expect_error(lambda: check(a, a_s, w, w_s, offs.float()), "'offsets'")
    expect_error(lambda: moe.quantize_fp8_rows(torch.zeros(4)), "'x'")
    expect_error(lambda: moe.quantize_fp8_blocks(torch.zeros(4)), "'w'")
    expect_error(lambda: moe.quantize_fp8_rows(torch.zeros((4, 16), dtype=torch.int32)), "'x'", "floating-point")
    expect_error(lambda: moe.swiglu_quantize_fp8(torch.zeros((4, 33))), "'h13'", "even number of columns")
    expect_error(lambda: moe.swiglu_quantize_fp8(torch.zeros(4)), "'h13'", "2-D")


def test_bench_arguments():
    from tdist import bench_fp8

    args, models, tokens = bench_fp8._parse(["--models", "qwen3,mixtral", "--tokens", "7,4096", "--tp", "2"])
    assert models == ["qwen3", "mixtral"] and tokens == [7, 4096] and args.tp == 2
    for bad in (["--models", "llama"], ["--tokens", "x"], ["--tokens", "0"], ["--tp", "0"]):
        with pytest.raises(SystemExit):
            bench_fp8._parse(bad)
