"""Shared by the CPU tests (test_*.py) and the GPU tests (gpu_test_ops.py)."""

import os
import tempfile

# JIT cache of the tests: a fresh folder unless the caller chose one (read when tdist first compiles).
os.environ.setdefault("TDIST_CACHE_DIR", tempfile.mkdtemp(prefix="tdist-pytest-cache-"))


def pytest_unconfigure(config):
    # One last line, after pytest's own summary: "N passed, M failed".
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    passed = len(reporter.stats.get("passed", []))
    failed = len(reporter.stats.get("failed", [])) + len(reporter.stats.get("error", []))
    print(f"{passed} passed, {failed} failed", flush=True)
