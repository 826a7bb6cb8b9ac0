"""Shared fixtures: the shipped catalog, a CLI runner, and the shared real-data folder."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import settings

from libra.costmodel.catalog import load_catalog

# Property tests draw the same examples on every run by default, so CI is deterministic (a change,
# not the dice, turns it red). `LIBRA_HYPOTHESIS=explore make test` draws new ones each run, which
# is how the fuzz-style tests of the services are meant to be used when hunting for bugs.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
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
