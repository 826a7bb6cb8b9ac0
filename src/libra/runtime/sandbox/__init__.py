"""The live actions service: sandboxed code execution and tools, scheduled action by action.

`libra serve actions` runs it. It executes actions through the same `libra.actions.Orchestrator`
as the simulator, in bubblewrap sandboxes (see `sandbox.py`), behind a SandboxFusion-compatible
`/run_code`, a session API for per-trajectory sandboxes, quota-limited HTTP tools, `/health` and
Prometheus `/metrics`. `client.py` and `rewards.py` are what reward functions call.
"""
