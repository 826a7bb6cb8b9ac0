"""EARL's parallelism selector: switching TP/CP as the context grows, never past the memory model."""

from __future__ import annotations

import pytest

from libra.core.errors import InfeasibleError
from libra.planner import GlobalPlanner, ParallelismSelector, PlanningProblem, SelectorConfig, WorkloadStats
from libra.planner.selector import range_edge
from tests.test_planner import synthetic


@pytest.fixture(scope="module")
def problem(catalog) -> PlanningProblem:
    # 2 nodes of A800 for Qwen3-14B, contexts allowed up to 128K tokens.
    return PlanningProblem(catalog.hardware("a800-80g"), 2, catalog.model("qwen3-14b"), 32, 16, 131072)


GROWTH = [3000, 3500, 6000, 12000, 24000, 48000, 100000, 130000]


def test_context_growing_past_the_initial_configuration(problem):
    sel = ParallelismSelector(problem)
    train_cm = problem.train_model()
    first = sel.observe(GROWTH[0], gpus=8)
    assert first is not None and first.context_bound == 4096
    initial_train, initial_tp = first.train, first.rollout_tp
    # The configuration chosen for short contexts cannot hold where the context is going ...
    assert not train_cm.memory(initial_train, GROWTH[-1]).fits
    switches, bound = 0, first.context_bound
    for ctx in GROWTH[1:]:
        decision = sel.observe(ctx, gpus=8)
        new_range = range_edge(sel.config.edges, ctx) != bound
        assert (decision is not None) == new_range  # switch exactly when the context changes range
        switches += decision is not None
        bound = sel.bound
        # ... so the selector lengthens it by parallelism: every step fits, nothing is truncated.
        assert bound >= ctx
        assert train_cm.memory(sel.train, bound).fits and sel.train.gpus <= 8
        assert problem.rollout_model(sel.rollout).kv_capacity_tokens() >= 4 * bound
    assert switches >= 4
    assert sel.train.tp * sel.train.cp > initial_train.tp * initial_train.cp
    # With the measured GPU terms and max_num_seqs capping each instance, TP2 already wins per GPU
    # at short context (EARL: "TP4 about 31% better at short context"), and it holds the long
    # contexts too, so rollout TP need not grow; training parallelism must.
    assert sel.rollout >= initial_tp


def test_choices_are_the_best_that_fit(problem):
    sel = ParallelismSelector(problem)
    for bound in (4096, 32768, 131072):
        tp = sel.rollout_tp(bound)
        fits = {t for t in (1, 2, 4, 8) if problem.rollout_model(t).kv_capacity_tokens() >= 4 * bound}
        per_gpu = {t: problem.rollout_model(t).throughput(problem.max_num_seqs, bound // 2) / t for t in fits}
        assert tp == max(per_gpu, key=per_gpu.get)
        train = sel.train_parallel(bound, 8)
        assert problem.train_model().memory(train, bound).fits
        assert (
            train.cp == 1
            or not problem.train_model()
            .memory(type(train)(train.tp, train.pp, train.dp, train.cp // 2, train.micro_batch), bound)
            .fits
        )  # CP only where the context needs it


def test_shrinking_context_waits_for_patience(problem):
    sel = ParallelismSelector(problem, SelectorConfig(down_patience=3))
    sel.observe(60000, gpus=8)
    high = sel.bound
    assert sel.observe(3000, gpus=8) is None and sel.observe(3000, gpus=8) is None
    assert sel.observe(60000, gpus=8) is None  # back up: the streak resets
    assert sel.observe(3000, gpus=8) is None and sel.observe(3000, gpus=8) is None
    down = sel.observe(3000, gpus=8)
    assert down is not None and down.context_bound < high == 65536


def test_a_context_nothing_can_hold_is_a_clear_error(problem):
    sel = ParallelismSelector(problem)
    with pytest.raises(InfeasibleError) as e:
        sel.observe(4_000_000, gpus=8)
    assert "qwen3-14b" in str(e.value) and "4000000-token" in str(e.value)
    assert sel.train is None  # the failed switch left no half-made choice behind


def test_range_edges():
    assert range_edge([4096, 8192], 1) == 4096
    assert range_edge([4096, 8192], 8192) == 8192
    assert range_edge([4096, 8192], 8193) == 16384  # past the last edge: the next power of two


def test_the_planner_searches_with_the_selector_bound(catalog):
    p = PlanningProblem(catalog.hardware("a800-80g"), 6, catalog.model("qwen3-14b"), 32, 16, 131072)
    planner = GlobalPlanner(p)
    short = planner.plan(WorkloadStats.from_trajectories(synthetic(512, 1, out_median=150, turns=(1, 3))))
    long = planner.plan(
        WorkloadStats.from_trajectories(synthetic(512, 1, out_median=9000, turns=(4, 12), max_length=131072))
    )
    assert short.context_bound < long.context_bound
    cm = p.train_model()
    assert cm.memory(long.train, long.context_bound).fits
    assert not cm.memory(short.train, long.context_bound).fits  # short contexts got a cheaper layout


# ---- the live CPU trainer's packing selector (EARL's rule on the built-in model) -------------------


def _tiny_dims():
    from libra.planner.cpu_fit import DenseDims
    from libra.runtime.engine.config import PRESETS

    return DenseDims.of(PRESETS["tiny"])


def test_cpu_fit_dims_count_the_built_in_models_parameters():
    from libra.runtime.engine.config import PRESETS
    from libra.runtime.engine.model import TinyTransformer

    model = TinyTransformer(PRESETS["tiny"])
    assert _tiny_dims().params() == sum(p.numel() for p in model.parameters())


def test_cpu_fit_picks_the_largest_packing_that_fits_and_refuses_with_reasons():
    from libra.planner.cpu_fit import CpuFitSelector, train_bytes

    dims = _tiny_dims()
    budget = train_bytes(dims, 16384, 8192)  # one 16K micro-batch of 8K sequences just fits
    sel = CpuFitSelector(dims, budget)
    fit = sel.choose(3000)
    fits = [p for p in sel.packings if p >= 4096 and train_bytes(dims, p, 4096) <= budget]
    assert (fit.context_bound, fit.packed_tokens) == (4096, max(fits))
    assert fit.refused and all("MiB" in r and "> budget" in r for r in fit.refused)
    assert len(fit.refused) == sum(1 for p in sel.packings if p > fit.packed_tokens)
    # Longer contexts need larger attention buffers: the packing shrinks, the context never does.
    longer = sel.choose(8000)
    assert (longer.context_bound, longer.packed_tokens) == (
        8192,
        16384,
    ) and longer.packed_tokens < fit.packed_tokens


def test_cpu_fit_refuses_a_context_that_cannot_fit_and_never_truncates():
    import pytest as _pytest

    from libra.core.errors import InfeasibleError
    from libra.planner.cpu_fit import CpuFitSelector, train_bytes

    dims = _tiny_dims()
    sel = CpuFitSelector(dims, train_bytes(dims, 8192, 8192))
    assert sel.observe(5000).context_bound == 8192
    assert sel.observe(6000) is None  # same range: no switch
    with _pytest.raises(InfeasibleError, match="32768-token sequence") as e:
        sel.observe(30000)
    assert "attention scores" in str(e.value)
    assert sel.current.context_bound == 8192  # the last fitting decision stands
