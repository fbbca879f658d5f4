"""The command-line tools shipped in the wheel, in <package>/bin: tdistrun (local launcher),
tdist-compile (ahead-of-time JIT cache), tdist-bench (collectives beside NCCL). pip installs a console
script for each; `python -m tdist.run TOOL [args...]` runs them as well.

The tools find libtdist and the nvidia-* wheels' libraries through their RUNPATH; libraries found
elsewhere (the system's, by tdist's own search) are passed on through LD_LIBRARY_PATH.
"""

from __future__ import annotations

import os
import sys

TOOLS = ("tdistrun", "tdist-compile", "tdist-bench")


def tool_path(name: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", name)


def _environment() -> dict:
    from ._libs import load_libraries

    env = dict(os.environ)
    dirs = []
    for where in load_libraries().values():
        d = os.path.dirname(where) if os.path.isabs(where) else None
        if d and d not in dirs:
            dirs.append(d)
    if dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(dirs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    return env


def run_tool(name: str, args=None) -> int:
    """Replaces this process with the tool (returns only when it cannot start)."""
    args = sys.argv[1:] if args is None else list(args)
    path = tool_path(name)
    if not os.access(path, os.X_OK):
        print(f"{name}: error: {path} is missing or not executable (this tdist was installed without its "
              "tools; build them with CMake: ninja -C build tools)", file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(path, [name] + args, _environment())
    except OSError as e:
        print(f"{name}: error: cannot execute {path}: {e}", file=sys.stderr)
        return 1
    return 1  # not reached


def tdistrun() -> int:
    return run_tool("tdistrun")


def tdist_compile() -> int:
    return run_tool("tdist-compile")


def tdist_bench() -> int:
    return run_tool("tdist-bench")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m tdist.run {{{','.join(TOOLS)}}} [args...]\n\n" + __doc__.split("\n\n")[0])
        return 0 if argv else 2
    if argv[0] not in TOOLS:
        print(f"python -m tdist.run: error: unknown tool '{argv[0]}' (expected one of {', '.join(TOOLS)})",
              file=sys.stderr)
        return 2
    return run_tool(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
