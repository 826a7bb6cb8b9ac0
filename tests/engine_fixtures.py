"""Start the built-in engine as a real subprocess: `libra serve engine` on a free loopback port.

Reusable by any test that needs a real OpenAI-compatible engine (the gateway tests included):

    from tests.engine_fixtures import engine, engine_factory, start_engine  # noqa: F401

`engine` is one module-scoped tiny engine; `engine_factory(*cli_args, name=...)` starts more and
stops them all at teardown; `start_engine` is the plain function behind both. The engine binds
port 0 and prints the port it got, so parallel test runs never race for a port. Its output goes
to a log file that is attached to any start-up failure.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

LISTENING = re.compile(r"listening on (http://[^\s:]+:(\d+))")
# How long a start, a stop or a plain request may take before it counts as hung: a guard for the
# suite, never a speed figure (two cores shared with other work can be very slow for a while).
HANG_S = 300.0


class ProcessControl:
    """Alive/log/kill/stop for a test's service subprocess (`self.proc`, `self.log_path`)."""

    proc: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL, as a crash would (for tests of services dying mid-run)."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=HANG_S)

    def stop(self, timeout: float = HANG_S) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit in time (a hang guard: a clean exit on a
        loaded machine can take many seconds). Returns the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=HANG_S)
        return self.proc.returncode


@dataclass
class EngineProcess(ProcessControl):
    proc: subprocess.Popen
    url: str
    port: int
    name: str
    log_path: Path

    @property
    def base_url(self) -> str:
        """What the `openai` client takes as base_url."""
        return self.url + "/v1"

    def get(self, path: str, timeout: float = HANG_S) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=HANG_S) as r:
            return r.read().decode()


def start_engine(*args: str, name: str | None = "tiny", log_dir: Path | None = None, timeout: float = HANG_S) -> EngineProcess:  # fmt: skip
    """Start `libra serve engine --port 0 ARGS` and wait until /health answers."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="libra-engine-"))
    log_path = log_dir / f"engine-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "libra", "serve", "engine", "--port", "0", *args]
    if name is not None and "--name" not in args:
        cmd += ["--name", name]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = LISTENING.search(log_path.read_text(errors="replace"))
        if m:
            eng = EngineProcess(proc, m.group(1), int(m.group(2)), name or "tiny", log_path)
            _wait_healthy(eng, deadline)
            return eng
        if proc.poll() is not None:
            raise RuntimeError(
                f"engine exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}"
            )
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"engine did not start in {timeout}s:\n{log_path.read_text(errors='replace')}")


def _wait_healthy(eng: EngineProcess, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            if eng.get("/health", timeout=2)["status"] == "ok":
                return
        except OSError:
            pass
        time.sleep(0.05)
    eng.kill()
    raise RuntimeError(f"engine never became healthy:\n{eng.log()}")


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> EngineProcess:
    eng = start_engine(log_dir=tmp_path_factory.mktemp("engine"))
    yield eng
    eng.stop()


@pytest.fixture
def engine_factory(tmp_path):
    started: list[EngineProcess] = []

    def make(*args: str, name: str | None = "tiny") -> EngineProcess:
        eng = start_engine(*args, name=name, log_dir=tmp_path)
        started.append(eng)
        return eng

    yield make
    for eng in started:
        eng.stop()
