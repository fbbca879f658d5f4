"""CPU tests of tdist.bench_moe's PyTorch grouped-GEMM baseline: the per-expert loop it falls back
to (against float64, output poisoned with NaN), the choice between it and torch._grouped_mm, and the
table naming the one used. No GPU; the tests with tensors need torch and skip, saying so, without it."""

import os

import pytest

from tdist import bench_moe as bm


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="the grouped-mm baseline tests need torch")


def test_counts_of_ends():
    assert bm.counts_of_ends([3, 3, 10, 10]) == [3, 0, 7, 0]
    assert bm.counts_of_ends([0, 5]) == [0, 5]
    assert bm.counts_of_ends([]) == []


def reference(torch, a, w, counts):
    """float64 rows of each expert times w[e]^T (w [E, N, K]), one row at a time."""
    out = torch.empty((a.shape[0], w.shape[1]), dtype=torch.float64)
    start = 0
    for e, c in enumerate(counts):
        for r in range(start, start + c):
            out[r] = w[e].double() @ a[r].double()
        start += c
    return out


# A fresh seed every run besides fixed ones: a failure prints it.
SEEDS = [1, 2, int.from_bytes(os.urandom(4), "little")]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_loop_against_float64(torch, seed, dtype_name):
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed)
    experts = int(torch.randint(1, 9, (1,), generator=g))
    counts = torch.randint(0, 40, (experts,), generator=g)
    counts[torch.rand((experts,), generator=g) < 0.3] = 0  # empty experts
    counts = counts.tolist()
    k, n = 8 * int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 70, (1,), generator=g))
    a = torch.randn((sum(counts), k), generator=g).to(dtype)
    w = torch.randn((experts, n, k), generator=g).to(dtype)
    out = torch.full((sum(counts), n), float("nan"), dtype=dtype)  # a row left unwritten shows
    got = bm.grouped_mm_loop(torch, a, w.transpose(1, 2), counts, out=out)
    assert got is out
    ref = reference(torch, a, w, counts)
    what = f"seed {seed} {dtype_name} counts {counts} k {k} n {n}"
    assert not torch.isnan(got).any(), what
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    err = (got.double() - ref).abs().max().item() if got.numel() else 0.0
    assert err <= tol * max(ref.abs().max().item() if ref.numel() else 0.0, 1e-3), f"{what}: max |err| {err}"
    fresh = bm.grouped_mm_loop(torch, a, w.transpose(1, 2), counts)  # its own output
    assert torch.equal(fresh, got), what


def test_loop_refuses_a_bad_split(torch):
    a = torch.zeros((10, 16))
    w_t = torch.zeros((3, 16, 8))
    for counts in ([4, 4, 4], [5, 5], [12, -2, 0], [4, 4, 1]):
        with pytest.raises(ValueError, match="do not split 10 rows over 3 experts"):
            bm.grouped_mm_loop(torch, a, w_t, counts)


def loop_as_grouped_mm(torch):
    """A stand-in torch._grouped_mm computed by the loop (correct by construction)."""
    def fn(a, w_t, offs):
        return bm.grouped_mm_loop(torch, a, w_t, bm.counts_of_ends(offs.tolist()))
    return fn


def test_pick_torch_grouped_mm_when_it_works(torch):
    assert bm.pick_grouped_mm(torch, loop_as_grouped_mm(torch), "cpu") == (bm.GROUPED_MM, None)


def test_pick_loop_when_missing_failing_or_wrong(torch):
    name, why = bm.pick_grouped_mm(torch, None, "cpu")
    assert name == bm.GROUPED_MM_LOOP and "has no torch._grouped_mm" in why

    def refuses(a, w_t, offs):
        raise RuntimeError("grouped gemm is only supported on SM90\nsecond line")
    name, why = bm.pick_grouped_mm(torch, refuses, "cpu")
    assert name == bm.GROUPED_MM_LOOP and "RuntimeError: grouped gemm is only supported on SM90" in why
    assert "second line" not in why

    good = loop_as_grouped_mm(torch)

    def off_by_one_expert(a, w_t, offs):  # every expert's rows shifted: a plausible indexing bug
        return good(a, w_t.roll(1, 0), offs)
    name, why = bm.pick_grouped_mm(torch, off_by_one_expert, "cpu")
    assert name == bm.GROUPED_MM_LOOP and "differs from the per-expert loop" in why

    def nan_row(a, w_t, offs):
        out = good(a, w_t, offs)
        out[-1, 0] = float("nan")
        return out
    assert bm.pick_grouped_mm(torch, nan_row, "cpu")[0] == bm.GROUPED_MM_LOOP

    def float32_out(a, w_t, offs):
        return good(a, w_t, offs).float()
    name, why = bm.pick_grouped_mm(torch, float32_out, "cpu")
    assert name == bm.GROUPED_MM_LOOP and "expected bf16" in why


def test_table_names_the_baseline(capsys):
    row = {"op": "moe_ag_group_gemm", "model": "Mixtral-8x7B", "m": 1024, "routing": "uniform", "tdist_us": 10.0,
           "group_gemm_us": 9.0, "baseline_us": 20.0, "torch_grouped_mm_us": 12.0,
           "ratios": {"group_gemm_vs_torch": 12 / 9, "tdist_over_group_gemm": 10 / 9, "speedup_vs_baseline": 2.0},
           "goals": {"group_gemm_vs_torch": True, "speedup_vs_baseline": True}, "max_rel_err": {}}
    args = bm._parse([])
    bm._print_row(row, True, 1, args, bm.GROUPED_MM_LOOP)
    head = capsys.readouterr().out.splitlines()[0]
    assert f"PyTorch's grouped GEMM (baseline, torch gg): {bm.GROUPED_MM_LOOP}" in head
    bm._print_row(row, True, 1, args)
    assert f"torch gg): {bm.GROUPED_MM}" in capsys.readouterr().out.splitlines()[0]


def test_fp8_columns(capsys):
    assert not bm._parse([]).fp8 and bm._parse(["--fp8"]).fp8
    row = {"op": "moe_group_gemm_rs", "model": "Qwen3-30B-A3B", "m": 4096, "routing": "skewed", "tdist_us": 90.0,
           "group_gemm_us": 80.0, "baseline_us": 150.0, "torch_grouped_mm_us": 85.0, "tdist_fp8_us": 60.0,
           "group_gemm_fp8_us": None, "ratios": {"group_gemm_vs_torch": 85 / 80, "tdist_over_group_gemm": 90 / 80,
                                                 "speedup_vs_baseline": 150 / 90},
           "ratios_fp8": {"op_bf16_over_fp8": bm._ratio(90.0, 60.0), "gg_bf16_over_fp8": bm._ratio(80.0, None)},
           "goals": {}, "max_rel_err": {"tdist_fp8": 0.03}}
    bm._print_row(row, False, 2, bm._parse(["--fp8"]))
    line = capsys.readouterr().out
    assert "| fp8 op 60.0 us (1.50x) gg - us (-x) err 3.0e-02 / -" in line, line
    del row["tdist_fp8_us"]
    bm._print_row(row, False, 2, bm._parse([]))
    assert "fp8" not in capsys.readouterr().out


def test_loop_agrees_with_torch_grouped_mm_where_it_runs(torch):
    # The loop must mean what torch._grouped_mm means (offsets, mat_b layout): where this torch runs it
    # on the CPU, the choice must not fall back for a difference.
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    name, why = bm.pick_grouped_mm(torch, torch._grouped_mm, "cpu")
    assert name == bm.GROUPED_MM or "fails on bf16 here" in why, why


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_random_cases_cover_the_stated_ranges(world):
    cases = bm.random_cases(200, 20261202, world)
    assert cases == bm.random_cases(200, 20261202, world)  # the seed fixes them
    assert cases != bm.random_cases(200, 7, world)
    for name, hidden, inter, experts, topk, m, routing in cases:
        assert 1 <= topk <= min(8, experts) and experts < 256
        assert 1024 <= hidden < 8192 and hidden % 8 == 0
        assert 8 * world <= inter < 16384 and inter % (8 * world) == 0
        assert world <= m < 16384 and m % world == 0
        assert routing in bm.ROUTINGS
        assert experts * 3 * (inter // world) * hidden * 2 <= bm.kRandomWeightBytes or experts == topk
        assert name == f"E{experts}/k{topk}/{hidden}x{inter}"
    # Odd multiples of 8 (the K that the GEMM reads slower) and both routings are drawn.
    assert any(c[1] % 16 == 8 for c in cases) and any(c[1] % 16 == 0 for c in cases)
    assert {c[6] for c in cases} == set(bm.ROUTINGS)


def test_random_flag_is_checked():
    assert bm._parse(["--random", "5"]).random == 5
    with pytest.raises(SystemExit):
        bm._parse(["--random", "-1"])


def test_tp_flag_is_checked_and_named(capsys):
    assert bm._parse([]).tp == 0 and bm._parse(["--tp", "2"]).tp == 2
    for bad in ("-1", "65"):
        with pytest.raises(SystemExit):
            bm._parse(["--tp", bad])
    row = {"op": "moe_group_gemm_rs", "model": "Qwen3-30B-A3B", "m": 4096, "routing": "uniform", "tdist_us": 90.0,
           "group_gemm_us": 80.0, "baseline_us": 150.0, "torch_grouped_mm_us": 85.0,
           "ratios": {"group_gemm_vs_torch": 85 / 80, "tdist_over_group_gemm": 90 / 80, "speedup_vs_baseline": 150 / 90},
           "goals": {}, "max_rel_err": {}}
    bm._print_row(row, True, 1, bm._parse(["--tp", "2"]), bm.GROUPED_MM, 2)
    assert "1 ranks (each one rank's share of TP 2, no other ranks' communication)" in capsys.readouterr().out
    bm._print_row(row, True, 2, bm._parse([]), bm.GROUPED_MM, 2)
    assert "share of TP" not in capsys.readouterr().out
