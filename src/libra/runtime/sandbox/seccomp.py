"""A seccomp filter that keeps a sandboxed program on the cores the scheduler gave it.

Where the host has no cpuset cgroup for the service (see cgroups.py), the granted cores are set
with `taskset` (or by the warm zygote), and this filter makes `sched_setaffinity` fail with EPERM
for everything the sandbox runs, so no program can widen its mask and defeat exclusive cores.
It also refuses narrowing, which programs rarely need; reading the mask works as before.

The filter is a classic-BPF program, built here for the host's architecture (x86_64 with its
x32 and i386 ABIs, i386, aarch64): bwrap loads it from a file descriptor (`--seccomp FD`) on the
cold path, and the warm zygote installs the same bytes itself once it has pinned itself.
"""

from __future__ import annotations

import errno
import platform
import struct

# linux/audit.h and the syscall tables of each ABI.
AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000
SCHED_SETAFFINITY = {AUDIT_ARCH_X86_64: 203, AUDIT_ARCH_I386: 241, AUDIT_ARCH_AARCH64: 122}
MACHINE_ARCHES = {
    "x86_64": (AUDIT_ARCH_X86_64, AUDIT_ARCH_I386),
    "amd64": (AUDIT_ARCH_X86_64, AUDIT_ARCH_I386),
    "i686": (AUDIT_ARCH_I386,),
    "aarch64": (AUDIT_ARCH_AARCH64,),
    "arm64": (AUDIT_ARCH_AARCH64,),
}

# linux/filter.h and linux/seccomp.h
LD_W_ABS, JEQ_K, RET_K = 0x20, 0x15, 0x06
OFFSET_NR, OFFSET_ARCH = 0, 4
RET_ALLOW = 0x7FFF0000
RET_EPERM = 0x00050000 | errno.EPERM


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def affinity_filter(machine: str | None = None) -> bytes | None:
    """The BPF program (struct sock_filter[]), or None on an architecture this does not know."""
    arches = MACHINE_ARCHES.get((machine or platform.machine()).lower())
    if arches is None:
        return None
    denied: list[tuple[int, int]] = []  # (arch, syscall number) pairs that get EPERM
    for arch in arches:
        nr = SCHED_SETAFFINITY[arch]
        denied.append((arch, nr))
        if arch == AUDIT_ARCH_X86_64:
            denied.append((arch, nr | X32_SYSCALL_BIT))
    prog = []
    for arch, nr in denied:  # per pair: load arch, skip unless it matches, load nr, deny on match
        prog += [
            _insn(LD_W_ABS, 0, 0, OFFSET_ARCH),
            _insn(JEQ_K, 0, 2, arch),
            _insn(LD_W_ABS, 0, 0, OFFSET_NR),
            _insn(JEQ_K, 4 * len(denied) - len(prog) - 3, 0, nr),  # to RET_EPERM
        ]
    prog.append(_insn(RET_K, 0, 0, RET_ALLOW))
    prog.append(_insn(RET_K, 0, 0, RET_EPERM))
    return b"".join(prog)
