"""Configuration: YAML files and dotted overrides, validated into typed models.

YAML is only a serialisation of pydantic models. `--set a.b=c` edits one value before validation,
and the value is parsed as YAML, so `--set split.train_gpus=32` gives an int and `--set x=[1,2]` a list.
Validation errors become one `ConfigError` line naming the field, the value and what is allowed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from libra.core.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


MAX_TEXT_FILE = 64 << 20  # a config or catalog this large is a wrong path, not a config


def regular_file(p: Path) -> os.stat_result:
    """`p`'s stat, checked before anything opens it (opening a FIFO waits for a writer, and a device
    such as /dev/zero reads forever). ValueError unless it is a regular file; OSError if missing."""
    st = os.stat(p)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    return st


def read_text_file(p: Path, limit: int = MAX_TEXT_FILE) -> str:
    """A regular UTF-8 file's text (`regular_file`). ValueError for a file over `limit` bytes or
    bytes that are not UTF-8, as for a special file; OSError when it cannot be opened."""
    st = regular_file(p)
    if st.st_size > limit:
        raise ValueError(f"{st.st_size >> 20} MiB; at most {limit >> 20} MiB")
    data = p.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text: byte {e.start} is 0x{data[e.start]:02x}") from None


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    try:
        text = read_text_file(p)
    except OSError as e:
        raise ConfigError("config", str(p), f"a readable YAML file ({e.strerror})") from None
    except ValueError as e:  # not UTF-8, or not a regular file
        raise ConfigError("config", str(p), f"a YAML text file ({e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise ConfigError("config", where, f"well-formed YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", str(p), "a YAML mapping at the top level")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError("--set", text, "KEY=VALUE with a dotted KEY, e.g. split.train_gpus=32")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of `data` with each `a.b.c=value` applied, creating mappings as needed."""
    import copy

    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(
                    "--set", text, f"a path through mappings; {part!r} is a {type(nxt).__name__}"
                )
            node = nxt
        node[path[-1]] = value
    return out


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names a model accepts at a validation-error location (walks nested models)."""
    node: type[BaseModel] = model
    for part in loc[:-1]:
        field = node.model_fields.get(str(part)) if isinstance(part, str) else None
        ann = getattr(field, "annotation", None) if field else None
        args = getattr(ann, "__args__", ())
        nested = next((a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if nested is not None:
            node = nested
    return sorted(node.model_fields)


def _first_error(err: ValidationError, prefix: str, model: type[BaseModel]) -> ConfigError:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e.get("loc", ()) if p != "__root__")
    field = f"{prefix}.{loc}" if prefix and loc else (loc or prefix or "config")
    if e.get("type") == "extra_forbidden":  # an unknown name: say which names there are
        names = _fields_at(model, tuple(e["loc"]))
        return ConfigError(field, e.get("input"), names or "nothing: no settings here")
    return ConfigError(field, e.get("input"), e.get("msg", "invalid").removeprefix("Value error, "))


def build(model: type[M], data: dict, prefix: str = "") -> M:
    """Validate `data` into `model`, turning the first problem into a one-line ConfigError."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise _first_error(err, prefix, model) from None


def load_model(
    model: type[M], path: str | Path | None, overrides: list[str] = (), base: dict | None = None
) -> M:
    data = dict(base or {})
    if path is not None:
        data.update(load_yaml(path))
    return build(model, apply_overrides(data, list(overrides)))
