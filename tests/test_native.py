"""The compiled simulator modules (libra.sim.native): opt-in, found only for the exact sources, kept
outside src/, and changing nothing."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from libra.sim import native


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """An empty build cache of this test's own."""
    monkeypatch.setenv(native.DIR_ENV, str(tmp_path))
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    return tmp_path


def _fake_build(root, group="abc__mypyc"):
    """Files where a build for the current sources would put them (empty: never imported here)."""
    root.mkdir(parents=True, exist_ok=True)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    for m in native.MODULES:
        path = root.joinpath(*m.split(".")).with_name(m.split(".")[-1] + suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    (root / (group + suffix)).touch()
    (root / native.MANIFEST).write_text(json.dumps({"group": group, "modules": list(native.MODULES)}))


def test_a_build_is_found_only_for_these_sources(cache):
    assert native.status()[0] is False and "not built" in native.status()[1]
    _fake_build(native.build_dir())
    assert native.status()[0] is True
    _fake_build(cache / "some-other-sources")  # a build of edited sources is another folder
    assert native.build_dir().parent == cache


def test_an_incomplete_build_or_the_env_switch_is_not_used(cache, monkeypatch):
    _fake_build(native.build_dir())
    missing = native.compiled_path(native.MODULES[-1])
    missing.unlink()
    ok, why = native.status()
    assert not ok and "incomplete" in why
    missing.touch()
    monkeypatch.setenv(native.PURE_ENV, "1")
    assert native.status() == (False, f"{native.PURE_ENV} is set")


def test_the_key_changes_with_any_source(monkeypatch):
    key = native.build_key()
    real = native.digest
    monkeypatch.setattr(native, "digest", lambda p: "0" * 64 if p.name == "engine.py" else real(p))
    assert native.build_key() != key


def test_modules_are_named_by_their_sources():
    for m in native.MODULES:
        assert native.source_path(m).is_file(), m


def test_import_libra_installs_no_import_hook_and_sim_stays_python():
    code = (
        "import sys; before = list(sys.meta_path); import libra, libra.sim.rl.pipeline, libra.cli; "
        "import libra.sim.engine as e; print(sys.meta_path == before, e.__file__.endswith('.py'))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]


CHILD = """
import json, sys
from libra.sim import native
activated = native.activate()[0]
from libra.sim.rl.pipeline import run
from libra.sim.scenarios import load_scenario
import libra.sim.engine as e, libra.sim.kernel as k, libra.sim.rl.driver as d
res = run(load_scenario("libra-r2e-48gpu"), ["static-uniform", "ablation:cmlfq"], 3, 0, None, lambda a, b: None)
files = [m.__file__.endswith(".py") for m in (e, k, d)]
print(json.dumps({"active": native.active(), "activated": activated, "status": native.status()[0],
                  "py_files": files, "systems": res["systems"]}))
"""


def _buildable() -> bool:
    return shutil.which("cc") is not None and importlib.util.find_spec("mypyc") is not None


def _child(pure: bool) -> dict:
    env = dict(os.environ, **{native.PURE_ENV: "1" if pure else "0"})
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_compiled_and_pure_give_identical_results():
    """`make test` builds first, so this compares the two for real; it fails when the build could
    exist but does not (a broken build must not hide behind the pure-Python fallback)."""
    fast, slow = _child(pure=False), _child(pure=True)
    assert slow["py_files"] == [True, True, True] and not slow["active"]
    assert fast["active"] == fast["status"] == fast["activated"]  # a usable build is used, and only then
    assert fast["py_files"] == [not fast["active"]] * 3  # all or nothing
    if not fast["active"]:
        if _buildable():  # `make test` builds first: a missing build here is a broken build
            pytest.fail(f"the compiled modules could be built here but are not used: {native.status()[1]}")
        pytest.skip("no C compiler or no mypy here: the compiled modules cannot be built")
    assert fast["systems"] == slow["systems"]
    assert not list(native.PACKAGE_DIR.rglob("*.so"))  # nothing compiled lives in src/
