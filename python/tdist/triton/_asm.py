"""PTX text of the Triton primitives (tdist.triton.language), built at trace time.

Every spin-wait here mirrors include/tdist/device/signal.cuh + timeout.cuh: one acquire load, then
relaxed polls, %globaltimer read every 256 polls, one confirming acquire once the condition holds;
past the timeout it prints the C++ device API's diagnostic (rank, block, thread, address, expected
and seen value) through vprintf and traps. Plain Python: the strings are testable without Triton.
"""

from __future__ import annotations

import struct

SCOPES = ("gpu", "sys")
CMPS = {"eq": "==", "ne": "!=", "gt": ">", "ge": ">=", "lt": "<", "le": "<="}
SIGNAL_OPS = ("set", "add")

# Polls between two reads of %globaltimer (SpinDeadline in timeout.cuh).
kPollsPerClockRead = 256

# vprintf argument buffer of the diagnostic: each argument at its natural alignment.
#   0 f64 timeout s | 8 i32 rank | 12,16,20 i32 ctaid.xyz | 24,28,32 i32 tid.xyz | 40 ptr address
#   48 u64 expected | 56 u64 seen
_DIAG_ARGS_BYTES = 64


def check_scope(scope, what: str = "scope") -> str:
    if scope not in SCOPES:
        raise ValueError(f"tdist.triton: {what} must be 'gpu' or 'sys', got {scope!r}")
    return scope


def check_cmp(cmp) -> str:
    if cmp not in CMPS:
        raise ValueError(f"tdist.triton: cmp must be one of {', '.join(map(repr, CMPS))}, got {cmp!r}")
    return cmp


def check_bits(bits, what: str) -> int:
    if bits not in (32, 64):
        raise ValueError(f"tdist.triton: {what} must point to 32- or 64-bit integers (flags), got {bits}-bit elements")
    return bits


def diagnostic_format(what: str, cmp: str) -> str:
    """The printf format of timeout.cuh's wait_timed_out, with `what` and the comparison filled in."""
    return (f"tdist: {what} timed out after %.1f s: rank %d, block (%d,%d,%d), thread (%d,%d,%d), "
            f"address %p, waiting for value {CMPS[cmp]} %llu, seen %llu\n")


def _store_string(buffer: str, text: str) -> list[str]:
    data = text.encode() + b"\0"
    data += b"\0" * (-len(data) % 8)
    return [f"st.local.u64 [{buffer}+{i}], {struct.unpack('<Q', data[i:i + 8])[0]};" for i in range(0, len(data), 8)]


def _f64_hex(x: float) -> str:
    return "0d" + struct.pack(">d", x).hex().upper()


def _diagnostic(what: str, cmp: str, bits: int, seen: str, addr: str, expected: str, timeout: str, rank: str) -> list[str]:
    """Prints the diagnostic (every timed-out thread) and traps."""
    fmt = diagnostic_format(what, cmp)
    fmt_bytes = len(fmt.encode()) + 1
    fmt_bytes += -fmt_bytes % 8
    lines = [f".local .align 8 .b8 tdist_fmt[{fmt_bytes}];", f".local .align 8 .b8 tdist_args[{_DIAG_ARGS_BYTES}];",
             ".reg .f64 %tdist_s;", ".reg .b64 %tdist_pf, %tdist_pa, %tdist_w;", ".reg .b32 %tdist_i;"]
    lines += _store_string("tdist_fmt", fmt)
    lines += [f"cvt.rn.f64.u64 %tdist_s, {timeout};", f"mul.f64 %tdist_s, %tdist_s, {_f64_hex(1e-9)};",
              "st.local.f64 [tdist_args+0], %tdist_s;", f"st.local.u32 [tdist_args+8], {rank};"]
    for offset, reg in ((12, "%ctaid.x"), (16, "%ctaid.y"), (20, "%ctaid.z"), (24, "%tid.x"), (28, "%tid.y"),
                        (32, "%tid.z")):
        lines += [f"mov.u32 %tdist_i, {reg};", f"st.local.u32 [tdist_args+{offset}], %tdist_i;"]
    lines.append(f"st.local.u64 [tdist_args+40], {addr};")
    for offset, reg in ((48, expected), (56, seen)):
        if bits == 32:
            lines += [f"cvt.u64.u32 %tdist_w, {reg};", f"st.local.u64 [tdist_args+{offset}], %tdist_w;"]
        else:
            lines.append(f"st.local.u64 [tdist_args+{offset}], {reg};")
    lines += ["mov.u64 %tdist_pf, tdist_fmt;", "cvta.local.u64 %tdist_pf, %tdist_pf;",
              "mov.u64 %tdist_pa, tdist_args;", "cvta.local.u64 %tdist_pa, %tdist_pa;",
              "{", ".param .b64 tdist_p0;", ".param .b64 tdist_p1;", ".param .b32 tdist_rv;",
              "st.param.b64 [tdist_p0], %tdist_pf;", "st.param.b64 [tdist_p1], %tdist_pa;",
              "call.uni (tdist_rv), vprintf, (tdist_p0, tdist_p1);", "}", "trap;"]
    return lines


def spin_wait(scope: str, cmp: str, bits: int, leader_only: bool, what: str = "wait") -> tuple[str, str]:
    """(asm, constraints) of a bounded spin until cmp(*addr, expected) holds.

    Operands: $0 seen (out), $1 address, $2 expected, $3 timeout in ns (u64), $4 rank (printed).
    leader_only: only thread 0 of the block spins (the others return 0 at once and must meet it at a
    bar.sync); else every thread spins on its own elements.
    """
    check_scope(scope)
    check_cmp(cmp)
    check_bits(bits, "flags")
    t = "u32" if bits == 32 else "u64"
    r = "r" if bits == 32 else "l"
    lines = ["{", ".reg .pred %tdist_p;", ".reg .u64 %tdist_t0, %tdist_t1;", ".reg .u32 %tdist_n, %tdist_x;"]
    if leader_only:
        lines += ["mov.u32 %tdist_x, %tid.x;", "setp.ne.u32 %tdist_p, %tdist_x, 0;", f"mov.b{bits} $0, 0;",
                  "@%tdist_p bra tdist_done;"]
    lines += [f"ld.acquire.{scope}.{t} $0, [$1];", f"setp.{cmp}.{t} %tdist_p, $0, $2;", "@%tdist_p bra tdist_done;",
              "mov.u64 %tdist_t0, %globaltimer;", "mov.u32 %tdist_n, 0;",
              "tdist_poll:",
              # Poll relaxed, then confirm with one acquire: cheaper than an acquire per poll.
              f"ld.relaxed.{scope}.{t} $0, [$1];", f"setp.{cmp}.{t} %tdist_p, $0, $2;", "@%tdist_p bra tdist_confirm;",
              "add.u32 %tdist_n, %tdist_n, 1;", f"and.b32 %tdist_x, %tdist_n, {kPollsPerClockRead - 1};",
              "setp.ne.u32 %tdist_p, %tdist_x, 0;", "@%tdist_p bra tdist_poll;",
              "mov.u64 %tdist_t1, %globaltimer;", "sub.u64 %tdist_t1, %tdist_t1, %tdist_t0;",
              "setp.le.u64 %tdist_p, %tdist_t1, $3;", "@%tdist_p bra tdist_poll;"]
    lines += _diagnostic(what, cmp, bits, "$0", "$1", "$2", "$3", "$4")
    lines += ["tdist_confirm:", f"ld.acquire.{scope}.{t} $0, [$1];", "tdist_done:", "}"]
    return "\n".join(lines), f"={r},l,{r},l,r"


def load(semantic: str, scope: str, bits: int) -> tuple[str, str]:
    """(asm, constraints) of ld.<acquire|relaxed>.<scope>: $0 value, $1 address."""
    assert semantic in ("acquire", "relaxed")
    check_scope(scope)
    check_bits(bits, "ptr")
    t = "u32" if bits == 32 else "u64"
    r = "r" if bits == 32 else "l"
    return f"ld.{semantic}.{scope}.{t} $0, [$1];", f"={r},l"


def leader_store(semantic: str, op: str, scope: str, bits: int) -> tuple[str, str]:
    """(asm, constraints) of a flag update by thread 0 of the block only: st.<semantic>.<scope> (set)
    or red.<semantic>.<scope>.add (add). $0 dummy out, $1 address, $2 value."""
    assert semantic in ("release", "relaxed")
    check_scope(scope)
    check_bits(bits, "flag")
    if op not in SIGNAL_OPS:
        raise ValueError(f"tdist.triton: op must be 'set' or 'add', got {op!r}")
    t = "u32" if bits == 32 else "u64"
    r = "r" if bits == 32 else "l"
    access = f"st.{semantic}.{scope}.{t} [$1], $2;" if op == "set" else f"red.{semantic}.{scope}.add.{t} [$1], $2;"
    asm = "\n".join(["{", ".reg .pred %tdist_p;", ".reg .u32 %tdist_x;", "mov.u32 %tdist_x, %tid.x;",
                     "setp.eq.u32 %tdist_p, %tdist_x, 0;", f"@%tdist_p {access}", "mov.u32 $0, 0;", "}"])
    return asm, f"=r,l,{r}"


def leader_atomic_add(scope: str, bits: int) -> tuple[str, str]:
    """(asm, constraints): thread 0 does atom.acq_rel.<scope>.add and gets the old value; the other
    threads get 0. $0 old, $1 address, $2 value."""
    check_scope(scope)
    check_bits(bits, "counter")
    t = "u32" if bits == 32 else "u64"
    r = "r" if bits == 32 else "l"
    asm = "\n".join(["{", ".reg .pred %tdist_p;", ".reg .u32 %tdist_x;", "mov.u32 %tdist_x, %tid.x;",
                     "setp.eq.u32 %tdist_p, %tdist_x, 0;", f"mov.b{bits} $0, 0;",
                     f"@%tdist_p atom.acq_rel.{scope}.add.{t} $0, [$1], $2;", "}"])
    return asm, f"={r},l,{r}"


def fence(scope: str) -> tuple[str, str]:
    """(asm, constraints) of fence.acq_rel.<scope>; $0 dummy out, $1 dummy in."""
    check_scope(scope)
    return f"fence.acq_rel.{scope};\nmov.u32 $0, $1;", "=r,r"


# consume_token: a zero the compiler cannot fold, computed from the waited value.
TOKEN_ZERO_32 = ("and.b32 $0, $1, 0;", "=r,r")
TOKEN_ZERO_64 = ("and.b64 $0, $1, 0;", "=l,l")
