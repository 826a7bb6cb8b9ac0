"""The run folder: steps.json, the reward curve, the Perfetto timeline, the final table.

RUN/steps.json      one object per step (see `StepRecord`; appended across --resume)
RUN/reward.png      success and reward per step, and the step time split
RUN/trace.json      Chrome-trace timeline (ui.perfetto.dev): the driver's phases, each rollout
                    batch, and every model turn on the engine that served it
RUN/summary.json    the figures of the final table
RUN/metrics.prom    the driver's Prometheus metrics at the end
RUN/checkpoints/    step-NNNNNN/{model.pt, optimizer.pt, manifest.json}, every trainer.checkpoint_every
RUN/weights/        version-NNNNNN.pt: the weights alone, for the engines, between two checkpoints
RUN/logs/           one log per process; processes.json says which is which
RUN/tb/, RUN/wandb/ the per-step curves (`curves`), when their extras are installed or asked for
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from libra.core.curves import CurveOptions, Curves, flatten

MOVING = 5  # steps in the moving average that `steps_to_success_0_8` and `final_success` use


@dataclass(slots=True)
class StepRecord:
    step: int
    reward: float
    success: float
    weight_version: int
    trained: int
    dropped: dict
    step_time_s: float
    rollout_wait_s: float
    train_s: float
    publish_s: float
    tokens: dict
    tokens_per_s: float
    staleness: dict
    sampled_versions: dict
    routing: dict
    tools: dict
    loss: dict
    replicas_equal: bool
    planner: dict | None = None
    selector: dict | None = None  # EARL: this step's packing, and what was refused and why
    elastic: dict | None = None  # the hybrid pool: joins, releases, rollbacks, hybrid_active, states
    fleet: dict | None = None  # the re-planned layout: buckets' boundaries and engines, what moved
    memory: dict | None = None  # each trainer replica's peak resident memory (and CUDA peak), by rank
    carried: int | None = None  # colocated-partial: groups still in flight when the step's rollout stopped

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class Timeline:
    """Chrome-trace complete events ("ph": "X"), wall-clock microseconds from the run's start."""

    t0: float
    events: list[dict] = field(default_factory=list)
    _tids: dict[str, int] = field(default_factory=dict)

    def span(self, track: str, name: str, start: float, end: float, **args) -> None:
        tid = self._tids.setdefault(track, len(self._tids) + 1)
        self.events.append({"name": name, "ph": "X", "pid": 1, "tid": tid, "ts": round((start - self.t0) * 1e6),
                            "dur": max(1, round((end - start) * 1e6)), "args": args})  # fmt: skip

    def chrome(self) -> dict:
        names = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": t, "args": {"name": n}} for n, t in self._tids.items()]  # fmt: skip
        return {"traceEvents": names + self.events, "displayTimeUnit": "ms"}


def moving(xs: list[float], k: int = MOVING) -> list[float]:
    return [sum(xs[max(0, i - k + 1) : i + 1]) / len(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def summarize(records: list[dict]) -> dict:
    """The final figures (also `bench_train.py --json`'s)."""
    if not records:
        return {"steps": 0}
    succ = [r["success"] for r in records]
    avg = moving(succ)
    # the first step whose full 5-step window (steps s-4..s) averages 0.8
    reach = next((r["step"] for i, (r, a) in enumerate(zip(records, avg, strict=True)) if a >= 0.8 and i >= MOVING - 1), None)  # fmt: skip
    step_s = sum(r["step_time_s"] for r in records)
    pub = sum(r["publish_s"] for r in records)
    return {
        "steps": len(records),
        "first_success": succ[0],
        "final_success": avg[-1],
        "best_success": max(avg),
        "steps_to_success_0_8": reach,
        "mean_step_s": step_s / len(records),
        "mean_rollout_wait_s": sum(r["rollout_wait_s"] for r in records) / len(records),
        "mean_train_s": sum(r["train_s"] for r in records) / len(records),
        "mean_publish_s": pub / len(records),
        "tokens_per_s": sum(r["tokens"]["total"] for r in records) / max(step_s, 1e-9),
        "control_share": pub / max(step_s, 1e-9),
        "trained": sum(r["trained"] for r in records),
        "dropped": sum(r["dropped"]["trajectories"] for r in records),
        "final_weight_version": records[-1]["weight_version"],
        "staleness": staleness_summary(records),
        "same_version_gap_max": max(
            (r.get("loss", {}).get("same_version_gap_max", 0.0) for r in records), default=0.0
        ),
        "same_version_tokens": sum(r.get("loss", {}).get("same_version_tokens", 0) for r in records),
        **({"elastic": elastic_summary(records)} if any(r.get("elastic") for r in records) else {}),
    }


def staleness_summary(records: list[dict]) -> dict:
    """Over the run: trained groups and model tokens by age (steps between the weights that
    sampled them and the step that trained them; a token's oldest weights, its KV cache's
    included), and the groups that expired past the bound (replaced, never trained)."""
    groups: dict[int, int] = {}
    tokens: dict[int, int] = {}
    for r in records:  # steps.json of an earlier version (a resumed run) may lack these keys
        st = r.get("staleness", {})
        for age in st.get("groups", []):
            groups[age] = groups.get(age, 0) + 1
        for age, n in st.get("tokens", {}).items():
            tokens[int(age)] = tokens.get(int(age), 0) + n
    expired = sum(r.get("staleness", {}).get("expired_groups", 0) for r in records)
    return {
        "groups": dict(sorted(groups.items())),
        "tokens": dict(sorted(tokens.items())),
        "expired_groups": expired,
    }


def elastic_summary(records: list[dict]) -> dict:
    """The hybrid pool over the run: its counters at the end, and the step time with a borrowed
    replica counted beside the step time without (same run: the first steps and a workload shift
    differ, so this is no A/B; `elastic.enabled=false` is the control run)."""
    pool = [r for r in records if r.get("elastic")]
    last = pool[-1]["elastic"]
    on = [r["step_time_s"] for r in pool if r["elastic"]["hybrid_active"] > 0]
    off = [r["step_time_s"] for r in pool if r["elastic"]["hybrid_active"] == 0]
    return {
        "joins": last["joins"],
        "releases": last["releases"],
        "rollbacks": last["rollbacks"],
        "hybrid_active_steps": len(on),
        "mean_step_s_hybrid_active": sum(on) / len(on) if on else None,
        "mean_step_s_no_hybrid": sum(off) / len(off) if off else None,
    }


def pool_changes(records: list[dict]) -> dict[str, list[int]]:
    """The steps at which the pool's counters went up: borrows, releases, rollbacks."""
    out: dict[str, list[int]] = {"joins": [], "releases": [], "rollbacks": []}
    prev = dict.fromkeys(out, 0)
    for r in records:
        e = r.get("elastic")
        if not e:
            continue
        for k in out:
            if e[k] > prev[k]:
                out[k].append(r["step"])
            prev[k] = e[k]
    return out


@dataclass(frozen=True, slots=True)
class WarmStartRecord:
    """What the warm-start did, for summary.json (none on a resumed run)."""

    steps: int
    probe_success: float | None


def curve_scalars(rec: dict) -> dict[str, float]:
    """What TensorBoard and W&B show per step: reward and success, the step time split,
    tokens/s, staleness, the loss's statistics, and the controller's decisions."""
    planner, pool = rec.get("planner") or {}, rec.get("elastic") or {}
    picked = {
        "reward": rec["reward"], "success": rec["success"], "weight_version": rec["weight_version"],
        "step_time_s": {"total": rec["step_time_s"], "rollout_wait": rec["rollout_wait_s"],
                        "train": rec["train_s"], "publish": rec["publish_s"]},
        "tokens_per_s": rec["tokens_per_s"], "trained": rec["trained"],
        "dropped": rec["dropped"]["trajectories"],
        "staleness": {"mean": rec["staleness"]["mean"], "max": rec["staleness"]["max"]},
        "loss": rec["loss"],
        "controller": {"replan": planner.get("replan") is not None,
                       "ratio": (planner.get("report") or {}).get("ratio"),
                       "hybrid_active": pool.get("hybrid_active"), "joins": pool.get("joins"),
                       "releases": pool.get("releases"), "rollbacks": pool.get("rollbacks")},
    }  # fmt: skip
    return flatten("", picked)


class RunFolder:
    def __init__(self, path: Path, t0: float, curves: CurveOptions | None = None):
        self.path = path
        self.curves = Curves(path, curves or CurveOptions(), name=path.name)
        self.timeline = Timeline(t0)
        self.records: list[dict] = []
        self.unfinished = 0  # trajectories still generating when the run ended
        self.interrupted = False  # stopped by an interrupt before its last step
        self.warmstart: WarmStartRecord | None = None
        self.base: dict | None = None  # the model's success before any training (task.base_eval)
        self.held_out: list[dict] = []  # the same problems' success after steps (task.eval_every, the last)

    def save_trajectories(self, step: int, groups) -> None:
        """Every trained trajectory of the step, turn by turn, as the engines reported it."""
        with open(self.path / "trajectories.jsonl", "a") as f:
            for g in groups:
                for t in g.group.trajs:
                    turns = [{"prompt_ids": x.prompt_ids, "token_ids": x.token_ids, "logprobs": x.logprobs,
                              "weight_versions": x.weight_versions, "kv_versions": x.kv_versions or x.weight_versions,
                              "forced": [int(f) for f in x.forced or [False] * len(x.token_ids)],
                              "bucket": x.bucket, "instance": x.instance}
                             for x in t.turns]  # fmt: skip
                    f.write(json.dumps({"step": step, "id": t.id, "batch": t.batch, "reward": t.reward, "turns": turns}) + "\n")  # fmt: skip

    def load_previous(self, upto: int) -> None:
        """On --resume: keep the steps before the checkpoint's."""
        f = self.path / "steps.json"
        if f.exists():
            self.records = [r for r in json.loads(f.read_text()) if r["step"] < upto]

    def record(self, rec: StepRecord) -> None:
        self.records.append(rec.as_dict())
        self._write("steps.json", self.records)
        self.curves.log(rec.step, curve_scalars(self.records[-1]))

    def _write(self, name: str, obj: object) -> None:
        tmp = self.path / (name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=1) + "\n")
        tmp.replace(self.path / name)

    def finish(self, metrics_text: bytes | None) -> dict:
        self.curves.close()
        ws = asdict(self.warmstart) if self.warmstart is not None else None
        summary = {**summarize(self.records), "unfinished": self.unfinished, "interrupted": self.interrupted,
                   "warmstart": ws, "base_success": self.base, "held_out": self.held_out}  # fmt: skip
        self._write("summary.json", summary)
        self._write("trace.json", self.timeline.chrome())
        if metrics_text is not None:
            (self.path / "metrics.prom").write_bytes(metrics_text)
        if self.records:
            plot(self.records, self.path / "reward.png")
        return summary


def plot(records: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(steps, [r["success"] for r in records], ".", alpha=0.4, label="success (step)")
    a.plot(steps, moving([r["success"] for r in records]), "-", label=f"success ({MOVING}-step mean)")
    a.plot(steps, moving([r["reward"] for r in records]), "--", label="reward (mean)")
    a.set(
        xlabel="step", ylabel="fraction of trajectories", ylim=(-0.02, 1.02), title="libra train: calc task"
    )
    a.legend(loc="lower right")
    parts = [
        ("rollout_wait_s", "waiting for rollouts"),
        ("train_s", "train"),
        ("publish_s", "publish weights"),
    ]
    bottom = [0.0] * len(records)
    for key, label in parts:
        vals = [r[key] for r in records]
        b.bar(steps, vals, bottom=bottom, label=label, width=1.0)
        bottom = [x + y for x, y in zip(bottom, vals, strict=True)]
    if any(r.get("elastic") for r in records):
        _plot_pool(b, records)
    b.set(xlabel="step", ylabel="seconds", title="step time")
    b.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


POOL_MARKS = {"joins": ("borrow", "tab:purple", "--"), "releases": ("released", "tab:green", "-"),
              "rollbacks": ("rollback", "tab:red", ":")}  # fmt: skip


def _plot_pool(ax, records: list[dict]) -> None:
    """The hybrid pool on the step-time split: shaded where a borrowed replica counted (with how
    many), a line where a borrow started, a replica came back to rollout, or one was rolled back."""
    shown = False
    for r in records:
        n = (r.get("elastic") or {}).get("hybrid_active", 0)
        if n:
            ax.axvspan(r["step"] - 0.5, r["step"] + 0.5, color="gold", alpha=0.25, zorder=0,
                       label=None if shown else "hybrid replica counted")  # fmt: skip
            ax.annotate(f"+{n}", (r["step"], 0), ha="center", va="bottom", fontsize="x-small")
            shown = True
    for key, steps in pool_changes(records).items():
        label, color, style = POOL_MARKS[key]
        for k, step in enumerate(steps):
            ax.axvline(step + 0.5, color=color, linestyle=style, label=None if k else label)
