"""Action-level orchestration scenarios (ARL-Tangram): trajectories' external actions on CPU
sandboxes, GPU reward services and API quotas, scheduled by `libra.actions` on a simulated clock.

`runner` plays the scenario's steps; `systems` are the schedulers compared; `workloads` generate
each step's action plans.
"""
