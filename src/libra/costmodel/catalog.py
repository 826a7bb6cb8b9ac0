"""The hardware and model catalog.

Shipped profiles live in `data/*.yaml`; users add their own with YAML files of the same shape,
named by `--catalog FILE` or the `LIBRA_CATALOG` environment variable (paths separated by ':').
A user entry with a shipped name replaces it. Unknown names fail with the list of known ones.
"""

from __future__ import annotations

import os
import re
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

    def resolve_model(self, wanted: str, field_name: str = "model") -> tuple[str, str]:
        """The catalog model a Hugging Face style name means, and the weight dtype its suffix notes.

        Case-insensitive; the org prefix (`Qwen/`) and common suffixes (`-Instruct`,
        `-Instruct-2507`, `-Base`, `-FP8`, ...) are dropped, and the name is matched against each
        entry's name and its `source`. `-FP8` is returned as the dtype ("" otherwise); an unknown
        name is an error listing the catalog's names."""
        key, dtype = _model_key(wanted)
        for name, spec in self.model_specs.items():
            keys = {_model_key(name)[0], _model_key(spec.source)[0]} if spec.source else {_model_key(name)[0]}
            if key in keys or key.replace("-", "") in {k.replace("-", "") for k in keys}:
                return name, dtype
        raise ConfigError(field_name, wanted, self.model_specs.keys())

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


_SUFFIX = re.compile(r"-(instruct|chat|base|hf|it|fp8|bf16|\d{4})$")


def _model_key(name: str) -> tuple[str, str]:
    """Lower case, no org prefix, '_' as '-', common suffixes dropped; and 'fp8' if one was -FP8."""
    key = name.strip().rsplit("/", 1)[-1].lower().replace("_", "-")
    dtype = ""
    while (m := _SUFFIX.search(key)) is not None:
        dtype = "fp8" if m.group(1) == "fp8" else dtype
        key = key[: m.start()]
    return key, dtype


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
