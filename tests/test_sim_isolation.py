"""Each system simulates in a forked child (sim.isolation): results, progress and errors cross back."""

from __future__ import annotations

import os

import pytest

from libra.core.errors import ConfigError, SimulationError
from libra.sim import isolation
from tests.test_sim_pipeline import SMALL, _quiet, run

pytestmark = pytest.mark.skipif(not isolation.forking(), reason="fork is not available here")


def test_the_work_runs_in_another_process_and_its_progress_is_relayed():
    seen = []

    def work(progress):
        progress("sys", 0.5)
        progress("sys", 1.0)
        return os.getpid()

    assert isolation.call(work, lambda *a: seen.append(a)) != os.getpid()
    assert seen == [("sys", 0.5), ("sys", 1.0)]
    assert isolation.call(work, lambda *a: None, isolate=False) == os.getpid()


def test_a_user_error_comes_back_as_itself():
    def work(progress):
        raise ConfigError("rollout.tp", 3, "1, 2, 4 or 8")

    with pytest.raises(ConfigError) as e:
        isolation.call(work, _quiet)
    assert e.value.field == "rollout.tp" and "allowed: 1, 2, 4 or 8" in str(e.value)


def test_an_unpicklable_error_comes_back_with_the_child_traceback():
    class Local(Exception):  # a local class cannot be pickled
        pass

    def work(progress):
        raise Local("boom")

    with pytest.raises(SimulationError, match="Local in the simulation process(.|\n)*boom"):
        isolation.call(work, _quiet)


def test_a_child_that_dies_is_reported():
    with pytest.raises(SimulationError, match="exit code 3"):
        isolation.call(lambda progress: os._exit(3), _quiet)


def test_isolated_and_in_process_runs_are_identical(tmp_path):
    systems = ["static-uniform", "router:cmlfq"]
    a = run(SMALL, systems, 3, 0, tmp_path / "a", _quiet)
    b = run(SMALL, systems, 3, 0, tmp_path / "b", _quiet, isolate=False)
    assert a == b
    assert (tmp_path / "a" / "summary.json").read_bytes() == (tmp_path / "b" / "summary.json").read_bytes()
    assert (tmp_path / "a" / "trace.json").read_bytes() == (tmp_path / "b" / "trace.json").read_bytes()


def test_the_environment_switch_keeps_the_work_in_this_process(monkeypatch):
    monkeypatch.setenv(isolation.NO_FORK_ENV, "1")
    assert not isolation.forking()
    assert isolation.call(lambda progress: os.getpid(), _quiet) == os.getpid()
