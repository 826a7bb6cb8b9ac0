"""Shared fixtures: the shipped catalog, a CLI runner, and the shared real-data folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from libra.costmodel.catalog import load_catalog

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
