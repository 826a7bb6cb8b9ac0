"""Reward functions built on the actions service's real tools.

- `unit_test_reward`: the fraction of a test file's tests a candidate solution passes, run by the
  sandboxed python test runner (elastic: the scheduler decides how many workers it gets).
- `judge_reward`: a score from a quota-limited HTTP tool (a judge model or scoring API) that
  answers JSON with a numeric `score`.

Both return a float and never raise for what the candidate does: a crash, a timeout or a judge
that fails all score 0, as a reward must.
"""

from __future__ import annotations

from libra.runtime.sandbox.client import ActionsClient


async def unit_test_reward(
    client: ActionsClient,
    solution: str,
    tests: str,
    module: str = "solution.py",
    test_file: str = "test_solution.py",
    parallel: int = 2,
    timeout_s: float = 30.0,
) -> float:
    sid = await client.create_session(files={module: solution, test_file: tests})
    try:
        r = await client.act(sid, tool="python_tests", path=test_file, parallel=parallel, timeout=timeout_s)
    finally:
        await client.delete_session(sid)
    summary = r.get("tests") or {}
    total = summary.get("tests", 0)
    return summary.get("passed", 0) / total if total else 0.0


async def judge_reward(
    client: ActionsClient, tool: str, payload: object, tokens: float | None = None
) -> float:
    r = await client.call_tool(tool, payload, tokens)
    body = r.get("body")
    if r.get("status") != "Success" or not isinstance(body, dict):
        return 0.0
    try:
        return float(body.get("score", 0.0))
    except (TypeError, ValueError):
        return 0.0
