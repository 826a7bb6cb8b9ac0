"""Chrome-trace (Perfetto) timelines: the one event format and writer, and the RL pipeline's
recorder of one chosen step (engine iterations, training, tool calls).

Only spans that overlap the chosen step's window are kept, so memory stays bounded however long
the simulation runs. Open the written `trace.json` in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

from pathlib import Path

from libra.sim.output import write_json


def span(pid: str, tid: str | int, name: str, t0: float, dur: float, args: dict | None = None) -> dict:
    """One complete slice ("X" event); times in seconds."""
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": t0 * 1e6, "dur": max(dur, 0.0) * 1e6,
            "args": args or {}}  # fmt: skip


def write_trace(events: list[dict], metadata: dict, path: Path) -> Path:
    return write_json({"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata}, path)


class Tracer:
    def __init__(self, step: int | None):
        self.step = step
        self.active = False
        self.events: list[dict] = []

    def step_started(self, s: int, now: float) -> None:
        if s == self.step:
            self.active = True

    def step_ended(self, s: int, now: float) -> None:
        if s == self.step:
            self.active = False

    def _span(self, pid: str, tid: str, name: str, t0: float, dur: float, args: dict | None = None) -> None:
        if self.active:
            self.events.append(span(pid, tid, name, t0, dur, args))

    def engine_span(self, engine, t0: float, t1: float, n_dec: int, prefill: int) -> None:
        name = "prefill+decode" if prefill else "decode"
        self._span("rollout", engine.id, name, t0, t1 - t0, {"decoding": n_dec, "prefill_tokens": prefill})

    def train_span(self, s: int, t0: float, dur: float) -> None:
        if s == self.step:
            self.active, was = True, self.active
            self._span("trainer", "train", f"train step {s}", t0, dur)
            self.active = was

    def tool_span(self, traj_id: str, tool: str | None, t0: float, dur: float) -> None:
        self._span("tools", "tool calls", tool or "tool", t0, dur, {"trajectory": traj_id})

    def write(self, system: str, path: Path) -> Path:
        return write_trace(self.events, {"system": system, "step": self.step}, path)
