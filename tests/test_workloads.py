"""The workload generators' contract: shape of a step, limits, determinism, configuration errors.

Calibration against real statistics is in test_workloads_stats.py; these tests hold for any
parameter values, so they use hypothesis where an invariant is at stake.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libra.core.errors import ConfigError
from libra.core.trace import read_trace, write_trace
from libra.core.trajectory import ToolStatus
from libra.sim.workloads import FAMILIES, Workload, WorkloadConfig, make_workload

ALL = sorted(FAMILIES)


def wl(family: str, prompts=8, samples=4, max_length=40960, **params):
    return make_workload(WorkloadConfig(family=family, prompts_per_step=prompts, samples_per_prompt=samples,
                                        max_length=max_length, params=params))  # fmt: skip


def turn_limit(family: str, max_turns: int) -> dict:
    """Params for a turn limit; agent families also need min_turns <= max_turns."""
    params = {"max_turns": max_turns}
    if "min_turns" in FAMILIES[family].Params.model_fields:
        params["min_turns"] = min(FAMILIES[family].Params().min_turns, max_turns)
    return params


def test_registry_names_the_three_families():
    assert set(FAMILIES) == {"search-r1", "dapo-math", "r2e-gym"}
    for name in ALL:
        assert isinstance(wl(name), Workload)


@pytest.mark.parametrize("family", ALL)
def test_one_step_is_prompts_times_samples_grpo_groups(family):
    trajs = wl(family, prompts=6, samples=5).generate(3, random.Random(1))
    assert len(trajs) == 30
    groups: dict[str, list] = {}
    for t in trajs:
        groups.setdefault(t.prompt_id, []).append(t)
        assert t.step == 3
    assert len(groups) == 6 and all(len(g) == 5 for g in groups.values())
    for g in groups.values():  # samples of one prompt share the prompt itself
        assert len({t.prompt_tokens for t in g}) == 1


@pytest.mark.parametrize("family", ALL)
def test_turn_fields_are_complete(family):
    for t in wl(family, prompts=16).generate(50, random.Random(2)):
        assert t.turns and not t.turns[-1].has_tool
        for u in t.turns[:-1]:
            assert u.has_tool and u.tool_latency_s is not None and u.tool_latency_s >= 0
            assert u.tool_return_tokens >= 0 and isinstance(u.tool_status, ToolStatus)


@pytest.mark.parametrize("family", ALL)
def test_ids_unique_across_steps(family):
    w, rng = wl(family), random.Random(3)
    ids = [t.id for step in range(4) for t in w.generate(step, rng)]
    assert len(ids) == len(set(ids))
    pids = {t.prompt_id for step in range(4) for t in w.generate(step, rng)}
    assert len(pids) == 4 * 8


@pytest.mark.parametrize("family", ALL)
def test_same_seed_same_output_other_seed_other_output(family):
    w = wl(family)
    a = [t.to_dict() for t in w.generate(7, random.Random(42))]
    b = [t.to_dict() for t in wl(family).generate(7, random.Random(42))]
    c = [t.to_dict() for t in w.generate(7, random.Random(43))]
    assert a == b and a != c


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(ALL),
    max_length=st.integers(256, 50_000),
    max_turns=st.integers(1, 40),
    step=st.integers(0, 150),
    seed=st.integers(0, 2**32),
)
def test_limits_hold_and_traces_round_trip(tmp_path_factory, family, max_length, max_turns, step, seed):
    w = wl(family, prompts=4, samples=4, max_length=max_length, **turn_limit(family, max_turns))
    trajs = w.generate(step, random.Random(seed))
    for t in trajs:
        assert t.total_tokens <= max_length
        assert 1 <= len(t.turns) <= max_turns
    path = tmp_path_factory.mktemp("rt") / "t.jsonl"
    write_trace(trajs, path)
    assert [t.to_dict() for t in read_trace(path)] == [t.to_dict() for t in trajs]


@pytest.mark.parametrize("family", ALL)
def test_max_length_cuts_instead_of_overflowing(family):
    # A limit well below the family's typical length: many rollouts must be cut, none may exceed it.
    trajs = wl(family, prompts=16, max_length=1500).generate(100, random.Random(5))
    assert max(t.total_tokens for t in trajs) <= 1500
    assert sum(t.total_tokens >= 1400 for t in trajs) >= len(trajs) // 4


@pytest.mark.parametrize("family", ALL)
def test_max_turns_is_respected_and_reached(family):
    trajs = wl(family, prompts=16, **turn_limit(family, 2)).generate(100, random.Random(6))
    assert max(len(t.turns) for t in trajs) == 2


def test_unknown_family_lists_the_registered_ones():
    with pytest.raises(ConfigError) as e:
        make_workload(WorkloadConfig(family="swe-bench"))
    assert e.value.field == "workload.family"
    assert all(name in str(e.value) for name in ALL)


def test_family_by_dotted_path():
    w = make_workload({"family": "libra.sim.workloads.r2e_gym:R2EGymWorkload"})
    assert len(w.generate(0, random.Random(0))) == 32 * 16
    with pytest.raises(ConfigError):
        make_workload({"family": "no.such.module:Thing"})


@pytest.mark.parametrize("family", ALL)
def test_unknown_param_lists_allowed(family):
    with pytest.raises(ConfigError) as e:
        wl(family, drift_step=5)
    assert e.value.field == "workload.params.drift_step"
    assert "drift_steps" in str(e.value) and "max_turns" in str(e.value)


def test_tool_overrides_merge_over_the_defaults():
    defaults = FAMILIES["r2e-gym"].Params().tools
    w = wl("r2e-gym", tools={"execute_bash": {"latency_median_s": 9.0}, "search": None,
                             "pytest": {"weight": 0.2, "return_median": 900, "return_sigma": 0.5,
                                        "failure_return_median": 1500, "latency_median_s": 20.0}})  # fmt: skip
    tools = w.params.tools
    assert set(tools) == {"execute_bash", "file_editor", "python", "pytest"}
    assert tools["execute_bash"].latency_median_s == 9.0
    assert tools["execute_bash"].return_median == defaults["execute_bash"].return_median
    used = {u.tool for t in w.generate(100, random.Random(0)) for u in t.turns if u.has_tool}
    assert "pytest" in used and "search" not in used


def test_unknown_tool_field_lists_tool_fields():
    with pytest.raises(ConfigError) as e:
        wl("r2e-gym", tools={"execute_bash": {"weight": 1, "return_median": 10, "return_sigma": 0,
                                              "failure_return_median": 5, "latency_median_s": 1, "colour": 3}})  # fmt: skip
    assert e.value.field == "workload.params.tools.execute_bash.colour"
    assert "return_median" in str(e.value)


@pytest.mark.parametrize(
    "data, field",
    [
        ({"family": "r2e-gym", "params": {"output_tokens_sigma": -1}}, "workload.params.output_tokens_sigma"),
        ({"family": "r2e-gym", "params": {"drift_steps": 0}}, "workload.params.drift_steps"),
        ({"family": "search-r1", "params": {"min_turns": 9, "max_turns": 3}}, "workload.params"),
        (
            {"family": "search-r1", "params": {"tools": {"search": None, "fetch": None, "ask_user": None}}},
            "workload.params",
        ),
        (
            {"family": "search-r1", "params": {"tools": {"browse": {"weight": 1}}}},
            "workload.params.tools.browse.return_median",
        ),
        (
            {"family": "search-r1", "params": {"tools": {"search": {"weight": 0}}}},
            "workload.params.tools.search.weight",
        ),
        (
            {"family": "dapo-math", "params": {"validator_timeout_share": 2}},
            "workload.params.validator_timeout_share",
        ),
        ({"family": "dapo-math", "params": "fast"}, "workload.params"),
        # a log-space spread or gain past MAX_LOG_SPREAD (these once overflowed math.exp mid-run)
        (
            {"family": "r2e-gym", "params": {"output_sample_sigma": 1e9}},
            "workload.params.output_sample_sigma",
        ),
        (
            {"family": "search-r1", "params": {"output_return_gain": 1e300}},
            "workload.params.output_return_gain",
        ),
        (
            {"family": "dapo-math", "params": {"difficulty_sample_sigma": 6}},
            "workload.params.difficulty_sample_sigma",
        ),
        ({"family": "dapo-math", "max_length": 10}, "workload.max_length"),
        ({"family": "dapo-math", "prompts_per_step": 0}, "workload.prompts_per_step"),
    ],
)
def test_bad_values_name_the_field(data, field):
    with pytest.raises(ConfigError) as e:
        make_workload(data)
    assert e.value.field == field, str(e.value)


def _changed(value):
    if isinstance(value, int):
        return value + 1 if value < 8 else value // 5
    if value >= 0.5 and value <= 1.0:  # keeps bounded shares and memories in range
        return value * 0.5
    if value > 1.0:  # shrinking big values keeps saturated effects (log-odds of 5) detectable
        return value * 0.4
    return value * 1.7 + 0.3 if value >= 0 else value * 0.5


def _active(family: str) -> dict:
    """Defaults with every mechanism switched on (drift, failure memory, stuck loops, timeouts), so
    that every parameter has an effect to detect."""
    d = FAMILIES[family].Params().model_dump()
    if "tools" in d:
        if d["finish_logit_end"] == d["finish_logit_start"]:
            d["finish_logit_end"] = d["finish_logit_start"] - 1.0
        for key, floor in (
            ("finish_failure_penalty", 0.5),
            ("stuck_finish_penalty", 2.0),
            ("stuck_fail_gain", 1.0),
        ):
            d[key] = max(d[key], floor)
        d["stuck_after"] = min(d["stuck_after"], 2)
        d["fail_logit"] = max(d["fail_logit"], -2.5)
        d["tools"] = {k: {**t, "timeout_share": 0.3} for k, t in d["tools"].items()}
    else:
        d["validator_timeout_share"] = 0.2
    return d


def _param_cases(family):
    """(name, params) with one parameter (or one field of one tool) changed from the active base."""
    base = _active(family)
    for name, value in base.items():
        if name != "tools":
            yield name, {**base, name: _changed(value)}
            continue
        for tool, spec in value.items():
            for field, v in spec.items():
                yield (
                    f"tools.{tool}.{field}",
                    {**base, "tools": {**value, tool: {**spec, field: _changed(v)}}},
                )


SIGNATURE_STEPS = (0, 15, 100)


def _signature(family, params):
    """The generated trajectories of each of SIGNATURE_STEPS, step by step (lazily: a parameter
    that already changed an earlier step needs no later one generated)."""
    w = wl(family, prompts=32, samples=4, max_length=40960, **params)
    return ([t.to_dict() for t in w.generate(s, random.Random(11))] for s in SIGNATURE_STEPS)


def _same(a, b) -> bool:
    return all(x == y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("family", ALL)
def test_every_parameter_is_overridable_and_used(family):
    """Changing any single parameter (tool fields included) changes the generated trajectories."""
    base = list(_signature(family, _active(family)))
    unused = [name for name, params in _param_cases(family) if _same(_signature(family, params), base)]
    assert not unused
