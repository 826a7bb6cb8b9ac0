"""What a launcher is: start a process from a spec, then watch, signal and stop it.

Every process of a run (engines, gateway, actions service, trainer replicas) is one `ProcessSpec`:
the Python arguments of its entry point (`-m libra serve engine ...`), the CPUs and GPUs it needs,
its environment and log file, and the line it prints when ready. A launcher turns specs into
`Handle`s; the driver only ever talks to handles, so the same run goes on local subprocesses
(`local`, the default) or on Ray actors in a placement group (`ray`) without another line of
driver code.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

LISTENING = r"listening on (https?://[^\s,()]+)"


class LaunchError(RuntimeError):
    """A process did not start, or died before it was ready."""


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    name: str
    args: tuple[str, ...]  # after the interpreter: ("-m", "libra", "serve", "engine", ...)
    log: Path
    cpus: float = 1.0
    gpus: float = 0.0
    env: dict[str, str] = field(default_factory=dict)


class Handle(Protocol):
    name: str
    log: Path
    offset: int  # the log's size when this process started (logs are appended across --resume)

    @property
    def pid(self) -> int: ...

    def returncode(self) -> int | None:
        """None while it runs."""

    def signal(self, sig: int) -> None: ...

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; returns once it is gone."""


class Launcher(Protocol):
    name: str

    def reserve(self, specs: list[ProcessSpec]) -> None:
        """Set resources aside for these processes (by name) before any starts; may be a no-op."""

    def start(self, spec: ProcessSpec) -> Handle: ...

    def shutdown(self) -> None: ...


def log_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def read_from(path: Path, offset: int) -> str:
    """The log's text from `offset` on: this process's lines, not an earlier run's."""
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def wait_for_line(h: Handle, pattern: str, timeout: float) -> re.Match:
    """The first match of `pattern` in the handle's log, waiting for it; LaunchError if the
    process exits first or `timeout` passes. Logs are files on every launcher, so this works the
    same for a subprocess and for a process a Ray actor owns."""
    rx, deadline = re.compile(pattern), time.monotonic() + timeout
    while True:
        text = read_from(h.log, h.offset)
        m = rx.search(text)
        if m:
            return m
        if h.returncode() is not None:
            raise LaunchError(f"{h.name} exited with code {h.returncode()} before it was ready; the end of its log ({h.log}):\n{text[-1500:]}")  # fmt: skip
        if time.monotonic() > deadline:
            raise LaunchError(f"{h.name} was not ready within {timeout:g} s; the end of its log ({h.log}):\n{text[-1500:]}")  # fmt: skip
        time.sleep(0.05)
