"""Opt-in compiled builds of the simulator's hot modules, kept in a cache outside the source tree.

Why it exists: `libra simulate`'s default job plays eight systems through 100 RL steps, about three
million tool-calling turns, and in CPython the engine's event handling is a flat ~30 us per turn
(no hot spot left to fix). mypyc compiles these very modules, which are plain typed Python, to C
extensions: the default job runs about 1.5x faster (`benchmarks/bench_sim.py` measures both ways
side by side). Nothing else changes: the source stays the one truth, and results are identical
bit for bit (`tests/test_native.py`).

Why opt-in: `import libra` changes nothing about how modules are imported. Only a simulator entry
point (`libra simulate`, `libra replay-vllm`, the simulator's benchmarks) calls `activate()`, and
the live services run the plain Python policy code unless asked (`libra serve gateway --compiled`).

Where builds live: `$LIBRA_NATIVE_DIR`, else `$XDG_CACHE_HOME/libra/native` (`~/.cache/...`), in
a folder named by a digest of the Python version and of every compiled module's source. An edited
module therefore has no build until `libra native build` makes one, and a stale build is never
found, let alone used. All or nothing: compiled modules of one group reach into each other's
classes directly, so a compiled driver must never meet a Python engine.

    libra native build     # compile into the cache (needs mypy and a C compiler; `make` does it)
    libra native status    # whether a build for these sources exists, and where
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
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
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/libra
PURE_ENV = "LIBRA_PURE_PYTHON"
DIR_ENV = "LIBRA_NATIVE_DIR"
MANIFEST = "manifest.json"


def source_path(module: str) -> Path:
    return PACKAGE_DIR.joinpath(*module.split(".")[1:]).with_suffix(".py")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cache_root() -> Path:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "libra" / "native"


def build_key() -> str:
    """Names the build of exactly these sources for this interpreter."""
    h = hashlib.sha256(sys.implementation.cache_tag.encode())
    for m in MODULES:
        h.update(m.encode() + b"\0" + digest(source_path(m)).encode())
    return h.hexdigest()[:20]


def build_dir() -> Path:
    return cache_root() / build_key()


def _extension(folder: Path, stem: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (folder / (stem + suffix)).exists():
            return folder / (stem + suffix)
    return None


def compiled_path(module: str, root: Path | None = None) -> Path | None:
    """The compiled file of `module` in the build for the current sources, if there is one."""
    root = root or build_dir()
    parts = module.split(".")
    return _extension(root.joinpath(*parts[:-1]), parts[-1])


def status() -> tuple[bool, str]:
    """(is there a usable build for these sources?, why or where), from the files alone."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return False, f"{PURE_ENV} is set"
    root = build_dir()
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return False, "not built for these sources (`libra native build`)"
    group = manifest.get("group", "")
    if any(compiled_path(m, root) is None for m in MODULES) or (group and _extension(root, group) is None):
        return False, f"incomplete build in {root} (`libra native build`)"
    return True, f"compiled (mypyc, {root})"


class _CompiledFinder(importlib.abc.MetaPathFinder):
    """Imports the group's modules (and mypyc's shared library of the group) from the build."""

    def __init__(self, root: Path, group: str):
        self.paths = {m: compiled_path(m, root) for m in MODULES}
        if group:
            self.paths[group] = _extension(root, group)

    def find_spec(self, name, path=None, target=None):
        file = self.paths.get(name)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(name, str(file))
        return importlib.util.spec_from_file_location(name, file, loader=loader)


def activate() -> tuple[bool, str]:
    """Use the compiled modules from here on, if a build for these sources exists and none of the
    group has been imported as Python yet. Returns (active, why). Called by simulator entry points."""
    if any(isinstance(f, _CompiledFinder) for f in sys.meta_path):
        return True, "already active"
    ok, why = status()
    if not ok:
        return False, why
    loaded = [m for m in MODULES if m in sys.modules]
    if loaded:
        return False, f"already imported as Python: {', '.join(loaded)}"
    root = build_dir()
    group = json.loads((root / MANIFEST).read_text())["group"]
    sys.meta_path.insert(0, _CompiledFinder(root, group))
    return True, why


def active() -> bool:
    """Whether the compiled modules are the ones imported (imports the engine to find out)."""
    import libra.sim.engine as engine

    return not engine.__file__.endswith(".py")


def build(if_stale: bool = False) -> int:
    """Compile MODULES with mypyc into the cache. The whole package is copied to a scratch folder
    first, so mypy type-checks them against exactly these sources and nothing is written to src/."""
    _remove_legacy()
    if if_stale and status()[0]:
        print(f"libra.sim.native: up to date ({build_dir()})")
        return 0
    root = build_dir()
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as scratch:
        work = Path(scratch)
        shutil.copytree(PACKAGE_DIR, work / "libra", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
        paths = [str(Path(*m.split(".")).with_suffix(".py")) for m in MODULES]
        print(f"libra.sim.native: compiling {len(paths)} modules with mypyc (about a minute)...", flush=True)
        # Errors only in the compiled modules: the rest of the package is read as typed context.
        cmd = [sys.executable, "-m", "mypyc", "--follow-imports=silent", *paths]
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            print(
                "libra.sim.native: build failed; everything still runs as Python, only slower:",
                *tail,
                sep="\n  ",
            )
            return 1
        _install(work, root)
    _prune(root)
    print(f"libra.sim.native: built {', '.join(MODULES)} in {root}")
    return 0


def _install(work: Path, root: Path) -> None:
    """Move the compiled files (and only those) from the scratch folder into `root`, atomically."""
    groups = [p for p in work.glob("*__mypyc.*") if p.suffix in (".so", ".pyd")]
    staged = Path(tempfile.mkdtemp(dir=root.parent))
    for m in MODULES:
        file = compiled_path(m, work)
        assert file is not None, m
        dest = staged / file.relative_to(work)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(file, dest)
    for g in groups:
        shutil.move(g, staged / g.name)
    group = groups[0].name.split(".")[0] if groups else ""
    (staged / MANIFEST).write_text(json.dumps({"group": group, "modules": list(MODULES)}) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    staged.rename(root)


def _remove_legacy() -> None:
    """Earlier versions compiled into src/, where Python's own import would still prefer a stale
    extension over its source: delete those files."""
    if PACKAGE_DIR.parent.name != "src":
        return
    (PACKAGE_DIR / "_native.json").unlink(missing_ok=True)
    for path in [*PACKAGE_DIR.rglob("*.so"), *PACKAGE_DIR.parent.glob("*__mypyc.*")]:
        path.unlink()


PRUNE_AFTER_S = 7 * 86400


def _prune(keep: Path) -> None:
    """Remove builds not rebuilt for a week (several checkouts may share the cache, each with its
    own sources, so a build of other sources is not necessarily stale)."""
    import time

    for other in keep.parent.iterdir():
        manifest = other / MANIFEST
        if other != keep and manifest.exists() and time.time() - manifest.stat().st_mtime > PRUNE_AFTER_S:
            shutil.rmtree(other, ignore_errors=True)
