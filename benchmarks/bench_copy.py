"""Which copies a warm-start has learned: per digit of the tool's result, how likely the answer
copies it, by the result's shape.

    python benchmarks/bench_copy.py --warm-cache DIR [--seeds 0-9] [--set KEY=VALUE ...]

For each seed, loads the warm-start that `bench_learning.py --warm-cache DIR` keeps for the same
config, and renders 400 held-out correct episodes (problems neither the warm-start nor RL draws).
Teacher-forced (one forward pass), each answer token's probability is averaged per result shape
and position: `pos2[0]` is the first digit of a positive two-digit result, `neg2[1]` the first
digit of a negative one (after its "-"). Why: GRPO fixes a copy the warm-start half learned, but
not one it never formed (docs/train.md, "Why 4 heads left seed 7 below 0.8"), and the overall
probe does not tell which copies formed. Prints one JSON object per seed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_learning import seeds_of, warm_file  # noqa: E402
from libra.runtime.engine.tokenizer import encode  # noqa: E402
from libra.runtime.train.batch import TrainSample, pad  # noqa: E402
from libra.runtime.train.config import load_train_config  # noqa: E402
from libra.runtime.train.models import train_model  # noqa: E402
from libra.runtime.train.task import ProblemStream, call_id, demonstration  # noqa: E402

EPISODES = 400
STREAM = 777  # added to the seed: a stream the warm-start (seed + 1) and the probe do not draw


def copy_probabilities(model: torch.nn.Module, task, seed: int, n: int = EPISODES) -> dict[str, float]:
    """Mean probability of each answer token given a correct episode before it, by result shape."""
    rng, stream = random.Random(seed), ProblemStream(seed + STREAM, task.lo, task.hi, task.ops)
    problems = [stream.next() for _ in range(n)]
    episodes = [demonstration(p, call_id(rng))[0] for p in problems]
    b = pad([TrainSample(ids=ids, mask=[1] * len(ids), logprobs=[0.0] * len(ids)) for ids in episodes])
    model.eval()
    with torch.no_grad():
        lp = torch.log_softmax(model.forward_train(b.tokens[:, :-1]).double(), -1)
    by: dict[str, list[float]] = defaultdict(list)
    for i, (p, ids) in enumerate(zip(problems, episodes, strict=True)):
        answer = p.answer
        shape = ("neg" if answer.startswith("-") else "pos") + str(len(answer.lstrip("-")))
        first = len(ids) - len(encode(answer)) - 1  # the answer's tokens, then END
        for j in range(len(answer)):
            by[f"{shape}[{j}]"].append(float(lp[i, first + j - 1, ids[first + j]].exp()))
    return {k: round(sum(v) / len(v), 3) for k, v in sorted(by.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm-cache", required=True)
    ap.add_argument("--seeds", default="0-9")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    a = ap.parse_args()
    torch.set_num_threads(1)
    for seed in seeds_of(a.seeds):
        cfg = load_train_config(None, [f"seed={seed}", *a.overrides])
        path = warm_file(a.warm_cache, cfg)
        if path is None or not path.exists():
            print(json.dumps({"seed": seed, "error": f"no warm-start {path}"}), flush=True)
            continue
        saved = torch.load(path, map_location="cpu", weights_only=True)
        model = train_model(cfg, seed)
        model.load_state_dict({k: v.float() for k, v in saved["model"].items()}, strict=True)
        steps, probe = saved["probes"][-1] if saved["probes"] else (len(saved["losses"]), None)
        out = {"seed": seed, "model": cfg.engine.model, "warmstart_steps": steps, "probe": probe}
        print(json.dumps({**out, "copy": copy_probabilities(model, cfg.task, seed)}), flush=True)


if __name__ == "__main__":
    main()
