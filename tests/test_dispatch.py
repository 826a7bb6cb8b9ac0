"""EARL's data dispatcher with real gloo processes: every trainer rank gets exactly its samples of
the token-balanced layout, with the producers' bytes, by the direct path and by the baseline."""

from __future__ import annotations

import pytest

from libra.runtime.dispatch import MODES, Plan, checksum, driver_bytes, run_dispatch, sample_payload

pytestmark = pytest.mark.timeout(300)


def test_every_rank_gets_exactly_its_samples_by_both_paths(tmp_path):
    plan = Plan(tokens=(700, 30, 1200, 64, 64, 900, 5, 333, 2048, 17), producers=2, ranks=3)
    results = run_dispatch(plan, tmp_path, repeats=2)
    assert [r.mode for r in results] == list(MODES)
    want = {
        r: {i: checksum(sample_payload(i, plan.tokens[i])) for i in share}
        for r, share in enumerate(plan.shares)
    }
    for res in results:
        assert res.received == want, res.mode  # each rank: its samples, no other, bytes intact
        assert res.latency_s > 0
    direct, gather = results
    assert direct.driver_bytes == 8 * len(plan.tokens)  # only the layout crosses the driver
    assert gather.driver_bytes > 2 * sum(4 * 3 * t for t in plan.tokens)


def test_layout_balances_tokens_across_ranks():
    plan = Plan(tokens=(8192,) * 4 + (16384,) * 2, producers=2, ranks=4)
    loads = sorted(sum(plan.tokens[i] for i in s) for s in plan.shares)
    assert loads == [16384] * 4
    assert driver_bytes(plan, "gather") > driver_bytes(plan, "direct")
