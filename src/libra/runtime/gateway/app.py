"""Build a running gateway from its validated config: the router, the cost model, the server.

The CLI only parses arguments into a `GatewayConfig`; everything that turns that config into live
objects is here, so a test or a launcher can start the very same gateway without the CLI.
"""

from __future__ import annotations

import logging

from libra.core.errors import ConfigError
from libra.runtime.gateway.config import GatewayConfig


def build_router(cfg: GatewayConfig):
    """The router the config names, priced by the cost model when the config gives one. Errors
    name the gateway's fields (`router_params.x`), not the simulator's (`rollout.router_params.x`)."""
    from libra.rollout.registry import make_router

    try:
        return make_router(
            cfg.router, cfg.bucket_list(), cost=coster(cfg), seed=cfg.seed, **cfg.router_params
        )
    except ConfigError as e:
        raise ConfigError(e.field.removeprefix("rollout."), e.value, e.allowed) from None


def coster(cfg: GatewayConfig):
    """The cost model of each bucket's engines, when the config says what they serve on."""
    if cfg.cost_model is None:
        return None
    from libra.costmodel.catalog import load_catalog
    from libra.costmodel.rollout import RolloutCostModel
    from libra.rollout.placement import CostModelCoster

    cat = load_catalog()
    hw = cat.hardware(cfg.cost_model.hardware, "cost_model.hardware")
    model = cat.model(cfg.cost_model.model, "cost_model.model")
    engine = cfg.cost_model.engine
    return CostModelCoster([RolloutCostModel(hw, model, b.tp, engine=engine) for b in cfg.bucket_list()])


def run(cfg: GatewayConfig, log_level: str = "info", access_log: bool = False) -> None:
    """Validate everything that can fail (router, tree file, port), then serve until a signal."""
    router = build_router(cfg)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from libra.runtime.gateway.server import Gateway, serve
    from libra.runtime.serving import bind

    gw = Gateway(cfg, router)  # loads the tree: a bad tree file fails here, before the port is taken
    serve(gw, bind(cfg.host, cfg.port), access_log)
