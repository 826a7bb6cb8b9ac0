"""Helpers for benchmarks: median timing, machine description, and a JSON result line."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def median_time(fn: Callable[[], object], inner: int, repeats: int = 15) -> float:
    """Median over `repeats` of the mean time of `inner` calls, in seconds per call."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def report(name: str, figures: dict) -> None:
    print(json.dumps({"benchmark": name, "machine": machine(), **figures}))
