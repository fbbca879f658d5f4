"""CPU tests of python -m tdist.bench's random sweeps of the collectives: every tdist method timed
beside auto and NCCL, the variants taking turns round by round, and the result file read by
bench/random_summary.py. torch, torch.distributed and tdist's ops are stand-ins here (a clock that
each call advances by a fixed time); no torch, no GPU."""

import json
import os
import sys
import types

import pytest

from repo_scripts import REPO, load_module as _load

try:  # the installed package, as the other CPU tests; else the source tree's file (no build needed)
    from tdist import bench
except ImportError:
    bench = _load("tdist.bench", os.path.join(REPO, "python", "tdist", "bench.py"))  # its package: the stand-in

SUMMARY = os.path.join(REPO, "bench", "random_summary.py")
rs = _load("random_summary_for_bench", SUMMARY) if os.path.exists(SUMMARY) else None


# --- stand-ins -----------------------------------------------------------------------------------

class Clock:
    """GPU time (ms): each call of a variant advances it by that variant's time; calls made while a
    graph captures are kept for its replays instead. `log` names the calls in order."""

    def __init__(self, us):
        self.us, self.now, self.log, self.capture = us, 0.0, [], None

    def call(self, name):
        if self.capture is not None:
            self.capture.append(name)
            return
        self.log.append(name)
        self.now += self.us(name) / 1000.0


class Tensor:
    def __init__(self, values=None, n=1):
        self.values, self.n = values, n

    def to(self, dtype):
        return self

    def clone(self):
        return Tensor(n=self.n)

    def element_size(self):
        return 2

    def tolist(self):
        return list(self.values)


def fake_torch(clock):
    torch = types.ModuleType("torch")
    torch.bfloat16, torch.float16, torch.float32, torch.float64 = "bf16", "fp16", "fp32", "fp64"
    torch.device = lambda *a: a
    torch.tensor = lambda values, **kw: Tensor(list(values))
    torch.randn = lambda n, **kw: Tensor(n=n)
    torch.empty = lambda n, **kw: Tensor(n=n)
    torch.empty_like = lambda t: Tensor(n=t.n)

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock.now

        def elapsed_time(self, end):
            return end.t - self.t

    class Graph:
        def __init__(self):
            self.calls = []

        def replay(self):
            for name in self.calls:
                clock.call(name)

    class Capture:
        def __init__(self, graph):
            self.graph = graph

        def __enter__(self):
            clock.capture = self.graph.calls

        def __exit__(self, *exc):
            clock.capture = None

    class Stream:
        def wait_stream(self, other):
            pass

    class Nothing:
        def __enter__(self):
            pass

        def __exit__(self, *exc):
            pass

    torch.cuda = types.SimpleNamespace(
        Event=Event, CUDAGraph=Graph, graph=Capture, Stream=Stream, stream=lambda s: Nothing(),
        current_stream=Stream, synchronize=lambda: None, set_device=lambda d: None,
        get_device_name=lambda: "stand-in GPU")
    return torch


def fake_dist(clock, world=2, other_rank=lambda us: us):
    """torch.distributed of rank 0 of `world`; a MAX all_reduce takes other_rank(this rank's value)
    as the other ranks' values."""
    dist = types.ModuleType("torch.distributed")
    dist.ReduceOp = types.SimpleNamespace(MAX="max")
    dist.group = types.SimpleNamespace(WORLD=types.SimpleNamespace(group_name="0"))
    dist.init_process_group = lambda *a, **kw: None
    dist.destroy_process_group = lambda: None
    dist.get_world_size = lambda: world
    dist.get_rank = lambda: 0
    dist.barrier = lambda: clock.log.append("|")

    def all_reduce(t, op=None, group=None):
        if op == "max":
            t.values = [max(v, other_rank(v)) for v in t.values]
        else:
            clock.call("nccl")

    dist.all_reduce = all_reduce
    dist.all_gather_into_tensor = lambda out, x, group=None: clock.call("nccl")
    dist.reduce_scatter_tensor = lambda out, x, group=None: clock.call("nccl")
    return dist


class Refused(Exception):
    pass


def fake_tdist(clock, refuse=lambda op, method, n: False):
    tdist = types.ModuleType("tdist")
    tdist.__version__ = "0"
    tdist._runtime = types.SimpleNamespace(_launcher_device=lambda: 0)
    tdist.init = lambda **kw: None
    tdist.finalize = lambda: None
    tdist.calls = []

    def op(name):
        def run(x, output=None, method="auto"):
            tdist.calls.append((name, x.n, method))
            if refuse(name, method, x.n):
                raise Refused(f"{method} refuses {x.n} elements")
            clock.call(f"tdist {method}")
        return run

    tdist.all_reduce, tdist.all_gather, tdist.reduce_scatter = op("all_reduce"), op("all_gather"), op("reduce_scatter")
    return tdist


@pytest.fixture
def stand_ins(monkeypatch):
    """Installs the stand-ins (torch's symmetric memory absent) for a call of bench.main."""
    def install(us, refuse=lambda op, method, n: False):
        clock = Clock(us)
        torch, dist, tdist = fake_torch(clock), fake_dist(clock), fake_tdist(clock, refuse)
        torch.distributed = dist
        monkeypatch.setitem(sys.modules, "torch", torch)
        monkeypatch.setitem(sys.modules, "torch.distributed", dist)
        monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", None)
        monkeypatch.setitem(sys.modules, "tdist", tdist)
        monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
        monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        return clock, tdist
    return install


# --- flags ---------------------------------------------------------------------------------------

def test_random_sweeps_time_every_method_unless_told():
    a = bench._parse(["--sizes", "random:3"])
    assert a.op_methods == {op: list(bench.COLLECTIVE_METHODS[op]) for op in bench.COLLECTIVES}
    assert a.op_methods["all_reduce"] == ["auto", "ll", "ll128", "one_shot", "two_shot", "ce"]  # tdist-bench's list
    assert bench._parse(["--sizes", "4K,1M"]).op_methods["all_gather"] == ["auto"]
    assert bench._parse(["--sizes", "random:3", "--methods", "auto"]).op_methods["reduce_scatter"] == ["auto"]
    g = bench._parse(["--ops", "gemm_rs,all_reduce", "--shapes", "random:2"])
    assert g.op_methods == {"gemm_rs": list(bench.GEMM_METHODS), "all_reduce": ["auto"]}  # sizes not random
    # each op takes the names it has; one that names none of its methods times auto
    m = bench._parse(["--ops", "all_reduce,all_gather,ag_gemm", "--methods", "one_shot,chunked,ll"])
    assert m.op_methods == {"all_reduce": ["one_shot", "ll"], "all_gather": ["ll"], "ag_gemm": ["chunked"]}
    assert bench._parse(["--ops", "reduce_scatter", "--methods", "all,nccl"]).op_methods["reduce_scatter"] == [
        "auto", "ll", "fused", "ce", "nccl"]
    assert bench._parse([]).rounds == 3


@pytest.mark.parametrize("argv,message", [(["--methods", "auto,warp"], "unknown method 'warp'"),
                                          (["--rounds", "0"], "--rounds must be at least 1")])
def test_bad_method_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench._parse(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


# --- timing ----------------------------------------------------------------------------------------

def test_variants_take_turns_and_keep_the_median_statistic():
    times = {"a": iter([5.0, 1.0, 1.0, 9.0, 1.0, 2.0, 2.0]), "b": iter([3.0] * 7)}  # us per call, in order
    clock = Clock(lambda name: next(times[name]))
    torch, dist = fake_torch(clock), fake_dist(clock, other_rank=lambda us: us * 1.5 if us < 2 else us)
    calls = {name: (lambda name=name: clock.call(name)) for name in ("a", "b")}
    us = bench._time_rounds(calls, 0, 7, 3, torch, dist)
    # 7 calls in 3 rounds: 3, 2, 2 of each, a's turn then b's, ranks meeting before each turn
    assert "".join(clock.log) == "|aaa|bbb|aa|bb|aa|bb"
    # a: median of all 7 calls (5, 1, 1, 9, 1, 2, 2) = 2; the other rank's 1.5 x below 2 us is not slower
    assert us == pytest.approx({"a": 2.0, "b": 3.0})
    # the slowest rank's median
    clock = Clock(lambda name: 1.0)
    slow = fake_dist(clock, other_rank=lambda us: 4 * us)
    assert bench._time_rounds({"a": lambda: clock.call("a")}, 2, 4, 3, fake_torch(clock), slow) == pytest.approx(
        {"a": 4.0})
    assert clock.log[:2] == ["a", "a"]  # warm-up first, untimed


def test_graph_timing_divides_replays_by_the_calls_captured():
    clock = Clock(lambda name: {"a": 2.0, "b": 0.5}[name])
    torch, dist = fake_torch(clock), fake_dist(clock)
    calls = {name: (lambda name=name: clock.call(name)) for name in ("a", "b")}
    us = bench._time_rounds(calls, 1, 4, 2, torch, dist, ops_per_graph=10)
    assert us == pytest.approx({"a": 2.0, "b": 0.5})
    timed = "".join(clock.log)
    assert timed.endswith("|" + "a" * 20 + "|" + "b" * 20 + "|" + "a" * 20 + "|" + "b" * 20)  # 2 replays per turn


def test_refused_variants_are_left_out(capsys):
    def refuse():
        raise Refused("no")
    ok = bench._runnable({"tdist auto": lambda: None, "tdist ce": refuse, "tdist ll": refuse}, 0, "all_reduce at 1K:",
                         quiet={"tdist ce"})
    assert list(ok) == ["tdist auto"]
    err = capsys.readouterr().err
    assert "all_reduce at 1K: tdist ll: Refused: no" in err and "tdist ce" not in err


# --- the whole sweep, and the summary of its file ----------------------------------------------------

def test_random_sweep_times_every_method_and_feeds_the_summary(stand_ins, tmp_path, capsys):
    if rs is None:
        pytest.skip("bench/random_summary.py is not beside these tests")
    speed = {"tdist auto": 10.0, "tdist ll": 9.0, "tdist ll128": 11.0, "tdist one_shot": 10.0,
             "tdist two_shot": 14.0, "tdist ce": 8.0, "nccl": 12.0}
    clock, tdist = stand_ins(lambda name: speed[name],
                             refuse=lambda op, method, n: method == "ce" and n % 2 == 1)  # ce: even counts only
    out = tmp_path / "py_coll.json"
    assert bench.main(["--ops", "all_reduce", "--sizes", "random:4", "--seed", "3", "--iters", "6",
                       "--warmup", "1", "--json", str(out)]) == 0
    sizes = bench.random_sizes(4, 3, 2)
    odd = [s for s in sizes if (s // 2) % 2]
    assert odd and len(odd) < len(sizes)  # both cases in the sweep
    # every method called with its name; ce refused on odd counts and left out without a word
    methods = {m for _, _, m in tdist.calls}
    assert methods == set(bench.COLLECTIVE_METHODS["all_reduce"])
    printed = capsys.readouterr()
    assert "Refused" not in printed.err
    assert "variants alternating in 3 rounds" in printed.out and "tdist two_shot us" in printed.out
    # per size: 3 turns of 7 variants (6 without ce), 2 calls each
    turns = "".join(x if x == "|" else "." for x in clock.log).split("|")[1:]
    assert len(turns) == 3 * (7 * (len(sizes) - len(odd)) + 6 * len(odd))
    doc = json.loads(out.read_text())
    assert doc["collective_rounds"] == 3 and doc["statistic"].startswith("median of per-call CUDA-event times")
    rows = rs.summarise([doc])
    assert [r["bytes"] for r in rows] == sizes
    for r in rows:
        even = (r["bytes"] // 2) % 2 == 0
        assert r["auto_us"] == pytest.approx(10.0) and r["baseline_us"] == pytest.approx(12.0)
        assert (r["best_method"], r["best_us"]) == (("ce", pytest.approx(8.0)) if even else ("ll", pytest.approx(9.0)))
    met = {g: ok for g, _, ok in rs.goals(rows)}
    assert met[next(g for g in met if "x NCCL at every one" in g)]
    assert not met[next(g for g in met if "best method" in g)]  # auto 1.11-1.25 x the best


def test_a_list_of_sizes_times_auto_beside_nccl(stand_ins, tmp_path):
    clock, tdist = stand_ins(lambda name: 5.0 if name == "nccl" else 4.0)
    out = tmp_path / "r.json"
    assert bench.main(["--ops", "all_gather", "--sizes", "4K", "--iters", "4", "--warmup", "0", "--rounds", "1",
                       "--json", str(out)]) == 0
    assert {m for _, _, m in tdist.calls} == {"auto"}
    assert "".join(clock.log).endswith("|" + "tdist auto" * 4 + "|" + "nccl" * 4)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["method"]) for r in rows] == [("tdist", "auto"), ("nccl", "nccl")]
    assert [r["us"] for r in rows] == pytest.approx([4.0, 5.0])


# --- the overlapped GEMMs take turns as the collectives do ----------------------------------------

class Operand(Tensor):
    """A stand-in operand: arithmetic, dtype and transposition keep it what it is."""

    def __mul__(self, other):
        return self

    __sub__ = __truediv__ = __mul__

    def t(self):
        return self


def test_gemm_variants_take_turns(stand_ins, monkeypatch):
    speed = {"tdist auto": 30.0, "tdist chunked": 31.0, "tdist sequential": 40.0, "nccl": 20.0, "mm": 25.0}
    clock, tdist = stand_ins(lambda name: speed[name])
    torch = sys.modules["torch"]
    torch.Generator = lambda device=None: types.SimpleNamespace(manual_seed=lambda s: None)
    torch.rand = lambda *shape, **kw: Operand()
    torch.empty = lambda *shape, **kw: Operand()
    torch.matmul = lambda x, y: (clock.call("mm"), Operand())[1]
    torch.cuda.empty_cache = lambda: None
    tdist._torch_ops = types.SimpleNamespace(gemm_method=lambda op, a, b, m, method: "chunked" if method == "auto"
                                             else method)
    tdist.gemm_rs = lambda a, b, method="auto": (clock.call(f"tdist {method}"), Operand())[1]
    monkeypatch.setattr(bench, "_rel_diff", lambda x, ref, torch, dist: 0.0)
    args = bench._parse(["--ops", "gemm_rs", "--rows", "4096", "--methods", "auto,chunked,sequential",
                         "--iters", "6", "--warmup", "1"])
    dist = torch.distributed
    rows = bench._bench_gemm("gemm_rs", args, "bf16", tdist, torch, dist)
    assert rows, "no shapes"
    for row in rows:
        # nccl+mm is a matmul and a reduce-scatter: 25 + 20 us
        assert row["us"] == pytest.approx({"tdist auto": 30.0, "tdist chunked": 31.0, "tdist sequential": 40.0,
                                           "nccl+mm": 45.0, "mm": 25.0})
        assert row["resolved"] == {"auto": "chunked", "chunked": "chunked", "sequential": "sequential"}
    # one shape's timed calls: 3 turns of the 5 variants (2 calls each), ranks meeting before each turn
    turns = [t for t in "".join(x if x == "|" else "." for x in clock.log).split("|")[1:]]
    assert len(turns) == 3 * 5 * len(rows)
