import pytest

from libra.core.errors import ConfigError
from libra.costmodel.training import TrainCostModel, TrainParallel


@pytest.fixture
def tcm(catalog):
    return TrainCostModel(catalog.hardware("a800-80g"), catalog.model("qwen3-14b"))


def test_more_gpus_faster(tcm):
    lens = [4096] * 256
    assert (
        tcm.step(TrainParallel(tp=4, dp=4), lens).step_time_s
        < tcm.step(TrainParallel(tp=4, dp=2), lens).step_time_s
    )


def test_attention_is_quadratic(tcm):
    par = TrainParallel(tp=8, dp=1)
    short = tcm.step(par, [1024] * 32).compute_s
    long = tcm.step(par, [32768] * 1).compute_s  # same tokens
    assert long > 1.25 * short  # 14B at 32K: attention adds ~40% over the linear FLOPs


def test_pipeline_bubble(tcm):
    lens = [2048] * 64
    assert tcm.step(TrainParallel(tp=4, pp=1, dp=2), lens).pp_bubble_s == 0
    est = tcm.step(TrainParallel(tp=4, pp=2, dp=1), lens)
    assert est.pp_bubble_s > 0


def test_memory_fit_decisions(tcm):
    # 14.8B params: weights+grads+optimizer = 18 bytes/param unsharded = 266 GB: no fit on 1 GPU.
    assert not tcm.memory(TrainParallel(), 4096).fits
    assert tcm.memory(TrainParallel(tp=8, dp=2), 4096).fits
    # 64K tokens without recompute needs far more activation memory than with it.
    no_rc = tcm.memory(TrainParallel(tp=8, recompute=False), 65536)
    rc = tcm.memory(TrainParallel(tp=8, recompute=True), 65536)
    assert no_rc.activations > 4 * rc.activations
    # Context parallelism divides the sequence, so a long context fits.
    assert (
        tcm.memory(TrainParallel(tp=4, cp=2, dp=2), 131072).activations
        < tcm.memory(TrainParallel(tp=4, dp=4), 131072).activations
    )


def test_distributed_optimizer_shards(tcm):
    a = tcm.memory(TrainParallel(tp=8, dp=1), 2048).optimizer
    b = tcm.memory(TrainParallel(tp=8, dp=4), 2048).optimizer
    assert b == pytest.approx(a / 4)


@pytest.mark.parametrize(
    "par,field",
    [
        (TrainParallel(tp=16), "tp"),
        (TrainParallel(pp=41), "pp"),  # more stages than qwen3-14b's 40 layers
        (TrainParallel(tp=3), "tp"),
        (TrainParallel(dp=0), "dp"),
    ],
)
def test_invalid_parallelism(tcm, par, field):
    with pytest.raises(ConfigError) as e:
        tcm.step(par, [1024])
    assert e.value.field == field


def test_uneven_pipeline_stages_are_priced_by_the_largest(tcm):
    """40 layers in 3 stages run as 14 + 13 + 13: priced as 3 even stages of 14 layers, between
    2 and 4 even stages, and identical to the even formula when pp divides the layers."""
    lens = [4096] * 64
    t = {pp: tcm.step(TrainParallel(tp=2, pp=pp, dp=2), lens) for pp in (2, 3, 4)}
    assert t[4].compute_s < t[3].compute_s < t[2].compute_s
    assert t[3].compute_s == pytest.approx(t[2].compute_s * 14 / 20, rel=0.01)
    m = {pp: tcm.memory(TrainParallel(tp=2, pp=pp, dp=2), 8192).weights for pp in (2, 3, 4)}
    assert m[3] == pytest.approx(m[2] * 14 / 20) and m[4] == pytest.approx(m[2] / 2)


def test_empty_batch_is_an_error(tcm):
    with pytest.raises(ConfigError):
        tcm.step(TrainParallel(tp=8), [])
