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
        (TrainParallel(pp=3), "pp"),
        (TrainParallel(tp=3), "tp"),
        (TrainParallel(dp=0), "dp"),
    ],
)
def test_invalid_parallelism(tcm, par, field):
    with pytest.raises(ConfigError) as e:
        tcm.step(par, [1024])
    assert e.value.field == field


def test_empty_batch_is_an_error(tcm):
    with pytest.raises(ConfigError):
        tcm.step(TrainParallel(tp=8), [])
