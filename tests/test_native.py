"""The compiled simulator modules (libra.native): when they are used, and that they change nothing."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from libra import native


@pytest.fixture
def built_files(monkeypatch, tmp_path):
    """Pretend every module of the group has a compiled file, and point the manifest at tmp_path."""
    monkeypatch.setattr(native, "compiled_paths", lambda m: [tmp_path / (m + ".so")])
    monkeypatch.setattr(native, "MANIFEST", tmp_path / "_native.json")
    monkeypatch.delenv(native.PURE_ENV, raising=False)
    return tmp_path


def _write_manifest(path, **changes):
    digests = {m: native.digest(native.source_path(m)) for m in native.MODULES}
    path.write_text(json.dumps(digests | changes))


def test_fresh_build_is_used(built_files):
    _write_manifest(built_files / "_native.json")
    assert native.status() == (True, "compiled (mypyc)")


def test_one_edited_source_makes_the_whole_group_pure(built_files):
    _write_manifest(built_files / "_native.json", **{native.MODULES[-1]: "0" * 64})
    ok, why = native.status()
    assert not ok and "stale" in why and native.MODULES[-1] in why


def test_missing_manifest_and_missing_build_and_env_switch(built_files, monkeypatch):
    assert native.status()[0] is False  # no manifest written
    _write_manifest(built_files / "_native.json")
    monkeypatch.setenv(native.PURE_ENV, "1")
    assert native.status() == (False, f"{native.PURE_ENV} is set")
    monkeypatch.delenv(native.PURE_ENV)
    monkeypatch.setattr(native, "compiled_paths", lambda m: [])
    assert "not built" in native.status()[1]


def test_modules_are_named_by_their_sources():
    for m in native.MODULES:
        assert native.source_path(m).is_file(), m


CHILD = """
import json, sys
from libra import native
from libra.sim.rl.pipeline import run
from libra.sim.scenarios import load_scenario
import libra.sim.engine as e, libra.sim.kernel as k, libra.sim.rl.driver as d
res = run(load_scenario("libra-r2e-48gpu"), ["static-uniform", "ablation:cmlfq"], 3, 0, None, lambda a, b: None)
files = [m.__file__.endswith(".py") for m in (e, k, d)]
print(json.dumps({"active": native.active(), "status": native.status()[0], "py_files": files,
                  "systems": res["systems"]}))
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
    assert fast["active"] == fast["status"]  # a usable build is used, and only then
    assert fast["py_files"] == [not fast["active"]] * 3  # all or nothing
    if not fast["active"]:
        if _buildable():  # `make test` builds first: a missing build here is a broken build
            pytest.fail(f"the compiled modules could be built here but are not used: {native.status()[1]}")
        pytest.skip("no C compiler or no mypy here: the compiled modules cannot be built")
    assert fast["systems"] == slow["systems"]
