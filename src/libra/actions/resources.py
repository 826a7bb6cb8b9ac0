"""Resource vectors: what one action may use of each resource type, as a feasible set per type.

ARL-Tangram describes an action's cost as a vector over resource types (cpu, gpu, memory,
gpu_memory and named API quotas), where each entry is not one number but the set of amounts the
action can run with: a range such as 1..16 cores, or a discrete set such as {1, 2, 4, 8} GPUs. The
scheduler picks one amount from each set; the elastic ("key") resource is where that choice changes
the action's duration. Keeping the set explicit, rather than a single request as Kubernetes does,
is what lets the scheduler trade parallelism of running actions against queueing of waiting ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from libra.core.errors import ConfigError

BASE_RESOURCES = ("cpu", "gpu", "memory", "gpu_memory")
QUOTA_PREFIX = "quota:"


def check_resource_name(name: str, field: str = "resource") -> str:
    """Known types, or `quota:NAME` for a named API quota (tokens per period and concurrency)."""
    if name in BASE_RESOURCES:
        return name
    if name.startswith(QUOTA_PREFIX) and len(name) > len(QUOTA_PREFIX):
        return name
    raise ConfigError(field, name, list(BASE_RESOURCES) + ["quota:NAME"])


@dataclass(frozen=True, slots=True)
class Range:
    """Every amount in [lo, hi], in steps of `step` (cores: step 1; memory in GiB: any step)."""

    lo: float
    hi: float
    step: float = 1

    def __post_init__(self) -> None:
        if not (0 <= self.lo <= self.hi) or self.step <= 0:
            raise ConfigError("feasible range", (self.lo, self.hi, self.step), "0 <= lo <= hi and step > 0")

    @property
    def min(self) -> float:
        return self.lo

    @property
    def max(self) -> float:
        return self.hi

    def __contains__(self, x: float) -> bool:
        if not self.lo <= x <= self.hi:
            return False
        k = (x - self.lo) / self.step
        return abs(k - round(k)) < 1e-9

    def values(self, cap: float = float("inf")) -> Iterator[float]:
        """Feasible amounts up to `cap`, ascending."""
        n = int((min(self.hi, cap) - self.lo) / self.step + 1e-9)
        for k in range(n + 1):
            yield self.lo + k * self.step


@dataclass(frozen=True, slots=True)
class Discrete:
    """An explicit set of amounts, e.g. the data-parallel degrees {1, 2, 4, 8} a service supports."""

    choices: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.choices or any(c < 0 for c in self.choices):
            raise ConfigError("feasible set", self.choices, "a non-empty set of amounts >= 0")
        object.__setattr__(self, "choices", tuple(sorted(set(self.choices))))

    @property
    def min(self) -> float:
        return self.choices[0]

    @property
    def max(self) -> float:
        return self.choices[-1]

    def __contains__(self, x: float) -> bool:
        return x in self.choices

    def values(self, cap: float = float("inf")) -> Iterator[float]:
        return (c for c in self.choices if c <= cap)


Feasible = Range | Discrete


def fixed(amount: float) -> Range:
    return Range(amount, amount)


def parse_feasible(value: object, field: str) -> Feasible:
    """YAML forms: `4` (fixed), `[1, 16]` (range), `{range: [1, 16]}`, `{set: [1, 2, 4, 8]}`."""
    if isinstance(value, Range | Discrete):
        return value
    if isinstance(value, bool):
        raise ConfigError(field, value, "a number, [lo, hi], {range: [lo, hi]} or {set: [...]}")
    if isinstance(value, int | float):
        return fixed(value)
    if isinstance(value, list | tuple) and len(value) == 2 and all(_num(v) for v in value):
        return _range(value, field)
    if isinstance(value, Mapping) and len(value) == 1:
        ((kind, arg),) = value.items()
        if (
            kind == "range"
            and isinstance(arg, list | tuple)
            and len(arg) in (2, 3)
            and all(_num(v) for v in arg)
        ):
            return _range(arg, field)
        if kind == "set" and isinstance(arg, list | tuple) and arg and all(_num(v) for v in arg):
            return _wrap(lambda: Discrete(tuple(arg)), field, arg)
    raise ConfigError(field, value, "a number, [lo, hi], {range: [lo, hi]} or {set: [...]}")


def _num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _range(arg, field: str) -> Range:
    return _wrap(lambda: Range(*arg), field, arg)


def _wrap(make, field: str, value: object):
    try:
        return make()
    except ConfigError as e:
        raise ConfigError(field, value, e.allowed) from None


@dataclass(frozen=True, slots=True)
class ResourceVector:
    """Feasible amounts per resource type. At most one entry is the elastic `key` resource."""

    entries: tuple[tuple[str, Feasible], ...]
    key: str | None = None

    @classmethod
    def of(cls, key: str | None = None, **amounts: object) -> ResourceVector:
        """Build from keywords; `quota_NAME=` stands for `quota:NAME` (not a Python identifier)."""
        items = {}
        for name, v in amounts.items():
            rname = QUOTA_PREFIX + name[len("quota_") :] if name.startswith("quota_") else name
            items[check_resource_name(rname)] = parse_feasible(v, rname)
        return cls.from_mapping(items, key)

    @classmethod
    def from_mapping(cls, items: Mapping[str, object], key: str | None = None) -> ResourceVector:
        entries = tuple((check_resource_name(n), parse_feasible(v, n)) for n, v in sorted(items.items()))
        if key is not None and key not in dict(entries):
            raise ConfigError("key", key, [n for n, _ in entries] or ["a resource listed in the vector"])
        return cls(entries, key)

    def get(self, name: str) -> Feasible | None:
        for n, f in self.entries:
            if n == name:
                return f
        return None

    def minimum(self, name: str) -> float:
        f = self.get(name)
        return 0.0 if f is None else f.min

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.entries)

    def quotas(self) -> tuple[tuple[str, float], ...]:
        """(quota name, tokens at the minimum) for each named quota this action draws on."""
        return tuple((n[len(QUOTA_PREFIX) :], f.min) for n, f in self.entries if n.startswith(QUOTA_PREFIX))
