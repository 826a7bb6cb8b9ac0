"""`libra route eval`: score routers offline on a trajectory trace.

The offline evaluator (`libra.rollout.evaluate`) as a command, so routing quality on a real trace
can be checked without the simulator: accuracy at tool returns, migrations and the migrated-token
ratio, one row per router, as a table or JSON. Errors are one line naming the field and exit 2.
"""

from __future__ import annotations

import click

from libra.core.errors import ConfigError
from libra.rollout.base import Bucket


def parse_buckets(text: str) -> list[Bucket]:
    """'4096,6144,16384' -> buckets short/medium/long... with TP 1, 2, 4, 8 by position."""
    try:
        limits = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(
            "--buckets", text, "comma-separated max_context values, e.g. 4096,12288,40960"
        ) from None
    names = ["short", "medium", "long", "xlong", "xxlong"]
    if not limits or len(limits) > len(names):
        raise ConfigError("--buckets", text, f"1 to {len(names)} comma-separated max_context values")
    return [Bucket(names[i], 2**i, c) for i, c in enumerate(limits)]


@click.group()
def route() -> None:
    """Rollout routing tools."""


@route.command("eval")
@click.option("--trace", "trace_path", required=True, type=click.Path(dir_okay=False), help="JSONL trace.")
@click.option("--buckets", default="4096,12288,40960", show_default=True, help="Bucket max_context values.")
@click.option(
    "--routers",
    default="cmlfq,cmlfq-paper,context-prior,classic-mlfq,length-predictor,oracle",
    show_default=True,
    help="Comma-separated router names.",
)
@click.option(
    "--order",
    type=click.Choice(["step", "interleaved"]),
    default="interleaved",
    show_default=True,
    help="Replay steps in lockstep, or on a token clock with feedback as each trajectory ends.",
)
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Router param, e.g. move_cost=0.2."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def eval_cmd(trace_path, buckets, routers, order, overrides, as_json) -> None:
    """Replay TRACE through each router and report routing accuracy and migrations."""
    rows = run_eval(trace_path, buckets, routers, order, overrides)
    if as_json:
        from libra.cli.common import emit_json

        emit_json(rows)
        return
    from libra.cli.common import console, table

    cols = ["router", "accuracy", "migrations", "migrated_token_ratio", "decisions"]
    console.print(table(f"routing on {trace_path} ({order})", cols, [[r[c] for c in cols] for r in rows]))


def run_eval(trace_path: str, buckets: str, routers: str, order: str, overrides=()) -> list[dict]:
    from libra.core.config import parse_override
    from libra.core.trace import read_trace
    from libra.rollout.evaluate import evaluate
    from libra.rollout.registry import make_router, route_params

    bks = parse_buckets(buckets)
    names = [r.strip() for r in routers.split(",") if r.strip()]
    if not names:
        raise ConfigError("--routers", routers, "one or more router names, comma-separated")
    params: dict = {}
    for text in overrides:
        path, value = parse_override(text)
        params[".".join(path)] = value
    per_router = route_params(names, params, "--set ")
    trajs = read_trace(trace_path)
    out = []
    for name in names:
        res = evaluate(make_router(name, bks, **per_router[name]), trajs, bks, order=order)
        d = res.to_dict()
        d["router"] = name
        out.append(d)
    return out
