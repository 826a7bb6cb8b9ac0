"""`libra train`'s configuration: one typed model, one default per field.

The embedded default (`configs/default.yaml`) runs on a laptop in a few minutes; a `--config FILE`
is merged over it and `--set a.b=c` overrides single values, then everything is validated at once,
so a bad value stops the run before any process starts, as one line naming the field (exit 2).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from libra.core.config import apply_overrides, build, load_yaml
from libra.core.errors import ConfigError
from libra.planner.config import ElasticConfig, PlannerConfig
from libra.runtime.elastic.config import ElasticRuntimeConfig
from libra.runtime.engine.sources import resolve

CONFIGS = "libra.runtime.train.configs"
# The loss's off-policy corrections (`grpo.Objective`): named here so the CLI validates without torch.
Correction = Literal["none", "tis"]


class _Strict(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)


class TaskConfig(_Strict):
    lo: int = Field(10, ge=0, le=9999, description="Smallest operand.")
    hi: int = Field(99, ge=0, le=9999, description="Largest operand.")
    ops: str = Field("+-", pattern=r"^[-+*]{1,3}$", description="Operators to draw from.")
    prompt: str = Field("What is {expr}?", min_length=1, max_length=2000, description="The user turn; {expr} is the problem.")  # fmt: skip
    system: str | None = Field(None, max_length=4000, description="A system turn before it (a checkpoint model's task).")  # fmt: skip
    base_eval: int = Field(0, ge=0, le=4096, description="Held-out problems the model is measured on before training and after the last step, greedy and sampled (0: none).")  # fmt: skip
    eval_every: int = Field(0, ge=0, le=100000, description="Measure the same held-out problems every this many steps too (0: only before and after; needs task.base_eval).")  # fmt: skip
    answer: Literal["exact", "last_number"] = Field("exact", description="exact: the answer is the whole text; last_number: the text's last integer.")  # fmt: skip
    tool: Literal["sandbox", "in_process"] = Field("sandbox", description="Where calc runs.")
    slow_tool_s: float = Field(0.0, ge=0, le=600, description="A workload shift: each tool call waits this long ...")  # fmt: skip
    slow_tool_from: int = Field(0, ge=0, description="... once this many steps have trained.")

    @model_validator(mode="after")
    def _range(self) -> TaskConfig:
        if self.hi < self.lo:
            raise ConfigError("task.hi", self.hi, f">= task.lo ({self.lo})")
        if self.eval_every and not self.base_eval:
            raise ConfigError(
                "task.eval_every", self.eval_every, "0 unless task.base_eval sets the held-out problems"
            )
        return self


class RolloutConfig(_Strict):
    groups_per_step: int = Field(8, ge=1, le=1024, description="GRPO groups (prompts) a step trains.")
    group_size: int = Field(8, ge=2, le=64, description="Samples per prompt.")
    temperature: float = Field(1.0, gt=0, le=2.0, description="Sampling temperature; the trainer scores tokens at the same one.")  # fmt: skip
    top_p: float = Field(1.0, gt=0, le=1.0, description="Nucleus mass, in (0, 1]; the trainer applies the same.")  # fmt: skip
    top_k: int = Field(0, ge=0, le=1_000_000, description="Keep the k most likely tokens (0: all); the trainer applies the same.")  # fmt: skip
    max_tokens: int = Field(64, ge=8, le=4096, description="Per model call.")
    agent_loop: str = Field("calc", description="A registered agent loop or pkg.module:Class.")
    max_drop_fraction: float = Field(0.5, ge=0, le=1, description="Dropped groups in a batch that stop the run.")  # fmt: skip
    turn_timeout_s: float = Field(120.0, gt=0, le=3600)


class PipelineConfig(_Strict):
    staleness: int = Field(1, ge=0, le=64, description="Batch s starts once s - k steps are trained.")
    consume: Literal["completion", "batch"] = "completion"
    mode: Literal["disaggregated", "colocated-partial"] = Field("disaggregated", description="disaggregated: rollout runs on while the trainer trains; colocated-partial: APRIL's partial rollouts, the engines paused while the trainer trains (docs/train.md).")  # fmt: skip
    over_provision: float = Field(2.0, ge=1, le=16, description="colocated-partial: groups in flight per step, times rollout.groups_per_step.")  # fmt: skip

    @property
    def colocated_partial(self) -> bool:
        return self.mode == "colocated-partial"

    @model_validator(mode="after")
    def _partial(self) -> PipelineConfig:
        if self.colocated_partial and self.staleness < 1:
            raise ConfigError("pipeline.staleness", self.staleness, ">= 1 with pipeline.mode colocated-partial (a carried group's tokens are trained a step later)")  # fmt: skip
        if self.colocated_partial and self.consume != "completion":
            raise ConfigError("pipeline.consume", self.consume, "completion with pipeline.mode colocated-partial (a step trains the first groups to finish)")  # fmt: skip
        return self


class BucketSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,32}$")
    tp: int = Field(
        1, ge=1, le=64, description="The bucket's TP label (the built-in engine runs on one core)."
    )
    max_context: int = Field(ge=16, le=8192)
    instances: int = Field(1, ge=1, le=64)


class EngineSettings(_Strict):
    model: str = Field("tiny8", description="A preset, smollm2-135m, a Hugging Face directory or a .gguf file (docs/models.md).")  # fmt: skip
    max_model_len: int | None = Field(None, ge=16, le=1 << 20, description="Cap a checkpoint's context (each engine's KV cache must hold one).")  # fmt: skip
    max_num_seqs: int = Field(64, ge=1, le=4096)
    kv_cache_mb: int = Field(32, ge=17, le=65536)
    threads: int = Field(1, ge=1, le=256)
    step_log: bool = Field(False, description="Each engine appends its steps (composition, CPU seconds) to RUN/logs/ENGINE-steps.jsonl.")  # fmt: skip

    @model_validator(mode="after")
    def _known(self) -> EngineSettings:
        resolve(self.model, self.max_model_len, "engine.model")  # a missing file or extra stops the run here
        return self

    @property
    def builtin(self) -> bool:
        return resolve(self.model, self.max_model_len, "engine.model").builtin


class GatewaySettings(_Strict):
    router: str = Field("cmlfq", description="A registered router name or pkg.module:Class.")
    router_params: dict = Field(default_factory=dict)


class ActionsSettings(_Strict):
    url: str | None = Field(None, pattern=r"^https?://", description="An actions service to use (default: start one).")  # fmt: skip
    insecure_no_sandbox: bool = Field(
        False, description="Start it without bubblewrap (never on shared machines)."
    )
    warm_pool: int = Field(4, ge=0, le=256)
    connect_timeout_s: float = Field(10.0, gt=0, le=600, description="How long to wait for it at start.")


class LoraSettings(_Strict):
    """peft's LoRA on a checkpoint model: only the adapters train, and only they are published."""

    r: int = Field(0, ge=0, le=1024, description="Adapter rank (0: full fine-tuning).")
    alpha: float = Field(16.0, gt=0)
    targets: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1, description="Module names that get adapters.")  # fmt: skip


class TrainerConfig(_Strict):
    replicas: int = Field(2, ge=1, le=64, description="Core data-parallel trainer replicas (one gloo group).")
    lr: float = Field(3e-4, gt=0, le=1, description="RL learning rate (AdamW); 1e-3 undid the warm-start here.")  # fmt: skip
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = Field(0.0, ge=0, le=1)
    grad_clip: float = Field(1.0, gt=0)
    clip_low: float = Field(0.2, ge=0, le=1)
    clip_high: float = Field(0.28, ge=0, le=10)
    dual_clip: float | None = Field(3.0, gt=1, le=1000, description="verl's clip_ratio_c: a negative advantage's token loss is at most this times |A| (null: off).")  # fmt: skip
    correction: Correction = Field("tis", description="Off-policy correction: none (PPO ratio to the engine's log-probs) or tis (truncated importance sampling).")  # fmt: skip
    tis_cap: float = Field(2.0, ge=1, le=1000, description="With correction tis: the importance weight's cap.")  # fmt: skip
    normalize_std: bool = Field(
        True, description="Divide advantages by the group's std (GRPO); false: Dr. GRPO."
    )
    negative_weight: float = Field(0.25, ge=0, le=1, description="Scales below-mean samples' advantages (1: plain GRPO, 0: positive samples only); docs/train.md compares 1 and 0.25 over seeds.")  # fmt: skip
    micro_batch_tokens: int = Field(8192, ge=256)
    memory_budget_mb: int = Field(512, ge=1, le=1 << 24, description="A replica's training memory; EARL's selector packs micro-batches within it.")  # fmt: skip
    context_edges: list[int] = Field([256, 512, 1024, 2048, 4096, 8192], min_length=1, description="The selector's context ranges.")  # fmt: skip
    threads: int = Field(1, ge=1, le=256)
    collective_timeout_s: float = Field(120.0, gt=0, le=3600, description="A replica waiting longer on its peers fails.")  # fmt: skip
    keep_checkpoints: int = Field(3, ge=1, le=1000)
    checkpoint_every: int = Field(1, ge=1, le=100_000, description="Steps between full checkpoints (weights and AdamW state, synced and hashed; the last step always writes one); the steps between write their weights alone, unsynced, for publication (RUN/weights/). --resume starts from the newest full checkpoint.")  # fmt: skip
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$", description="cpu (gloo) or cuda (NCCL between replicas).")  # fmt: skip
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="auto: float32 on CPU, bfloat16 on CUDA.")  # fmt: skip
    lora: LoraSettings = LoraSettings()


class WarmStartConfig(_Strict):
    steps: int = Field(600, ge=0, le=100_000, description="At most this many supervised steps on demonstrations before RL.")  # fmt: skip
    lr: float = Field(3e-3, gt=0, le=1)
    batch: int = Field(32, ge=1, le=4096)
    target_success: float = Field(0.3, ge=0, le=1, description="Stop once the probe's success reaches this (0: run every step).")  # fmt: skip
    probe_every: int = Field(2, ge=1, le=100_000, description="Steps between two probes.")


class PublishConfig(_Strict):
    pause_mode: Literal["abort", "in_place", "retract"] = Field("retract", description="How engines pause for new weights: retract recomputes running requests' KV with the new weights (every token has one version); in_place keeps the old KV (tokens after the update are marked mixed); abort ends them.")  # fmt: skip
    admin_token: str | None = Field(None, description="Bearer token of the engines' control endpoints.")


class ElasticSettings(_Strict):
    """The hybrid pool live: rollout engines that may become trainer replicas and back."""

    enabled: bool = Field(False, description="Let the planner's controller borrow rollout engines for training.")  # fmt: skip
    hybrid: int = Field(1, ge=1, le=16, description="Engines (of buckets with more than one) that may be borrowed.")  # fmt: skip
    policy: ElasticConfig = Field(default_factory=ElasticConfig, description="The controller's thresholds.")
    runtime: ElasticRuntimeConfig = Field(default_factory=ElasticRuntimeConfig, description="Join timeouts.")
    drain_timeout_s: float = Field(120.0, gt=0, le=3600, description="A drained engine's requests must end within this.")  # fmt: skip


class PlannerSettings(_Strict):
    """The planner, live: the fleet planner re-plans how many engines serve each bucket and where
    the boundaries lie, under the simulator's triggers and apply rule (`policy`)."""

    replan: bool = Field(True, description="Let the planner move engines between buckets and move the boundaries.")  # fmt: skip
    policy: PlannerConfig = Field(default_factory=PlannerConfig, description="Triggers, apply rule, bucket shape.")  # fmt: skip


class TrainConfig(_Strict):
    seed: int = Field(0, ge=0, le=2**31 - 1)
    steps: int = Field(100, ge=1, le=100_000)
    task: TaskConfig = TaskConfig()
    rollout: RolloutConfig = RolloutConfig()
    pipeline: PipelineConfig = PipelineConfig()
    buckets: list[BucketSpec] = Field(
        default_factory=lambda: [
            BucketSpec(name="short", tp=1, max_context=256),
            BucketSpec(name="long", tp=2, max_context=8192),
        ],  # fmt: skip
        min_length=1,
    )
    engine: EngineSettings = EngineSettings()
    gateway: GatewaySettings = GatewaySettings()
    actions: ActionsSettings = ActionsSettings()
    trainer: TrainerConfig = TrainerConfig()
    warmstart: WarmStartConfig = WarmStartConfig()
    publish: PublishConfig = PublishConfig()
    elastic: ElasticSettings = ElasticSettings()
    planner: PlannerSettings = PlannerSettings()
    metrics_port: int = Field(0, ge=-1, le=65535, description="The driver's Prometheus port (0: any free one, -1: none).")  # fmt: skip
    save_trajectories: bool = Field(False, description="Write every trained trajectory's tokens to RUN/trajectories.jsonl.")  # fmt: skip
    ray_address: str | None = Field(None, description="With --launcher ray: a cluster address (default: start a local one).")  # fmt: skip

    @model_validator(mode="after")
    def _buckets(self) -> TrainConfig:
        names = [b.name for b in self.buckets]
        if len(set(names)) != len(names):
            raise ConfigError("buckets", names, "unique bucket names")
        ctx = [b.max_context for b in self.buckets]
        if len(set(ctx)) != len(ctx):
            raise ConfigError("buckets", ctx, "a different max_context for every bucket")
        if self.pipeline.colocated_partial and self.elastic.enabled:
            raise ConfigError("pipeline.mode", self.pipeline.mode, "disaggregated with elastic.enabled (the hybrid pool lends rollout engines to training, which colocated-partial pauses)")  # fmt: skip
        return self


def embedded(name: str = "default") -> Path:
    return Path(str(resources.files(CONFIGS).joinpath(f"{name}.yaml")))


def load_train_config(path: str | None, overrides: list[str], base: dict | None = None) -> TrainConfig:
    """The embedded default, then the file's values, then each `--set`, validated as one."""
    data = load_yaml(embedded())
    if base:
        data = _merge(data, base)
    if path:
        data = _merge(data, load_yaml(_named(path)))
    return build(TrainConfig, apply_overrides(data, overrides))


def _named(path: str) -> Path | str:
    """`--config elastic-demo`: an embedded config by name, when no such file exists."""
    if (
        not Path(path).exists()
        and path.replace("-", "_").replace("_", "").isalnum()
        and embedded(path).exists()
    ):
        return embedded(path)
    return path


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
