"""The `local` launcher: each process a subprocess of the driver, its output in its log file.

Children are started with the parent-death signal set (Linux `PR_SET_PDEATHSIG`), so a driver
that is killed outright takes its engines, gateway and trainers with it instead of leaving them
holding ports and cores.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

from libra.runtime.launch.base import ProcessSpec, log_size

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the process that started it dies (Linux only)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def popen(args: list[str], log_path: str, env: dict[str, str]) -> subprocess.Popen:
    """Start `python ARGS` with stdout and stderr appended to `log_path`."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **env}, preexec_fn=die_with_parent,
        )  # fmt: skip


class LocalHandle:
    def __init__(self, spec: ProcessSpec):
        self.name, self.log = spec.name, spec.log
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        self.offset = log_size(spec.log)
        self.proc = popen(list(spec.args), str(spec.log), spec.env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def returncode(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> None:
        stop_process(self.proc, timeout)


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(timeout=30)


class LocalLauncher:
    name = "local"

    def reserve(self, specs: list[ProcessSpec]) -> None:
        return None

    def start(self, spec: ProcessSpec) -> LocalHandle:
        return LocalHandle(spec)

    def shutdown(self) -> None:
        return None
