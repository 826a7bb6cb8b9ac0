"""Shared fixtures: the shipped catalog, a CLI runner, and the shared real-data folder."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import settings

from libra.costmodel.catalog import load_catalog

# One BLAS thread per test process (and per CLI subprocess, which inherits it). The suite's numpy
# work is small matrices (the routers' ridge fits, the cost models' fits); on a loaded 2-core box
# OpenBLAS's worker threads spin waiting for a core and cost up to three times the CPU of the work
# itself (tests/test_rollout_evaluate.py: 28 s of CPU with the default threads, 18 s with one).
# It must be set before numpy is first imported, which no import above does; under pytest-xdist
# each worker runs this file first too. A caller's own setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# Property tests draw the same examples on every run by default, so CI is deterministic (a change,
# not the dice, turns it red). `LIBRA_HYPOTHESIS=explore make test` draws new ones each run, which
# is how the fuzz-style tests of the services are meant to be used when hunting for bugs.
# No per-example deadline (hypothesis' default is 200 ms): on a loaded machine an example can take
# longer than that, and DeadlineExceeded would then fail a test for the machine's pace, not for
# the property. The suite's timeout (pyproject) still stops a test that hangs.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("LIBRA_HYPOTHESIS", "ci"))

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("LIBRA_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def catalog():
    return load_catalog()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip(f"shared data folder not found at {SHARED_DATA} (set LIBRA_SHARED_DATA)")
    return SHARED_DATA


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `libra ARGS` as a real subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "libra", *args], capture_output=True, text=True, timeout=timeout
    )


def run_main(*args: str) -> subprocess.CompletedProcess:
    """`libra ARGS` in this process, through the same `libra.cli.main` that `run_cli`'s process
    runs, for a behaviour's further cases once one real process has shown it (a new interpreter
    is 0.5-1.5 CPU s of imports). Output and exit code come back as `run_cli`'s do; an exception
    that is not an exit propagates, failing the test as a traceback on stderr would. The
    simulator's compiled modules are never switched on here: they would stay on for every later
    test of this process (LIBRA_PURE_PYTHON while a command module is first imported)."""
    from libra.cli import main
    from libra.sim.native import PURE_ENV

    out, err = io.StringIO(), io.StringIO()
    before = os.environ.get(PURE_ENV)
    os.environ[PURE_ENV] = "1"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        if before is None:
            del os.environ[PURE_ENV]
        else:
            os.environ[PURE_ENV] = before
    return subprocess.CompletedProcess(["libra", *args], code, out.getvalue(), err.getvalue())


def wait_for(check, what: str, limit_s: float = 600.0) -> None:
    """Poll until `check()` holds (a readiness wait, never a fixed sleep); the limit only stops a
    broken service from hanging the suite, it is not a figure any test asserts."""
    end = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.05)


def pytest_collection_modifyitems(config, items):
    """The long end-to-end modules (marked `slow`) run first. Under pytest-xdist (`make test` runs
    two workers, a module each at a time) a long module started last would run alone at the end;
    started first, the short ones fill the other worker meanwhile. Order within a module is kept."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
