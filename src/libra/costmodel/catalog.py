"""The hardware and model catalog.

Shipped profiles live in `data/*.yaml`; users add their own with YAML files of the same shape,
named by `--catalog FILE` or the `LIBRA_CATALOG` environment variable (paths separated by ':').
A user entry with a shipped name replaces it. Unknown names fail with the list of known ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from libra.core.config import build, load_yaml
from libra.core.errors import ConfigError
from libra.core.specs import HardwareSpec, ModelSpec

_DATA = Path(__file__).parent / "data"


@dataclass
class Catalog:
    hardware_specs: dict[str, HardwareSpec] = field(default_factory=dict)
    model_specs: dict[str, ModelSpec] = field(default_factory=dict)

    def hardware(self, name: str, field_name: str = "hardware") -> HardwareSpec:
        if name not in self.hardware_specs:
            raise ConfigError(field_name, name, self.hardware_specs.keys())
        return self.hardware_specs[name]

    def model(self, name: str, field_name: str = "model") -> ModelSpec:
        if name not in self.model_specs:
            raise ConfigError(field_name, name, self.model_specs.keys())
        return self.model_specs[name]

    def add_file(self, path: str | Path) -> None:
        data = load_yaml(path)
        unknown = set(data) - {"hardware", "models"}
        if unknown:
            raise ConfigError(f"{path}: {sorted(unknown)[0]}", data[sorted(unknown)[0]], "hardware, models")
        for i, rec in enumerate(_as_list(data.get("hardware"), f"{path}: hardware")):
            spec = build(HardwareSpec, rec, f"{path}: hardware[{i}]")
            self.hardware_specs[spec.name] = spec
        for i, rec in enumerate(_as_list(data.get("models"), f"{path}: models")):
            spec = build(ModelSpec, rec, f"{path}: models[{i}]")
            self.model_specs[spec.name] = spec


def _as_list(value: object, field_name: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(field_name, type(value).__name__, "a YAML list of entries")
    return value


_DEFAULT: Catalog | None = None


def load_catalog(extra: list[str] | tuple[str, ...] = ()) -> Catalog:
    """The shipped catalog plus `LIBRA_CATALOG` files plus `extra` files, later ones winning."""
    global _DEFAULT
    if _DEFAULT is None:
        cat = Catalog()
        cat.add_file(_DATA / "hardware.yaml")
        cat.add_file(_DATA / "models.yaml")
        _DEFAULT = cat
    paths = [p for p in os.environ.get("LIBRA_CATALOG", "").split(":") if p] + list(extra)
    if not paths:
        return _DEFAULT
    cat = Catalog(dict(_DEFAULT.hardware_specs), dict(_DEFAULT.model_specs))
    for p in paths:
        cat.add_file(p)
    return cat
