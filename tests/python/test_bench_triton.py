"""CPU tests of tdist.bench_triton's --summary rows and its option parsing. No torch, no GPU."""

import json

import pytest

from tdist import bench_triton as bt

SCHEMA = ["op", "m", "n", "k", "world", "triton_us", "cpp_us", "torch_fused_us", "baseline_us"]


def rows(op, m, n, k, world, **ms):
    """main()'s rows of one shape: one per method, its median in ms (None and an error where it failed)."""
    return [{"op": op, "m": m, "n": n, "k": k, "world": world, "method": method, "ms": t,
             "tflops": None, "vs_triton": None, "error": None if t is not None else "failed"}
            for method, t in ms.items()]


def test_one_row_per_shape_in_us():
    out = bt.summary_rows(
        rows("ag_gemm", 1024, 14336, 8192, 2, triton=0.5, tdist_cpp=0.25, nccl_cublas=1.5, torch_fused=0.75)
        + rows("gemm_rs", 1024, 8192, 14336, 2, triton=2.0, tdist_cpp=1.0, nccl_cublas=4.0, torch_fused=3.0))
    assert out == [
        {"op": "ag_gemm", "m": 1024, "n": 14336, "k": 8192, "world": 2, "triton_us": 500.0, "cpp_us": 250.0,
         "torch_fused_us": 750.0, "baseline_us": 1500.0},
        {"op": "gemm_rs", "m": 1024, "n": 8192, "k": 14336, "world": 2, "triton_us": 2000.0, "cpp_us": 1000.0,
         "torch_fused_us": 3000.0, "baseline_us": 4000.0},
    ]
    assert all(list(r) == SCHEMA for r in out)


def test_methods_not_run_are_null():
    # torch_fused failed (ms None); nccl_cublas has no row at all
    out = bt.summary_rows(rows("ag_gemm", 2048, 14336, 8192, 2, triton=1.0, tdist_cpp=0.875, torch_fused=None))
    assert len(out) == 1 and list(out[0]) == SCHEMA
    assert out[0]["torch_fused_us"] is None and out[0]["baseline_us"] is None
    assert out[0]["triton_us"] == 1000.0 and out[0]["cpp_us"] == 875.0
    assert '"baseline_us": null' in json.dumps(out)


def test_shapes_apart_and_in_order():
    # the same M at another world size or op is another row; rows of one shape may come apart
    a = rows("gemm_rs", 4096, 8192, 14336, 2, triton=1.0)
    b = rows("gemm_rs", 4096, 8192, 7168, 4, triton=2.0)
    c = rows("ag_gemm", 4096, 14336, 8192, 2, triton=3.0)
    out = bt.summary_rows(a + b + c + rows("gemm_rs", 4096, 8192, 14336, 2, tdist_cpp=0.5))
    assert [(r["op"], r["world"], r["triton_us"], r["cpp_us"]) for r in out] == [
        ("gemm_rs", 2, 1000.0, 500.0), ("gemm_rs", 4, 2000.0, None), ("ag_gemm", 2, 3000.0, None)]


def test_bad_rows():
    with pytest.raises(ValueError, match="unknown method"):
        bt.summary_rows(rows("ag_gemm", 1024, 14336, 8192, 2, cublas=1.0))
    with pytest.raises(ValueError, match="two triton rows"):
        bt.summary_rows(rows("ag_gemm", 1024, 14336, 8192, 2, triton=1.0) * 2)


def test_options():
    args = bt._parse([])
    assert args.summary is None and args.m == [1024, 2048, 4096, 8192]
    args = bt._parse(["--summary", "s.json", "--rows", "2048,1024,2048"])
    assert args.summary == "s.json" and args.m == [2048, 1024]
    for bad in (["--summary"], ["--rows", "1k"], ["--rows", "0"]):
        with pytest.raises(SystemExit):
            bt._parse(bad)
