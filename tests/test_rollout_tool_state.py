"""Tool-return states: size classes, status detection, and malformed returns that must not crash."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra.core.errors import ConfigError
from libra.core.trajectory import ToolStatus, Turn
from libra.rollout.base import PayloadSize, Status, ToolState
from libra.rollout.tool_state import (
    MAX_TOOL_NAME,
    UNKNOWN_TOOL,
    SizeThresholds,
    classify,
    from_turn,
    trajectory_path,
)


def test_size_classes_in_tokens_and_chars():
    assert classify("t", "x" * 4 * 500).size == PayloadSize.SMALL  # 500 tokens at 4 chars each
    assert classify("t", "x" * (4 * 500 + 4)).size == PayloadSize.MEDIUM
    assert classify("t", "x" * 4 * 5001).size == PayloadSize.LARGE
    assert classify("t", "x" * 600, unit="chars").size == PayloadSize.MEDIUM
    assert classify("t", "x" * 600, small_max=1000, medium_max=2000, unit="chars").size == PayloadSize.SMALL


def test_trace_turns_use_the_same_thresholds():
    th = SizeThresholds(small_max=100, medium_max=1000)
    assert from_turn(Turn(5, "search", 100, ToolStatus.SUCCESS), th).size == PayloadSize.SMALL
    assert from_turn(Turn(5, "search", 101, ToolStatus.FAILURE), th) == ToolState(
        "search", PayloadSize.MEDIUM, Status.FAILURE
    )
    assert from_turn(Turn(5, "run", 5000, ToolStatus.TIMEOUT), th).status == Status.TIMEOUT
    # chars thresholds: a trace's tokens count 4 characters each
    assert from_turn(Turn(1, "x", 30), SizeThresholds(small_max=100, medium_max=200, unit="chars")).size == (
        PayloadSize.MEDIUM
    )


@pytest.mark.parametrize(
    "text",
    [
        "Traceback (most recent call last):\n  File 'a.py', line 1\nKeyError: 'x'",
        "Error: reservation not found",
        "ERROR: could not build wheel",
        "ValueError: invalid literal",
        "bash: foo: command not found",
        "FAILED tests/test_x.py::test_y - assert 1 == 2",
        "Process finished with exit code 2",
    ],
)
def test_errors_in_text_are_failures(text):
    assert classify("bash", text).status == Status.FAILURE


@pytest.mark.parametrize(
    "text",
    ["Command timed out after 30 s", "subprocess.TimeoutExpired: ...", "Time limit exceeded", "TimeoutError"],
)
def test_timeouts_in_text(text):
    assert classify("bash", text).status == Status.TIMEOUT


@pytest.mark.parametrize(
    "text",
    [
        "def f(timeout=30):\n    error = None\n    return error",  # source code mentioning the words
        "Found 3 results about error-correcting codes",
        "All 12 tests passed",
    ],
)
def test_ordinary_text_is_success(text):
    assert classify("view", text).status == Status.SUCCESS


def test_structured_returns():
    assert classify("api", {"status": "error", "message": "no"}).status == Status.FAILURE
    assert classify("api", {"result": 3, "error": None}).status == Status.SUCCESS
    assert classify("api", {"error": {"code": 500}}).status == Status.FAILURE
    assert classify("api", {"timed_out": True}).status == Status.TIMEOUT
    assert classify("sh", {"exit_code": 1, "stdout": ""}).status == Status.FAILURE
    # SandboxFusion's run_code response: the nested run_result carries the outcome
    sandbox = {"status": "Success", "run_result": {"status": "TimeLimitExceeded", "return_code": None}}
    assert classify("run_code", sandbox).status == Status.TIMEOUT
    ok = {"status": "Success", "run_result": {"status": "Finished", "return_code": 0, "stdout": "4\n"}}
    assert classify("run_code", ok).status == Status.SUCCESS
    assert classify("api", [{"a": 1}, {"b": 2}]).status == Status.SUCCESS


def test_status_hint_wins():
    assert classify("t", "Traceback (most recent call last)", status_hint="success").status == Status.SUCCESS
    assert classify("t", "all good", status_hint="timeout").status == Status.TIMEOUT
    assert classify("t", "all good", status_hint=False).status == Status.FAILURE
    assert classify("t", "all good", status_hint=ToolStatus.FAILURE).status == Status.FAILURE
    # an unknown hint is ignored, not an error
    assert classify("t", "all good", status_hint="weird").status == Status.SUCCESS


class Hostile:
    def __str__(self):
        raise RuntimeError("no")


@pytest.mark.parametrize(
    "content",
    [None, "", b"", b"\xff\xfe\x00\x01" * 100, bytearray(b"\x00" * 10), 12345, 3.5, Hostile(), {}, []],
    ids=["none", "empty", "empty-bytes", "binary", "bytearray", "int", "float", "hostile", "dict", "list"],
)
def test_malformed_returns_give_a_defined_state(content):
    s = classify(None, content)
    assert s.tool == UNKNOWN_TOOL
    assert s.size in PayloadSize and s.status in Status


def test_empty_and_none_are_small_successes():
    for content in (None, "", b""):
        assert classify("t", content) == ToolState("t", PayloadSize.SMALL, Status.SUCCESS)


def test_huge_return_is_large_and_fast():
    huge = "line of build log\n" * 2_000_000 + "Traceback (most recent call last):\nOSError: disk full"
    s = classify("bash", huge)
    assert s.size == PayloadSize.LARGE
    assert s.status == Status.FAILURE  # found in the tail window


def test_cyclic_structure():
    a: list = []
    a.append(a)
    d: dict = {"self": None}
    d["self"] = d
    assert classify("x", a).status in Status
    assert classify("x", d).status in Status


def test_tool_names_are_bounded_keys():
    assert classify("", "x").tool == UNKNOWN_TOOL
    assert classify("  ", "x").tool == UNKNOWN_TOOL
    assert len(classify("t" * 10_000, "x").tool) == MAX_TOOL_NAME
    assert classify(42, "x").tool == "42"


def test_bad_thresholds_are_config_errors():
    with pytest.raises(ConfigError, match="unit"):
        classify("t", "x", unit="bytes")
    with pytest.raises(ConfigError, match="medium_max"):
        classify("t", "x", small_max=100, medium_max=50)
    with pytest.raises(ConfigError, match="small_max"):
        classify("t", "x", small_max=[1])


def test_trajectory_path():
    from libra.core.trajectory import Trajectory

    t = Trajectory("a", "p", 0, 100, [Turn(10, "s", 10), Turn(5, "e", 9000, ToolStatus.FAILURE), Turn(3)])
    assert trajectory_path(t) == (
        ToolState("s", PayloadSize.SMALL, Status.SUCCESS),
        ToolState("e", PayloadSize.LARGE, Status.FAILURE),
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(
    tool=st.one_of(st.none(), st.text(max_size=80), st.integers()),
    content=st.one_of(st.text(), st.binary(), json_values),
    hint=st.one_of(st.none(), st.text(max_size=12), st.booleans(), st.integers()),
)
def test_classify_never_raises(tool, content, hint):
    s = classify(tool, content, status_hint=hint)
    assert isinstance(s, ToolState)
    assert s.size in PayloadSize and s.status in Status
    assert 0 < len(s.tool) <= MAX_TOOL_NAME
