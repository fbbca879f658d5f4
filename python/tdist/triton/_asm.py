"""PTX text of the Triton primitives (tdist.triton.language), built at trace time.

Every spin-wait here mirrors include/tdist/device/signal.cuh + timeout.cuh: one acquire load, then
relaxed polls, %globaltimer read every 256 polls, one confirming acquire once the condition holds.
Past the timeout it follows the process's timeout action, as wait_timed_out does:
  - abort (the heap descriptor holds the address of the process's FaultRecord): the first wait to time
    out claims the record (atom.cas), fills it, prints the C++ device API's diagnostic and returns the
    last value seen; every other wait of the process returns at its next clock check once the record
    is claimed, so kernels drain and the host raises tdist.DeviceTimeoutError;
  - trap (the descriptor holds 0 there): print the diagnostic and trap.
Plain Python: the strings are testable without Triton.
"""

from __future__ import annotations

import struct

SCOPES = ("gpu", "sys")
CMPS = {"eq": "==", "ne": "!=", "gt": ">", "ge": ">=", "lt": "<", "le": "<="}
SIGNAL_OPS = ("set", "add")

# Polls between two reads of %globaltimer (SpinDeadline in timeout.cuh).
kPollsPerClockRead = 256

# FaultRecord of include/tdist/device/timeout.cuh (host-mapped), byte offsets:
#   0 u32 state | 4 u32 site | 8 i32 rank | 12 u32 cmp | 16,20,24 u32 block.xyz | 28,32,36 u32 thread.xyz
#   40 u64 address | 48 u64 expected | 56 u64 seen | 64 u64 timeout_ns
kFaultNone, kFaultClaimed, kFaultRecorded = 0, 1, 2
kWaitSiteUser = 6  # WaitSite::kUser: the host names it "a user kernel's wait"
CMP_CODES = {c: i for i, c in enumerate(CMPS)}  # the order of Cmp in device/common.cuh

# Suffix of the diagnostic under the abort action (wait_timed_out's last %s).
ABORT_SUFFIX = "; aborting this process's waits"

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


def diagnostic_format(what: str, cmp: str, suffix: str = "") -> str:
    """The printf format of timeout.cuh's wait_timed_out, with `what`, the comparison and the suffix ("" when
    the wait traps, ABORT_SUFFIX when it aborts) filled in."""
    return (f"tdist: {what} timed out after %.1f s: rank %d, block (%d,%d,%d), thread (%d,%d,%d), "
            f"address %p, waiting for value {CMPS[cmp]} %llu, seen %llu{suffix}\n")


def _store_string(buffer: str, text: str) -> list[str]:
    data = text.encode() + b"\0"
    data += b"\0" * (-len(data) % 8)
    return [f"st.local.u64 [{buffer}+{i}], {struct.unpack('<Q', data[i:i + 8])[0]};" for i in range(0, len(data), 8)]


def _f64_hex(x: float) -> str:
    return "0d" + struct.pack(">d", x).hex().upper()


def _diagnostic(what: str, cmp: str, bits: int, seen: str, addr: str, expected: str, timeout: str, rank: str,
                trap: str) -> list[str]:
    """Prints the diagnostic; `trap` (a predicate register) set: without the abort suffix, then traps."""
    fmt = diagnostic_format(what, cmp, ABORT_SUFFIX)
    # Under trap the suffix is cut off: "\n\0" written over its first two bytes.
    cut = len(diagnostic_format(what, cmp).encode()) - 1
    fmt_bytes = len(fmt.encode()) + 1
    fmt_bytes += -fmt_bytes % 8
    lines = [f".local .align 8 .b8 tdist_fmt[{fmt_bytes}];", f".local .align 8 .b8 tdist_args[{_DIAG_ARGS_BYTES}];",
             ".reg .f64 %tdist_s;", ".reg .b64 %tdist_pf, %tdist_pa, %tdist_w;", ".reg .b32 %tdist_i;"]
    lines += _store_string("tdist_fmt", fmt)
    lines += [f"@{trap} st.local.u8 [tdist_fmt+{cut}], 10;", f"@{trap} st.local.u8 [tdist_fmt+{cut + 1}], 0;"]
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
              "call.uni (tdist_rv), vprintf, (tdist_p0, tdist_p1);", "}", f"@{trap} trap;"]
    return lines


def _record_fault(cmp: str, bits: int, seen: str, addr: str, expected: str, timeout: str, rank: str,
                  record: str) -> list[str]:
    """Fills the FaultRecord at `record` (claimed by this thread), as record_fault in timeout.cuh."""
    lines = [f"st.u32 [{record}+4], {kWaitSiteUser};", f"st.u32 [{record}+8], {rank};",
             f"st.u32 [{record}+12], {CMP_CODES[cmp]};"]
    for offset, reg in ((16, "%ctaid.x"), (20, "%ctaid.y"), (24, "%ctaid.z"), (28, "%tid.x"), (32, "%tid.y"),
                        (36, "%tid.z")):
        lines += [f"mov.u32 %tdist_x, {reg};", f"st.u32 [{record}+{offset}], %tdist_x;"]
    lines.append(f"st.u64 [{record}+40], {addr};")
    for offset, reg in ((48, expected), (56, seen)):
        if bits == 32:
            lines += [f"cvt.u64.u32 %tdist_t1, {reg};", f"st.u64 [{record}+{offset}], %tdist_t1;"]
        else:
            lines.append(f"st.u64 [{record}+{offset}], {reg};")
    lines += [f"st.u64 [{record}+64], {timeout};",
              "membar.sys;",  # the fields before the state, for the host's plain reads
              f"st.volatile.u32 [{record}], {kFaultRecorded};"]
    return lines


def spin_wait(scope: str, cmp: str, bits: int, leader_only: bool, what: str = "wait") -> tuple[str, str]:
    """(asm, constraints) of a bounded spin until cmp(*addr, expected) holds.

    Operands: $0 seen (out), $1 address, $2 expected, $3 timeout in ns (u64), $4 rank (printed), $5 address
    of the process's FaultRecord (u64; 0: a timed-out wait traps).
    leader_only: only thread 0 of the block spins (the others return 0 at once and must meet it at a
    bar.sync); else every thread spins on its own elements.
    After an abort the wait returns the last value seen, whether or not the condition holds.
    """
    check_scope(scope)
    check_cmp(cmp)
    check_bits(bits, "flags")
    t = "u32" if bits == 32 else "u64"
    r = "r" if bits == 32 else "l"
    lines = ["{", ".reg .pred %tdist_p, %tdist_q;", ".reg .u64 %tdist_t0, %tdist_t1;",
             ".reg .u32 %tdist_n, %tdist_x;"]
    if leader_only:
        lines += ["mov.u32 %tdist_x, %tid.x;", "setp.ne.u32 %tdist_p, %tdist_x, 0;", f"mov.b{bits} $0, 0;",
                  "@%tdist_p bra tdist_done;"]
    lines += [f"ld.acquire.{scope}.{t} $0, [$1];", f"setp.{cmp}.{t} %tdist_p, $0, $2;", "@%tdist_p bra tdist_done;",
              "setp.eq.u64 %tdist_q, $5, 0;",  # q: waits trap (no record to report the fault through)
              "mov.u64 %tdist_t0, %globaltimer;", "mov.u32 %tdist_n, 0;",
              "tdist_poll:",
              # Poll relaxed, then confirm with one acquire: cheaper than an acquire per poll.
              f"ld.relaxed.{scope}.{t} $0, [$1];", f"setp.{cmp}.{t} %tdist_p, $0, $2;", "@%tdist_p bra tdist_confirm;",
              "add.u32 %tdist_n, %tdist_n, 1;", f"and.b32 %tdist_x, %tdist_n, {kPollsPerClockRead - 1};",
              "setp.ne.u32 %tdist_p, %tdist_x, 0;", "@%tdist_p bra tdist_poll;",
              # Another wait of the process has given up: this one gives up too (SpinDeadline::expired).
              "@%tdist_q bra tdist_clock;",
              "ld.volatile.u32 %tdist_x, [$5];", f"setp.ne.u32 %tdist_p, %tdist_x, {kFaultNone};",
              "@%tdist_p bra tdist_done;",
              "tdist_clock:",
              "mov.u64 %tdist_t1, %globaltimer;", "sub.u64 %tdist_t1, %tdist_t1, %tdist_t0;",
              "setp.le.u64 %tdist_p, %tdist_t1, $3;", "@%tdist_p bra tdist_poll;",
              # Timed out. Under abort, the first wait claims the record; the others return quietly.
              "@%tdist_q bra tdist_report;",
              f"atom.cas.sys.b32 %tdist_x, [$5], {kFaultNone}, {kFaultClaimed};",
              f"setp.ne.u32 %tdist_p, %tdist_x, {kFaultNone};", "@%tdist_p bra tdist_done;"]
    lines += _record_fault(cmp, bits, "$0", "$1", "$2", "$3", "$4", "$5")
    lines.append("tdist_report:")
    lines += _diagnostic(what, cmp, bits, "$0", "$1", "$2", "$3", "$4", "%tdist_q")
    lines += ["bra tdist_done;", "tdist_confirm:", f"ld.acquire.{scope}.{t} $0, [$1];", "tdist_done:", "}"]
    return "\n".join(lines), f"={r},l,{r},l,r,l"


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
