"""The workload interface: the scenario's `workload:` mapping, the `Workload` protocol, validation.

A workload family turns one RL step into trajectories (prompts x GRPO samples). The simulator
and the planner call only what is here, so a family is swappable by name in the scenario YAML.
Family parameters arrive as a free mapping (`workload.params`) and are validated by the family's
own pydantic model, so a typo is reported with the list of parameters that family accepts.
"""

from __future__ import annotations

import random
from typing import Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from libra.core.config import build
from libra.core.errors import ConfigError
from libra.core.trajectory import Trajectory

P = TypeVar("P", bound=BaseModel)


class WorkloadConfig(BaseModel):
    """The scenario's `workload:` mapping."""

    model_config = ConfigDict(extra="forbid")
    family: str = Field(description="Workload family: a registered name or 'package.module:Class'.")
    prompts_per_step: int = Field(32, ge=1, description="Prompts per RL step (GRPO groups).")
    samples_per_prompt: int = Field(16, ge=1, description="GRPO samples per prompt.")
    max_length: int = Field(40960, ge=256, description="Context limit in tokens; longer rollouts are cut.")
    params: dict = Field(default_factory=dict, description="Family parameters; see `libra trace params`.")


@runtime_checkable
class Workload(Protocol):
    """One family, configured. `generate` returns one RL step: prompts x samples trajectories."""

    def generate(self, step: int, rng: random.Random) -> list[Trajectory]: ...


def _allowed_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names a model accepts at a validation-error location (walks nested models/dicts)."""
    node: type[BaseModel] = model
    for part in loc[:-1]:
        field = node.model_fields.get(str(part)) if isinstance(part, str) else None
        ann = getattr(field, "annotation", None) if field else None
        args = getattr(ann, "__args__", ())
        nested = next((a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if nested is not None:
            node = nested
    return list(node.model_fields)


def validate_params(model: type[P], data: dict, prefix: str) -> P:
    """Validate family params; an unknown name is reported with the names that are allowed."""
    if not isinstance(data, dict):
        raise ConfigError(prefix, data, "a mapping of parameter names to values")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        if first.get("type") == "extra_forbidden":
            loc = tuple(first["loc"])
            field = ".".join([prefix, *map(str, loc)])
            raise ConfigError(field, first.get("input"), _allowed_at(model, loc)) from None
    return build(model, data, prefix)  # any other problem: the shared one-line field/value message
