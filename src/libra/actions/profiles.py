"""Efficiency profiles: how much faster an action runs with more units of its key resource.

duration(m) = T1 / (E(m) * m), where T1 is the duration on one unit and 0 < E(m) <= 1. E comes
from measurements (a test suite run with 1, 2, 4 ... workers; a reward model prefilled at TP 1, 2,
4, 8), given as points; between points it is interpolated linearly, and beyond the largest point
the speed-up stays flat, because extrapolating a measured curve upward would promise speed nobody
saw. An action whose elasticity is unknown has no profile and always gets its minimum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from libra.core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EfficiencyProfile:
    """Measured parallel efficiency E(m) at a few unit counts m (E(1) is usually 1)."""

    name: str
    points: tuple[tuple[float, float], ...]
    source: str = ""
    _cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        pts = tuple(sorted((float(m), float(e)) for m, e in self.points))
        if not pts:
            raise ConfigError(f"profiles.{self.name}", self.points, "at least one (units, efficiency) point")
        for m, e in pts:
            _check_point(f"profiles.{self.name}.{m:g}", m, e)
        object.__setattr__(self, "points", pts)

    @classmethod
    def from_mapping(
        cls, name: str, data: Mapping, source: str = "", field: str | None = None
    ) -> EfficiencyProfile:
        field = field or f"profiles.{name}"
        if not isinstance(data, Mapping) or not data:
            raise ConfigError(field, data, "a mapping of units -> efficiency, e.g. {1: 1.0, 4: 0.85}")
        pts = []
        for m, e in data.items():
            try:
                point = (float(m), float(e))
            except (TypeError, ValueError):
                raise ConfigError(f"{field}.{m}", e, "numbers: units -> efficiency") from None
            _check_point(f"{field}.{m}", *point)  # here, so the error names the caller's field
            pts.append(point)
        return cls(name, tuple(pts), source)

    @classmethod
    def amdahl(cls, name: str, serial: float, units: tuple[int, ...], source: str = "") -> EfficiencyProfile:
        """E(m) = 1 / (1 + s (m - 1)): a fixed serial share s (setup, collection, merge)."""
        if not 0 <= serial < 1:
            raise ConfigError(f"profiles.{name}.serial", serial, "0 <= serial < 1")
        return cls(name, tuple((m, 1.0 / (1.0 + serial * (m - 1))) for m in units), source)

    def efficiency(self, m: float) -> float:
        pts = self.points
        if m <= pts[0][0]:
            return pts[0][1]
        if m >= pts[-1][0]:
            last_m, last_e = pts[-1]
            return last_e * last_m / m  # flat speed-up past the last measurement
        for (m0, e0), (m1, e1) in zip(pts, pts[1:], strict=False):
            if m <= m1:
                return e0 + (e1 - e0) * (m - m0) / (m1 - m0)
        raise AssertionError("unreachable")

    def speedup(self, m: float) -> float:
        """E(m) * m, cached: the scheduler asks for the same few m millions of times."""
        s = self._cache.get(m)
        if s is None:
            s = self._cache[m] = self.efficiency(m) * m
        return s

    def duration(self, t1: float, m: float) -> float:
        return t1 / self.speedup(m)


def _check_point(field: str, units: float, efficiency: float) -> None:
    if units <= 0 or not 0 < efficiency <= 1:
        raise ConfigError(field, efficiency, "units > 0 and 0 < efficiency <= 1")


def load_profiles(data: Mapping | None, field_name: str = "profiles") -> dict[str, EfficiencyProfile]:
    """`{name: {units: efficiency, ...}}` or `{name: {amdahl: s, units: [...]}}` from YAML."""
    return {name: load_profile(name, spec, f"{field_name}.{name}") for name, spec in (data or {}).items()}


def load_profile(name: str, spec: object, field: str) -> EfficiencyProfile:
    """One profile: `{units: efficiency, ...}`, `{points: {...}}` or `{amdahl: s, units: [...]}`."""
    if isinstance(spec, Mapping) and "amdahl" in spec:
        serial, units = _amdahl_spec(field, spec)
        return EfficiencyProfile.amdahl(name, serial, units, str(spec.get("source", "")))
    if isinstance(spec, Mapping) and "points" in spec:
        source = str(spec.get("source", ""))
        return EfficiencyProfile.from_mapping(name, spec["points"], source, f"{field}.points")
    return EfficiencyProfile.from_mapping(name, spec, field=field)  # type: ignore[arg-type]  # it checks


def _amdahl_spec(field: str, spec: Mapping) -> tuple[float, tuple[int, ...]]:
    """The serial share and the unit counts of `{amdahl: s, units: [...]}`, checked."""
    serial = spec["amdahl"]
    if isinstance(serial, bool) or not isinstance(serial, (int, float)) or not 0 <= serial < 1:
        raise ConfigError(f"{field}.amdahl", serial, "a number: the serial share, 0 <= s < 1")
    units = spec.get("units", (1, 2, 4, 8, 16))
    if (
        not isinstance(units, (list, tuple))
        or not units
        or not all(isinstance(m, int) and not isinstance(m, bool) and m > 0 for m in units)
    ):
        raise ConfigError(f"{field}.units", units, "a non-empty list of positive unit counts, e.g. [1, 2, 4]")
    return float(serial), tuple(units)


def lookup(
    profiles: Mapping[str, EfficiencyProfile], name: str | None, field: str
) -> EfficiencyProfile | None:
    """`None` means unknown elasticity (the action runs at its minimum)."""
    if name is None:
        return None
    if name not in profiles:
        raise ConfigError(field, name, sorted(profiles) or ["a profile defined under `profiles`"])
    return profiles[name]
