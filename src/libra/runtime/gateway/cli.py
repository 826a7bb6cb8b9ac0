"""`libra serve gateway`: the OpenAI-compatible gateway that routes with C-MLFQ.

Configuration comes from a YAML file (`--config`), the command line, or both; command-line
options win over the file, and `--set key=value` overrides win over everything. Everything is
validated into `GatewayConfig`, and the router is built, before the port is bound and before
anything is served, so a bad value is one line naming it and exit code 2.

Example, in front of two built-in engines (one per bucket), with no file:

    libra serve gateway --port 8000 \\
        --backend http://127.0.0.1:8101,bucket=short,tp=1,max_context=4096 \\
        --backend http://127.0.0.1:8102,bucket=long,tp=2,max_context=8192
"""

from __future__ import annotations

import click

from libra.commands.common import set_option_for
from libra.core.config import apply_overrides, load_yaml
from libra.core.errors import ConfigError
from libra.runtime.gateway.config import BACKEND_SPEC, backend_from_spec, load_gateway_config


@click.command("gateway")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None, help="Gateway YAML (see docs/gateway.md).")  # fmt: skip
@click.option("--host", default=None, help="Address to bind [default: 127.0.0.1].")
@click.option("--port", type=click.IntRange(0, 65535), default=None, help="Port; 0 picks a free one (printed at start) [default: 8000].")  # fmt: skip
@click.option("--backend", "backends", multiple=True, metavar=BACKEND_SPEC, help="An OpenAI-compatible backend (repeatable); adds to the file's backends.")  # fmt: skip
@click.option(
    "--router", default=None, help="Router: a registered name or pkg.module:Class [default: cmlfq]."
)
@click.option("--tree-path", default=None, type=click.Path(dir_okay=False), help="Causal tree file: loaded at start, saved periodically and at shutdown.")  # fmt: skip
@set_option_for("health.interval_s=2")
@click.option("--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]))  # fmt: skip
@click.option("--access-log", is_flag=True, help="Log every HTTP request.")
def gateway(config_path, host, port, backends, router, tree_path, overrides, log_level, access_log) -> None:
    """OpenAI-compatible gateway: routes every turn of every session with a Libra router
    (C-MLFQ by default) across vLLM, SGLang or built-in engine instances."""
    data = load_yaml(config_path) if config_path else {}
    for key, value in (("host", host), ("port", port), ("router", router), ("tree_path", tree_path)):
        if value is not None:
            data[key] = value
    if backends:
        listed = data.get("backends") or []
        if not isinstance(listed, list):
            raise ConfigError("backends", listed, "a list of backends")
        data["backends"] = listed + [backend_from_spec(s) for s in backends]
    cfg = load_gateway_config(apply_overrides(data, list(overrides)))

    from libra.rollout.registry import make_router

    try:
        rt = make_router(cfg.router, cfg.bucket_list(), cost=_coster(cfg), seed=cfg.seed, **cfg.router_params)
    except ConfigError as e:  # the registry names simulator fields (rollout.router); name ours
        raise ConfigError(e.field.removeprefix("rollout."), e.value, e.allowed) from None
    import logging

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from libra.runtime.gateway.server import Gateway, bind, serve

    gw = Gateway(cfg, rt)  # loads the tree: a bad tree file fails here, before the port is taken
    serve(gw, bind(cfg.host, cfg.port), access_log)


def _coster(cfg):
    """The cost model of each bucket's engines, when the config says what they serve on."""
    if cfg.cost_model is None:
        return None
    from libra.costmodel.catalog import load_catalog
    from libra.costmodel.rollout import RolloutCostModel
    from libra.rollout.placement import CostModelCoster

    cat = load_catalog()
    hw = cat.hardware(cfg.cost_model.hardware, "cost_model.hardware")
    model = cat.model(cfg.cost_model.model, "cost_model.model")
    return CostModelCoster([RolloutCostModel(hw, model, b.tp) for b in cfg.bucket_list()])
