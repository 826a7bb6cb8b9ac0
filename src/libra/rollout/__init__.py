"""Rollout routing policies: C-MLFQ (tool-return state, causal prefix tree, bucket rule) and
baselines. Pure code: routers see snapshots and return decisions; the simulator and the live
gateway carry the decisions out."""
