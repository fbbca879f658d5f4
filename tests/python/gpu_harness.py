"""What the Python GPU tests share (run under torchrun, one process per GPU): the session (NCCL
process group, then tdist.init over it), the rank and world, and the runner that prints one line per
test and "N passed, M failed" last. The tests run in the same order on every rank (they are
collective), with a barrier after each."""

import os
import traceback

import tdist  # before torch: tdist's libnccl (>= 2.28) is then the one the process loads

import torch
import torch.distributed as dist

HEAP = "8G"


def setup():
    """init_process_group (NCCL) + tdist.init over it. Idempotent."""
    local = tdist._runtime._launcher_device()  # LOCAL_RANK (modulo the GPUs under TDIST_SHARE_GPUS)
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    if not tdist.is_initialized():
        tdist.init(process_group=dist.group.WORLD, heap_size=HEAP)


def teardown():
    if tdist.is_initialized():
        tdist.finalize()
    if dist.is_initialized():
        dist.destroy_process_group()


def rank():
    return dist.get_rank()


def world():
    return dist.get_world_size()


def expect_error(fn, *fragments, cls=None):
    """`fn()` raises `cls` (default tdist.Error) whose message holds every fragment."""
    cls = cls or tdist.Error
    try:
        fn()
    except cls as e:
        for f in fragments:
            assert f in str(e), f"'{f}' not in '{e}'"
    else:
        raise AssertionError(f"no {cls.__name__} raised; expected {fragments}")


def check_close(got, ref, what, tol=1e-2):
    """`got` matches the float64 reference `ref` within tol x max |ref| (at least 1e-3), with no NaN."""
    got = got.detach().double().cpu()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"{what}: NaN in the output"
    err = (got - ref).abs().max().item() if got.numel() else 0.0
    scale = max(ref.abs().max().item() if ref.numel() else 0.0, 1e-3)
    assert err <= tol * scale, f"{what}: max |err| {err:.4g} > {tol} x {scale:.4g}"


def skip_all(reason: str) -> int:
    """A whole test file skipped (an optional package it needs is missing): says why, ends with the
    closing line "0 passed, 0 failed" that scripts/gpu-test reads, and returns the exit status, 0.
    Needs no session (call it before run_tests)."""
    print(f"[rank {os.environ.get('RANK', '0')}] SKIP {reason}\n0 passed, 0 failed", flush=True)
    return 0


def run_tests(tests) -> int:
    """Runs every test on every rank in order; returns the exit status. TDIST_GPU_TESTS (names,
    comma-separated) runs only those, in the same order on every rank; a name that matches none fails."""
    wanted = [n for n in os.environ.get("TDIST_GPU_TESTS", "").split(",") if n]
    unknown = sorted(set(wanted) - {t.__name__ for t in tests})
    if unknown:
        print(f"TDIST_GPU_TESTS names no test of this file: {', '.join(unknown)}\n0 passed, 1 failed", flush=True)
        return 1
    if wanted:
        tests = [t for t in tests if t.__name__ in wanted]
    setup()
    passed = failed = 0
    for t in tests:
        try:
            t()
            passed += 1
            print(f"[rank {rank()}] PASS {t.__name__}", flush=True)
        except Exception:
            failed += 1
            print(f"[rank {rank()}] FAIL {t.__name__}\n{traceback.format_exc()}", flush=True)
        torch.cuda.synchronize()
        dist.barrier()
    teardown()
    print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


def pytest_session():
    """A module-scoped autouse fixture with one session for a test module under pytest (None
    without pytest): `_tdist_session = gpu_harness.pytest_session()`."""
    try:
        import pytest
    except ImportError:  # plain-script use does not need pytest
        return None

    @pytest.fixture(scope="module", autouse=True)
    def _tdist_session():
        setup()
        yield
        teardown()

    return _tdist_session
