import json

import pytest

from libra.core.errors import TraceError
from libra.core.trace import read_trace, write_trace
from libra.core.trajectory import ToolStatus


def test_real_tau_bench_trace_reads(shared_data):
    trajs = read_trace(shared_data / "trajectories" / "tau-bench-airline.jsonl")
    assert len(trajs) == 200
    assert len({t.prompt_id for t in trajs}) == 50
    assert all(not t.turns[-1].has_tool for t in trajs)
    fails = sum(t.failures for t in trajs)
    # The data README's 6.3% counts real tool calls; replies to the user ("respond") cannot fail.
    tool_turns = sum(1 for t in trajs for u in t.turns if u.has_tool and u.tool != "respond")
    assert fails / tool_turns == pytest.approx(0.063, abs=0.005)
    assert sum(1 for t in trajs if t.failures) / len(trajs) == pytest.approx(0.18, abs=0.01)


def test_roundtrip(tmp_path, shared_data):
    trajs = read_trace(shared_data / "trajectories" / "tau-bench-airline.jsonl")[:10]
    p = tmp_path / "t.jsonl"
    write_trace(trajs, p)
    again = read_trace(p)
    assert [t.to_dict() for t in again] == [t.to_dict() for t in trajs]


GOOD = {"id": "a", "prompt_id": "p", "step": 0, "prompt_tokens": 10,
        "turns": [{"output_tokens": 5, "tool": "bash", "tool_return_tokens": 3, "tool_status": "failure"},
                  {"output_tokens": 2}]}  # fmt: skip


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda d: d.pop("prompt_tokens"), "prompt_tokens"),
        (lambda d: d.update(prompt_tokens=-3), "prompt_tokens"),
        (lambda d: d["turns"][0].update(tool_status="exploded"), "turns[0].tool_status"),
        (lambda d: d["turns"][1].update(tool="bash"), "turns[1].tool"),
        (lambda d: d["turns"][0].pop("tool"), "turns[0].tool"),
        (lambda d: d.update(turns=[]), "turns"),
        (lambda d: d["turns"][0].update(output_tokens="many"), "output_tokens"),
        (lambda d: d["turns"][0].update(tool_latency_s=-1), "tool_latency_s"),
        # each of these replayed for hours, or with nonsense times, before it was refused
        (lambda d: d["turns"][0].update(output_tokens=10**12), "output_tokens"),
        (lambda d: d["turns"][0].update(tool_latency_s=float("nan")), "tool_latency_s"),
        (lambda d: d["turns"][0].update(tool_latency_s=1e308), "tool_latency_s"),
        (lambda d: d.update(prompt_tokens=2**24, turns=[{"output_tokens": 2}]), "turns"),
        (lambda d: None, "id"),  # line 1 has the same id: routers key trajectories by id
    ],
)
def test_malformed_line_names_file_line_field(tmp_path, mutate, field):
    bad = json.loads(json.dumps(GOOD))
    mutate(bad)
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(GOOD) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert f"{p}:2:" in str(e.value) and field in str(e.value)


def test_not_json(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("{nope\n")
    with pytest.raises(TraceError, match=":1:"):
        read_trace(p)


def test_llmservingsim_sessions(tmp_path):
    rec = {"session_id": "s1", "arrival_time_ns": 0,
           "sub_requests": [{"input_toks": 100, "output_toks": 20, "tool_duration_ns": 2_000_000_000},
                            {"input_toks": 150, "output_toks": 10}]}  # fmt: skip
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps(rec) + "\n")
    (t,) = read_trace(p)
    assert t.prompt_tokens == 100 and len(t.turns) == 2
    assert t.turns[0].tool_return_tokens == 30 and t.turns[0].tool_latency_s == 2.0
    assert t.turns[0].tool_status == ToolStatus.SUCCESS and t.total_tokens == 160
