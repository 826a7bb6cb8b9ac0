"""Optional compiled builds of the simulator's hot modules, and the rule for when they are used.

Why it exists: `libra simulate`'s default job plays eight systems through 100 RL steps, about three
million tool-calling turns, and in CPython the engine's event handling is a flat ~30 us per turn
(no hot spot left to fix). mypyc compiles these very modules, which are plain typed Python, to C
extensions: static-uniform runs 1.48x faster, the whole default job 1.36x (`benchmarks/bench_sim.py`
measures both ways side by side). Nothing else changes: the source stays the one truth, and
results are identical bit for bit (`tests/test_native.py`).

When a compiled module is used: only if every module of the group was built from exactly the
source now beside it (SHA-256 recorded in `_native.json` at build time). Otherwise, or with
LIBRA_PURE_PYTHON=1, every one of them is imported from its .py file. It is all or nothing because
compiled modules of one group reach into each other's classes directly, so a compiled driver must
never meet a Python engine. An edited engine.py is therefore simply run as Python until rebuilt.

    libra native build     # compile in place (needs mypy and a C compiler; `make` does it)
    libra native status    # compiled or pure, and why
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

# The modules compiled together, in one mypyc group. They must stay mypy-clean.
MODULES = (
    "libra.sim.kernel",
    "libra.sim.engine",
    "libra.sim.rl.driver",
    "libra.rollout.placement",
    "libra.rollout.tree",
    "libra.rollout.predictor",
    "libra.rollout.features",
    "libra.rollout.batching",
)
PACKAGE_DIR = Path(__file__).resolve().parent
MANIFEST = PACKAGE_DIR / "_native.json"
PURE_ENV = "LIBRA_PURE_PYTHON"


def source_path(module: str) -> Path:
    return PACKAGE_DIR.joinpath(*module.split(".")[1:]).with_suffix(".py")


def compiled_paths(module: str) -> list[Path]:
    src = source_path(module)
    candidates = (src.with_name(src.stem + suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES)
    return [path for path in candidates if path.exists()]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def status() -> tuple[bool, str]:
    """(use the compiled modules?, why) — decided from the files alone, before any is imported."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return False, f"{PURE_ENV} is set"
    missing = [m for m in MODULES if not compiled_paths(m)]
    if missing:
        return False, "not built (`libra native build`)"
    try:
        recorded = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return False, f"{MANIFEST.name} is missing or unreadable: rebuild"
    stale = [m for m in MODULES if recorded.get(m) != digest(source_path(m))]
    if stale:
        return False, f"stale: {', '.join(stale)} changed since the build (rebuild)"
    return True, "compiled (mypyc)"


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Imports the listed modules from their .py files even where a compiled one sits beside it."""

    def __init__(self, modules: tuple[str, ...]):
        self.modules = set(modules)

    def find_spec(self, name, path=None, target=None):
        if name not in self.modules:
            return None
        return importlib.util.spec_from_file_location(name, source_path(name))


def install() -> None:
    """Called when `libra` is imported: make pure Python win unless the compiled group is usable."""
    if any(isinstance(f, _SourceFinder) for f in sys.meta_path):
        return
    if not status()[0] and any(compiled_paths(m) for m in MODULES):
        sys.meta_path.insert(0, _SourceFinder(MODULES))


def active() -> bool:
    """Whether the compiled modules are the ones imported (imports the engine to find out)."""
    import libra.sim.engine as engine

    return not engine.__file__.endswith(".py")


def build(if_stale: bool = False) -> int:
    if if_stale and status()[0]:
        print("libra.native: up to date")
        return 0
    if PACKAGE_DIR.parent.name != "src":
        print("libra.native: builds only in a source checkout (src/libra); running as Python")
        return 1
    repo = PACKAGE_DIR.parent.parent
    _remove_build()  # a failed build must leave nothing that looks usable
    paths = [str(source_path(m).relative_to(repo)) for m in MODULES]
    print(f"libra.native: compiling {len(paths)} modules with mypyc (about a minute)...", flush=True)
    proc = subprocess.run([sys.executable, "-m", "mypyc", *paths], cwd=repo, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        print("libra.native: build failed; everything still runs as Python, only slower:", *tail, sep="\n  ")
        return 1
    MANIFEST.write_text(json.dumps({m: digest(source_path(m)) for m in MODULES}, indent=1) + "\n")
    print("libra.native: built", ", ".join(MODULES))
    return 0


def _remove_build() -> None:
    """Delete the manifest, the modules' compiled files and mypyc's shared libraries (whose names
    change with the module list, so old ones would otherwise pile up in src/)."""
    MANIFEST.unlink(missing_ok=True)
    for m in MODULES:
        for path in compiled_paths(m):
            path.unlink()
    for path in PACKAGE_DIR.parent.glob("*__mypyc.*"):
        path.unlink()
