"""CPU tests of bench/random_summary.py (the random-shape summary of tdist-bench and
bench_gemm_overlap results): rows, goals and errors on hand-made result files. No torch, no GPU."""

import json

import pytest

from repo_scripts import load_script

rs = load_script("bench/random_summary.py")


def doc(bench, rows):
    return {"schema": "tdist.bench/1", "bench": bench, "gpu": "test", "world_size": 2, "rows": rows}


def coll(op, nbytes, times, nccl):
    """tdist-bench rows of one size: a tdist row per method (auto as auto:<resolved>), NCCL's."""
    rows = [{"op": op, "bytes": nbytes, "impl": "tdist", "method": m, "us": us} for m, us in times.items()]
    return rows + [{"op": op, "bytes": nbytes, "impl": "nccl", "method": "nccl", "us": nccl}]


def gemm(op, m, times, baseline, alone):
    """bench_gemm_overlap rows of one shape."""
    shape = {"op": op, "m": m, "n": 4096, "k": 8192}
    rows = [dict(shape, impl="tdist", method=meth, us=us) for meth, us in times.items()]
    return rows + [dict(shape, impl="gemm", method="tdist::Gemm", us=alone),
                   dict(shape, impl="nccl+cublas", method="baseline", us=baseline)]


def test_rows_name_auto_best_and_baselines():
    rows = rs.summarise([
        doc("tdist-bench", coll("all_reduce", 3001 * 2, {"auto:ll": 5.0, "ll": 5.1, "one_shot": 4.0}, 6.0)),
        doc("gemm_overlap", gemm("gemm_rs", 3000, {"auto": 110.0, "fused": 105.0, "sequential": 130.0},
                                 140.0, 100.0)),
    ])
    assert rows == [
        {"op": "all_reduce", "m": None, "n": None, "k": None, "bytes": 6002, "auto_us": 5.0, "best_us": 4.0,
         "best_method": "one_shot", "baseline_us": 6.0, "gemm_us": None},
        {"op": "gemm_rs", "m": 3000, "n": 4096, "k": 8192, "bytes": None, "auto_us": 110.0, "best_us": 105.0,
         "best_method": "fused", "baseline_us": 140.0, "gemm_us": 100.0},
    ]


def test_null_times_and_missing_rows_give_nulls():
    rows = rs.summarise([doc("tdist-bench", coll("all_gather", 4096, {"auto:ll": None, "sm": 3.0}, None))])
    assert rows[0]["auto_us"] is None and rows[0]["baseline_us"] is None
    assert rows[0]["best_us"] == 3.0 and rows[0]["best_method"] == "sm"
    tie = rs.summarise([doc("tdist-bench", coll("all_reduce", 4096, {"auto:ll": 3.0, "ll": 3.0}, 5.0))])
    assert tie[0]["best_method"] == "ll"  # a tie names the method, not auto's row of it
    goals = rs.goals(rows)  # nothing to compare auto with: no ratio goal, only the count
    assert [g for g, _, _ in goals] == ["all_gather: at least 60 sizes"]


def test_goals_met_and_missed():
    good = []
    for i in range(60):
        good += coll("reduce_scatter", 1000 + 2 * i, {"auto:ll": 10.0, "ll": 10.0, "fused": 12.0}, 10.2)
    met = {g: ok for g, _, ok in rs.goals(rs.summarise([doc("tdist-bench", good)]))}
    assert met and all(met.values()), met
    # one size 4 % slower than NCCL misses the every-size goal; 5 sizes of 60 over 1.05 x best miss the 95 %
    bad = list(good)
    bad += coll("reduce_scatter", 9999 * 2, {"auto:ll": 10.4, "ll": 10.4}, 10.0)
    for i in range(5):
        bad += coll("reduce_scatter", 20000 + 2 * i, {"auto:fused": 12.0, "ll": 10.0}, 12.0)
    result = {g: (measured, ok) for g, measured, ok in rs.goals(rs.summarise([doc("tdist-bench", bad)]))}
    every = next(k for k in result if "at every one of" in k)
    share = next(k for k in result if "best method" in k)
    assert result[every] == ("worst 1.040", False)
    assert not result[share][1] and result[share][0].startswith("92.4%")


def test_median_gemm_ratio_goal_only_counts_m_from_2048():
    rows = []
    for i in range(40):
        m = 1024 if i < 20 else 4096
        alone = 100.0
        auto = 150.0 if m < 2048 else 105.0  # small M far from the GEMM alone: not in the median goal
        rows += gemm("ag_gemm", m + i, {"auto": auto, "chunked": auto}, auto * 1.2, alone)
    result = {g: (measured, ok) for g, measured, ok in rs.goals(rs.summarise([doc("gemm_overlap", rows)]))}
    median = next(k for k in result if k.startswith("ag_gemm: median"))
    assert result[median] == ("1.050", True) and "(20 shapes)" in median


def test_main_writes_rows_and_checks(tmp_path, capsys):
    coll_path = tmp_path / "c.json"
    coll_path.write_text(json.dumps(doc("tdist-bench", coll("all_reduce", 2048, {"auto:ll": 2.0, "ll": 2.0}, 1.0))))
    out = tmp_path / "summary.json"
    assert rs.main([str(coll_path), "--out", str(out)]) == 0  # a report: missed goals do not fail it
    assert rs.main([str(coll_path), "--check"]) == 1  # auto at 2x NCCL
    printed = capsys.readouterr().out
    assert "MISSED" in printed and "worst 2.000" in printed
    assert json.loads(out.read_text())[0]["auto_us"] == 2.0


def test_bad_input_is_named(tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    assert rs.main([str(other)]) == 2
    assert "not a result file of schema tdist.bench/1" in capsys.readouterr().err
    assert rs.main([str(tmp_path / "missing.json")]) == 2
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(doc("put_bandwidth", [{"op": "put", "bytes": 1, "impl": "tdist", "us": 1.0}])))
    assert rs.main([str(empty)]) == 2
    assert "no collective or overlapped-GEMM rows" in capsys.readouterr().err


def test_plot_is_drawn(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    rows = rs.summarise([doc("tdist-bench", coll("all_reduce", 4096, {"auto:ll": 2.0, "ll": 1.9}, 2.5)),
                         doc("gemm_overlap", gemm("gemm_rs", 4096, {"auto": 110.0}, 120.0, 100.0))])
    path = tmp_path / "p.png"
    rs.plot(rows, str(path), "test")
    assert path.stat().st_size > 1000


# Result files laid out as each producer writes them: tools/tdist-bench (C++), bench/gemm_overlap.cu
# (C++) and python -m tdist.bench. The rows mirror the producers' JSON writers field by field, so
# that a name the summary does not know shows up here.


def header(bench):
    return {"schema": "tdist.bench/1", "tdist_version": "0", "bench": bench, "gpu": "NVIDIA H200", "world_size": 2,
            "dtype": "bf16", "command": "x", "seed": 1, "rows": []}


# --- tools/tdist-bench --method all: per method the tdist row (auto as auto:<picked>), NCCL's row once,
# after the first method's ------------------------------------------------------------------------------

def cpp_collective(doc, op, nbytes, times, nccl, pdl=(True,)):
    first = True
    for method, us in times.items():
        for index, on in enumerate(pdl):
            t = us if index == 0 else us * 1.01
            doc["rows"].append({"op": op, "bytes": nbytes, "count": nbytes // 2, "impl": "tdist", "method": method,
                                "pdl": on, "timing": "events", "us": t, "algbw_gbps": nbytes / t / 1e3,
                                "busbw_gbps": nbytes / t / 1e3, "speedup_vs_nccl": nccl / t, "wrong": 0})
        if first:
            doc["rows"].append({"op": op, "bytes": nbytes, "count": nbytes // 2, "impl": "nccl", "method": "nccl",
                                "timing": "events", "us": nccl, "algbw_gbps": 1.0, "busbw_gbps": 1.0})
            first = False
    return doc


# --- bench_gemm_overlap: per shape the tdist rows (method as asked, resolved), then tdist::Gemm alone,
# NCCL + cuBLAS, the collective alone and cuBLAS alone ----------------------------------------------

def cpp_gemm(doc, op, m, n, k, times, resolved, gemm, baseline, nccl, cublas):
    def row(impl, method, us):
        return {"op": op, "m": m, "n": n, "k": k, "n_total": 2 * n if op == "ag_gemm" else n,
                "k_total": k if op == "ag_gemm" else 2 * k, "note": "--shapes", "impl": impl, "method": method,
                "us": us, "tflops": 2.0 * m * n * k / us * 1e-6}
    for method, us in times.items():
        t = row("tdist", method, us)
        t.update(resolved=resolved.get(method, method), max_rel_diff=1e-3, ratio_gemm=us / gemm,
                 ratio_baseline=us / baseline)
        doc["rows"].append(t)
    doc["rows"] += [row("gemm", "tdist::Gemm", gemm), row("nccl+cublas", "baseline", baseline),
                    row("nccl", "nccl", nccl), row("cublas", "cublas", cublas)]
    return doc


# --- python -m tdist.bench: collectives (tdist per method, nccl, symm_mem 1-shot / 2-shot for
# AllReduce) and GEMMs ("tdist <method>", nccl+mm, mm, symm_mem; a failed variant as an error row) -----

def py_collective(doc, op, nbytes, times, nccl, symm=None):
    cells = {f"tdist {m}": us for m, us in times.items()}
    cells["nccl"] = nccl
    cells.update({f"symm_mem {m}": us for m, us in (symm or {}).items()})
    for name, us in cells.items():
        impl, _, method = name.partition(" ")
        doc["rows"].append({"op": op, "bytes": nbytes, "impl": impl, "method": method or impl, "timing": "events",
                            "us": us, "algbw_gbps": None, "busbw_gbps": None})
    return doc


def py_gemm(doc, op, m, n, k, times, resolved, nccl_mm, mm, symm=None, errors=()):
    us = {f"tdist {meth}": t for meth, t in times.items()}
    us.update({"nccl+mm": nccl_mm, "mm": mm})
    if symm is not None:
        us["symm_mem"] = symm
    for name, t in us.items():
        impl, _, method = name.partition(" ")
        row = {"op": op, "m": m, "n": n, "k": k, "note": "--shapes", "impl": impl, "method": method or impl,
               "us": t, "tflops": 1.0}
        if impl == "tdist":
            row["resolved"] = resolved[method]
        doc["rows"].append(row)
    for name in errors:
        impl, _, method = name.partition(" ")
        doc["rows"].append({"op": op, "m": m, "n": n, "k": k, "impl": impl, "method": method, "us": None,
                            "error": "Error: refused"})
    return doc


def test_cpp_tdist_bench_rows():
    doc = cpp_collective(header("tdist-bench"), "all_reduce", 6002,
                         {"auto:one_shot": 5.0, "ll": 4.5, "ll128": 4.8, "one_shot": 5.0, "two_shot": 7.0}, 6.0,
                         pdl=(True, False))
    cpp_collective(doc, "reduce_scatter", 8192, {"auto:ll": 3.0, "ll": 3.0, "fused": 3.3}, 2.9)
    rows = rs.summarise([doc])
    assert rows[0] == {"op": "all_reduce", "m": None, "n": None, "k": None, "bytes": 6002, "auto_us": 5.0,
                       "best_us": 4.5, "best_method": "ll", "baseline_us": 6.0, "gemm_us": None}
    assert rows[1]["best_method"] == "ll" and rows[1]["baseline_us"] == 2.9  # a tie names the method
    result = {g: (measured, ok) for g, measured, ok in rs.goals(rows)}
    every = next(k for k in result if "at every one of 2 sizes" in k)
    assert result[every] == ("worst 1.034", False)  # 3.0 / 2.9: auto over NCCL by 3.4 %
    assert "x NCCL at" in every


def test_cpp_gemm_overlap_rows_take_cublas_as_the_gemm_and_not_the_collective_alone():
    doc = cpp_gemm(header("gemm_overlap"), "gemm_rs", 4096, 8192, 3584,
                   {"auto": 120.0, "fused": 118.0, "chunked": 125.0, "sequential": 150.0, "baseline": 160.0},
                   {"auto": "fused"}, gemm=112.0, baseline=158.0, nccl=40.0, cublas=110.0)
    (row,) = rs.summarise([doc])
    # the collective alone (40 us) is no baseline; cuBLAS (110), not tdist::Gemm (112), is the GEMM alone
    assert row == {"op": "gemm_rs", "m": 4096, "n": 8192, "k": 3584, "bytes": None, "auto_us": 120.0,
                   "best_us": 118.0, "best_method": "fused", "baseline_us": 158.0, "gemm_us": 110.0}
    # auto best: its row names the method it ran
    fast = cpp_gemm(header("gemm_overlap"), "ag_gemm", 3000, 7168, 8192, {"auto": 90.0, "chunked": 95.0},
                    {"auto": "fused"}, gemm=85.0, baseline=120.0, nccl=30.0, cublas=84.0)
    (row,) = rs.summarise([fast])
    assert row["best_method"] == "auto:fused" and row["gemm_us"] == 84.0
    # without a cuBLAS row, tdist's own GEMM alone
    fast["rows"] = [r for r in fast["rows"] if r["impl"] != "cublas"]
    assert rs.summarise([fast])[0]["gemm_us"] == 85.0


def test_python_bench_rows_read_its_names():
    doc = py_collective(header("python"), "all_reduce", 4098, {"auto": 8.0, "ll": 7.9, "one_shot": 9.0}, 10.0,
                        symm={"1-shot": 8.5, "2-shot": 7.0})
    py_collective(doc, "all_gather", 1 << 20, {"auto": 20.0, "sm": 20.0}, 21.0)
    py_gemm(doc, "ag_gemm", 4096, 7168, 8192, {"auto": 200.0, "fused": 199.0, "chunked": 210.0},
            {"auto": "fused", "fused": "fused", "chunked": "chunked"}, nccl_mm=230.0, mm=190.0, symm=220.0)
    py_gemm(doc, "gemm_rs", 4097, 8192, 7168, {"auto": 300.0, "chunked": 300.0},
            {"auto": "chunked", "chunked": "chunked"}, nccl_mm=None, mm=280.0, errors=("tdist sequential",))
    ar, ag, agg, rsg = rs.summarise([doc])
    # torch's symm_mem AllReduce is an extra field; NCCL stays the collectives' baseline
    assert ar == {"op": "all_reduce", "m": None, "n": None, "k": None, "bytes": 4098, "auto_us": 8.0,
                  "best_us": 7.9, "best_method": "ll", "baseline_us": 10.0, "gemm_us": None, "torch_fused_us": 7.0}
    assert rs.goal_baseline_us(ar) == 10.0
    assert ag["best_method"] == "sm" and "torch_fused_us" not in ag
    assert agg == {"op": "ag_gemm", "m": 4096, "n": 7168, "k": 8192, "bytes": None, "auto_us": 200.0,
                   "best_us": 199.0, "best_method": "fused", "baseline_us": 230.0, "gemm_us": 190.0,
                   "torch_fused_us": 220.0}
    assert rs.goal_baseline_us(agg) == 220.0  # torch's fused op beats NCCL + matmul here
    # unequal M: no nccl+mm (null time), the refused method's error row ignored
    assert rsg["baseline_us"] is None and rsg["best_method"] == "chunked" and rsg["gemm_us"] == 280.0


def test_torch_fused_op_faster_than_auto_misses_the_gemm_goal():
    doc = header("python")
    for i in range(40):
        m = 2048 + 128 * i
        # auto 5 % behind torch's fused op at one shape, 2 % ahead of NCCL + matmul everywhere
        fused = 100.0 / 1.05 if i == 7 else 110.0
        py_gemm(doc, "ag_gemm", m, 7168, 8192, {"auto": 100.0, "chunked": 101.0}, {"auto": "chunked",
                "chunked": "chunked"}, nccl_mm=102.0, mm=95.0, symm=fused)
    rows = rs.summarise([doc])
    assert all(r["baseline_us"] == 102.0 for r in rows)
    result = {g: (measured, ok) for g, measured, ok in rs.goals(rows)}
    every = next(k for k in result if "at every one of 40 shapes" in k)
    assert "torch's fused op" in every
    assert result[every] == ("worst 1.050", False)
    best = next(k for k in result if "best method" in k)
    assert result[best] == ("100.0% of 40", True)
    median = next(k for k in result if k.startswith("ag_gemm: median"))
    assert result[median] == ("1.053", True)  # 100 / 95 against mm (cuBLAS alone)
    # the same rows without torch's fused op meet it
    for r in rows:
        del r["torch_fused_us"]
    result = {g: (measured, ok) for g, measured, ok in rs.goals(rows)}
    every = next(k for k in result if "at every one of 40 shapes" in k)
    assert "torch" not in every and result[every] == ("worst 0.980", True)


def test_one_case_from_both_producers_takes_each_best():
    cpp = cpp_gemm(header("gemm_overlap"), "gemm_rs", 4096, 8192, 3584, {"auto": 120.0, "fused": 121.0},
                   {"auto": "fused"}, gemm=112.0, baseline=130.0, nccl=40.0, cublas=111.0)
    py = py_gemm(header("python"), "gemm_rs", 4096, 8192, 3584, {"auto": 123.0, "chunked": 119.0},
                 {"auto": "fused", "chunked": "chunked"}, nccl_mm=125.0, mm=113.0, symm=140.0)
    (row,) = rs.summarise([cpp, py])
    assert (row["auto_us"], row["best_us"], row["best_method"]) == (120.0, 119.0, "chunked")
    assert (row["baseline_us"], row["gemm_us"], row["torch_fused_us"]) == (125.0, 111.0, 140.0)


def test_goal_table_file_and_check(tmp_path, capsys):
    files = []
    for name, doc in (("c.json", cpp_collective(header("tdist-bench"), "all_gather", 4096,
                                                {"auto:ll": 2.0, "ll": 2.0, "sm": 3.0}, 1.0)),
                      ("g.json", cpp_gemm(header("gemm_overlap"), "ag_gemm", 4096, 7168, 8192, {"auto": 100.0},
                                          {"auto": "fused"}, gemm=99.0, baseline=120.0, nccl=30.0, cublas=98.0))):
        path = tmp_path / name
        path.write_text(json.dumps(doc))
        files.append(str(path))
    goals = tmp_path / "goals.txt"
    assert rs.main(files + ["--goals", str(goals)]) == 0
    assert rs.main(files + ["--check"]) == 1  # AllGather auto at 2 x NCCL
    table = goals.read_text().splitlines()
    printed = capsys.readouterr().out.splitlines()
    assert table == printed[:len(table)]
    assert any(line.startswith("MISSED") and "collectives: auto <= 1.03 x NCCL" in line and "worst 2.000" in line
               for line in table)
    assert any(line.startswith("met") and "overlapped GEMMs: auto <= 1.03 x NCCL + cuBLAS" in line for line in table)
    assert any("ag_gemm: median auto / GEMM alone" in line and "1.020" in line for line in table)
