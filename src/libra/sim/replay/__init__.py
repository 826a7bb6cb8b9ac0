"""Replays of real serving measurements on the simulated engine (`libra replay-vllm`)."""
