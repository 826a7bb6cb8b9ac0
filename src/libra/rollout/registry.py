"""The router registry: short names to router classes, and `make_router` to build one.

The simulator's `router:NAME` / `planned:NAME` systems (with the scenario's
`rollout.router_params`) and the live gateway (its `router` and `router_params`) both build their
router here. A dotted path `pkg.mod:Class` plugs in an outside router with the same constructor:
`Class(buckets, cost=None, seed=0, **params)`.
"""

from __future__ import annotations

from collections.abc import Sequence

from libra.core.errors import ConfigError
from libra.core.registry import Registry
from libra.rollout.base import Bucket, MigrationCoster, Router
from libra.rollout.cmlfq import PaperCMLFQRouter
from libra.rollout.peers import GroupRoundRobinRouter, HeddleRouter, SeerRouter
from libra.rollout.robust import ContextPriorRouter, RobustCMLFQRouter
from libra.rollout.routers import (
    PARAMS_FIELD,
    ClassicMLFQRouter,
    LeastLoadedRouter,
    LengthPredictorRouter,
    OracleRouter,
    RoundRobinRouter,
)

ROUTERS: Registry[type] = Registry(
    "router",
    "rollout.router",
    (
        RobustCMLFQRouter,
        PaperCMLFQRouter,
        ClassicMLFQRouter,
        LengthPredictorRouter,
        LeastLoadedRouter,
        RoundRobinRouter,
        OracleRouter,
        ContextPriorRouter,
        GroupRoundRobinRouter,
        SeerRouter,
        HeddleRouter,
    ),
)


def router_class(name: str) -> type:
    """A registered router class, or outside code as `package.module:Class`."""
    return ROUTERS.get_entry(name)


def _fields(name: str) -> dict | None:
    """The param names router `name` takes; None for an outside router without a pydantic Params."""
    return getattr(getattr(router_class(name), "Params", None), "model_fields", None)


def params_for(name: str, params: dict) -> dict:
    """The entries of one shared `rollout.router_params` that router `name` has.

    A run holds several routers on one set of params, so each takes those it has (`move_cost` is
    cmlfq's, `spill` every bucket router's). A name that neither this router nor a registered one
    has is an error listing those there are (so a param only an outside router knows cannot share a
    run with registered routers). An outside router without a pydantic `Params` gets them all.
    """
    fields = _fields(name)
    if fields is None:
        return dict(params)
    known = set(fields).union(*(cls.Params.model_fields for cls in ROUTERS.values()))
    _check_known(params, known, PARAMS_FIELD + ".")
    return {k: v for k, v in params.items() if k.split(".")[0] in fields}


def route_params(names: Sequence[str], params: dict, prefix: str = PARAMS_FIELD + ".") -> dict[str, dict]:
    """`params_for` each router of a run, after checking that some router of the run has each param:
    one that none of them has would do nothing, so it is an error listing what they do have."""
    fields = {n: _fields(n) for n in names}
    if all(f is not None for f in fields.values()):
        _check_known(params, set().union(*fields.values()), prefix)
    return {n: params_for(n, params) for n in fields}


def _check_known(params: dict, known: set, prefix: str) -> None:
    """A ConfigError for the first param (by its top-level name) not in `known`, listing those."""
    for key, value in params.items():
        if key.split(".")[0] not in known:
            raise ConfigError(
                f"{prefix}{key}", value, sorted(known) if known else "no param: these routers take none"
            )


def make_router(
    name: str,
    buckets: Sequence[Bucket],
    cost: MigrationCoster | None = None,
    seed: int = 0,
    **params,
) -> Router:
    """Build the router `name` (a registered name or `pkg.mod:Class`) with validated params."""
    cls = router_class(name)
    if not isinstance(cls, type) or not all(hasattr(cls, m) for m in ("route", "on_finish", "on_step_end")):
        raise ConfigError("rollout.router", name, "a class with route, on_finish and on_step_end")
    try:
        router = cls(buckets, cost=cost, seed=seed, **params)
    except TypeError as e:  # an outside class with another constructor
        raise ConfigError(
            "rollout.router", name, f"a class taking (buckets, cost, seed, **params): {e}"
        ) from None
    if not isinstance(router, Router):  # e.g. no `name` attribute
        raise ConfigError("rollout.router", name, "a Router (name, route, on_finish, on_step_end)")
    return router
